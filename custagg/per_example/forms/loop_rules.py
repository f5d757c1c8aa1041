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

Where `dz` comes from (issue 26):

* `one_pass` (v2 loops): `eps` is a TensorList reserved for T items, none
  set; the tap's output goes through `IdentityN(z_t, eps, t)`, whose
  gradient (`_eps_tap_grad`) passes dz_t on and sets item t of eps to it
  (no zeros read and added per step); the ops between the
  loops and the loss are copied onto the rebuilt loops' outputs, and the
  rules' one backward pass (`engine.SharedPass`) differentiates that
  recomputed loss to the taps' lists and to the rule ops' outputs (their
  copies after the loops). The original loop then never runs unless the
  user fetches the loss: one forward and one backward pass of the loop.
  T, needed before the tapped loop starts, comes from a copy of the loop
  that runs only the variables its condition reads (no float state).
* `build` (the fallback: v1 frames, random or stateful ops after the
  loop, a condition on the loop's state): `eps`
  `[T, B, ...]` zeros with T from the original loop's counter, and one
  backward pass of the rebuilt loop seeded with the loss's gradient at
  the original loop's outputs (from the rules' shared backward pass): the
  loop runs twice.

That last condition is checked statically, never assumed: from each tap's
output, through the rest of the body, into the next iterations (loop
variables) and out of the loop to the loss, every op must be known to keep
the batch axis (`separability`), TensorLists included (items keep their
batch axis). Anything unknown refuses the tap, and the planner takes an
exact form instead (per-example copies, `forms/copies.py`).

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
from custagg.graph import copier
from custagg.rules import applies
from custagg.rules import outer as _outer
from custagg.rules import registry as registry_lib

LOOP_TYPES = batch_axis.LOOP_TYPES
# The ops through which x enters a loop: a v2 While, a v1 frame's Enter.
ENTRY_TYPES = LOOP_TYPES | frozenset(["Enter", "RefEnter"])

# Ops between the loop's input and the value a tap reads.
_READS = frozenset(["ReadVariableOp", "Identity"])


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
      where the run-time certificate checks the rest (`engine.Certificate`).
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
    if op.type in ("Enter", "RefEnter"):
        if defer:
            return None, "the certificate covers v2 loops only"
        return _find_v1(op, loss, loss_ancestors, taps)
    if op.type not in LOOP_TYPES:
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
            reads = [c for c in readers if c.type in _TA_READS]
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


# The reads of a v1 TensorArray after its loop, where seeds go in.
_TA_READS = frozenset(["TensorArrayGatherV3", "TensorArrayReadV3",
                       "TensorArrayConcatV3"])


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
        if add.type not in ("AddV2", "Add"):
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
        if c.type in batch_axis.RANDOM or (
                _stateful(c) and c.type not in _STATEFUL_OK):
            # The rebuilt loop would draw new numbers (or act twice).
            return None, batch_axis.Reason(
                "op '%s' (type %s) inside loop '%s' %s, and the loop rules "
                "run the loop once more" % (
                    c.name, c.type, name, "draws random numbers"
                    if c.type in batch_axis.RANDOM else "has side effects"), c)
    taps, value = [], None
    for t, slot in _values(entry, live):
        value = t if slot is None else t.op.inputs[0]
        for c in t.consumers():
            if c not in live:
                continue
            if c.type in _READS or (c.type == "Unpack" and slot is None):
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


# Stateful ops a second run of the loop may repeat: reads.
_STATEFUL_OK = frozenset(["ReadVariableOp", "VarHandleOp", "ResourceGather",
                          "Placeholder", "TensorArrayReadV3",
                          "TensorArrayWriteV3", "TensorArrayGatherV3",
                          "TensorArrayScatterV3", "TensorArraySizeV3",
                          "TensorArrayV3"])


def _stateful(op):
    return getattr(op.op_def, "is_stateful", False)


def _counted(op, body):
    """Why loop var 0 may not be the iteration count (None if it is:
    while_v2 puts a counter there, `i + 1` each iteration)."""
    out = body.outputs[0] if body.outputs else None
    if out is None or out.dtype != tf.int32 or \
            out.op.type not in ("AddV2", "Add"):
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
            if c.type in _READS:
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


# --------------------------------------------------------------------------
# Building


