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

Copies follow v2 control flow (`While`/`If` ops: their function bodies are
shared, their gradients rebuilt from the function definitions) and
`tf.function` call sites (their gradient functions come along). v1 loops
(`Enter`/`Exit` frames, `disable_v2_behavior`) are rebuilt as new
`tf.while_loop`s whose bodies copy the frame's ops.

The copy is exact only if examples do not interact between the inputs and
the loss. `analyze` refuses graphs where a known op mixes examples (batch
statistics, a mean over the batch) or draws random numbers (a copy would
draw new ones), and every run checks that the copies' losses equal the
batch's loss, so an interaction no analysis saw fails loudly instead of
giving wrong gradients.
"""

from __future__ import annotations

import collections

import numpy as np
import tensorflow as tf

from custagg import _tf_compat
from custagg import graph as graph_lib
from custagg.graph import pfor as pfor_lib
from custagg.batch_axis import rowwise
from custagg.batch_axis import separation
from custagg.batch_axis import sources
from custagg.batch_axis import table
from custagg._tf_compat import indexed_slices as indexed_slices_lib
from custagg._tf_compat import pfor_ops  # noqa: F401  (documented above)

# Ops whose copy would draw new random numbers.
RANDOM = table.RANDOM

# Attrs a copy must not take: colocation with the original's neighbours.
_DROP_ATTRS = frozenset(["_class"])

# Copies run one example (TensorList element shapes get a batch of 1)
# unless `whole_batch()` is active: the loop rules rebuild a loop on the
# whole batch with this machinery.
_STATE = {"one_row": True}
# While op -> the hook that taps its rebuilt body (`loop_rules`): extra
# loop variables, and ops whose copies it replaces.
_HOOKS = {}
_ACTIVE = []        # the hooks of the bodies being copied, innermost last


class whole_batch(object):
    """Within it, copies keep the batch as it is (no one-row shapes) and
    the While ops in `hooks` (While op -> hook) are rebuilt with them."""

    def __init__(self, hooks):
        self.hooks = hooks
        self._saved = None

    def __enter__(self):
        # Restored, not reset, on exit: a whole-batch rebuild inside another
        # one (or inside a one-row copy) leaves the outer state as it was.
        self._saved = (_STATE["one_row"], {op: _HOOKS[op] for op in self.hooks
                                           if op in _HOOKS})
        _STATE["one_row"] = False
        _HOOKS.update(self.hooks)

    def __exit__(self, *exc):
        one_row, hooks = self._saved
        _STATE["one_row"] = one_row
        for op in self.hooks:
            _HOOKS.pop(op, None)
        _HOOKS.update(hooks)

class Forward(collections.namedtuple("Forward", ["inputs", "ops", "loss",
                                                 "static_b", "unproven"])):
    """The forward pass to copy: batch `inputs`, the `ops` between them and
    the `loss` (creation order), the static batch size (or None), and why
    the examples are not proved apart (`custagg.batch_axis.rowwise`; None when they
    are, and the copies then run without the run-time check)."""

    @property
    def op_set(self):
        return frozenset(self.ops)


class Refused(ValueError):
    """The forward pass cannot be recomputed per example; the message names
    the op and says what to try."""

    def __init__(self, message, op=None):
        super().__init__(message)
        self.op = op


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
      Refused: none found, or a source holding the batch on another axis
        than 0 (the copies take rows of axis 0).
    """
    del loss_ancestors, static_b
    found = batch_axes if batch_axes is not None else sources.infer(loss)
    for t, desc in found.sources:
        if desc != 0:
            raise Refused(
                "batch source '%s' (op type %s) holds the examples on axis "
                "%s, and the per-example copies take rows of axis 0; "
                "transpose it to batch-major before the model"
                % (t.name, t.op.type, desc), t.op)
    if not found.sources:
        raise Refused(sources.no_sources_reason(found) +
                      ", so there is no example to recompute")
    return [t for t, _ in found.sources]


def _region(inputs, loss_ancestors):
    """Ops on a path from the batch inputs to the loss, in creation order."""
    region = graph_lib.downstream(inputs, within=loss_ancestors)
    return graph_lib.in_creation_order(region, next(iter(inputs)).graph)


def _known(op):
    return table.known(op)


