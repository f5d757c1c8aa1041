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
"""

from __future__ import annotations

import collections

import tensorflow as tf

from custagg import graph
from custagg._tf_compat import tensor_util
from custagg.batch_axis import symbolic_shapes
from custagg.batch_axis.proof_values import AS_ROWS
from custagg.batch_axis.proof_values import Dims
from custagg.batch_axis.proof_values import NotProved
from custagg.batch_axis.proof_values import Rows
from custagg.batch_axis.proof_values import SAME
from custagg.batch_axis.proof_values import SIZE
from custagg.batch_axis.proof_values import UNKNOWN
from custagg.batch_axis.proof_values import new_rows
from custagg.batch_axis.proof_values import op_text
from custagg.batch_axis.proof_values import sized

# Cast, Identity, ZerosLike and OnesLike are elementwise too; their entries
# (below) also carry the batch size.
_ELEMENTWISE_UNARY = frozenset("""
Abs Acos Acosh Asin Asinh Atan Atanh Ceil Cos Cosh Digamma Elu Erf Erfc
Exp Expm1 Floor IdentityN Inv Lgamma Log Log1p LeakyRelu Neg
PreventGradient Reciprocal Relu Relu6 Round Rsqrt Selu Sigmoid Sign Sin Sinh
Snapshot Softplus Softsign Sqrt Square StopGradient Tan Tanh CheckNumerics
EnsureShape Gelu LogicalNot IsNan IsInf IsFinite""".split())

_ELEMENTWISE_BINARY = frozenset("""
Add AddV2 AddN Atan2 BiasAdd BiasAddV1 Div DivNoNan FloorDiv FloorMod Maximum
Minimum Mod Mul MulNoNan Pow RealDiv SquaredDifference Sub TruncateDiv Xdivy
Xlogy Select SelectV2 ClipByValue Equal NotEqual Less LessEqual Greater
GreaterEqual LogicalAnd LogicalOr""".split())

_SPATIAL = frozenset("""
Conv2D Conv3D DepthwiseConv2dNative MaxPool MaxPoolV2 AvgPool MaxPool3D
AvgPool3D LRN""".split())

_REDUCTIONS = frozenset("Sum Mean Max Min Prod All Any EuclideanNorm".split())


class _Sentinel(object):
    """A named constant, distinct from None and from every descriptor."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name

    def __reduce__(self):
        return self.name


