"""custagg's reverse-mode traversal of a `tf.Graph`: a drop-in for `tf.gradients`.

The traversal does no maths of its own. It finds the ops between `ys` and
`xs`, visits them in reverse order (an op is ready once every consumer on a
path to `ys` has sent back its contribution), sums the contributions for each
output (`aggregation.aggregate_contributions`), and calls the gradient
function TensorFlow registered for the op (found and called by
`traversal.op_gradients`, which holds no state of the pass).

Semantics follow `tf.compat.v1.gradients` (TF 2.21): the same lookup of
gradient functions (`gradient_override_map`, `tf.custom_gradient`,
`tf.no_gradient`, function-call ops), `None` for unconnected `xs` unless
`unconnected_gradients=ZERO`, `IndexedSlices` kept sparse, integer paths not
differentiated, `stop_gradients` ops treated as constants.

With `AggregationMethod.CUSTOM`, `ys` are per-example terms; they are weighted
by `gradient_factors` before the pass starts (see `aggregation.custom_seeds`).

Control flow: v2 (`While`/`If`, what TF 2.21 builds under
`tf.compat.v1.disable_eager_execution()`) needs nothing special: its
gradients are registered functions like any other op's. v1 control flow
(`Switch`/`Merge`, and `Enter`/`Exit`/`NextIteration` loops, built under
`tf.compat.v1.disable_v2_behavior()`) is differentiated as TF does it: a
v1 while loop's gradient is itself a while loop, built by TF's loop-state
object (`control_flow_state`), which the traversal enters and leaves around
each op and asks for zeros; the traversal only decides when each op is
visited.
"""

from __future__ import annotations

import collections
import contextlib
import operator

import tensorflow as tf

from custagg import _tf_compat
from custagg.traversal import aggregation
from custagg import errors
from custagg.traversal import op_gradients
from custagg._tf_compat import backprop_util
from custagg._tf_compat import composite_tensor
from custagg._tf_compat import composite_tensor_gradient
from custagg._tf_compat import control_flow_state
from custagg._tf_compat import control_flow_util
from custagg._tf_compat import default_gradient
from custagg._tf_compat import indexed_slices as indexed_slices_lib
from custagg._tf_compat import object_identity
from custagg._tf_compat import ops
from custagg._tf_compat import resource_variable_ops
from custagg.traversal.aggregation import AggregationMethod

def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _one_per_class(ts):
    """One element of `ts` per distinct class, for isinstance checks.

    `any(isinstance(t, C) for t in ts)` is the same test on these: the
    answer depends on the class only (`type(t)`, and `t.__class__`, which a
    proxy may change; both are keyed). ys can hold thousands of slices of one
    class (CUSTOM list form), and an isinstance check against TF's abstract
    classes (Variable, CompositeTensor) costs about a microsecond; this is a
    few C-level passes.
    """
    return list(dict(zip(zip(map(type, ts), map(_class_of, ts)),
                         ts)).values())


_class_of = operator.attrgetter("__class__")


def _is_func_graph(graph):
    return isinstance(graph, ops.Graph) and _tf_compat.building_function(graph)


def _outer_value(t):
    """For a placeholder that captures an outer tensor, that outer tensor."""
    # A function traced from eager code captures EagerTensors, which have no
    # op: they are where the walk outwards ends.
    if isinstance(t, ops.EagerTensor):
        return t
    graph = t.op.graph
    if _is_func_graph(graph) and t.op.type == "Placeholder":
        for outer, inner in graph.captures:
            if inner is t:
                return _outer_value(outer)
    return t


def _zeros_like(t):
    """Zeros standing for the gradient of `t` (the variable's shape for handles)."""
    dtype = default_gradient.get_zeros_dtype(t)
    if t.dtype == tf.resource:
        return tf.zeros(resource_variable_ops.variable_shape(t), dtype=dtype)
    return tf.zeros_like(t, dtype=dtype)