def _check_examples_apart(inputs, ops, loss, loss_ancestors, static_b):
    """Raises `Refused` where a known op mixes examples; ops the analysis
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
            if op.type in RANDOM:
                raise Refused(
                    "op '%s' (type %s) draws random numbers between the "
                    "inputs and the loss, and a per-example copy would draw "
                    "new ones; pass the random tensor in as a placeholder, "
                    "or use strategy='loop'" % (op.name, op.type), op)
            outs = [o for o in op.outputs if o.ref() in live]
            if not _known(op):
                for o in op.outputs:
                    if _leading_is_batch(o, static_b):
                        queue.append((o, 0))
                continue
            if not outs:
                continue
            nexts, reason = separation.step(op, t, axis, outs)
            if reason is not None:
                raise Refused(
                    "%s, so one example's forward pass alone does not give "
                    "its loss" % reason, op)
            queue.extend(nexts)


def analyze(loss, loss_ancestors, static_b):
    """The forward pass to recompute: `Forward(inputs, ops, loss)`.

    Raises:
      Refused: with the op and what to try.
    """
    found = sources.infer(loss)
    inputs = batch_inputs(loss, batch_axes=found)
    ops = _region(inputs, loss_ancestors)
    if loss.op not in ops:
        raise Refused("the loss does not depend on the batch inputs")
    hidden = sources.untraced(found, set(ops) | {t.op for t in inputs})
    if hidden:
        # Rows no source explains: a copy would take them whole.
        raise Refused("%s, so one example's forward pass alone cannot be "
                      "copied" % hidden[0], getattr(hidden[0], "op", None))
    for op in ops:
        ctxt = _tf_compat.control_flow_context(op)
        if ctxt is not None and _frame_of(ctxt, None) is None:
            raise Refused(
                "op '%s' (type %s) is in a v1 tf.compat.v1.cond (Switch/"
                "Merge under disable_v2_behavior), which custagg does not "
                "copy; tf.compat.v1.enable_control_flow_v2() builds conds it "
                "can copy" % (op.name, op.type), op)
    for op in ops:
        if op.type in RANDOM:
            # Anywhere in the copied ops, not only on the batch's path: a
            # mask drawn from tf.shape(x) is copied too, and draws anew.
            raise Refused(
                "op '%s' (type %s) draws random numbers between the inputs "
                "and the loss, and a per-example copy would draw new ones; "
                "pass the random tensor in as a placeholder, or use "
                "strategy='loop'" % (op.name, op.type), op)
    _check_examples_apart(inputs, ops, loss, loss_ancestors, static_b)
    if static_b is not None and static_b > 1:
        # A static batch is folded into constants (tensordot's reshape
        # target [B*T, D], space-to-batch paddings) that a copy of one
        # example's ops would keep: run-time shape errors or, worse, rows of
        # other examples. Refuse rather than guess; the planner falls back.
        raise Refused(
            "the batch size is static (%d), so shapes built from it are "
            "constants the per-example copy cannot adjust; feed the batch "
            "through a placeholder of shape [None, ...] for the O(B) form"
            % static_b)
    try:
        unproven = None if static_b == 1 else rowwise.prove(inputs, ops,
                                                            loss)
    except rowwise.Unexplained as e:
        raise Refused("%s; the copies would not be exact" % e) from e
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
    default graph; returns the copy of the loss."""
    mapping = dict(rows)
    _copy_ops(forward.ops, mapping, wanted={forward.loss.ref()})
    return mapping[forward.loss.ref()]


def _frame_of(ctxt, frame):
    """The v1 while context just inside `frame` (None: top level) that holds
    `ctxt`, or None if a v1 cond context is on the way."""
    while ctxt is not None:
        if not hasattr(ctxt, "loop_exits"):
            return None
        if ctxt.outer_context is frame:
            return ctxt
        ctxt = ctxt.outer_context
    return None


