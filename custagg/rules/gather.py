"""Rules for embedding lookups: `ResourceGather` and `GatherV2` on a table.

`z = table[ids]` with ids `[B, ...]`: example b's gradient has the rows
`dz[b, t]` at rows `ids[b, t]` of the `[V, *D]` table, nothing elsewhere.
Norms and sums never densify a `[V, *D]` table per example: for norms each
example's ids are sorted so repeats sit side by side and a sorted segment sum
merges them (so `||g_b||` counts them correctly), and weighted sums stay
`IndexedSlices` like TF's own embedding gradients. Only `per_example` (asked for explicitly)
builds the dense `[B, V, *D]`.
"""

import tensorflow as tf
from custagg import registry
from custagg._tf_compat import resource_variable_ops
from custagg._tf_compat import tensor_util


def _table_shape(ctx):
    """Static dims of the table `[V, *D]` (from the handle for resources)."""
    p = ctx.param
    if p.dtype == tf.resource:
        data = resource_variable_ops.get_eager_safe_handle_data(p)
        if data is None or not data.is_set or len(data.shape_and_type) != 1:
            return None
        shape = tf.TensorShape(data.shape_and_type[0].shape)
    else:
        shape = p.shape
    if shape.rank is None or not shape.is_fully_defined():
        return None
    return shape.as_list()


class _Rows(object):
    """Example-keyed rows of the per-example table gradients."""

    def __init__(self, ctx):
        dims = _table_shape(ctx)
        self.vocab, self.row_dims = dims[0], dims[1:]
        ids = ctx.op.inputs[1]
        self.batch = tf.shape(ids, out_type=tf.int64)[0]
        width = 1
        for d in self.row_dims:
            width *= d
        self.ids = tf.reshape(tf.cast(ids, tf.int64), [-1])          # [B*T]
        self.values = tf.reshape(ctx.grad, [-1, width])               # [B*T, Dp]
        per_ex = tf.size(ids, out_type=tf.int64) // tf.maximum(
            self.batch, 1)
        example = tf.range(tf.size(self.ids, out_type=tf.int64)) // \
            tf.maximum(per_ex, 1)
        self.keys = example * self.vocab + self.ids                   # [B*T]

    def per_example_rows(self):
        """(ids `[B, T]`, rows `[B, T, Dp]`): each example's lookups."""
        return (tf.reshape(self.ids, [self.batch, -1]),
                tf.reshape(self.values, [self.batch, -1,
                                         self.values.shape[-1]]))

    def merged(self):
        """(unique keys, summed rows): repeated ids within an example merged."""
        unique, idx = tf.unique(self.keys, out_idx=tf.int64)
        rows = tf.math.unsorted_segment_sum(self.values, idx,
                                            tf.size(unique, out_type=tf.int64))
        return unique, rows


def _sorted_squared_norms(ids, rows):
    """`[B]` squared norms of each example's table gradient.

    Example b's gradient is the sum of `rows[b, t]` placed at table row
    `ids[b, t]`; rows with the same id add up before squaring. Sorting each
    example's ids puts repeats side by side, so a sorted segment sum over
    the `B*T` rows merges them (TF's sorted segment sum is a contiguous
    reduction, far cheaper than `tf.unique` + an unsorted one).

    Args:
      ids: `[B, T]` ids.
      rows: `[B, T, Dp]` output gradients, one row per lookup.
    """
    order = tf.argsort(ids, axis=1, stable=True)                  # [B, T]
    ids = tf.gather(ids, order, batch_dims=1)
    rows = tf.gather(rows, order, batch_dims=1)
    batch = tf.shape(ids)[0]
    new = tf.concat([tf.ones([batch, 1], tf.bool),
                     tf.not_equal(ids[:, 1:], ids[:, :-1])], axis=1)
    segment = tf.cumsum(tf.reshape(tf.cast(new, tf.int32), [-1])) - 1
    merged = tf.math.segment_sum(
        tf.reshape(rows, [-1, tf.shape(rows)[2]]), segment)      # [S, Dp]
    example = tf.math.segment_max(
        tf.reshape(tf.tile(tf.range(batch)[:, None], [1, tf.shape(ids)[1]]),
                   [-1]), segment)                                # [S]
    return tf.math.unsorted_segment_sum(
        tf.reduce_sum(tf.square(merged), axis=1), example, batch)


@registry.register_rule("ResourceGather", "GatherV2")
class GatherRule(registry.Rule):
    """Per-example gradient of a gathered table: `[B, V, *D]` (dense only here)."""

    def unsupported(self, ctx):
        op = ctx.op
        if ctx.input_index != 0:
            return "the parameter is the indices, not the table"
        if op.get_attr("batch_dims") != 0:
            return "batch_dims != 0"
        if op.type == "GatherV2":
            axis = tensor_util.constant_value(op.inputs[2])
            if axis is None or int(axis) != 0:
                return "a gather along an axis other than 0"
        if _table_shape(ctx) is None:
            return "the table shape is not static"
        if ctx.op.inputs[1].shape.rank in (None, 0):
            return "the ids have no batch axis"
        return None

    def per_example(self, ctx):
        rows = _Rows(ctx)
        dense = tf.math.unsorted_segment_sum(rows.values, rows.keys,
                                             rows.batch * rows.vocab)
        return tf.reshape(dense, [-1, rows.vocab] + rows.row_dims)

    def squared_norms(self, ctx):
        rows = _Rows(ctx)
        _, values = rows.per_example_rows()
        return _sorted_squared_norms(
            tf.reshape(ctx.op.inputs[1], [tf.shape(values)[0], -1]), values)

    def group_squared_norms(self, ctx, num_groups):
        # A microbatch's lookups side by side ([M, (B/M) T]): repeats of an
        # id across its examples merge like repeats within one example.
        _, values = _Rows(ctx).per_example_rows()
        return _sorted_squared_norms(
            tf.reshape(ctx.op.inputs[1], [num_groups, -1]),
            tf.reshape(values, [num_groups, -1, values.shape[-1]]))

    def weighted_sum(self, ctx, weights):
        rows = _Rows(ctx)
        _, values = rows.per_example_rows()                       # [B, T, Dp]
        c = tf.cast(weights, values.dtype)[:, None, None]
        return tf.IndexedSlices(
            tf.reshape(values * c, [-1] + rows.row_dims),
            rows.ids, tf.constant([rows.vocab] + rows.row_dims, tf.int64))

    def squared_sum(self, ctx):
        rows = _Rows(ctx)
        unique, merged = rows.merged()
        table = tf.math.unsorted_segment_sum(tf.square(merged),
                                             unique % rows.vocab, rows.vocab)
        return tf.reshape(table, [rows.vocab] + rows.row_dims)