class _Backprop(object):
    """State of one reverse pass: what is between ys and xs, and what is pending."""

    def __init__(self, graph, ys, xs, stop_tensors, colocate, gate,
                 sum_method, gradient_uid, scope_name, src_graph=None,
                 optimize_identity_n=False):
        # `graph`: where the gradient ops go (the default graph);
        # `src_graph`: the graph of ys and xs, where called functions are
        # looked up (TF's `src_graph`: a function body whose gradient is
        # built in another graph, by cond_v2, while_v2, tf.function).
        self.graph = graph
        self.src_graph = graph if src_graph is None else src_graph
        # The gradients call's name scope ("gradients/"): TF names the XLA
        # scope of separately compiled gradients after it.
        self.scope_name = scope_name
        # TF's helper option: IdentityN outputs without a gradient give
        # their inputs None, not zeros (IdentityN passes gradients through).
        self.optimize_identity_n = optimize_identity_n
        self.xs = xs
        self.xs_set = object_identity.ObjectIdentitySet(xs)
        self.colocate = colocate
        self.gate = gate
        self.sum_method = sum_method
        self.gradient_uid = gradient_uid
        # FuncGraphs enclosing the default graph: their captures are inputs.
        self.func_graphs = []
        g = self.src_graph
        while _is_func_graph(g):
            self.func_graphs.append(g)
            g = g.outer_graph
        # op -> list (one per output) of received contributions; replaced by
        # the aggregated gradient once the op has been visited.
        self.grads = {}
        self.from_ops = [x.op for x in xs]
        self.stop_gradient_ops = [t.op for t in stop_tensors]
        self.stop_ops = set()       # set by run(), after loop exits are known
        # TF's bookkeeping of v1 while loops (None when there are none).
        self.loop_state = None
        self._find_between([y.op for y in ys], self.from_ops)

    # -- graph structure -------------------------------------------------

    def inputs(self, op):
        """Inputs of `op`, seen through captures of enclosing functions."""
        if not _is_func_graph(op.graph):
            return list(op.inputs)
        return [t if t in self.xs_set else _outer_value(t) for t in op.inputs]

    def _graph_inputs(self, op):
        return [t for t in self.inputs(op) if not isinstance(t, ops.EagerTensor)]

    def _consumers(self, t):
        found = t.consumers()
        if not self.func_graphs:
            return found
        for fg in self.func_graphs:
            for outer, inner in fg.captures:
                if outer is t:
                    found.extend(self._consumers(inner))
        return found

    def _find_between(self, to_ops, from_ops):
        """Marks the ops on a differentiable path from xs to ys; counts edges."""
        reached = set()
        # With one op in ys that is not in a v1 while loop, nothing
        # downstream of it leads back to it (only a loop's back edge,
        # NextIteration -> Merge, closes a cycle), so its consumers cannot
        # be between xs and ys and are not walked: `between` and `order`
        # come out the same. This keeps the B slices of a CUSTOM list form
        # (consumers of the tensor custom_seeds put in their place) out of
        # the walk, ~1 us each.
        end = set(to_ops)
        end = end.pop() if len(end) == 1 else None
        if end is not None and control_flow_util.IsInWhileLoop(end):
            end = None
        queue = collections.deque(from_ops)
        while queue:
            op = queue.popleft()
            if op in reached:
                continue
            reached.add(op)
            if op is end:
                continue
            for out in op.outputs:
                # Consumers first: many outputs have none (the B slices of a
                # CUSTOM list form, when reached), and IsTrainable costs more
                # than the lookup.
                consumers = self._consumers(out)
                if consumers and backprop_util.IsTrainable(out):
                    queue.extend(consumers)
        self.reachable_to_ops = set(op for op in to_ops if op in reached)
        self.between = set()
        order = []
        queue = collections.deque(to_ops)
        while queue:
            op = queue.popleft()
            if op in reached and op not in self.between:
                self.between.add(op)
                order.append(op)
                queue.extend(t.op for t in self._graph_inputs(op))
        # A v1 while loop between them: TF's loop state takes all the loop's
        # Exits in (adding them to `order` and `between`), since the gradient
        # loop carries every loop variable.
        self.loop_state = control_flow_state.MaybeCreateControlFlowState(
            order, self.between, self.colocate)
        # pending[op]: contributions op still waits for (one per edge).
        self.pending = collections.defaultdict(int)
        for op in order:
            for t in self._graph_inputs(op):
                if t.op in self.between:
                    self.pending[t.op] += 1

    def _stop_ops(self, from_ops, stop_gradient_ops):
        """xs ops with no xs ancestor on a path, plus stop_gradients ops."""
        stop = set(op for op in from_ops
                   if not any(self.pending[t.op] > 0
                              for t in self._graph_inputs(op)))
        stop.update(stop_gradient_ops)
        return stop

    # -- contributions ----------------------------------------------------

    def add(self, t, grad):
        per_output = self.grads.get(t.op)
        if per_output is None:
            per_output = [[] for _ in t.op.outputs]
            self.grads[t.op] = per_output
        received = per_output[t.value_index]
        if isinstance(received, list):
            received.append(grad)
        else:
            # Only a v1 loop's Switch is visited twice: its gradient from
            # the loop's exit is replaced by the one from the back edge.
            per_output[t.value_index] = grad

    def _has_grads(self, op):
        per_output = self.grads.get(op, ())
        return any(g is not None if not isinstance(g, list)
                   else any(c is not None for c in g) for g in per_output)

    def _aggregate(self, op):
        """Sums each output's contributions in place; returns the sums.

        The list returned is the one stored for `op`, not a copy: the zeros
        `_call_gradient` makes for an unused output are then that output's
        gradient when it is also an x, as in `tf.gradients` (asking for the
        second output of a `tf.split` whose first output is used gives zeros,
        not None).
        """
        per_output = self.grads.get(op)
        if per_output is None:
            per_output = [[] for _ in op.outputs]
            self.grads[op] = per_output
        for i, contribs in enumerate(per_output):
            if isinstance(contribs, list):   # else: a v1 loop Switch's, kept
                per_output[i] = aggregation.aggregate_contributions(
                    contribs, self.sum_method, op, self.gradient_uid)
        return per_output

    def result(self, x, unconnected):
        per_output = self.grads.get(x.op)
        grad = None if per_output is None else per_output[x.value_index]
        if isinstance(grad, list):
            # x's op was never visited: nothing reached it.
            grad = aggregation.aggregate_contributions(
                grad, self.sum_method, x.op, self.gradient_uid)
        if grad is None and unconnected == tf.UnconnectedGradients.ZERO:
            return _zeros_like(x)
        return grad

    # -- visiting ops -----------------------------------------------------

    @contextlib.contextmanager
    def _maybe_colocate(self, op):
        if self.colocate:
            with _tf_compat.colocate_with_for_gradient(op, self.gradient_uid):
                yield
        else:
            yield

    @contextlib.contextmanager
    def _in_grad_loop(self, op, before):
        """Inside the gradient while loop of op's v1 loop, if it has one.

        `before=True` is the context the output gradients are summed in
        (for a loop's Exit, the loop outside it); `before=False` the one
        op's gradient function runs in.
        """
        if self.loop_state is None:
            yield
            return
        outside = _tf_compat.graph_control_flow_context(self.graph)
        self.loop_state.EnterGradWhileContext(op, before)
        try:
            yield
        except BaseException:
            # The error of the gradient function (or of TF's loop state) is
            # the one the user must see. A function that failed half-way can
            # leave the gradient loop's context stack in a state its Exit
            # cannot undo (IndexError: pop from empty list): its error is
            # dropped and the graph's context put back as it was before.
            try:
                self.loop_state.ExitGradWhileContext(op, before)
            except Exception:  # pylint: disable=broad-except
                pass
            _tf_compat.set_graph_control_flow_context(self.graph, outside)
            raise
        self.loop_state.ExitGradWhileContext(op, before)

    def _check_not_through_loop_entry(self, op):
        """A loop's Switch reached from outside the loop: TF can only
        differentiate through loop invariants and the body's inputs."""
        ctxt = _tf_compat.control_flow_context(op)
        if (control_flow_util.IsSwitch(op) and ctxt is not None
                and ctxt.IsWhileContext() and ctxt ==
                _tf_compat.graph_control_flow_context(self.graph)):
            # The message names the x the user asked about (as TF's does),
            # not the Switch: the nearest of xs' ops upstream of it.
            asked = self._nearest_from_op(op)
            raise ValueError(
                "Cannot compute gradient inside while loop with respect to op "
                "'%s'. We do not support taking the gradient wrt or through "
                "the initial value of a loop variable. Gradients can be "
                "computed through loop invariants or wrt the input parameters "
                "to the loop body. custagg.gradients: the path from ys to "
                "'%s' enters while loop '%s' through a loop variable's "
                "initial value (at '%s'); inside the body, differentiate with "
                "respect to the body's own loop variable, or compute the "
                "gradient outside the loop."
                % (asked.name, asked.name, ctxt.name, op.name))

    def _nearest_from_op(self, op):
        """The first of xs' ops met walking up from `op` (breadth first)."""
        from_ops = set(self.from_ops)
        queue = collections.deque([op])
        seen = set()
        while queue:
            cur = queue.popleft()
            if cur in from_ops:
                return cur
            if cur in seen:
                continue
            seen.add(cur)
            queue.extend(t.op for t in self._graph_inputs(cur))
        return op   # not reached: op is between ys and xs

    def visit(self, op):
        """Aggregates op's output gradients and sends its input gradients on."""
        with self._maybe_colocate(op):
            with self._in_grad_loop(op, before=True):
                out_grads = self._aggregate(op)
            has_grads = any(g is not None for g in out_grads)
            grad_fn, is_call, func = None, False, None
            if has_grads and op not in self.stop_ops:
                grad_fn, is_call, func = op_gradients.lookup(
                    op, self.src_graph)
            with self._in_grad_loop(op, before=False):
                self._check_not_through_loop_entry(op)
                inputs = self.inputs(op)
                if has_grads and (grad_fn is not None or is_call):
                    in_grads = self._call_gradient(op, grad_fn, func,
                                                   out_grads)
                else:
                    in_grads = [None] * len(inputs)
                for i, (t_in, g) in enumerate(zip(inputs, in_grads)):
                    if g is not None:
                        self._send(op, i, t_in, g)

    def _send(self, op, i, t_in, g):
        """Records `g` as a contribution to input i of op, `t_in`."""
        if isinstance(g, tf.Tensor) and t_in.dtype != tf.resource:
            try:
                g.set_shape(t_in.shape)
            except ValueError:
                raise ValueError(
                    "Incompatible shapes between op input and calculated "
                    "input gradient. Forward operation: %s. Input index: %d. "
                    "Original input shape: %s. Calculated input gradient "
                    "shape: %s. custagg.gradients: fix the gradient function "
                    "used for op type %s." % (op.name, i, t_in.shape, g.shape,
                                              op.type))
        if not isinstance(t_in, ops.EagerTensor):
            self.add(t_in, g)

    def _call_gradient(self, op, grad_fn, func, out_grads):
        # The gradient of an output nothing depends on is zero; gradient
        # functions expect a tensor for every trainable output.
        if self.optimize_identity_n and op.type == "IdentityN":
            return op_gradients.call(op, grad_fn, func, out_grads, self.graph,
                                     self.src_graph, self.gate,
                                     self.gradient_uid, self.scope_name)
        for i, g in enumerate(out_grads):
            if g is None and ((grad_fn is None) or
                              backprop_util.IsTrainable(op.outputs[i])):
                if self.loop_state is not None:
                    # Inside a gradient loop zeros must be made per
                    # iteration (TF keeps their shapes on a stack).
                    out_grads[i] = self.loop_state.ZerosLikeV1WhileLoop(op, i)
                elif default_gradient.supports_default_grad(op.outputs[i]):
                    out_grads[i] = control_flow_state.ZerosLike(op, i)
        return op_gradients.call(op, grad_fn, func, out_grads, self.graph,
                                 self.src_graph, self.gate,
                                 self.gradient_uid, self.scope_name)

    def run(self, ys, grad_ys):
        for y, gy in zip(ys, grad_ys):
            self.add(y, gy)
        queue = collections.deque()
        queued = set()
        for y in ys:
            op = y.op
            if (self.pending[op] == 0 and op not in queued
                    and op in self.reachable_to_ops):
                queued.add(op)
                queue.append(op)
        if self.loop_state is not None:
            # Exits of a v1 loop that ys do not use get zeros (the gradient
            # loop carries every loop variable).
            for y in self.loop_state.ProcessUnusedLoopExits(self.pending,
                                                            queued):
                if backprop_util.IsTrainable(y):
                    self.add(y, self.loop_state.ZerosLikeForExit(y))
                queue.append(y.op)
        # After the loop exits: they may mark loop Enters as pending.
        self.stop_ops = self._stop_ops(self.from_ops, self.stop_gradient_ops)
        while queue:
            op = queue.popleft()
            self.visit(op)
            self._release_inputs(op, queue)
        if self.loop_state is not None:
            self.loop_state.PostProcessing()

    def _release_inputs(self, op, queue):
        """Counts op's contributions as received; queues the ready inputs."""
        for t in self._graph_inputs(op):
            self.pending[t.op] -= 1
            ready = self.pending[t.op] == 0
            if not ready and self.loop_state is not None:
                # A v1 loop's Switch goes first with the exit's gradient,
                # and again once the back edge's has come.
                ready = (self.pending[t.op] > 0
                         and control_flow_util.IsLoopSwitch(t.op))
            if not ready:
                continue
            if control_flow_util.IsLoopExit(t.op):
                self._exit_ready(t, queue)
            else:
                queue.append(t.op)

    def _exit_ready(self, exit_t, queue):
        """A v1 loop's Exit waits until all the loop's Exits are ready.

        Then the loop is entered only if one of them got a gradient, and
        the others get zeros; with none, all go on with None.
        """
        grad_state = self.loop_state.GetGradState(exit_t.op, before=False)
        grad_state.deferred_exits.append(exit_t)
        grad_state.pending_exits_count -= 1
        if grad_state.pending_exits_count:
            return
        used = False
        for y in grad_state.deferred_exits:
            if self._has_grads(y.op):
                used = True
                queue.append(y.op)
            else:
                grad_state.unused_exits.append(y)
        for y in grad_state.unused_exits:
            if used and backprop_util.IsTrainable(y):
                self.add(y, self.loop_state.ZerosLikeForExit(y))
            queue.append(y.op)