def _copy_ops(ops, mapping, frame=None, wanted=()):
    """Copies `ops` (in creation order) with inputs through `mapping`
    (ref -> tensor), which gets the copies' outputs. `frame`: the v1 while
    context being rebuilt (ops of loops inside it are rebuilt as loops);
    `wanted`: refs of the tensors the caller reads (with the inputs of
    `ops`, what decides which outputs of a loop are live)."""
    done = set()
    read = set(wanted)
    for op in ops:
        read.update(t.ref() for t in op.inputs)
    for op in ops:
        if all(o.ref() in mapping for o in op.outputs) and op.outputs:
            continue
        ctxt = _tf_compat.control_flow_context(op)
        if ctxt is not frame:
            inner = _frame_of(ctxt, frame)
            if inner is None:
                raise Refused("op '%s' (type %s) is in a v1 control-flow "
                              "context custagg cannot rebuild"
                              % (op.name, op.type), op)
            if inner not in done:
                done.add(inner)
                rebuild_v1_while(inner, mapping)
            continue
        if op.type in ("While", "StatelessWhile"):
            outs = rebuild_while(op, mapping, [
                k for k, o in enumerate(op.outputs) if o.ref() in read])
        else:
            outs = copy_op(op, mapping)
            if _ACTIVE and op in _ACTIVE[-1].ops:
                outs = _ACTIVE[-1].tap(op, outs, mapping)
        for old, out in zip(op.outputs, outs):
            if out is not None:
                mapping[old.ref()] = out


# Constants of at most this many elements are made again inside functions
# rather than captured (`_input`).
_INLINE_CONSTANTS = 1024

# TensorList makers and the index of their element_shape input.
_LIST_MAKERS = {"TensorListReserve": 0, "EmptyTensorList": 0}


def _is_batch_dim(d):
    # analyze() takes only a dynamic batch (or one of 1): the batch axis is
    # the unknown one.
    return d is None or d < 0


def _one_row_invariant(shape):
    """A loop variable's shape invariant for a one-example copy: the
    leading axis left open."""
    shape = tf.TensorShape(shape)
    if shape.rank is None or shape.rank == 0:
        return shape
    return tf.TensorShape([None] + shape.as_list()[1:])


def _tight_invariant(relaxed, init):
    """`relaxed` (a `_one_row_invariant`) with the initial value's static
    dimensions filled in, where that value has them."""
    if relaxed.rank is None or not isinstance(init, tf.Tensor) or \
            init.shape.rank != relaxed.rank:
        return relaxed
    try:
        return relaxed.merge_with(init.shape)
    except ValueError:
        return relaxed


def _one_row_shape(op):
    """For a TensorList maker whose elements' leading axis is unknown (the
    batch, in an RNN), the element shape with that axis 1 (a copy runs one
    example: pfor and the gradients read unset elements, which needs the
    whole shape); else None."""
    k = _LIST_MAKERS.get(op.type)
    if k is None or not _STATE["one_row"]:
        return None
    shape = tf.get_static_value(op.inputs[k])
    if shape is None or np.ndim(shape) != 1 or len(shape) < 1 or \
            not _is_batch_dim(int(shape[0])) or any(d < 0 for d in shape[1:]):
        return None
    return tf.constant([1] + [int(d) for d in shape[1:]],
                       dtype=op.inputs[k].dtype)


def _input(t, mapping):
    """The copy's version of input `t`."""
    got = mapping.get(t.ref())
    if got is not None:
        return got
    if t.op.type == "Const" and t.graph is not \
            tf.compat.v1.get_default_graph() and \
            t.shape.num_elements() is not None and \
            t.shape.num_elements() <= _INLINE_CONSTANTS:
        # Inside a function (a pass of the copies, a loop body) a captured
        # constant is a placeholder to shape inference: `tf.zeros(tf.stack(
        # [tf.shape(x)[0], 32]))` would get shape [None, None]. Small
        # constants are made again where they are used, so the copies keep
        # the static shapes of the one-example graph.
        # Not kept in `mapping`: it may serve ops of other graphs (the
        # loop a body belongs to) too.
        value = tf.get_static_value(t)
        if value is not None:
            return tf.constant(value, dtype=t.dtype)
    if t.dtype == tf.variant and _one_row_shape(t.op) is not None:
        # An empty list made outside the batch ops but filled with rows.
        mapping[t.ref()] = copy_op(t.op, mapping)[t.value_index]
        return mapping[t.ref()]
    return t


class _Rows(object):
    """Stands for `TensorListFromTensor(tensor)` inside a copied loop body
    whose only uses read items: each read becomes `tf.gather(tensor, i)`."""

    def __init__(self, tensor):
        self.tensor = tensor


