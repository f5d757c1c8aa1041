"""The rules' one backward pass, shared by every x on rules.

`SharedPass` runs ONE backward pass of the summed loss to the outputs of
every rule op (and every loop the loop rules read, rebuilt once where they
can be: `loop_rules.one_pass`), and gives each rule consumer its
`RuleContext`; the certified rules on the rows of a fold read them through
`folded_rows.FoldedRows`.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from custagg import sparse
from custagg.traversal.gradients import gradients
from custagg.per_example.folded_rows import FoldedRows
from custagg.per_example.forms import loop_rules
from custagg.per_example.forms import rows as rows_lib
from custagg.per_example.forms import rules as rules_form
from custagg.rules import registry as registry_lib

_LOG = logging.getLogger("custagg")


class SharedPass(object):
    """The rules' one backward pass, shared by every x on rules."""

    def __init__(self, plan):
        self.plan = plan
        self._contexts = None
        self._one = None
        self._loss = plan.loss
        # Inside a `tf.cond` branch (the certified rules): the contexts'
        # caches for that branch only, so a tensor a rule caches there is
        # never read from outside it (`Engine._branch`).
        self.branch_caches = None
        self._folds = {}
        # ref -> the shared pass's gradient at a loop use's check tensor.
        self._checks = {}
        # (op, index) -> scalar bool: the rows of a fold read either way
        # (`rows.RowFold.either`) are time-major at this step (set by the
        # `Certificate`, read by `FoldedRows`).
        self.time_major = {}

    def _build(self):
        self._contexts = {}
        found = list(rules_form.rule_consumers(
            c for x in self.plan.assignments if x.strategy == "rules"
            for c in x.consumers))
        consumers = [c for c in found if isinstance(c, rules_form.Consumer)]
        uses = [c for c in found if isinstance(c, loop_rules.LoopUse)]
        one = None
        # One scope for the pass (re-entered below, not "..._1").
        with tf.name_scope("per_example_rules") as scope:
            pass
        if uses:
            # The tapped loops and the loss recomputed from them: one
            # forward and one backward pass of each loop (the certificate
            # checks rows of the same recomputed graph: `tensor_of`).
            with tf.name_scope(scope):
                one, why = loop_rules.one_pass(uses, self.plan.loss)
            if one is None:
                _LOG.info("custagg: the loop rules run their loops twice: %s",
                          first_line(why if isinstance(why, Exception)
                                     else ValueError(str(why))))
        self._one = one
        if one is None:
            loss, batch, op_of = self.plan.loss, self.plan.batch_size, \
                (lambda op: op)
        else:
            # B from the recomputed loss: the original's shape would run
            # the original loop.
            loss, op_of = one.loss, one.op_of
            batch = self.plan.batch_size if isinstance(
                self.plan.batch_size, int) else tf.shape(loss)[0]
        self._loss = loss
        ops = [op_of(c.op) for c in consumers]
        outs = [op.outputs[0] for op in ops]
        # Today's path: the rebuilt loops are seeded with the loss's
        # gradient at the loops' outputs, from the same backward pass.
        targets = loop_rules.cotangent_targets(uses) if one is None else []
        eps = [] if one is None else one.eps
        # Rules that read the gradient at other tensors too (nce_loss's
        # gather: the sampled logits) get it from the same pass.
        extras = [list(c.rule.extra_targets(registry_lib.RuleContext(
            op, c.index, None, batch))) for c, op in zip(consumers, ops)]
        flat = [t for ts in extras for t in ts]
        # The certificate's g1 at the loops' outputs (`LoopUse.checks`, in
        # the graph of `loss`) from this pass too: a pass of its own to
        # them was the whole backward pass below the loops once more.
        checks = []
        for u in uses:
            for t, _ in u.checks or ():
                t = t if one is None else one.tensor_of(t)
                if not any(t is c for c in checks):
                    checks.append(t)
        with tf.name_scope(scope):
            grads = gradients(loss, outs + targets + eps + flat + checks,
                              skip_unneeded_captures=True) \
                if outs or targets or eps else []
        n = len(outs) + len(targets)
        if checks:
            self._checks = {t.ref(): g for t, g in
                            zip(checks, grads[len(grads) - len(checks):])}
            grads = grads[:len(grads) - len(checks)]
        extra_grads = grads[n + len(eps):]
        for c, op, g, ts in zip(consumers, ops, grads, extras):
            cache = {}
            if ts:
                got, extra_grads = extra_grads[:len(ts)], \
                    extra_grads[len(ts):]
                cache["extra"] = [tf.zeros_like(t) if e is None
                                  else sparse.dense(e)
                                  for t, e in zip(ts, got)]
            ctx = None if g is None else registry_lib.RuleContext(
                op, c.index, sparse.dense(g), batch, cache)
            self._contexts[(c.op, c.index)] = ctx
        if uses:
            if one is None:
                seeds = {t.ref(): g if g is None or t.dtype == tf.variant
                         else sparse.dense(g)
                         for t, g in zip(targets, grads[len(outs):n])}
                outers = loop_rules.build(uses, seeds, batch)
            else:
                outers = one.build(grads[n:n + len(eps)], batch)
            for u in uses:
                outer, dense = outers[(u.op, u.index)]
                self._contexts[(u.op, u.index)] = loop_rules.LoopContext(
                    u.op, u.index, None, batch,
                    {"outer": outer, "dense": dense, "param": u.value})

    def one_pass(self):
        """The loop rules' `OnePass` (its loops the only ones run), or None
        (no loop rules, or today's two passes)."""
        if self._contexts is None:
            self._build()
        return self._one

    def check_gradient(self, t):
        """`(True, d sum(loss()) / dt)` (the gradient None where the loss
        does not reach t) for a tensor a loop use's certificate reads
        (`LoopUse.checks`, as `tensor_of` maps it), from this pass;
        `(False, None)` for any other tensor."""
        if self._contexts is None:
            self._build()
        if t.ref() not in self._checks:
            return False, None
        return True, self._checks[t.ref()]

    def built_one_pass(self):
        """`one_pass()` if the shared pass is built already, else None
        (never builds it: a caller inside a `tf.cond` branch must not)."""
        return None if self._contexts is None else self._one

    def batch_size(self):
        """B as the plan has it (an int when static), else from the loss
        the shared pass differentiates (`rows`)."""
        b = self.plan.batch_size
        return b if isinstance(b, int) else self.rows()

    def loss(self):
        """The `[B]` loss the shared pass differentiates: the plan's, or
        where the loops were rebuilt (`one_pass`) the loss recomputed from
        them."""
        if self._contexts is None:
            self._build()
        return self._loss

    def tensor_of(self, t):
        """`t` in the graph of `loss()`: its copy where it lies after a
        rebuilt loop, else `t`."""
        if self._contexts is None:
            self._build()
        return t if self._one is None else self._one.tensor_of(t)

    def rows(self):
        """B as a scalar tensor, from the loss the shared pass
        differentiates (never the original's where the loops were rebuilt:
        its shape would run the original loops)."""
        if self._contexts is None:
            self._build()
        return tf.shape(self._loss)[0]

    def context(self, c):
        """The `RuleContext` of one rule consumer, or None when the loss's
        gradient does not reach it."""
        if self._contexts is None:
            self._build()
        return self._in_branch(c, self._contexts[(c.op, c.index)])

    def _in_branch(self, c, ctx):
        if ctx is None or self.branch_caches is None:
            return ctx
        # What the cache held before the branch (built outside it) stays
        # readable; what the branch adds stays in the branch.
        cache = self.branch_caches.setdefault((c.op, c.index),
                                              dict(ctx.cache or {}))
        return ctx._replace(cache=cache)

    def contexts(self, a):
        """(rule, RuleContext) pairs of an x planned as "rules" (its chains
        apart); consumers the loss's gradient does not reach are left out."""
        if self._contexts is None:
            self._build()
        out = []
        for c in a.consumers:
            if isinstance(c, rules_form.Chain):
                continue
            ctx = self._in_branch(c, self._contexts[(c.op, c.index)])
            if ctx is None:
                continue
            rule = loop_rules.RULE if isinstance(c, loop_rules.LoopUse) \
                else c.rule
            if a.form == "certified" and self.fold(c) is not None:
                rule = FoldedRows(rule, self.time_major.get(
                    (c.op, c.index)))
            out.append((rule, ctx))
        return out

    def fold(self, c):
        """The `rows.RowFold` of a rule consumer's rows (a certified rule
        on `[B*T, ...]` rows of a proved fold), or None."""
        key = (c.op, c.index)
        if key not in self._folds:
            fold = None
            if isinstance(c, rules_form.Consumer):
                start, axis = c.rule.coupling_start(registry_lib.RuleContext(
                    c.op, c.index, None, None))
                if start is c.op.outputs[0] and isinstance(axis, int):
                    fold = rows_lib.fold_of(start, axis, self.plan.loss)
            self._folds[key] = fold
        return self._folds[key]


def first_line(e):
    """The line of an exception's text that says what went wrong."""
    lines = [l.strip() for l in str(e).strip().split("\n") if l.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line[:300]
    return (lines[0] if lines else type(e).__name__)[:300]
