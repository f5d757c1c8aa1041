"""Rules for embedding lookups: `ResourceGather` and `GatherV2` on a table.

`z = table[ids]` with ids `[B, ...]`: example b's gradient has the rows
`dz[b, t]` at rows `ids[b, t]` of the `[V, *D]` table, nothing elsewhere.
Norms and sums never densify a `[V, *D]` table per example. For norms,
repeated ids of an example must add up before squaring: with few lookups per
example (static `T <= _MASKED_GRAM_MAX_LOOKUPS`) the Gram of its rows masked
by id equality does that with one batched matmul; otherwise each example's
ids are sorted so repeats sit side by side and a sorted segment sum merges
them. When the output gradient is one row per example broadcast along the
lookups (the gradient of a mean or sum pooling over them, the usual
bag-of-words model), the norm is that row's norm times the sum of the
squared id counts, and no `[B, T, Dp]` rows are read at all. Weighted sums
stay `IndexedSlices` like TF's own embedding gradients. Only `per_example` (asked for explicitly)
builds the dense `[B, V, *D]`.
"""

import collections

import numpy as np
import tensorflow as tf
from custagg import _tf_compat
from custagg.rules import registry
from custagg._tf_compat import resource_variable_ops
from custagg._tf_compat import tensor_util


def _table_shape(ctx):
    """Static dims of the table `[V, *D]` (from the handle for resources)."""
    return table_shape(ctx.param)


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


# Largest static number of lookups per example for which the masked Gram
# (B T^2 Dp multiply-adds) is used for norms; above it the per-example sort
# (B T log T, then one pass over the rows). Measured on 2 cores, float32,
# B=256, Dp=64 (the zoo's Keras embedding, norms alone): T=32 masked 0.7 ms
# / sorted 1.0-1.2 ms; T=64 3.4 / 2.8 ms; T=128 12-13 / 4.9-5.6 ms.
_MASKED_GRAM_MAX_LOOKUPS = 32


def _masked_gram_squared_norms(ids, rows):
    """`[B]` squared norms: `sum_{t,s} [ids_t == ids_s] rows_t . rows_s`.

    Args:
      ids: `[B, T]` ids.
      rows: `[B, T, Dp]` output gradients, one row per lookup.
    """
    gram = tf.linalg.matmul(rows, rows, transpose_b=True)          # [B, T, T]
    return tf.reduce_sum(gram * _same_id(ids, rows.dtype), axis=[1, 2])


def _same_id(ids, dtype):
    """`[B, T, T]`: 1 where lookups t and s of an example read the same row."""
    return tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), dtype)


def _squared_id_counts(ids, dtype):
    """`[B]`: `sum_{t,s} [ids_t == ids_s]`, the sum of each id's count squared.

    Args:
      ids: `[B, T]` ids.
    """
    if ids.shape[1] is not None and ids.shape[1] <= 4 * _MASKED_GRAM_MAX_LOOKUPS:
        # A [B, T, T] comparison: no sort, and cheap at this size.
        return tf.reduce_sum(_same_id(ids, dtype), axis=[1, 2])
    # Rows of ones: the merged rows are the counts.
    return _sorted_squared_norms(
        ids, tf.ones(tf.concat([tf.shape(ids), [1]], 0), dtype))


def _broadcast_row(grad):
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
    while t.op.type in ("RealDiv", "Mul"):
        a, b = t.op.inputs
        if b.shape.rank == 0:
            factor = b if t.op.type == "Mul" else tf.math.reciprocal(b)
            t = a
        elif t.op.type == "Mul" and a.shape.rank == 0:
            factor, t = a, b
        else:
            return None
        scale = factor if scale is None else scale * factor
    if t.op.type not in ("BroadcastTo", "Tile"):
        return None
    u = t.op.inputs[0]
    if (u.dtype != grad.dtype or u.shape.rank != grad.shape.rank or
            u.shape.rank < 2 or u.shape[1] not in (1, None) or
            grad.shape[1] == 1):
        return None
    return u, scale, t.op


