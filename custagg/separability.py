"""Batch-coupling detection: do examples stay apart from a rule's op to the loss?

Rules are exact only when example b's loss depends on the op's output only
through row b (no batch statistics, no reductions or reshapes across the
batch). `coupling(start, batch_axis, loss)` follows every differentiable path
from `start` to `loss` and tracks which axis holds the batch; it returns
`None` when the batch reaches axis 0 of the `[B]` loss on every path, else a
short description of the first op that mixes examples.

The table is a whitelist: an op type it does not know counts as mixing, so
"auto" falls back to an exact strategy instead of risking a wrong answer.
Each entry maps (op, input index, batch axis of that input) to the batch axis
of the op's outputs, or None when the op mixes examples.
"""

from __future__ import annotations

import collections

from tensorflow.python.eager import backprop_util
from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor_util

import tensorflow as tf

_ELEMENTWISE_UNARY = frozenset("""
Abs Acos Acosh Asin Asinh Atan Atanh Cast Ceil Cos Cosh Digamma Elu Erf Erfc
Exp Expm1 Floor Identity IdentityN Inv Lgamma Log Log1p LeakyRelu Neg
PreventGradient Reciprocal Relu Relu6 Round Rsqrt Selu Sigmoid Sign Sin Sinh
Snapshot Softplus Softsign Sqrt Square StopGradient Tan Tanh CheckNumerics
EnsureShape Gelu""".split())

_ELEMENTWISE_BINARY = frozenset("""
Add AddV2 AddN Atan2 BiasAdd BiasAddV1 Div DivNoNan FloorDiv FloorMod Maximum
Minimum Mod Mul MulNoNan Pow RealDiv SquaredDifference Sub TruncateDiv Xdivy
Xlogy Select SelectV2 ClipByValue""".split())

_SPATIAL = frozenset("""
Conv2D Conv3D DepthwiseConv2dNative MaxPool MaxPoolV2 AvgPool MaxPool3D
AvgPool3D LRN""".split())

_REDUCTIONS = frozenset("Sum Mean Max Min Prod All Any EuclideanNorm".split())


def _const(t):
    value = tensor_util.constant_value(t)
    return None if value is None else [int(v) for v in value.reshape(-1)]


def _rank(t):
    return t.shape.rank


def _elementwise(op, index, axis):
    in_rank, out_rank = _rank(op.inputs[index]), _rank(op.outputs[0])
    if in_rank is None or out_rank is None:
        return None
    out_axis = axis + out_rank - in_rank
    # A size-1 axis broadcast against a longer one is not the batch: every
    # example would see the same entry (a [1, D] parameter times a [1, D]
    # constant, then times the activations).
    in_dim = tf.compat.dimension_value(op.inputs[index].shape[axis])
    out_dim = tf.compat.dimension_value(op.outputs[0].shape[out_axis])
    if in_dim == 1 and out_dim != 1:
        return None
    return out_axis


def _last_axis_op(op, index, axis):
    rank = _rank(op.inputs[index])
    return None if rank is None or axis == rank - 1 else axis


def _matmul(op, index, axis):
    ta, tb = op.get_attr("transpose_a"), op.get_attr("transpose_b")
    if index == 0:
        row_axis = 1 if ta else 0
        return 0 if axis == row_axis else None
    col_axis = 0 if tb else 1
    return 1 if axis == col_axis else None


def _batch_matmul(op, index, axis):
    rank, out_rank = _rank(op.inputs[index]), _rank(op.outputs[0])
    if rank is None or out_rank is None:
        return None
    if axis < rank - 2:
        out_axis = axis + out_rank - rank
        in_dim = tf.compat.dimension_value(op.inputs[index].shape[axis])
        out_dim = tf.compat.dimension_value(op.outputs[0].shape[out_axis])
        return None if in_dim == 1 and out_dim != 1 else out_axis
    adj = op.get_attr("adj_x" if index == 0 else "adj_y")
    kept = (rank - 1 if adj else rank - 2) if index == 0 else \
        (rank - 2 if adj else rank - 1)
    if axis != kept:
        return None
    return out_rank - 2 if index == 0 else out_rank - 1


def _einsum(op, index, axis):
    eq = op.get_attr("equation").decode().replace(" ", "")
    if "..." in eq or "->" not in eq:
        return None
    ins, out = eq.split("->")
    sub = ins.split(",")[index]
    letter = sub[axis]
    return out.index(letter) if letter in out else None


