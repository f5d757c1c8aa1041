"""The batch-axis table's per-op functions for math and shape ops:
elementwise (broadcasting), matmuls and einsum, reshapes (folds),
squeeze / expand_dims / transpose, reductions, the spatial ops, cross
entropy, batch normalization; and `move`, which applies a function that
moves whole axes to any descriptor.

Each is an `Entry.axes` of `custagg.batch_axis.table`: `fn(op, index,
axis)` (or, fold-aware, `fn(op, index, desc, shapes)`) -> the outputs'
descriptor, None meaning MIXES and NO_PATH meaning NO_BATCH.
"""

from __future__ import annotations

import tensorflow as tf

from custagg.batch_axis import symbolic_shapes
from custagg.batch_axis.descriptors import Folded
from custagg.batch_axis.descriptors import NO_PATH
from custagg.batch_axis.descriptors import Stacked
from custagg.batch_axis.descriptors import as_dim
from custagg.batch_axis.descriptors import axis_of
from custagg.batch_axis.descriptors import const_ints
from custagg.batch_axis.descriptors import rank_of


def elementwise(op, index, axis):
    """Broadcasting aligns axes from the right, so a batch axis counted from
    the end survives operands of unknown rank (an unshaped `keep_prob`).

    v1 `Select` (`tf.compat.v1.where`) with a vector condition and matrix
    branches does not broadcast: entry r of the condition picks row r
    (dynamic_rnn's `time >= sequence_length`), so it keeps axis 0."""
    in_rank, out_rank = rank_of(op.inputs[index]), rank_of(op.outputs[0])
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


def last_axis_op(op, index, axis):
    rank = rank_of(op.inputs[index])
    return None if rank is None or axis == rank - 1 else axis


def matmul(op, index, axis):
    ta, tb = op.get_attr("transpose_a"), op.get_attr("transpose_b")
    if index == 0:
        row_axis = 1 if ta else 0
        return 0 if axis == row_axis else None
    col_axis = 0 if tb else 1
    return 1 if axis == col_axis else None


def batch_matmul(op, index, axis):
    rank, out_rank = rank_of(op.inputs[index]), rank_of(op.outputs[0])
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


def einsum(op, index, axis):
    eq = op.get_attr("equation").decode().replace(" ", "")
    if "..." in eq or "->" not in eq:
        return None
    ins, out = eq.split("->")
    sub = ins.split(",")[index]
    letter = sub[axis]
    return out.index(letter) if letter in out else None


def reshape(op, index, batch, shapes):
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
            return tuple(middle_entry(d) for d in lead)
    return None


def middle_entry(dim):
    """A `Folded.middle` entry: the int when static, else the `Dim`."""
    return dim.static if dim.static is not None else dim


def _middle_size(middle):
    """The number of rows one example has in a fold, as a `Dim`."""
    out = symbolic_shapes.ONE
    for d in middle:
        out = out * as_dim(d)
    return out


def squeeze(op, index, axis):
    dims = list(op.get_attr("squeeze_dims"))
    rank = rank_of(op.inputs[0])
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


def expand_dims(op, index, axis):
    dim = const_ints(op.inputs[1])
    out_rank = rank_of(op.outputs[0])
    if index != 0 or dim is None or out_rank is None:
        return None
    d = dim[0] % out_rank
    return axis + 1 if d <= axis else axis


def transpose(op, index, axis):
    perm = const_ints(op.inputs[1])
    if index != 0 or perm is None:
        return None
    return perm.index(axis)


def reduction(op, index, axis):
    axes = const_ints(op.inputs[1])
    rank = rank_of(op.inputs[0])
    if index != 0 or axes is None or rank is None:
        return None
    axes = [a % rank for a in axes]
    if axis in axes:
        return None
    if op.get_attr("keep_dims"):
        return axis
    return axis - sum(1 for a in axes if a < axis)


def first_axis_only(op, index, axis):
    return 0 if index == 0 and axis == 0 else None


def xent(op, index, axis):
    return 0 if axis == 0 else None


def batch_norm(op, index, batch, shapes):
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
    rank = rank_of(op.inputs[0])
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


def move(fn, op, index, desc):
    """An entry that moves or keeps whole axes (`fn(op, index, axis)`),
    applied to any descriptor: a folded or stacked axis is moved like a
    plain one, its rows staying what they are."""
    position = axis_of(desc)
    if position < 0 and fn is not elementwise:
        return None     # only broadcasting knows axes from the end
    out = fn(op, index, position)
    if not isinstance(desc, (Folded, Stacked)):
        return out

    def rewrap(d):
        if d is None or d is NO_PATH or not isinstance(d, int):
            return d
        return desc._replace(axis=d)
    return [rewrap(d) for d in out] if isinstance(out, list) else rewrap(out)
