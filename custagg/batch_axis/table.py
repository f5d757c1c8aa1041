"""THE batch-axis table: where the examples go through one op.

An entry answers, for an op, the index of one of its inputs and the batch
descriptor of that input (which axis holds the examples):

* a descriptor for the op's outputs (an int axis, a `Folded` axis, a
  `ListOf` for TensorLists), or a list with one per output;
* `MIXES`: the op may mix examples (a reduction over the batch axis, batch
  statistics), or the table does not know it -- an unknown op counts as
  mixing, so nothing is guessed;
* `NO_BATCH` (per output, in a list): that output does not depend on this
  input, so it carries no batch from it.

`forward(op, index, desc)` reads the table in the direction the data
flows (separation proofs, the row-wise proof, the boundary and copy forms,
loop rules). `inverse(op, out_index, desc)` reads the same entries the other
way (batch-source inference from the loss): input i holds the batch on
axis j exactly when `forward(op, i, j)` puts it where output `out_index` has
it; an input for which no axis does carries no batch.

The whitelist is the safety argument: a wrong "keeps examples apart" would
give wrong per-example gradients, a missing entry only a slower exact form.

The entries' functions live by op family in `shape_axes` (math and shape
ops), `row_axes` (ops that cut, join and copy rows) and `size_rules` (the
batch size); the descriptors in `descriptors`. The table itself, and every
lookup in it, is here.
"""

from __future__ import annotations

import collections

import tensorflow as tf

from custagg import op_kinds
from custagg.batch_axis import row_axes
from custagg.batch_axis import shape_axes
from custagg.batch_axis import size_rules
from custagg.batch_axis import symbolic_shapes
# The descriptors' names are read from here too (`table.Folded`).
from custagg.batch_axis.descriptors import MIXES
from custagg.batch_axis.descriptors import NO_BATCH
from custagg.batch_axis.descriptors import Folded
from custagg.batch_axis.descriptors import ListOf
from custagg.batch_axis.descriptors import Reason
from custagg.batch_axis.descriptors import Stacked
from custagg.batch_axis.descriptors import as_dim
from custagg.batch_axis.descriptors import axis_of
from custagg.batch_axis.descriptors import rank_of


# Cast, Identity, ZerosLike and OnesLike are elementwise too; their entries
# (below) also carry the batch size.
_ELEMENTWISE_UNARY = frozenset("""
Abs Acos Acosh Asin Asinh Atan Atanh Ceil Cos Cosh Digamma Elu Erf Erfc
Exp Expm1 Floor IdentityN Inv Lgamma Log Log1p LeakyRelu Neg
PreventGradient Reciprocal Relu Relu6 Round Rsqrt Selu Sigmoid Sign Sin Sinh
Snapshot Softplus Softsign Sqrt Square StopGradient Tan Tanh CheckNumerics
EnsureShape LogicalNot IsNan IsInf IsFinite""".split())

_ELEMENTWISE_BINARY = frozenset("""
Add AddV2 AddN Atan2 BiasAdd BiasAddV1 Div DivNoNan FloorDiv FloorMod Maximum
Minimum Mod Mul MulNoNan Pow RealDiv SquaredDifference Sub TruncateDiv Xdivy
Xlogy Select SelectV2 ClipByValue Equal NotEqual Less LessEqual Greater
GreaterEqual LogicalAnd LogicalOr""".split())

_SPATIAL = frozenset("""
Conv2D Conv3D DepthwiseConv2dNative MaxPool MaxPoolV2 AvgPool MaxPool3D
AvgPool3D LRN""".split())

_REDUCTIONS = frozenset("Sum Mean Max Min Prod All Any EuclideanNorm".split())


# v1 control flow (`op_kinds.V1_CONTROL_FLOW`) passes its data through
# unchanged, so the batch stays on its axis; the back edge (NextIteration
# into Merge) carries it into the next iteration.


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
    if isinstance(batch, (Folded, Stacked)) or batch < 0:
        return None
    if step == "put":
        return ListOf(batch)
    if step == "split":
        return ListOf(batch - 1) if batch >= 1 else None
    return None


# --------------------------------------------------------------------------
# The table