def _is_own_batch_size(t, x):
    """Whether `t` is `tf.shape(x)[0]` (a StridedSlice of x's Shape)."""
    op = t.op
    if op.type != "StridedSlice" or op.inputs[0].op.type != "Shape":
        return False
    if op.inputs[0].op.inputs[0] is not x:
        return False
    return (_const(op.inputs[1]) == [0] and _const(op.inputs[3]) == [1]
            and op.get_attr("shrink_axis_mask") == 1
            and not op.get_attr("begin_mask") & 1)


def _reshape(op, index, axis):
    if index != 0 or axis != 0:
        return None
    x, z = op.inputs[0], op.outputs[0]
    shape_op = op.inputs[1].op
    if (shape_op.type == "Pack" and shape_op.get_attr("axis") == 0
            and _is_own_batch_size(shape_op.inputs[0], x)):
        # reshape(x, [tf.shape(x)[0], ...]): each example keeps its row.
        return 0
    if x.shape.rank is None or z.shape.rank is None or z.shape.rank == 0:
        return None
    in_rest, out_rest = x.shape[1:], z.shape[1:]
    if not (in_rest.is_fully_defined() and out_rest.is_fully_defined()):
        return None
    if in_rest.num_elements() != out_rest.num_elements():
        return None
    b_in = tf.compat.dimension_value(x.shape[0])
    b_out = tf.compat.dimension_value(z.shape[0])
    if b_in is not None and b_out is not None and b_in != b_out:
        return None
    return 0


def _squeeze(op, index, axis):
    dims = list(op.get_attr("squeeze_dims"))
    rank = _rank(op.inputs[0])
    if not dims:
        if rank is None or not op.inputs[0].shape.is_fully_defined():
            return None
        dims = [i for i, d in enumerate(op.inputs[0].shape.as_list())
                if d == 1]
    if rank is not None:
        dims = [d % rank for d in dims]
    if axis in dims:
        return None
    return axis - sum(1 for d in dims if d < axis)


def _expand_dims(op, index, axis):
    dim = _const(op.inputs[1])
    out_rank = _rank(op.outputs[0])
    if index != 0 or dim is None or out_rank is None:
        return None
    d = dim[0] % out_rank
    return axis + 1 if d <= axis else axis


def _transpose(op, index, axis):
    perm = _const(op.inputs[1])
    if index != 0 or perm is None:
        return None
    return perm.index(axis)


def _reduction(op, index, axis):
    axes = _const(op.inputs[1])
    rank = _rank(op.inputs[0])
    if index != 0 or axes is None or rank is None:
        return None
    axes = [a % rank for a in axes]
    if axis in axes:
        return None
    if op.get_attr("keep_dims"):
        return axis
    return axis - sum(1 for a in axes if a < axis)


def _first_axis_only(op, index, axis):
    return 0 if index == 0 and axis == 0 else None


def _xent(op, index, axis):
    return 0 if axis == 0 else None


def _batch_norm(op, index, axis):
    if op.get_attr("is_training"):
        return None
    return 0 if index == 0 and axis == 0 else None


def _pad(op, index, axis):
    pads = _const(op.inputs[1])
    if index != 0 or pads is None or pads[2 * axis] or pads[2 * axis + 1]:
        return None
    return axis


def _concat(op, index, axis):
    n = op.get_attr("N")
    concat_axis = _const(op.inputs[n])
    rank = _rank(op.outputs[0])
    if index >= n or concat_axis is None or rank is None:
        return None
    return None if concat_axis[0] % rank == axis else axis


def _pack(op, index, axis):
    pack_axis = op.get_attr("axis")
    rank = _rank(op.outputs[0])
    if rank is None:
        return None
    pack_axis %= rank
    return axis + 1 if pack_axis <= axis else axis


def _strided_slice(op, index, axis):
    if index != 0:
        return None
    if op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask"):
        return None
    begin = _const(op.inputs[1])
    if begin is None:
        return None
    shrink = op.get_attr("shrink_axis_mask")
    if axis < len(begin):
        full = (op.get_attr("begin_mask") >> axis & 1 and
                op.get_attr("end_mask") >> axis & 1 and
                not shrink >> axis & 1)
        strides = _const(op.inputs[3])
        if not full or strides is None or strides[axis] != 1:
            return None
    return axis - sum(1 for i in range(min(axis, len(begin)))
                      if shrink >> i & 1)


def _slice(op, index, axis):
    begin, size = _const(op.inputs[1]), _const(op.inputs[2])
    if index != 0 or begin is None or size is None:
        return None
    if begin[axis] != 0 or size[axis] != -1:
        return None
    return axis


