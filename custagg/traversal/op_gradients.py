"""Finding and calling the gradient function of one op.

The traversal (`custagg.gradients`) decides when each op is visited and sums
what it receives; this module does what happens at one op, holding no state
of the pass:

* `lookup`: which gradient function TF would use for the op (the registry
  under `_gradient_op_type` or the op type, a called function's Python
  gradient, or none: then a `SymbolicGradient` node is built);
* `call`: calls it under the op's gradient name scope, with TF's
  `original_op` and XLA attributes, checks that it gave one gradient per
  input, and gates the results with `tf.tuple` when asked.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from custagg import _tf_compat
from custagg import op_kinds
from custagg._tf_compat import attr_value_pb2
from custagg._tf_compat import default_gradient
from custagg._tf_compat import gen_functional_ops
from custagg._tf_compat import ops


def is_partitioned_call(op):
    return op.type in op_kinds.CALLS


def lookup(op, src_graph):
    """(gradient function, function-call flag, called function) for `op`.

    Order as in TF: a function set on the op (v2 control flow, tf.function
    call sites); the registry under `_gradient_op_type` (gradient_override_map,
    tf.custom_gradient) or the op type; then a function call's Python
    gradient or, failing that (None), a SymbolicGradient node. Functions are
    looked up in `src_graph` and the graphs enclosing it.
    """
    is_call = (_tf_compat.is_function(src_graph, op.type)
               or is_partitioned_call(op))
    try:
        return ops.get_gradient_function(op), is_call, None
    except LookupError:
        if not is_call:
            raise LookupError(
                "No gradient defined for operation'%s' (op type: %s). "
                "custagg.gradients: register one with "
                "@tf.RegisterGradient(%r), or wrap the op's input in "
                "tf.stop_gradient if it should be treated as a constant."
                % (op.name, op.type, op.type))
    func = called_function(op, src_graph)
    func = getattr(op, "__defun", func)
    return (_tf_compat.python_grad_func(func) if func is not None
            else None), True, func


def called_function(op, src_graph):
    """The function a call op runs, from `src_graph` or an enclosing graph."""
    name = op.get_attr("f").name if is_partitioned_call(op) else op.type
    g = src_graph
    while g is not None:
        func = _tf_compat.get_function(g, name)
        if func is not None:
            return func
        g = getattr(g, "outer_graph", None)
    return None


def call(op, grad_fn, func, out_grads, graph, src_graph, gate, gradient_uid,
         scope_name, skip=None):
    """The input gradients of `op` for its output gradients `out_grads`.

    Args:
      op: the forward op.
      grad_fn: its gradient function, or None for a function call without
        one (a SymbolicGradient node is built).
      func: the called function, for call ops (its XLA attributes count).
      out_grads: one gradient per output (zeros already in place where the
        gradient function needs a tensor).
      graph: where the gradient ops go; `src_graph`: the graph of `op`.
      gate: group the input gradients with `tf.tuple`.
      gradient_uid, scope_name: of this gradients call (colocation, the
        XLA scope of separately compiled gradients).
      skip: indices of inputs whose gradients are not wanted, told to the
        gradient function as `op.skip_input_indices` (as TF's eager tape
        does; while_v2's gradient then leaves those captures out).

    Returns:
      A list with one gradient (or None) per input of `op` (While ops may
      return more: they grow inputs while their gradient is built).
    """
    with tf.name_scope(op.name + "_grad"):
        with _tf_compat.original_op(src_graph, op):
            with _xla_scope(op, func, graph, scope_name):
                if grad_fn is not None and skip:
                    op.skip_input_indices = skip
                    try:
                        in_grads = grad_fn(op, *out_grads)
                    finally:
                        del op.skip_input_indices
                elif grad_fn is not None:
                    in_grads = grad_fn(op, *out_grads)
                else:
                    in_grads = symbolic_gradient(op, out_grads)
            in_grads = (list(in_grads) if isinstance(in_grads, (list, tuple))
                        else [in_grads])
            if op.type not in op_kinds.V2_LOOPS and \
                    len(in_grads) != len(op.inputs):
                raise ValueError(
                    "Num gradients %d generated for op %s do not match "
                    "num inputs %d. custagg.gradients: the gradient "
                    "function of op '%s' (type %s) must return one "
                    "gradient (or None) per input."
                    % (len(in_grads), op.node_def, len(op.inputs),
                       op.name, op.type))
            if gate and sum(g is not None for g in in_grads) > 1:
                with tf.device(None):
                    with _tf_compat.colocate_with_for_gradient(
                            None, gradient_uid, ignore_existing=True):
                        in_grads = tf.tuple(in_grads)
    return in_grads


def symbolic_gradient(op, out_grads):
    """A SymbolicGradient node for a function call without a Python gradient."""
    fn = attr_value_pb2.NameAttrList()
    fn.name = op.get_attr("f").name if is_partitioned_call(op) else op.type
    for key in op.node_def.attr:
        fn.attr[key].CopyFrom(op.node_def.attr[key])
    return gen_functional_ops.symbolic_gradient(
        input=list(op.inputs) + list(out_grads),
        Tout=[default_gradient.get_zeros_dtype(t) for t in op.inputs],
        f=fn)


@contextlib.contextmanager
def _xla_scope(op, func, graph, scope_name):
    """Gradients of XLA-compiled ops are compiled too (as TF does)."""
    try:
        attrs = (_tf_compat.function_def(func).attr if func is not None
                 else None)
        if attrs is not None:
            compile_ = attrs["_XlaCompile"].b
            separate = attrs["_XlaSeparateCompiledGradients"].b
            scope = attrs["_XlaScope"].s.decode()
        else:
            compile_ = op.get_attr("_XlaCompile")
            separate = op.get_attr("_XlaSeparateCompiledGradients")
            scope = op.get_attr("_XlaScope").decode()
    except (ValueError, KeyError, AttributeError):
        compile_ = False
    if not compile_:
        yield
        return
    if separate:
        scope = "%s_grad_%s" % (scope,
                                scope_name.rstrip("/").replace("/", "_"))
    new_attrs = {"_XlaCompile": attr_value_pb2.AttrValue(b=True),
                 "_XlaScope": attr_value_pb2.AttrValue(s=scope.encode())}
    with _tf_compat.attr_scope(graph, new_attrs):
        yield
