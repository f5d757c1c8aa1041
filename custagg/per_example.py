"""Per-example gradients, norms, clipped and weighted sums: the front door.

Every function takes a per-example loss `per_example_loss` of shape `[B]`
(B may be unknown until run time) and a list `xs` of variables or tensors.
Results are gradients of the per-example losses as given: a mean loss scales
each example's gradient by 1/B. `None` stands for "no gradient" (the loss
does not depend on that x), as in `tf.gradients`.

Strategies (chosen per x by `plan_per_example`):

* `"loop"`: one backward pass per example (`custagg.gradients(loss[i], x)`);
  obviously correct, needs a static B, graph and time grow with B^2.
* `"pfor"`: TF's vectorization (`parallel_for.pfor`) of the backward pass
  seeded with `one_hot(i)`, in chunks of `pfor_chunk_size` examples so
  memory stays bounded. Exact for any graph pfor can convert (it falls back
  to a while loop for ops it cannot).
* `"rules"`: one backward pass of the summed loss to the outputs of the ops
  that consume x, then a per-op rule (`custagg.rules`) forms each example's
  gradient from the op's inputs and that output gradient (outer products).
  About one backward pass; norms and clipped sums never materialize
  `[B, *x.shape]`. Needs a rule for every consumer and no batch coupling
  downstream; otherwise it is an error that says what to use instead.
* `"auto"`: "rules" for each x that qualifies, "pfor" for the others (and
  "loop" if pfor cannot build and B is static).

"pfor" takes, per x, the first form that applies: the boundary ops (O(B));
per-example copies of the forward pass, vectorized by pfor ("recompute",
O(B): `custagg.recompute`, for weights inside loops and ops no rule covers),
or run in a while loop when pfor cannot convert the copies
("recompute-loop", O(B)); the whole backward pass per example (O(B^2), the
last resort, used where examples interact or the forward pass cannot be
copied). `str(plan)` gives each choice and why.
"""

from __future__ import annotations

import collections
import logging
import weakref

import numpy as np
import tensorflow as tf

from custagg import batch_axis
from custagg import graph as graph_lib
from custagg import errors
from custagg import loop_rules
from custagg import recompute
from custagg import registry as registry_lib
from custagg import separability
from custagg import shortcuts
from custagg import sparse
from custagg import vectorized
from custagg._tf_compat import indexed_slices as indexed_slices_lib
from custagg._tf_compat import resource_variable_ops
from custagg.aggregation import AggregationMethod
from custagg.gradients import gradients
from custagg.rules import _outer as _outer_lib

_LOG = logging.getLogger("custagg")

STRATEGIES = ("auto", "rules", "pfor", "loop")

_Consumer = collections.namedtuple("_Consumer", ["op", "index", "rule"])
# A consumer that sees no batch data (`l2_loss(w)`, `gamma * rsqrt(var)`):
# x's per-example gradient through it is the op's own gradient (TF's, so
# overrides hold) applied to the per-example gradients of its output,
# which the rules give (`inner`: one Assignment per float output).
_Chain = collections.namedtuple("_Chain", ["op", "indices", "inner"])


# How each strategy's per-example graph is built, and what it costs in
# backward passes over the batch (B examples).
FORMS = {
    "rules": ("rules", "about 1 backward pass"),
    "loop-rules": ("rules, inside loop bodies too (the loop run once more "
                   "on the whole batch)", "about 2 backward passes"),
    "boundary": ("pfor at the ops where x meets batch data", "O(B)"),
    "recompute": ("pfor over per-example copies of the forward pass",
                  "O(B)"),
    "recompute-loop": ("a while loop over per-example copies of the forward "
                       "pass", "O(B)"),
    "whole-pass": ("pfor over the whole backward pass", "O(B^2)"),
    "loop": ("one backward pass per example", "O(B^2)"),
}
SLOW_FORMS = frozenset(["whole-pass", "loop"])


class Assignment(object):
    """How one x gets its per-example gradients.

    Attributes:
      x: the x as given (variable or tensor).
      tensor: the graph tensor differentiated (a resource handle for
        resource variables).
      strategy: "rules", "pfor", "loop", or None when the loss does not
        depend on x.
      form: how the graph is built (a key of `FORMS`): "rules",
        "boundary" or "whole-pass" (strategy "pfor"), "loop"; None when
        unconnected.
      reason: why "rules" (and, for "whole-pass", the boundary form)
        could not be used; None when they were, or were not considered.
      consumers: the rule ops, for "rules".
      boundaries: the boundary ops, for the "boundary" form.
      forward: the forward pass to copy (`recompute.Forward`), for the
        "recompute" and "recompute-loop" forms.
      blocker: the op that kept x off "rules", when one op did.
    """

    def __init__(self, x, tensor, strategy, reason=None, consumers=(),
                 form=None, boundaries=None, blocker=None):
        self.x, self.tensor = x, tensor
        self.strategy, self.reason = strategy, reason
        self.consumers = list(consumers)
        self.form = form or (strategy if strategy in ("rules", "loop")
                             else None)
        self.boundaries = boundaries
        self.blocker = blocker
        self.forward = None     # recompute.Forward, for the recompute forms

    @property
    def name(self):
        return getattr(self.x, "name", str(self.x))

    @property
    def cost(self):
        """The cost class of the form ("O(B)", "O(B^2)", ...), or None."""
        return FORMS[self.form][1] if self.form else None

    def __repr__(self):
        return "Assignment(%s: %s%s)" % (
            self.name, self.form or self.strategy,
            "" if not self.reason else ", because " + self.reason)


