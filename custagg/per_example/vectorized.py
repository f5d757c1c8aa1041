"""The "pfor" strategy: TF's vectorization of per-example backward passes.

Two forms, tried in order for each x:

1. Boundary ops (fast, about B times one op's backward). The ops where x's
   value first meets batch data ("boundary ops": a MatMul of activations and
   `inv(W)`, say) are re-created inside a `pfor` body on example i's rows
   of their batch inputs, and differentiated from there back to x with the
   seed `dz[i]`, the example's own row of the summed loss's gradient
   (valid because nothing downstream mixes examples: checked by
   `separability`). Everything between x and the boundary (the parameter
   side, e.g. `inv`) is differentiated inside the body too, so no rule is
   needed for any op.
2. Whole backward pass (exact for any graph): the loss's backward pass
   seeded with `one_hot(i)`, vectorized over i. Each example's pass goes
   through the whole batch, so cost grows with B^2; chunks of
   `chunk` examples bound the memory.

Both run in passes (`chunked_pfor`) of as many examples as keep a pass's
outputs under `PASS_BYTES`, never fewer than `chunk` (the whole backward
pass: always `chunk`).
"""

from __future__ import annotations

import collections

import tensorflow as tf

from custagg import _tf_compat
from custagg import graph as graph_lib
from custagg.graph import pfor as pfor_lib
from custagg import batch_axis
from custagg import sparse
from custagg._tf_compat import attr_value_pb2
from custagg._tf_compat import backprop_util
from custagg._tf_compat import pfor_ops
from custagg.traversal.gradients import gradients

_Boundary = collections.namedtuple("_Boundary", ["op", "batch_inputs"])


def _is_batch_tensor(t, region, batch_static):
    if t.op not in region or t.shape.rank in (None, 0):
        return t.op in region and t.shape.rank is None
    lead = tf.compat.dimension_value(t.shape[0])
    return lead is None or batch_static is None or lead == batch_static


def find_boundary(x_tensor, loss, loss_ancestors, region, batch_static):
    """The boundary ops of x, or (None, reason) when the fast form does not apply."""
    found, seen_ops, seen = [], set(), set()
    for t, stack in graph_lib.depth_first(x_tensor, seen):
        if t is loss:
            return None, "x reaches the loss without meeting batch data"
        for op in t.consumers():
            if op not in loss_ancestors or op in seen_ops:
                continue
            seen_ops.add(op)
            batch_inputs = [k for k, inp in enumerate(op.inputs)
                            if _is_batch_tensor(inp, region, batch_static)]
            if not batch_inputs:
                stack.extend(out for out in op.outputs
                             if backprop_util.IsTrainable(out))
                continue
            for k in batch_inputs:
                # The copy holds its batch inputs constant; one that x
                # reached through ops that are not boundaries (a transposed
                # activation whose leading axis is not B, or x itself being
                # batch data) would cut x's path: no fast form then.
                if op.inputs[k].ref() in seen:
                    return None, (
                        "input %d of op '%s' (type %s) depends on both x and "
                        "batch data through ops whose batch axis is not "
                        "leading" % (k, op.name, op.type))
                if batch_axis.propagate(op, k, 0) != 0:
                    return None, batch_axis.Reason(
                        "op '%s' (type %s) does not keep examples apart"
                        % (op.name, op.type), op)
            for out in op.outputs:
                if out.op in loss_ancestors and backprop_util.IsTrainable(out):
                    why = batch_axis.coupling(out, 0, loss, loss_ancestors)
                    if why:
                        return None, why
            found.append(_Boundary(op, batch_inputs))
    if not found:
        return None, "no op where x meets batch data"
    return found, None


def _copy_on_rows(op, batch_inputs, i):
    """Re-creates `op` on rows [i:i+1] of its batch inputs.

    A Conv2D with explicit padding is copied as `tf.pad` of its input and a
    VALID Conv2D (the same values): TF's pfor converter for its filter
    gradient, Conv2DBackpropFilter, drops `explicit_paddings`, and the
    vectorized op then fails at run time.
    """
    inputs = [tf.gather(inp, tf.reshape(i, [1])) if k in batch_inputs
              else inp for k, inp in enumerate(op.inputs)]
    graph = tf.compat.v1.get_default_graph()
    attrs = {key: op.node_def.attr[key] for key in op.node_def.attr}
    pads = pfor_lib.explicit_padding(op)
    if pads is not None:
        sliced = [inputs[k] for k in batch_inputs]
        inputs[0] = tf.pad(inputs[0], pads)
        attrs["padding"] = attr_value_pb2.AttrValue(s=b"VALID")
        attrs["explicit_paddings"] = attr_value_pb2.AttrValue(
            list=attr_value_pb2.AttrValue.ListValue())
        new = _tf_compat.create_op(
            graph, op.type, inputs, dtypes=[o.dtype for o in op.outputs],
            name=op.name.split("/")[-1] + "_example", attrs=attrs,
            op_def=op.op_def)
        return new, sliced
    new = _tf_compat.create_op(
        graph, op.type, inputs, dtypes=[o.dtype for o in op.outputs],
        name=op.name.split("/")[-1] + "_example", attrs=attrs,
        op_def=op.op_def)
    return new, [inputs[k] for k in batch_inputs]


