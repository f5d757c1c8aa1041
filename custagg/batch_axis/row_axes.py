"""The batch-axis table's per-op functions for ops that cut, join and
copy rows: pad, slices, gather, concat / stack / split / unstack, tile,
space-to-batch (dilated convolutions), transposed convolution, sequence
ops (reverse_sequence, roll, CTC loss), one_hot, ParseExample, and the
shape ops through which no rows flow.

Each is an `Entry.axes` of `custagg.batch_axis.table` (see
`custagg.batch_axis.shape_axes`).
"""

from __future__ import annotations

import tensorflow as tf

from custagg._tf_compat import tensor_util
from custagg.batch_axis.descriptors import Folded
from custagg.batch_axis.descriptors import NO_PATH
from custagg.batch_axis.descriptors import Stacked
from custagg.batch_axis.descriptors import axis_of
from custagg.batch_axis.descriptors import const_ints
from custagg.batch_axis.descriptors import rank_of
from custagg.batch_axis.shape_axes import move


def _entry(t, *position):
    """The constant entry of `t` at `position` (indices from the outside
    in), where the rest of t may be known only at run time (a `tf.stack`,
    or a list of tensors converted to one: `[0, (h1 - h2) // 2, ...]`),
    else None."""
    value = tensor_util.constant_value(t)
    if value is not None:
        return int(value[position])
    if t.op.type != "Pack" or t.op.get_attr("axis") != 0 or not position:
        return None
    if position[0] >= len(t.op.inputs):
        return None
    return _entry(t.op.inputs[position[0]], *position[1:])


def pad(op, index, axis):
    """The batch axis stays where it is padded by nothing (the other axes'
    paddings may be run-time sizes)."""
    pads = op.inputs[1]
    if index != 0 or _entry(pads, axis, 0) != 0 or \
            _entry(pads, axis, 1) != 0:
        return None
    return axis


def _concat(op, index, axis):
    n = op.get_attr("N")
    concat_axis = const_ints(op.inputs[n])
    rank = rank_of(op.outputs[0])
    if index >= n or concat_axis is None or rank is None:
        return None
    return None if concat_axis[0] % rank == axis else axis


def pack(op, index, axis):
    pack_axis = op.get_attr("axis")
    rank = rank_of(op.outputs[0])
    if rank is None:
        return None
    pack_axis %= rank
    return axis + 1 if pack_axis <= axis else axis


def strided_slice(op, index, axis):
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
    strides = const_ints(op.inputs[3])
    if n is None:
        return None
    ellipsis, new_axis, shrink = (op.get_attr(a) for a in (
        "ellipsis_mask", "new_axis_mask", "shrink_axis_mask"))
    begin_mask, end_mask = op.get_attr("begin_mask"), op.get_attr("end_mask")
    rank = rank_of(op.inputs[0])
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


def plain_slice(op, index, axis):
    """The batch axis survives a slice that takes all of it (begin 0, size
    -1 there; the other axes' offsets and sizes may be run-time values, as
    in a U-Net's `crop_and_concat`)."""
    if index != 0 or _entry(op.inputs[1], axis) != 0 or \
            _entry(op.inputs[2], axis) != -1:
        return None
    return axis


def gather(op, index, axis):
    if op.get_attr("batch_dims") != 0:
        return None
    if op.type == "GatherV2":
        gaxis = const_ints(op.inputs[2])
        if gaxis is None:
            return None
        gaxis = gaxis[0]
    else:
        gaxis = 0
    if index == 1:          # the ids carry the batch: out = ids.shape + rest
        return axis + gaxis
    if index == 0 and op.inputs[0].dtype != tf.resource:
        rank = rank_of(op.inputs[0])
        if rank is None or axis == gaxis % rank:
            return None
        ids_rank = rank_of(op.inputs[1])
        if ids_rank is None:
            return None
        return axis if axis < gaxis % rank else axis + ids_rank - 1
    return None


def _split(op, index, axis):
    value_index, axis_index = (1, 0) if op.type == "Split" else (0, 2)
    split_axis = const_ints(op.inputs[axis_index])
    rank = rank_of(op.inputs[value_index])
    if index != value_index or split_axis is None or rank is None:
        return None
    return None if split_axis[0] % rank == axis else axis


def unpack(op, index, axis):
    rank = rank_of(op.inputs[0])
    if rank is None:
        return None
    unpack_axis = op.get_attr("axis") % rank
    if unpack_axis == axis:
        return None
    return axis - 1 if unpack_axis < axis else axis


def _tile(op, index, axis):
    multiples = const_ints(op.inputs[1])
    if index != 0 or multiples is None or multiples[axis] != 1:
        return None
    return axis


def tile_rows(op, index, desc, shapes):
    """`tf.tile` with m > 1 copies along the batch axis repeats the whole
    axis: row `k*R + r` is row r (R rows), so a batch (or c stacked
    copies of it) becomes m (m*c) stacked copies; tiling other axes
    keeps the batch where it is."""
    del shapes
    multiples = const_ints(op.inputs[1])
    pos = axis_of(desc)
    if index != 0 or multiples is None or pos < 0:
        return None
    m = multiples[pos]
    if m == 1:
        return move(_tile, op, index, desc)
    if m < 1 or isinstance(desc, Folded):
        return None
    return Stacked(_copies(desc) * m, pos)


def _copies(desc):
    return desc.copies if isinstance(desc, Stacked) else 1