def _spread_shape(u, spread):
    """`[B, T, *D]`, the shape `spread` (`BroadcastTo` or `Tile` of u)
    makes, from its inputs (not from its output, which TF would compute)."""
    if spread.type == "BroadcastTo":
        return tf.cast(spread.inputs[1], tf.int32)
    return tf.shape(u) * tf.cast(spread.inputs[1], tf.int32)


def _pooled_squared_norms(ids, u, scale, row_shape):
    """`[B]` squared norms when every lookup of example b has gradient `u_b`.

    Args:
      ids: `[B, T]` ids.
      u: `[B|1, 1, *D]`; broadcast to `row_shape` (`[B, 1, *D]`, a tensor) so
        a batch of 1 or broadcast row dims count as TF's broadcast does.
      scale: `None` or a scalar multiplying `u`.
    """
    u = tf.broadcast_to(u, row_shape)
    sq = tf.reduce_sum(tf.reshape(tf.square(u), [row_shape[0], -1]), axis=1)
    if scale is not None:
        sq = sq * tf.square(tf.cast(scale, sq.dtype))
    return sq * _squared_id_counts(ids, sq.dtype)


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


class NceSplit(collections.namedtuple("NceSplit", [
        "true_ids", "sampled_ids", "true_rows", "use", "use_index",
        "use_rule"])):
    """A gather at `concat([true_ids, sampled_ids])` (what nce_loss and
    sampled_softmax_loss gather, weights and biases alike), whose output is
    split by two `Slice`s into the first `n = len(true_ids)` rows
    (`true_rows`) and the rest, the sampled rows; those feed one op `use`
    (at input `use_index`) that has a rule of its own with them as its
    parameter: the sampled logits `inputs @ sampled_w^T` (`[B, S]`, a
    MatMul) or their bias `+ sampled_b` (an AddV2).

    Why the split is exact: a sampled row s is shared by every example,
    and its summed gradient `sum_b dlogits[b, s] x_b` mixes them; but row b
    of the sampled logits is example b's alone (the static proof from the
    `use` op's output says so), so example b's gradient w.r.t. the sampled
    rows is the `use` rule's per-example gradient for b (`dlogits[b, s] x_b`
    for the weights, `dlogits[b, s]` for the biases), read from the
    gradient at `use`'s output (`Rule.extra_targets`, the same backward
    pass). The true rows are per example as any gather's (row r of example
    r // num_true, proved from `true_rows`). Example b's table gradient is
    then a lookup of `num_true + S` rows: its true ids and every sampled id,
    so the gather rule's norms and sums apply unchanged (an id both true and
    sampled, an accidental hit, adds up like a repeated id)."""


def nce_split(op):
    """The `NceSplit` of a gather op, or None."""
    if op.type not in ("ResourceGather", "GatherV2"):
        return None
    ids = op.inputs[1]
    if ids.op.type != "ConcatV2" or ids.op.get_attr("N") != 2:
        return None
    axis = tensor_util.constant_value(ids.op.inputs[2])
    true_ids, sampled = ids.op.inputs[0], ids.op.inputs[1]
    if axis is None or int(axis) != 0 or true_ids.shape.rank != 1 or \
            sampled.shape.rank != 1:
        return None
    out = op.outputs[0]
    while True:
        consumers = _tf_compat.forward_consumers(out)
        if len(consumers) == 1 and consumers[0].type == "Identity":
            out = consumers[0].outputs[0]
            continue
        break
    if len(consumers) != 2 or any(c.type != "Slice" or c.inputs[0] is not out
                                  for c in consumers):
        return None
    rank = out.shape.rank
    if rank is None:
        return None
    true_rows = sampled_rows = None
    for c in consumers:
        begin, size = c.inputs[1], c.inputs[2]
        if _entries_are(begin, rank, 0, lambda e: _is_value(e, 0)) and \
                _entries_are(size, rank, -1,
                             lambda e: _counts_rows(e, true_ids)):
            true_rows = c.outputs[0]
        elif _entries_are(begin, rank, 0,
                          lambda e: _counts_rows(e, true_ids)) and \
                _entries_are(size, rank, -1, lambda e: _is_value(e, -1)):
            sampled_rows = c.outputs[0]
    if true_rows is None or sampled_rows is None:
        return None
    uses = [(c, k) for c in _tf_compat.forward_consumers(sampled_rows)
            for k, t in enumerate(c.inputs) if t is sampled_rows]
    if len(uses) != 1:
        return None
    use, k = uses[0]
    table = table_shape(op.inputs[0])
    count = tf.compat.dimension_value(sampled.shape[0])
    if table is None or count is None:
        return None
    # The sampled rows' static shape is `[S, *D]` (S sampled ids of the
    # table's rows), which TF's Slice does not infer: the use's rule reads
    # it through a stand-in parameter (rules read only a parameter's shape
    # and dtype, never its value).
    use = _UseOp(use, k, _StaticParam(
        tf.TensorShape([count] + table[1:]), sampled_rows.dtype,
        sampled_rows.name))
    rule = registry.default_registry().lookup(use.type)
    if rule is None or rule.unsupported(
            registry.RuleContext(use, k, None, None)) is not None:
        return None
    return NceSplit(true_ids, sampled, true_rows, use, k, rule)