def _check_seed_dtype(i, y, gy):
    """A seed must be a possible gradient of its y (TF's rules)."""
    if y.dtype.is_floating or y.dtype.is_integer:
        ok = gy.dtype.is_floating or gy.dtype.is_integer
        expected = "a real or integer dtype"
    elif y.dtype.is_complex:
        ok, expected = gy.dtype.is_complex, "a complex dtype"
    elif y.dtype == tf.variant:
        ok, expected = gy.dtype == tf.variant, "variant"
    elif y.dtype == tf.resource:
        # A resource y is a variable's handle; its gradient is numeric.
        ok, expected = gy.dtype != tf.resource, "a numeric dtype"
    else:
        raise TypeError(
            "Tensor %s with type %s must be numeric to obtain a default "
            "gradient. custagg.gradients: ys[%d] (%s) has no gradient; ys "
            "must be numeric." % (y, y.dtype.name, i, y.name))
    if not ok:
        # TF's wording first (code matching TF's messages keeps working).
        if y.dtype == tf.resource:
            first = ("Input gradient %s for resource tensor %s should not be "
                     "a resource" % (gy, y))
        else:
            kind, need = (("complex-valued", "real") if y.dtype.is_complex
                          else ("variant", "variant") if y.dtype == tf.variant
                          else ("real or integer-valued", "real or integer"))
            first = ("Gradient type %s generated for %s tensor %s with type "
                     "%s must be %s" % (gy.dtype.name, kind, y, y.dtype.name,
                                        need))
        raise TypeError(
            "%s. custagg.gradients: grad_ys[%d] has dtype %s but ys[%d] (%s) "
            "is %s; expected %s." % (first, i, gy.dtype.name, i, y.name,
                                     y.dtype.name, expected))