def copy_op(op, mapping):
    graph = tf.compat.v1.get_default_graph()
    inputs = [_input(t, mapping) for t in op.inputs]
    if inputs and isinstance(inputs[0], _Rows):
        item = tf.gather(inputs[0].tensor, inputs[1])
        return [item]
    fixed_shape = _one_row_shape(op)
    if fixed_shape is not None:
        inputs[_LIST_MAKERS[op.type]] = fixed_shape
    node_def = _tf_compat.node_def(op)
    attrs = {k: node_def.attr[k] for k in node_def.attr
             if k not in _DROP_ATTRS}
    controls = [mapping[c.outputs[0].ref()].op for c in op.control_inputs
                if c.outputs and c.outputs[0].ref() in mapping]
    with tf.control_dependencies(controls):
        new = _tf_compat.create_op(
            graph, op.type, inputs, dtypes=[o.dtype for o in op.outputs],
            name=op.name.split("/")[-1], attrs=attrs, op_def=op.op_def)
    fn = _tf_compat.gradient_function(op)
    if fn is not None:
        _tf_compat.set_gradient_function(new, fn)
    for old, out in zip(op.outputs, new.outputs):
        if old.dtype in (tf.resource, tf.variant):
            _tf_compat.copy_handle_data(old, out)
    return new.outputs


def func_graph(op, attr):
    try:
        return graph_lib.func_graph(op, attr)
    except graph_lib.FunctionNotFound as e:
        raise Refused(str(e), e.op) from e


def ancestors_in(graph_outputs, stop=(), skip=()):
    """Ops behind `graph_outputs` through data and control edges, not past
    the tensors whose refs are in `stop` (bound values: a loop's variables)
    nor into the ops in `skip` (a v1 frame's Merge/Switch)."""
    return graph_lib.upstream(graph_outputs, control=True,
                          stop_tensors=frozenset(stop), skip=frozenset(skip))


def _run_func_graph(func, outputs, bound):
    """Copies the ops of FuncGraph `func` behind `outputs` into the current
    graph with `func.inputs[k]` bound to `bound[k]`; returns the copies."""
    mapping = {func.inputs[k].ref(): v for k, v in bound.items()}
    needed = ancestors_in(outputs)
    _copy_ops([o for o in func.get_operations() if o in needed], mapping,
              wanted={t.ref() for t in outputs})
    return [mapping[t.ref()] for t in outputs]


def frame_ops(ctxt, graph):
    """Ops of the v1 while context `ctxt` and of the contexts inside it."""
    out = []
    for op in graph.get_operations():
        c = _tf_compat.control_flow_context(op)
        while c is not None and c is not ctxt:
            c = c.outer_context
        if c is ctxt:
            out.append(op)
    return out


def _live_v1(switches, merges, nexts, pred, wanted, exits):
    """Indices of the v1 loop variables that the exits in `wanted` (refs)
    and the condition `pred` depend on."""
    var_of = {}
    for j, (sw, mg) in enumerate(zip(switches, merges)):
        var_of[sw.outputs[1].ref()] = j
        var_of[mg.outputs[0].ref()] = j
    live, todo = set(), [j for j, e in enumerate(exits) if e.ref() in wanted]
    roots = [pred]
    while True:
        seen, stack = set(), [t for t in roots]
        while stack:
            t = stack.pop()
            if t.ref() in seen:
                continue
            seen.add(t.ref())
            if t.ref() in var_of:
                todo.append(var_of[t.ref()])
                continue
            stack.extend(t.op.inputs)
            stack.extend(c.outputs[0] for c in t.op.control_inputs
                         if c.outputs)
        fresh = [j for j in todo if j not in live]
        if not fresh:
            return sorted(live)
        live.update(fresh)
        todo = []
        roots = [nexts[j].inputs[0] for j in fresh]