def _element_shape(t):
    """A TensorList element shape for `t`'s rows: `[-1, *rest]` with -1
    where a dim is unknown."""
    return tf.constant([-1] + [-1 if d is None else d
                               for d in t.shape.as_list()[1:]], tf.int32)


# Ops whose gradient at an input of the output's shape is the output's
# gradient unchanged.
_PASS_THROUGH = frozenset(["Identity", "AddV2", "Add", "AddN"])


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
        if c.type not in _PASS_THROUGH or \
                sum(i is t for i in c.inputs) != 1:
            return tuple(chain)
        out = c.outputs[0]
        if c.type != "Identity" and not _full_addend(t, out):
            return tuple(chain)
        t = out


def _full_addend(t, out):
    """Whether `t`, an addend of `out`, has `out`'s static shape, the dims
    after the batch known (so its gradient is `out`'s, unreduced)."""
    return bool(out.shape.rank == t.shape.rank and out.shape.rank and
                t.shape[1:].is_fully_defined() and
                out.shape[1:] == t.shape[1:] and
                tf.compat.dimension_value(out.shape[0]) ==
                tf.compat.dimension_value(t.shape[0]))


def _gradient_owner(tap, taps, tap_of_op):
    """The index of the tap whose dz is also `tap`'s: `tap`'s output (or a
    sum it is a full-shape addend of, `_readers`) has one reader on the
    loss's path, that tap's op, which reads it only at inputs other than
    its parameter whose gradient is the op's output gradient unchanged
    (`Rule.passes_gradient_to`, or the full-shape addend of a tapped
    `AddV2`); else None."""
    # The first tapped op down the chain (the ops before it pass dz on).
    summed = False
    for user, t in tap.reader or ():
        if user in tap_of_op:
            break
        summed = summed or user.type != "Identity"
    else:
        return None
    summed = summed or user.type in ("AddV2", "Add")
    if summed and not tap.others:
        # A sum's dz is an addend's only if the addend has the sum's rows:
        # so for taps whose pushed inputs' rows are checked to be the
        # batch's after the loop (`_tap_result`), not others.
        return None
    j = tap_of_op[user]
    other = taps[j]
    positions = [k for k, i in enumerate(other.op.inputs) if i is t]
    passes = other.rule.passes_gradient_to
    if other.op.type in ("AddV2", "Add") and len(positions) == 1 and \
            _full_addend(t, other.op.outputs[0]):
        # A bias added to the full-shape value (hand-written cells'
        # `x W + b`): the value's gradient is the sum's.
        passes = positions
    if positions and all(k in passes and k != other.index
                         for k in positions):
        return j
    return None


_EPS_TAP = "CustaggLoopEpsTap"


def _eps_tap_grad(op, dz, *unused):
    """The gradient of `IdentityN(z, eps list, step)` (a one-pass tap):
    dz for z, and for the list (none of whose items is set) the list with
    item `step` set to dz: what `TensorListGetItem(eps, step)` added to z
    would give, without reading and adding zeros at every step."""
    del unused
    dz = tf.convert_to_tensor(dz)
    return [dz, tf.raw_ops.TensorListSetItem(
        input_handle=op.inputs[1], index=op.inputs[2], item=dz), None]


try:
    tf.RegisterGradient(_EPS_TAP)(_eps_tap_grad)
except KeyError:        # registered already: this module imported again
    pass