class Entry(collections.namedtuple("Entry", ["axes", "sizes",
                                             "fold_aware"])):
    """What one op type does to the batch: the one table entry that the
    separation walk, the batch-source inference, the copy and boundary
    forms, the loop rules and the row-wise proof all read.

    axes: `fn(op, index, axis)` -> the outputs' descriptor (an axis, or a
      list with one per output) given the batch at input `index` on `axis`;
      None inside it means MIXES and NO_PATH (`descriptors`) means
      NO_BATCH (`forward` turns them into the sentinels). With `fold_aware`,
      `fn(op, index, desc, shapes)` sees the whole descriptor (a `Folded`
      or `Stacked` included) and the symbolic shapes; otherwise a folded
      or stacked axis is moved like a plain one. None: the op is not known to keep examples apart.
    sizes: `fn(op, ins)` -> the row-wise proof's values of the outputs
      (`proof_values`) given the inputs' (`ins`), where the batch size may
      flow through the op (`tf.shape(x)[0]`, `tf.stack`, `tf.fill`), or
      `AS_ROWS` to let `axes` decide; None: only `axes`.
    """

    def __new__(cls, axes=None, sizes=None, fold_aware=False):
        return super(Entry, cls).__new__(cls, axes, sizes, fold_aware)


_TABLE = {}
for _t in _ELEMENTWISE_UNARY | _ELEMENTWISE_BINARY:
    _TABLE[_t] = Entry(shape_axes.elementwise)
for _t in _SPATIAL:
    _TABLE[_t] = Entry(shape_axes.first_axis_only)
for _t in _REDUCTIONS:
    _TABLE[_t] = Entry(shape_axes.reduction)
_TABLE.update({
    "Softmax": Entry(shape_axes.last_axis_op),
    "LogSoftmax": Entry(shape_axes.last_axis_op),
    "MatMul": Entry(shape_axes.matmul),
    "BatchMatMul": Entry(shape_axes.batch_matmul),
    "BatchMatMulV2": Entry(shape_axes.batch_matmul),
    "BatchMatMulV3": Entry(shape_axes.batch_matmul),
    "Einsum": Entry(shape_axes.einsum), "Squeeze": Entry(shape_axes.squeeze),
    "Transpose": Entry(shape_axes.transpose),
    "SparseSoftmaxCrossEntropyWithLogits": Entry(shape_axes.xent),
    "SoftmaxCrossEntropyWithLogits": Entry(shape_axes.xent),
    "Pad": Entry(row_axes.pad),
    "PadV2": Entry(row_axes.pad),
    "MirrorPad": Entry(row_axes.pad),
    "Slice": Entry(row_axes.plain_slice), "GatherV2": Entry(row_axes.gather),
    "ResourceGather": Entry(row_axes.gather),
    "Tile": Entry(row_axes.tile_rows, fold_aware=True),
    "SpaceToBatchND": Entry(row_axes.space_to_batch_rows, fold_aware=True),
    "BatchToSpaceND": Entry(row_axes.space_to_batch_rows, fold_aware=True),
    "Conv2DBackpropInput": Entry(row_axes.transposed_conv),
    "Split": Entry(row_axes.split_rows, fold_aware=True),
    "SplitV": Entry(row_axes.split_rows, fold_aware=True),
    "Unpack": Entry(row_axes.unpack),
    "ReverseSequence": Entry(row_axes.reverse_sequence),
    "OneHot": Entry(row_axes.one_hot),
    "Roll": Entry(row_axes.roll),
    "CTCLoss": Entry(row_axes.ctc_loss), "CTCLossV2": Entry(row_axes.ctc_loss),
    "ParseExample": Entry(row_axes.parse_example),
    "ParseExampleV2": Entry(row_axes.parse_example),
    "Reshape": Entry(shape_axes.reshape, fold_aware=True),
    "FusedBatchNorm": Entry(shape_axes.batch_norm, fold_aware=True),
    "FusedBatchNormV2": Entry(shape_axes.batch_norm, fold_aware=True),
    "FusedBatchNormV3": Entry(shape_axes.batch_norm, fold_aware=True),
    # Where the batch size flows (the row-wise proof reads `sizes`).
    "Shape": Entry(row_axes.no_rows, size_rules.size_shape),
    "ShapeN": Entry(row_axes.no_rows, size_rules.size_shape_n),
    "Rank": Entry(row_axes.no_rows, size_rules.size_same),
    "Size": Entry(row_axes.no_rows),
    "TensorListLength": Entry(sizes=size_rules.size_same),
    "Cast": Entry(shape_axes.elementwise, size_rules.size_cast),
    "Identity": Entry(shape_axes.elementwise, size_rules.size_identity),
    "ZerosLike": Entry(shape_axes.elementwise, size_rules.size_like),
    "OnesLike": Entry(shape_axes.elementwise, size_rules.size_like),
    "StridedSlice": Entry(
        row_axes.strided_slice, size_rules.size_strided_slice),
    "ExpandDims": Entry(shape_axes.expand_dims, size_rules.size_expand_dims),
    "Pack": Entry(row_axes.pack, size_rules.size_pack),
    "ConcatV2": Entry(
        row_axes.concat_rows, size_rules.size_concat, fold_aware=True),
    "Fill": Entry(sizes=size_rules.size_fill),
    "BroadcastTo": Entry(sizes=size_rules.size_broadcast_to),
    "TensorListReserve": Entry(sizes=size_rules.size_list_reserve),
    "EmptyTensorList": Entry(sizes=size_rules.size_list_reserve),
})


