"""Rebuilding a loop on the whole batch, tapped for the loop rules.

TF's gradient of a loop sums `a_t^T dz_t` over the batch inside its gradient
loop, where nothing can reach it. So each loop with taps (`loop_taps`) is
rebuilt once on the whole batch (`graph.copier`'s `Copier`, the batch kept
whole) by a `Hook` that taps the copied body: each tap's output gets a
perturbation `eps_t` whose gradient is `dz_t`, and the tap's other inputs are
pushed to an extra TensorList (`[T, R, ...]` after the loop).

Where `dz` comes from (issue 26):

* `rebuild_once` (v2 loops, `loop_rules.one_pass`): `eps` is an empty
  TensorList carried through the loop; the tap's output goes through
  `IdentityN(z_t, eps)`, whose gradient (`_eps_tap_grad`) passes dz_t on
  and pushes it onto eps's gradient (no zeros read and added per step, no
  step index kept for the backward loop, and T is not needed before the
  loop runs, whatever its condition reads); the ops between the loops and
  the loss are copied onto the rebuilt loops' outputs, and the rules' one
  backward pass (`shared_pass.SharedPass`) differentiates that recomputed
  loss to the taps' lists and to the rule ops' outputs (their copies after
  the loops). The original loop then never runs unless the user fetches
  the loss: one forward and one backward pass of the loop.
* `tapped_dz` (the fallback: v1 frames, stateful ops or random ops
  drawing by more than shapes after the loop): one backward pass of the
  rebuilt loop seeded with the loss's gradient at the original loop's
  outputs (from the rules' shared backward pass): the loop runs twice. A
  v1 frame's eps is `[T, B, ...]` zeros (T from the original loop's
  counter), row t added at step t.
"""

from __future__ import annotations

import collections

import tensorflow as tf

from custagg import op_kinds
from custagg.graph import copier
from custagg.per_example.forms import loop_taps


def _element_shape(t):
    """A TensorList element shape for `t`'s rows: `[-1, *rest]` with -1
    where a dim is unknown."""
    return tf.constant([-1] + [-1 if d is None else d
                               for d in t.shape.as_list()[1:]], tf.int32)


# The integer dtype of each floating dtype's size: pushed rows are kept in
# their lists as these bits (`_as_bits`).
_BITS = {tf.float16: tf.int16, tf.bfloat16: tf.int16, tf.float32: tf.int32,
         tf.float64: tf.int64, tf.complex64: tf.int64}


def _as_bits(dtype):
    """The dtype a tap's pushed rows of `dtype` are listed as: the integer
    of its size, so the list is an untrainable accumulator (while_v2 passes
    no gradient into it). A float list is trainable: the backward pass
    makes a `[T, B, ...]` list of zeros for it, and its gradient loop pops
    a zero row per step and adds it to the row's gradient (GRU B=512: 1.1 ms
    of ZerosLike alone in a 30 ms step). `tf.bitcast` shares the buffer."""
    return _BITS.get(dtype.base_dtype, dtype)


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
    summed = summed or user.type in op_kinds.ADDS
    if summed and not tap.others:
        # A sum's dz is an addend's only if the addend has the sum's rows:
        # so for taps whose pushed inputs' rows are checked to be the
        # batch's after the loop (`_tap_result`), not others.
        return None
    j = tap_of_op[user]
    other = taps[j]
    positions = [k for k, i in enumerate(other.op.inputs) if i is t]
    passes = other.rule.passes_gradient_to
    if other.op.type in op_kinds.ADDS and len(positions) == 1 and \
            loop_taps.full_addend(t, other.op.outputs[0]):
        # A bias added to the full-shape value (hand-written cells'
        # `x W + b`): the value's gradient is the sum's.
        passes = positions
    if positions and all(k in passes and k != other.index
                         for k in positions):
        return j
    return None


_EPS_TAP = "CustaggLoopEpsTap"


def _eps_tap_grad(op, dz, dlist):
    """The gradient of `IdentityN(z, eps)` (a lazy tap; eps an empty
    TensorList carried through the loop and through this IdentityN): dz
    for z, and for the list the gradient list of the later steps with dz
    pushed onto it. The backward loop runs the steps last to first, so the
    list ends with step 0's dz (`stacked_dz` reads it back in step order).
    Nothing of the forward step is read: while_v2 pushes and pops no step
    index or list for this gradient."""
    del op
    if dlist is None:
        raise ValueError("custagg: no gradient reached a loop rule's eps "
                         "list; use strategy='pfor' and report this graph.")
    dz = tf.convert_to_tensor(dz)
    return [dz, tf.raw_ops.TensorListPushBack(input_handle=dlist, tensor=dz)]