def rebuild_v1_while(ctxt, mapping, wanted=None):
    """A v1 while loop (Enter/Merge/Switch/NextIteration/Exit frame) rebuilt
    as a new `tf.compat.v1.while_loop` whose cond and body copy the frame's
    ops; maps the frame's Exit outputs (and nothing inside it). `wanted`:
    refs of the exits the caller reads (None: all)."""
    exits = list(ctxt.loop_exits)
    switches = [e.op.inputs[0].op for e in exits]
    merges = [sw.inputs[0].op for sw in switches]
    enters = [m.inputs[0].op for m in merges]
    nexts = [m.inputs[1].op for m in merges]
    if any(m.type not in ("Merge", "RefMerge") for m in merges) or \
            any(e.type not in ("Enter", "RefEnter") for e in enters):
        raise Refused("the v1 while loop '%s' has a layout custagg does not "
                      "know" % ctxt.name, exits[0].op if exits else None)
    graph = exits[0].graph
    ops = frame_ops(ctxt, graph)
    pred = [op for op in ops if op.type == "LoopCond" and
            _tf_compat.control_flow_context(op) is ctxt][0].inputs[0]
    loop_ops = set(merges) | set(switches) | set(enters) | set(nexts) | set(
        e.op for e in exits)
    if wanted is not None:
        # Only the variables the wanted exits and the condition need (not
        # the iteration counter a gradient of the loop added, whose ops
        # read the frame's pivot).
        keep = _live_v1(switches, merges, nexts, pred, wanted, exits)
        exits, switches, merges, enters, nexts = (
            [v[j] for j in keep] for v in (exits, switches, merges, enters,
                                           nexts))
    constants = {}
    entering = [op for op in ops
                if op.type in ("Enter", "RefEnter") and op not in loop_ops and
                _tf_compat.control_flow_context(op) is ctxt]
    if not _STATE["one_row"]:
        # A v1 TensorArray read in the loop (dynamic_rnn's unstacked
        # inputs) clears each item after its read: the rebuilt loop gets
        # its own array, made the same way.
        arrays = ancestors_in([op.inputs[0] for op in entering])
        _copy_ops([op for op in graph.get_operations() if op in arrays and
                   op.type.startswith("TensorArray")], mapping)
    for op in entering:
        constants[op.outputs[0].ref()] = _input(op.inputs[0], mapping)
    inits = [_input(e.inputs[0], mapping) for e in enters]
    shapes = [_one_row_invariant(m.outputs[0].shape) for m in merges]

    def run(bound, outputs):
        m = dict(mapping)
        m.update(constants)
        m.update(bound)
        needed = ancestors_in(outputs, set(bound) | set(constants),
                               loop_ops)
        _copy_ops([op for op in ops if op in needed and op not in loop_ops
                   and op.outputs and op.outputs[0].ref() not in m]
                  + [op for op in ops if op in needed and not op.outputs
                     and op not in loop_ops], m, ctxt)
        return [m[t.ref()] for t in outputs]

    def cond_fn(*values):
        bound = {mg.outputs[0].ref(): v for mg, v in zip(merges, values)}
        return run(bound, [pred])[0]

    def body_fn(*values):
        bound = {sw.outputs[1].ref(): v for sw, v in zip(switches, values)}
        return run(bound, [n.inputs[0] for n in nexts])

    new = _tapped_while(_HOOKS.get(ctxt), cond_fn, body_fn, inits, shapes,
                        ctxt.parallel_iterations)
    for e, t in zip(exits, new):
        mapping[e.ref()] = t


_is_accumulator = graph_lib.is_accumulator


def _live_vars(body, cond, var_idx, used):
    """The loop variables (indices) that the `used` outputs and the
    condition depend on; the others are dead and not rebuilt (an unused
    TensorList output would get a variant `zeros_like` gradient)."""
    position = {body.inputs[k].ref(): k for k in var_idx}
    live = set()
    todo = [k for k in var_idx if k in used]
    cond_needed = ancestors_in([cond.outputs[0]])
    for j, t in enumerate(cond.inputs):
        if t.op in cond_needed and j in var_idx:
            todo.append(j)
    while todo:
        k = todo.pop()
        if k in live:
            continue
        live.add(k)
        needed = ancestors_in([body.outputs[k]])
        for t in body.inputs:
            if t.op in needed and t.ref() in position:
                todo.append(position[t.ref()])
    return [k for k in var_idx if k in live]