def _default_grad_ys(ys, grad_ys, colocate, gradient_uid):
    """Ones for missing seeds; checks the given ones (as tf.gradients does)."""
    # Converted together and named "grad_y" as TF does, so that constants
    # given as seeds get the same names in both.
    grad_ys = indexed_slices_lib.convert_n_to_tensor_or_indexed_slices(
        grad_ys, name="grad_y")
    seeds = []
    for i, (y, gy) in enumerate(zip(ys, grad_ys)):
        with (_tf_compat.colocate_with_for_gradient(y.op, gradient_uid)
              if colocate else contextlib.nullcontext()):
            if gy is None:
                if y.dtype.is_complex:
                    raise TypeError(
                        "Gradients of complex tensors (%s) must set grad_ys "
                        "(y.dtype = %s). custagg.gradients: pass grad_ys for "
                        "ys[%d] (%s)." % (y, y.dtype.name, i, y.name))
                seeds.append(tf.ones(tf.shape(y), dtype=y.dtype,
                                     name="grad_ys_%d" % i))
                continue
            _check_seed_dtype(i, y, gy)
            if isinstance(gy, indexed_slices_lib.IndexedSlices):
                seeds.append(indexed_slices_lib.IndexedSlices(
                    tf.identity(gy.values, name="grad_ys_%d_values" % i),
                    tf.identity(gy.indices, name="grad_ys_%d_indices" % i),
                    gy.dense_shape if gy.dense_shape is None else
                    tf.identity(gy.dense_shape, name="grad_ys_%d_shape" % i)))
                continue
            seeds.append(tf.identity(gy, name="grad_ys_%d" % i))
    return seeds


