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

import tensorflow as tf

from custagg import symbolic_shapes
from custagg._tf_compat import backprop_util
from custagg._tf_compat import gradient_registry
from custagg._tf_compat import tensor_util

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


class Reason(str):
    """A reason string that also names the op it is about (or None)."""

    def __new__(cls, text, op=None):
        self = super(Reason, cls).__new__(cls, text)
        self.op = op
        return self


def _const(t):
    value = tensor_util.constant_value(t)
    return None if value is None else [int(v) for v in value.reshape(-1)]


def _rank(t):
    return t.shape.rank


def _elementwise(op, index, axis):
    """Broadcasting aligns axes from the right, so a batch axis counted from
    the end survives operands of unknown rank (an unshaped `keep_prob`)."""
    in_rank, out_rank = _rank(op.inputs[index]), _rank(op.outputs[0])
    if axis < 0:
        if out_rank is None:
            return axis
        return out_rank + axis if out_rank + axis >= 0 else None
    if in_rank is None:
        return None
    if out_rank is None:
        return axis - in_rank
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


def _reshape(op, index, batch, shapes):
    """Reshapes keep row-major order: the batch survives when each example's
    entries stay one contiguous block of the output.

    With every axis before the batch of static size 1 and S the number of
    entries of one example, output axis a is the batch when the axes before
    a have size 1 and the axes after it hold exactly S entries; it holds
    rows (example, t...) -- a fold -- when the axes after it hold the
    entries of one `t`. Sizes are compared as symbolic expressions of the
    graph's dimensions (`symbolic_shapes`), so `[-1, C]`,
    `[tf.shape(x)[0], -1]` and Keras LayerNormalization's
    `[1, B*T, D, 1]` are all proved from the graph.
    """
    if index != 0:
        return None
    in_shape = shapes.shape(op.inputs[0])
    out_shape = shapes.shape(op.outputs[0])
    pos = batch.axis if isinstance(batch, Folded) else batch
    if in_shape is None or out_shape is None or pos < 0:
        return None
    middle = batch.middle if isinstance(batch, Folded) else ()
    if any(d is None or d.static != 1 for d in in_shape[:pos]):
        return None
    row = symbolic_shapes.product(in_shape[pos + 1:])
    if row is None:
        return None
    example = row * symbolic_shapes.Dim.of(_prod(middle))
    for out_axis in range(len(out_shape)):
        after = symbolic_shapes.product(out_shape[out_axis + 1:])
        if after is not None:
            if after == example:
                return out_axis
            if middle and after == row:
                return Folded(middle, out_axis)
            if not middle:
                fold = _new_fold(in_shape[pos + 1:], after)
                if fold is not None:
                    return Folded(fold, out_axis)
        dim = out_shape[out_axis]
        if dim is None or dim.static != 1:
            break
    return None


def _new_fold(example_dims, after):
    """The leading example dims T... when the rest hold `after` entries."""
    for j in range(1, len(example_dims)):
        lead = example_dims[:j]
        if any(d is None or d.static is None for d in lead):
            return None
        if symbolic_shapes.product(example_dims[j:]) == after:
            return tuple(d.static for d in lead)
    return None


def _prod(dims):
    out = 1
    for d in dims:
        out *= d
    return out


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