def _gather(op, index, axis):
    if op.get_attr("batch_dims") != 0:
        return None
    if op.type == "GatherV2":
        gaxis = _const(op.inputs[2])
        if gaxis is None:
            return None
        gaxis = gaxis[0]
    else:
        gaxis = 0
    if index == 1:          # the ids carry the batch: out = ids.shape + rest
        return axis + gaxis
    if index == 0 and op.inputs[0].dtype != tf.resource:
        rank = _rank(op.inputs[0])
        if rank is None or axis == gaxis % rank:
            return None
        ids_rank = _rank(op.inputs[1])
        if ids_rank is None:
            return None
        return axis if axis < gaxis % rank else axis + ids_rank - 1
    return None


def _split(op, index, axis):
    value_index, axis_index = (1, 0) if op.type == "Split" else (0, 2)
    split_axis = _const(op.inputs[axis_index])
    rank = _rank(op.inputs[value_index])
    if index != value_index or split_axis is None or rank is None:
        return None
    return None if split_axis[0] % rank == axis else axis


def _unpack(op, index, axis):
    rank = _rank(op.inputs[0])
    if rank is None:
        return None
    unpack_axis = op.get_attr("axis") % rank
    if unpack_axis == axis:
        return None
    return axis - 1 if unpack_axis < axis else axis


def _tile(op, index, axis):
    multiples = _const(op.inputs[1])
    if index != 0 or multiples is None or multiples[axis] != 1:
        return None
    return axis


_TABLE = {}
for _t in _ELEMENTWISE_UNARY | _ELEMENTWISE_BINARY:
    _TABLE[_t] = _elementwise
for _t in _SPATIAL:
    _TABLE[_t] = _first_axis_only
for _t in _REDUCTIONS:
    _TABLE[_t] = _reduction
_TABLE.update({
    "Softmax": _last_axis_op, "LogSoftmax": _last_axis_op,
    "MatMul": _matmul, "BatchMatMul": _batch_matmul,
    "BatchMatMulV2": _batch_matmul, "BatchMatMulV3": _batch_matmul,
    "Einsum": _einsum, "Reshape": _reshape, "Squeeze": _squeeze,
    "ExpandDims": _expand_dims, "Transpose": _transpose,
    "SparseSoftmaxCrossEntropyWithLogits": _xent,
    "SoftmaxCrossEntropyWithLogits": _xent,
    "FusedBatchNorm": _batch_norm, "FusedBatchNormV2": _batch_norm,
    "FusedBatchNormV3": _batch_norm, "Pad": _pad, "PadV2": _pad,
    "MirrorPad": _pad, "ConcatV2": _concat, "Pack": _pack,
    "StridedSlice": _strided_slice, "Slice": _slice, "GatherV2": _gather,
    "ResourceGather": _gather, "Tile": _tile, "Split": _split,
    "SplitV": _split, "Unpack": _unpack,
})


class Folded(collections.namedtuple("Folded", ["middle"])):
    """The batch folded into rows: axis 0 holds (example, t...) pairs.

    `tf.tensordot` (Keras Dense on `[B, T..., D]`) reshapes to `[B*T, D]`,
    multiplies, and reshapes back. `middle` is the static `T...` shape. Rows
    stay apart through a MatMul on the left and row-wise elementwise ops,
    and the unfold reshape brings the batch back to axis 0.
    """


def _fold(op, x, z):
    """Folded(middle) when reshape `x` `[B, T..., D]` -> `z` `[B*T, D]`."""
    if x.shape.rank is None or x.shape.rank < 3 or z.shape.rank != 2:
        return None
    middle = x.shape[1:-1]
    depth = tf.compat.dimension_value(x.shape[-1])
    if not middle.is_fully_defined() or depth is None:
        return None
    width = tf.compat.dimension_value(z.shape[-1])
    if width is None:
        # The row width is known only where it is used: a MatMul taking the
        # rows with a static inner dimension D runs only if the width is D.
        def fixes_width(c):
            if c.type != "MatMul" or c.get_attr("transpose_a") or \
                    c.inputs[0] is not z:
                return False
            inner = c.inputs[1].shape[1 if c.get_attr("transpose_b") else 0]
            return tf.compat.dimension_value(inner) == depth
        if not any(fixes_width(c) for c in z.consumers()):
            return None
    elif width != depth:
        return None
    return Folded(tuple(middle.as_list()))


