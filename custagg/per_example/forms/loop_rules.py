"""Per-example rules inside while-loop bodies: any registered rule.

A weight `w` used inside a v2 `While` body (Keras LSTM/GRU, `dynamic_rnn`,
a hand-written `tf.while_loop` cell) enters the loop as a captured input;
a body op `z_t = op(a_t, w)` runs once per iteration t. Example b's
gradient is the sum over iterations of what the op's rule (from the same
registry as outside loops, a user's rules included) gives for one call:

    G_b = sum_t rule(op; a_bt, dz_bt),     dz_bt = d loss_b / d z_bt

For a bilinear rule (MatMul, Einsum, Conv2D) that is an outer product summed
over the iterations: `_outer.Outer` with the iterations as part of its T
axis, so norms, clipped and weighted sums take the same identities as a
Dense layer on a sequence (Gram form, `A^T diag(c) G`). A rule without an
`outer` (BiasAdd, broadcast adds) gives `[B, *w.shape]` per iteration, summed.

TF's gradient of the loop sums over the batch inside the gradient loop,
where no one can reach it. So the loop is **rebuilt once on the whole
batch** (`graph.copier`'s `Copier`, the batch kept whole) with each
tapped op's output perturbed by zeros, `z_t + eps_t`, and each of the op's
other inputs pushed to an extra TensorList. `d/d eps = dz` `[T, B, ...]`:
row b of it is `d loss_b / d z_bt` because examples stay apart downstream
of every tap. The rule then runs once, outside the loop, on a copy of the
op whose inputs are the stacked `[T*B, ...]` rows (row t*B + b is example b
at step t), and its result is folded back to `[B, ...]`.


The loop's taps are found by `loop_taps` (statically proved to keep
examples apart), the loop rebuilt and tapped by `loop_rebuild` (once, with
the loss recomputed from it: `OnePass`; or twice: `build`); this module
runs each tap's rule on the stacked rows and keeps the result for the
engine (`LoopRule`, `LoopContext`).
"""

from __future__ import annotations

import collections

import tensorflow as tf

from custagg.per_example.forms import loop_rebuild
from custagg.per_example.forms import loop_taps
from custagg.rules import outer as _outer
from custagg.rules import registry as registry_lib

# The loop rules' entry points the planner and the engine read here.
LoopUse = loop_taps.LoopUse
find = loop_taps.find
in_v1_loop = loop_taps.in_v1_loop
cotangent_targets = loop_taps.cotangent_targets


class OnePass(object):
    """The v2 loops of `uses` rebuilt once on the whole batch, tapped, and
    the loss computed again from them (every op between the loops and the
    loss copied, upstream ones kept): the only loops the per-example graph
    runs, so the rules' one backward pass of this loss gives both the rule
    ops' gradients and each tap's dz (`eps`), the loop's forward running
    once and its backward once (issue 26). Built by `one_pass`.

    Attributes:
      loss: the `[B]` loss recomputed from the rebuilt loops.
      eps: the taps' reserved lists, hook by hook (the gradient targets).
    """

    def __init__(self, loss, mapping, hooks, by_loop):
        self.loss = loss
        self._mapping = mapping
        self._hooks = hooks
        self._by_loop = by_loop
        self.eps = [e for loop in by_loop for e in hooks[loop].eps]

    def op_of(self, op):
        """`op`'s copy when it is downstream of a rebuilt loop, else `op`."""
        if not op.outputs:
            return op
        new = self._mapping.get(op.outputs[0].ref())
        return op if new is None else new.op

    def tensor_of(self, t):
        """`t`'s copy when it is downstream of a rebuilt loop, else `t`."""
        return self._mapping.get(t.ref(), t)

    def build(self, eps_grads, batch):
        """Each use's per-row gradients as `build` gives them, from the
        gradients at `eps` (aligned with it; a variant list or None).
        `batch` is read only where a loop ran no step: the rows are the
        taps' own."""
        grads = iter(eps_grads)
        result = {}
        with tf.name_scope("loop_rules_form"):
            for loop, group in self._by_loop.items():
                hook = self._hooks[loop]
                dz = loop_rebuild.stacked_dz(
                    hook, [next(grads) for _ in hook.eps], batch)
                for use in group:
                    result[(use.op, use.index)] = _outer_of(use, hook, dz)
        return result


