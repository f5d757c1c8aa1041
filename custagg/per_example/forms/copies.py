"""The "recompute" forms: each example's forward pass, copied and vectorized.

For an x no rule covers (an RNN cell's weight inside a `while_loop`, an op
only TF knows), the per-example gradient of example i is the gradient of a
copy of the forward pass run on example i alone:

    g_i = d/dx  loss'(inputs[i:i+1])

where `loss'` is the forward subgraph between the batch inputs (the
sources `custagg.batch_axis.infer` finds backward from the loss) and the
loss, re-created op by op with those inputs replaced by one example's rows.
Ops that do not depend on batch data (variable reads, constants) are not
copied: the copy reads the same variables, so gradients reach x. Each
example costs one forward and one backward pass of one example, so the
whole batch costs O(B) passes, not the O(B^2) of seeding the batch's
backward pass with `one_hot(i)`.

Two forms vectorize the copies:

* "recompute": `pfor` over chunks of examples (`graph.pfor.chunked_pfor`),
  what `tf.vectorized_map(grad)` does for code that is still at hand;
* "recompute-loop": a `tf.while_loop` over the examples (one copy per
  iteration; dynamic B works), for graphs pfor cannot convert.

The copying itself is `custagg.graph.copier.Copier`'s (one per copy, no
state between copies). Copies follow v2 control flow (`While`/`If` ops:
their function bodies are shared, their gradients rebuilt from the function
definitions) and `tf.function` call sites (their gradient functions come
along). v1 loops (`Enter`/`Exit` frames, `disable_v2_behavior`) are rebuilt
as new `tf.while_loop`s whose bodies copy the frame's ops.

The copy is exact only if examples do not interact between the inputs and
the loss. `analyze` refuses graphs where a known op mixes examples (batch
statistics, a mean over the batch) or draws random numbers (a copy would
draw new ones), and every run checks that the copies' losses equal the
batch's loss, so an interaction no analysis saw fails loudly instead of
giving wrong gradients.
"""

from __future__ import annotations

import collections
import itertools

import tensorflow as tf

from custagg import _tf_compat
from custagg import graph as graph_lib
from custagg import op_kinds
from custagg.batch_axis import rowwise
from custagg.batch_axis import separation
from custagg.batch_axis import sources
from custagg.batch_axis import table
from custagg.graph import copier
from custagg.graph import functions
from custagg.graph import pfor as pfor_lib
from custagg.graph.copier import CannotCopy
from custagg._tf_compat import indexed_slices as indexed_slices_lib
from custagg._tf_compat import pfor_ops


class Forward(collections.namedtuple("Forward", ["inputs", "ops", "loss",
                                                 "static_b", "unproven"])):
    """The forward pass to copy: batch `inputs`, the `ops` between them and
    the `loss` (creation order), the static batch size (or None), and why
    the examples are not proved apart (`custagg.batch_axis.rowwise`; None
    when they are, and the copies then run without the run-time check)."""

    @property
    def op_set(self):
        return frozenset(self.ops)


def _leading_is_batch(t, static_b):
    if t.shape.rank is None or t.shape.rank == 0:
        return False
    lead = tf.compat.dimension_value(t.shape[0])
    return lead is None or static_b is None or lead == static_b


def batch_inputs(loss, loss_ancestors=None, static_b=None, batch_axes=None):
    """The batch sources feeding the loss (`custagg.batch_axis.infer`):
    the tensors the copies take one example's rows of.

    Args:
      loss: the per-example loss `[B]`.
      loss_ancestors: unused (kept for callers); the walk starts at loss.
      static_b: unused (kept for callers).
      batch_axes: `batch_axis.infer(loss)` (computed if None).

    Raises:
      CannotCopy: none found, or a source holding the batch on another axis
        than 0 (the copies take rows of axis 0).
    """
    del loss_ancestors, static_b
    found = batch_axes if batch_axes is not None else sources.infer(loss)
    for t, desc in found.sources:
        if desc != 0:
            raise CannotCopy(
                "batch source '%s' (op type %s) holds the examples on axis "
                "%s, and the per-example copies take rows of axis 0; "
                "transpose it to batch-major before the model"
                % (t.name, t.op.type, desc), t.op)
    if not found.sources:
        raise CannotCopy(sources.no_sources_reason(found) +
                      ", so there is no example to recompute")
    return [t for t, _ in found.sources]