def _propagate_folded(op, index, axis):
    """Rows (example, t) on axis 0: which ops keep them apart."""
    if op.type == "Transpose":
        perm = _const(op.inputs[1])
        return axis if perm is not None and perm[0] == 0 and index == 0 \
            else None
    if op.type == "MatMul":
        return axis if index == 0 and not op.get_attr("transpose_a") else None
    if op.type == "Reshape" and index == 0:
        z = op.outputs[0]
        if z.shape.rank == len(axis.middle) + 2 and \
                tuple(z.shape[1:-1].as_list()) == axis.middle:
            return 0
        return None
    if op.type in _ELEMENTWISE_UNARY or op.type in _ELEMENTWISE_BINARY:
        # Row-wise only when no operand carries rows of its own shape other
        # than folded ones (ranks equal) and the others broadcast along rows.
        out_rank = _rank(op.outputs[0])
        if out_rank != _rank(op.inputs[index]):
            return None
        return axis
    return None


def propagate(op, index, axis):
    """Batch axis of `op`'s outputs given the batch at `axis` of input `index`."""
    if isinstance(axis, Folded):
        try:
            return _propagate_folded(op, index, axis)
        except (ValueError, TypeError, IndexError):
            return None
    if op.type == "Reshape" and axis == 0 and index == 0 and \
            _reshape(op, index, axis) is None:
        folded = _fold(op, op.inputs[0], op.outputs[0])
        if folded is not None:
            return folded
    fn = _TABLE.get(op.type)
    if fn is None:
        return None
    try:
        return fn(op, index, axis)
    except (ValueError, TypeError, IndexError):
        return None


def ancestors(t):
    """Ops the tensor `t` depends on (through data inputs)."""
    seen = set()
    queue = collections.deque([t.op])
    while queue:
        op = queue.popleft()
        if op in seen:
            continue
        seen.add(op)
        queue.extend(i.op for i in op.inputs)
    return seen


def _blocks_gradient(op):
    """StopGradient, and ops registered with no gradient (tf.no_gradient)."""
    if op.type == "StopGradient":
        return True
    try:
        return ops._gradient_registry.lookup(op.type) is None  # pylint: disable=protected-access
    except LookupError:
        return False


_GRADIENT_PATHS = {}


def gradient_paths(loss, loss_ancestors):
    """Refs of the tensors a gradient of `loss` flows back into.

    Not through StopGradient or ops without a gradient, nor along integer
    or boolean tensors (`tf.shape(z)` feeding a reshape, an argmax): a
    batch statistic taken under `tf.stop_gradient` couples nothing.
    Remembers the last loss asked about (the planner asks once per op).
    """
    key = loss.ref()
    if key in _GRADIENT_PATHS:
        return _GRADIENT_PATHS[key]
    live = set()
    queue = collections.deque([loss])
    while queue:
        t = queue.popleft()
        if t.ref() in live:
            continue
        live.add(t.ref())
        if _blocks_gradient(t.op):
            continue
        queue.extend(i for i in t.op.inputs if i.op in loss_ancestors
                     and backprop_util.IsTrainable(i))
    _GRADIENT_PATHS.clear()
    _GRADIENT_PATHS[key] = live
    return live


def coupling(start, batch_axis, loss, loss_ancestors):
    """None if examples stay apart from `start` to `loss`, else a reason.

    Only paths a gradient flows back along are followed (`gradient_paths`).

    Args:
      start: the rule op's output tensor.
      batch_axis: the axis of `start` that holds the batch.
      loss: the per-example loss `[B]`.
      loss_ancestors: `ancestors(loss)`.
    """
    live = gradient_paths(loss, loss_ancestors)
    seen = set()
    queue = collections.deque([(start, batch_axis)])
    while queue:
        t, axis = queue.popleft()
        if (t.ref(), axis) in seen:
            continue
        seen.add((t.ref(), axis))
        if t is loss:
            if axis != 0:
                return ("the batch reaches axis %d of the loss, not axis 0"
                        % axis)
            continue
        for consumer in t.consumers():
            outs = [out for out in consumer.outputs if out.ref() in live]
            if not outs or _blocks_gradient(consumer):
                continue
            if _has_replaced_gradient(consumer):
                return ("op '%s' (type %s) has a replaced gradient function "
                        "(tf.custom_gradient or gradient_override_map), which "
                        "may mix examples" % (consumer.name, consumer.type))
            for index, inp in enumerate(consumer.inputs):
                if inp is not t:
                    continue
                out_axis = propagate(consumer, index, axis)
                if out_axis is None:
                    return ("op '%s' (type %s) mixes examples or is not known "
                            "to keep them apart" % (consumer.name,
                                                    consumer.type))
                for out in outs:
                    queue.append((out, out_axis))
    return None


def _has_replaced_gradient(op):
    try:
        op.get_attr("_gradient_op_type")
    except ValueError:
        return False
    return True
