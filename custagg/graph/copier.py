"""Copies of forward-pass ops: the `Copier`, and the loop plumbing it needs.

A copy re-creates ops of the graph in the default graph with some inputs
replaced (`mapping`: tensor ref -> replacement; it also receives the copies'
outputs). v2 loops (`While`) are rebuilt as new `tf.while_loop`s whose body
and cond copy the functions' ops; v1 loops (`Enter`/`Exit` frames) as new
`tf.compat.v1.while_loop`s whose bodies copy the frame's ops; `tf.function`
call sites keep their gradient functions.

What one copy job needs to know -- whether it copies one example
(`one_row`: TensorList element shapes of an unknown leading axis get 1) or
the whole batch, the hooks that tap rebuilt loop bodies (the loop rules),
and the hooks of the bodies being copied right now -- lives on its
`Copier`, passed explicitly; nothing is kept between jobs. The per-example
copies (`per_example/forms/copies.py`) and the loop rules
(`per_example/forms/loop_rules.py`) build on it. Nothing here knows about
examples beyond the `one_row` shapes.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from custagg import _tf_compat
from custagg import op_kinds
from custagg.graph import functions
from custagg.graph import walks

# Attrs a copy must not take: colocation with the original's neighbours.
_DROP_ATTRS = frozenset(["_class"])


class CannotCopy(ValueError):
    """The ops cannot be copied (or the forward pass not copied per
    example); the message names the op and says what to try; `op` is it."""

    def __init__(self, message, op=None):
        super().__init__(message)
        self.op = op


class Copier(object):
    """One copy job.

    Attributes:
      one_row: True when the copy runs one example (a TensorList made for
        rows of an unknown leading axis gets element shape `[1, ...]`, and
        rebuilt loops first try the copy's static shapes); False to keep the
        batch as it is (the loop rules rebuild a loop on the whole batch).
      hooks: loop (v2 While op, or v1 while context) -> the hook tapping its
        rebuilt body: `initial()` its extra loop variables, `invariant(t)`,
        `enter(values)` / `leave()` around each body copy, `ops` the ops
        whose copies `tap(op, outs, mapping)` replaces, `done(finals)`.
    """

    def __init__(self, one_row=True, hooks=None, checks=False):
        self.one_row = one_row
        self.hooks = dict(hooks or {})
        # With `checks`, a copy of an op with no outputs (an `Assert`) is
        # kept in the mapping (`control_key`), and the copies of the ops
        # that wait on it wait on the copy; without, control inputs of
        # copies are only those with outputs in the mapping.
        self.checks = checks
        # The hooks of the bodies being copied now, innermost last.
        self._active = []

    def copy_ops(self, ops, mapping, frame=None, wanted=()):
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
                inner = frame_of(ctxt, frame)
                if inner is None:
                    raise CannotCopy("op '%s' (type %s) is in a v1 "
                                     "control-flow context custagg cannot "
                                     "rebuild" % (op.name, op.type), op)
                if inner not in done:
                    done.add(inner)
                    self.rebuild_v1_while(inner, mapping)
                continue
            if op.type in op_kinds.V2_LOOPS:
                outs = self.rebuild_while(op, mapping, [
                    k for k, o in enumerate(op.outputs) if o.ref() in read])
            else:
                outs = self.copy_op(op, mapping)
                if self._active and op in self._active[-1].ops:
                    outs = self._active[-1].tap(op, outs, mapping)
            for old, out in zip(op.outputs, outs):
                if out is not None:
                    mapping[old.ref()] = out

    def copy_op(self, op, mapping):
        """Copies `op` with its inputs through `mapping` (ref -> tensor)
        into the default graph; returns the copy's outputs."""
        graph = tf.compat.v1.get_default_graph()
        inputs = [self.input(t, mapping) for t in op.inputs]
        if inputs and isinstance(inputs[0], _Rows):
            item = tf.gather(inputs[0].tensor, inputs[1])
            return [item]
        fixed_shape = self.one_row_shape(op)
        if fixed_shape is not None:
            inputs[_LIST_MAKERS[op.type]] = fixed_shape
        node_def = _tf_compat.node_def(op)
        attrs = {k: node_def.attr[k] for k in node_def.attr
                 if k not in _DROP_ATTRS}
        if pads_explicitly(op):
            # The same convolution as an explicit tf.pad and VALID padding:
            # pfor runs the copies' Conv2DBackpropFilter through its
            # while-loop fallback, which drops `explicit_paddings` (TF 2.21:
            # "explicit_paddings attribute must contain 8 values, but got:
            # 0"). Zero padding then a VALID window is what EXPLICIT means.
            pads = list(node_def.attr["explicit_paddings"].list.i)
            inputs[0] = tf.pad(inputs[0], [pads[k:k + 2]
                                           for k in range(0, len(pads), 2)])
            attrs["padding"] = _tf_compat.attr_value_pb2.AttrValue(s=b"VALID")
            attrs["explicit_paddings"] = _tf_compat.attr_value_pb2.AttrValue(
                list=_tf_compat.attr_value_pb2.AttrValue.ListValue())
        controls = []
        for c in op.control_inputs:
            got = mapping.get(c.outputs[0].ref() if c.outputs else
                              control_key(c) if self.checks else None)
            if got is not None:
                controls.append(got if isinstance(got, tf.Operation)
                                else got.op)
        with tf.control_dependencies(controls):
            new = _tf_compat.create_op(
                graph, op.type, inputs, dtypes=[o.dtype for o in op.outputs],
                name=op.name.split("/")[-1], attrs=attrs, op_def=op.op_def)
        if self.checks and not op.outputs:
            mapping[control_key(op)] = new
        fn = _tf_compat.gradient_function(op)
        if fn is not None:
            _tf_compat.set_gradient_function(new, fn)
        for old, out in zip(op.outputs, new.outputs):
            if old.dtype in (tf.resource, tf.variant):
                _tf_compat.copy_handle_data(old, out)
        return new.outputs

    def input(self, t, mapping):
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
        if t.dtype == tf.variant and self.one_row_shape(t.op) is not None:
            # An empty list made outside the batch ops but filled with rows.
            mapping[t.ref()] = self.copy_op(t.op, mapping)[t.value_index]
            return mapping[t.ref()]
        return t

    def one_row_shape(self, op):
        """For a TensorList maker whose elements' leading axis is unknown (the
        batch, in an RNN), the element shape with that axis 1 (a copy runs one
        example: pfor and the gradients read unset elements, which needs the
        whole shape); else None."""
        k = _LIST_MAKERS.get(op.type)
        if k is None or not self.one_row:
            return None
        shape = tf.get_static_value(op.inputs[k])
        if shape is None or np.ndim(shape) != 1 or len(shape) < 1 or \
                not _is_batch_dim(int(shape[0])) or \
                any(d < 0 for d in shape[1:]):
            return None
        return tf.constant([1] + [int(d) for d in shape[1:]],
                           dtype=op.inputs[k].dtype)

    def run_func_graph(self, func, outputs, bound):
        """Copies the ops of FuncGraph `func` behind `outputs` into the current
        graph with `func.inputs[k]` bound to `bound[k]`; returns the copies."""
        mapping = {func.inputs[k].ref(): v for k, v in bound.items()}
        needed = ancestors_in(outputs)
        self.copy_ops([o for o in func.get_operations() if o in needed],
                      mapping, wanted={t.ref() for t in outputs})
        return [mapping[t.ref()] for t in outputs]

    def rebuild_while(self, op, mapping, used):
        """A v2 While op rebuilt as a new `tf.while_loop` whose body and cond
        copy the original functions' ops.

        Only the loop's own outputs are rebuilt, not the accumulators of
        intermediates a gradient (or Keras) added: the new loop's gradient
        adds the ones it needs, and pfor converts the loop built here as it
        would one traced from Python code.
        """
        body, cond = func_graph(op, "body"), func_graph(op, "cond")
        # Accumulators a gradient built earlier added: not rebuilt.
        keep = functions.own_loop_variables(op, body)
        ins = {k: self.input(op.inputs[k], mapping) for k in keep}
        through = [k for k in keep if body.outputs[k] is body.inputs[k]]
        var_idx = _live_vars(body, cond, [k for k in keep if k not in through],
                             set(used))
        fixed = {k: ins[k] for k in through}
        # A loop-invariant TensorList made from batch data (Keras' unstacked
        # inputs) is made again inside the body from its tensor: as a capture
        # its unused loop output would get a variant `zeros_like` gradient,
        # which pfor cannot vectorize.
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
                    bound[k] = _Rows(self.input(t.op.inputs[0], mapping))
                else:
                    bound[k] = self.copy_op(t.op, mapping)[t.value_index]
            bound.update(zip(var_idx, values))
            return bound

        def cond_fn(*values):
            return self.run_func_graph(cond, [cond.outputs[0]],
                                       bind(values))[0]

        def body_fn(*values):
            return self.run_func_graph(
                body, [body.outputs[k] for k in var_idx], bind(values))

        inits = [ins[k] for k in var_idx]
        relaxed = [shapes[k] if k < len(shapes) else tf.TensorShape(None)
                   for k in var_idx]
        hook = self.hooks.get(op)
        new = None
        if hook is None and self.one_row:
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
                    new = self.tapped_while(
                        None, cond_fn, body_fn, inits, tight,
                        op.get_attr("parallel_iterations"))
                except ValueError:
                    mapping.clear()
                    mapping.update(saved)
                    new = None
        if new is None:
            new = self.tapped_while(hook, cond_fn, body_fn, inits, relaxed,
                                op.get_attr("parallel_iterations"))
        outs = [None] * len(op.outputs)
        for k in through:
            outs[k] = ins[k]
        for k, t in zip(var_idx, new):
            outs[k] = t
        return outs

    def rebuild_v1_while(self, ctxt, mapping, wanted=None):
        """A v1 while loop (Enter/Merge/Switch/NextIteration/Exit frame)
        rebuilt as a new `tf.compat.v1.while_loop` whose cond and body copy
        the frame's ops; maps the frame's Exit outputs (and nothing inside
        it). `wanted`: refs of the exits the caller reads (None: all)."""
        exits = list(ctxt.loop_exits)
        switches = [e.op.inputs[0].op for e in exits]
        merges = [sw.inputs[0].op for sw in switches]
        enters = [m.inputs[0].op for m in merges]
        nexts = [m.inputs[1].op for m in merges]
        if any(m.type not in op_kinds.V1_MERGES for m in merges) or \
                any(e.type not in op_kinds.V1_ENTERS for e in enters):
            raise CannotCopy("the v1 while loop '%s' has a layout custagg "
                             "does not know" % ctxt.name,
                             exits[0].op if exits else None)
        graph = exits[0].graph
        ops = frame_ops(ctxt, graph)
        pred = [op for op in ops if op.type == "LoopCond" and
                _tf_compat.control_flow_context(op) is ctxt][0].inputs[0]
        loop_ops = (set(merges) | set(switches) | set(enters) | set(nexts) |
                    set(e.op for e in exits))
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
                    if op.type in op_kinds.V1_ENTERS and
                    op not in loop_ops and
                    _tf_compat.control_flow_context(op) is ctxt]
        if not self.one_row:
            # A v1 TensorArray read in the loop (dynamic_rnn's unstacked
            # inputs) clears each item after its read: the rebuilt loop gets
            # its own array, made the same way.
            arrays = ancestors_in([op.inputs[0] for op in entering])
            self.copy_ops([op for op in graph.get_operations()
                           if op in arrays and
                           op.type.startswith("TensorArray")], mapping)
        for op in entering:
            constants[op.outputs[0].ref()] = self.input(op.inputs[0], mapping)
        inits = [self.input(e.inputs[0], mapping) for e in enters]
        shapes = [_one_row_invariant(m.outputs[0].shape) for m in merges]

        def run(bound, outputs):
            m = dict(mapping)
            m.update(constants)
            m.update(bound)
            needed = ancestors_in(outputs, set(bound) | set(constants),
                                   loop_ops)
            self.copy_ops(
                [op for op in ops if op in needed and op not in loop_ops
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

        new = self.tapped_while(self.hooks.get(ctxt), cond_fn, body_fn, inits,
                                shapes, ctxt.parallel_iterations)
        for e, t in zip(exits, new):
            mapping[e.ref()] = t

    def tapped_while(self, hook, cond_fn, body_fn, loop_vars, shapes,
                     parallel_iterations):
        """`_while_loop` of a rebuilt loop; with a `hook` (the loop rules'),
        the hook's extra loop variables ride along after `loop_vars` (cond_fn
        and body_fn never see them) and the copy of the body is tapped by
        it."""
        if hook is None:
            return _while_loop(cond_fn, body_fn, loop_vars, shapes,
                               parallel_iterations)
        n = len(loop_vars)
        extra = hook.initial()

        def tapped_body(*values):
            hook.enter(values[n:])
            self._active.append(hook)
            try:
                outs = body_fn(*values[:n])
            finally:
                self._active.pop()
            return list(outs) + hook.leave()

        new = _while_loop(lambda *values: cond_fn(*values[:n]), tapped_body,
                          list(loop_vars) + extra,
                          list(shapes) + [hook.invariant(t) for t in extra],
                          parallel_iterations)
        hook.done(new[n:])
        return new[:n]


# Constants of at most this many elements are made again inside functions
# rather than captured (`Copier.input`).
_INLINE_CONSTANTS = 1024

# TensorList makers and the index of their element_shape input.
_LIST_MAKERS = {"TensorListReserve": 0, "EmptyTensorList": 0}


def pads_explicitly(op):
    """Whether `op` is a convolution with EXPLICIT padding and TF's own
    gradient (no override), which `Copier.copy_op` writes as a tf.pad and
    VALID padding."""
    if op.type not in op_kinds.EXPLICIT_PADDING_CONVS:
        return False
    node_def = _tf_compat.node_def(op)
    return node_def.attr["padding"].s == b"EXPLICIT" and \
        "_gradient_op_type" not in node_def.attr


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


def frame_of(ctxt, frame):
    """The v1 while context just inside `frame` (None: top level) that holds
    `ctxt`, or None if a v1 cond context is on the way."""
    while ctxt is not None:
        if not hasattr(ctxt, "loop_exits"):
            return None
        if ctxt.outer_context is frame:
            return ctxt
        ctxt = ctxt.outer_context
    return None


def func_graph(op, attr):
    """`graph.func_graph`, its failure a `CannotCopy`."""
    try:
        return functions.func_graph(op, attr)
    except functions.FunctionNotFound as e:
        raise CannotCopy(str(e), e.op) from e


def control_key(op):
    """The key of a copied op with no outputs (an `Assert`) in a copy's
    mapping (`Copier(checks=True)`): the op its copies' readers wait on."""
    return ("control", op)


def ancestors_in(graph_outputs, stop=(), skip=()):
    """Ops behind `graph_outputs` through data and control edges, not past
    the tensors whose refs are in `stop` (bound values: a loop's variables)
    nor into the ops in `skip` (a v1 frame's Merge/Switch)."""
    return walks.upstream(graph_outputs, control=True,
                          stop_tensors=frozenset(stop), skip=frozenset(skip))


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


def live_loop_variables(op, used):
    """The positions of While `op`'s own loop variables (loop invariants
    apart) that a rebuild reading outputs `used` runs: those the `used`
    outputs and the condition depend on, through the body."""
    body, cond = func_graph(op, "body"), func_graph(op, "cond")
    keep = functions.own_loop_variables(op, body)
    through = [k for k in keep if body.outputs[k] is body.inputs[k]]
    return _live_vars(body, cond, [k for k in keep if k not in through],
                      set(used))


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


class _Rows(object):
    """Stands for `TensorListFromTensor(tensor)` inside a copied loop body
    whose only uses read items: each read becomes `tf.gather(tensor, i)`."""

    def __init__(self, tensor):
        self.tensor = tensor


def _while_loop(cond_fn, body_fn, loop_vars, shapes, parallel_iterations):
    """A new `tf.compat.v1.while_loop` (v1 or v2, as the graph builds them)
    returning a list."""
    return tf.compat.v1.while_loop(
        cond_fn, body_fn, loop_vars, shape_invariants=shapes,
        parallel_iterations=parallel_iterations, return_same_structure=True)