class Plan(object):
    """Which strategy and form each x got; `str(plan)` prints a small table.

    The plan is what runs: the per-example functions build exactly the
    forms it lists.
    """

    def __init__(self, loss, assignments, batch_size, requested):
        self.loss = loss
        self.assignments = assignments
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
        """"rules", "boundary", "whole-pass", "loop", or None."""
        return self._find(x).form

    def strategies(self):
        """List aligned with xs: "rules" / "pfor" / "loop" / None."""
        return [a.strategy for a in self.assignments]

    def forms(self):
        """List aligned with xs: the form of each (see `FORMS`)."""
        return [a.form for a in self.assignments]

    def slow(self):
        """The assignments whose cost grows with B^2."""
        return [a for a in self.assignments if a.form in SLOW_FORMS]

    def __str__(self):
        lines = ["per-example plan (strategy=%r):" % self.requested]
        for a in self.assignments:
            if a.strategy is None:
                what = "unconnected (None)"
            elif a.form in ("rules", "loop-rules"):
                what = "rules via " + ", ".join(sorted(set(
                    c.op.type for c in _rule_consumers(a.consumers)
                    if isinstance(c, _Consumer)) | set(
                    "%s in loop '%s'" % (t.op.type, c.name)
                    for c in _rule_consumers(a.consumers)
                    if isinstance(c, loop_rules.LoopUse) for t in c.taps)))
                through = sorted(set(c.op.type for c in a.consumers
                                     if isinstance(c, _Chain)))
                if through:
                    what += " (through %s)" % ", ".join(through)
            else:
                what = "%s: %s, %s" % (a.strategy, FORMS[a.form][0], a.cost)
                if a.form in ("recompute", "recompute-loop") and \
                        a.forward is not None:
                    what += (
                        " (examples proved apart: no run-time check)"
                        if a.forward.unproven is None else
                        " (checked against the batch's losses at run time: "
                        "not proved apart, %s)" % a.forward.unproven)
            if a.reason:
                what += "  [%s]" % a.reason
            lines.append("  %-40s %s" % (a.name, what))
        return "\n".join(lines)

    __repr__ = __str__


# --------------------------------------------------------------------------
# Planning


def _check_loss(per_example_loss, fn_name):
    errors.check_not_eager(fn_name)
    if isinstance(per_example_loss, (list, tuple)):
        raise TypeError(
            "%s: per_example_loss must be one tensor of shape [B] (the loss of "
            "each example); got a %s. Use tf.stack(...) on the per-example "
            "terms." % (fn_name, type(per_example_loss).__name__))
    errors.check_graph_tensor(per_example_loss, "per_example_loss", fn_name)
    loss = tf.convert_to_tensor(per_example_loss)
    if loss.shape.rank != 1:
        raise ValueError(
            "%s: per_example_loss must have shape [B], one loss per example; "
            "got shape %s. Reduce the other axes per example first (e.g. "
            "tf.reduce_sum(loss, axis=1)), and do not average over the "
            "batch." % (fn_name, loss.shape))
    if not loss.dtype.is_floating:
        raise TypeError("%s: per_example_loss must be floating point; got %s."
                        % (fn_name, loss.dtype.name))
    return loss


def _check_strategy(strategy, fn_name):
    if strategy not in STRATEGIES:
        raise ValueError("%s: unknown strategy %r; expected one of %s."
                         % (fn_name, strategy, ", ".join(map(repr,
                                                             STRATEGIES))))


def _as_tensor(x, i, fn_name):
    if resource_variable_ops.is_resource_variable(x):
        return x.handle
    errors.check_graph_tensor(x, "xs[%d]" % i, fn_name)
    return indexed_slices_lib.internal_convert_to_tensor_or_indexed_slices(
        x, as_ref=True)


def _find_consumers(x_tensor, loss_ancestors, live):
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


def _rules_reason(x_tensor, loss, loss_ancestors, registry, batch_size,
                  region=None, depth=0):
    """(consumers, None) if every consumer of x has a usable rule, else
    (None, reason). Consumers are `_Consumer`s and, for ops that see no
    batch data, `_Chain`s through them."""
    if region is None:
        region = batch_axis.batch_region(loss, loss_ancestors)
    found = batch_axis.infer(loss)
    if not found.sources:
        # No batch data at all: say why, not where a chain gave up.
        return None, separability.Reason(
            batch_axis.no_sources_reason(found),
            getattr(found.blocked[0], "op", None) if found.blocked else None)
    consumers, chained = [], set()
    for op, k in _find_consumers(x_tensor, loss_ancestors,
                                 shortcuts.live_ops(loss)):
        if op.type in loop_rules.ENTRY_TYPES:
            # A loop: its body's ops are what use x (loop rules).
            use, why = loop_rules.find(op, k, loss, loss_ancestors)
            if use is None:
                return None, separability.Reason(
                    "no per-example rule for op type '%s' (op '%s'): %s"
                    % (op.type, op.name, why), getattr(why, "op", None) or op)
            consumers.append(use)
            continue
        if loop_rules.in_v1_loop(op):
            # A gradient at a tensor inside a v1 frame is not per iteration.
            return None, separability.Reason(
                "op '%s' (type %s) is inside a v1 while loop" % (
                    op.name, op.type), op)
        if op not in region and depth < _MAX_CHAIN:
            if op in chained:
                continue
            chained.add(op)
            chain, why = _chain(op, x_tensor, loss, loss_ancestors, registry,
                                batch_size, region, depth)
            if chain is None:
                return None, why
            consumers.append(chain)
            continue
        rule = registry.lookup(op.type)
        if rule is None:
            return None, separability.Reason(
                "no per-example rule for op type '%s' (op '%s')"
                % (op.type, op.name), op)
        if shortcuts.gradient_override(op) is not None:
            return None, separability.Reason(
                "op '%s' (type %s) has its gradient overridden (to %r); the "
                "%s rule implements the standard gradient" % (
                    op.name, op.type, shortcuts.gradient_override(op),
                    op.type), op)
        ctx = registry_lib.RuleContext(op, k, None, batch_size)
        why = rule.unsupported(ctx)
        if why:
            return None, separability.Reason(
                "the %s rule does not handle op '%s': %s" % (
                    op.type, op.name, why), op)
        start, axis = rule.coupling_start(ctx)
        coupled = separability.coupling(start, axis, loss,
                                        loss_ancestors)
        if coupled:
            return None, separability.Reason(
                "batch coupling between op '%s' and the loss: %s; "
                "per-example rules assume examples do not interact"
                % (op.name, coupled), getattr(coupled, "op", None))
        consumers.append(_Consumer(op, k, rule))
    if not consumers:
        return None, "x reaches the loss through no op with a batch input"
    return consumers, None


# How many batch-free ops a chain may pass before the rules give up.
_MAX_CHAIN = 16


def _chain(op, x_tensor, loss, loss_ancestors, registry, batch_size, region,
           depth):
    """A `_Chain` through `op` (which sees no batch data), or (None, why)."""
    indices = [k for k, inp in enumerate(op.inputs)
               if inp.ref() in _reached_refs(x_tensor, loss_ancestors,
                                             shortcuts.live_ops(loss))]
    inner = []
    for out in op.outputs:
        if out.op not in loss_ancestors or not out.dtype.is_floating:
            continue
        if not any(c in loss_ancestors for c in out.consumers()):
            continue
        consumers, why = _rules_reason(out, loss, loss_ancestors, registry,
                                       batch_size, region, depth + 1)
        if consumers is None:
            return None, why
        inner.append(Assignment(out, out, "rules", None, consumers))
    if not inner:
        return None, "op '%s' reaches the loss through no float output" % (
            op.name)
    return _Chain(op, indices, inner), None


