"""Obviously-correct references for tests and checks.

`loop_per_example` is the reference every strategy and rule is compared
with: one `tf.compat.v1.gradients` (TensorFlow's own traversal, not
custagg's) per example, stacked. Slow (B backward passes, each through the
whole batch) but with nothing clever in it.
"""

import numpy as np
import tensorflow as tf


def loop_per_example(per_example_loss, xs, batch=None,
                     num_microbatches=None, rows=False):
    """`[B, *x.shape]` per x, from one `tf.compat.v1.gradients` per example.

    The one loop reference of the project: every strategy, form and rule is
    checked against it.

    Args:
      per_example_loss: `[B]` tensor.
      xs: list of variables/tensors.
      batch: how many examples to differentiate (a Python int). Default:
        the loss's static B. With a dynamic B, pass the largest batch you
        will feed; the result then has `batch` rows, and a feed of fewer
        examples fails at run time (slice the rows of a larger feed
        instead, for models that keep examples apart).
      num_microbatches: M (a Python int dividing `batch`), or None: with M,
        row m is the gradient of microbatch m's summed loss (examples
        `m*B/M ... (m+1)*B/M - 1`), `[M, *x.shape]`.
      rows: return the rows unstacked instead, a list (one entry per example
        or microbatch) of lists aligned with xs, so a caller with a dynamic
        B can fetch the first b of them for a feed of b examples.

    Returns:
      List aligned with xs of `[B, *x.shape]` (or `[M, *x.shape]`) tensors
      (zeros where the loss does not depend on x).
    """
    if batch is None:
        batch = tf.compat.dimension_value(per_example_loss.shape[0])
    if batch is None:
        raise ValueError("custagg.testing.loop_per_example needs a static "
                         "batch size; per_example_loss has shape %s. Pass "
                         "batch=<the largest batch you feed>."
                         % per_example_loss.shape)
    groups = num_microbatches or batch
    if batch % groups:
        raise ValueError("custagg.testing.loop_per_example: num_microbatches"
                         "=%d does not divide batch=%d." % (groups, batch))
    k = batch // groups
    xs = list(xs)
    out = []
    for i in range(groups):
        part = (per_example_loss[i] if k == 1 else
                tf.reduce_sum(per_example_loss[i * k:(i + 1) * k]))
        grads = tf.compat.v1.gradients(
            part, xs, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        out.append([tf.convert_to_tensor(g) for g in grads])
    if rows:
        return out
    return [tf.stack(list(col), axis=0) for col in zip(*out)]


def compare(actual, desired, rtol, label="", scale=None):
    """The one comparator: None when `actual` (fetched; `IndexedSlicesValue`
    densified) equals `desired` to `rtol`, else a message saying what
    differs. The absolute floor is `rtol * scale`, so entries that cancel to
    about zero are judged on the problem's scale (default: the array's own
    `max|desired|`; pass the model's gradient scale for arrays that are zero
    up to rounding, like an attention key bias)."""
    actual = to_numpy(actual)
    desired = np.asarray(desired)
    if actual is None:
        return "%s: got None" % label
    if actual.shape != desired.shape:
        return "%s: shape %s, expected %s" % (label, actual.shape,
                                              desired.shape)
    if scale is None:
        scale = float(np.max(np.abs(desired))) if desired.size else 0.0
    atol = rtol * max(scale, 1e-12)
    if not np.allclose(actual, desired, rtol=rtol, atol=atol):
        diff = np.abs(actual.astype(np.float64) - desired)
        return "%s: max |diff| %.3g at %s (scale %.3g, rtol %g)" % (
            label, float(np.max(diff)),
            np.unravel_index(int(np.argmax(diff)), diff.shape), scale, rtol)
    return None


def assert_close(actual, desired, rtol, label="", scale=None):
    """`compare`, raising AssertionError with its message."""
    why = compare(actual, desired, rtol, label, scale)
    assert why is None, why


def assert_allclose_list(actual, desired, rtol, atol=0.0, names=None):
    """`compare` over aligned lists, naming the entry; `atol` raises the
    absolute floor (the scale becomes at least `atol / rtol`)."""
    assert len(actual) == len(desired), (len(actual), len(desired))
    for j, (a, d) in enumerate(zip(actual, desired)):
        label = names[j] if names else "entry %d" % j
        d = np.asarray(d)
        scale = float(np.max(np.abs(d))) if d.size else 0.0
        if atol and rtol:
            scale = max(scale, atol / rtol)
        elif atol:
            np.testing.assert_allclose(np.asarray(to_numpy(a)), d, atol=atol,
                                       err_msg=label)
            continue
        assert_close(a, d, rtol, label, scale)


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


def waits_for_backward_pass(op):
    """Whether graph op `op` runs only after a backward pass: one of its
    inputs or control inputs, transitively, is an op under a
    `.../gradients/...` name scope (what `tf.compat.v1.gradients` and
    custagg's traversal build). For tests of ordering: a term built from
    forward values alone that does not wait runs in the forward pass and
    is held to the backward pass."""
    seen, stack = set(), [op]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if "/gradients/" in "/" + op.name and op.type != "Const":
            return True
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return False