def boundary_per_example(loss, group, boundaries, batch, chunk):
    """Per-example gradients of each x in `group` through its boundary ops.

    Args:
      loss: `[B]` loss.
      group: assignments, each with `.tensor`.
      boundaries: list aligned with group: the x's boundary ops.
      batch: B (int or scalar tensor).
      chunk: examples vectorized at once.

    Returns:
      List aligned with group of `[B, *x.shape]` tensors.
    """
    outs = []
    for bounds in boundaries:
        for b in bounds:
            outs.extend(o for o in b.op.outputs
                        if backprop_util.IsTrainable(o))
    unique = list({o.ref(): o for o in outs}.values())
    dz = dict(zip([o.ref() for o in unique], gradients(loss, unique)))

    # pfor runs loop_fn through autograph unless told not to; custagg's
    # traversal is plain graph-building Python and must not be rewritten.
    @tf.autograph.experimental.do_not_convert
    def loop_fn(i):
        results = []
        for a, bounds in zip(group, boundaries):
            ys, seeds, held = [], [], []
            for b in bounds:
                new, sliced = _copy_on_rows(b.op, b.batch_inputs, i)
                held.extend(sliced)
                for old, out in zip(b.op.outputs, new.outputs):
                    g = dz.get(old.ref())
                    if g is None:
                        continue
                    ys.append(out)
                    seeds.append(tf.gather(sparse.dense(g),
                                           tf.reshape(i, [1])))
            # The sliced batch inputs are held constant: other uses of x
            # upstream of them are other boundary ops, counted there.
            g, = gradients(ys, [a.tensor], grad_ys=seeds,
                           stop_gradients=held,
                           unconnected_gradients=tf.UnconnectedGradients.ZERO)
            results.append(sparse.dense(g))
        return results

    dtypes = [pfor_lib.grad_dtype(a.tensor) for a in group]
    # The pass from the boundary ops back to x may cross an op pfor
    # converts wrongly that is no boundary op (one that sees no batch data,
    # between x and the boundary: a convolution with explicit padding, a
    # roll along a negative axis; `graph.pfor.vectorizes_exactly`): the
    # same passes then run one example at a time.
    behind = graph_lib.upstream(
        [t for bounds in boundaries for b in bounds for t in b.op.inputs])
    if not pfor_lib.vectorizes_exactly(behind):
        return pfor_lib.loop(loop_fn, batch, dtypes)
    return pfor_lib.chunked_pfor(loop_fn, batch, chunk, dtypes)


def whole_pass_per_example(loss, tensors, zeros, batch, chunk):
    """Per-example gradients by the one-hot-seeded full backward pass.

    Vectorized with pfor, except where pfor would build a wrong graph
    (`graph.pfor.vectorizes_exactly`): then the same passes run one
    example at a time.
    """

    # pfor runs loop_fn through autograph unless told not to; custagg's
    # traversal is plain graph-building Python and must not be rewritten.
    @tf.autograph.experimental.do_not_convert
    def loop_fn(i):
        seed = tf.one_hot(i, batch, dtype=loss.dtype)
        grads = gradients(loss, tensors, grad_ys=seed)
        return [sparse.dense(g) if g is not None else z()
                for g, z in zip(grads, zeros)]

    dtypes = [pfor_lib.grad_dtype(t) for t in tensors]
    if not pfor_lib.vectorizes_exactly(graph_lib.ancestors(loss)):
        return pfor_lib.loop(loop_fn, batch, dtypes)
    # Each iteration holds a backward pass through the whole batch, which its
    # [*x.shape] outputs do not show: passes stay at `chunk`.
    return pfor_lib.chunked_pfor(loop_fn, batch, chunk, dtypes, max_pass_bytes=0)
