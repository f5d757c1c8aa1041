"""Training on custagg's gradients: optimizer wrappers and multi-worker steps.

  optimizers   `PerExampleOptimizer`, `WeightedOptimizer`, `ClippedOptimizer`,
               `DPOptimizer` (wrap any `tf.compat.v1.train` optimizer); public
               as `custagg.optimizers`
  distributed  DP optimizers on TF's distributed runtime; public as
               `custagg.distributed`

`optimizers` sits below `custagg.privacy` (TF Privacy's DP classes are
built on its helpers); `distributed` sits above it (it also wraps
`custagg.privacy.dp_optimizer`'s Gaussian-query classes). See
docs/architecture.md.
"""