def one_pass(uses, loss):
    """`(OnePass, None)`, or `(None, reason)` when the loops of `uses` are
    read the way of `build` instead (`loop_rebuild.rebuild_once`)."""
    built, why = loop_rebuild.rebuild_once(uses, loss)
    if built is None:
        return None, why
    return OnePass(*built), None


def build(uses, cotangent_of, batch):
    """Each use's per-example gradients: `{(use.op, use.index): (Outer or
    None, [B, *x] or None)}` (see `_outer_of`).

    Args:
      uses: `LoopUse`s (those of one loop share one rebuild).
      cotangent_of: maps a loop output's ref to d(sum loss)/d output
        (missing or None: no gradient).
      batch: B (int or scalar tensor).
    """
    by_loop = collections.OrderedDict()
    for use in uses:
        by_loop.setdefault(use.loop, []).append(use)
    result = {}
    with tf.name_scope("loop_rules_form"):
        for loop, group in by_loop.items():
            hook, dz = loop_rebuild.tapped_dz(loop, group, cotangent_of,
                                                  batch)
            result.update({(use.op, use.index): _outer_of(use, hook, dz)
                           for use in group})
    return result


def _outside_value(use, slot):
    """x's value (or its slot's slice) outside the loop: the parameter of
    the rule's op run on the stacked rows."""
    src = use.op.inputs[use.index]
    value = src
    if src.dtype == tf.resource:
        value = tf.raw_ops.ReadVariableOp(resource=src,
                                          dtype=use.value.dtype)
        value.set_shape(use.value.shape)
    if slot is not None:
        j, n = slot
        value = tf.unstack(value, num=n, axis=0)[j]
    return value


def _fold(t):
    """`[T, B, ...]` -> `[T*B, ...]` (row t*B + b)."""
    rest = t.shape[2:]
    shape = ([-1] + rest.as_list() if rest.is_fully_defined() else
             tf.concat([[-1], tf.shape(t)[2:]], 0))
    return tf.reshape(t, shape)


def _unfold(t, steps, rows):
    """`[T*B, S, N]` -> `[B, T*S, N]` (example b's rows of every step; B =
    `rows`, given: with T = 0 there is nothing to infer it from)."""
    n = tf.compat.dimension_value(t.shape[2])
    n = n if n is not None else tf.shape(t)[2]
    t = tf.reshape(t, tf.stack([steps, rows, tf.shape(t)[1], n]))
    t = tf.transpose(t, [1, 0, 2, 3])
    return tf.reshape(t, tf.stack([rows, steps * tf.shape(t)[2], n]))