def _graph_of(ts):
    for t in ts:
        g = getattr(t, "graph", None)
        if g is not None:
            return g
    return None


def _check_same_graph(ys, xs, graph):
    if _is_func_graph(graph):
        # A function's body may use tensors of enclosing graphs (captures).
        return
    for arg, ts in (("ys", ys), ("xs", xs)):
        for i, t in enumerate(ts):
            if getattr(t, "graph", graph) is not graph:
                raise ValueError(
                    "custagg.gradients: %s[%d] (%s) is from another graph than "
                    "ys[0]; all of ys and xs must come from the same tf.Graph "
                    "(build them under one `with graph.as_default():`)."
                    % (arg, i, getattr(t, "name", t)))


def _convert_xs(xs):
    converted = []
    for i, x in enumerate(xs):
        if resource_variable_ops.is_resource_variable(x):
            x = x.handle
        errors.check_graph_tensor(x, "xs[%d]" % i, "custagg.gradients")
        converted.append(
            indexed_slices_lib.internal_convert_to_tensor_or_indexed_slices(
                x, name="x", as_ref=True))
    return converted


def gradients(ys,
              xs,
              grad_ys=None,
              name="gradients",
              colocate_gradients_with_ops=False,
              gate_gradients=False,
              aggregation_method=None,
              stop_gradients=None,
              unconnected_gradients=tf.UnconnectedGradients.NONE,
              gradient_factors=None,
              src_graph=None,
              optimize_identity_n=False):
    """Symbolic derivatives of `ys` w.r.t. `xs`; a drop-in for `tf.gradients`.

    Without `gradient_factors` this returns what `tf.compat.v1.gradients`
    returns: `sum over ys of d y / d x` for each `x` (seeded by `grad_ys`).

    With `aggregation_method=AggregationMethod.CUSTOM` and `gradient_factors`
    `f` of shape `[B]`, it returns, for each `x`,
    `sum_i f[i] * d ys_i / d x`, the per-example terms being either

    * `ys` given as a list of B per-example tensors, typically
      `[loss[i] for i in range(B)]` (slices of one tensor are recognized and
      differentiated in a single backward pass from that tensor), or
    * `ys` given as one tensor (or a one-element list) of rank >= 1 whose
      leading axis is the batch, e.g. a per-example loss `[B]`.

    `grad_ys`, if also given, multiplies in. Integer factors are cast to the
    dtype of `ys`. The gradients are of the terms as given: a mean loss
    scales each example's term by 1/B.

    Args:
      ys: a `Tensor` or list of tensors to differentiate.
      xs: a `Tensor`, `Variable` or list of them, to differentiate against.
      grad_ys: optional list aligned with `ys`: the seeds (default ones).
      name: name scope for the gradient ops.
      colocate_gradients_with_ops: place each gradient op with its forward op.
      gate_gradients: add a `tf.tuple` around each op's input gradients.
      aggregation_method: an `AggregationMethod` (or `tf.AggregationMethod`)
        value.
      stop_gradients: tensors held constant (not differentiated through).
      unconnected_gradients: `tf.UnconnectedGradients.NONE` (give `None`) or
        `ZERO` (give zeros) for xs the ys do not depend on.
      gradient_factors: `[B]` tensor of per-example factors, only with
        `CUSTOM`; usually a `tf.compat.v1.placeholder` fed each step.
      src_graph: the graph ys and xs are in, when the gradient is built in
        another one (TF's internal gradients helper takes it: cond_v2,
        while_v2 and tf.function build a function body's gradient inside a
        new function graph). Called functions are looked up there and its
        enclosing function graphs' captures are followed; the gradient ops
        go into the default graph. Default: the default graph (and, outside
        function graphs, custagg builds in the graph of ys).
      optimize_identity_n: TF's internal helper's option: an `IdentityN`
        output with no gradient gives its input `None` instead of zeros.

    Returns:
      A list aligned with `xs` of `Tensor`, `IndexedSlices` or `None`.

    Raises:
      RuntimeError: in eager mode (graph mode is needed).
      ValueError / TypeError: bad `aggregation_method`, `gradient_factors`,
        `unconnected_gradients`, or ys/xs from different graphs.

    Example:
      >>> x = tf.compat.v1.placeholder(tf.float32, [4, 3])
      >>> w = tf.compat.v1.get_variable("w", [3, 1])
      >>> loss = tf.reshape(tf.matmul(x, w), [4])     # per-example loss
      >>> f = tf.compat.v1.placeholder(tf.float32, [4])
      >>> g, = custagg.gradients([loss[i] for i in range(4)], [w],
      ...     aggregation_method=custagg.AggregationMethod.CUSTOM,
      ...     gradient_factors=f)                    # sum_i f[i] x_i
    """
    aggregation.check_factors_usage(aggregation_method, gradient_factors)
    sum_method = aggregation.check_method(aggregation_method)
    try:
        unconnected_gradients = tf.UnconnectedGradients(unconnected_gradients)
    except ValueError:
        raise ValueError(
            "Unknown value for unconnected_gradients: '%s'. "
            "custagg.gradients: expected tf.UnconnectedGradients.NONE or ZERO "
            "(or 'none' / 'zero')." % (unconnected_gradients,))

    # Resource variables are differentiated through their handles (ys are
    # read); ref variables convert to their ref tensor / snapshot below.
    ys = _as_list(ys)
    y_kinds = _one_per_class(ys)
    if any(isinstance(y, tf.Variable) for y in y_kinds):
        ys = [tf.convert_to_tensor(y) if isinstance(y, tf.Variable) else y
              for y in ys]
        y_kinds = _one_per_class(ys)
    xs = [x.handle if resource_variable_ops.is_resource_variable(x) else x
          for x in _as_list(xs)]
    stop_gradients = [] if stop_gradients is None else _as_list(stop_gradients)
    grad_ys = [None] * len(ys) if grad_ys is None else _as_list(grad_ys)
    if len(grad_ys) != len(ys):
        raise ValueError(
            "Length mismatch. Passed %d grad_ys for %d ys. custagg.gradients: "
            "pass one seed (or None) per y." % (len(grad_ys), len(ys)))
    args = _Args(name, colocate_gradients_with_ops, gate_gradients,
                 aggregation_method, sum_method, stop_gradients,
                 unconnected_gradients, gradient_factors, src_graph,
                 optimize_identity_n)
    # As in tf.gradients, composite grad_ys alone (an IndexedSlices seed)
    # do not take this path: they are kept as they are.
    if any(isinstance(t, composite_tensor.CompositeTensor)
           for t in y_kinds + xs):
        return _composite_gradients(ys, xs, grad_ys, args)
    return _tensor_gradients(ys, xs, grad_ys, args, y_kinds)


