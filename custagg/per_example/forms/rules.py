"""The "rules" and "loop-rules" forms: one backward pass, a rule per op.

Planning finds, for x, every op where x's value is used (looking through
the ops `custagg.rules.shortcuts` lets the rules see through) and asks the
registry for a rule; each rule op must keep examples apart down to the loss
(`batch_axis.coupling`). An op that sees no batch data (`l2_loss(w)`) is a
`Chain`: x's gradient through it is that op's own gradient applied to the
per-example gradients of its outputs, which the rules give. "Sees no batch
data" is proved, not assumed: outside the batch region and with every
input other than x computed from constants and variables alone
(`_sees_no_data`); an op that reads fed data the walk from the loss did
not reach is a rule consumer, certified at run time where its static proof
fails. A loop that x
enters is read by the loop rules (`loop_rules.find`), which ask the same
registry for the body's ops.

Building is shared by every x on rules: the engine's `SharedPass` runs one
backward pass of the summed loss to all rule ops' outputs (and the loops'
outputs), and each quantity is reduced from the rules' `RuleContext`s.
"""

from __future__ import annotations

import collections

from custagg import batch_axis
from custagg import graph as graph_lib
from custagg import op_kinds
from custagg.per_example.forms import base
from custagg.per_example.forms import loop_rules
from custagg.per_example.forms import rows
from custagg.rules import registry as registry_lib
from custagg.rules import shortcuts
from custagg.rules.applies import rule_reason  # noqa: F401  (the rules' own checks)

# x used by a rule op: `op.inputs[index]` carries x; `rule` from the registry.
Consumer = collections.namedtuple("Consumer", ["op", "index", "rule"])
# A consumer that sees no batch data (`l2_loss(w)`, `gamma * rsqrt(var)`):
# x's per-example gradient through it is the op's own gradient (TF's, so
# overrides hold) applied to the per-example gradients of its output,
# which the rules give (`inner`: one Assignment per float output).
Chain = collections.namedtuple("Chain", ["op", "indices", "inner"])

# How many batch-free ops a chain may pass before the rules give up.
MAX_CHAIN = 16


def rule_consumers(consumers):
    """The `Consumer`s and `LoopUse`s of `consumers`, chains' inner ones
    included."""
    for c in consumers:
        if isinstance(c, Chain):
            for inner in c.inner:
                for r in rule_consumers(inner.consumers):
                    yield r
        else:
            yield c


def find_consumers(x_tensor, loss_ancestors, live):
    """(op, input index) pairs where x's value enters a non-pass-through op.

    Only ops a gradient of the loss goes through (`live`) count: a use of x
    under `tf.stop_gradient` or an integer cast is no consumer.
    """
    found = []
    for t, stack in graph_lib.depth_first(x_tensor):
        for op in t.consumers():
            if op not in loss_ancestors or op not in live:
                continue
            for k, inp in enumerate(op.inputs):
                if inp is not t or not live.reaches(inp):
                    continue
                if shortcuts.passes_through(op, k, live):
                    stack.append(op.outputs[0])
                else:
                    found.append((op, k))
    return found


def _reached_refs(x_tensor, loss_ancestors, live):
    """Refs of x and of the pass-through tensors `find_consumers` follows."""
    refs = set()
    for t, stack in graph_lib.depth_first(x_tensor, refs):
        for op in t.consumers():
            if op in loss_ancestors and op.inputs[0] is t and \
                    shortcuts.passes_through(op, 0, live):
                stack.append(op.outputs[0])
    return refs