class _Hook(object):
    """Taps one rebuilt While body (`Copier.hooks`): adds
    `eps[t]` to each tap's output and pushes the tap's other inputs."""

    def __init__(self, taps, steps, batch, v1=False):
        """`batch` None: the eps lists are reserved for `steps` items of
        unknown rows, each read as zeros of its tap's output shape (the
        one-pass build, `OnePass`, which must not read B from the loss:
        that would run the original loop); else `[T, B, ...]` zeros."""
        self.v1 = v1
        self.lazy = batch is None
        self.taps = list(taps)
        self.ops = {tap.op: i for i, tap in enumerate(self.taps)}
        # slot[i]: which eps (and dz) tap i reads: its own, or that of the
        # tap it alone feeds through an input whose gradient is dz itself
        # (a MatMul into a BiasAdd: one [T, B, ...] tensor, not two).
        owner = [_gradient_owner(tap, self.taps, self.ops)
                 for tap in self.taps]

        def root(i):
            while owner[i] is not None:    # the body is acyclic: chains end
                i = owner[i]
            return i

        roots = [root(i) for i in range(len(self.taps))]
        self.owners = sorted(set(roots))   # the taps that add their own eps
        self.slot = [self.owners.index(r) for r in roots]
        if self.lazy:
            # The lists themselves are what the gradient is taken to.
            self.eps = [tf.raw_ops.TensorListReserve(
                element_shape=_element_shape(self.taps[i].op.outputs[0]),
                num_elements=steps,
                element_dtype=self.taps[i].op.outputs[0].dtype)
                for i in self.owners]
            self._lists = list(self.eps)
        else:
            self.eps = [tf.zeros(tf.stack([steps, batch] +
                                          self.taps[i].rest),
                                 self.taps[i].op.outputs[0].dtype)
                        for i in self.owners]
            self._lists = [] if v1 else [tf.raw_ops.TensorListFromTensor(
                tensor=e, element_shape=_element_shape(e[0]))
                for e in self.eps]
        # One extra loop variable per (tap, other input): the pushed rows.
        self.pushed = [(i, k) for i, tap in enumerate(self.taps)
                       for k in tap.others]
        self.inputs = {}        # (tap, input) -> [T, B, ...]
        self.fired = set()      # the taps the rebuilt body copied

    def initial(self):
        """Extra loop variables: the step, one list per pushed input (in a
        v1 loop, a TensorArray's flow: a v1 gradient makes zeros for every
        exit, which a variant list cannot have)."""
        out = [tf.constant(0, tf.int32)]
        self._arrays = {}
        for i, k in self.pushed:
            t = self.taps[i].op.inputs[k]
            if self.v1:
                ta = tf.TensorArray(
                    t.dtype, size=0, dynamic_size=True,
                    element_shape=tf.TensorShape([None]).concatenate(
                        t.shape[1:]))
                self._arrays[(i, k)] = ta
                out.append(ta.flow)
            else:
                out.append(tf.raw_ops.EmptyTensorList(
                    element_shape=_element_shape(t), max_num_elements=-1,
                    element_dtype=t.dtype))
        return out

    def _array(self, key, flow):
        ta = self._arrays[key]
        return tf.TensorArray(ta.dtype, handle=ta.handle, flow=flow)

    def invariant(self, t):
        del t
        return tf.TensorShape([])     # a scalar step, or a TensorList

    def enter(self, values):
        self.step = values[0]
        self.lists = dict(zip(self.pushed, values[1:]))

    def tap(self, op, outs, mapping):
        del mapping
        i = self.ops[op]
        self.fired.add(i)
        tap = self.taps[i]
        s = self.slot[i]
        copied = outs[0].op        # the copy, its inputs the rebuilt body's
        for k in tap.others:
            # The rows are checked once after the loop (`_tap_result`),
            # not at every step: a check in the body is ~8 nodes per step
            # and input (issue 26).
            a = copied.inputs[k]
            if self.v1:
                self.lists[(i, k)] = self._array(
                    (i, k), self.lists[(i, k)]).write(self.step, a).flow
            else:
                self.lists[(i, k)] = tf.raw_ops.TensorListPushBack(
                    input_handle=self.lists[(i, k)], tensor=a)
        if i not in self.owners:
            # Its dz is read at the tap it feeds (`slot`): no eps of its
            # own, nothing read.
            return list(outs)
        if self.lazy:
            # The output as it is, through an IdentityN that also takes
            # the (unset) eps list and the step: its gradient passes dz on
            # and sets item `step` of the list to it (`_eps_tap_grad`).
            # `z + GetItem(eps, step)` read and added zeros of z's shape at
            # every step, and while_v2 pushed the list's element shape and
            # length per step for TensorListGetItem's gradient (issue 26).
            with tf.compat.v1.get_default_graph().gradient_override_map(
                    {"IdentityN": _EPS_TAP}):
                tapped = tf.raw_ops.IdentityN(
                    input=[outs[0], self._lists[s], self.step])[0]
            return [tapped] + list(outs[1:])
        if self.v1:
            # A v1 loop accumulates a captured tensor's gradient (here
            # IndexedSlices) itself; a variant list's it does not.
            item = tf.gather(self.eps[s], self.step)
        else:
            item = tf.raw_ops.TensorListGetItem(
                input_handle=self._lists[s], index=self.step,
                element_shape=_element_shape(self.eps[s][0]),
                element_dtype=self.eps[s].dtype)
        # eps has the loss's B rows: a tapped output with other rows (one
        # row broadcast later) would make them up; fail instead.
        checks = [tf.debugging.assert_equal(
            tf.shape(outs[0])[0], tf.shape(item)[0],
            message="custagg: a loop rule's op '%s' has other rows than "
                    "the batch's examples; use strategy='pfor'" % op.name)]
        with tf.control_dependencies(checks):
            # AddN, not AddV2: the shapes are equal (checked), and AddN's
            # gradient passes dz through where AddV2's reduces over
            # broadcast axes (BroadcastGradientArgs, Sum and Reshape at
            # every step of the backward loop).
            return [tf.math.add_n([outs[0], item])] + list(outs[1:])

    def leave(self):
        return [self.step + 1] + [self.lists[key] for key in self.pushed]

    def done(self, values):
        for key, lst in zip(self.pushed, values[1:]):
            i, k = key
            t = self.taps[i].op.inputs[k]
            if self.v1:
                stacked = self._array(key, lst).stack()
            else:
                stacked = tf.raw_ops.TensorListStack(
                    input_handle=lst, element_shape=_element_shape(t),
                    element_dtype=t.dtype)
            stacked.set_shape(tf.TensorShape([None, None]).concatenate(
                t.shape[1:]))
            self.inputs[key] = stacked