# The checked arguments of one gradients call, passed on unchanged.
_Args = collections.namedtuple("_Args", [
    "name", "colocate", "gate", "aggregation_method", "sum_method",
    "stop_gradients", "unconnected", "gradient_factors", "src_graph",
    "optimize_identity_n"])


def _composite_gradients(ys, xs, grad_ys, args):
    """Gradients for composite tensors (RaggedTensor, IndexedSlices, ...).

    Each composite stands for the tensors TF differentiates it by (its
    `__composite_gradient__` components, e.g. a RaggedTensor's flat values);
    the gradients of those are put back into the composite's structure, as
    `tf.gradients` does.
    """
    if args.aggregation_method == AggregationMethod.CUSTOM and any(
            isinstance(y, composite_tensor.CompositeTensor) for y in ys):
        raise TypeError(
            "custagg.gradients: with AggregationMethod.CUSTOM, ys must be "
            "Tensors (per-example terms); got a %s. Convert it to a dense "
            "[B] tensor of per-example losses first." % type(
                [y for y in ys if isinstance(
                    y, composite_tensor.CompositeTensor)][0]).__name__)
    flat = composite_tensor_gradient.get_flat_tensors_for_gradients
    flat_grads = _tensor_gradients(flat(ys), flat(xs), flat(grad_ys), args)
    return composite_tensor_gradient.replace_flat_tensors_for_gradients(
        xs, flat_grads)