def find_rule_consumers(x_tensor, ctx, depth=0, unproven=None):
    """x's rule consumers (`Consumer`s, `LoopUse`s, `Chain`s), or raises
    `Refused` naming the op that has no usable rule.

    `unproven`: None (the static proof must hold for every rule op), or a
    list: a rule op that applies but whose separation down to the loss the
    static analysis cannot prove is taken anyway and its reason appended
    (the certified form checks those at run time); a loop proved apart
    only inside its body is taken with the tensors after it to check
    (`LoopUse.checks`).
    """
    loss, loss_ancestors = ctx.loss, ctx.ancestors
    found = batch_axis.infer(loss)
    if not found.sources and unproven is not None:
        # No batch source found from the loss (a shape known only at run
        # time, an op the table does not know): each rule op's rows are
        # checked at run time instead (the certificate), whatever lies
        # between it and the loss.
        unproven.append(batch_axis.Reason(
            batch_axis.no_sources_reason(found),
            getattr(found.blocked[0], "op", None) if found.blocked else None))
    elif not found.sources:
        # No batch data at all: say why, not where a chain gave up. A rule
        # op that x meets and that refuses on its own terms ("training
        # mode", a coupling from its output) names the cause more precisely
        # than the op where the walk back from the loss stopped.
        for op, k in find_consumers(x_tensor, loss_ancestors, ctx.live):
            if ctx.registry.lookup(op.type) is not None:
                why = rule_reason(op, k, ctx.registry, ctx.batch_size, loss,
                                  loss_ancestors)
                if why:
                    raise base.Refused(why)
        raise base.Refused(batch_axis.Reason(
            batch_axis.no_sources_reason(found),
            getattr(found.blocked[0], "op", None) if found.blocked else None))
    region = ctx.region()
    consumers, chained = [], set()
    for op, k in find_consumers(x_tensor, loss_ancestors, ctx.live):
        if op.type in op_kinds.LOOP_ENTRIES:
            # A loop: its body's ops are what use x (loop rules).
            use, why = loop_rules.find(op, k, loss, loss_ancestors,
                                       ctx.registry, ctx.batch_size)
            if use is None and unproven is not None:
                # Apart inside the loop, not proved after it: the
                # certificate checks the loop's outputs at run time.
                deferred, _ = loop_rules.find(
                    op, k, loss, loss_ancestors, ctx.registry,
                    ctx.batch_size, defer=True)
                if deferred is not None:
                    unproven.append(why)
                    use = deferred
            if use is None:
                raise base.Refused(_loop_reason(op, why))
            consumers.append(use)
            continue
        if loop_rules.in_v1_loop(op):
            # A gradient at a tensor inside a v1 frame is not per iteration.
            raise base.Refused(batch_axis.Reason(
                "op '%s' (type %s) is inside a v1 while loop" % (
                    op.name, op.type), op))
        if op not in region and depth < MAX_CHAIN and \
                _sees_no_data(op, x_tensor, ctx):
            if op in chained:
                continue
            chained.add(op)
            consumers.append(_chain(op, x_tensor, ctx, depth, unproven))
            continue
        why = rule_reason(op, k, ctx.registry, ctx.batch_size, loss,
                          loss_ancestors)
        if why and unproven is not None and rule_reason(
                op, k, ctx.registry, ctx.batch_size, None, None) is None:
            # The rule applies; only the proof of separation failed.
            unproven.append(why)
            why = None
        if why:
            raise base.Refused(why)
        consumers.append(Consumer(op, k, ctx.registry.lookup(op.type)))
    if not consumers:
        raise base.Refused(
            "x reaches the loss through no op with a batch input")
    return consumers


def _loop_reason(op, why):
    """Why the loop rules refused loop `op` (`why`, from `loop_rules.find`),
    with its cause: where the proof stopped after the loop (an op of the
    graph the loop is in) is the same for every weight of the loop, so the
    plan prints it once."""
    stop = getattr(why, "op", None)
    cause = None
    if stop is not None and stop.graph is op.graph:
        cause = ("no static proof that examples stay apart from loop '%s' "
                 "to the loss: %s" % (op.name, batch_axis.mixes_text(stop)))
    return batch_axis.Reason(
        "no per-example rule for op type '%s' (op '%s'): %s"
        % (op.type, op.name, why), stop or op, cause=cause)


def _sees_no_data(op, x_tensor, ctx):
    """Whether `op` (outside the batch region) is proved to see no batch
    data, so that it may be a `Chain`: each input is x (or x read through
    ops the rules see through) or computed from constants, variables and
    scalars alone (`PlanContext.data_region`).

    The batch region is only what the walk back from the loss reached: an
    op the walk could not pass (a reshape by another tensor's `tf.shape`,
    an op the table does not know) hides the batch's own inputs behind it,
    so the ops that read them, an embedding gather of fed ids, lie outside
    the region while holding rows of examples. Chaining through such an op
    would take its output for a parameter shared by the batch; instead it
    is a rule consumer like any op in the region: its rule's static proof
    of separation is asked for, and where that fails the certified form
    checks its rows at run time (or the plan refuses them,
    `forms/rows.py`).
    """
    data = ctx.data_region()
    if op not in data:
        return True
    reached = _reached_refs(x_tensor, ctx.ancestors, ctx.live)
    return all(inp.ref() in reached or inp.op not in data
               for inp in op.inputs)


