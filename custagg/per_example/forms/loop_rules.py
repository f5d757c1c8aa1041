"""Per-example rules inside while-loop bodies: the RNN cell's MatMul/BiasAdd.

A weight `w` used inside a v2 `While` body (Keras LSTM/GRU, `dynamic_rnn`,
a hand-written `tf.while_loop` cell) enters the loop as a captured input;
the body's op `z_t = a_t w` (or `z_t = z + w`, a bias) runs once per
iteration t. Example b's gradient is

    G_b = sum_t a_bt (x) dz_bt,     dz_bt = d loss_b / d z_bt

an outer product summed over the iterations: `_outer.Outer` with the
iterations as its T axis, so norms, clipped and weighted sums take the same
identities as a Dense layer on a sequence (Gram form, `A^T diag(c) G`).

TF's gradient of the loop sums `a_t^T dz_t` over the batch inside the
gradient loop, where no one can reach it. So the loop is **rebuilt once on
the whole batch** (`recompute`'s copy machinery, the batch kept whole) with
each tapped op's output perturbed by a zero tensor, `z_t + eps[t]`, with
`eps` `[T, B, N]` read from a TensorList, and each `a_t` pushed to an extra
TensorList. One backward pass of the rebuilt loop, seeded with the loss's
gradient at the original loop's outputs (from the rules' shared backward
pass), gives `d/d eps = dz` `[T, B, N]`: row b of it is `d loss_b / d z_bt`
because examples stay apart downstream of every tap.

That last condition is checked statically, never assumed: from each tap's
output, through the rest of the body, into the next iterations (loop
variables) and out of the loop to the loss, every op must be known to keep
the batch axis (`separability`), TensorLists included (items keep their
batch axis). Anything unknown refuses the tap, and the planner takes an
exact form instead (per-example copies, `custagg.recompute`).

Handled: `While`/`StatelessWhile` at the top level of the loss's graph and
top-level v1 frames (Enter/Exit, `disable_v2_behavior`), x entering as a
loop-invariant input (a resource handle read inside, or a value), consumed
inside by `MatMul` (x on the right, `a_t` `[B, K]`), `BiasAdd`, or
`AddV2`/`Add` of a `[N]` bias to `[B, N]`, directly or through `Unpack`
along axis 0 (the Keras GRU's `[2, 3H]` bias).
"""

from __future__ import annotations

import collections

import tensorflow as tf

from custagg import _tf_compat
from custagg import recompute
from custagg.rules import registry as registry_lib
from custagg import separability
from custagg.rules import _outer

LOOP_TYPES = separability.LOOP_TYPES
# The ops through which x enters a loop: a v2 While, a v1 frame's Enter.
ENTRY_TYPES = LOOP_TYPES | frozenset(["Enter", "RefEnter"])

# Ops between the loop's input and the value a tap reads.
_READS = frozenset(["ReadVariableOp", "Identity"])


class Tap(collections.namedtuple("Tap", ["op", "kind", "slot"])):
    """One body op that consumes x.

    op: the body op (`MatMul`: output `[B, N]` = `a [B, K]` x `w [K, N]`;
      `BiasAdd`/`AddV2`: `[B, N]` + `[N]`).
    kind: "matmul" (a_t is op.inputs[0]) or "bias" (a_t is 1).
    slot: (j, J) when the op reads `unstack(x)[j]` of J slices, else None.
    """

    @property
    def width(self):
        """N, the static size of the op's output rows."""
        return tf.compat.dimension_value(self.op.outputs[0].shape[-1])


class LoopUse(collections.namedtuple("LoopUse", [
        "op", "index", "taps", "value", "outputs", "loop", "counter"])):
    """x's uses inside one loop, entering at `op.inputs[index]` (`op`: the
    v2 While, or the v1 Enter).

    value: x's value inside the body (x's shape).
    outputs: the loop's outputs the loss reads (While outputs, v1 Exits).
    loop: the While op, or the v1 WhileContext (one rebuild per loop).
    counter: (final, start) tensors of the loop's iteration counter.
    """

    @property
    def name(self):
        """The loop's name (the While op's, or the v1 frame's)."""
        return self.loop.name


