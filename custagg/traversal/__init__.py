"""The `tf.gradients` drop-in: the backward pass itself.

  gradients         `custagg.gradients`: the arguments checked and converted,
                    the seeds, the results read off the pass
  backprop          the pass (`Backprop`): pending counts, the ready queue,
                    the per-output lists of incoming gradients, each op's step
  aggregation       how those lists are summed (`AggregationMethod`, CUSTOM:
                    the per-example weighted sum); no maths of any op
  slice_recognizer  which incoming gradients are rows of one batch (CUSTOM)
  op_gradients      the few gradient functions custagg runs itself

Imports go one way: `traversal` imports only TensorFlow and the shared
modules (`custagg._tf_compat`, `errors`, `sparse`); the per-example engine
and the optimizers build on it. See docs/architecture.md.
"""