def _tap_result(use, tap, hook, dz):
    """The rule's answer for one tap on all steps at once: ("outer", a, g,
    key) in the layout of x's slice, or ("dense", [B, *slice])."""
    i = hook.taps.index(tap)
    inputs = list(tap.op.inputs)
    g = tf.convert_to_tensor(dz[hook.slot[i]])                 # [T, B, ...]
    steps, examples = tf.shape(g)[0], tf.shape(g)[1]
    for k in tap.others:
        stacked = hook.inputs[(i, k)]                           # [T, R, ...]
        # The rows become examples: other rows than the batch's (one row
        # broadcast later) would be made up; fail instead. Checked once
        # here on the stacked rows rather than at every step in the body.
        check = tf.debugging.assert_equal(
            tf.logical_or(tf.equal(tf.shape(stacked)[0], 0), tf.equal(
                tf.shape(stacked)[1], examples)), True,
            message="custagg: input %d of a loop rule's op '%s' has other "
                    "rows than the batch's examples; use strategy='pfor'"
                    % (k, tap.op.name))
        with tf.control_dependencies([check]):
            inputs[k] = _fold(stacked)
    inputs[tap.index] = _outside_value(use, tap.slot)
    for k in tap.stand_ins:
        # The rule reads only this input's shape (and the op's attributes):
        # zeros of `[T*B, ...]`, which nothing downstream runs. Where its
        # dims after the batch are not static, the output's (the one rule
        # that reads no other input, BiasAdd's, has its value shaped so).
        rest = tap.op.inputs[k].shape[1:]
        inputs[k] = tf.zeros(
            tf.concat([[steps * examples],
                       rest.as_list() if rest.is_fully_defined() else
                       tf.shape(g)[2:]], 0), tap.op.inputs[k].dtype)
        inputs[k].set_shape(tf.TensorShape([None]).concatenate(rest))
    # The tapped op once more, outside the loop, on every step's rows: the
    # rule reads its inputs, attributes and shapes from it.
    graph = tf.compat.v1.get_default_graph()
    op = graph.create_op(
        tap.op.type, inputs, [o.dtype for o in tap.op.outputs],
        name="loop_rule_" + tap.op.type,
        attrs={key: value for key, value in tap.op.node_def.attr.items()})
    rows = tf.shape(inputs[tap.others[0]])[0] if tap.others else \
        steps * examples
    ctx = registry_lib.RuleContext(op, tap.index, _fold(g), rows, {})
    outer = tap.rule.outer(ctx)
    if outer is not None:
        return ("outer", _unfold(outer.a, steps, examples),
                _unfold(outer.g, steps, examples), outer.key)
    per = tf.convert_to_tensor(tap.rule.per_example(ctx))      # [T*B, *p]
    per = tf.reshape(per, tf.concat([[steps, examples],
                                     tf.shape(per)[1:]], 0))
    return ("dense", tf.reduce_sum(per, axis=0))


def _identity_key(dims):
    return _outer.layout(dims[:-1], dims[-1:], None).key


def _outer_of(use, hook, dz):
    """`(Outer or None, dense or None)` for all taps of `use`: one Outer
    when every tap's rule gives one laid out as x's rows x columns (the
    taps' (a, g) pairs side by side along T: G_b is the sum over taps and
    iterations), else the dense `[B, *x]` sum."""
    shape = _outer.static_dims(use.value)
    results = []
    for tap in use.taps:
        i = hook.taps.index(tap)
        if i not in hook.fired:
            # find() took only ops on a path to the loss: a tap the rebuilt
            # body did not copy is a bug, never a zero to return.
            raise ValueError(
                "custagg: the loop rules did not find op '%s' in the rebuilt "
                "loop '%s'; use strategy='pfor' for this variable and "
                "report this graph." % (tap.op.name, use.name))
        results.append((tap, _tap_result(use, tap, hook, dz)))
    one_outer = shape is not None and all(
        r[0] == "outer" and r[3] == _identity_key(
            shape if tap.slot is None else shape[1:])
        for tap, r in results)
    if one_outer:
        a_parts, g_parts = [], []
        for tap, (_, a, g, _) in results:
            if tap.slot is not None:
                j, n = tap.slot
                width = tf.compat.dimension_value(a.shape[2])
                a = tf.pad(a, [[0, 0], [0, 0],
                               [j * width, (n - j - 1) * width]])
            a_parts.append(a)
            g_parts.append(g)
        a = a_parts[0] if len(a_parts) == 1 else tf.concat(a_parts, axis=1)
        g = g_parts[0] if len(g_parts) == 1 else tf.concat(g_parts, axis=1)
        outer = _outer.Outer(a, g, _outer.layout(shape[:-1], shape[-1:],
                                                 None))
        outer._choose_at_run_time = True
        return outer, None
    dense = []
    for tap, r in results:
        if r[0] == "outer":
            part = _outer.Outer(r[1], r[2], _outer.layout(
                [_outer.prod(r[3][0])], [_outer.prod(r[3][1])], None))
            # Back to the slice's layout through the rule's own `to_param`.
            part = _slice_layout(part, r[3])
        else:
            part = r[1]
        if tap.slot is not None:
            j, n = tap.slot
            part = tf.expand_dims(part, 1)
            rank = part.shape.rank
            part = tf.pad(part, [[0, 0], [j, n - j - 1]] +
                          [[0, 0]] * (rank - 2))
        dense.append(part)
    return None, tf.add_n(dense) if len(dense) > 1 else dense[0]