try:
    tf.RegisterGradient(_EPS_TAP)(_eps_tap_grad)
except KeyError:        # registered already: this module imported again
    pass


class Hook(object):
    """Taps one rebuilt While body (`Copier.hooks`): passes each eps
    owner's output through its eps list (whose gradient gets dz_t) and
    pushes the taps' other inputs."""

    def __init__(self, taps, steps=None, batch=None):
        """`batch` None: a v2 loop (the one-pass build `OnePass`, and
        `tapped_dz`): the eps lists start empty and the backward pass fills
        them, so neither the iteration count nor B is read before the loop
        runs (B from the loss would run the original loop), and the loop
        carries no step (while_v2 pushed it at every step for the backward
        loop to pop) and no row counts. Else a v1 frame: `[steps, batch,
        ...]` zeros, row t read at step t."""
        self.lazy = batch is None
        self.batch = batch
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
        # One extra loop variable per (tap, other input): the pushed rows.
        # (One list for all of them, or one eps list for all owners, would
        # hold every item until the last is read out after the loop: the
        # GRU's peak grew by a third.)
        self.pushed = [(i, k) for i, tap in enumerate(self.taps)
                       for k in tap.others]
        if self.lazy:
            self.eps = [tf.raw_ops.EmptyTensorList(
                element_shape=_element_shape(self.taps[i].op.outputs[0]),
                max_num_elements=-1,
                element_dtype=self.taps[i].op.outputs[0].dtype)
                for i in self.owners]
        else:
            # At least one row: a v1 gradient of reads from an empty eps
            # fails (its IndexedSlices accumulator starts at row 0). With
            # no step the one row's dz is zero, and the pushed inputs get
            # one row of zeros too (`done`).
            self.eps = [tf.zeros(tf.stack([tf.maximum(steps, 1), batch] +
                                          self.taps[i].rest),
                                 self.taps[i].op.outputs[0].dtype)
                        for i in self.owners]
        self.inputs = {}        # (tap, input) -> [T, B, ...]
        self.fired = set()      # the taps the rebuilt body copied

    def initial(self):
        """Extra loop variables. Lazy: the eps lists, then one list per
        pushed input. A v1 frame: the step, then one TensorArray's flow per
        pushed input (a v1 gradient makes zeros for every exit, which a
        variant list cannot have)."""
        if self.lazy:
            return list(self.eps) + [tf.raw_ops.EmptyTensorList(
                element_shape=_element_shape(self.taps[i].op.inputs[k]),
                max_num_elements=-1,
                element_dtype=_as_bits(self.taps[i].op.inputs[k].dtype))
                for i, k in self.pushed]
        out = [tf.constant(0, tf.int32)]
        self._arrays = {}
        for i, k in self.pushed:
            t = self.taps[i].op.inputs[k]
            ta = tf.TensorArray(
                t.dtype, size=0, dynamic_size=True,
                element_shape=tf.TensorShape([None]).concatenate(
                    t.shape[1:]))
            self._arrays[(i, k)] = ta
            out.append(ta.flow)
        return out

    def _array(self, key, flow):
        ta = self._arrays[key]
        return tf.TensorArray(ta.dtype, handle=ta.handle, flow=flow)

    def invariant(self, t):
        del t
        return tf.TensorShape([])     # a scalar step, or a TensorList

    def enter(self, values):
        if self.lazy:
            self.carried = list(values[:len(self.eps)])
            values = values[len(self.eps):]
        else:
            self.step, values = values[0], values[1:]
        self.lists = dict(zip(self.pushed, values))

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
            if not self.lazy:
                self.lists[(i, k)] = self._array(
                    (i, k), self.lists[(i, k)]).write(self.step, a).flow
                continue
            bits = _as_bits(a.dtype)
            self.lists[(i, k)] = tf.raw_ops.TensorListPushBack(
                input_handle=self.lists[(i, k)],
                tensor=a if bits == a.dtype else tf.bitcast(a, bits))
        if i not in self.owners:
            # Its dz is read at the tap it feeds (`slot`): no eps of its
            # own, nothing read.
            return list(outs)
        if self.lazy:
            # The output as it is, through an IdentityN that also passes
            # the eps list on: its gradient passes dz on and pushes it
            # onto the list's gradient (`_eps_tap_grad`). `z + eps[t]`
            # read and added zeros of z's shape at every step (issue 26),
            # and setting item t needed t in the backward loop (pushed at
            # every step forward, popped backward).
            with tf.compat.v1.get_default_graph().gradient_override_map(
                    {"IdentityN": _EPS_TAP}):
                tapped, self.carried[s] = tf.raw_ops.IdentityN(
                    input=[outs[0], self.carried[s]])
            return [tapped] + list(outs[1:])
        # A v1 loop accumulates a captured tensor's gradient (here
        # IndexedSlices) itself.
        item = tf.gather(self.eps[s], self.step)
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
        extra = self.carried if self.lazy else [self.step + 1]
        return extra + [self.lists[key] for key in self.pushed]

    def done(self, values):
        lists = values[len(self.eps) if self.lazy else 1:]
        if self.lazy:
            # Stacked by `stacked_dz`, which knows B for a loop that ran no
            # step (an empty list has no rows to read).
            self.pushed_lists = dict(zip(self.pushed, lists))
            return
        for key, lst in zip(self.pushed, lists):
            t = self.taps[key[0]].op.inputs[key[1]]
            array = self._array(key, lst)
            rest = t.shape[1:]
            if rest.is_fully_defined():
                # A frame that ran no step: a zero-size TensorArray stacks
                # only with a static element shape; one row of zeros with
                # B rows, as eps has (`__init__`).
                stacked = tf.cond(
                    array.size() > 0, array.stack, lambda: tf.zeros(
                        tf.stack([1, self.batch] + rest.as_list()), t.dtype))
            else:
                stacked = array.stack()
            stacked.set_shape(tf.TensorShape([None, None]).concatenate(
                t.shape[1:]))
            self.inputs[key] = stacked