def _batch_norm(op, index, batch, shapes):
    """FusedBatchNorm: inference mode is a per-channel affine map; training
    mode takes statistics per channel, which keeps examples apart only when
    the batch (or rows folded from it, as in Keras LayerNormalization's
    `[1, B*T, D, 1]` NCHW call) is the channel axis."""
    del shapes
    if index != 0:
        return None
    n_out = len(op.outputs)
    if not op.get_attr("is_training"):
        return [batch] + [NO_PATH] * (n_out - 1)
    rank = _rank(op.inputs[0])
    pos = batch.axis if isinstance(batch, Folded) else batch
    if rank is None or pos < 0:
        return None
    channel = 1 if op.get_attr("data_format").decode().startswith("NC") \
        else rank - 1
    if pos != channel:
        return None
    stats = Folded(batch.middle, 0) if isinstance(batch, Folded) else 0
    # y, batch mean, batch variance; the reserve outputs carry no gradient.
    return [batch, stats, stats] + [NO_PATH] * (n_out - 3)


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
    """The batch axis survives a slice that takes all of it (begin and end
    masks, stride 1); new axes (`h[:, None, :]`), shrunk axes and an
    ellipsis move it."""
    if index != 0:
        return None
    # Only the number of entries matters, not where slices begin: the batch
    # axis must be taken whole, by the masks (`x[:, t, :]` with a loop
    # counter t is fine).
    n = tf.compat.dimension_value(op.inputs[1].shape[0]) \
        if op.inputs[1].shape.rank == 1 else None
    strides = _const(op.inputs[3])
    if n is None:
        return None
    ellipsis, new_axis, shrink = (op.get_attr(a) for a in (
        "ellipsis_mask", "new_axis_mask", "shrink_axis_mask"))
    begin_mask, end_mask = op.get_attr("begin_mask"), op.get_attr("end_mask")
    rank = _rank(op.inputs[0])
    if ellipsis and rank is None:
        return None
    in_dim = out_dim = 0
    for i in range(n):
        bit = 1 << i
        if ellipsis & bit:
            # Covers the input axes the entries after it do not take.
            later = sum(1 for j in range(i + 1, n)
                        if not (new_axis | ellipsis) & (1 << j))
            covered = rank - in_dim - later
            if in_dim <= axis < in_dim + covered:
                return out_dim + axis - in_dim
            in_dim += covered
            out_dim += covered
        elif new_axis & bit:
            out_dim += 1
        elif shrink & bit:
            if in_dim == axis:
                return None
            in_dim += 1
        else:
            if in_dim == axis:
                full = begin_mask & bit and end_mask & bit
                if not full or strides is None or strides[i] != 1:
                    return None
                return out_dim
            in_dim += 1
            out_dim += 1
    return out_dim + axis - in_dim


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


class Folded(collections.namedtuple("Folded", ["middle", "axis"])):
    """Rows folded from the batch: axis `axis` holds (example, t...) pairs.

    `tf.tensordot` (Keras Dense on `[B, T..., D]`) reshapes to `[B*T, D]`,
    multiplies, and reshapes back; Keras LayerNormalization reshapes to
    `[1, B*T, D, 1]`. `middle` is the static `T...` shape. Ops that move or
    keep an axis treat a folded axis like a plain one; reshapes and
    batch normalization look at the fold itself.
    """

    def __new__(cls, middle, axis=0):
        return super(Folded, cls).__new__(cls, tuple(middle), axis)


class ListOf(collections.namedtuple("ListOf", ["axis"])):
    """A TensorList (variant) whose items hold the batch at `axis` (an RNN's
    unstacked inputs `[T, B, D]` -> items `[B, D]`, its output sequence)."""


# v1 control flow (Enter/Exit frames, v1 cond): each passes its data
# through unchanged (a Merge picks one input whole, a Switch forwards it to
# one side), so the batch stays on its axis; the back edge (NextIteration
# into Merge) carries it into the next iteration.
_CONTROL_FLOW = frozenset(["Enter", "RefEnter", "Exit", "RefExit", "Merge",
                           "RefMerge", "Switch", "RefSwitch", "NextIteration",
                           "RefNextIteration"])


# How a list of items (a TensorList, or a v1 TensorArray through its flow
# tensor, which TF's own gradients follow) carries the batch, by (op type,
# input index): "put" an item with the batch at axis a into a list (items:
# a), "split" a tensor into items along axis 0 (a - 1), "keep" a list,
# "item" read one (a), "stack" them all (a + 1), "pop" (list and item).
_LIST_STEPS = {
    ("TensorListFromTensor", 0): "split", ("TensorArrayScatterV3", 2): "split",
    ("TensorListSetItem", 2): "put", ("TensorListPushBack", 1): "put",
    ("TensorArrayWriteV3", 2): "put",
    ("TensorListSetItem", 0): "keep", ("TensorListPushBack", 0): "keep",
    ("TensorArrayWriteV3", 3): "keep", ("TensorArrayScatterV3", 3): "keep",
    ("Identity", 0): "keep",
    ("TensorListGetItem", 0): "item", ("TensorArrayReadV3", 2): "item",
    ("TensorListStack", 0): "stack", ("TensorListGather", 0): "stack",
    ("TensorArrayGatherV3", 2): "stack",
    ("TensorListPopBack", 0): "pop",
}
_LIST_OPS = frozenset(t for t, _ in _LIST_STEPS) - {"Identity"}


