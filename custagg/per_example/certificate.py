"""The run-time certificate of separation (the certified rules' check).

`Certificate` runs one more backward pass, seeded with random per-example
weights, to the rule ops' outputs (or the loops' outputs after a loop),
and checks row by row that it is the shared pass's gradient scaled by each
row's example's weight (docs/strategies.md gives the argument and the
tolerances, `CERTIFICATE_RTOL`, `path_rtol`). The rows of a fold read
either way (`rows.RowFold.either`) are checked under both row maps, and
the one that holds is recorded for `folded_rows.FoldedRows`
(`SharedPass.time_major`).
"""

from __future__ import annotations

import collections

import tensorflow as tf

from custagg import sparse
from custagg.graph import walks
from custagg.traversal.gradients import gradients
from custagg.per_example.forms import loop_rules
from custagg.rules import registry as registry_lib


# Relative tolerance of the certificate's row check, by the gradients'
# dtype (see `Certificate`).
CERTIFICATE_RTOL = {tf.float64: 1e-11, tf.float32: 1e-4,
                    tf.float16: 1e-2, tf.bfloat16: 1e-2}
# Rows whose gradient is below this fraction of the largest row's are
# checked against that fraction of the largest row (rounding in a tiny
# row is relative to the terms it was summed from, not to itself).
CERTIFICATE_FLOOR = 1e-3