def _tensor_gradients(ys, xs, grad_ys, args, y_kinds=None):
    """`gradients` once ys, xs and grad_ys hold no composite tensors.

    `y_kinds`: `_one_per_class(ys)` when the caller has it.
    """
    if y_kinds is None:
        y_kinds = _one_per_class(ys)
    # Per class first: B slices are all graph Tensors.
    if any(isinstance(y, ops.EagerTensor) for y in y_kinds):
        errors.check_graph_tensors(ys, "ys", "custagg.gradients")
    graph = _graph_of(ys) or ops.get_default_graph()
    if args.src_graph is None:
        _check_same_graph(ys, xs, graph)

    # TF builds in the default graph; custagg outside function graphs (and
    # without src_graph) in the graph of ys.
    with graph.as_default() if not (
            _is_func_graph(ops.get_default_graph()) or
            args.src_graph is not None) else contextlib.nullcontext():
        # The v1 name scope, as tf.gradients: name=None means "gradients",
        # name="" means the root scope.
        with ops.name_scope_v1(args.name, "gradients") as scope_name:
            gradient_uid = ops.get_default_graph().unique_name("uid")
            # Graph tensors convert to themselves: skip the conversion
            # machinery for them (the CUSTOM list form passes B slices).
            # Eager tensors (inside a tf.function) are captured by it.
            if not all(isinstance(y, tf.Tensor) and
                       not isinstance(y, ops.EagerTensor) for y in y_kinds):
                ys = indexed_slices_lib.convert_n_to_tensor_or_indexed_slices(
                    ys, name="y")
            xs = _convert_xs(xs)
            if args.aggregation_method == AggregationMethod.CUSTOM:
                with tf.name_scope("custom_seeds"):
                    ys, grad_ys = aggregation.custom_seeds(
                        ys, grad_ys, args.gradient_factors)
            grad_ys = _default_grad_ys(ys, grad_ys, args.colocate,
                                       gradient_uid)
            backprop = _Backprop(ops.get_default_graph(), ys, xs,
                                 args.stop_gradients, args.colocate,
                                 args.gate, args.sum_method, gradient_uid,
                                 scope_name, args.src_graph,
                                 args.optimize_identity_n)
            backprop.run(ys, grad_ys)
        # Outside the name scope, as in tf.gradients: the zeros made for
        # unconnected xs (unconnected_gradients=ZERO) get the same names.
        return [backprop.result(x, args.unconnected) for x in xs]