# Op types the one-pass build does not copy downstream of a loop: control
# flow and function calls whose copies would need their own rebuild.
_NOT_COPIED = frozenset(["If", "StatelessIf", "Case", "StatelessCase",
                         "PartitionedCall", "StatefulPartitionedCall",
                         "SymbolicGradient"])


# Stateful ops after a loop that a copy may run again: checks (a shape
# assertion of a loss) act only by failing, as the original would.
_CHECKS = frozenset(["Assert"])


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
        """Each use's per-example gradients as `build` gives them, from the
        gradients at `eps` (aligned with it; a variant list or None)."""
        grads = iter(eps_grads)
        result = {}
        with tf.name_scope("loop_rules_form"):
            for loop, group in self._by_loop.items():
                hook = self._hooks[loop]
                dz = []
                for s, lst in enumerate(hook.eps):
                    g = next(grads)
                    tap = hook.taps[hook.owners[s]]
                    dtype = tap.op.outputs[0].dtype
                    # Fully defined at run time: unset items (no gradient at
                    # a step) and an empty loop stack as zeros.
                    shape = tf.concat([[batch], tf.constant(tap.rest,
                                                            tf.int32)], 0)
                    if g is None:
                        d = tf.zeros(tf.concat([
                            [tf.raw_ops.TensorListLength(input_handle=lst)],
                            shape], 0), dtype)
                    else:
                        d = tf.raw_ops.TensorListStack(
                            input_handle=g, element_shape=shape,
                            element_dtype=dtype)
                    d.set_shape(tf.TensorShape([None, None]).concatenate(
                        tap.rest))
                    dz.append(d)
                for use in group:
                    result[(use.op, use.index)] = _outer_of(use, hook, dz)
        return result


