"""What runs, and why: `Plan` and `Assignment`, and the planner.

`make_plan` asks each form of the strategy's chain (`forms.CHAINS`), in
order, whether it can give x's per-example gradients; the first that does
not refuse takes x, and the refusals before it become the assignment's
reason. A `Plan` is never changed after it is returned: a fallback a build
takes later is recorded by the engine (`Engine.built`), not in the plan.
Planning keeps no state between calls: everything it finds about a loss
lives in this call's `PlanContext`.
"""

from __future__ import annotations

import logging
import weakref

import tensorflow as tf

from custagg import batch_axis
from custagg import graph as graph_lib
from custagg import op_kinds
from custagg.graph.copier import CannotCopy
from custagg.per_example.forms import CHAINS
from custagg.per_example.forms import FORMS
from custagg.per_example.forms import Refused
from custagg.per_example.forms import copies
from custagg.per_example.forms import loop_rules
from custagg.per_example.forms import rules as rules_form
from custagg.rules import shortcuts

_LOG = logging.getLogger("custagg")

SLOW_FORMS = frozenset(name for name, f in FORMS.items() if f.slow)


class Assignment(object):
    """How one x gets its per-example gradients (read-only once built).

    Attributes:
      x: the x as given (variable or tensor).
      tensor: the graph tensor differentiated (a resource handle for
        resource variables).
      strategy: "rules", "pfor", "loop", or None when the loss does not
        depend on x.
      form: how the graph is built (a key of `forms.FORMS`); None when
        unconnected.
      reason: why the cheaper forms were not used; None when the first
        form of the chain was, or none was considered.
      consumers: the rule ops, loop uses and chains, for "rules".
      boundaries: the boundary ops, for the "boundary" form.
      forward: the forward pass to copy (`forms.copies.Forward`), for the
        "recompute" and "recompute-loop" forms.
      blocker: the op that kept x off a cheaper form, when one op did.
      causes: the refusals of `reason` without what is particular to x
        (`batch_axis.Reason.cause`): `str(plan)` prints each cause once,
        with the xs it holds up.
    """

    __slots__ = ("x", "tensor", "strategy", "reason", "consumers", "form",
                 "boundaries", "blocker", "forward", "causes", "_frozen")

    def __init__(self, x, tensor, strategy, reason=None, consumers=(),
                 form=None, boundaries=None, blocker=None, forward=None,
                 causes=()):
        set_ = object.__setattr__
        set_(self, "x", x)
        set_(self, "tensor", tensor)
        set_(self, "strategy", strategy)
        set_(self, "reason", reason)
        set_(self, "consumers", tuple(consumers))
        set_(self, "form", form or (strategy if strategy in ("rules", "loop")
                                    else None))
        set_(self, "boundaries", boundaries)
        set_(self, "blocker", blocker)
        set_(self, "forward", forward)
        set_(self, "causes", tuple(causes))
        set_(self, "_frozen", True)

    def __setattr__(self, name, value):
        raise AttributeError(
            "custagg: a plan's Assignment is read-only (setting %r); the "
            "plan says what runs, and a build records its fallbacks apart "
            "(Engine.built)." % name)

    def on_tensor(self, tensor):
        """This assignment differentiating `tensor` instead (x's copy in a
        recomputed graph: `Engine.exact`); itself when it is the same."""
        if tensor is self.tensor:
            return self
        return Assignment(self.x, tensor, self.strategy, self.reason,
                          self.consumers, self.form, self.boundaries,
                          self.blocker, self.forward, self.causes)

    @property
    def name(self):
        return getattr(self.x, "name", str(self.x))

    @property
    def cost(self):
        """The cost class of the form ("O(B)", "O(B^2)", ...), or None."""
        return FORMS[self.form].cost if self.form else None

    def __repr__(self):
        return "Assignment(%s: %s%s)" % (
            self.name, self.form or self.strategy,
            "" if not self.reason else ", because " + self.reason)


