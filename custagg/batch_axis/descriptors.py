"""The batch descriptors the batch-axis table speaks in, and the small
readers its per-op functions share.

A descriptor says which axis of a tensor holds the examples: an int axis, a
`Folded` or `Stacked` axis (rows made from the batch), a `ListOf` (a
TensorList whose items hold it); `MIXES` and `NO_BATCH` are the two
answers that are not an axis. `custagg.batch_axis.table` re-exports them.
"""

from __future__ import annotations

import collections

from custagg._tf_compat import tensor_util
from custagg.batch_axis import symbolic_shapes


class _Sentinel(object):
    """A named constant, distinct from None and from every descriptor."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name

    def __reduce__(self):
        return self.name


# The op may mix examples, or is not in the table (see `table`).
MIXES = _Sentinel("MIXES")
# This output (or input) carries no batch.
NO_BATCH = _Sentinel("NO_BATCH")


class Reason(str):
    """A reason string that also names the op it is about (or None), and
    its `cause`: the text without what is particular to one variable
    (a plan prints each cause once, with the variables it holds up)."""

    def __new__(cls, text, op=None, cause=None):
        self = super(Reason, cls).__new__(cls, text)
        self.op = op
        self.cause = cause if cause is not None else str(text)
        return self


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


# Inside the per-op functions, None means MIXES and NO_PATH means
# NO_BATCH; `forward` turns them into the sentinels.
NO_PATH = NO_BATCH


def const_ints(t):
    """The entries of constant `t` as a flat list of ints, else None."""
    value = tensor_util.constant_value(t)
    return None if value is None else [int(v) for v in value.reshape(-1)]


def rank_of(t):
    """The static rank of `t`, or None."""
    return t.shape.rank


def as_dim(entry):
    """A `Folded.middle` entry (an int or a `Dim`) as a `Dim`."""
    return entry if isinstance(entry, symbolic_shapes.Dim) else \
        symbolic_shapes.Dim.of(entry)


def axis_of(desc):
    """The axis of a plain, folded or stacked batch descriptor."""
    return desc.axis if isinstance(desc, (Folded, Stacked)) else desc
