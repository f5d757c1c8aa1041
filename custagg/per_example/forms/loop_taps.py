"""Finding the loop rules' taps: the body ops that read a weight.

A weight `w` used inside a v2 `While` body (Keras LSTM/GRU, `dynamic_rnn`,
a hand-written `tf.while_loop` cell) or a top-level v1 frame enters the loop
as a loop-invariant input; `find` returns its `LoopUse` (the taps: each body
op that reads it and has a registered rule) or the reason the loop rules
cannot read it. The loops are rebuilt and tapped by `loop_rebuild`, and the
rules' answers assembled by `loop_rules`.

Row b of `dz_t` is example b's own only if examples stay apart downstream
of every tap. That is checked statically, never assumed: from each tap's
output, through the rest of the body, into the next iterations (loop
variables) and out of the loop to the loss, every op must be known to keep
the batch axis (`separability`), TensorLists included (items keep their
batch axis). Anything unknown refuses the tap, and the planner takes an
exact form instead (per-example copies, `forms/copies.py`). With
`find(..., defer=True)` (the certified form) only the part inside the loop
is proved, and the run-time certificate checks the rest at the loop's
outputs (`LoopUse.checks`).

Handled: `While`/`StatelessWhile` at the top level of the loss's graph and
top-level v1 frames (Enter/Exit, `disable_v2_behavior`), x entering as a
loop-invariant input (a resource handle read inside, or a value), consumed
inside by any op with a registered rule whose static checks pass there
(`custagg.rules.applies.rule_reason`), with the batch on axis 0 of its output and the
output's other dims static, directly or through `Unpack` along axis 0 (the
Keras GRU's `[2, 3H]` bias).
"""

from __future__ import annotations

import collections

import tensorflow as tf

from custagg import _tf_compat
from custagg import batch_axis
from custagg import op_kinds
from custagg.graph import copier
from custagg.rules import applies
from custagg.rules import registry as registry_lib


class Tap(collections.namedtuple("Tap", ["op", "index", "rule", "slot",
                                         "reader"], defaults=[None])):
    """One body op that consumes x.

    op: the body op, output `[B, ...]` (batch on axis 0, the rest static).
    index: which of `op.inputs` carries x (or its slice).
    rule: the registry's rule for the op.
    slot: (j, J) when the op reads `unstack(x)[j]` of J slices, else None.
    reader: `((op, tensor), ...)`: the one op on the loss's path that
      reads the op's output, and on through ops that pass its gradient on
      unchanged (`_readers`), each with the tensor it reads; or None.
    """

    @property
    def rest(self):
        """The static dims of the op's output after the batch axis."""
        return self.op.outputs[0].shape.as_list()[1:]

    @property
    def others(self):
        """The input positions other than x's whose values the rule reads:
        pushed per iteration."""
        if not self.rule.reads_other_inputs:
            return []
        return [k for k in range(len(self.op.inputs)) if k != self.index]

    @property
    def stand_ins(self):
        """The input positions other than x's that the rule does not read
        (`Rule.reads_other_inputs`): not kept per iteration; the op rebuilt
        outside the loop gets zeros of their shape, which nothing runs."""
        if self.rule.reads_other_inputs:
            return []
        return [k for k in range(len(self.op.inputs)) if k != self.index]


class LoopUse(collections.namedtuple("LoopUse", [
        "op", "index", "taps", "value", "outputs", "loop", "counter",
        "checks"], defaults=[None])):
    """x's uses inside one loop, entering at `op.inputs[index]` (`op`: the
    v2 While, or the v1 Enter).

    value: x's value inside the body (x's shape).
    outputs: the loop's outputs the loss reads (While outputs, v1 Exits).
    loop: the While op, or the v1 WhileContext (one rebuild per loop).
    counter: (final, start) tensors of the loop's iteration counter.
    checks: None when examples are proved apart from every tap to the loss;
      for the certified form (`find(..., defer=True)`: proved apart inside
      the loop only), the `(tensor, batch axis)` pairs after the loop
      where the run-time certificate checks the rest (`certificate.Certificate`).
    """

    @property
    def name(self):
        """The loop's name (the While op's, or the v1 frame's)."""
        return self.loop.name