def size_rule(op):
    """The `sizes` entry of `op`'s type (the row-wise proof's), or None."""
    entry = _TABLE.get(op.type)
    return None if entry is None else entry.sizes


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


def normalize(t, axis):
    """A negative (
        from the end) position made positive where t's rank is known.""",
    rank = rank_of(t)
    if rank is None or isinstance(axis, ListOf):
        return axis
    if isinstance(axis, (Folded, Stacked)):
        return axis if axis.axis >= 0 else axis._replace(
            axis=axis.axis + rank)
    return axis + rank if axis < 0 else axis




def mixes_text(op):
    """Why `forward` answers MIXES at `op`, in the user's terms: what the
    table cannot read there and what to do (the run-time certificate
    checks the rules past it meanwhile)."""
    what = "op '%s' (type %s)" % (op.name, op.type)
    if op.type not in _TABLE and not known(op):
        return ("%s is not in the batch-axis table, so whether it keeps "
                "examples apart is not known statically" % what)
    if op.type == "Squeeze" and not op.get_attr("squeeze_dims") and \
            not op.inputs[0].shape.is_fully_defined():
        return ("%s (tf.squeeze without an axis) drops the axes of size 1, "
                "known only at run time: with one example it drops the "
                "batch axis too, so its output rank is unknown; give it an "
                "axis (tf.squeeze(t, axis=-1))" % what)
    if op.type == "Reshape" and tf.get_static_value(op.inputs[1]) is not None:
        return ("%s reshapes to the constant sizes %s, which do not keep "
                "the batch on an axis of its own: it mixes examples (or "
                "folds them in an order that cannot be proved); -1 on the "
                "batch axis keeps it" % (
                    what, list(tf.get_static_value(op.inputs[1]))))
    if op.type == "Reshape":
        return ("%s reshapes to sizes the analysis cannot match to the "
                "batch axis (read from another tensor's tf.shape, or known "
                "only at run time); -1 on the batch axis, or sizes read "
                "from the reshaped tensor's own tf.shape, let custagg prove "
                "it" % what)
    unknown = [t for t in list(op.inputs) + list(op.outputs)
               if t.shape.rank is None and t.dtype != tf.resource]
    if unknown:
        return ("%s: '%s' has unknown rank, so where it holds the batch "
                "is not known statically; a static rank (tf.ensure_shape, "
                "tf.reshape) lets custagg prove it" % (what,
                                                        unknown[0].name))
    return "%s mixes examples or is not known to keep them apart" % what


def known(op):
    """Whether the table has an entry for `op`'s type (loops aside)."""
    entry = _TABLE.get(op.type)
    return ((entry is not None and entry.axes is not None) or
            op.type in op_kinds.V1_CONTROL_FLOW or op.type in _LIST_OPS)


def forward(op, index, desc, shapes=None):
    """Batch descriptor(s) of `op`'s outputs given the batch at input `index`.

    v2 loops are not in the table (their bodies are followed by
    `custagg.batch_axis.separation.propagate`); here they are `MIXES`.

    Args:
      op: the consumer.
      index: which input carries the batch.
      desc: an int axis (negative: counted from the end, rank unknown), a
        `Folded` or a `ListOf`.
      shapes: a `symbolic_shapes.ShapeCache` (a new one if None).

    Returns:
      `MIXES`; or one descriptor for every output; or a list with one per
      output (`NO_BATCH` where that output does not depend on the input,
      `MIXES` where it mixes).
    """
    out = _forward(op, index, desc, shapes)
    if out is None:
        return MIXES
    if isinstance(out, list):
        return [MIXES if d is None else d for d in out]
    return out


