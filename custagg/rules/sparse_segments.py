"""Rules for sparse segment reductions: `SparseSegmentSum/Mean/SqrtN`.

`z = sparse_segment_sum(data, indices, segment_ids)`: row s of z sums the
rows `data[indices[j]]` over the entries j with `segment_ids[j] == s`
(Mean divides by the number n_s of such entries, SqrtN by its square
root). Feature columns' `embedding_lookup_sparse` makes z `[B, D]`, one
row per example (the sparse tensor's rows, empty ones filled): when the
batch-axis walk proves that row s of z reaches only loss s, example s's
gradient with respect to data is

    g_s = sum_{j : segment_ids[j] == s} w_j e_{indices[j]} (x) dz_s

(w_j = 1, 1/n_s or 1/sqrt(n_s)): the rows `w_j dz_s` at rows `indices[j]`
of data, nothing elsewhere. data is usually the gather of an embedding
table by the unique ids of the batch: the rules see through that gather
(`lookup_into_segments`) and key the rows by table row `ids[indices[j]]`
instead, so x is the table itself and nothing `[B, U, D]` is gathered
back.
"""

import tensorflow as tf
from custagg import _tf_compat
from custagg import op_kinds
from custagg._tf_compat import tensor_util
from custagg.rules import gather as gather_rules
from custagg.rules import registry


def lookup_into_segments(op):
    """Whether gather `op` (`ResourceGather` or `GatherV2` along axis 0 of
    a table of static shape) feeds only sparse segment reductions, as their
    data: `embedding_lookup_sparse`'s gather of the batch's unique ids.
    The rules then see through it (`shortcuts.passes_through`): the
    gathered rows are not examples, but the segment rule reads the ids
    and keys each example's gradient rows by table row."""
    if op.type not in op_kinds.RULE_GATHERS or \
            op.get_attr("batch_dims") != 0:
        return False
    if op.type == "GatherV2":
        axis = tensor_util.constant_value(op.inputs[2])
        if axis is None or int(axis) != 0:
            return False
    ends = []
    stack = [op.outputs[0]]
    while stack:
        t = stack.pop()
        consumers = _tf_compat.forward_consumers(t)
        if not consumers:
            return False
        for c in consumers:
            if c.type in op_kinds.IDENTITIES:   # embedding_lookup's Identity
                stack.append(c.outputs[0])
                continue
            if c.type not in op_kinds.SPARSE_SEGMENT_REDUCTIONS or \
                    c.inputs[0] is not t or any(u is t for u in c.inputs[1:]):
                return False
            ends.append(c)
    return bool(ends) and _table_dims(op) is not None


def _lookup_of(data):
    """The gather op behind `data` (through identities), or None."""
    t = data
    while t.op.type in op_kinds.IDENTITIES:
        t = t.op.inputs[0]
    return t.op if lookup_into_segments(t.op) else None


def _table_dims(gather_op):
    return gather_rules.table_shape(gather_op.inputs[0])


class _Entries(object):
    """One row per entry j: its example (segment), data row, and the row
    `w_j dz_s` of example s's gradient."""

    def __init__(self, ctx):
        op = ctx.op
        data = op.inputs[0]
        g = ctx.grad                                              # [B, *D]
        self.row_dims = data.shape.as_list()[1:]
        self.batch = tf.shape(g, out_type=tf.int64)[0]
        self.index = tf.cast(op.inputs[1], tf.int64)              # [N]
        lookup = _lookup_of(data)
        if lookup is not None:
            # Seen through the gather: rows of the table, `ids[index[j]]`.
            self.rows = tf.constant(_table_dims(lookup)[0], tf.int64)
            self.index = tf.gather(tf.cast(lookup.inputs[1], tf.int64),
                                   self.index)
        else:
            self.rows = tf.shape(data, out_type=tf.int64)[0]      # U
        self.segment = tf.cast(op.inputs[2], tf.int64)            # [N]
        values = tf.gather(g, self.segment)                       # [N, *D]
        kind = op.type
        if kind != "SparseSegmentSum":
            n = tf.math.unsorted_segment_sum(
                tf.ones_like(self.segment, g.dtype), self.segment,
                self.batch)
            n = tf.gather(n, self.segment)
            w = 1.0 / (n if kind == "SparseSegmentMean" else tf.sqrt(n))
            values = values * tf.reshape(w, [-1] + [1] * (g.shape.rank - 1))
        self.values = values
        # (example, data row) of each entry, as one key.
        self.keys = self.segment * self.rows + self.index

    def merged(self):
        """(unique keys, summed rows): an example's entries on one data row
        added before squaring."""
        unique, pos = tf.unique(self.keys, out_idx=tf.int64)
        return unique, tf.math.unsorted_segment_sum(
            self.values, pos, tf.size(unique, out_type=tf.int64))


@registry.register_rule(*sorted(op_kinds.SPARSE_SEGMENT_REDUCTIONS))
class SparseSegmentRule(registry.Rule):
    """Per-example gradient of `data`: `[B, U, *D]` (U rows of data); of
    the table `[B, V, *D]` when data is a lookup the rules see through
    (`lookup_into_segments`)."""

    def unsupported(self, ctx):
        if ctx.input_index != 0:
            return "the parameter is the indices or segment ids, not the data"
        shape = ctx.op.inputs[0].shape
        if shape.rank in (None, 0) or not shape[1:].is_fully_defined():
            return "the data's row shape is not static"
        return None

    def per_example(self, ctx):
        e = _Entries(ctx)
        return gather_rules.rows_by_example(e.values, e.keys, e.batch,
                                            e.rows, e.row_dims)

    def squared_norms(self, ctx):
        e = _Entries(ctx)
        unique, merged = e.merged()
        per_key = tf.reduce_sum(
            tf.reshape(tf.square(merged), [tf.shape(merged)[0], -1]), 1)
        return tf.math.unsorted_segment_sum(per_key, unique // e.rows,
                                            e.batch)

    def weighted_sum(self, ctx, weights):
        e = _Entries(ctx)
        c = tf.gather(tf.cast(weights, e.values.dtype), e.segment)
        values = e.values * tf.reshape(c, [-1] + [1] * len(e.row_dims))
        return tf.math.unsorted_segment_sum(values, e.index, e.rows)

    def squared_sum(self, ctx):
        e = _Entries(ctx)
        unique, merged = e.merged()
        return tf.math.unsorted_segment_sum(tf.square(merged),
                                            unique % e.rows, e.rows)