def _slice_layout(outer, key):
    """`[B, *slice]` from an Outer in the rule's layout `key`."""
    d_dims, k_dims, perm = key
    full = outer.per_example()                                # [B, D, K]
    return _outer.layout(list(d_dims), list(k_dims), perm)(
        tf.reshape(full, [tf.shape(full)[0], _outer.prod(d_dims),
                          _outer.prod(k_dims)]))


class LoopRule(registry_lib.Rule):
    """The rule of a loop use: every reduction from its Outer, or from its
    dense result (`ctx.cache`: "outer" or "dense"), both per row of the
    taps, `[R, ...]`.

    R is B, or B*T where the loop runs on an example-major fold of the
    batch (a char-level RNN on `[B*T, L, D]`): example b's gradient is then
    the sum of rows bT ... bT + T - 1, so the rows are grouped into B
    examples here (`Outer.grouped`, `registry.group_sum`; a no-op for R =
    B). Only the certified form reads folded rows, inside its `tf.cond`
    branch, after its run-time check at the loop's outputs (same rows:
    proved inside the body) held under that map (`certificate.Certificate`);
    the static proof keeps the rows B."""

    @staticmethod
    def _outer(ctx):
        outer = ctx.cache["outer"]
        if outer is None:
            return None
        return outer.grouped(_batch(ctx))

    def per_example(self, ctx):
        outer = self._outer(ctx)
        if outer is not None:
            return outer.per_example()
        return registry_lib.group_sum(ctx.cache["dense"], _batch(ctx))

    def outer(self, ctx):
        return self._outer(ctx)

    def _from_outer(self, ctx, name, args, answer):
        """`answer(outer)` from the outer-product form; where there is none,
        the base rule's `name(ctx, *args)` on the materialized rows."""
        outer = self._outer(ctx)
        if outer is None:
            return getattr(super(LoopRule, self), name)(ctx, *args)
        return answer(outer)

    def squared_norms(self, ctx):
        return self._from_outer(ctx, "squared_norms", (),
                                lambda o: o.squared_norms())

    def group_squared_norms(self, ctx, num_groups):
        return self._from_outer(
            ctx, "group_squared_norms", (num_groups,),
            lambda o: o.grouped(num_groups).squared_norms())

    def segment_squared_norms(self, ctx, segments):
        return self._from_outer(
            ctx, "segment_squared_norms", (segments,),
            lambda o: o.grouped(segments).squared_norms())

    def weighted_sum(self, ctx, weights):
        return self._from_outer(ctx, "weighted_sum", (weights,),
                                lambda o: o.weighted_sum(weights))

    def squared_sum(self, ctx):
        return self._from_outer(ctx, "squared_sum", (),
                                lambda o: o.squared_sum())


def _batch(ctx):
    """B: an int when static, else the scalar tensor."""
    b = tf.get_static_value(ctx.batch_size)
    return int(b) if b is not None else ctx.batch_size


class LoopContext(registry_lib.RuleContext):
    """A RuleContext whose parameter is x's value inside the body."""

    @property
    def param(self):
        return self.cache["param"]


RULE = LoopRule()