class Certificate(object):
    """The run-time certificate of separation for rule ops (`consumers`).

    For a rule op with output z (`[R, ...]`, rows mapped to examples by
    the rule: row r of example r, or `r // T` for `[B*T, ...]` rows of a
    folded dense layer), the rules need d loss_i / d z_r = 0 unless row r
    belongs to example i. With `g1 = d(sum_i loss_i)/dz` (the shared
    pass's) and `gc = d(sum_i c_i loss_i)/dz` (ONE more backward pass, to
    these z only, seeded with c ~ U[1, 2]^B), that holds iff
    `gc_r = c_pi(r) * g1_r` for every row. A rule op passes when, for every
    example b,

        max|gc_b - c_b g1_b| <= rtol * (s_b + CERTIFICATE_FLOOR * max_b' s_b')

    with `s_b = max(max|gc_b|, c_b max|g1_b|)` over example b's rows and
    rtol `CERTIFICATE_RTOL[dtype]`. A NaN fails. docs/strategies.md gives
    the argument for the draw and the error a passing check admits.
    """

    def __init__(self, engine, consumers):
        # The loss the shared pass differentiates, and the rule ops' and
        # loop outputs' copies in its graph where the loops were rebuilt:
        # the check reads the rows the rules read, and the original loops
        # do not run.
        shared = engine.shared
        loss = shared.loss()
        batch = tf.shape(loss)[0]
        # Per consumer, the tensors its check reads: (tensor, g1 or None,
        # axis, start). A rule op: its output, with g1 from the shared
        # pass. A loop use: the loop's outputs after the loop
        # (`LoopUse.checks`), whose g1 the shared pass takes there too
        # (`SharedPass.check_gradient`): the certificate runs its seeded
        # pass only.
        points = collections.OrderedDict()
        by_consumer = {}
        eithers = {}    # ref -> keys of the rules on a fold read either way
        for c in consumers:
            key = (c.op, c.index)
            if key in by_consumer:
                continue
            by_consumer[key] = []
            # (Also builds the shared pass here, outside any tf.cond, so
            # the rules' contexts are the graph's own.)
            ctx = engine.shared.context(c)
            if isinstance(c, loop_rules.LoopUse):
                for t, axis in c.checks or ():
                    t = shared.tensor_of(t)
                    # Rows B, or B*T of a fold (`loop_rules.LoopRule`
                    # reads them example-major): start None.
                    points.setdefault(t.ref(), [t, None, axis, None])
                    by_consumer[key].append(t.ref())
                continue
            if ctx is None:
                continue    # no gradient reaches it: nothing to certify
            out = ctx.op.outputs[0]
            if out.ref() not in points:
                fold = shared.fold(c)
                axis, start = _rows(c, fold)
                points[out.ref()] = [out, ctx.grad, axis,
                                     shared.tensor_of(start)]
                if fold is not None and fold.either:
                    eithers[out.ref()] = []
            if out.ref() in eithers:
                eithers[out.ref()].append(key)
            by_consumer[key].append(out.ref())
        self._ok = {}
        if not points:
            return
        with tf.name_scope("certificate"):
            seed = tf.random.uniform([batch], 1.0, 2.0, dtype=loss.dtype)
            keys = list(points)
            missing = []
            for k in keys:
                if points[k][1] is None:
                    # A loop's output: g1 from the shared pass, which
                    # takes it to these tensors too (`check_gradient`).
                    found, g1 = shared.check_gradient(points[k][0])
                    if found:
                        points[k][1] = g1
                    else:
                        missing.append(k)
            if missing:
                for k, g in zip(missing, gradients(
                        loss, [points[k][0] for k in missing],
                        skip_unneeded_captures=True)):
                    points[k][1] = g
            gcs = gradients(loss, [points[k][0] for k in keys], grad_ys=seed,
                            skip_unneeded_captures=True)
            ok_at = {}
            ancestors = set(walks.upstream([loss]))
            for k, gc in zip(keys, gcs):
                out, g1, axis, start = points[k]
                if gc is None or g1 is None:
                    ok_at[k] = tf.constant(True)
                    continue
                rtol = path_rtol(out, ancestors)
                g1, gc = sparse.dense(g1), sparse.dense(gc)
                if axis == 0 and start is not None and \
                        start.op.type == "BatchToSpaceND":
                    # The rows of the space-to-batch blocks, block-major
                    # (the rule's start is after BatchToSpaceND): read
                    # example-major, every dilated convolution failed the
                    # check at every step and ran the exact form.
                    ok_at[k] = _time_major_agree(g1, gc, seed, start, batch,
                                                 rtol, start_axis=0)
                    continue
                ok_at[k] = _rows_agree(g1, gc, seed, axis, start, batch,
                                       rtol)
                if k in eithers:
                    # Example-major failed: the time-major map, row r of
                    # example r mod B (`start` `[T, B, ...]`).
                    late = tf.logical_not(ok_at[k])
                    time_major = tf.logical_and(late, _time_major_agree(
                        g1, gc, seed, start, batch, rtol))
                    ok_at[k] = tf.logical_or(ok_at[k], time_major)
                    for key in eithers[k]:
                        shared.time_major[key] = time_major
        for key, refs in by_consumer.items():
            oks = [ok_at[r] for r in refs]
            if oks:
                self._ok[key] = oks[0] if len(oks) == 1 else \
                    tf.reduce_all(tf.stack(oks))

    def ok_of(self, consumers):
        """Scalar bool: the check holds at every op of `consumers`."""
        oks = [self._ok[(c.op, c.index)] for c in consumers
               if (c.op, c.index) in self._ok]
        if not oks:
            return tf.constant(True)
        return tf.reduce_all(tf.stack(oks)) if len(oks) > 1 else oks[0]


def _rows(c, fold=None):
    """(axis, start): the axis of the rule op's output z whose index is the
    example's, and the tensor whose batch axis must hold B examples. For a
    fold read past the unfold (`[B*T, ...]` rows of a dense layer on
    `[B, T, D]`), the rows are example-major: z reshaped to `[B, -1]` has
    one row per example, and `start` (the unfolded `[B, T, K]`) says B.
    The same for a proved fold before the rule (`fold`, a `rows.RowFold`:
    the rules sum rows by r // T, `FoldedRows`): `start` is the folded
    `[B, T..., D]`, whose axis 0 must hold B, so that z's `B*T` rows
    reshaped to `[B, -1]` put row r at example r // T."""
    if fold is not None:
        return 0, fold.source
    ctx = registry_lib.RuleContext(c.op, c.index, None, None)
    start, axis = c.rule.coupling_start(ctx)
    if start is not c.op.outputs[0]:
        return 0, start
    return axis, start


