"""The batch *size* through an op: the row-wise proof's `sizes` entries
of the batch-axis table (`custagg.batch_axis.table`, values from
`proof_values`). `tf.zeros(tf.stack([tf.shape(x)[0], H]))` makes rows of
a new tensor; a batch size used any other way (a copy sees 1) is not
proved.
"""

from __future__ import annotations

import tensorflow as tf

from custagg.batch_axis import symbolic_shapes
from custagg.batch_axis.descriptors import ListOf
from custagg.batch_axis.descriptors import const_ints
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


def size_shape(op, ins):
    """`tf.shape(x)`: B where x holds its rows (`_size_of`)."""
    return [_size_of(op.inputs[0], ins[0])]


def size_shape_n(op, ins):
    """`tf.shape_n`: each like `size_shape`."""
    return [_size_of(t, v) if v is not None else None
            for t, v in zip(op.inputs, ins)]


def size_same(op, ins):
    """A rank, a list length: the same in the batch and in a copy."""
    return [SAME]


def size_cast(op, ins):
    """The batch size cast to another int type stays the size; to a float
    it would enter arithmetic (a copy sees 1): not proved."""
    v = ins[0]
    if sized(v):
        if not op.outputs[0].dtype.is_integer:
            raise NotProved("%s casts the batch size to %s" % (
                op_text(op), op.outputs[0].dtype.name))
        return [v]
    return AS_ROWS


def size_identity(op, ins):
    """The batch size passes through."""
    if sized(ins[0]):
        return [ins[0]]
    return AS_ROWS


def size_strided_slice(op, ins):
    """Entries of a shape vector picked (`tf.shape(x)[0]` is B)."""
    v = ins[0]
    if not isinstance(v, Dims):
        if any(sized(w) for w in ins[1:]):
            raise NotProved("%s slices at positions built from the "
                            "batch size" % op_text(op))
        return AS_ROWS
    picked = symbolic_shapes.slice_vector(
        op, list(v.entries),
        *(const_ints(t) for t in op.inputs[1:4]))
    if picked is None:
        return [UNKNOWN]
    if isinstance(picked, str):
        return [{"B": SIZE, "=": SAME}.get(picked, UNKNOWN)]
    return [Dims(tuple(picked))]


def size_expand_dims(op, ins):
    """B made a vector `[B]`."""
    if ins[0] == SIZE and ins[1] in (None, SAME) and \
            const_ints(op.inputs[1]) in ([0], [-1]):
        return [Dims(("B",))]
    if sized(ins[0]) or sized(ins[1]):
        return [UNKNOWN]
    return AS_ROWS


def size_pack(op, ins):
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


def size_concat(op, ins):
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


def size_fill(op, ins):
    """`tf.fill(dims, value)`: a new tensor with B on one axis is rows
    there (value the same everywhere)."""
    dims, value = ins
    if value not in (None, SAME):
        raise NotProved("%s fills with a value that depends on batch "
                        "data" % op_text(op))
    return [new_rows(op, dims)]


def size_broadcast_to(op, ins):
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


def size_like(op, ins):
    """`zeros_like` / `ones_like`: rows where the input is rows."""
    return [ins[0]] if isinstance(ins[0], Rows) else [UNKNOWN]


def size_list_reserve(op, ins):
    """A TensorList whose element shape has B on one axis: a list of
    rows (its items hold the batch there)."""
    shape, count = ins
    if count not in (None, SAME):
        raise NotProved("%s sizes a list from batch data" % op_text(op))
    if shape in (None, SAME):
        return [SAME]
    return [Rows(ListOf(new_rows(op, shape).desc))]
