"""One reverse pass of `custagg.gradients`: pending counts and the ready queue.

`Backprop` finds the ops between `ys` and `xs` (through the captures of
enclosing function graphs), counts for each op the consumers on a path to
`ys` that have yet to send their contribution (`pending`), and visits an op
once that count is zero: it sums the contributions per output
(`aggregation.aggregate_contributions`), calls the op's registered gradient
function (`op_gradients`) and sends the results to the op's inputs. v1
while loops go through TF's loop-state object (`control_flow_state`), which
the pass enters and leaves around each op. `gradients.py` checks and
converts the arguments, seeds the pass and reads its results.
"""

from __future__ import annotations

import collections
import contextlib

import tensorflow as tf

from custagg import _tf_compat
from custagg import op_kinds
from custagg.traversal import aggregation
from custagg.traversal import op_gradients
from custagg._tf_compat import backprop_util
from custagg._tf_compat import control_flow_state
from custagg._tf_compat import control_flow_util
from custagg._tf_compat import default_gradient
from custagg._tf_compat import object_identity
from custagg._tf_compat import ops
from custagg._tf_compat import resource_variable_ops


def is_func_graph(graph):
    return isinstance(graph, ops.Graph) and _tf_compat.building_function(graph)


def _outer_value(t):
    """For a placeholder that captures an outer tensor, that outer tensor."""
    # A function traced from eager code captures EagerTensors, which have no
    # op: they are where the walk outwards ends.
    if isinstance(t, ops.EagerTensor):
        return t
    graph = t.op.graph
    if is_func_graph(graph) and t.op.type == "Placeholder":
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


class Backprop(object):
    """State of one reverse pass: what is between ys and xs, and what is pending."""

    def __init__(self, graph, ys, xs, stop_tensors, colocate, gate,
                 sum_method, gradient_uid, scope_name, src_graph=None,
                 optimize_identity_n=False, skip_unneeded_captures=False):
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
        # custagg's option: v2 While gradients leave out the captures on
        # no path from xs (`_unneeded_captures`).
        self.skip_unneeded_captures = skip_unneeded_captures
        self.xs = xs
        self.xs_set = object_identity.ObjectIdentitySet(xs)
        self.colocate = colocate
        self.gate = gate
        self.sum_method = sum_method
        self.gradient_uid = gradient_uid
        # FuncGraphs enclosing the default graph: their captures are inputs.
        self.func_graphs = []
        g = self.src_graph
        while is_func_graph(g):
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
        if not is_func_graph(op.graph):
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
                                 self.gradient_uid, self.scope_name,
                                 skip=self._unneeded_captures(op))

    def _unneeded_captures(self, op):
        """For a v2 While: the indices of its inputs on no path from xs
        (their gradients would be dropped), which TF's While gradient then
        does not build (`skip_input_indices`: a weight captured by an RNN
        whose per-example rule reads the taps, not the loop's own
        `sum_b a_bt^T dz_bt` per step and its accumulated `a_t`); else
        None."""
        if not self.skip_unneeded_captures or \
                op.type not in op_kinds.V2_LOOPS:
            return None
        return [i for i, t in enumerate(self.inputs(op))
                if isinstance(t, ops.EagerTensor) or t.op not in self.between]

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