class _StaticParam(collections.namedtuple("_StaticParam",
                                          ["shape", "dtype", "name"])):
    """A parameter's static shape and dtype (`nce_split`)."""


class _UseOp(object):
    """An op with input `index` replaced by `param` (`nce_split`); every
    other attribute is the op's."""

    def __init__(self, op, index, param):
        self._op = op
        self.inputs = list(op.inputs)
        self.inputs[index] = param

    def __getattr__(self, name):
        return getattr(self._op, name)


def _entries(vec, rank):
    """The entries of a `[rank]` int vector: ints where constant, the
    tensors `Pack` stacked, or ("shape", t) for `tf.shape(t)` of a rank-1
    t; None where unknown."""
    value = tensor_util.constant_value(vec)
    if value is not None:
        return [int(v) for v in value]
    if vec.op.type == "Pack" and len(vec.op.inputs) == rank:
        return [int(v) if v is not None else t for t, v in zip(
            vec.op.inputs, (tensor_util.constant_value(t)
                            for t in vec.op.inputs))]
    if vec.op.type == "Shape" and rank == 1:
        return [("shape", vec.op.inputs[0])]
    return None


def _entries_are(vec, rank, rest, first):
    """Whether entry 0 of `vec` passes `first` and the others equal
    `rest`."""
    entries = _entries(vec, rank)
    if entries is None or len(entries) != rank:
        return False
    return first(entries[0]) and all(isinstance(e, int) and e == rest
                                     for e in entries[1:])


def _is_value(e, v):
    return isinstance(e, int) and e == v


def _counts_rows(e, ids):
    """Whether entry `e` is the length of rank-1 `ids`: `tf.shape(ids)`,
    `tf.shape(ids)[0]`, or the static length."""
    if isinstance(e, int):
        n = tf.compat.dimension_value(ids.shape[0])
        return n is not None and n == e
    if isinstance(e, tuple):
        return e[1] is ids
    if e.op.type == "StridedSlice" and e.op.inputs[0].op.type == "Shape" \
            and e.op.inputs[0].op.inputs[0] is ids and \
            e.op.get_attr("shrink_axis_mask") == 1:
        begin, end, strides = (tensor_util.constant_value(t)
                               for t in e.op.inputs[1:])
        return begin is not None and end is not None and \
            strides is not None and list(begin) == [0] and \
            list(end) == [1] and list(strides) == [1]
    return False


