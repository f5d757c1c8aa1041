"""Which ops the per-example rules may see through, and what the loss depends on.

The rules find, for each x, the ops where x's value is used (a `MatMul`'s
weight input, a `GatherV2`'s table), looking through ops that only carry the
value on (`ReadVariableOp`, `Identity`, `Cast`, `Reshape`, ...). Seeing
through an op is a shortcut: it assumes the op's gradient is the standard
one (the incoming gradient, cast or reshaped back). That holds only when

* the op has no gradient override (`gradient_override_map` or
  `tf.custom_gradient` set a `_gradient_op_type` attribute on it),
* values stay floating point along the way (an integer `Cast` has no
  gradient: TF gives `None`),
* the op is on a differentiable path to the loss (not under
  `tf.stop_gradient`, not cut by an op whose gradient is `None`).

Ops that fail a check are not seen through: the rules treat them as
ordinary consumers (an op without batch data is differentiated with its own,
possibly overridden, gradient; others need a rule or fall back to pfor).
A rule's own op with a gradient override is not handled by the rule either:
the rule implements the standard gradient.

`live_ops(loss)` gives the ops gradients reach from the loss, as
`tf.gradients` walks them: an x none of them uses gets `None`.
"""

from __future__ import annotations

import weakref

from custagg import op_kinds
from custagg._tf_compat import backprop_util
from custagg._tf_compat import ops
from custagg.rules import sparse_segments


def gradient_override(op):
    """The gradient type `op` is overridden to (bytes), or None."""
    try:
        return op.get_attr("_gradient_op_type")
    except ValueError:
        return None


def _has_no_gradient(op):
    """True when TF gives `op` no gradient (`tf.no_gradient`, StopGradient,
    an override to such a type). Unregistered ops (function calls, ops TF
    will refuse) count as differentiable: TF decides for them."""
    try:
        return ops.get_gradient_function(op) is None
    except LookupError:
        return False


def _float_or_handle(t):
    return t.dtype.is_floating or t.dtype.base_dtype.name == "resource"


def passes_through(op, k, live):
    """Whether the rules may see through input `k` of `op` to its output.

    Ops that keep the value (`op_kinds.KEEPS_VALUES`: between a parameter
    and its user they change neither values nor, up to a reshape, layout),
    and a table lookup that feeds only sparse segment reductions
    (`sparse_segments.lookup_into_segments`: feature columns'
    `embedding_lookup_sparse`), whose rule keys rows by table row."""
    if k != 0 or op not in live:
        return False
    if op.type not in op_kinds.KEEPS_VALUES and not (
            sparse_segments.lookup_into_segments(op)):
        return False
    if gradient_override(op) is not None:
        return False
    return (_float_or_handle(op.inputs[0]) and len(op.outputs) == 1
            and op.outputs[0].dtype.is_floating)


class _Live(object):
    """The ops gradients reach from one loss, and the tensors they reach."""

    def __init__(self, loss):
        self.ops = set()
        self.tensors = set()      # refs of the tensors a gradient reaches
        self.tensors.add(loss.ref())
        stack = [loss.op]
        while stack:
            op = stack.pop()
            if op in self.ops:
                continue
            self.ops.add(op)
            if _has_no_gradient(op):
                continue
            for t in op.inputs:
                if backprop_util.IsTrainable(t):
                    self.tensors.add(t.ref())
                    stack.append(t.op)

    def __contains__(self, op):
        return op in self.ops and not _has_no_gradient(op)

    def reaches(self, t):
        """Whether a gradient of the loss reaches tensor `t`."""
        return t.ref() in self.tensors


# graph -> {(loss ref, graph version): _Live}
_CACHE = weakref.WeakKeyDictionary()


def live_ops(loss):
    """A `_Live` for `loss` (cached until the graph grows): `op in live` is
    True for ops that pass a gradient from the loss on to their inputs."""
    per_graph = _CACHE.setdefault(loss.graph, {})
    key = (loss.ref(), loss.graph.version)
    live = per_graph.get(key)
    if live is None:
        per_graph.clear()
        live = per_graph[key] = _Live(loss)
    return live
