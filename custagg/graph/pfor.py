"""`pfor` in passes: TF's vectorization over n iterations, run as a few
vectorized passes whose outputs fit a memory budget.

A graph utility with no per-example knowledge: the per-example forms
(`custagg.per_example.vectorized`) and the copies (`per_example.forms.copies`) both
run their per-example bodies through `chunked_pfor`.
"""

from __future__ import annotations

import tensorflow as tf

from custagg._tf_compat import pfor_ops
from custagg._tf_compat import resource_variable_ops
from custagg.graph import functions


# The most bytes of outputs one pass of `chunked_pfor` may produce when it
# grows past `chunk` examples. Each pass has a fixed cost, the vectorized
# graph's op count (a converted while loop runs all its ops at every step
# whatever the pass size), which at 32 examples a pass is most of the time of
# small layers: the while-loop LSTM's per-example norms at B=512 took 232 ms
# in passes of 32 and 155 ms in one pass (tf.vectorized_map, one pass: 147).
# 64 MiB of outputs is 677 examples of that LSTM's cell gradients.
PASS_BYTES = 64 * 2 ** 20


def chunked_pfor(loop_fn, n, chunk, dtypes, max_pass_bytes=None):
    """`pfor(loop_fn, n)` in passes: `chunk` iterations first, then more.

    TF's own `parallel_iterations` always builds a leftover pass of
    `n % chunk` iterations, and with 0 of them (n a multiple of the chunk)
    several converters (ReluGrad, max-pool and while-loop gradients) build
    wrongly shaped results that fail at run time; TF 2.12 also fails for
    `n < chunk`. Here every pass vectorizes at least 1 iteration, and a pass
    takes `p = max(chunk, max_pass_bytes // b)` iterations, `b` the bytes of
    one iteration's outputs (from a trace of `loop_fn(0)` that never runs),
    so that small outputs take few passes: one pass when `n <= p` is known
    statically, else a `tf.while_loop` over passes of `min(p, n - start)`.
    Where the trace does not give `b`, the first pass takes `chunk` and the
    later ones `p` from the first pass's shapes (`chunk` if not static).

    Args:
      loop_fn: `i -> list of tensors` (scalar int32 i), one per `dtypes`.
      n: number of iterations (int or scalar int32 tensor; >= 0).
      chunk: the fewest iterations of a pass (of the first one, where one
        iteration's output bytes are not known before it is traced).
      dtypes: the dtypes `loop_fn` returns, in order.
      max_pass_bytes: the outputs' bytes a later pass may reach (None:
        `PASS_BYTES`; 0: every pass `chunk`, for loop functions whose memory
        is not in their outputs, such as a whole backward pass).

    Returns:
      List of `[n, ...]` tensors, row i from iteration i.
    """
    static_n = n if isinstance(n, int) else tf.get_static_value(n)
    if static_n is not None and static_n <= chunk:
        return pfor_ops.pfor(loop_fn, int(static_n))
    if max_pass_bytes is None:
        max_pass_bytes = PASS_BYTES
    first, probed = chunk, None
    if max_pass_bytes > 0:
        probed = output_shapes(loop_fn)
        if probed is not None:
            first = later_pass_size(probed, dtypes, chunk, max_pass_bytes)
    if static_n is not None and static_n <= first:
        return pfor_ops.pfor(loop_fn, int(static_n))
    n = tf.convert_to_tensor(n, tf.int32)
    if probed is not None and static_n is None:
        # A batch that fits one pass (the usual case) skips the loop over
        # passes: its frame, the arrays and their concatenation cost 3-4%
        # of norule_rnn's per-example norms next to `tf.vectorized_map`'s
        # single pfor. pfor converts loop_fn once more for the other branch
        # (build time, not run time).
        def one_pass():
            return [tf.cast(o, d) for o, d in
                    zip(pfor_ops.pfor(loop_fn, n), dtypes)]

        def in_passes():
            return _passes(loop_fn, n, chunk, dtypes, max_pass_bytes, first,
                           static_n)

        outs = tf.cond(n <= first, one_pass, in_passes)
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        for out, shape in zip(outs, probed):
            try:
                out.set_shape(tf.TensorShape([None]).concatenate(shape))
            except ValueError:
                pass        # the trace's shapes are only a hint here
        return list(outs)
    return _passes(loop_fn, n, chunk, dtypes, max_pass_bytes, first, static_n)