def path_rtol(t, ancestors):
    """The certificate's rtol for rows read at `t`: that of the least
    precise floating dtype among `t` and the tensors between it and the
    loss (`ancestors`: the ops the loss depends on). The seeded pass's
    gradient crosses them, rounded to their precision: a float64 model
    whose loss goes through float32 (`tf.compat.v1.losses` computes in
    float32) has float32 gradients there, and its seeds `c_b` come out
    rounded to 1e-8, so the float64 rtol would fail every step."""
    rtol = CERTIFICATE_RTOL.get(t.dtype.base_dtype, 1e-4)
    seen, stack = set(), [t]
    while stack:
        for op in stack.pop().consumers():
            if op in seen or op not in ancestors:
                continue
            seen.add(op)
            for o in op.outputs:
                if o.dtype.is_floating:
                    rtol = max(rtol, CERTIFICATE_RTOL.get(o.dtype.base_dtype,
                                                          1e-4))
                stack.append(o)
    return rtol


def _time_major_agree(g1, gc, seed, start, batch, rtol, start_axis=1):
    """`_rows_agree` for the `[T*B, ...]` rows of a time-major fold (row r
    of example r mod B; `start` `[T, B, ...]` must hold B on axis 1), or of
    a space-to-batch block (a dilated convolution's rows before its
    `BatchToSpaceND`, row k*B + b of example b; `start`, the
    `BatchToSpaceND` output, holds B on axis 0: `start_axis`)."""
    def agree():
        def example_major(g):
            rows = tf.reshape(g, [-1, batch, tf.size(g) // tf.shape(g)[0]])
            return tf.transpose(rows, [1, 0, 2])
        return _agree(example_major(g1), example_major(gc), seed, 0, batch,
                      rtol)
    return tf.cond(tf.equal(tf.shape(start)[start_axis], batch), agree,
                   lambda: tf.constant(False))


def _rows_agree(g1, gc, seed, axis, start, batch, rtol):
    """Scalar bool: `gc_b == seed_b * g1_b` for every example b, within the
    tolerance of `Certificate`; False when the rule's rows are not the
    batch's examples at this step (a sampled path's rows). `rtol`:
    `path_rtol` of the rows' tensor. `start` None: a loop's output, whose
    R rows along `axis` may be any multiple of B, read example-major
    (row r of example r // (R/B)); the loop's own rows are proved apart
    statically, so only the map is checked here."""
    if start is None:
        rows = tf.shape(g1)[axis]
        rows_ok = tf.logical_and(tf.greater(rows, 0),
                                 tf.equal(tf.math.floormod(rows, batch), 0))
    else:
        rows_ok = tf.equal(tf.shape(start)[axis], batch)
    return tf.cond(rows_ok, lambda: _agree(g1, gc, seed, axis, batch, rtol),
                   lambda: tf.constant(False))


def _agree(g1, gc, seed, axis, batch, rtol):
    if axis != 0:
        perm = [axis] + [k for k in range(g1.shape.rank) if k != axis]
        g1, gc = tf.transpose(g1, perm), tf.transpose(gc, perm)
    g1 = tf.reshape(g1, [batch, -1])
    gc = tf.reshape(gc, [batch, -1])
    c = tf.cast(seed, g1.dtype)[:, None]
    gap = tf.reduce_max(tf.abs(gc - c * g1), axis=1)
    scale = tf.maximum(tf.reduce_max(tf.abs(gc), axis=1),
                       tf.reduce_max(tf.abs(c * g1), axis=1))
    floor = CERTIFICATE_FLOOR * tf.reduce_max(
        tf.concat([scale, tf.zeros([1], scale.dtype)], 0))
    return tf.reduce_all(gap <= rtol * (scale + floor))