class Plan(object):
    """Which strategy and form each x got; `str(plan)` prints a small table.

    The plan is what runs: the per-example functions build exactly the
    forms it lists (or, where a build is refused, the fallback they record
    and log). It is never changed after it is returned.
    """

    def __init__(self, loss, assignments, batch_size, requested):
        self.loss = loss
        self.assignments = tuple(assignments)
        self.batch_size = batch_size
        self.requested = requested

    def _find(self, x):
        for a in self.assignments:
            if a.x is x or a.tensor is x:
                return a
        raise KeyError("custagg: %r is not one of the planned xs." % (x,))

    def strategy_for(self, x):
        return self._find(x).strategy

    def form_for(self, x):
        """"rules", "boundary", "whole-pass", "loop", ..., or None."""
        return self._find(x).form

    def strategies(self):
        """List aligned with xs: "rules" / "pfor" / "loop" / None."""
        return [a.strategy for a in self.assignments]

    def forms(self):
        """List aligned with xs: the form of each (see `forms.FORMS`)."""
        return [a.form for a in self.assignments]

    def slow(self):
        """The assignments whose cost grows with B^2."""
        return [a for a in self.assignments if a.form in SLOW_FORMS]

    def __str__(self):
        """One line per x (its form, and the numbers of the causes that
        kept it off cheaper ones), then each cause once with the xs it
        holds up."""
        lines = ["per-example plan (strategy=%r):" % self.requested]
        causes = {}     # cause -> (number, [x names]), in order found
        for a in self.assignments:
            refs = []
            for cause in a.causes:
                number, names = causes.setdefault(
                    cause, (len(causes) + 1, []))
                names.append(a.name)
                refs.append("(%d)" % number)
            lines.append("  %-40s %s%s" % (
                a.name, describe(a, reason=False),
                "  [why: %s]" % " ".join(refs) if refs else ""))
        if causes:
            lines.append("why not a cheaper form (each cause once, with the "
                         "variables it holds up):")
            for cause, (number, names) in causes.items():
                lines.append("  (%d) %s" % (number, cause))
                lines.append("      holds up: %s" % ", ".join(names))
        return "\n".join(lines)

    __repr__ = __str__


def describe(a, form=None, reason=True):
    """One line: what builds x's per-example gradients, and (with
    `reason`) why."""
    form = form or a.form
    if a.strategy is None:
        what = "unconnected (None)"
    elif form in ("rules", "loop-rules", "certified"):
        found = list(rules_form.rule_consumers(a.consumers))
        what = ("rules (certified at run time) via " if form == "certified"
                else "rules via ") + ", ".join(sorted(set(
            c.op.type for c in found if isinstance(c, rules_form.Consumer)) |
            set("%s in loop '%s'" % (t.op.type, c.name)
                for c in found if isinstance(c, loop_rules.LoopUse)
                for t in c.taps)))
        through = sorted(set(c.op.type for c in a.consumers
                             if isinstance(c, rules_form.Chain)))
        if through:
            what += " (through %s)" % ", ".join(through)
    else:
        f = FORMS[form]
        what = "%s: %s, %s" % (f.strategy, f.what, f.cost)
        if form in ("recompute", "recompute-loop") and a.forward is not None:
            what += (
                " (examples proved apart: no run-time check)"
                if a.forward.unproven is None else
                " (checked against the batch's losses at run time: "
                "not proved apart, %s)" % a.forward.unproven)
    if a.reason and reason:
        what += "  [%s]" % a.reason
    return what


class PlanContext(object):
    """What one `plan_per_example` call knows about its loss; the forms'
    `plan` reads it. Found lazily, once per call, and dropped with it."""

    def __init__(self, loss, registry):
        self.loss = loss
        self.registry = registry
        self.static_b = tf.compat.dimension_value(loss.shape[0])
        self.batch_size = (tf.shape(loss)[0] if self.static_b is None
                           else self.static_b)
        self.ancestors = graph_lib.ancestors(loss)
        self.live = shortcuts.live_ops(loss)
        self._region = None
        self._data = None
        self._forward = None
        self._varying = {}

    def region(self):
        """The ops that carry batch data (`batch_axis.batch_region`: the
        walk from the loss, whatever op types bring the batch in)."""
        if self._region is None:
            self._region = batch_axis.batch_region(self.loss, self.ancestors)
        return self._region

    def data_region(self):
        """The ops whose outputs may depend on fed data
        (`batch_axis.data_region`: found forward from the feeds and input
        pipelines, where `region` is what the walk back from the loss
        reached). An op in neither is proved free of examples' data."""
        if self._data is None:
            self._data = batch_axis.data_region(self.ancestors)
        return self._data

    def forward(self):
        """The forward pass to copy (`copies.Forward`), or the
        `CannotCopy` saying why it cannot be copied."""
        if self._forward is None:
            try:
                self._forward = copies.analyze(self.loss, self.ancestors,
                                               self.static_b)
            except CannotCopy as e:
                self._forward = e
        return self._forward

    def varying_loop(self, forward):
        """`copies.varying_loop(forward)`, once per call."""
        if "loop" not in self._varying:
            self._varying["loop"] = copies.varying_loop(forward)
        return self._varying["loop"]

    def inner_assignment(self, tensor, consumers):
        """The assignment of a chain's inner output (the rules' form)."""
        return Assignment(tensor, tensor, "rules", None, consumers)