def find(op, index, loss, loss_ancestors, registry, batch_size,
         defer=False):
    """`(LoopUse, None)` when every use of `op.inputs[index]` in the loop
    body is a tap that keeps examples apart to the loss, else
    `(None, reason)`. `op`: a v2 While, or the Enter of a v1 frame.
    `registry`: the rules to ask; `batch_size`: B (int or scalar tensor).

    `defer`: prove examples apart only from the taps to the loop's outputs
    (through the body and the next iterations), and leave the rest, from
    the outputs to the loss, to the run-time certificate: the use's
    `checks` say where (v2 loops only)."""
    taps = _TapFinder(registry, batch_size)
    if op.type in op_kinds.V1_ENTERS:
        if defer:
            return None, "the certificate covers v2 loops only"
        return _find_v1(op, loss, loss_ancestors, taps)
    if op.type not in op_kinds.V2_LOOPS:
        return None, "not a while loop"
    try:
        body = copier.func_graph(op, "body")
    except copier.CannotCopy as e:
        return None, str(e)
    why = _counted(op, body)
    if why:
        return None, why
    if index >= len(body.outputs) or \
            body.outputs[index] is not body.inputs[index]:
        return None, ("x enters loop '%s' as a loop variable that the body "
                      "changes" % op.name)
    used = _used_outputs(op, loss_ancestors)
    # Body ops behind the loop variables whose outputs the loss reads.
    live = copier.ancestors_in([body.outputs[k] for k in used])

    checks = []

    def coupling(z):
        if defer:
            return _inside(op, body, z, live, loss_ancestors, checks)
        return _coupling(op, body, z, live, loss, loss_ancestors)
    outputs = tuple(op.outputs[k] for k in used)
    use, why = _use(op, index, op.name, live, body.inputs[index], coupling,
                    outputs, op, (op.outputs[0], op.inputs[0]), taps)
    if use is not None and defer:
        use = use._replace(checks=tuple(_unique(checks)))
    return use, why


def _list_readers(t, loss_ancestors):
    """The ops that read list `t` (a While output) on the loss's side,
    through the Identity ops control flow v2 puts after a loop."""
    out, stack = [], [t]
    while stack:
        for c in stack.pop().consumers():
            if c not in loss_ancestors:
                continue
            if c.type == "Identity":
                stack.append(c.outputs[0])
            else:
                out.append(c)
    return out


def _unique(points):
    out = []
    for t, axis in points:
        if not any(t is u and axis == a for u, a in out):
            out.append((t, axis))
    return out


def _inside(op, body, start, live, loss_ancestors, checks):
    """`_coupling`'s first half: None if row b of `start` reaches only row
    b of the loop's outputs (through the body and the next iterations),
    appending to `checks` where those rows are read after the loop
    (`(tensor, axis)`: an output, or the stack of an output list); else a
    reason."""
    reached, why = batch_axis.walk_body(body, [(start, 0)], live)
    if why:
        return why
    for k, axes in sorted(reached.items()):
        out = op.outputs[k]
        if not any(c in loss_ancestors for c in out.consumers()):
            continue
        for axis in axes:
            if isinstance(axis, int) and out.dtype != tf.variant:
                checks.append((out, axis))
                continue
            if isinstance(axis, batch_axis.ListOf) and \
                    isinstance(axis.axis, int):
                readers = _list_readers(out, loss_ancestors)
                if readers and all(c.type == "TensorListStack"
                                   for c in readers):
                    # Items [B, ...] stacked: [T, B, ...].
                    checks.extend((c.outputs[0], axis.axis + 1)
                                  for c in readers)
                    continue
            return batch_axis.Reason(
                "output %d of loop '%s' holds the batch as %s, where the "
                "run-time certificate cannot read rows" % (k, op.name, axis),
                op)
    return None


def in_v1_loop(op):
    """Whether `op` is inside a v1 while frame."""
    ctxt = _tf_compat.control_flow_context(op)
    while ctxt is not None:
        if hasattr(ctxt, "loop_exits"):
            return True
        ctxt = ctxt.outer_context
    return False


def _find_v1(enter, loss, loss_ancestors, taps):
    """`find` for a v1 frame (Enter/Exit, `disable_v2_behavior`): the frame's
    ops are ops of the graph, so the coupling check walks them as any."""
    ctxt = _tf_compat.control_flow_context(enter)
    name = getattr(ctxt, "name", "?")
    if ctxt is None or not hasattr(ctxt, "loop_exits") or \
            ctxt.outer_context is not None:
        return None, ("x enters a v1 control-flow context ('%s') that is not "
                      "a top-level while loop" % name)
    if not enter.get_attr("is_constant"):
        return None, ("x enters v1 loop '%s' as a loop variable" % name)
    counter = _v1_counter(ctxt)
    if counter is None:
        return None, "v1 loop '%s' has no iteration counter from 0" % name
    live = set(o for o in copier.frame_ops(ctxt, enter.graph)
               if o in loss_ancestors)

    def coupling(z):
        return batch_axis.coupling(z, 0, loss, loss_ancestors)
    outputs = []
    for e in ctxt.loop_exits:
        readers = [c for c in e.consumers() if c in loss_ancestors]
        if not readers:
            continue
        if any(c.type.startswith("TensorArray") for c in readers):
            # A TensorArray's flow: its gradient is not a value to seed a
            # copy with (the values sit in the original array's gradient
            # array), so the seeds go in at the array's reads.
            reads = [c for c in readers
                     if c.type in op_kinds.V1_TENSOR_ARRAY_READS]
            if len(reads) + sum(c.type == "TensorArraySizeV3"
                                for c in readers) != len(readers):
                return None, ("the output TensorArray of v1 loop '%s' is "
                              "read in a way the loop rules do not follow"
                              % name)
            outputs.extend(c.outputs[0] for c in reads)
        else:
            outputs.append(e)
    return _use(enter, 0, name, live, enter.outputs[0], coupling,
                tuple(outputs), ctxt, counter, taps)


