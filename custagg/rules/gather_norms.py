"""The embedding rules' rows and norms: repeated ids merged, never dense.

A lookup `z = table[ids]` (`ids` `[B, T]`) gives example b the rows
`dz[b, t]` at table rows `ids[b, t]`; rows with the same id add up before
squaring. Three forms of the `[B]` squared norms, chosen by the graph
(`gather.GatherRule` picks): the masked Gram of each example's rows (few
static lookups, `MASKED_GRAM_MAX_LOOKUPS`), a per-example sort and sorted
segment sum (`sorted_squared_norms`), and, when the output gradient is one
row per example broadcast along the lookups (`broadcast_row`: a mean or sum
pooling), that row's norm times the sum of the squared id counts
(`pooled_squared_norms`). `Rows` keys the rows by (example, id) for the
dense per-example form and the merged sums.
"""

import tensorflow as tf
from custagg import op_kinds
from custagg._tf_compat import resource_variable_ops
from custagg.rules import outer as _outer
from custagg.rules import registry


def table_shape(p):
    """Static dims of table `p` `[V, *D]` (a resource handle's from its
    handle data), or None."""
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


def rows_by_example(values, keys, batch, rows, row_dims):
    """`[B, rows, *row_dims]`: each of `values` (`[N, *row_dims]`) summed
    into row `keys[n] = b * rows + r` (example b, table row r).

    `batch`: B (an int64 scalar tensor); `rows`: a Python int or an int64
    scalar tensor; `row_dims`: static ints.
    """
    rows64 = tf.cast(rows, tf.int64)
    dense = tf.math.unsorted_segment_sum(values, keys, batch * rows64)
    out = tf.reshape(dense, tf.concat(
        [tf.stack([batch, rows64]), tf.constant(row_dims, tf.int64)], 0))
    static = tf.get_static_value(rows64)
    out.set_shape([None, None if static is None else int(static)] +
                  list(row_dims))
    return out


class Rows(object):
    """Example-keyed rows of the per-example table gradients."""

    def __init__(self, ctx):
        dims = table_shape(ctx.param)
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


# Largest static number of lookups per example for which the masked Gram
# (B T^2 Dp multiply-adds) is used for norms; above it the per-example sort
# (B T log T, then one pass over the rows). Measured on 2 cores, float32,
# B=256, Dp=64 (the zoo's Keras embedding, norms alone): T=32 masked 0.7 ms
# / sorted 1.0-1.2 ms; T=64 3.4 / 2.8 ms; T=128 12-13 / 4.9-5.6 ms.
MASKED_GRAM_MAX_LOOKUPS = 32


def masked_gram_squared_norms(ids, rows):
    """`[B]` squared norms: `sum_{t,s} [ids_t == ids_s] rows_t . rows_s`.

    Args:
      ids: `[B, T]` ids.
      rows: `[B, T, Dp]` output gradients, one row per lookup.
    """
    gram, same = _outer.after_gradient(
        lambda: tf.linalg.matmul(rows, rows, transpose_b=True),  # [B, T, T]
        lambda: _same_id(ids, rows.dtype))
    return tf.reduce_sum(gram * same, axis=[1, 2])


def _same_id(ids, dtype):
    """`[B, T, T]`: 1 where lookups t and s of an example read the same row."""
    return tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), dtype)


def _squared_id_counts(ids, dtype):
    """`[B]`: `sum_{t,s} [ids_t == ids_s]`, the sum of each id's count squared.

    Up to 64 lookups a `[B, T, T]` comparison summed in int32; beyond, each
    (example, id) pair's count from `tf.unique_with_counts` (O(B T), no
    sort). Per run on 2 cores, float32: B=512, T=32 0.45 ms against 0.68
    ms for the float comparison this replaced; B=64, T=256 0.79 ms against
    2.0 ms for the per-example sort it replaced (a loaded machine).

    Args:
      ids: `[B, T]` ids (>= 0, as any lookup that ran).
    """
    if ids.shape[1] is not None and ids.shape[1] <= 2 * MASKED_GRAM_MAX_LOOKUPS:
        return tf.cast(tf.reduce_sum(_same_id(ids, tf.int32), axis=[1, 2]),
                       dtype)
    batch = tf.shape(ids, out_type=tf.int64)[0]
    ids = tf.cast(ids, tf.int64)
    # One key per (example, id): b * (max id + 1) + id.
    span = tf.maximum(tf.reduce_max(ids), 0) + 1   # B=0: empty, any span
    keys = tf.reshape(tf.range(batch)[:, None] * span + ids, [-1])
    unique, _, counts = tf.unique_with_counts(keys)
    return tf.math.unsorted_segment_sum(
        tf.square(tf.cast(counts, dtype)), unique // span, batch)


def broadcast_row(grad):
    """`(u, scale, spread)` when `grad [B, T, *D]` is `u [B|1, 1, *D]` spread
    along T (`spread`: the `BroadcastTo` or `Tile` op) times `scale`.

    Every lookup of an example then has the same output gradient
    `u[b, 0] * scale`. Recognized: `BroadcastTo` or `Tile` of a tensor of
    the same rank whose axis 1 is 1 (TF's Sum and Mean gradients), under any
    number of `RealDiv`/`Mul` by a scalar (Mean divides by the count). With
    a dynamic batch TF reshapes to a shape it computes, so axis 1 may be
    known only at run time: the caller then checks it there. `None`
    otherwise: the general forms then read the rows.
    """
    scale = None
    t = grad
    while t.op.type in op_kinds.SCALINGS:
        a, b = t.op.inputs
        if b.shape.rank == 0:
            factor = b if t.op.type == "Mul" else tf.math.reciprocal(b)
            t = a
        elif t.op.type == "Mul" and a.shape.rank == 0:
            factor, t = a, b
        else:
            return None
        scale = factor if scale is None else scale * factor
    if t.op.type not in op_kinds.SPREADS:
        return None
    u = t.op.inputs[0]
    if (u.dtype != grad.dtype or u.shape.rank != grad.shape.rank or
            u.shape.rank < 2 or u.shape[1] not in (1, None) or
            grad.shape[1] == 1):
        return None
    return u, scale, t.op


def spread_shape(u, spread):
    """`[B, T, *D]`, the shape `spread` (`BroadcastTo` or `Tile` of u)
    makes, from its inputs (not from its output, which TF would compute)."""
    if spread.type == "BroadcastTo":
        return tf.cast(spread.inputs[1], tf.int32)
    return tf.shape(u) * tf.cast(spread.inputs[1], tf.int32)


def pooled_squared_norms(ids, u, scale, row_shape):
    """`[B]` squared norms when every lookup of example b has gradient `u_b`.

    Args:
      ids: `[B, T]` ids.
      u: `[B|1, 1, *D]`; broadcast to `row_shape` (`[B, 1, *D]`, a tensor) so
        a batch of 1 or broadcast row dims count as TF's broadcast does.
      scale: `None` or a scalar multiplying `u`.
    """
    u = tf.broadcast_to(u, row_shape)
    sq = registry.squared_norms_of(u)
    if scale is not None:
        sq = sq * tf.square(tf.cast(scale, sq.dtype))
    return sq * _squared_id_counts(ids, sq.dtype)


def sorted_squared_norms(ids, rows):
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
        registry.squared_norms_of(merged), example, batch)