# The op may mix examples, or is not in the table (see the module).
MIXES = _Sentinel("MIXES")
# This output (or input) carries no batch.
NO_BATCH = _Sentinel("NO_BATCH")


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
    the end survives operands of unknown rank (an unshaped `keep_prob`).

    v1 `Select` (`tf.compat.v1.where`) with a vector condition and matrix
    branches does not broadcast: entry r of the condition picks row r
    (dynamic_rnn's `time >= sequence_length`), so it keeps axis 0."""
    in_rank, out_rank = _rank(op.inputs[index]), _rank(op.outputs[0])
    if op.type == "Select" and index == 0 and in_rank == 1 and \
            (out_rank is None or out_rank > 1):
        return 0 if axis == 0 else None
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
    if index != 0 or isinstance(batch, Stacked):
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
    example = row * _middle_size(middle)
    for out_axis in range(len(out_shape)):
        after = symbolic_shapes.product(out_shape[out_axis + 1:])
        if after is not None:
            if shapes.equal(after, example, op):
                return out_axis
            if middle and shapes.equal(after, row, op):
                return Folded(middle, out_axis)
            if not middle:
                fold = _new_fold(in_shape[pos + 1:], after, shapes, op)
                if fold is not None:
                    return Folded(fold, out_axis)
        dim = out_shape[out_axis]
        if dim is None or dim.static != 1:
            break
    return None


def _new_fold(example_dims, after, shapes, op):
    """The leading example dims T... when the rest hold `after` entries.

    A dynamic T (`[B, None, D]` -> `[-1, D]`, the tensordot of a dense
    layer on a padded batch) is kept as its symbolic `Dim`: row-major order
    makes row n of the output entry (n // T, n % T) whatever T is at run
    time, so the fold is exact as long as the rows hold exactly the
    trailing dims' entries, which the symbolic comparison proves."""
    # Up to all of them: `[B, T]` -> `[B*T]` (labels flattened for a
    # per-token loss) folds T with nothing left per row.
    for j in range(1, len(example_dims) + 1):
        lead = example_dims[:j]
        if any(d is None for d in lead):
            return None
        if shapes.equal(symbolic_shapes.product(example_dims[j:]), after,
                        op):
            return tuple(_middle_entry(d) for d in lead)
    return None


def _middle_entry(dim):
    """A `Folded.middle` entry: the int when static, else the `Dim`."""
    return dim.static if dim.static is not None else dim


def _middle_size(middle):
    """The number of rows one example has in a fold, as a `Dim`."""
    out = symbolic_shapes.ONE
    for d in middle:
        out = out * _as_dim(d)
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
    if rank is None or isinstance(batch, Stacked) or pos < 0:
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


def _tile_rows(op, index, desc, shapes):
    """`tf.tile` with m > 1 copies along the batch axis repeats the whole
    axis: row `k*R + r` is row r (R rows), so a batch (or c stacked
    copies of it) becomes m (m*c) stacked copies; tiling other axes
    keeps the batch where it is."""
    del shapes
    multiples = _const(op.inputs[1])
    pos = _position(desc)
    if index != 0 or multiples is None or pos < 0:
        return None
    m = multiples[pos]
    if m == 1:
        return _move(_tile, op, index, desc)
    if m < 1 or isinstance(desc, Folded):
        return None
    return Stacked(_copies(desc) * m, pos)


def _copies(desc):
    return desc.copies if isinstance(desc, Stacked) else 1


def _concat_rows(op, index, desc, shapes):
    """`tf.concat` along another axis keeps the batch. Along the batch
    axis, input k's rows start after the rows of inputs 0..k-1: when every
    input has the same (symbolic) size R there, input k's row r is output
    row `k*R + r`, so N inputs holding the batch (c stacked copies) give N
    (N*c) stacked copies (the Transformer's heads moved to axis 0)."""
    n = op.get_attr("N")
    concat_axis = _const(op.inputs[n])
    rank = _rank(op.outputs[0])
    pos = _position(desc)
    if index >= n or concat_axis is None or rank is None or pos < 0:
        return None
    if concat_axis[0] % rank != pos:
        return _move(_concat, op, index, desc)
    if isinstance(desc, Folded):
        return None
    dims = [shapes.shape(t) for t in op.inputs[:n]]
    if any(d is None or len(d) <= pos or d[pos] is None for d in dims):
        return None
    if not all(shapes.equal(d[pos], dims[index][pos], op) for d in dims):
        return None
    return Stacked(_copies(desc) * n, pos)


def _split_rows(op, index, desc, shapes):
    """`tf.split` along another axis keeps the batch. `Split` cuts the
    batch axis into equal runs: with c stacked copies cut into s pieces (s
    dividing c), piece k holds copies `k*c/s .. (k+1)*c/s - 1`, each a
    whole batch (s == c: the batch itself). A plain batch cut, or uneven
    sizes (`SplitV`), mixes."""
    del shapes
    value_index, axis_index = (1, 0) if op.type == "Split" else (0, 2)
    split_axis = _const(op.inputs[axis_index])
    rank = _rank(op.inputs[value_index])
    pos = _position(desc)
    if index != value_index or split_axis is None or rank is None or \
            pos < 0:
        return None
    if split_axis[0] % rank != pos:
        return _move(_split, op, index, desc)
    if op.type != "Split" or not isinstance(desc, Stacked):
        return None
    pieces = op.get_attr("num_split")
    if pieces < 1 or desc.copies % pieces:
        return None
    per = desc.copies // pieces
    return pos if per == 1 else Stacked(per, pos)


def _reverse_sequence(op, index, axis):
    """`tf.reverse_sequence`: slice k of `batch_dim` has its first
    `seq_lengths[k]` entries along `seq_dim` reversed. Every entry stays in
    its slice of every axis but `seq_dim` (there it moves within the
    slice), so a batch on any other axis stays where it is, and
    `seq_lengths` (one per slice of `batch_dim`) puts its batch on
    `batch_dim`. A batch on `seq_dim` is reversed across examples: mixes.
    (bidirectional_dynamic_rnn's backward direction, with batch_dim=0 on
    batch-major inputs.)"""
    seq_dim, batch_dim = op.get_attr("seq_dim"), op.get_attr("batch_dim")
    if index == 1:
        return batch_dim if axis == 0 else None
    if index != 0 or axis == seq_dim:
        return None
    return axis


def _one_hot(op, index, axis):
    """`tf.one_hot(indices, depth, axis=a)`: entry i of the indices becomes
    the depth-vector at i, a new axis at `a` (-1: last); the batch axis of
    the indices moves past it. depth and the on/off values are scalars."""
    new = op.get_attr("axis")
    rank = _rank(op.inputs[0])
    if index != 0 or rank is None:
        return None
    if new == -1:
        new = rank
    return axis + 1 if new <= axis else axis


def _roll(op, index, axis):
    """`tf.roll`: entries move along the rolled axes only, so a batch on
    another axis stays; rolled along the batch axis (in-batch negatives'
    `tf.roll(d, 1, axis=0)`), example i meets example i-1: mixes."""
    shift_axes = _const(op.inputs[2])
    rank = _rank(op.inputs[0])
    if index != 0 or shift_axes is None or rank is None:
        return None
    if axis in [a % rank for a in shift_axes]:
        return None
    return axis


def _parse_example(op, index, axis):
    """Example b's features come from serialized record b alone: the dense
    values hold the batch on axis 0; the sparse (and ragged) outputs list
    the entries of all examples together, so they mix."""
    if index != 0 or axis != 0:
        return None
    if op.type == "ParseExample":
        n_sparse, n_dense = op.get_attr("Nsparse"), op.get_attr("Ndense")
    else:
        n_sparse = op.get_attr("num_sparse")
        n_dense = len(op.get_attr("Tdense"))
    out = [None] * len(op.outputs)
    for k in range(3 * n_sparse, 3 * n_sparse + n_dense):
        out[k] = 0
    return out


def _shape(op, index, axis):
    """`tf.shape`, `tf.rank`, `tf.size`: the batch *size* flows on (the
    row-wise proof follows it), no rows do."""
    del index, axis
    return [NO_PATH] * len(op.outputs)


class Folded(collections.namedtuple("Folded", ["middle", "axis"])):
    """Rows folded from the batch: axis `axis` holds (example, t...) pairs.

    `tf.tensordot` (Keras Dense on `[B, T..., D]`) reshapes to `[B*T, D]`,
    multiplies, and reshapes back; Keras LayerNormalization reshapes to
    `[1, B*T, D, 1]`. `middle` is the `T...` shape: an int where static, a
    `symbolic_shapes.Dim` where T is dynamic (the same symbol wherever the
    graph's shapes prove the same T). Ops that move or
    keep an axis treat a folded axis like a plain one; reshapes and
    batch normalization look at the fold itself.
    """

    def __new__(cls, middle, axis=0):
        return super(Folded, cls).__new__(cls, tuple(middle), axis)


class Stacked(collections.namedtuple("Stacked", ["copies", "axis"])):
    """Rows stacked from the batch: axis `axis` holds `copies` blocks of B
    rows, row `k*B + b` belonging to example b.

    The TF1 Transformers' heads on axis 0 (`tf.concat(tf.split(q, h,
    axis=2), axis=0)`: `[h*B, T, D/h]`) and `tf.tile(x, [h, 1])` make it;
    `tf.split(.., h, axis=0)` takes the blocks apart again. Ops that move
    or keep an axis treat it like a plain one; a reshape does not follow it.
    """


class ListOf(collections.namedtuple("ListOf", ["axis"])):
    """A TensorList (variant) whose items hold the batch at `axis` (an RNN's
    unstacked inputs `[T, B, D]` -> items `[B, D]`, its output sequence)."""


# v1 control flow passes its data through unchanged, so the batch stays on
# its axis; the back edge (NextIteration into Merge) carries it into the
# next iteration.
_CONTROL_FLOW = graph.V1_CONTROL_FLOW
_SWITCHES = frozenset(["Switch", "RefSwitch"])


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
# The batch *size* through an op: the row-wise proof's `sizes` entries
# (`proof_values`). `tf.zeros(tf.stack([tf.shape(x)[0], H]))` makes rows
# of a new tensor; a batch size used any other way (a copy sees 1) is not
# proved.

def _size_of(t, v):
    """The proof's value of `tf.shape(t)` for `t` holding `v`."""
    if isinstance(v, Rows) and isinstance(v.desc, ListOf):
        return SAME      # a list is a scalar variant
    rank = t.shape.rank
    if not isinstance(v, Rows) or rank is None:
        return UNKNOWN
    if isinstance(v.desc, int):
        return Dims(tuple("B" if k == v.desc else "="
                                 for k in range(rank)))
    return Dims(tuple("?" if k == v.desc.axis else "="
                             for k in range(rank)))


def _size_shape(op, ins):
    """`tf.shape(x)`: B where x holds its rows (`_size_of`)."""
    return [_size_of(op.inputs[0], ins[0])]


def _size_shape_n(op, ins):
    """`tf.shape_n`: each like `_size_shape`."""
    return [_size_of(t, v) if v is not None else None
            for t, v in zip(op.inputs, ins)]


def _size_same(op, ins):
    """A rank, a list length: the same in the batch and in a copy."""
    return [SAME]


def _size_cast(op, ins):
    """The batch size cast to another int type stays the size; to a float
    it would enter arithmetic (a copy sees 1): not proved."""
    v = ins[0]
    if sized(v):
        if not op.outputs[0].dtype.is_integer:
            raise NotProved("%s casts the batch size to %s" % (
                op_text(op), op.outputs[0].dtype.name))
        return [v]
    return AS_ROWS


def _size_identity(op, ins):
    """The batch size passes through."""
    if sized(ins[0]):
        return [ins[0]]
    return AS_ROWS


def _size_strided_slice(op, ins):
    """Entries of a shape vector picked (`tf.shape(x)[0]` is B)."""
    v = ins[0]
    if not isinstance(v, Dims):
        if any(sized(w) for w in ins[1:]):
            raise NotProved("%s slices at positions built from the "
                            "batch size" % op_text(op))
        return AS_ROWS
    picked = symbolic_shapes.slice_vector(
        op, list(v.entries),
        *(_const(t) for t in op.inputs[1:4]))
    if picked is None:
        return [UNKNOWN]
    if isinstance(picked, str):
        return [{"B": SIZE, "=": SAME}.get(picked, UNKNOWN)]
    return [Dims(tuple(picked))]


def _size_expand_dims(op, ins):
    """B made a vector `[B]`."""
    if ins[0] == SIZE and ins[1] in (None, SAME) and \
            const_ints(op.inputs[1]) in ([0], [-1]):
        return [Dims(("B",))]
    if sized(ins[0]) or sized(ins[1]):
        return [UNKNOWN]
    return AS_ROWS


def _size_pack(op, ins):
    """`tf.stack([B, H])`: a shape vector."""
    if not any(sized(v) for v in ins):
        return AS_ROWS
    if op.get_attr("axis") != 0 or op.outputs[0].shape.rank != 1:
        return [UNKNOWN]
    entries = []
    for v in ins:
        if v == SIZE:
            entries.append("B")
        elif v in (None, SAME):
            entries.append("=")
        else:
            return [UNKNOWN]
    return [Dims(tuple(entries))]


def _size_concat(op, ins):
    """`tf.concat` of shape vectors."""
    n = op.get_attr("N")
    if not any(isinstance(v, Dims) for v in ins[:n]):
        return AS_ROWS
    if op.outputs[0].shape.rank != 1:
        return [UNKNOWN]
    entries = []
    for t, v in zip(op.inputs[:n], ins[:n]):
        if isinstance(v, Dims):
            entries.extend(v.entries)
        elif v in (None, SAME) and t.shape.is_fully_defined():
            entries.extend("=" * t.shape.num_elements())
        else:
            return [UNKNOWN]
    return [Dims(tuple(entries))]


def _size_fill(op, ins):
    """`tf.fill(dims, value)`: a new tensor with B on one axis is rows
    there (value the same everywhere)."""
    dims, value = ins
    if value not in (None, SAME):
        raise NotProved("%s fills with a value that depends on batch "
                        "data" % op_text(op))
    return [new_rows(op, dims)]


def _size_broadcast_to(op, ins):
    """`tf.broadcast_to(v, dims)` onto a shape with B on one axis."""
    v, dims = ins
    if not isinstance(dims, Dims):
        return AS_ROWS
    out = new_rows(op, dims)
    rank = op.inputs[0].shape.rank
    if rank is None:
        raise NotProved("%s broadcasts a tensor of unknown rank"
                        % op_text(op))
    pos = out.desc - (len(dims.entries) - rank)
    if isinstance(v, Rows):
        if v.desc != pos:
            raise NotProved("%s broadcasts rows onto another axis"
                            % op_text(op))
    elif pos >= 0 and tf.compat.dimension_value(
            op.inputs[0].shape[pos]) != 1:
        raise NotProved("%s broadcasts a tensor with more than one entry "
                        "onto the batch axis" % op_text(op))
    return [out]


def _size_like(op, ins):
    """`zeros_like` / `ones_like`: rows where the input is rows."""
    return [ins[0]] if isinstance(ins[0], Rows) else [UNKNOWN]


def _size_list_reserve(op, ins):
    """A TensorList whose element shape has B on one axis: a list of
    rows (its items hold the batch there)."""
    shape, count = ins
    if count not in (None, SAME):
        raise NotProved("%s sizes a list from batch data" % op_text(op))
    if shape in (None, SAME):
        return [SAME]
    return [Rows(ListOf(new_rows(op, shape).desc))]


# --------------------------------------------------------------------------
# The table


class Entry(collections.namedtuple("Entry", ["axes", "sizes",
                                             "fold_aware"])):
    """What one op type does to the batch: the one table entry that the
    separation walk, the batch-source inference, the copy and boundary
    forms, the loop rules and the row-wise proof all read.

    axes: `fn(op, index, axis)` -> the outputs' descriptor (an axis, or a
      list with one per output) given the batch at input `index` on `axis`;
      None inside it means MIXES and NO_PATH means NO_BATCH (`forward`
      turns them into the sentinels). With `fold_aware`,
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


# Inside the per-op functions, None means MIXES and NO_PATH means
# NO_BATCH; `forward` turns them into the sentinels.
NO_PATH = NO_BATCH

_TABLE = {}
for _t in _ELEMENTWISE_UNARY | _ELEMENTWISE_BINARY:
    _TABLE[_t] = Entry(_elementwise)
for _t in _SPATIAL:
    _TABLE[_t] = Entry(_first_axis_only)
for _t in _REDUCTIONS:
    _TABLE[_t] = Entry(_reduction)
_TABLE.update({
    "Softmax": Entry(_last_axis_op), "LogSoftmax": Entry(_last_axis_op),
    "MatMul": Entry(_matmul), "BatchMatMul": Entry(_batch_matmul),
    "BatchMatMulV2": Entry(_batch_matmul),
    "BatchMatMulV3": Entry(_batch_matmul),
    "Einsum": Entry(_einsum), "Squeeze": Entry(_squeeze),
    "Transpose": Entry(_transpose),
    "SparseSoftmaxCrossEntropyWithLogits": Entry(_xent),
    "SoftmaxCrossEntropyWithLogits": Entry(_xent),
    "Pad": Entry(_pad), "PadV2": Entry(_pad), "MirrorPad": Entry(_pad),
    "Slice": Entry(_slice), "GatherV2": Entry(_gather),
    "ResourceGather": Entry(_gather),
    "Tile": Entry(_tile_rows, fold_aware=True),
    "Split": Entry(_split_rows, fold_aware=True),
    "SplitV": Entry(_split_rows, fold_aware=True),
    "Unpack": Entry(_unpack),
    "ReverseSequence": Entry(_reverse_sequence), "OneHot": Entry(_one_hot),
    "Roll": Entry(_roll),
    "ParseExample": Entry(_parse_example),
    "ParseExampleV2": Entry(_parse_example),
    "Reshape": Entry(_reshape, fold_aware=True),
    "FusedBatchNorm": Entry(_batch_norm, fold_aware=True),
    "FusedBatchNormV2": Entry(_batch_norm, fold_aware=True),
    "FusedBatchNormV3": Entry(_batch_norm, fold_aware=True),
    # Where the batch size flows (the row-wise proof reads `sizes`).
    "Shape": Entry(_shape, _size_shape),
    "ShapeN": Entry(_shape, _size_shape_n),
    "Rank": Entry(_shape, _size_same),
    "Size": Entry(_shape),
    "TensorListLength": Entry(sizes=_size_same),
    "Cast": Entry(_elementwise, _size_cast),
    "Identity": Entry(_elementwise, _size_identity),
    "ZerosLike": Entry(_elementwise, _size_like),
    "OnesLike": Entry(_elementwise, _size_like),
    "StridedSlice": Entry(_strided_slice, _size_strided_slice),
    "ExpandDims": Entry(_expand_dims, _size_expand_dims),
    "Pack": Entry(_pack, _size_pack),
    "ConcatV2": Entry(_concat_rows, _size_concat, fold_aware=True),
    "Fill": Entry(sizes=_size_fill),
    "BroadcastTo": Entry(sizes=_size_broadcast_to),
    "TensorListReserve": Entry(sizes=_size_list_reserve),
    "EmptyTensorList": Entry(sizes=_size_list_reserve),
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
    """A negative (from the end) position made positive where t's rank is known."""
    rank = _rank(t)
    if rank is None or isinstance(axis, ListOf):
        return axis
    if isinstance(axis, (Folded, Stacked)):
        return axis if axis.axis >= 0 else axis._replace(
            axis=axis.axis + rank)
    return axis + rank if axis < 0 else axis




def known(op):
    """Whether the table has an entry for `op`'s type (loops aside)."""
    entry = _TABLE.get(op.type)
    return ((entry is not None and entry.axes is not None) or
            op.type in _CONTROL_FLOW or op.type in _LIST_OPS)


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
        if op.type in _CONTROL_FLOW:
            # A Switch's predicate picks the branch for the whole batch.
            return None if op.type in _SWITCHES and index == 1 else axis
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
        return _move(fn, op, index, axis)
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
    return all(shapes.equal(_as_dim(x), _as_dim(y), op)
               for x, y in zip(a.middle, b.middle))


def _as_dim(entry):
    return entry if isinstance(entry, symbolic_shapes.Dim) else \
        symbolic_shapes.Dim.of(entry)


def _position(desc):
    """The axis of a plain, folded or stacked batch descriptor."""
    return desc.axis if isinstance(desc, (Folded, Stacked)) else desc


def _move(fn, op, index, desc):
    """An entry that moves or keeps whole axes (`fn(op, index, axis)`),
    applied to any descriptor: a folded or stacked axis is moved like a
    plain one, its rows staying what they are."""
    position = _position(desc)
    if position < 0 and fn is not _elementwise:
        return None     # only broadcasting knows axes from the end
    out = fn(op, index, position)
    if not isinstance(desc, (Folded, Stacked)):
        return out

    def rewrap(d):
        if d is None or d is NO_PATH or not isinstance(d, int):
            return d
        return desc._replace(axis=d)
    return [rewrap(d) for d in out] if isinstance(out, list) else rewrap(out)


def _stack_candidates(like, output):
    """Numbers of stacked copies an input might hold for an output holding
    the batch at `like`: the divisors of like's copies (a concat or tile
    of stacked inputs), and the pieces of a `Split` times like's copies."""
    copies = like.copies if isinstance(like, Stacked) else 1
    out = set(c for c in range(2, copies + 1) if copies % c == 0)
    if output is not None and output.op.type == "Split":
        out.add(copies * output.op.get_attr("num_split"))
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
                    middle = tuple(_middle_entry(d) for d in after[:n])
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
            _position(like)
        out.extend(ListOf(j) for j in range(max(depth, 0) + 2))
    return out


# Public views of the op sets, for the analyses that build on the table.
ELEMENTWISE = frozenset(t for t, e in _TABLE.items()
                        if e.axes is _elementwise)
const_ints = _const

# Ops whose copy (or second run) would draw new random numbers.
RANDOM = frozenset([
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal",
    "TruncatedNormal", "Multinomial", "RandomShuffle", "RandomGamma",
    "RandomPoisson", "RandomPoissonV2", "ParameterizedTruncatedNormal",
    "StatefulUniform", "StatefulUniformInt", "StatefulStandardNormalV2",
    "StatefulTruncatedNormal", "StatefulUniformFullInt",
    "StatefulRandomBinomial", "RandomShuffleQueueV2"])
