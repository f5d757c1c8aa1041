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

This module checks and converts the arguments, seeds the pass (ones, or
CUSTOM's weighted seeds) and reads the results; the pass itself, pending
counts, ready queue and the step of each op, is `backprop.Backprop`.
"""

from __future__ import annotations

import collections
import contextlib
import operator

import tensorflow as tf

from custagg import _tf_compat
from custagg.traversal import aggregation
from custagg import errors
from custagg._tf_compat import composite_tensor
from custagg._tf_compat import composite_tensor_gradient
from custagg._tf_compat import indexed_slices as indexed_slices_lib
from custagg._tf_compat import ops
from custagg._tf_compat import resource_variable_ops
from custagg.traversal.aggregation import AggregationMethod
# The pass itself (pending counts, ready queue, per-op step) is in
# backprop.py; `_Backprop` stays readable here as before the split.
from custagg.traversal.backprop import Backprop as _Backprop
from custagg.traversal.backprop import is_func_graph as _is_func_graph


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
              optimize_identity_n=False,
              skip_unneeded_captures=False):
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
      skip_unneeded_captures: tell each v2 `While`'s gradient which of its
        inputs lie on no path from xs (`op.skip_input_indices`, as TF's
        eager tape does), so its gradient loop leaves those captures out
        (an RNN weight when only the taps' gradients are asked for). Off by
        default: `tf.compat.v1.gradients` builds them, and without it the
        graph is TF's op for op. The per-example engine's passes turn it on.

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
                 optimize_identity_n, skip_unneeded_captures)
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
    "optimize_identity_n", "skip_unneeded_captures"])


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
                                 args.optimize_identity_n,
                                 args.skip_unneeded_captures)
            backprop.run(ys, grad_ys)
        # Outside the name scope, as in tf.gradients: the zeros made for
        # unconnected xs (unconnected_gradients=ZERO) get the same names.
        return [backprop.result(x, args.unconnected) for x in xs]
