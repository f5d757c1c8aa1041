"""The values of the row-wise proof (`custagg.batch_axis.rowwise`).

Each tensor that depends on batch data gets one of these; the batch-axis
table's entries say how an op maps them (`table.Entry`: `axes` for `Rows`,
`sizes` for the batch size):

* `Rows(d)`: example b's entries are the slice `b` of batch descriptor `d`
  (an axis, a `table.Folded` axis, or a `table.ListOf` for TensorLists) and
  depend on example b's rows alone;
* `SAME`: a value equal in the batch and in every copy of one example;
* `Dims(entries)`: an int vector of dimensions, each "B" (the batch size,
  1 in a copy), "=" (the same in both) or "?" (anything else built from
  B); `SIZE` is the scalar B;
* `UNKNOWN`: an output the proof cannot describe (an error only if used).

Imports nothing of custagg: the table and the proof both build on it.
"""

from __future__ import annotations

import collections

SAME = "same"
SIZE = "size"
UNKNOWN = "unknown"
# What a `sizes` entry returns when no batch size is involved: the op's
# `axes` entry decides (the proof's `rows_op`).
AS_ROWS = "as rows"


class Rows(collections.namedtuple("Rows", ["desc"])):
    """Example b's entries are slice b along `desc`, from example b alone."""


class Dims(collections.namedtuple("Dims", ["entries"])):
    """An int vector of dimensions: each "B", "=" or "?" (see the module)."""


class NotProved(Exception):
    """The graph is not proved row-wise; the message says where and why."""


def sized(v):
    """Whether `v` is built from the batch size (`SIZE` or `Dims`)."""
    return v == SIZE or isinstance(v, Dims)


def op_text(op):
    return "op '%s' (type %s)" % (op.name, op.type)


def new_rows(op, dims):
    """Rows(p) for a new tensor of shape `dims` with "B" at p only."""
    if not isinstance(dims, Dims):
        raise NotProved("%s makes a tensor whose shape depends on batch "
                        "data in a way the proof cannot read"
                        % op_text(op))
    where = [k for k, e in enumerate(dims.entries) if e != "="]
    if len(where) != 1 or dims.entries[where[0]] != "B":
        raise NotProved("%s makes a tensor with the batch size on %s "
                        "axes" % (op_text(op), len(where) or "no"))
    return Rows(where[0])
