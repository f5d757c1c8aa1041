"""Function bodies of v2 control flow and calls, and what a loop keeps."""

from __future__ import annotations

from custagg import _tf_compat


class FunctionNotFound(ValueError):
    """An op's function attr names no function of its graph (or of the
    graphs around it). `op` is the op."""

    def __init__(self, message, op=None):
        super().__init__(message)
        self.op = op


def _named(op, name):
    """The FuncGraph of function `name`, looked up from `op`'s graph
    outwards, or None."""
    graph = op.graph
    while graph is not None:
        func = _tf_compat.get_function(graph, name)
        if func is not None and getattr(func, "graph", None) is not None:
            return func.graph
        graph = getattr(graph, "outer_graph", None)
    return None


def nested_ops(op):
    """The ops inside `op`'s functions (a While's body and cond, a cond's
    branches, a call's function), and inside theirs, recursively."""
    for value in op.node_def.attr.values():
        names = ([value.func.name] if value.HasField("func") else
                 [f.name for f in value.list.func])
        for name in names:
            graph = _named(op, name)
            for inner in graph.get_operations() if graph is not None else ():
                yield inner
                yield from nested_ops(inner)


def func_graph(op, attr):
    """The FuncGraph of `op`'s function attr `attr` ("body", "cond", "f").

    Looked up in `op`'s graph and the graphs around it (a loop inside a
    function body).

    Raises:
      FunctionNotFound: naming the op and the function.
    """
    name = op.get_attr(attr).name
    graph = _named(op, name)
    if graph is not None:
        return graph
    raise FunctionNotFound(
        "cannot find the %s function '%s' of op '%s' (type %s)"
        % (attr, name, op.name, op.type), op)


def is_accumulator(op, body, k):
    """Whether loop variable k of While `op` only collects an intermediate
    for a gradient: an empty TensorList in, one push per iteration.

    Args:
      op: the While op.
      body: its body FuncGraph (`func_graph(op, "body")`).
      k: the loop variable's position.
    """
    out = body.outputs[k]
    return (op.inputs[k].op.type == "EmptyTensorList" and
            out.op.type == "TensorListPushBack" and
            out.op.inputs[0] is body.inputs[k])


def own_loop_variables(op, body):
    """The positions of While `op`'s own loop variables: its original
    outputs (`_num_original_outputs`: a gradient built before may have added
    more) less the accumulators of intermediates (`is_accumulator`), which
    a gradient may also have counted as original."""
    try:
        n = op.get_attr("_num_original_outputs")
    except ValueError:
        n = len(op.outputs)
    return [k for k in range(n) if not is_accumulator(op, body, k)]
