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


def to_numpy(value):
    """A fetched gradient as a dense ndarray (`IndexedSlicesValue` summed)."""
    if value is None:
        return None
    if hasattr(value, "indices") and hasattr(value, "values"):
        dense = np.zeros(value.dense_shape, dtype=value.values.dtype)
        np.add.at(dense, np.asarray(value.indices), value.values)
        return dense
    return np.asarray(value)


def numpy_norms(per_example):
    """`[B]` global L2 norms of aligned `[B, *x.shape]` arrays (None skipped)."""
    per_example = [g for g in per_example if g is not None]
    batch = per_example[0].shape[0]
    sq = sum(np.sum(np.square(g.reshape(batch, -1).astype(np.float64)),
                    axis=1) for g in per_example)
    return np.sqrt(sq)


def numpy_clipped(per_example, clip, per_x=False):
    """`sum_b min(1, C / ||g_b||) g_b` per x, from materialized gradients.

    Args:
      per_example: list of `[B, *x.shape]` arrays.
      clip: C (one global norm over all xs), or a list aligned with
        `per_example` when `per_x` (each x clipped by its own norm).

    Returns:
      (list of clipped sums, norms): norms are `[B]`, or a list of per-x
      `[B]` norms when `per_x`.
    """
    def factors(norms, c):
        return c / np.maximum(norms, c)

    if per_x:
        norms = [numpy_norms([g]) for g in per_example]
        sums = [np.tensordot(factors(n, c), g, axes=1)
                for g, n, c in zip(per_example, norms, clip)]
        return sums, norms
    norms = numpy_norms(per_example)
    f = factors(norms, clip)
    return [np.tensordot(f, g, axes=1) for g in per_example], norms


def numpy_second_moments(per_example):
    """`sum_b g_b ** 2` per x."""
    return [np.sum(np.square(g), axis=0) for g in per_example]


def assert_close(actual, desired, rtol, label="", scale=None):
    """`actual` (fetched; `IndexedSlicesValue` densified) equals `desired`
    to `rtol`, with an absolute floor of `rtol * scale` so entries that
    cancel to about zero are judged on the problem's scale (default: the
    array's own `max|desired|`; pass the model's gradient scale for arrays
    that are zero up to rounding, like an attention key bias)."""
    actual = to_numpy(actual)
    desired = np.asarray(desired)
    assert actual is not None, "%s: got None" % label
    assert actual.shape == desired.shape, "%s: shape %s, expected %s" % (
        label, actual.shape, desired.shape)
    if scale is None:
        scale = float(np.max(np.abs(desired))) if desired.size else 0.0
    np.testing.assert_allclose(actual, desired, rtol=rtol, atol=rtol * scale,
                               err_msg=label)
