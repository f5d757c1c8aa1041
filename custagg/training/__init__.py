"""Training on custagg's gradients: the optimizer wrappers without DP.

  optimizers   `PerExampleOptimizer` (`sum_i g_i`), `WeightedOptimizer`
               (`sum_i f_i g_i`); wrap any `tf.compat.v1.train` optimizer

The DP wrappers (`DPOptimizer`, `ClippedOptimizer`) and multi-worker DP
training build on these in `custagg.privacy`; all are public as
`custagg.optimizers` and `custagg.distributed`. See docs/architecture.md.
"""