def _reached_refs(x_tensor, loss_ancestors, live):
    """Refs of x and of the pass-through tensors `_find_consumers` follows."""
    refs = set()
    for t, stack in graph_lib.depth_first(x_tensor, refs):
        for op in t.consumers():
            if op in loss_ancestors and op.inputs[0] is t and \
                    shortcuts.passes_through(op, 0, live):
                stack.append(op.outputs[0])
    return refs


# Keyed by graph: loss ref -> (form, reason) where building the recompute
# form fell back, so later plans of that loss say what runs.
_RECOMPUTE_FALLBACKS = weakref.WeakKeyDictionary()


def _forward_or_refusal(loss, ancestors, static_b):
    try:
        return recompute.analyze(loss, ancestors, static_b)
    except recompute.Refused as e:
        return e


def _recompute_reason(forward, x_tensor):
    """(forward, None) if x's per-example gradients can come from copies of
    the forward pass, else (None, reason)."""
    if isinstance(forward, recompute.Refused):
        return None, separability.Reason(str(forward), forward.op)
    if x_tensor.op in forward.op_set:
        return None, separability.Reason(
            "x ('%s') depends on batch data, and a copy of the forward pass "
            "would copy it too" % x_tensor.name, x_tensor.op)
    return forward, None


def plan_per_example(per_example_loss, xs, strategy="auto", registry=None):
    """Decides, per x, which strategy computes its per-example gradients.

    Args:
      per_example_loss: `[B]` tensor.
      xs: list of variables or tensors.
      strategy: "auto", "rules", "pfor" or "loop".
      registry: a `custagg.RuleRegistry` (default: the built-in rules).

    Returns:
      A `Plan`; `str(plan)` shows the choice and, where rules were not used,
      why.

    Raises:
      ValueError: a bad argument; "rules" asked for an x it cannot handle
        (the message names the op and suggests a strategy); "loop" with an
        unknown batch size.
    """
    fn = "custagg.plan_per_example"
    loss = _check_loss(per_example_loss, fn)
    _check_strategy(strategy, fn)
    registry = registry or registry_lib.default_registry()
    xs = list(xs) if isinstance(xs, (list, tuple)) else [xs]
    static_b = tf.compat.dimension_value(loss.shape[0])
    batch_size = tf.shape(loss)[0] if static_b is None else static_b
    ancestors = separability.ancestors(loss)
    region = None
    forwards = None     # [recompute.Forward or Refused], found once
    assignments = []
    for i, x in enumerate(xs):
        t = _as_tensor(x, i, fn)
        if t.graph is not loss.graph:
            raise ValueError(
                "custagg: xs[%d] (%s) is from another graph than "
                "per_example_loss." % (i, getattr(x, "name", x)))
        if t.op not in ancestors or not shortcuts.live_ops(loss).reaches(t):
            # As tf.gradients: None where no gradient reaches x.
            assignments.append(Assignment(x, t, None))
            continue
        if strategy == "loop":
            assignments.append(Assignment(x, t, "loop"))
            continue
        reason = None
        if strategy != "pfor":
            if region is None:
                region = batch_axis.batch_region(loss, ancestors)
            consumers, reason = _rules_reason(t, loss, ancestors, registry,
                                              batch_size, region)
            if consumers is not None:
                in_loops = any(isinstance(c, loop_rules.LoopUse)
                               for c in _rule_consumers(consumers))
                assignments.append(Assignment(
                    x, t, "rules", None, consumers,
                    form="loop-rules" if in_loops else "rules"))
                continue
            if strategy == "rules":
                raise ValueError(
                    "custagg: strategy='rules' cannot give per-example "
                    "gradients of %s: %s. Use strategy='auto' (falls back to "
                    "'pfor' for this variable) or 'pfor', or register a rule "
                    "with @custagg.register_rule(...)." % (
                        getattr(x, "name", x), reason))
        # pfor: the boundary form where the ops that meet batch data keep
        # examples apart downstream, else the whole backward pass.
        if region is None:
            region = batch_axis.batch_region(loss, ancestors)
        bounds, why = vectorized.find_boundary(t, loss, ancestors, region,
                                               static_b)
        blocker = getattr(reason, "op", None)
        if bounds is None:
            blocker = blocker or getattr(why, "op", None)
            reason = "; ".join(r for r in (reason, "no boundary form: " + why)
                               if r)
        form = "boundary" if bounds else "whole-pass"
        forward = None
        if bounds is None:
            # Each example's forward pass copied and vectorized (O(B)), or
            # else the whole backward pass per example (O(B^2)).
            if forwards is None:
                forwards = [_forward_or_refusal(loss, ancestors, static_b)]
            forward, why = _recompute_reason(forwards[0], t)
            if forward is not None:
                form = "recompute"
                # A fallback an earlier build took for this loss holds now.
                taken = _RECOMPUTE_FALLBACKS.get(loss.graph, {}).get(
                    loss.ref())
                if taken:
                    form = taken[0]
                    reason = reason + "; " + taken[1]
            else:
                blocker = blocker or getattr(why, "op", None)
                reason = reason + "; no recompute form: " + str(why)
        assignments.append(Assignment(
            x, t, "pfor", reason, form=form, boundaries=bounds,
            blocker=blocker))
        assignments[-1].forward = forward
    plan = Plan(loss, assignments, batch_size, strategy)
    _LOG.debug("%s", plan)
    return plan


# --------------------------------------------------------------------------
# Execution


def _x_shape(a):
    shape = a.x.shape if hasattr(a.x, "shape") else a.tensor.shape
    shape = tf.TensorShape(shape)
    if shape.is_fully_defined():
        return shape.as_list()
    value = a.x.value() if isinstance(a.x, tf.Variable) else a.tensor
    return tf.unstack(tf.shape(value))


def _static_x_shape(a):
    return tf.TensorShape(a.x.shape if hasattr(a.x, "shape")
                          else a.tensor.shape)


def _x_dtype(a):
    return tf.as_dtype(a.x.dtype).base_dtype