def _draws_by_shapes(op, below):
    """Whether random op `op`'s inputs depend on the ops `below` the loops
    only through the shapes of their outputs (`op_kinds.SHAPE_ONLY`), along
    ops that rerun the same: the copy's inputs then equal the original's, so
    the copy may be the original op itself (its draw). Tensors made outside
    `below` are the copy's own inputs anyway."""
    seen, stack = set(), list(op.inputs)
    while stack:
        t = stack.pop()
        src = t.op
        if src in seen or src not in below or src.type in op_kinds.SHAPE_ONLY:
            continue
        seen.add(src)
        if src.type in op_kinds.V2_LOOPS or \
                src.type in op_kinds.FUNCTION_OPS or \
                loop_taps.reruns_differently(src):
            return False
        stack.extend(src.inputs)
    return True


def rebuild_once(uses, loss):
    """`((loss, mapping, hooks, by_loop), None)` (what `loop_rules.OnePass`
    holds), or `(None, reason)` when the loops of `uses` are read the way of
    `tapped_dz` instead (their original loops run, and the
    rebuilt ones once more): a v1 frame, a loop the copier cannot copy;
    between the loops and the loss an op
    that has side effects or draws random numbers from more than shapes
    (its copy would draw or act again), another loop, a cond or a function
    call. A random op drawing by shapes only (dropout after an RNN,
    `_draws_by_shapes`) is not copied: the copy reads its draw, and the
    original loops run forward for the shapes it reads."""
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
    # Random ops after the loops that draw by shapes only (dropout's mask
    # on `tf.shape(rnn_out)`): the copy reads the original op's draw, the
    # mask the loss itself uses, so the values stay exact.
    reused = set()
    for op in below:
        if op in by_loop or op.type in op_kinds.CHECKS:
            continue    # a check acts only by failing, as the original would
        if op.type in op_kinds.RANDOM and _draws_by_shapes(op, below):
            reused.add(op)
            continue
        # Not copied after a loop: another loop, a cond or a function call
        # (their copies would need their own rebuild), an op whose second
        # run would not repeat the first.
        if op.type in op_kinds.V2_LOOPS or op.type in op_kinds.FUNCTION_OPS \
                or loop_taps.reruns_differently(op):
            return None, ("op '%s' (type %s) between a loop and the loss "
                          "would run again in a copy" % (op.name, op.type))
    for loop in by_loop:
        # Only whether the copier can read the loop (its functions, its own
        # loop variables), before any op is made: the rebuild below reads
        # the same and would raise where this returns the fallback's reason.
        try:
            copier.live_loop_variables(loop, [0])
        except copier.CannotCopy as e:
            return None, str(e)
    mapping, hooks = {}, {}
    copies = copier.Copier(one_row=False, checks=True)
    with tf.name_scope("loop_rules_one_pass"):
        for op in graph.get_operations():
            if op not in ancestors:
                continue
            if op in by_loop:
                taps = [tap for use in by_loop[op] for tap in use.taps]
                hooks[op] = copies.hooks[op] = Hook(taps)
                used = [k for k, o in enumerate(op.outputs)
                        if any(c in ancestors for c in o.consumers())]
                outs = copies.rebuild_while(op, mapping, used)
            elif op in reused:
                outs = list(op.outputs)
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
    return (new_loss, mapping, hooks, by_loop), None