def find(op, index, loss, loss_ancestors, registry=None, batch_size=None):
    """`(LoopUse, None)` when every use of `op.inputs[index]` in the loop
    body is a tap that keeps examples apart to the loss, else
    `(None, reason)`. `op`: a v2 While, or the Enter of a v1 frame."""
    if op.type in ("Enter", "RefEnter"):
        return _find_v1(op, loss, loss_ancestors)
    if op.type not in LOOP_TYPES:
        return None, "not a while loop"
    try:
        body = recompute._func_graph(op, "body")  # pylint: disable=protected-access
    except recompute.Refused as e:
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
    live = recompute._ancestors_in([body.outputs[k] for k in used])  # pylint: disable=protected-access

    def coupling(z):
        return _coupling(op, body, z, live, loss, loss_ancestors)
    outputs = tuple(op.outputs[k] for k in used)
    return _use(op, index, op.name, live, body.inputs[index], coupling,
                outputs, op, (op.outputs[0], op.inputs[0]))


def in_v1_loop(op):
    """Whether `op` is inside a v1 while frame."""
    ctxt = _tf_compat.control_flow_context(op)
    while ctxt is not None:
        if hasattr(ctxt, "loop_exits"):
            return True
        ctxt = ctxt.outer_context
    return False


def _find_v1(enter, loss, loss_ancestors):
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
    live = set(o for o in recompute._frame_ops(ctxt, enter.graph)  # pylint: disable=protected-access
               if o in loss_ancestors)

    def coupling(z):
        return separability.coupling(z, 0, loss, loss_ancestors)
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
                tuple(outputs), ctxt, counter)


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