class _Engine(object):
    """Builds the tensors a plan calls for, sharing the rules' backward pass."""

    def __init__(self, plan, pfor_chunk_size):
        self.plan = plan
        self.loss = plan.loss
        self.chunk = pfor_chunk_size
        self._contexts = None
        self._materialized = {}

    # -- rules --

    def contexts(self, a):
        """RuleContexts (grads included) for an x planned as "rules"."""
        if self._contexts is None:
            self._contexts = {}
            found = list(_rule_consumers(
                c for x in self.plan.assignments if x.strategy == "rules"
                for c in x.consumers))
            consumers = [c for c in found if isinstance(c, _Consumer)]
            uses = [c for c in found if isinstance(c, loop_rules.LoopUse)]
            outs = [c.op.outputs[0] for c in consumers]
            # The loop rules' rebuilt loops are seeded with the loss's
            # gradient at the loops' outputs: the same backward pass.
            targets = loop_rules.cotangent_targets(uses)
            with tf.name_scope("per_example_rules"):
                grads = gradients(self.loss, outs + targets) \
                    if outs or targets else []
            for c, g in zip(consumers, grads):
                ctx = None if g is None else registry_lib.RuleContext(
                    c.op, c.index, sparse.dense(g), self.plan.batch_size, {})
                self._contexts[(c.op, c.index)] = ctx
            if uses:
                seeds = {t.ref(): g if g is None or t.dtype == tf.variant
                         else sparse.dense(g)
                         for t, g in zip(targets, grads[len(outs):])}
                outers = loop_rules.build(uses, seeds, self.plan.batch_size)
                for u in uses:
                    self._contexts[(u.op, u.index)] = loop_rules.LoopContext(
                        u.op, u.index, None, self.plan.batch_size,
                        {"outer": outers[(u.op, u.index)], "param": u.value})
        return [(loop_rules.RULE if isinstance(c, loop_rules.LoopUse)
                 else c.rule, self._contexts[(c.op, c.index)])
                for c in a.consumers
                if isinstance(c, (_Consumer, loop_rules.LoopUse))
                and self._contexts[(c.op, c.index)] is not None]

    def chains(self, a):
        return [c for c in a.consumers if isinstance(c, _Chain)]

    def _vjp(self, chain, cotangents, a, batched):
        """x's gradient through `chain.op` for output cotangents (one list
        entry per `chain.inner`), in x's layout; `batched`: leading B."""
        op = chain.op
        ys = [inner.tensor for inner in chain.inner]
        wrt = [op.inputs[k] for k in chain.indices]
        others = [t for k, t in enumerate(op.inputs)
                  if k not in chain.indices]

        def vjp(seeds):
            grads = gradients(ys, wrt, grad_ys=seeds, stop_gradients=others,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return [sparse.dense(g) for g in grads]

        if not batched:
            parts = vjp(cotangents)
        elif _scalar_chain(chain):
            # A scalar output (l2_loss): each example's gradient is its own
            # multiple of one vector-Jacobian product.
            c = cotangents[0]
            parts = [tf.reshape(c, [-1] + [1] * g.shape.rank) * g[None]
                     for g in vjp([tf.ones([], c.dtype)])]
        else:
            @tf.autograph.experimental.do_not_convert
            def one(i):
                return vjp([tf.gather(c, i) for c in cotangents])
            parts = vectorized.chunked_pfor(
                one, self.plan.batch_size, self.chunk,
                [t.dtype.base_dtype for t in wrt])
        return [self._to_x(p, a, batched) for p in parts]

    def _scaled_chain(self, chain, a):
        """(c `[B]`, v in x's layout): the scalar chain's g_b = c_b v."""
        c = self._rules_per_example(chain.inner[0])
        v = self._vjp(chain, [tf.ones([], c.dtype)], a, False)
        return c, tf.add_n(v) if len(v) > 1 else v[0]

    def _terms(self, a, groups=None):
        """x's per-example gradients as a sum of terms, for norms without
        materializing: ("outer", Outer, param shape), ("scaled", c, v) or
        ("dense", [B, *x]). With `groups` (M): the microbatch sums, `[M]`
        leading instead of `[B]`."""
        def group(t):
            return t if groups is None else registry_lib.group_sum(t, groups)
        terms = []
        for rule, ctx in self.contexts(a):
            outer = rule.outer(ctx)
            if outer is not None:
                if groups is not None:
                    outer = outer.grouped(groups)
                terms.append(("outer", outer, _outer_lib.static_dims(
                    ctx.param)))
            else:
                terms.append(("dense", group(self._to_x(
                    rule.per_example(ctx), a, True)), None))
        for chain in self.chains(a):
            if _scalar_chain(chain):
                c, v = self._scaled_chain(chain, a)
                terms.append(("scaled", group(c), v))
            else:
                for part in self._chain_per_example(chain, a):
                    terms.append(("dense", group(part), None))
        return terms

    def _cross_norms(self, a, groups=None):
        """`[B]` (`[M]` with `groups`) squared norms from pairwise inner
        products of the terms, or None when two terms cannot be paired
        without materializing."""
        terms = self._terms(a, groups)
        dtype = self.loss.dtype
        total = []
        for i, t in enumerate(terms):
            for j in range(i, len(terms)):
                ip = _inner(t, terms[j], a)
                if ip is None:
                    return None
                total.append(tf.cast(ip, dtype) * (1.0 if i == j else 2.0))
        return tf.add_n(total) if total else None

    def _chain_per_example(self, chain, a):
        cotangents = [self._rules_per_example(inner) for inner in chain.inner]
        return self._vjp(chain, cotangents, a, True)

    def _to_x(self, t, a, batched):
        """A rule result in the op input's layout -> x's layout and dtype."""
        dtype = _x_dtype(a)
        if isinstance(t, indexed_slices_lib.IndexedSlices):
            rows_of = tf.get_static_value(t.dense_shape)
            if rows_of is not None and _static_x_shape(a).is_fully_defined() \
                    and list(rows_of) != _static_x_shape(a).as_list():
                # Rows of a reshaped table are not rows of x: dense, as
                # TF's Reshape gradient gives.
                t = tf.convert_to_tensor(t)
            else:
                return indexed_slices_lib.IndexedSlices(
                    tf.cast(t.values, dtype), t.indices, t.dense_shape)
        lead = [tf.shape(t)[0]] if batched else []
        return tf.cast(tf.reshape(t, lead + _x_shape(a)), dtype)

    def _rules_per_example(self, a):
        parts = [self._to_x(rule.per_example(ctx), a, True)
                 for rule, ctx in self.contexts(a)]
        for chain in self.chains(a):
            parts.extend(self._chain_per_example(chain, a))
        return tf.add_n(parts) if len(parts) > 1 else parts[0]

    # -- pfor and loop --

    def _materialize(self, strategy):
        """Per-example gradients of every x planned as `strategy`."""
        if strategy in self._materialized:
            return self._materialized[strategy]
        group = [a for a in self.plan.assignments if a.strategy == strategy]
        with tf.name_scope("per_example_" + strategy):
            if strategy == "pfor":
                try:
                    stacked = self._pfor(group)
                except Exception as e:  # pylint: disable=broad-except
                    if self.plan.requested != "auto":
                        raise
                    # "auto" never fails where the loop works; the plan says
                    # so (the plan object is updated, and warns once).
                    _LOG.debug("pfor failed (%s); using the loop", e)
                    for a in group:
                        a.strategy, a.form = "loop", "loop"
                        a.reason = ((a.reason + "; ") if a.reason else "") + (
                            "pfor could not build: %s" % e)
                    warn_slow(self.plan)
                    try:
                        stacked = self._loop(group)
                    except Exception as loop_error:  # pylint: disable=broad-except
                        raise _no_strategy(group, e, loop_error)
            else:
                stacked = self._loop(group)
        result = {}
        for a, s in zip(group, stacked):
            result[id(a)] = tf.cast(s, _x_dtype(a))
        self._materialized[strategy] = result
        return result

    def _pfor(self, group):
        """Each x in the form its plan gives: boundary ops or whole pass."""
        loss, batch = self.loss, self.plan.batch_size
        fast = [a for a in group if a.form == "boundary"]
        result = {}
        again = [a for a in group
                 if a.form in ("recompute", "recompute-loop")]
        if again:
            result.update(self._recompute(again))
        slow = [a for a in group if a.form == "whole-pass"]
        # The scopes name the form, so the graph shows what ran.
        if fast:
            with tf.name_scope("boundary_form"):
                stacked = vectorized.boundary_per_example(
                    loss, fast, [a.boundaries for a in fast], batch,
                    self.chunk)
            result.update(zip([id(a) for a in fast], stacked))
        if slow:
            with tf.name_scope("whole_pass_form"):
                stacked = vectorized.whole_pass_per_example(
                    loss, [a.tensor for a in slow],
                    [lambda a=a: tf.zeros(_x_shape(a), _x_dtype(a))
                     for a in slow], batch, self.chunk)
            result.update(zip([id(a) for a in slow], stacked))
        return [result[id(a)] for a in group]

    def _recompute(self, group):
        """Per-example copies of the forward pass: pfor over chunks of
        examples ("recompute"), else a while loop over them
        ("recompute-loop"), else the whole pass; the plan records which ran
        and why (and later plans of this loss say so too)."""
        forward = group[0].forward
        fallbacks = _RECOMPUTE_FALLBACKS.setdefault(self.loss.graph, {})
        tensors = [a.tensor for a in group]
        zeros = [lambda a=a: tf.zeros(_x_shape(a), _x_dtype(a))
                 for a in group]
        dtypes = [recompute.grad_dtype(t) for t in tensors]
        batch = recompute.batch_size(forward, self.plan.batch_size)
        ids = [id(a) for a in group]

        def fall_back(form, why):
            for a in group:
                if a.form != form:
                    a.form = form
                    a.reason = ((a.reason + "; ") if a.reason else "") + why
            fallbacks[self.loss.ref()] = (form, why)

        varying = recompute.varying_loop(forward) \
            if group[0].form == "recompute" else None
        if varying is not None:
            fall_back("recompute-loop",
                      "the loop '%s' runs as many iterations as the batch "
                      "data asks (a condition on batch data), which pfor's "
                      "conversion of the copies does not run correctly"
                      % varying.name)
        if group[0].form == "recompute":
            try:
                with tf.name_scope("recompute_form"):
                    return dict(zip(ids, recompute.per_example_pfor(
                        forward, tensors, zeros, dtypes, batch, self.chunk,
                        _copy_gradients)))
            except Exception as e:  # pylint: disable=broad-except
                _LOG.debug("pfor could not vectorize the copies (%s)", e)
                fall_back("recompute-loop",
                          "pfor could not vectorize the copies: "
                          + _first_line(e))
        if group[0].form == "recompute-loop":
            try:
                with tf.name_scope("recompute_loop_form"):
                    return dict(zip(ids, recompute.per_example_loop(
                        forward, tensors, zeros, dtypes,
                        [_static_x_shape(a) for a in group], batch,
                        _copy_gradients)))
            except Exception as e:  # pylint: disable=broad-except
                _LOG.debug("the copies could not be built (%s)", e)
                fall_back("whole-pass", "the copies could not be built: "
                          + _first_line(e))
        warn_slow(self.plan)
        with tf.name_scope("whole_pass_form"):
            return dict(zip(ids, vectorized.whole_pass_per_example(
                self.loss, tensors, zeros, batch, self.chunk)))

    def _loop(self, group):
        """One `gradients(loss[i])` per example: a Python loop for a static
        B, else a `tf.while_loop` over the examples."""
        tensors = [a.tensor for a in group]

        def one(i):
            grads = gradients(self.loss[i], tensors,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return [tf.cast(sparse.dense(g), _x_dtype(a))
                    for g, a in zip(grads, group)]

        batch = self.plan.batch_size
        if isinstance(batch, int):
            rows = [one(i) for i in range(batch)]
            return [tf.stack(list(col), axis=0) for col in zip(*rows)]
        arrays = [tf.TensorArray(_x_dtype(a), size=batch,
                                 element_shape=tf.TensorShape(
                                     _static_x_shape(a)))
                  for a in group]

        def body(i, arrays):
            return i + 1, [ta.write(i, g) for ta, g in zip(arrays, one(i))]

        _, arrays = tf.while_loop(lambda i, _: i < batch, body,
                                  [tf.constant(0), arrays])
        return [ta.stack() for ta in arrays]

    def _checked(self, t, a, what):
        """`t`, a rules result with one row per example, checked to have B
        rows (the loss's): a rule that took other rows for examples (a fold
        of `[B, T, D]` into `B*T` rows it did not see) raises instead of
        clipping or weighting each row as if it were an example."""
        if not isinstance(t, tf.Tensor) or t.shape.rank == 0:
            return t
        rows = tf.compat.dimension_value(t.shape[0])
        batch = tf.compat.dimension_value(self.loss.shape[0])
        name = getattr(a.x, "name", a.x)
        hint = ("a rule took another axis, or rows of a fold it did not see, "
                "for the examples; strategy='pfor' avoids the rules")
        if rows is not None and batch is not None:
            if rows != batch:
                raise ValueError(
                    "custagg: the rules gave %s of %s for %d rows, but the "
                    "batch has %d examples (%s)." % (what, name, rows, batch,
                                                     hint))
            return t
        check = tf.debugging.assert_equal(
            tf.shape(t)[0], tf.shape(self.loss)[0],
            message="custagg: the rules gave %s of %s for another number of "
                    "rows than the batch's examples (%s)" % (what, name, hint))
        with tf.control_dependencies([check]):
            return tf.identity(t)

    def per_example(self, a):
        if a.strategy is None:
            return None
        if a.strategy == "rules":
            return self._checked(self._rules_per_example(a), a,
                                 "per-example gradients")
        return self._materialize(a.strategy)[id(a)]

    def squared_norms(self, a, groups=None):
        """[B] squared norms of x's per-example gradients (loss dtype), or
        with `groups` (M) the [M] squared norms of the microbatch sums."""
        if groups is not None:
            return self._group_squared_norms(a, groups)
        sq = self._squared_norms(a)
        if a.strategy == "rules":
            sq = self._checked(sq, a, "norms")
        return sq

    def _squared_norms(self, a):
        dtype = self.loss.dtype
        if a.strategy == "rules" and not self.chains(a):
            pairs = self.contexts(a)
            if len(pairs) == 1:      # one consumer: the rule's own identity
                rule, ctx = pairs[0]
                return tf.cast(rule.squared_norms(ctx), dtype)
            if not pairs:
                return tf.zeros(tf.shape(self.loss), dtype)
        if a.strategy == "rules":
            # A shared weight, or weight decay next to a layer: cross terms.
            cross = self._cross_norms(a)
            if cross is not None:
                return cross
        g = tf.cast(self.per_example(a), dtype)
        return tf.reduce_sum(tf.reshape(tf.square(g), [tf.shape(g)[0], -1]),
                             axis=1)

    def _group_squared_norms(self, a, groups):
        """`[M]` ||sum_{b in m} g_b||^2: each rule's group form (the block
        Gram form for outer products, ids keyed by microbatch for tables),
        cross terms summed per microbatch; xs taking pfor or the loop (and
        rules without a group form) sum their materialized `[B, ...]`."""
        dtype = self.loss.dtype
        if a.strategy == "rules" and not self.chains(a):
            pairs = self.contexts(a)
            if len(pairs) == 1:
                rule, ctx = pairs[0]
                return tf.cast(rule.group_squared_norms(ctx, groups), dtype)
            if not pairs:
                return tf.zeros([groups], dtype)
        if a.strategy == "rules":
            cross = self._cross_norms(a, groups)
            if cross is not None:
                return cross
        g = registry_lib.group_sum(tf.cast(self.per_example(a), dtype), groups)
        return tf.reduce_sum(tf.reshape(tf.square(g), [groups, -1]), axis=1)

    def weighted_sums(self, group, weights):
        """sum_b weights[b] g_b for each x of `group` (one weights vector)."""
        out = {}
        by_pass = []
        for a in group:
            if a.strategy == "rules":
                continue
            done = self._materialized.get(a.strategy, {}).get(id(a))
            if done is not None and not _gathered(a.tensor):
                # Per-example gradients already built (for the norms):
                # their weighted sum costs B * |x| multiply-adds, where
                # another backward pass would run the batch's forward and
                # backward passes again.
                out[id(a)] = tf.tensordot(tf.cast(weights, done.dtype), done,
                                          axes=1)
            else:
                by_pass.append(a)
        for a in group:
            if a.strategy == "rules":
                parts = [self._to_x(rule.weighted_sum(ctx, weights), a, False)
                         for rule, ctx in self.contexts(a)]
                for chain in self.chains(a):
                    # Linear in the cotangent: the chain's weighted sum is the
                    # op's gradient of its outputs' weighted sums.
                    inner = self.weighted_sums(chain.inner, weights)
                    parts.extend(self._vjp(
                        chain,
                        [sparse.dense(inner[id(i)]) for i in chain.inner], a,
                        False))
                out[id(a)] = _sum_parts(parts, a)
        if by_pass:
            # Exact whatever the graph: d/dx sum_b w_b l_b with w constant.
            grads = gradients(self.loss, [a.tensor for a in by_pass],
                              aggregation_method=AggregationMethod.CUSTOM,
                              gradient_factors=weights)
            for a, g in zip(by_pass, grads):
                out[id(a)] = g
        return out

    def squared_sum(self, a):
        if a.strategy == "rules" and not self.chains(a):
            parts = self.contexts(a)
            if len(parts) == 1:
                rule, ctx = parts[0]
                return self._to_x(rule.squared_sum(ctx), a, False)
        return tf.reduce_sum(tf.square(self.per_example(a)), axis=0)


def _gathered(x_tensor):
    """Whether rows of x are gathered (an embedding table): its summed
    gradient is then `IndexedSlices`, which a backward pass keeps."""
    return any(op.type in ("ResourceGather", "GatherV2", "Gather") and
               op.inputs[0] is x_tensor for op in x_tensor.consumers())


def _no_strategy(group, pfor_error, loop_error):
    """The error for a graph no strategy can build: names the ops that kept
    each x off the O(B) forms and what to try."""
    ops = sorted({"'%s' (%s)" % (a.blocker.name, a.blocker.type)
                  for a in group if a.blocker is not None})
    return ValueError(
        "custagg: no strategy can build per-example gradients of %s%s. "
        "Tried: rules (%s); pfor: %s; the per-example loop: %s. What to "
        "try: give the inputs a [None, ...] shape so each example's forward "
        "pass can be copied, build the model with control flow v2 "
        "(tf.compat.v1.enable_control_flow_v2()), or register a rule for the "
        "op with @custagg.register_rule." % (
            ", ".join(a.name for a in group),
            (", held up by op " + ", ".join(ops)) if ops else "",
            "; ".join(sorted({a.reason.split(";")[0] for a in group
                              if a.reason})) or "not asked for",
            _first_line(pfor_error), _first_line(loop_error)))


def _copy_gradients(ys, xs, **kwargs):
    """TF's own gradients for the copies of the forward pass: custagg's
    traversal adds nothing there, and TF's leaves no `zeros_like` of the
    TensorLists a loop accumulates (which pfor cannot vectorize)."""
    return tf.compat.v1.gradients(ys, xs, **kwargs)


def _first_line(e):
    """The line of an exception's text that says what went wrong."""
    lines = [l.strip() for l in str(e).strip().split("\n") if l.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line[:300]
    return (lines[0] if lines else type(e).__name__)[:300]


def _scalar_chain(chain):
    return len(chain.inner) == 1 and chain.inner[0].tensor.shape.rank == 0


def _per_example_dot(u, v):
    batch = tf.shape(u)[0]
    return tf.reduce_sum(tf.reshape(u * tf.cast(v, u.dtype), [batch, -1]),
                         axis=1)


def _inner(s, t, a):
    """`[B]` <s_b, t_b> for two terms of `_Engine._terms`, or None."""
    if s[0] > t[0]:
        s, t = t, s          # order: dense < outer < scaled
    kinds = (s[0], t[0])
    if kinds == ("outer", "outer"):
        if s[1].key != t[1].key or s[2] != t[2]:
            return None
        return s[1].inner(t[1])
    if kinds == ("outer", "scaled"):
        v = tf.reshape(t[2], s[2])
        return tf.cast(t[1], s[1].a.dtype) * s[1].inner_dense(v, False)
    if kinds == ("dense", "outer"):
        m = tf.reshape(s[1], [-1] + list(t[2]))
        return t[1].inner_dense(m, True)
    if kinds == ("dense", "dense"):
        return _per_example_dot(s[1], t[1])
    if kinds == ("dense", "scaled"):
        return tf.cast(t[1], s[1].dtype) * _per_example_dot(
            s[1], tf.expand_dims(t[2], 0))
    # scaled, scaled
    return s[1] * tf.cast(t[1], s[1].dtype) * tf.reduce_sum(
        tf.cast(s[2], s[1].dtype) * tf.cast(t[2], s[1].dtype))


def _rule_consumers(consumers):
    """The `_Consumer`s of `consumers`, chains' inner ones included."""
    for c in consumers:
        if isinstance(c, _Chain):
            for inner in c.inner:
                for r in _rule_consumers(inner.consumers):
                    yield r
        else:
            yield c


def _sum_parts(parts, a):
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, indexed_slices_lib.IndexedSlices) for p in parts):
        return sparse.concat_slices(parts)
    return tf.add_n([sparse.dense(p) for p in parts])


def _engine(per_example_loss, xs, strategy, registry, pfor_chunk_size, fn):
    _check_strategy(strategy, fn)
    plan = plan_per_example(per_example_loss, xs, strategy, registry)
    warn_slow(plan)
    return plan, _Engine(plan, pfor_chunk_size)


# Keyed by graph: the (variable, form) pairs already warned about there.
_WARNED = weakref.WeakKeyDictionary()


def warn_slow(plan):
    """One short warning per graph for the xs whose cost grows with B^2.

    Asked-for slow strategies ("loop", "pfor" on a coupled graph) still
    warn: the user may not know what they cost. The warning names the op
    that kept them off the O(B) forms and the cheapest fix, when one is on
    the user's side.
    """
    graph = plan.loss.graph
    seen = _WARNED.setdefault(graph, set())
    fresh = [a for a in plan.slow() if (a.name, a.form) not in seen]
    if not fresh:
        return
    seen.update((a.name, a.form) for a in fresh)
    blockers = {a.blocker.name: a.blocker for a in fresh if a.blocker}
    what = "; ".join(sorted({_fix_hint(op) for op in blockers.values()}))
    _LOG.warning(
        "custagg: per-example gradients of %s cost O(B^2) (%s)%s. %s"
        "print(custagg.plan_per_example(...)) shows why.",
        ", ".join(sorted({a.name for a in fresh})),
        ", ".join(sorted({FORMS[a.form][0] for a in fresh})),
        (", held up by op " + ", ".join("'%s' (%s)" % (n, op.type)
                                        for n, op in sorted(blockers.items())))
        if blockers else "",
        (what + ". ") if what else "")


def _fix_hint(op):
    """The cheapest fix for a blocking op, in the user's terms ("" if none)."""
    if op.type.startswith("FusedBatchNorm") or op.type in ("Mean", "Sum"):
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


# --------------------------------------------------------------------------
# Public functions


def per_example_gradients(per_example_loss, xs, strategy="auto",
                          registry=None, pfor_chunk_size=32,
                          name="per_example_gradients"):
    """The gradient of each example's loss, before TensorFlow sums them.

    Args:
      per_example_loss: `[B]` tensor, the loss of each example (B may be
        unknown until run time). Gradients are of these losses as given: a
        mean loss scales each one by 1/B.
      xs: a variable/tensor or list of them.
      strategy: "auto" (default), "rules", "pfor" or "loop" (see module doc).
      registry: rule registry (default: the built-in rules).
      pfor_chunk_size: the fewest examples vectorized at once by "pfor";
        passes grow up to `custagg.vectorized.PASS_BYTES` of outputs (the
        whole-pass form keeps exactly this many: its memory is not in its
        outputs).
      name: name scope.

    Returns:
      List aligned with `xs`; entry j is `[B, *xs[j].shape]` whose row i is
      `d per_example_loss[i] / d xs[j]`, or `None` if the loss does not
      depend on `xs[j]`.

    Example:
      >>> loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
      ...     labels=y, logits=tf.matmul(x, w) + b)          # [B]
      >>> gw, gb = custagg.per_example_gradients(loss, [w, b])
      >>> # gw: [B, 784, 10], gb: [B, 10]
    """
    fn = "custagg.per_example_gradients"
    with tf.name_scope(name):
        plan, engine = _engine(per_example_loss, xs, strategy, registry,
                               pfor_chunk_size, fn)
        return [engine.per_example(a) for a in plan.assignments]


def per_example_norms(per_example_loss, xs, strategy="auto", registry=None,
                      pfor_chunk_size=32, name="per_example_norms",
                      num_microbatches=None):
    """`[B]` global L2 norms of the per-example gradients over all `xs`.

    With rules, computed without materializing per-example gradients
    (`||a_b|| ||dz_b||` for dense layers, the Gram form for sequences, sparse
    rows for embeddings). Unconnected xs count as zero.

    With `num_microbatches` M (a Python int dividing B; B may be dynamic):
    `[M]` norms of the microbatch gradients, microbatch m being examples
    `m*B/M ... (m+1)*B/M - 1` (TF Privacy's `tf.reshape(loss, [M, -1])`)
    and its gradient that of its summed loss, `sum_{b in m} g_b`, again
    without materializing where the rules allow (see `Rule.
    group_squared_norms`).
    """
    fn = "custagg.per_example_norms"
    with tf.name_scope(name):
        plan, engine = _engine(per_example_loss, xs, strategy, registry,
                               pfor_chunk_size, fn)
        groups, check = _groups(plan.loss, num_microbatches, fn)
        with tf.control_dependencies(check):
            return tf.sqrt(_total_squared_norms(plan, engine,
                                                plan.assignments, groups))


def _groups(loss, num_microbatches, fn):
    """(M or None when M = B is static, [assert that M divides B])."""
    if num_microbatches is None:
        return None, []
    m = num_microbatches
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
        raise ValueError("%s: num_microbatches must be a positive Python int "
                         "dividing the batch size, or None; got %r." % (fn, m))
    m = int(m)
    batch = tf.compat.dimension_value(loss.shape[0])
    if batch is not None:
        if batch % m:
            raise ValueError("%s: num_microbatches=%d does not divide the "
                             "batch size %d." % (fn, m, batch))
        return (None if m == batch else m), []
    return m, [tf.debugging.assert_equal(
        tf.shape(loss)[0] % m, 0,
        message="%s: num_microbatches=%d must divide the batch size" % (fn, m))]


def _group_weights(factors, loss, groups):
    """`[M]` microbatch factors -> `[B]` (each example its group's)."""
    if groups is None:
        return factors
    k = tf.shape(loss)[0] // groups
    return tf.reshape(tf.tile(factors[:, None], tf.stack([1, k])), [-1])


def _total_squared_norms(plan, engine, group, groups=None):
    parts = [engine.squared_norms(a, groups) for a in group if a.strategy]
    if not parts:
        return tf.zeros([groups] if groups else tf.shape(plan.loss),
                        plan.loss.dtype)
    return tf.add_n(parts)


def _clip_factors(sq_norms, clip, dtype):
    """min(1, C / norm), written C / max(norm, C) so norm 0 gives 1."""
    # dtype_hint: a Python float must not pass through float32 on its way
    # to a float64 loss.
    c = tf.cast(tf.convert_to_tensor(clip, dtype_hint=dtype), dtype)
    return tf.stop_gradient(c / tf.maximum(tf.sqrt(sq_norms), c))


def clipped_gradients(per_example_loss, xs, l2_norm_clip, strategy="auto",
                      return_norms=False, registry=None, pfor_chunk_size=32,
                      name="clipped_gradients", num_microbatches=None):
    """`sum_b min(1, C / ||g_b||) g_b`: the per-example clipped sum (DP-SGD).

    The clip factors are constants (never differentiated through). For xs
    covered by rules the sum is formed from the norm pass's own activations
    and output gradients (`a^T diag(c) dz` for a MatMul): about one backward
    pass, no per-example gradient materialized. Other xs get a second
    backward pass weighted by the factors (`AggregationMethod.CUSTOM`).

    Args:
      per_example_loss: `[B]` per-example losses.
      xs: variables/tensors.
      l2_norm_clip: C, a float or scalar tensor (one global norm over all
        xs), or a list aligned with xs (each x clipped by its own norm).
      strategy: as for `per_example_gradients`.
      return_norms: also return the `[B]` norms before clipping (global, or
        a list of per-x norms with per-x clip norms).
      num_microbatches: M (a Python int dividing B), or None for M = B:
        `sum_m min(1, C / ||G_m||) G_m` with `G_m` the gradient of
        microbatch m's summed loss (see `per_example_norms`); the norms are
        then `[M]`. The same one-pass sum with each example weighted by its
        microbatch's factor: a DP step with M < B costs about what M = B
        costs.

    Returns:
      List aligned with xs (`Tensor`, `IndexedSlices` for embedding tables,
      or `None`), and the norms if `return_norms`.
    """
    fn = "custagg.clipped_gradients"
    per_x = isinstance(l2_norm_clip, (list, tuple))
    with tf.name_scope(name):
        plan, engine = _engine(per_example_loss, xs, strategy, registry,
                               pfor_chunk_size, fn)
        live = [a for a in plan.assignments if a.strategy]
        groups, check = _groups(plan.loss, num_microbatches, fn)
        with tf.control_dependencies(check):
            grads, norms = _clipped(plan, engine, live, l2_norm_clip, per_x,
                                    groups, fn)
        return (grads, norms) if return_norms else grads


def _clipped(plan, engine, live, l2_norm_clip, per_x, groups, fn):
    """`clipped_gradients`' sums (aligned with the plan's xs) and norms."""
    dtype = plan.loss.dtype

    def weights(sq, clip):
        return _group_weights(_clip_factors(sq, clip, dtype), plan.loss,
                              groups)
    if per_x:
        if len(l2_norm_clip) != len(plan.assignments):
            raise ValueError(
                "%s: l2_norm_clip has %d entries but xs has %d; give one "
                "clip norm per x, or one number." % (
                    fn, len(l2_norm_clip), len(plan.assignments)))
        sums, norms = {}, []
        for a, clip in zip(plan.assignments, l2_norm_clip):
            if not a.strategy:
                norms.append(tf.zeros([groups] if groups else
                                      tf.shape(plan.loss), dtype))
                continue
            sq = engine.squared_norms(a, groups)
            norms.append(tf.sqrt(sq))
            sums.update(engine.weighted_sums([a], weights(sq, clip)))
    else:
        sq = _total_squared_norms(plan, engine, live, groups)
        norms = tf.sqrt(sq)
        sums = engine.weighted_sums(live, weights(sq, l2_norm_clip))
    return [sums.get(id(a)) for a in plan.assignments], norms


def weighted_gradients(per_example_loss, xs, weights, name="weighted_gradients"):
    """`sum_b weights[b] * d per_example_loss[b] / dx` in one backward pass.

    The same as `custagg.gradients(per_example_loss, xs,
    aggregation_method=CUSTOM, gradient_factors=weights)`; exact for any
    graph, batch coupling included, since the weights are constants.
    """
    _check_loss(per_example_loss, "custagg.weighted_gradients")
    with tf.name_scope(name):
        return gradients(per_example_loss, xs,
                         aggregation_method=AggregationMethod.CUSTOM,
                         gradient_factors=weights)


def gradient_second_moments(per_example_loss, xs, strategy="auto",
                            registry=None, pfor_chunk_size=32,
                            name="gradient_second_moments"):
    """`sum_b g_b ** 2` (elementwise) for each x.

    With the gradient sum `sum_b g_b` this gives the per-coordinate variance
    of per-example gradients: `E[g^2] - E[g]^2`. Rules give it without
    materializing for dense layers (`(a^2)^T (dz^2)`) and embeddings.
    """
    fn = "custagg.gradient_second_moments"
    with tf.name_scope(name):
        plan, engine = _engine(per_example_loss, xs, strategy, registry,
                               pfor_chunk_size, fn)
        return [engine.squared_sum(a) if a.strategy else None
                for a in plan.assignments]