def _item_list(op, index, batch):
    """Lists of items keep each item's batch axis (`_LIST_STEPS`); a list
    reaching any other op mixes (None)."""
    step = _LIST_STEPS.get((op.type, index))
    if isinstance(batch, ListOf):
        if step == "keep":
            return batch
        if step == "item":
            return batch.axis
        if step == "stack":
            return batch.axis + 1
        if step == "pop":
            return [batch, batch.axis]
        return None
    if isinstance(batch, Folded) or batch < 0:
        return None
    if step == "put":
        return ListOf(batch)
    if step == "split":
        return ListOf(batch - 1) if batch >= 1 else None
    return None


# An output that does not depend on the tracked input (not followed).
NO_PATH = "no path"

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
    "Einsum": _einsum, "Squeeze": _squeeze,
    "ExpandDims": _expand_dims, "Transpose": _transpose,
    "SparseSoftmaxCrossEntropyWithLogits": _xent,
    "SoftmaxCrossEntropyWithLogits": _xent,
    "Pad": _pad, "PadV2": _pad,
    "MirrorPad": _pad, "ConcatV2": _concat, "Pack": _pack,
    "StridedSlice": _strided_slice, "Slice": _slice, "GatherV2": _gather,
    "ResourceGather": _gather, "Tile": _tile, "Split": _split,
    "SplitV": _split, "Unpack": _unpack,
})


# Ops whose rule needs the whole batch descriptor (fold included) and the
# symbolic shapes; every other entry sees only the axis position.
_FOLD_AWARE = {
    "Reshape": _reshape,
    "FusedBatchNorm": _batch_norm, "FusedBatchNormV2": _batch_norm,
    "FusedBatchNormV3": _batch_norm,
}


def _fold(op, x, z):
    """Folded(middle) when reshape `x` `[B, T..., D]` -> `z` `[B*T, D]`.

    For targets the symbolic shapes cannot read: the row width is then
    known only where it is used, as the inner dimension of a MatMul.
    """
    if x.shape.rank is None or x.shape.rank < 3 or z.shape.rank != 2:
        return None
    middle = x.shape[1:-1]
    depth = tf.compat.dimension_value(x.shape[-1])
    if not middle.is_fully_defined() or depth is None:
        return None
    width = tf.compat.dimension_value(z.shape[-1])
    if width is None:
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
    return Folded(tuple(middle.as_list()), 0)


def _normalize(t, axis):
    """A negative (from the end) position made positive where t's rank is known."""
    rank = _rank(t)
    if rank is None or isinstance(axis, ListOf):
        return axis
    if isinstance(axis, Folded):
        return axis if axis.axis >= 0 else Folded(axis.middle,
                                                  axis.axis + rank)
    return axis + rank if axis < 0 else axis


def propagate(op, index, axis, shapes=None):
    """Batch descriptor(s) of `op`'s outputs given the batch at input `index`.

    Args:
      op: the consumer.
      index: which input carries the batch.
      axis: an int (negative: counted from the end, rank unknown) or a
        `Folded`.
      shapes: a `symbolic_shapes.ShapeCache` (a new one if None).

    Returns:
      None when the op may mix examples; else one descriptor for every
      output, or a list with one per output (`NO_PATH` where that output
      does not depend on the input).
    """
    shapes = shapes if shapes is not None else symbolic_shapes.ShapeCache()
    axis = _normalize(op.inputs[index], axis)
    try:
        if op.type in LOOP_TYPES:
            return _while(op, index, axis)
        if op.type in _CONTROL_FLOW:
            return axis
        if isinstance(axis, ListOf) or op.type in _LIST_OPS:
            return _item_list(op, index, axis)
        if op.type in _FOLD_AWARE:
            out = _FOLD_AWARE[op.type](op, index, axis, shapes)
            if out is None and op.type == "Reshape" and axis == 0 and \
                    index == 0:
                out = _fold(op, op.inputs[0], op.outputs[0])
            return out
        fn = _TABLE.get(op.type)
        if fn is None:
            return None
        position = axis.axis if isinstance(axis, Folded) else axis
        if position < 0 and fn is not _elementwise:
            return None     # only broadcasting knows axes from the end
        if isinstance(axis, Folded):
            out = fn(op, index, axis.axis)
            return None if out is None else Folded(axis.middle, out)
        return fn(op, index, axis)
    except (ValueError, TypeError, IndexError):
        return None


LOOP_TYPES = frozenset(["While", "StatelessWhile"])