def _chain(op, x_tensor, ctx, depth, unproven=None):
    """A `Chain` through `op` (which sees no batch data), or raises."""
    reached = _reached_refs(x_tensor, ctx.ancestors, ctx.live)
    indices = [k for k, inp in enumerate(op.inputs) if inp.ref() in reached]
    inner = []
    for out in op.outputs:
        if out.op not in ctx.ancestors or not out.dtype.is_floating:
            continue
        if not any(c in ctx.ancestors for c in out.consumers()):
            continue
        consumers = find_rule_consumers(out, ctx, depth + 1, unproven)
        inner.append(ctx.inner_assignment(out, consumers))
    if not inner:
        raise base.Refused("op '%s' reaches the loss through no float "
                           "output" % op.name)
    return Chain(op, indices, inner)


class RulesForm(base.Form):
    """Per-op rules from one shared backward pass (`shared_pass.SharedPass`)."""

    name = "rules"
    strategy = "rules"
    what = "rules"
    cost = "about 1 backward pass"

    def plan(self, x_tensor, ctx):
        consumers = find_rule_consumers(x_tensor, ctx)
        in_loops = any(isinstance(c, loop_rules.LoopUse)
                       for c in rule_consumers(consumers))
        return base.Choice(LOOP_RULES if in_loops else self,
                           consumers=consumers)

    def build(self, engine, group):
        # The rules never materialize through this path: the engine reduces
        # each quantity from the shared pass's contexts.
        return {id(a): engine.rules_per_example(a) for a in group}


class LoopRulesForm(RulesForm):
    """The rules, some of them inside loop bodies (`loop_rules`)."""

    name = "loop-rules"
    what = ("rules, inside loop bodies too (the loop run once more on the "
            "whole batch)")
    cost = "about 2 backward passes"


class CertifiedForm(RulesForm):
    """The rules where the static proof of separation fails, certified at
    run time (`certificate.Certificate`): one more backward pass, seeded with
    random per-example weights c, must give at the rule's start
    `gc = c_pi(r) * g1` row by row; a step whose check fails takes the
    exact form (`EXACT`) under `tf.cond` instead."""

    name = "certified"
    what = "rules (certified at run time)"
    cost = "about 2 backward passes"
    scope = "certified_rules"
    refused_as = "no certified rules: "

    def plan(self, x_tensor, ctx):
        unproven = []
        consumers = find_rule_consumers(x_tensor, ctx, unproven=unproven)
        if not unproven:    # cannot happen after RULES refused; be safe
            raise base.Refused("nothing to certify")
        for c in rule_consumers(consumers):
            if isinstance(c, loop_rules.LoopUse):
                # Its rows were read when its checks were found.
                continue
            rule_ctx = registry_lib.RuleContext(c.op, c.index, None,
                                                ctx.batch_size)
            if len(c.rule.coupling_starts(rule_ctx)) > 1:
                # The row check reads one tensor's rows.
                raise base.Refused(batch_axis.Reason(
                    "op '%s': the %s rule reads rows of several tensors, "
                    "which one row check cannot certify" % (
                        c.op.name, c.op.type), c.op))
            start, axis = c.rule.coupling_start(rule_ctx)
            if not isinstance(axis, int):
                # The row check reads one batch axis of the rule's output.
                raise base.Refused(batch_axis.Reason(
                    "the batch is not one axis of op '%s''s output (%s)"
                    % (c.op.name, axis), c.op))
            # Rows no run-time check can map to examples: the check would
            # fail every step, so x goes on to the next form now.
            why = rows.non_example_rows(start, axis, ctx.loss)
            if why is not None:
                raise base.Refused(batch_axis.Reason(
                    "op '%s': %s" % (c.op.name, why), why.op))
        # Why the static proof failed is the rules' refusal, already in
        # the plan's reason.
        return base.Choice(self, consumers=consumers)

    def build(self, engine, group):
        # Each quantity is chosen per x under its own `tf.cond`
        # (`Engine.certified`): the rules' value, or the exact form's.
        return {id(a): engine.per_example(a) for a in group}


RULES = RulesForm()
LOOP_RULES = LoopRulesForm()
CERTIFIED = CertifiedForm()