class _SampledLookup(object):
    """Example b's table gradient through an `NceSplit`, never `[B, S, *D]`.

    Example b reads its `nt` true rows (gradients `true_rows[b]`, ids
    `true_ids[b]`) and the S shared sampled rows (ids `sampled_ids`). Its
    gradient w.r.t. sampled row s is rank one, `coef[b, s] * vec[b]`: for
    the sampled logits `x @ w_s^T` (a MatMul, `transpose_b`) `dlogits[b, s]
    x_b`; for a bias (rows of no dims) the use rule's `[B, S]` gradient
    times 1. `coef` and `vec` are None for other use ops, whose quantities
    then read the materialized rows (`GatherRule._lookups`).

    Squared norms add up rows that land on one table row before squaring,
    exactly, whatever the ids (a sampler drawn without `unique`, a label
    among the sampled ids: an accidental hit, whether its logit was
    removed or not):

        ||g_b||^2 = sum_{t,t'} [id_bt = id_bt'] r_bt . r_bt'          (true)
                  + |vec_b|^2 sum_{s,s'} [sid_s = sid_s'] coef_bs coef_bs'
                  + 2 sum_{t,s} [id_bt = sid_s] coef_bs (r_bt . vec_b)

    (`[B, nt, nt]`, `[S, S]` shared by the batch, `[B, nt, S]` masks). The
    weighted sum is `c`-weighted true rows next to `(c coef)^T vec` at the
    sampled ids: `B nt + S` rows, the rows TF's own gradient has.

    Attributes:
      true_ids: `[B, nt]` int64; true_rows: `[B, nt, Dp]`.
      sampled_ids: `[S]` int64.
      coef: `[B, S]` or None; vec: `[B, Dp]` or None.
      use_ctx: the use op's `RuleContext` (its gradient from the shared
        pass); row_dims: the table's row dims `D` (`Dp` their product).
    """

    def __init__(self, ctx, split):
        dims = _table_shape(ctx)
        self.vocab, self.row_dims = dims[0], dims[1:]
        width = 1
        for d in self.row_dims:
            width *= d
        self.use_ctx = registry.RuleContext(
            split.use, split.use_index, ctx.cache["extra"][0],
            ctx.batch_size)
        self.use_rule = split.use_rule
        dtype = ctx.grad.dtype
        n = tf.shape(split.true_ids)[0]
        self.true_rows = tf.reshape(ctx.grad[:n], [-1, width])   # [B*nt, Dp]
        self.true_flat_ids = tf.cast(split.true_ids, tf.int64)
        self.num_true = _true_per_example(split.true_ids)
        self.sampled_ids = tf.cast(split.sampled_ids, tf.int64)
        self.coef, self.vec = _sampled_factors(self.use_rule, self.use_ctx,
                                               self.row_dims)
        batch = tf.shape(self.coef)[0] if self.coef is not None else \
            tf.shape(self.use_ctx.grad)[0]
        # With num_true static the reshape says so (and would fail, never
        # mislead, on a step whose true rows were not B * num_true).
        per = -1 if self.num_true is None else self.num_true
        self.true_ids = tf.reshape(self.true_flat_ids, [batch, per])
        self.true_rows3 = tf.reshape(self.true_rows, [batch, per, width])
        if self.coef is not None:
            self.coef = tf.cast(self.coef, dtype)
            self.vec = tf.cast(self.vec, dtype)

    def squared_norms(self):
        """`[B]` squared norms (the docstring's identity)."""
        rows, ids = self.true_rows3, self.true_ids
        if self.num_true == 1:      # (rows [B, 1, Dp]: nothing to merge)
            true = tf.reduce_sum(tf.square(rows), axis=[1, 2])
        else:
            true = _masked_gram_squared_norms(ids, rows)
        sid = self.sampled_ids
        same = tf.cast(tf.equal(sid[:, None], sid[None, :]), rows.dtype)
        sampled = tf.reduce_sum(tf.matmul(self.coef, same) * self.coef,
                                axis=1)                                # [B]
        if self.row_dims:
            sampled = sampled * tf.reduce_sum(tf.square(self.vec), axis=1)
        hits = tf.cast(tf.equal(ids[:, :, None], sid[None, None, :]),
                       rows.dtype)                                   # [B, nt, S]
        hit_coef = tf.reduce_sum(hits * self.coef[:, None, :], axis=2)
        dots = tf.reduce_sum(rows * self.vec[:, None, :], axis=2)      # [B, nt]
        return true + sampled + 2.0 * tf.reduce_sum(hit_coef * dots, axis=1)

    def group_squared_norms(self, num_groups):
        """`[M]` squared norms of the M microbatch sums (groups of n = B/M
        consecutive examples). A group's gradient w.r.t. sampled row s,
        `sum_{b in m} coef_bs vec_b`, is no longer rank one: either it is
        formed, `[M, S, Dp]`, and merged with the group's true rows by id
        (`_sorted_squared_norms`), or, for small groups, its norm terms come
        from Grams over the group's examples (`_group_gram_norms`), which
        hold `B n` and `B nt n` numbers instead of `M S Dp`."""
        width = int(np.prod(self.row_dims)) if self.row_dims else 1
        count = tf.compat.dimension_value(self.sampled_ids.shape[0])
        per_group = tf.shape(self.coef)[0] // num_groups
        static = tf.get_static_value(per_group)
        if static is not None:
            return self._group_gram_norms(num_groups) \
                if static * static <= count * width else \
                self._group_rows_norms(num_groups)
        return tf.cond(per_group * per_group <= count * width,
                       lambda: self._group_gram_norms(num_groups),
                       lambda: self._group_rows_norms(num_groups))

    def _group_rows_norms(self, m):
        width = self.true_rows.shape[-1]
        coef = tf.reshape(self.coef, [m, -1, tf.shape(self.coef)[1]])
        vec = tf.reshape(self.vec, [m, -1, tf.shape(self.vec)[1]])
        sampled = tf.matmul(coef, vec, transpose_a=True)             # [M, S, Dp]
        ids = tf.concat([tf.reshape(self.true_ids, [m, -1]),
                         tf.tile(self.sampled_ids[None], [m, 1])], 1)
        rows = tf.concat([tf.reshape(self.true_rows3, [m, -1, width]),
                          sampled], 1)
        return _sorted_squared_norms(ids, rows)

    def _group_gram_norms(self, m):
        """The docstring's three terms summed over a group's examples b, b'
        (`K = vec vec^T`, `[M, n, n]`; rows and ids `[M, L = n nt, ...]`)."""
        width = self.true_rows.shape[-1]
        rows = tf.reshape(self.true_rows3, [m, -1, width])           # [M, L, Dp]
        ids = tf.reshape(self.true_ids, [m, -1])                      # [M, L]
        coef = tf.reshape(self.coef, [m, -1, tf.shape(self.coef)[1]])  # [M, n, S]
        vec = tf.reshape(self.vec, [m, -1, tf.shape(self.vec)[1]])     # [M, n, Dp]
        true = _sorted_squared_norms(ids, rows)
        sid = self.sampled_ids
        same = tf.cast(tf.equal(sid[:, None], sid[None, :]), rows.dtype)
        gram_vec = tf.matmul(vec, vec, transpose_b=True)             # [M, n, n]
        gram_coef = tf.matmul(tf.tensordot(coef, same, 1), coef,
                              transpose_b=True)                      # [M, n, n]
        hits = tf.cast(tf.equal(ids[:, :, None], sid[None, None, :]),
                       rows.dtype)                                   # [M, L, S]
        hit_coef = tf.matmul(hits, coef, transpose_b=True)           # [M, L, n]
        dots = tf.matmul(rows, vec, transpose_b=True)                # [M, L, n]
        return true + tf.reduce_sum(gram_vec * gram_coef, axis=[1, 2]) + \
            2.0 * tf.reduce_sum(hit_coef * dots, axis=[1, 2])

    def segment_squared_norms(self, segments):
        """`[U]` squared norms of the users' sums (`segments.Segments`).
        The docstring's three terms over pairs of one user's examples b, b'
        (masks `[B, B]` and `[B nt, B]`); the true rows merged by (user,
        id) as any gather's. Holds `B (1 + nt) B` numbers where the rows
        would hold `B (nt + S) Dp`: used for rows of several numbers."""
        dtype = self.true_rows.dtype
        user = tf.cast(segments.ids, tf.int64)                         # [B]
        count = tf.cast(segments.count, tf.int64)
        row_user = tf.reshape(tf.broadcast_to(
            user[:, None], tf.shape(self.true_ids)), [-1])          # [B nt]
        ids, rows = self.true_flat_ids, self.true_rows
        unique, idx = tf.unique(row_user * self.vocab + ids, out_idx=tf.int64)
        merged = tf.math.unsorted_segment_sum(
            rows, idx, tf.size(unique, out_type=tf.int64))
        true = tf.math.unsorted_segment_sum(
            tf.reduce_sum(tf.square(merged), axis=1), unique // self.vocab,
            count)
        sid = self.sampled_ids
        same = tf.cast(tf.equal(sid[:, None], sid[None, :]), dtype)
        gram = tf.matmul(self.vec, self.vec, transpose_b=True) * tf.matmul(
            tf.matmul(self.coef, same), self.coef, transpose_b=True)  # [B, B]
        sampled = tf.reduce_sum(
            segments.same(user, user, dtype) * gram, axis=1)
        hits = tf.cast(tf.equal(ids[:, None], sid[None, :]), dtype)  # [B nt, S]
        cross = tf.matmul(hits, self.coef, transpose_b=True) * tf.matmul(
            rows, self.vec, transpose_b=True)                      # [B nt, B]
        cross = tf.reduce_sum(segments.same(row_user, user, dtype) * cross,
                              axis=1)
        return true + tf.math.unsorted_segment_sum(sampled, user, count) + \
            2.0 * tf.math.unsorted_segment_sum(cross, row_user, count)

    def weighted_sum(self, weights):
        """`sum_b c_b g_b` as IndexedSlices of `B nt + S` rows."""
        c = tf.cast(weights, self.true_rows.dtype)
        true = self.true_rows3 * c[:, None, None]
        sampled = tf.matmul(self.coef * c[:, None], self.vec,
                            transpose_a=True)                        # [S, Dp]
        values = tf.concat([tf.reshape(true, [-1] + self.row_dims),
                            tf.reshape(sampled, [-1] + self.row_dims)], 0)
        return tf.IndexedSlices(
            values, tf.concat([self.true_flat_ids, self.sampled_ids], 0),
            tf.constant([self.vocab] + self.row_dims, tf.int64))