def tapped_dz(loop, group, cotangent_of, batch):
    """`(Hook, dz)` for the uses `group` of one loop (a While op or a v1
    context): the loop rebuilt and tapped, and one backward pass of it
    seeded with `cotangent_of` (see `loop_rules.build`) to the taps' eps,
    aligned with `Hook.eps`."""
    taps = [tap for use in group for tap in use.taps]
    v2 = isinstance(loop, tf.Operation)
    if v2:
        # Lazy eps lists (filled by the backward pass: `stacked_dz`).
        hook = Hook(taps)
    else:
        # `[T, B, ...]` zeros, T the iterations the original loop ran.
        final, start = group[0].counter
        hook = Hook(taps, final - start, batch)
    outputs = [t for t in loop_taps.cotangent_targets(group)
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
    if not v2:
        grads = tf.compat.v1.gradients(
            ys, hook.eps, grad_ys=seeds,
            unconnected_gradients=tf.UnconnectedGradients.ZERO)
        # Dense by eps's own rows: the frame's accumulated dense_shape is
        # the accumulator's start (zeros) when no step ran.
        return hook, [tf.math.unsorted_segment_sum(
            g.values, g.indices, tf.shape(e)[0])
            if isinstance(g, tf.IndexedSlices) else g
            for g, e in zip(grads, hook.eps)]
    return hook, stacked_dz(hook, tf.compat.v1.gradients(
        ys, hook.eps, grad_ys=seeds), batch)


def _read(lst, like, dtype, batch, reverse=False):
    """`[T, R, ...]`: the items of list `lst` of rows like `like`'s (last
    first where `reverse`); a list the loop left empty (no step ran) as
    `[0, B, ...]`, the rows its items would have had unknowable, B's
    harmless: every sum over its steps is empty."""
    n = tf.raw_ops.TensorListLength(input_handle=lst)
    shape = _element_shape(like)
    shape = tf.concat([[tf.where(n > 0, -1, tf.cast(batch, tf.int32))],
                       shape[1:]], 0)
    at = tf.range(n - 1, -1, -1) if reverse else tf.range(n)
    return tf.raw_ops.TensorListGather(
        input_handle=lst, indices=at, element_shape=shape,
        element_dtype=dtype)


def stacked_dz(hook, grads, batch):
    """dz `[T, R, ...]` per eps list of a lazy `hook` (`Hook.eps`), from
    the gradients at those lists (aligned with them; a variant list or
    None); also stacks the pushed inputs into `Hook.inputs`. The backward
    loop pushed dz step by step from the last: read back last item first.
    R is the rows of the tap's output in the rebuilt loop: B, or B*T where
    the loop runs on a fold of the batch. `batch`: B (int or scalar
    tensor), the rows of a loop that ran no step."""
    for key, lst in hook.pushed_lists.items():
        t = hook.taps[key[0]].op.inputs[key[1]]
        bits = _as_bits(t.dtype)
        stacked = _read(lst, t, bits, batch)
        if bits != t.dtype:
            stacked = tf.bitcast(stacked, t.dtype.base_dtype)
        stacked.set_shape(tf.TensorShape([None, None]).concatenate(
            t.shape[1:]))
        hook.inputs[key] = stacked
    dz = []
    for s, g in enumerate(grads):
        tap = hook.taps[hook.owners[s]]
        dtype = tap.op.outputs[0].dtype
        if g is None:
            # No gradient reached the list: every dz is zero. The steps and
            # rows from an input the tap (or one sharing its dz) pushed.
            pushed = [hook.inputs[key] for key in hook.pushed
                      if hook.slot[key[0]] == s]
            if not pushed:
                raise ValueError(
                    "custagg: no gradient reached the loop rule's op '%s'; "
                    "use strategy='pfor' and report this graph."
                    % tap.op.name)
            d = tf.zeros(tf.concat([tf.shape(pushed[0])[:2],
                                    tf.constant(tap.rest, tf.int32)], 0),
                         dtype)
        else:
            d = _read(g, tap.op.outputs[0], dtype, batch, reverse=True)
        d.set_shape(tf.TensorShape([None, None]).concatenate(tap.rest))
        dz.append(d)
    return dz


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