def _v1_counter(ctxt):
    """(Exit, start) of a loop variable that starts at a constant and goes
    up by 1 each iteration (dynamic_rnn's `time`, a hand-written `t`)."""
    for exit_t in ctxt.loop_exits:
        switch = exit_t.op.inputs[0].op
        merge = switch.inputs[0].op
        if merge.type != "Merge" or exit_t.dtype != tf.int32:
            continue
        start = merge.inputs[0].op
        nxt = merge.inputs[1].op
        if start.type != "Enter" or tf.get_static_value(
                start.inputs[0]) is None or nxt.type != "NextIteration":
            continue
        add = nxt.inputs[0].op
        if add.type not in op_kinds.ADDS:
            continue
        ins = list(add.inputs)
        through = [i for i in ins if i.op.type == "Identity" and
                   i.op.inputs[0].op is switch and i.op.inputs[0]
                   .value_index == 1]
        if through and any(tf.get_static_value(i) == 1 for i in ins):
            return exit_t, start.inputs[0]
    return None


def _use(op, index, name, live, entry, coupling, outputs, loop, counter,
         finder):
    """The LoopUse of x entering at `entry` (a body tensor), or the reason
    the loop rules cannot read it."""
    for c in live:
        if reruns_differently(c):
            # The rebuilt loop would draw new numbers (or act twice).
            return None, batch_axis.Reason(
                "op '%s' (type %s) inside loop '%s' %s, and the loop rules "
                "run the loop once more" % (
                    c.name, c.type, name, "draws random numbers"
                    if c.type in op_kinds.RANDOM else "has side effects"), c)
    taps, value = [], None
    for t, slot in _values(entry, live):
        value = t if slot is None else t.op.inputs[0]
        for c in t.consumers():
            if c not in live:
                continue
            if c.type in op_kinds.LOOP_VALUE_READS or (
                    c.type == "Unpack" and slot is None):
                continue
            tap, why = finder.tap(c, t, slot)
            if tap is None:
                return None, batch_axis.Reason(
                    "op '%s' (type %s) uses x inside loop '%s' in a way the "
                    "loop rules do not handle (%s)" % (
                        c.name, c.type, name, why), c)
            taps.append(tap)
    taps = [tap._replace(reader=_readers(tap.op.outputs[0], live))
            for tap in taps]
    if not taps:
        return None, "x reaches the loss through no op of loop '%s'" % name
    for tap in taps:
        why = coupling(tap.op.outputs[0])
        if why:
            return None, batch_axis.Reason(
                "batch coupling between op '%s' inside loop '%s' and the "
                "loss: %s" % (tap.op.name, name, why),
                getattr(why, "op", None) or op)
    return LoopUse(op, index, taps, value, outputs, loop, counter), None


def is_stateful(op):
    return getattr(op.op_def, "is_stateful", False)


def reruns_differently(op):
    """Whether a second run of `op` (a loop run once more, an op after it
    copied) would not repeat the first: it draws random numbers, or it is
    stateful and not a read (`op_kinds.REPEATABLE_STATEFUL`)."""
    return op.type in op_kinds.RANDOM or (
        is_stateful(op) and op.type not in op_kinds.REPEATABLE_STATEFUL)


def _counted(op, body):
    """Why loop var 0 may not be the iteration count (None if it is:
    while_v2 puts a counter there, `i + 1` each iteration)."""
    out = body.outputs[0] if body.outputs else None
    if out is None or out.dtype != tf.int32 or \
            out.op.type not in op_kinds.ADDS:
        return "loop '%s' has no iteration counter" % op.name
    ins = list(out.op.inputs)
    if body.inputs[0] not in ins or not any(
            tf.get_static_value(i) == 1 for i in ins):
        return "loop '%s' has no iteration counter" % op.name
    return None


def _used_outputs(op, loss_ancestors):
    """Indices of the While's outputs the loss reads (through a gradient)."""
    return [k for k, out in enumerate(op.outputs)
            if (out.dtype.is_floating or out.dtype == tf.variant) and
            any(c in loss_ancestors for c in out.consumers())]