def _region(inputs, loss_ancestors):
    """Ops on a path from the batch inputs to the loss, in creation order."""
    region = graph_lib.downstream(inputs, within=loss_ancestors)
    return graph_lib.in_creation_order(region, next(iter(inputs)).graph)


def _check_examples_apart(inputs, ops, loss, loss_ancestors, static_b):
    """Raises `CannotCopy` where a known op mixes examples; ops the analysis
    does not know (loops, calls) are assumed to keep the batch on axis 0 of
    their batch-shaped outputs, which the run-time check confirms."""
    live = graph_lib.gradient_paths(loss, loss_ancestors)
    in_region = set(ops)
    seen = set()
    queue = collections.deque((t, 0) for t in inputs)
    while queue:
        t, axis = queue.popleft()
        if (t.ref(), axis) in seen:
            continue
        seen.add((t.ref(), axis))
        for op in t.consumers():
            if op not in in_region:
                continue
            # (Random ops: `analyze` refused them all before this walk.)
            outs = [o for o in op.outputs if o.ref() in live]
            if not table.known(op):
                for o in op.outputs:
                    if _leading_is_batch(o, static_b):
                        queue.append((o, 0))
                continue
            if not outs:
                continue
            nexts, reason = separation.step(op, t, axis, outs)
            if reason is not None:
                raise CannotCopy(
                    "%s, so one example's forward pass alone does not give "
                    "its loss" % reason, op)
            queue.extend(nexts)


def analyze(loss, loss_ancestors, static_b):
    """The forward pass to recompute: `Forward(inputs, ops, loss)`.

    Raises:
      CannotCopy: with the op and what to try.
    """
    found = sources.infer(loss)
    inputs = batch_inputs(loss, batch_axes=found)
    ops = _region(inputs, loss_ancestors)
    if loss.op not in ops:
        raise CannotCopy("the loss does not depend on the batch inputs")
    hidden = sources.untraced(found, set(ops) | {t.op for t in inputs})
    if hidden:
        # Rows no source explains: a copy would take them whole.
        raise CannotCopy("%s, so one example's forward pass alone cannot be "
                      "copied" % hidden[0], getattr(hidden[0], "op", None))
    for op in ops:
        ctxt = _tf_compat.control_flow_context(op)
        if ctxt is not None and copier.frame_of(ctxt, None) is None:
            raise CannotCopy(
                "op '%s' (type %s) is in a v1 tf.compat.v1.cond (Switch/"
                "Merge under disable_v2_behavior), which custagg does not "
                "copy; tf.compat.v1.enable_control_flow_v2() builds conds it "
                "can copy" % (op.name, op.type), op)
    for op in ops:
        # Anywhere in the copied ops, not only on the batch's path (a mask
        # drawn from tf.shape(x) is copied too, and draws anew), and inside
        # their loop bodies and branches (a DropoutWrapper in an RNN cell:
        # the copies' losses never matched the batch's, and every step ran
        # the copies and then the exact form).
        drawn = next((c for c in itertools.chain([op], functions.nested_ops(
            op)) if c.type in op_kinds.RANDOM), None)
        if drawn is not None:
            raise CannotCopy(
                "op '%s' (type %s) draws random numbers between the inputs "
                "and the loss%s, and a per-example copy would draw new ones; "
                "pass the random tensor in as a placeholder, or use "
                "strategy='loop'" % (
                    drawn.name, drawn.type, "" if drawn is op else
                    " (inside '%s')" % op.name), op)
    _check_examples_apart(inputs, ops, loss, loss_ancestors, static_b)
    if static_b is not None and static_b > 1:
        # A static batch is folded into constants (tensordot's reshape
        # target [B*T, D], space-to-batch paddings) that a copy of one
        # example's ops would keep: run-time shape errors or, worse, rows of
        # other examples. Refuse rather than guess; the planner falls back.
        raise CannotCopy(
            "the batch size is static (%d), so shapes built from it are "
            "constants the per-example copy cannot adjust; feed the batch "
            "through a placeholder of shape [None, ...] for the O(B) form"
            % static_b)
    try:
        unproven = None if static_b == 1 else rowwise.prove(inputs, ops,
                                                            loss)
    except rowwise.Unexplained as e:
        raise CannotCopy("%s; the copies would not be exact" % e) from e
    return Forward(inputs, ops, loss, static_b, unproven)