def concat_rows(op, index, desc, shapes):
    """`tf.concat` along another axis keeps the batch. Along the batch
    axis, input k's rows start after the rows of inputs 0..k-1: when every
    input has the same (symbolic) size R there, input k's row r is output
    row `k*R + r`, so N inputs holding the batch (c stacked copies) give N
    (N*c) stacked copies (the Transformer's heads moved to axis 0)."""
    n = op.get_attr("N")
    concat_axis = const_ints(op.inputs[n])
    rank = rank_of(op.outputs[0])
    pos = axis_of(desc)
    if index >= n or concat_axis is None or rank is None or pos < 0:
        return None
    if concat_axis[0] % rank != pos:
        return move(_concat, op, index, desc)
    if isinstance(desc, Folded):
        return None
    dims = [shapes.shape(t) for t in op.inputs[:n]]
    if any(d is None or len(d) <= pos or d[pos] is None for d in dims):
        return None
    if not all(shapes.equal(d[pos], dims[index][pos], op) for d in dims):
        return None
    return Stacked(_copies(desc) * n, pos)


def split_rows(op, index, desc, shapes):
    """`tf.split` along another axis keeps the batch. `Split` cuts the
    batch axis into equal runs: with c stacked copies cut into s pieces (s
    dividing c), piece k holds copies `k*c/s .. (k+1)*c/s - 1`, each a
    whole batch (s == c: the batch itself). A plain batch cut, or uneven
    sizes (`SplitV`), mixes."""
    del shapes
    value_index, axis_index = (1, 0) if op.type == "Split" else (0, 2)
    split_axis = const_ints(op.inputs[axis_index])
    rank = rank_of(op.inputs[value_index])
    pos = axis_of(desc)
    if index != value_index or split_axis is None or rank is None or \
            pos < 0:
        return None
    if split_axis[0] % rank != pos:
        return move(_split, op, index, desc)
    if op.type != "Split" or not isinstance(desc, Stacked):
        return None
    pieces = op.get_attr("num_split")
    if pieces < 1 or desc.copies % pieces:
        return None
    per = desc.copies // pieces
    return pos if per == 1 else Stacked(per, pos)


def blocks(op):
    """prod(block_shape) of a SpaceToBatchND / BatchToSpaceND when static."""
    block = const_ints(op.inputs[1])
    if block is None:
        return None
    n = 1
    for b in block:
        n *= b
    return n


def space_to_batch_rows(op, index, desc, shapes):
    """`SpaceToBatchND` (TF's lowering of dilated convolutions) cuts each
    image into n = prod(block_shape) blocks and stacks them on the batch
    axis block-major: output row `k*R + r` is block k of input row r, so a
    batch (c stacked copies) on axis 0 becomes n (n*c) stacked copies.
    `BatchToSpaceND` undoes it: output row r gathers input rows `k*R' + r`
    (R' its rows), so n*c' stacked copies become c' (c' = 1: the batch
    itself) and a batch not stacked n times mixes. The batch on another
    axis (a spatial one is cut into blocks) mixes."""
    del shapes
    n = blocks(op)
    if index != 0 or n is None or n < 1 or isinstance(desc, Folded) or \
            axis_of(desc) != 0:
        return None
    if op.type == "SpaceToBatchND":
        return Stacked(_copies(desc) * n, 0) if n > 1 else desc
    copies = _copies(desc)
    if copies % n:
        return None
    per = copies // n
    return 0 if per == 1 else Stacked(per, 0)


def transposed_conv(op, index, axis):
    """`Conv2DBackpropInput` as a layer (`conv2d_transpose`): its output
    rows are its input's (`out_backprop`, input 2); the sizes (input 0)
    and the filter carry no rows."""
    return 0 if index == 2 and axis == 0 else None


def reverse_sequence(op, index, axis):
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


def one_hot(op, index, axis):
    """`tf.one_hot(indices, depth, axis=a)`: entry i of the indices becomes
    the depth-vector at i, a new axis at `a` (-1: last); the batch axis of
    the indices moves past it. depth and the on/off values are scalars."""
    new = op.get_attr("axis")
    rank = rank_of(op.inputs[0])
    if index != 0 or rank is None:
        return None
    if new == -1:
        new = rank
    return axis + 1 if new <= axis else axis


def roll(op, index, axis):
    """`tf.roll`: entries move along the rolled axes only, so a batch on
    another axis stays; rolled along the batch axis (in-batch negatives'
    `tf.roll(d, 1, axis=0)`), example i meets example i-1: mixes."""
    shift_axes = const_ints(op.inputs[2])
    rank = rank_of(op.inputs[0])
    if index != 0 or shift_axes is None or rank is None:
        return None
    if axis in [a % rank for a in shift_axes]:
        return None
    return axis


def parse_example(op, index, axis):
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


def ctc_loss(op, index, axis):
    """`CTCLoss` / `CTCLossV2` (`tf.compat.v1.nn.ctc_loss`): the logits are
    time-major `[T, B, C]` (the Python function transposes batch-major
    logits itself), `sequence_length` is `[B]`; output 0 is the `[B]`
    loss, output 1 the `[T, B, C]` gradient, example b's from its own
    column b (its own labels and length). The sparse labels list every
    example's entries together: mixes."""
    if (index == 0 and axis == 1) or (index == 3 and axis == 0):
        return [0, 1]
    return None


def no_rows(op, index, axis):
    """`tf.shape`, `tf.rank`, `tf.size`: the batch *size* flows on (the
    row-wise proof follows it), no rows do."""
    del index, axis
    return [NO_PATH] * len(op.outputs)
