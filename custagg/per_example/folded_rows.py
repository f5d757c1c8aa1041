"""A rule on the `R = B*T` rows of a fold, read per example
(`FoldedRows`: the certified rules on `rows.RowFold` rows)."""

from __future__ import annotations

import tensorflow as tf

from custagg.rules import outer as outer_lib
from custagg.rules import registry as registry_lib


class FoldedRows(registry_lib.Rule):
    """A rule on `R = B*T` rows of a fold (`rows.RowFold`), read per
    example: the wrapped rule takes each row for an example, and example
    b's gradient is the sum of its T rows, rows bT ... bT + T - 1 of an
    example-major fold (the map r // T the certificate checks), so each
    per-example quantity is the wrapped rule's quantity of B consecutive
    groups of rows (the microbatch identities `group_squared_norms`,
    `Outer.grouped`), and a weighted sum weights row r by c_{r // T}.

    `time_major`: None, or a scalar bool (a fold read either way,
    `RowFold.either`: the certificate's finding at this step) that makes
    row r example r mod B's: the rows are put in example-major order
    first (one gather of the wrapped rule's rows or outer factors), and a
    weighted sum weights row r by c_{r mod B}. Only built inside the
    certified branch, where the certificate has checked that the fold's
    batch axis holds B.
    """

    def __init__(self, rule, time_major=None):
        self.rule = rule
        self.time_major = time_major
        self.reads_other_inputs = rule.reads_other_inputs
        self.passes_gradient_to = rule.passes_gradient_to

    @staticmethod
    def _inner(ctx):
        # The wrapped rule's row-level cache apart from this one's
        # (both would use the key "per_example").
        if ctx.cache is None:
            return ctx
        return ctx._replace(cache=ctx.cache.setdefault("rows", {}))

    @staticmethod
    def _batch(ctx):
        b = tf.get_static_value(ctx.batch_size)
        return int(b) if b is not None else ctx.batch_size

    def _order(self, ctx):
        """`[R]`: the row at each example-major position b*T + t (row
        t*B + b where this step's fold is time-major), or None (always
        example-major)."""
        if self.time_major is None:
            return None
        rows = tf.shape(ctx.grad)[0]
        batch = tf.cast(ctx.batch_size, rows.dtype)
        index = tf.range(rows)
        across = tf.reshape(tf.transpose(tf.reshape(index, [-1, batch])),
                            [-1])
        return tf.where(self.time_major, across, index)

    def unsupported(self, ctx):
        return self.rule.unsupported(ctx)

    def output_batch_axis(self, ctx):
        return 0

    def _rows_per_example(self, ctx):
        rows = self.rule.per_example(self._inner(ctx))
        order = self._order(ctx)
        return rows if order is None else tf.gather(rows, order)

    def per_example(self, ctx):
        return registry_lib.group_sum(self._rows_per_example(ctx),
                                      self._batch(ctx))

    def squared_norms(self, ctx):
        outer = self.outer(ctx)
        if outer is not None:
            return outer.squared_norms()
        if self.time_major is not None:
            return registry_lib.squared_norms_of(self.per_example(ctx))
        return self.rule.group_squared_norms(self._inner(ctx),
                                             self._batch(ctx))

    def group_squared_norms(self, ctx, num_groups):
        # M groups of B/M examples are M groups of R/M consecutive rows.
        if self.time_major is not None:
            return registry_lib.squared_norms_of(registry_lib.group_sum(
                self._rows_per_example(ctx), num_groups))
        return self.rule.group_squared_norms(self._inner(ctx), num_groups)

    def weighted_sum(self, ctx, weights):
        rows = tf.shape(ctx.grad)[0]
        times = rows // tf.shape(weights)[0]
        per_row = tf.repeat(weights, times)
        if self.time_major is not None:
            per_row = tf.where(self.time_major, tf.tile(weights, [times]),
                               per_row)
        return self.rule.weighted_sum(self._inner(ctx), per_row)

    def outer(self, ctx):
        outer = self.rule.outer(self._inner(ctx))
        if outer is None:
            return None
        order = self._order(ctx)
        if order is not None:
            outer = outer_lib.Outer(tf.gather(outer.a, order),
                                    tf.gather(outer.g, order),
                                    outer.to_param)
        batch = self._batch(ctx)
        if isinstance(batch, int):
            return outer.grouped(batch)
        d, k = outer.a.shape[2], outer.g.shape[2]
        grouped = outer_lib.Outer(
            tf.reshape(outer.a, [batch, -1, tf.compat.dimension_value(d)
                                 or tf.shape(outer.a)[2]]),
            tf.reshape(outer.g, [batch, -1, tf.compat.dimension_value(k)
                                 or tf.shape(outer.g)[2]]),
            outer.to_param)
        grouped._choose_at_run_time = True
        return grouped
