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
stay `IndexedSlices` like TF's own embedding gradients. Only `per_example`
(asked for explicitly) builds the dense `[B, V, *D]`.

This module holds the rule (`GatherRule`); the rows and the three norm
forms are in `gather_norms`, nce_loss's and sampled_softmax_loss's split of
the sampled rows (`NceSplit`, `SampledLookup`) in `gather_sampled`.
"""

import collections

import tensorflow as tf
from custagg.rules import registry
# The rows, norms and sampled-loss split live in gather_norms and
# gather_sampled; the names below stay readable here (`gather.table_shape`,
# `gather.NceSplit`, ...), as before the split.
from custagg.rules.gather_norms import (  # noqa: F401
    MASKED_GRAM_MAX_LOOKUPS as _MASKED_GRAM_MAX_LOOKUPS,
    Rows as _Rows,
    broadcast_row as _broadcast_row,
    masked_gram_squared_norms as _masked_gram_squared_norms,
    pooled_squared_norms as _pooled_squared_norms,
    rows_by_example,
    sorted_squared_norms as _sorted_squared_norms,
    spread_shape as _spread_shape,
    table_shape)
from custagg.rules.gather_sampled import (  # noqa: F401
    NceSplit,
    SampledLookup as _SampledLookup,
    nce_split)
from custagg._tf_compat import tensor_util


def _table_shape(ctx):
    """Static dims of the table `[V, *D]` (from the handle for resources)."""
    return table_shape(ctx.param)


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
            return registry.squared_norms_of(values)
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
            registry.squared_norms_of(merged), unique // rows.vocab,
            tf.cast(segments.count, tf.int64))

    def weighted_sum(self, ctx, weights):
        sampled = self._sampled(ctx)
        if sampled is not None and sampled.coef is not None:
            return sampled.weighted_sum(weights)
        ctx = self._lookups(ctx)
        rows = _Rows(ctx)
        pooled = _broadcast_row(ctx.grad)
        if pooled is not None:
            # c_b (scale u_b) spread as TF spread u: the same rows times
            # c_b, one pass over [B, T, Dp] instead of three, and TF's own
            # spread of u (Mean's and Sum's gradients tile it) is not run.
            # Exact whatever u's axis 1 is at run time: spreading commutes
            # with a per-example factor.
            u, scale, spread = pooled
            c = tf.reshape(tf.cast(weights, u.dtype),
                           [-1] + [1] * (u.shape.rank - 1))
            if scale is not None:
                c = c * tf.cast(scale, u.dtype)
            uc = u * c
            full = _spread_shape(u, spread)                      # [B, T, Dp]
            if spread.type == "BroadcastTo":
                values = tf.broadcast_to(uc, full)
            else:
                # Tile's multiples were for u, whose batch may be 1 (tiled
                # to B): u*c has B rows, so its multiples are the full
                # shape over its own (c is 1 on the other axes). B=0: no
                # rows to tile, any multiple.
                values = tf.tile(uc, full // tf.maximum(tf.shape(uc), 1))
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