def _while(op, index, batch):
    """A v2 loop: the batch followed through its body (every iteration) to
    each output, one descriptor per output (None if an output would get
    two, or the body mixes examples)."""
    from custagg import recompute  # pylint: disable=g-import-not-at-top
    try:
        body = recompute._func_graph(op, "body")  # pylint: disable=protected-access
    except recompute.Refused:
        return None
    if len(body.inputs) != len(op.inputs) or \
            len(body.outputs) != len(op.outputs):
        return None
    # Not the accumulators a gradient (or Keras) added: they collect
    # intermediates, nested lists included, for a gradient of the loop.
    live = recompute._ancestors_in([  # pylint: disable=protected-access
        out for k, out in enumerate(body.outputs)
        if not recompute._is_accumulator(op, body, k)])  # pylint: disable=protected-access
    reached, reason = walk_body(body, [(body.inputs[index], batch)], live)
    if reason is not None:
        return None
    out = []
    for k in range(len(op.outputs)):
        got = reached.get(k, set())
        if len(got) > 1:
            return None
        out.append(got.pop() if got else NO_PATH)
    return out


def walk_body(body, starts, live):
    """Follows the batch from `starts` ((body tensor, descriptor) pairs)
    through a loop body's ops in `live`, into the next iterations (an
    output is the next iteration's input at the same position).

    Returns `({output position: {descriptors}}, None)`, or `(None, Reason)`
    naming the op that mixes examples or is not known to keep them apart.
    """
    positions = collections.defaultdict(list)
    for k, out in enumerate(body.outputs):
        positions[out.ref()].append(k)
    reached = collections.defaultdict(set)
    shapes = symbolic_shapes.ShapeCache()
    seen = set()
    queue = collections.deque(starts)
    while queue:
        t, axis = queue.popleft()
        if (t.ref(), axis) in seen:
            continue
        seen.add((t.ref(), axis))
        for k in positions.get(t.ref(), ()):
            reached[k].add(axis)
            queue.append((body.inputs[k], axis))
        for c in t.consumers():
            if c not in live or _blocks_gradient(c):
                continue
            if _has_replaced_gradient(c):
                return None, Reason(
                    "op '%s' (type %s) has a replaced gradient function"
                    % (c.name, c.type), c)
            outs = [o for o in c.outputs
                    if o.dtype.is_floating or o.dtype == tf.variant]
            if not outs:
                continue
            nexts, reason = step(c, t, axis, outs, shapes)
            if reason is not None:
                return None, reason
            queue.extend(nexts)
    return reached, None


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
        return gradient_registry.lookup(op.type) is None
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
    shapes = symbolic_shapes.ShapeCache()
    seen = set()
    queue = collections.deque([(start, batch_axis)])
    while queue:
        t, axis = queue.popleft()
        if (t.ref(), axis) in seen:
            continue
        seen.add((t.ref(), axis))
        if t is loss:
            if _normalize(t, axis) != 0:
                return Reason("the batch reaches axis %s of the loss, not "
                              "axis 0" % (axis,), t.op)
            continue
        for consumer in t.consumers():
            outs = [out for out in consumer.outputs if out.ref() in live]
            if not outs or _blocks_gradient(consumer):
                continue
            if _has_replaced_gradient(consumer):
                return Reason(
                    "op '%s' (type %s) has a replaced gradient function "
                    "(tf.custom_gradient or gradient_override_map), which "
                    "may mix examples" % (consumer.name, consumer.type),
                    consumer)
            nexts, reason = step(consumer, t, axis, outs, shapes)
            if reason is not None:
                return reason
            queue.extend(nexts)
    return None


def step(op, t, axis, outs, shapes=None):
    """Where the batch goes from `t` (batch at `axis`) through `op`.

    Returns `(pairs, reason)`: the `(output, axis)` pairs of `outs` the
    batch reaches (outputs it provably does not reach left out), or a
    `Reason` naming `op` when op mixes examples or is not known to keep
    them apart.
    """
    pairs = []
    for index, inp in enumerate(op.inputs):
        if inp is not t:
            continue
        out_axis = propagate(op, index, axis, shapes)
        if out_axis is None:
            return [], Reason(
                "op '%s' (type %s) mixes examples or is not known to keep "
                "them apart" % (op.name, op.type), op)
        for out in outs:
            here = (out_axis[out.value_index]
                    if isinstance(out_axis, list) else out_axis)
            if here is None:
                return [], Reason(
                    "output %d of op '%s' (type %s) mixes examples"
                    % (out.value_index, op.name, op.type), op)
            if here is not NO_PATH:
                pairs.append((out, here))
    return pairs, None


def _has_replaced_gradient(op):
    try:
        op.get_attr("_gradient_op_type")
    except ValueError:
        return False
    return True