def one_pass(uses, loss):
    """`(OnePass, None)`, or `(None, reason)` when the loops of `uses` are
    read the way of `build` instead (their original loops run, and the
    rebuilt ones once more): a v1 frame; a loop whose condition depends on
    its floating state (its iteration count, needed before the tapped loop
    runs, would cost a forward pass); between the loops and the loss an op
    that draws random numbers or has side effects (its copy would draw or
    act again: dropout after an RNN), another loop, a cond or a function
    call."""
    by_loop = collections.OrderedDict()
    for use in uses:
        by_loop.setdefault(use.loop, []).append(use)
    for loop in by_loop:
        if not isinstance(loop, tf.Operation):
            return None, "v1 loop '%s'" % by_loop[loop][0].name
    graph = loss.graph
    ancestors = copier.ancestors_in([loss])
    # The ops after the loops, through data and control edges (creation
    # order is topological): a labels' reshape waiting on an `Assert` that
    # reads the logits' shape is after the loop too, and its copy waits on
    # the copied check (kept, the original would run the original loop).
    below = set()
    for op in graph.get_operations():
        if op in ancestors and any(
                p in by_loop or p in below
                for p in [t.op for t in op.inputs] + list(op.control_inputs)):
            below.add(op)
    for op in below:
        if op in by_loop or op.type in _CHECKS:
            continue
        if op.type in batch_axis.RANDOM or op.type in LOOP_TYPES or \
                op.type in _NOT_COPIED or (
                    _stateful(op) and op.type not in _STATEFUL_OK):
            return None, ("op '%s' (type %s) between a loop and the loss "
                          "would run again in a copy" % (op.name, op.type))
    for loop in by_loop:
        try:
            counted = copier.live_loop_variables(loop, [0])
        except copier.CannotCopy as e:
            return None, str(e)
        if any(loop.inputs[k].dtype.is_floating or
               loop.inputs[k].dtype.is_complex for k in counted):
            return None, ("the condition of loop '%s' depends on its state"
                          % loop.name)
    mapping, hooks = {}, {}
    copies = copier.Copier(one_row=False, checks=True)
    with tf.name_scope("loop_rules_one_pass"):
        for op in graph.get_operations():
            if op not in ancestors:
                continue
            if op in by_loop:
                taps = [tap for use in by_loop[op] for tap in use.taps]
                # The iteration count first, from a loop of the variables
                # the condition reads (no float state: checked above).
                counts = copier.Copier(one_row=False).rebuild_while(
                    op, dict(mapping), [0])
                steps = counts[0] - copies.input(op.inputs[0], mapping)
                hooks[op] = copies.hooks[op] = _Hook(taps, steps, None)
                used = [k for k, o in enumerate(op.outputs)
                        if any(c in ancestors for c in o.consumers())]
                outs = copies.rebuild_while(op, mapping, used)
            elif op in below or any(t.ref() in mapping for t in op.inputs):
                outs = copies.copy_op(op, mapping)
            else:
                continue
            for old, new in zip(op.outputs, outs):
                if new is not None:
                    # The copy computes the same values: what the original's
                    # static shape proves holds for it too (a rebuilt loop's
                    # stacked outputs lose a static T), and the rules' proofs
                    # on the copies (a dense layer's folded rows) need it.
                    if new.shape.is_compatible_with(old.shape):
                        new.set_shape(old.shape)
                    mapping[old.ref()] = new
    new_loss = mapping.get(loss.ref())
    if new_loss is None:
        raise ValueError("custagg: the loss does not depend on the loops "
                         "the loop rules rebuilt; report this graph.")
    return OnePass(new_loss, mapping, hooks, by_loop), None


def cotangent_targets(uses):
    """The loop outputs whose gradients `build` needs, in a fixed order."""
    out = []
    for use in uses:
        for t in use.outputs:
            if not any(t is o for o in out):
                out.append(t)
    return out


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
            result.update(_build_loop(loop, group, cotangent_of, batch))
    return result