def batch_size(forward, default):
    """The batch size the copies run over: with the examples proved apart,
    the inputs' leading dimension (asserted equal across inputs), so the
    batch's own forward pass never runs; else `default` (the loss's)."""
    if forward.unproven is not None or isinstance(default, int):
        return default
    sizes = [tf.shape(t, out_type=tf.int32)[0] for t in forward.inputs]
    if len(sizes) == 1:
        return sizes[0]
    # The proof reads every input's leading axis as the batch; inputs fed
    # with other lengths fail here, not as an index out of range (or,
    # on a GPU, as rows of zeros) in a copy.
    checks = [tf.debugging.assert_equal(
        sizes[0], n, message="custagg: the batch inputs '%s' and '%s' have "
        "other leading dimensions; every input with a [None, ...] shape "
        "feeding the loss must hold one row per example"
        % (forward.inputs[0].name, t.name))
        for t, n in zip(forward.inputs[1:], sizes[1:])]
    with tf.control_dependencies(checks):
        return tf.identity(sizes[0])


def copy_forward(forward, rows):
    """Re-creates `forward.ops` on `rows` (a dict: input ref -> tensor) in the
    default graph, one example's copy (a `Copier` of its own); returns the
    copy of the loss."""
    mapping = dict(rows)
    copier.Copier(one_row=True).copy_ops(forward.ops, mapping,
                                         wanted={forward.loss.ref()})
    return mapping[forward.loss.ref()]


def _dense(g):
    if isinstance(g, indexed_slices_lib.IndexedSlices):
        return tf.convert_to_tensor(g)
    return g