def _true_per_example(true_ids):
    """The static number of true ids per example, or None: both losses
    flatten the `[B, num_true]` labels with a Reshape to `[-1]`."""
    if true_ids.op.type == "Reshape" and \
            true_ids.op.inputs[0].shape.rank == 2:
        return tf.compat.dimension_value(true_ids.op.inputs[0].shape[1])
    return None


def _sampled_factors(use_rule, use_ctx, row_dims):
    """`(coef [B, S], vec [B, Dp])` with example b's gradient w.r.t. sampled
    row s equal to `coef[b, s] * vec[b]` (see `_SampledLookup`), or
    `(None, None)` when the use op is not one of the rank-one forms."""
    op = use_ctx.op
    if not row_dims:
        # Rows of one number: the use rule's own [B, S] gradients are the
        # coefficients (a bias, whatever op adds it), times 1.
        g = use_rule.per_example(use_ctx)
        g = tf.reshape(g, [tf.shape(g)[0], -1])
        return g, tf.ones(tf.stack([tf.shape(g)[0], 1]), g.dtype)
    # The sampled logits `x @ w_s^T` (what nce_loss and sampled_softmax_loss
    # build): row s of example b's gradient is dz[b, s] x_b.
    if op.type != "MatMul" or use_ctx.input_index != 1 or \
            op.get_attr("transpose_a") or not op.get_attr("transpose_b") or \
            len(row_dims) != 1 or op.inputs[0].shape.rank != 2 or \
            use_ctx.grad.shape.rank != 2:
        return None, None
    return use_ctx.grad, op.inputs[0]