def _passes(loop_fn, n, chunk, dtypes, max_pass_bytes, first, static_n):
    """`chunked_pfor`'s `tf.while_loop` over passes, the first of `first`
    iterations."""
    shapes = []

    def body(j, start, size, arrays):
        size = tf.minimum(size, n - start)

        @tf.autograph.experimental.do_not_convert
        def offset_fn(i):
            return loop_fn(i + start)

        outs = pfor_ops.pfor(offset_fn, size)
        del shapes[:]
        shapes.extend(o.shape[1:] for o in outs)
        later = later_pass_size(shapes, dtypes, chunk, max_pass_bytes)
        return (j + 1, start + size, tf.constant(later),
                [ta.write(j, tf.cast(o, ta.dtype)) for ta, o in zip(arrays, outs)])

    arrays = [tf.TensorArray(dtype, size=0, dynamic_size=True, infer_shape=False)
              for dtype in dtypes]
    _, _, _, arrays = tf.while_loop(
        lambda j, start, size, _: start < n, body,
        [tf.constant(0), tf.constant(0), tf.constant(first), arrays],
        parallel_iterations=1)
    results = []
    for ta, shape in zip(arrays, shapes):
        out = ta.concat()
        out.set_shape(tf.TensorShape([static_n]).concatenate(shape))
        results.append(out)
    return results


def output_shapes(loop_fn):
    """The shapes of `loop_fn(0)`'s outputs, from a trace in a function that
    is never called (so nothing of it runs or joins the graph), or None when
    that trace fails (the real one, inside pfor, then says why)."""
    probe = tf.function(lambda: loop_fn(tf.constant(0)), autograph=False)
    try:
        outs = probe.get_concrete_function().structured_outputs
    except Exception:  # pylint: disable=broad-except
        return None
    return [tf.TensorShape(o.shape) for o in outs]


def later_pass_size(shapes, dtypes, chunk, max_pass_bytes):
    """Iterations of one of `chunked_pfor`'s passes.

    Args:
      shapes: one iteration's output shapes (`TensorShape`s, no leading axis).
      dtypes: their dtypes.
      chunk: the fewest iterations a pass takes.
      max_pass_bytes: the most bytes of outputs a pass grows to.

    Returns:
      int: `max(chunk, max_pass_bytes // bytes of one iteration)`, `chunk`
      when a shape is not fully known.
    """
    if not all(s.is_fully_defined() for s in shapes):
        return chunk
    per_iteration = sum(max(1, s.num_elements()) * tf.as_dtype(d).size
                        for s, d in zip(shapes, dtypes))
    grown = max_pass_bytes // max(1, per_iteration)
    return int(max(chunk, min(grown, 2 ** 31 - 1)))


def grad_dtype(t):
    """The dtype of a gradient with respect to `t` (resource: its value's),
    the dtype a pfor pass over such gradients stacks."""
    if t.dtype == tf.resource:
        data = resource_variable_ops.get_eager_safe_handle_data(t)
        if data is not None and data.is_set and data.shape_and_type:
            return tf.as_dtype(data.shape_and_type[0].dtype)
        raise ValueError("custagg: cannot tell the value dtype of resource "
                         "%s." % t.name)
    return t.dtype.base_dtype


def explicit_padding(op):
    """The `[4, 2]` paddings of a Conv2D with explicit padding, else None."""
    if op.type != "Conv2D":
        return None
    try:
        if op.get_attr("padding") != b"EXPLICIT":
            return None
        pads = list(op.get_attr("explicit_paddings"))
    except ValueError:
        return None
    return [pads[j:j + 2] for j in range(0, len(pads), 2)]


def _rolls_by_negative_axis(op):
    """A `Roll` whose axis is negative or not a constant: TF's pfor
    converter rolls its stacked input along `axis + 1`, one axis too far
    to the right for a negative axis (`tf.vectorized_map` of `tf.roll(t,
    1, axis=-2)` rolls along -1)."""
    if op.type != "Roll":
        return False
    axis = tf.get_static_value(op.inputs[2])
    return axis is None or (axis < 0).any()


def vectorizes_exactly(ops, copied=False):
    """False when `ops` (those a vectorized pass differentiates or runs),
    or the bodies and branches of their loops, conds and calls (pfor
    converts those ops too), hold an op TF's pfor converts wrongly: a
    `Roll` along a negative (or unknown) axis, or, unless `copied` (the
    copier pads such convolutions with `tf.pad` itself), a Conv2D with
    explicit padding, whose Conv2DBackpropFilter converter drops
    `explicit_paddings`. The caller then runs the same iterations one at a
    time (`loop`)."""
    def wrong(op):
        return _rolls_by_negative_axis(op) or (
            not copied and explicit_padding(op) is not None)
    return not any(wrong(op) or any(map(wrong, functions.nested_ops(op)))
                   for op in ops)


def loop(loop_fn, n, dtypes):
    """`loop_fn(i)` for each i < n in a `tf.while_loop`, stacked: what
    `chunked_pfor` gives, one iteration at a time."""
    arrays = [tf.TensorArray(d, size=n, infer_shape=True) for d in dtypes]

    def body(i, arrays):
        return i + 1, [ta.write(i, tf.cast(g, ta.dtype))
                       for ta, g in zip(arrays, loop_fn(i))]

    _, arrays = tf.while_loop(lambda i, _: i < n, body,
                              [tf.constant(0), arrays])
    return [ta.stack() for ta in arrays]