def make_plan(loss, xs, tensors, strategy, registry):
    """The `Plan` of `xs` (graph tensors `tensors`) under `strategy`.

    Raises:
      ValueError: strategy "rules" refused for an x (the message names the
        op and suggests a strategy).
    """
    ctx = PlanContext(loss, registry)
    assignments = []
    for x, t in zip(xs, tensors):
        if t.op not in ctx.ancestors or not ctx.live.reaches(t):
            # As tf.gradients: None where no gradient reaches x.
            assignments.append(Assignment(x, t, None))
            continue
        reasons, causes, blocker, said = [], [], None, set()
        for form in CHAINS[strategy]:
            try:
                choice = form.plan(t, ctx)
            except Refused as r:
                # The certified rules refuse, mostly, for the rules' own
                # reason (no rule for an op): said once.
                cause = getattr(r.reason, "cause", str(r.reason))
                if cause not in said:
                    reasons.append(form.refused_as + str(r.reason))
                    causes.append(form.refused_as + cause)
                    said.add(cause)
                blocker = blocker or r.op
                if strategy == "rules":
                    raise ValueError(
                        "custagg: strategy='rules' cannot give per-example "
                        "gradients of %s: %s. Use strategy='auto' (falls "
                        "back to 'pfor' for this variable) or 'pfor', or "
                        "register a rule with @custagg.register_rule(...)."
                        % (getattr(x, "name", x), r.reason))
                continue
            if choice.note:
                reasons.append(choice.note)
                causes.append(choice.note)
            f = choice.form
            assignments.append(Assignment(
                x, t, f.strategy, "; ".join(reasons) or None,
                consumers=choice.consumers, form=f.name,
                boundaries=choice.boundaries, blocker=blocker,
                forward=choice.forward, causes=causes))
            break
        else:   # the last form of every chain takes any x
            raise AssertionError("custagg: no form took %s: %s" % (
                getattr(x, "name", x), "; ".join(reasons)))
    plan = Plan(loss, assignments, ctx.batch_size, strategy)
    _LOG.debug("%s", plan)
    return plan


# Keyed by graph: the (variable, form) pairs already warned about there.
# (Warnings only: what a later plan decides never depends on it.)
_WARNED = weakref.WeakKeyDictionary()


def warn_slow(plan, assignments=None, forms=None):
    """One short warning per graph for the xs whose cost grows with B^2.

    Asked-for slow strategies ("loop", "pfor" on a coupled graph) still
    warn: the user may not know what they cost. The warning names the op
    that kept them off the O(B) forms and the cheapest fix, when one is on
    the user's side. `assignments`/`forms`: a build's fallback (the forms
    that ran instead of the planned ones).
    """
    if assignments is None:
        slow = [(a, a.form) for a in plan.slow()]
    else:
        slow = [(a, f) for a, f in zip(assignments, forms)
                if f in SLOW_FORMS]
    graph = plan.loss.graph
    seen = _WARNED.setdefault(graph, set())
    fresh = [(a, f) for a, f in slow if (a.name, f) not in seen]
    if not fresh:
        return
    seen.update((a.name, f) for a, f in fresh)
    blockers = {a.blocker.name: a.blocker for a, _ in fresh if a.blocker}
    what = "; ".join(sorted({_fix_hint(op) for op in blockers.values()}))
    _LOG.warning(
        "custagg: per-example gradients of %s cost O(B^2) (%s)%s. %s"
        "print(custagg.plan_per_example(...)) shows why.",
        ", ".join(sorted({a.name for a, _ in fresh})),
        ", ".join(sorted({FORMS[f].what for _, f in fresh})),
        (", held up by op " + ", ".join("'%s' (%s)" % (n, op.type)
                                        for n, op in sorted(blockers.items())))
        if blockers else "",
        (what + ". ") if what else "")


def _fix_hint(op):
    """The cheapest fix for a blocking op, in the user's terms ("" if none)."""
    if op.type.startswith("FusedBatchNorm") or \
            op.type in op_kinds.SUM_REDUCTIONS:
        return ("batch statistics mix examples: per-example gradients are "
                "exact but cost a pass per example; layer normalization, or "
                "batch normalization in inference mode, keeps them apart")
    shapes = [t.shape for t in list(op.inputs) + list(op.outputs)]
    if any(sh.rank is None or (sh.rank and None in sh.as_list()[1:])
           for sh in shapes):
        return ("op '%s' has inputs or outputs of unknown shape: giving the "
                "placeholders static shapes except the batch axis may let "
                "custagg prove that examples stay apart" % op.name)
    if op.type == "Reshape" or op.type == "Transpose":
        return ("op '%s' moves the batch axis: keep the batch on axis 0 "
                "(tf.reshape(x, [tf.shape(x)[0], ...]) or [-1, ...])"
                % op.name)
    return ""