class _Op(collections.namedtuple("_Op", ["inputs", "type", "name"])):
    """What the gather rule reads of an op (its table and ids), for the
    lookup an `NceSplit` makes per example."""


@registry.register_rule("ResourceGather", "GatherV2")
class GatherRule(registry.Rule):
    """Per-example gradient of a gathered table: `[B, V, *D]` (dense only
    here). A gather split as nce_loss's (`NceSplit`) reads each example's
    true rows and its own gradient w.r.t. the shared sampled rows."""

    def coupling_start(self, ctx):
        split = nce_split(ctx.op)
        if split is not None:
            return split.true_rows, 0
        return super(GatherRule, self).coupling_start(ctx)

    def coupling_starts(self, ctx):
        split = nce_split(ctx.op)
        if split is None:
            return super(GatherRule, self).coupling_starts(ctx)
        use_ctx = registry.RuleContext(split.use, split.use_index, None,
                                       ctx.batch_size)
        return [(split.true_rows, 0),
                split.use_rule.coupling_start(use_ctx)]

    def extra_targets(self, ctx):
        split = nce_split(ctx.op)
        return () if split is None else (split.use.outputs[0],)

    def _lookups(self, ctx):
        """`ctx` itself, or for an `NceSplit` the per-example lookup of
        `num_true + S` rows: ids `[B, num_true + S]` and their gradient
        `[B, num_true + S, *D]` (see `NceSplit`)."""
        if isinstance(ctx.op, _Op):
            return ctx
        split = nce_split(ctx.op)
        if split is None:
            return ctx
        if "nce" in (ctx.cache or {}):
            return ctx.cache["nce"]
        use_ctx = registry.RuleContext(split.use, split.use_index,
                                       ctx.cache["extra"][0], ctx.batch_size)
        sampled = split.use_rule.per_example(use_ctx)       # [B, S, *D]
        batch = tf.shape(sampled)[0]
        n = tf.shape(split.true_ids)[0]
        row_dims = _table_shape(ctx)[1:]
        true_grad = tf.reshape(ctx.grad[:n], tf.concat(
            [[batch, -1], tf.shape(ctx.grad)[1:]], 0))       # [B, nt, *D]
        ids = tf.concat([
            tf.reshape(tf.cast(split.true_ids, tf.int64), [batch, -1]),
            tf.tile(tf.cast(split.sampled_ids, tf.int64)[None], [batch, 1])],
            1)
        grad = tf.concat([true_grad, tf.cast(sampled, true_grad.dtype)], 1)
        grad.set_shape([None, None] + row_dims)
        out = ctx._replace(op=_Op([ctx.param, ids], ctx.op.type,
                                  ctx.op.name), input_index=0, grad=grad)
        if ctx.cache is not None:
            ctx.cache["nce"] = out
        return out

    def _sampled(self, ctx):
        """The `_SampledLookup` of an `NceSplit` gather (built once per
        context), or None."""
        if isinstance(ctx.op, _Op) or ctx.cache is None or \
                "extra" not in ctx.cache:
            return None
        if "sampled" not in ctx.cache:
            split = nce_split(ctx.op)
            ctx.cache["sampled"] = None if split is None else \
                _SampledLookup(ctx, split)
        return ctx.cache["sampled"]

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
        ctx = self._lookups(ctx)
        rows = _Rows(ctx)
        return rows_by_example(rows.values, rows.keys, rows.batch,
                               rows.vocab, rows.row_dims)

    def squared_norms(self, ctx):
        sampled = self._sampled(ctx)
        if sampled is not None and sampled.coef is not None:
            return sampled.squared_norms()
        ctx = self._lookups(ctx)
        ids = ctx.op.inputs[1]
        pooled = _broadcast_row(ctx.grad) if ids.shape.rank == 2 else None
        if pooled is None:
            return self._row_squared_norms(ctx)
        u, scale, spread = pooled
        full = _spread_shape(u, spread)
        shape = tf.concat([tf.shape(ids)[:1], [1], full[2:]], 0)
        if u.shape[1] == 1:
            return _pooled_squared_norms(ids, u, scale, shape)

        def rows():
            # The rows again from u, inside the branch, so the pooled
            # branch never makes TF compute the [B, T, Dp] gradient.
            g = tf.broadcast_to(u, full) if spread.type == "BroadcastTo" \
                else tf.tile(u, spread.inputs[1])
            if scale is not None:
                g = g * tf.cast(scale, g.dtype)
            return self._row_squared_norms(ctx._replace(grad=g))

        # Axis 1 of u is known only at run time: the pooled form where it
        # is 1, the rows otherwise (never a guess).
        return tf.cond(
            tf.equal(tf.shape(u)[1], 1),
            lambda: _pooled_squared_norms(ids, u, scale, shape), rows)

    def _row_squared_norms(self, ctx):
        """`[B]` squared norms from the `[B, T, Dp]` rows (any gradient)."""
        _, values = _Rows(ctx).per_example_rows()                 # [B, T, Dp]
        ids = tf.reshape(ctx.op.inputs[1], [tf.shape(values)[0], -1])
        lookups = ctx.op.inputs[1].shape[1:].num_elements()
        if lookups == 1:        # one row per example: nothing to merge
            return tf.reduce_sum(tf.square(values), axis=[1, 2])
        if lookups is not None and lookups <= _MASKED_GRAM_MAX_LOOKUPS:
            return _masked_gram_squared_norms(ids, values)
        return _sorted_squared_norms(ids, values)

    def group_squared_norms(self, ctx, num_groups):
        sampled = self._sampled(ctx)
        if sampled is not None and sampled.coef is not None:
            return sampled.group_squared_norms(num_groups)
        ctx = self._lookups(ctx)
        # A microbatch's lookups side by side ([M, (B/M) T]): repeats of an
        # id across its examples merge like repeats within one example.
        _, values = _Rows(ctx).per_example_rows()
        return _sorted_squared_norms(
            tf.reshape(ctx.op.inputs[1], [num_groups, -1]),
            tf.reshape(values, [num_groups, -1, values.shape[-1]]))

    def segment_squared_norms(self, ctx, segments):
        sampled = self._sampled(ctx)
        if sampled is not None and sampled.coef is not None and \
                sampled.row_dims:
            return sampled.segment_squared_norms(segments)
        ctx = self._lookups(ctx)
        # Rows keyed by (user, id): repeats of an id across one user's
        # examples merge like repeats within one example; never dense.
        rows = _Rows(ctx)
        example = rows.keys // rows.vocab                           # [B*T]
        user = tf.gather(tf.cast(segments.ids, tf.int64), example)
        unique, idx = tf.unique(user * rows.vocab + rows.ids, out_idx=tf.int64)
        merged = tf.math.unsorted_segment_sum(
            rows.values, idx, tf.size(unique, out_type=tf.int64))
        return tf.math.unsorted_segment_sum(
            tf.reduce_sum(tf.square(merged), axis=1), unique // rows.vocab,
            tf.cast(segments.count, tf.int64))

    def weighted_sum(self, ctx, weights):
        sampled = self._sampled(ctx)
        if sampled is not None and sampled.coef is not None:
            return sampled.weighted_sum(weights)
        ctx = self._lookups(ctx)
        rows = _Rows(ctx)
        pooled = _broadcast_row(ctx.grad)
        if pooled is not None and pooled[2].type == "BroadcastTo":
            # c_b (scale u_b) broadcast as TF broadcast u: the same rows
            # times c_b, one pass over [B, T, Dp] instead of three. (Exact
            # whatever u's axis 1 is at run time: broadcasting commutes
            # with a per-example factor.)
            u, scale, spread = pooled
            c = tf.reshape(tf.cast(weights, u.dtype),
                           [-1] + [1] * (u.shape.rank - 1))
            if scale is not None:
                c = c * tf.cast(scale, u.dtype)
            values = tf.broadcast_to(u * c, _spread_shape(u, spread))
        else:
            _, values = rows.per_example_rows()                   # [B, T, Dp]
            values = values * tf.cast(weights, values.dtype)[:, None, None]
        return tf.IndexedSlices(
            tf.reshape(values, [-1] + rows.row_dims),
            rows.ids, tf.constant([rows.vocab] + rows.row_dims, tf.int64))

    def squared_sum(self, ctx):
        ctx = self._lookups(ctx)
        rows = _Rows(ctx)
        unique, merged = rows.merged()
        table = tf.math.unsorted_segment_sum(tf.square(merged),
                                             unique % rows.vocab, rows.vocab)
        return tf.reshape(table, [rows.vocab] + rows.row_dims)
