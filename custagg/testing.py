"""Obviously-correct references for tests and checks.

`loop_per_example` is the reference every strategy and rule is compared
with: one `tf.compat.v1.gradients` (TensorFlow's own traversal, not
custagg's) per example, stacked. Slow (B backward passes, each through the
whole batch) but with nothing clever in it.
"""

import numpy as np
import tensorflow as tf


def loop_per_example(per_example_loss, xs):
    """`[B, *x.shape]` per x, from one `tf.compat.v1.gradients` per example.

    Args:
      per_example_loss: `[B]` tensor with a static B.
      xs: list of variables/tensors.

    Returns:
      List aligned with xs of `[B, *x.shape]` tensors (zeros where the loss
      does not depend on x).
    """
    batch = tf.compat.dimension_value(per_example_loss.shape[0])
    if batch is None:
        raise ValueError("custagg.testing.loop_per_example needs a static "
                         "batch size; per_example_loss has shape %s."
                         % per_example_loss.shape)
    xs = list(xs)
    rows = []
    for i in range(batch):
        grads = tf.compat.v1.gradients(
            per_example_loss[i], xs,
            unconnected_gradients=tf.UnconnectedGradients.ZERO)
        rows.append([tf.convert_to_tensor(g) for g in grads])
    return [tf.stack(list(col), axis=0) for col in zip(*rows)]


def assert_allclose_list(actual, desired, rtol, atol=0.0, names=None):
    """np.testing.assert_allclose over aligned lists, naming the entry."""
    assert len(actual) == len(desired), (len(actual), len(desired))
    for j, (a, d) in enumerate(zip(actual, desired)):
        label = names[j] if names else "entry %d" % j
        np.testing.assert_allclose(np.asarray(a), np.asarray(d), rtol=rtol,
                                   atol=atol, err_msg=label)