def _one_example(forward, tensors, zeros, i, gradients):
    """[per-example gradient of each tensor..., the copy's loss (scalar)]."""
    index = tf.reshape(i, [1])
    rows = {t.ref(): tf.gather(t, index) for t in forward.inputs}
    copy = copy_forward(forward, rows)
    loss_i = tf.reshape(copy, [])
    grads = gradients(loss_i, tensors,
                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
    out = [_dense(g) if g is not None else z()
           for g, z in zip(grads, zeros)]
    return out + [loss_i]


def _checked(results, losses, forward, exact=None):
    """`results` once the copies' losses are seen to equal the batch's;
    `results` as they are where `forward` proves the examples apart.

    `exact`: None (a failed check raises InvalidArgumentError), or a
    callable building the exact form's results (a list aligned with
    `results`): a step whose check fails takes it under `tf.cond`, so the
    exact form runs only then."""
    if forward.unproven is None:
        return results
    loss = forward.loss
    dtype = loss.dtype
    tol = 1e-3 if dtype in (tf.float16, tf.bfloat16, tf.float32) else 1e-7
    scale = tf.reduce_max(tf.abs(loss)) + tf.ones([], dtype)
    gap = tf.reduce_max(tf.abs(tf.cast(losses, dtype) - loss))
    if exact is not None:
        # A NaN gap fails too: the exact form's value, never the copies'.
        out = tf.cond(gap <= tol * scale,
                      lambda: [tf.identity(r) for r in results],
                      lambda: [tf.cast(e, r.dtype)
                               for e, r in zip(exact(), results)],
                      name="copies_checked")
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        for o, r in zip(out, results):
            o.set_shape(r.shape)
        return out
    check = tf.debugging.Assert(
        gap <= tol * scale,
        ["custagg: the per-example recomputation of the forward pass gives "
         "other losses than the batch does (largest gap, scale):", gap, scale,
         "so examples interact somewhere between the inputs and the loss. "
         "Use strategy='pfor' on a graph where custagg can see the coupling, "
         "or strategy='loop'."])
    with tf.control_dependencies([check]):
        return [tf.identity(r) for r in results]


def per_example_pfor(forward, tensors, zeros, dtypes, batch, chunk,
                     gradients, exact=None):
    """`[B, *x.shape]` per tensor: pfor over per-example copies."""

    @tf.autograph.experimental.do_not_convert
    def loop_fn(i):
        return _one_example(forward, tensors, zeros, i, gradients)

    if has_v1_loops(forward):
        # The gradient of a v1 loop cannot be built inside another v1 loop
        # (the chunks' while loop): one pfor over the whole batch.
        out = pfor_ops.pfor(loop_fn, batch)
    else:
        out = pfor_lib.chunked_pfor(loop_fn, batch, chunk,
                                      list(dtypes) + [forward.loss.dtype])
    return _checked(out[:-1], out[-1], forward, exact)


def has_v1_loops(forward):
    """Whether the forward pass holds v1 control flow (Enter/Exit frames)."""
    return any(_tf_compat.control_flow_context(op) is not None
               for op in forward.ops)


def varying_loop(forward):
    """A v2 loop of the forward pass whose condition depends on the values
    of batch data (dynamic_rnn with `sequence_length` stops at the longest
    sequence), or None. pfor converts such a loop's copies when their shapes
    are static, and the converted loop then fails at run time reading its
    unstacked inputs ("Trying to access element 0 in a list with 0
    elements"), so these copies run in the while loop over examples.
    (Every copy sees the same shapes, one example's rows: what goes
    through ops that read only shapes, `op_kinds.SHAPE_ONLY`, makes no
    copy's loop run a different number of iterations.)"""
    valued = graph_lib.downstream(forward.inputs,
                                  stop_types=op_kinds.SHAPE_ONLY)
    inputs = {t.ref() for t in forward.inputs}
    for op in forward.ops:
        if op.type not in op_kinds.V2_LOOPS:
            continue
        try:
            body, cond = (copier.func_graph(op, "body"),
                          copier.func_graph(op, "cond"))
        except CannotCopy:
            return op
        if len(body.inputs) != len(op.inputs) or \
                len(cond.inputs) != len(op.inputs):
            return op
        dep = {k for k, t in enumerate(op.inputs)
               if t.op in valued or t.ref() in inputs}
        while True:
            more = {k for k, out in enumerate(body.outputs) if k not in dep
                    and any(body.inputs[j].op in graph_lib.upstream(
                        [out], stop_types=op_kinds.SHAPE_ONLY)
                            for j in dep)}
            if not more:
                break
            dep |= more
        needed = graph_lib.upstream([cond.outputs[0]],
                                    stop_types=op_kinds.SHAPE_ONLY)
        if any(cond.inputs[k].op in needed for k in dep):
            return op
    return None


def per_example_loop(forward, tensors, zeros, dtypes, shapes, batch,
                     gradients, exact=None):
    """`[B, *x.shape]` per tensor: a `tf.while_loop` over the examples."""
    batch = tf.convert_to_tensor(batch, tf.int32)
    arrays = [tf.TensorArray(d, size=batch, element_shape=s)
              for d, s in zip(list(dtypes) + [forward.loss.dtype],
                              list(shapes) + [tf.TensorShape([])])]

    def body(i, arrays):
        outs = _one_example(forward, tensors, zeros, i, gradients)
        return i + 1, [ta.write(i, tf.cast(o, ta.dtype))
                       for ta, o in zip(arrays, outs)]

    _, arrays = tf.while_loop(lambda i, _: i < batch, body,
                              [tf.constant(0), arrays],
                              parallel_iterations=1)
    out = [ta.stack() for ta in arrays]
    return _checked(out[:-1], out[-1], forward, exact)