def _build_loop(loop, group, cotangent_of, batch):
    """`build` for the uses of one loop (a While op or a v1 context)."""
    taps = [tap for use in group for tap in use.taps]
    final, start = group[0].counter
    # The number of iterations the original loop ran.
    v2 = isinstance(loop, tf.Operation)
    hook = _Hook(taps, final - start, batch, v1=not v2)
    outputs = [t for t in cotangent_targets(group)
               if cotangent_of.get(t.ref()) is not None]
    # The loop rebuilt on the whole batch, its body tapped by the hook.
    rebuild = copier.Copier(one_row=False, hooks={loop: hook})
    if v2:
        new = rebuild.rebuild_while(loop, {}, [
            t.value_index for t in outputs])
        ys = [new[t.value_index] for t in outputs]
    else:
        mapping = {}
        exits = {e.ref() for e in loop.loop_exits}
        rebuild.rebuild_v1_while(loop, mapping, {
            t.ref() if t.ref() in exits else t.op.inputs[2].ref()
            for t in outputs})
        ys = [_remap(t, mapping, {}, rebuild) for t in outputs]
    seeds = [cotangent_of[t.ref()] for t in outputs]
    dz = tf.compat.v1.gradients(
        ys, hook.eps, grad_ys=seeds,
        unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return {(use.op, use.index): _outer_of(use, hook, dz) for use in group}


def _remap(t, mapping, memo, copies):
    """`t` as computed from the tensors in `mapping` (ref -> replacement):
    the ops between them and `t` copied (by the `Copier` `copies`), the
    others kept."""
    if t.ref() in mapping:
        return mapping[t.ref()]
    if t.op in memo:
        return t
    new = [_remap(i, mapping, memo, copies) for i in t.op.inputs]
    if all(n is i for n, i in zip(new, t.op.inputs)):
        memo[t.op] = True       # does not depend on the rebuilt loop
        return t
    outs = copies.copy_op(t.op, {
        i.ref(): n for i, n in zip(t.op.inputs, new)})
    for old, out in zip(t.op.outputs, outs):
        mapping[old.ref()] = out
    return mapping[t.ref()]


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


def _unfold(t, steps):
    """`[T*B, S, N]` -> `[B, T*S, N]` (example b's rows of every step)."""
    n = tf.compat.dimension_value(t.shape[2])
    n = n if n is not None else tf.shape(t)[2]
    t = tf.reshape(t, tf.stack([steps, -1, tf.shape(t)[1], n]))
    t = tf.transpose(t, [1, 0, 2, 3])
    return tf.reshape(t, tf.stack([tf.shape(t)[0], -1, n]))


def _tap_result(use, tap, hook, dz):
    """The rule's answer for one tap on all steps at once: ("outer", a, g,
    key) in the layout of x's slice, or ("dense", [B, *slice])."""
    i = hook.taps.index(tap)
    inputs = list(tap.op.inputs)
    g = tf.convert_to_tensor(dz[hook.slot[i]])                 # [T, B, ...]
    steps = tf.shape(g)[0]
    for k in tap.others:
        stacked = hook.inputs[(i, k)]                           # [T, R, ...]
        # The rows become examples: other rows than the batch's (one row
        # broadcast later) would be made up; fail instead. Checked once
        # here on the stacked rows rather than at every step in the body.
        check = tf.debugging.assert_equal(
            tf.logical_or(tf.equal(tf.shape(stacked)[0], 0), tf.equal(
                tf.shape(stacked)[1], tf.shape(g)[1])), True,
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
            tf.concat([[steps * tf.shape(g)[1]],
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
        steps * tf.shape(g)[1]
    ctx = registry_lib.RuleContext(op, tap.index, _fold(g), rows, {})
    outer = tap.rule.outer(ctx)
    if outer is not None:
        return ("outer", _unfold(outer.a, steps), _unfold(outer.g, steps),
                outer.key)
    per = tf.convert_to_tensor(tap.rule.per_example(ctx))      # [T*B, *p]
    per = tf.reshape(per, tf.concat([[steps, -1], tf.shape(per)[1:]], 0))
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
    dense `[B, *x]` (`ctx.cache`: "outer" or "dense")."""

    def per_example(self, ctx):
        if ctx.cache["outer"] is not None:
            return ctx.cache["outer"].per_example()
        return ctx.cache["dense"]

    def outer(self, ctx):
        return ctx.cache["outer"]

    def squared_norms(self, ctx):
        if ctx.cache["outer"] is None:
            return super(LoopRule, self).squared_norms(ctx)
        return ctx.cache["outer"].squared_norms()

    def group_squared_norms(self, ctx, num_groups):
        if ctx.cache["outer"] is None:
            return super(LoopRule, self).group_squared_norms(ctx, num_groups)
        return ctx.cache["outer"].grouped(num_groups).squared_norms()

    def segment_squared_norms(self, ctx, segments):
        if ctx.cache["outer"] is None:
            return super(LoopRule, self).segment_squared_norms(ctx, segments)
        return ctx.cache["outer"].grouped(segments).squared_norms()

    def weighted_sum(self, ctx, weights):
        if ctx.cache["outer"] is None:
            return super(LoopRule, self).weighted_sum(ctx, weights)
        return ctx.cache["outer"].weighted_sum(weights)

    def squared_sum(self, ctx):
        if ctx.cache["outer"] is None:
            return super(LoopRule, self).squared_sum(ctx)
        return ctx.cache["outer"].squared_sum()


class LoopContext(registry_lib.RuleContext):
    """A RuleContext whose parameter is x's value inside the body."""

    @property
    def param(self):
        return self.cache["param"]


RULE = LoopRule()