def _use(op, index, name, live, entry, coupling, outputs, loop, counter):
    """The LoopUse of x entering at `entry` (a body tensor), or the reason
    the loop rules cannot read it."""
    for c in live:
        if c.type in recompute.RANDOM or (
                _stateful(c) and c.type not in _STATEFUL_OK):
            # The rebuilt loop would draw new numbers (or act twice).
            return None, separability.Reason(
                "op '%s' (type %s) inside loop '%s' %s, and the loop rules "
                "run the loop once more" % (
                    c.name, c.type, name, "draws random numbers"
                    if c.type in recompute.RANDOM else "has side effects"), c)
    taps, value = [], None
    for t, slot in _values(entry, live):
        value = t if slot is None else t.op.inputs[0]
        for c in t.consumers():
            if c not in live:
                continue
            kind, why = _tap_kind(c, t, slot)
            if kind == "read":
                continue
            if kind is None:
                return None, separability.Reason(
                    "op '%s' (type %s) uses x inside loop '%s' in a way the "
                    "loop rules do not handle (%s)" % (
                        c.name, c.type, name, why), c)
            taps.append(Tap(c, kind, slot))
    if not taps:
        return None, "x reaches the loss through no op of loop '%s'" % name
    for tap in taps:
        why = coupling(tap.op.outputs[0])
        if why:
            return None, separability.Reason(
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


def _tap_kind(c, t, slot):
    """("matmul" | "bias", None) for an op a tap can read, or (None, why)."""
    if c.type in _READS or (c.type == "Unpack" and slot is None):
        return "read", None
    out = c.outputs[0]
    if out.shape.rank != 2 or tf.compat.dimension_value(out.shape[1]) is None:
        return None, "its output is not [B, N] with N known"
    if c.type == "MatMul":
        if c.inputs[1] is not t or c.inputs[0] is t or \
                c.get_attr("transpose_a") or c.get_attr("transpose_b"):
            return None, "x is not the right operand of a plain a x w"
        if c.inputs[0].shape.rank != 2 or tf.compat.dimension_value(
                c.inputs[0].shape[1]) is None:
            return None, "the activation is not [B, K] with K known"
        return "matmul", None
    if c.type in ("BiasAdd", "AddV2", "Add"):
        k = list(c.inputs).index(t)
        if c.type == "BiasAdd" and k != 1:
            return None, "x is the value, not the bias"
        other = c.inputs[1 - k]
        if t.shape.rank != 1 or other.shape.rank != 2 or other is t:
            return None, "not a [B, N] + [N] bias"
        return "bias", None
    return None, "no loop rule for op type %s" % c.type


def _coupling(op, body, start, live, loss, loss_ancestors):
    """None if row b of `start` (a body tensor, batch on axis 0) reaches
    only loss[b]: through the body, the next iterations and out of the
    loop; else a reason."""
    reached, why = separability.walk_body(body, [(start, 0)], live)
    if why:
        return why
    for k, axes in sorted(reached.items()):
        for axis in axes:
            why = separability.coupling(op.outputs[k], axis, loss,
                                        loss_ancestors)
            if why:
                return why
    return None


# --------------------------------------------------------------------------
# Building


class _Hook(object):
    """Taps one rebuilt While body (see `recompute.whole_batch`)."""

    def __init__(self, taps, steps, batch, v1=False):
        self.v1 = v1
        self.taps = list(taps)
        self.ops = {tap.op: i for i, tap in enumerate(self.taps)}
        self.eps = []
        for tap in self.taps:
            dtype = tap.op.outputs[0].dtype
            self.eps.append(tf.zeros(tf.stack([steps, batch, tap.width]),
                                     dtype))
        self._lists = [] if v1 else [tf.raw_ops.TensorListFromTensor(
            tensor=e, element_shape=tf.constant([-1, e.shape[2]], tf.int32))
            for e in self.eps]
        self.activations = {}
        self.fired = set()      # the taps the rebuilt body copied

    def _matmuls(self):
        return [i for i, tap in enumerate(self.taps) if tap.kind == "matmul"]

    def initial(self):
        """Extra loop variables: the step, one list of a_t per MatMul tap
        (in a v1 loop, a TensorArray's flow: a v1 gradient makes zeros for
        every exit, which a variant list cannot have)."""
        out = [tf.constant(0, tf.int32)]
        self._arrays = {}
        for i in self._matmuls():
            a = self.taps[i].op.inputs[0]
            width = tf.compat.dimension_value(a.shape[1])
            if self.v1:
                ta = tf.TensorArray(a.dtype, size=0, dynamic_size=True,
                                    element_shape=tf.TensorShape([None,
                                                                  width]))
                self._arrays[i] = ta
                out.append(ta.flow)
            else:
                out.append(tf.raw_ops.EmptyTensorList(
                    element_shape=tf.constant([-1, width], tf.int32),
                    max_num_elements=-1, element_dtype=a.dtype))
        return out

    def _array(self, i, flow):
        ta = self._arrays[i]
        return tf.TensorArray(ta.dtype, handle=ta.handle, flow=flow)

    def invariant(self, t):
        del t
        return tf.TensorShape([])     # a scalar step, or a TensorList

    def enter(self, values):
        self.step = values[0]
        self.lists = dict(zip(self._matmuls(), values[1:]))

    def tap(self, op, outs, mapping):
        i = self.ops[op]
        self.fired.add(i)
        tap = self.taps[i]
        width = tap.width
        if self.v1:
            # A v1 loop accumulates a captured tensor's gradient (here
            # IndexedSlices) itself; a variant list's it does not.
            item = tf.gather(self.eps[i], self.step)
        else:
            item = tf.raw_ops.TensorListGetItem(
                input_handle=self._lists[i], index=self.step,
                element_shape=tf.constant([-1, width], tf.int32),
                element_dtype=self.eps[i].dtype)
        if tap.kind == "matmul":
            a = recompute._input(op.inputs[0], mapping)  # pylint: disable=protected-access
            if self.v1:
                self.lists[i] = self._array(i, self.lists[i]).write(
                    self.step, a).flow
            else:
                self.lists[i] = tf.raw_ops.TensorListPushBack(
                    input_handle=self.lists[i], tensor=a)
        # eps has the loss's B rows: a tapped output with other rows (one
        # row broadcast later) would make them up; fail instead.
        check = tf.debugging.assert_equal(
            tf.shape(outs[0])[0], tf.shape(item)[0],
            message="custagg: a loop rule's op '%s' has other rows than the "
                    "batch's examples; use strategy='pfor'" % op.name)
        with tf.control_dependencies([check]):
            return [outs[0] + item] + list(outs[1:])

    def leave(self):
        return [self.step + 1] + [self.lists[i] for i in self._matmuls()]

    def done(self, values):
        for i, lst in zip(self._matmuls(), values[1:]):
            a = self.taps[i].op.inputs[0]
            if self.v1:
                stacked = self._array(i, lst).stack()
                stacked.set_shape([None, None, a.shape[1]])
                self.activations[i] = stacked
                continue
            self.activations[i] = tf.raw_ops.TensorListStack(
                input_handle=lst, element_shape=tf.constant(
                    [-1, tf.compat.dimension_value(a.shape[1])], tf.int32),
                element_dtype=a.dtype)


def cotangent_targets(uses):
    """The loop outputs whose gradients `build` needs, in a fixed order."""
    out = []
    for use in uses:
        for t in use.outputs:
            if not any(t is o for o in out):
                out.append(t)
    return out


def build(uses, cotangent_of, batch):
    """The Outer of each use: `{(use.op, use.index): Outer}`.

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
    with recompute.whole_batch({loop: hook}):
        if v2:
            new = recompute._rebuild_while(loop, {}, [  # pylint: disable=protected-access
                t.value_index for t in outputs])
            ys = [new[t.value_index] for t in outputs]
        else:
            mapping = {}
            exits = {e.ref() for e in loop.loop_exits}
            recompute._rebuild_v1_while(loop, mapping, {  # pylint: disable=protected-access
                t.ref() if t.ref() in exits else t.op.inputs[2].ref()
                for t in outputs})
            ys = [_remap(t, mapping, {}) for t in outputs]
    seeds = [cotangent_of[t.ref()] for t in outputs]
    dz = tf.compat.v1.gradients(
        ys, hook.eps, grad_ys=seeds,
        unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return {(use.op, use.index): _outer_of(use, hook, dz) for use in group}


def _remap(t, mapping, memo):
    """`t` as computed from the tensors in `mapping` (ref -> replacement):
    the ops between them and `t` copied, the others kept."""
    if t.ref() in mapping:
        return mapping[t.ref()]
    if t.op in memo:
        return t
    new = [_remap(i, mapping, memo) for i in t.op.inputs]
    if all(n is i for n, i in zip(new, t.op.inputs)):
        memo[t.op] = True       # does not depend on the rebuilt loop
        return t
    outs = recompute._copy_op(t.op, {  # pylint: disable=protected-access
        i.ref(): n for i, n in zip(t.op.inputs, new)})
    for old, out in zip(t.op.outputs, outs):
        mapping[old.ref()] = out
    return mapping[t.ref()]


def _outer_of(use, hook, dz):
    """One Outer for all taps of `use`: the taps' (a, g) pairs side by side
    along T (G_b is the sum over taps and iterations)."""
    shape = _outer.static_dims(use.value)
    a_parts, g_parts = [], []
    for tap in use.taps:
        i = hook.taps.index(tap)
        if i not in hook.fired:
            # find() took only ops on a path to the loss: a tap the rebuilt
            # body did not copy is a bug, never a zero to return.
            raise ValueError(
                "custagg: the loop rules did not find op '%s' in the rebuilt "
                "loop '%s'; use strategy='pfor' for this variable and "
                "report this graph." % (tap.op.name, use.name))
        g = tf.transpose(tf.convert_to_tensor(dz[i]), [1, 0, 2])  # [B, T, N]
        if tap.kind == "matmul":
            a = tf.transpose(hook.activations[i], [1, 0, 2])       # [B, T, K]
        else:
            a = tf.ones(tf.concat([tf.shape(g)[:2], [1]], 0), g.dtype)
        if tap.slot is not None:
            j, n = tap.slot
            width = tf.compat.dimension_value(a.shape[2])
            a = tf.pad(a, [[0, 0], [0, 0], [j * width, (n - j - 1) * width]])
        a_parts.append(a)
        g_parts.append(g)
    d_dims, k_dims = shape[:-1], shape[-1:]
    a = a_parts[0] if len(a_parts) == 1 else tf.concat(a_parts, axis=1)
    g = g_parts[0] if len(g_parts) == 1 else tf.concat(g_parts, axis=1)
    outer = _outer.Outer(a, g, _outer.layout(d_dims or [], k_dims, None))
    outer._choose_at_run_time = True  # pylint: disable=protected-access
    return outer


class LoopRule(registry_lib.Rule):
    """The rule of a loop use: every reduction from its Outer (`ctx.cache`)."""

    def per_example(self, ctx):
        return ctx.cache["outer"].per_example()

    def outer(self, ctx):
        return ctx.cache["outer"]

    def squared_norms(self, ctx):
        return ctx.cache["outer"].squared_norms()

    def group_squared_norms(self, ctx, num_groups):
        return ctx.cache["outer"].grouped(num_groups).squared_norms()

    def weighted_sum(self, ctx, weights):
        return ctx.cache["outer"].weighted_sum(weights)

    def squared_sum(self, ctx):
        return ctx.cache["outer"].squared_sum()


class LoopContext(registry_lib.RuleContext):
    """A RuleContext whose parameter is x's value inside the body."""

    @property
    def param(self):
        return self.cache["param"]


RULE = LoopRule()