def rebuild_while(op, mapping, used):
    """A v2 While op rebuilt as a new `tf.while_loop` whose body and cond
    copy the original functions' ops.

    Only the loop's own outputs are rebuilt, not the accumulators of
    intermediates a gradient (or Keras) added: the new loop's gradient adds
    the ones it needs, and pfor converts the loop built here as it would one
    traced from Python code.
    """
    body, cond = func_graph(op, "body"), func_graph(op, "cond")
    try:
        n = op.get_attr("_num_original_outputs")
    except ValueError:
        n = len(op.outputs)
    # A gradient built earlier may have added accumulators of intermediates
    # (and counted them as original outputs): not rebuilt.
    keep = [k for k in range(n) if not _is_accumulator(op, body, k)]
    ins = [_input(t, mapping) if k in keep else None
           for k, t in enumerate(op.inputs[:n])]
    through = [k for k in keep if body.outputs[k] is body.inputs[k]]
    var_idx = _live_vars(body, cond, [k for k in keep if k not in through],
                         set(used))
    fixed = {k: ins[k] for k in through}
    # A loop-invariant TensorList made from batch data (Keras' unstacked
    # inputs) is made again inside the body from its tensor: as a capture its
    # unused loop output would get a variant `zeros_like` gradient, which
    # pfor cannot vectorize.
    remake = {}
    for k in through:
        t = op.inputs[k]
        if t.dtype == tf.variant and t.ref() in mapping and \
                not any(i.dtype == tf.variant for i in t.op.inputs):
            remake[k] = t
    shapes = [_one_row_invariant(s) for s in op.get_attr("output_shapes")]

    # The body ops the rebuilt loop runs (a gradient built before may have
    # added others that read the loop's inputs).
    live_ops = ancestors_in([body.outputs[k] for k in var_idx])

    def bind(values):
        bound = dict(fixed)
        for k, t in remake.items():
            if t.op.type == "TensorListFromTensor" and all(
                    c.type == "TensorListGetItem" and c.inputs[0] is
                    body.inputs[k] for c in body.inputs[k].consumers()
                    if c in live_ops):
                # Reads of the unstacked tensor: a gather of its rows.
                bound[k] = _Rows(_input(t.op.inputs[0], mapping))
            else:
                bound[k] = copy_op(t.op, mapping)[t.value_index]
        bound.update(zip(var_idx, values))
        return bound

    def cond_fn(*values):
        return _run_func_graph(cond, [cond.outputs[0]], bind(values))[0]

    def body_fn(*values):
        return _run_func_graph(body, [body.outputs[k] for k in var_idx],
                               bind(values))

    inits = [ins[k] for k in var_idx]
    relaxed = [shapes[k] if k < len(shapes) else tf.TensorShape(None)
               for k in var_idx]
    hook = _HOOKS.get(op)
    new = None
    if hook is None and _STATE["one_row"]:
        # First with the copy's own shapes: a one-example copy whose loop
        # variables keep their static [1, ...] shapes builds a body (and a
        # gradient) with static shapes, as `tf.vectorized_map`'s traced
        # function does, so pfor adds no shape bookkeeping per iteration. A
        # variable whose shape does change between iterations fails the
        # build's invariant check (ValueError) and the loop is built again
        # with the leading axes left open.
        tight = [_tight_invariant(r, t) for r, t in zip(relaxed, inits)]
        if tight != relaxed:
            saved = dict(mapping)
            try:
                new = _tapped_while(None, cond_fn, body_fn, inits, tight,
                                    op.get_attr("parallel_iterations"))
            except ValueError:
                mapping.clear()
                mapping.update(saved)
                new = None
    if new is None:
        new = _tapped_while(hook, cond_fn, body_fn, inits, relaxed,
                            op.get_attr("parallel_iterations"))
    outs = [None] * len(op.outputs)
    for k in through:
        outs[k] = ins[k]
    for k, t in zip(var_idx, new):
        outs[k] = t
    return outs