def _values(t, live):
    """(tensor, slot) pairs: x's value inside the body, through reads, and
    its `Unpack` slices (slot (j, J))."""
    stack, found = [t], []
    while stack:
        t = stack.pop()
        for c in t.consumers():
            if c not in live:
                continue
            if c.type in op_kinds.LOOP_VALUE_READS:
                stack.append(c.outputs[0])
        if t.dtype != tf.resource:
            found.append((t, None))
        for c in t.consumers():
            if c in live and c.type == "Unpack" and c.get_attr("axis") == 0 \
                    and t.dtype != tf.resource:
                n = len(c.outputs)
                found.extend((o, (j, n)) for j, o in enumerate(c.outputs))
    return found


class _TapFinder(object):
    """Asks the registry whether a body op that reads x can be a tap."""

    def __init__(self, registry, batch_size):
        self.registry = registry
        self.batch_size = batch_size

    def tap(self, c, t, slot):
        """(Tap, None) for an op whose rule applies here, or (None, why)."""
        ks = [k for k, i in enumerate(c.inputs) if i is t]
        if len(ks) != 1:
            return None, "x is more than one input of the op"
        k = ks[0]
        # The static checks of the rule, as outside loops; the coupling to
        # the loss is checked from the tap through the loop (`_coupling`).
        why = applies.rule_reason(c, k, self.registry, self.batch_size,
                                     None, None)
        if why:
            return None, str(why)
        rule = self.registry.lookup(c.type)
        ctx = registry_lib.RuleContext(c, k, None, self.batch_size)
        start, axis = rule.coupling_start(ctx)
        if start is not c.outputs[0] or axis != 0:
            return None, ("the %s rule reads the batch elsewhere than axis 0 "
                          "of the op's output" % c.type)
        out = c.outputs[0]
        if out.shape.rank is None or out.shape.rank < 1 or \
                not out.shape[1:].is_fully_defined():
            return None, "its output is not [B, ...] with the rest known"
        for j in range(len(c.inputs)):
            if j == k:
                continue
            other = c.inputs[j]
            if other.shape.rank is None or other.shape.rank < 1 or \
                    other.dtype == tf.resource or other.dtype == tf.variant:
                return None, ("input %d is not a [B, ...] value" % j)
            lead = tf.compat.dimension_value(other.shape[0])
            out_lead = tf.compat.dimension_value(out.shape[0])
            if lead is not None and out_lead is not None and lead != out_lead:
                return None, ("input %d has other rows than the output" % j)
        return Tap(c, k, rule, slot), None


def _coupling(op, body, start, live, loss, loss_ancestors):
    """None if row b of `start` (a body tensor, batch on axis 0) reaches
    only loss[b]: through the body, the next iterations and out of the
    loop; else a reason."""
    reached, why = batch_axis.walk_body(body, [(start, 0)], live)
    if why:
        return why
    for k, axes in sorted(reached.items()):
        for axis in axes:
            why = batch_axis.coupling(op.outputs[k], axis, loss,
                                        loss_ancestors)
            if why:
                return why
    return None


def _readers(t, live):
    """`((op, tensor), ...)`: the one op in `live` (the body ops on the
    loss's path; not the accumulators a gradient taken before added) that
    reads `t`, and on through ops that pass the gradient on unchanged
    (`Identity`, or a sum with `t` a full-shape addend: the Keras LSTM's
    `x W + h U` before its BiasAdd), each with the tensor it reads; the
    chain ends at an op of another type or a tensor with more readers
    (empty if `t` has more than one)."""
    chain = []
    while True:
        users = [c for c in t.consumers() if c in live]
        if len(users) != 1:
            return tuple(chain)
        c = users[0]
        chain.append((c, t))
        if c.type not in op_kinds.SAME_GRADIENT or \
                sum(i is t for i in c.inputs) != 1:
            return tuple(chain)
        out = c.outputs[0]
        if c.type != "Identity" and not full_addend(t, out):
            return tuple(chain)
        t = out


def full_addend(t, out):
    """Whether `t`, an addend of `out`, has `out`'s static shape, the dims
    after the batch known (so its gradient is `out`'s, unreduced)."""
    return bool(out.shape.rank == t.shape.rank and out.shape.rank and
                t.shape[1:].is_fully_defined() and
                out.shape[1:] == t.shape[1:] and
                tf.compat.dimension_value(out.shape[0]) ==
                tf.compat.dimension_value(t.shape[0]))


def cotangent_targets(uses):
    """The loop outputs whose gradients `build` needs, in a fixed order."""
    out = []
    for use in uses:
        for t in use.outputs:
            if not any(t is o for o in out):
                out.append(t)
    return out