def _forward(op, index, axis, shapes):
    shapes = shapes if shapes is not None else symbolic_shapes.ShapeCache()
    axis = normalize(op.inputs[index], axis)
    try:
        if op.type in op_kinds.V1_CONTROL_FLOW:
            # A Switch's predicate picks the branch for the whole batch.
            if op.type in op_kinds.V1_SWITCHES and index == 1:
                return None
            return axis
        if isinstance(axis, ListOf) or op.type in _LIST_OPS:
            return _item_list(op, index, axis)
        entry = _TABLE.get(op.type)
        if entry is None or entry.axes is None:
            return None
        fn = entry.axes
        if entry.fold_aware:
            out = fn(op, index, axis, shapes)
            if out is None and op.type == "Reshape" and axis == 0 and \
                    index == 0:
                out = _fold(op, op.inputs[0], op.outputs[0])
            return out
        return shape_axes.move(fn, op, index, axis)
    except (ValueError, TypeError, IndexError):
        # Attrs or constant inputs the entry cannot read (a missing attr
        # on an old release, an axis out of range): not known to keep
        # examples apart.
        return None


def same(a, b, shapes, op):
    """Whether descriptors a and b place the batch alike at op's output:
    equal, or folds on the same axis whose middles are equal whenever op
    runs (`ShapeCache.equal`: a dynamic T read from two tensors that a
    run-time check equates)."""
    if a == b:
        return True
    if not (isinstance(a, Folded) and isinstance(b, Folded)) or \
            a.axis != b.axis or len(a.middle) != len(b.middle):
        return False
    return all(shapes.equal(as_dim(x), as_dim(y), op)
               for x, y in zip(a.middle, b.middle))
def _stack_candidates(like, output):
    """Numbers of stacked copies an input might hold for an output holding
    the batch at `like`: the divisors of like's copies (a concat or tile
    of stacked inputs), and the pieces of a `Split` times like's copies."""
    copies = like.copies if isinstance(like, Stacked) else 1
    out = set(c for c in range(2, copies + 1) if copies % c == 0)
    if output is not None and output.op.type == "Split":
        out.add(copies * output.op.get_attr("num_split"))
    if output is not None and output.op.type == "BatchToSpaceND":
        n = row_axes.blocks(output.op)
        if n is not None:
            out.add(copies * n)
    out.discard(1)
    return sorted(out)


def candidates(t, like, output=None, shapes=None):
    """The descriptors input `t` might hold the batch at, for an output
    holding it at `like`: every axis of t; as `Folded` with like's middle
    when `like` is folded, or, into a reshape `output` (unfolding
    `[B*T, D]` back to `[B, T, D]`), with each run of the output's axes
    after the batch as the middle (static ones; with `shapes`, a
    `symbolic_shapes.ShapeCache`, dynamic ones by their symbolic dims too);
    as `Stacked` copies where a concat, tile or split may have stacked the
    batch; lists' item axes for scalars (lists, TensorArray flows). Empty
    when t's rank is unknown (nothing is guessed)."""
    rank = t.shape.rank
    if rank is None:
        return []
    out = []
    middles = []
    if isinstance(like, Folded):
        middles.append(like.middle)
    elif isinstance(like, int) and like >= 0 and output is not None and \
            output.op.type == "Reshape" and output.shape.rank is not None:
        # Up to all of them: `[B*T]` -> `[B, T]` (a per-token loss
        # reshaped back) has no row axis left.
        after = output.shape.as_list()[like + 1:]
        for n in range(1, len(after) + 1):
            if all(d is not None for d in after[:n]):
                middles.append(tuple(after[:n]))
        dims = shapes.shape(output) if shapes is not None else None
        if dims is not None and len(dims) == output.shape.rank:
            after = dims[like + 1:]
            for n in range(1, len(after) + 1):
                if all(d is not None for d in after[:n]):
                    middle = tuple(shape_axes.middle_entry(d) for d in after[:n])
                    if middle not in middles:
                        middles.append(middle)
    for middle in middles:
        out.extend(Folded(middle, j) for j in range(rank))
    for copies in _stack_candidates(like, output):
        out.extend(Stacked(copies, j) for j in range(rank))
    out.extend(range(rank))
    if rank == 0:
        # A TensorList (variant) or a v1 TensorArray's flow (a float
        # scalar): a list whose items hold the batch.
        depth = like.axis if isinstance(like, ListOf) else \
            axis_of(like)
        out.extend(ListOf(j) for j in range(max(depth, 0) + 2))
    return out


# Public views of the op sets, for the analyses that build on the table.
ELEMENTWISE = frozenset(t for t, e in _TABLE.items()
                        if e.axes is shape_axes.elementwise)