def _tapped_while(hook, cond_fn, body_fn, loop_vars, shapes,
                  parallel_iterations):
    """`_while_loop` of a rebuilt loop; with a `hook` (the loop rules'), the
    hook's extra loop variables ride along after `loop_vars` (cond_fn and
    body_fn never see them) and the copy of the body is tapped by it."""
    if hook is None:
        return _while_loop(cond_fn, body_fn, loop_vars, shapes,
                           parallel_iterations)
    n = len(loop_vars)
    extra = hook.initial()

    def tapped_body(*values):
        hook.enter(values[n:])
        _ACTIVE.append(hook)
        try:
            outs = body_fn(*values[:n])
        finally:
            _ACTIVE.pop()
        return list(outs) + hook.leave()

    new = _while_loop(lambda *values: cond_fn(*values[:n]), tapped_body,
                      list(loop_vars) + extra,
                      list(shapes) + [hook.invariant(t) for t in extra],
                      parallel_iterations)
    hook.done(new[n:])
    return new[:n]


def _while_loop(cond_fn, body_fn, loop_vars, shapes, parallel_iterations):
    """A new `tf.compat.v1.while_loop` (v1 or v2, as the graph builds them)
    returning a list."""
    return tf.compat.v1.while_loop(
        cond_fn, body_fn, loop_vars, shape_invariants=shapes,
        parallel_iterations=parallel_iterations, return_same_structure=True)


def grad_dtype(t):
    """The dtype of a gradient with respect to `t` (resource: its value's)."""
    if t.dtype == tf.resource:
        data = _tf_compat.resource_variable_ops.get_eager_safe_handle_data(t)
        if data is not None and data.is_set and data.shape_and_type:
            return tf.as_dtype(data.shape_and_type[0].dtype)
        raise ValueError("custagg: cannot tell the value dtype of resource "
                         "%s." % t.name)
    return t.dtype.base_dtype


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


def _checked(results, losses, forward):
    """`results` once the copies' losses are seen to equal the batch's;
    `results` as they are where `forward` proves the examples apart."""
    if forward.unproven is None:
        return results
    loss = forward.loss
    dtype = loss.dtype
    tol = 1e-3 if dtype in (tf.float16, tf.bfloat16, tf.float32) else 1e-7
    scale = tf.reduce_max(tf.abs(loss)) + tf.ones([], dtype)
    gap = tf.reduce_max(tf.abs(tf.cast(losses, dtype) - loss))
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
                     gradients):
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
    return _checked(out[:-1], out[-1], forward)


def has_v1_loops(forward):
    """Whether the forward pass holds v1 control flow (Enter/Exit frames)."""
    return any(_tf_compat.control_flow_context(op) is not None
               for op in forward.ops)


# Ops whose outputs depend on their inputs' shapes only: every copy sees
# the same shapes (one example's rows), so nothing that goes through them
# makes the copies' loops run different numbers of iterations.
_SHAPE_ONLY = frozenset(["Shape", "ShapeN", "Size", "Rank",
                         "TensorListLength", "TensorListElementShape"])


def varying_loop(forward):
    """A v2 loop of the forward pass whose condition depends on the values
    of batch data (dynamic_rnn with `sequence_length` stops at the longest
    sequence), or None. pfor converts such a loop's copies when their shapes
    are static, and the converted loop then fails at run time reading its
    unstacked inputs ("Trying to access element 0 in a list with 0
    elements"), so these copies run in the while loop over examples."""
    valued = graph_lib.downstream(forward.inputs, stop_types=_SHAPE_ONLY)
    inputs = {t.ref() for t in forward.inputs}
    for op in forward.ops:
        if op.type not in ("While", "StatelessWhile"):
            continue
        try:
            body, cond = func_graph(op, "body"), func_graph(op, "cond")
        except Refused:
            return op
        if len(body.inputs) != len(op.inputs) or \
                len(cond.inputs) != len(op.inputs):
            return op
        dep = {k for k, t in enumerate(op.inputs)
               if t.op in valued or t.ref() in inputs}
        while True:
            more = {k for k, out in enumerate(body.outputs) if k not in dep
                    and any(body.inputs[j].op in graph_lib.upstream(
                        [out], stop_types=_SHAPE_ONLY)
                            for j in dep)}
            if not more:
                break
            dep |= more
        needed = graph_lib.upstream([cond.outputs[0]], stop_types=_SHAPE_ONLY)
        if any(cond.inputs[k].op in needed for k in dep):
            return op
    return None


def per_example_loop(forward, tensors, zeros, dtypes, shapes, batch,
                     gradients):
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
    return _checked(out[:-1], out[-1], forward)

