"""Reachability in a TF1 graph: the one module every analysis walks with.

Every walk here follows data edges between ops (and, where asked, control
edges); none knows what a batch is. The batch-aware walks (which axis holds
the examples) are in `custagg.batch_axis` and call these for the region
they may visit.
"""

from __future__ import annotations

import collections
import weakref

from custagg._tf_compat import backprop_util
from custagg._tf_compat import gradient_registry


def upstream(tensors, control=False, stop_types=frozenset(),
             stop_tensors=frozenset(), skip=frozenset()):
    """The ops `tensors` depend on.

    Args:
      tensors: where to start (their producing ops are included).
      control: follow control edges too.
      stop_types: op types whose inputs are not followed (the op itself is
        included): what an assert checks, for instance.
      stop_tensors: refs of tensors not followed (bound values: a loop's
        variables); neither they nor what they depend on are included unless
        reached another way.
      skip: ops left out and not walked through (a v1 frame's Merge/Switch,
        which control edges reach).

    Returns:
      A set of ops.
    """
    seen = set(skip)
    stack = [t.op for t in tensors if t.ref() not in stop_tensors]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if op.type not in stop_types:
            stack.extend(t.op for t in op.inputs
                         if t.ref() not in stop_tensors)
        if control:
            stack.extend(op.control_inputs)
    return seen - set(skip)


def ancestors(t):
    """Ops the tensor `t` depends on through data inputs (its own op too)."""
    return upstream([t])


def downstream(tensors, stop_types=frozenset(), within=None):
    """The ops that read `tensors`, directly or through other ops' outputs.

    Args:
      tensors: where to start (their producers are not included).
      stop_types: op types left out and not walked through.
      within: a set of ops the walk stays in (None: the whole graph).

    Returns:
      A set of ops.
    """
    seen = set()
    queue = collections.deque(c for t in tensors for c in t.consumers())
    while queue:
        op = queue.popleft()
        if op in seen or op.type in stop_types or (
                within is not None and op not in within):
            continue
        seen.add(op)
        for out in op.outputs:
            queue.extend(out.consumers())
    return seen


def depth_first(start, seen=None):
    """Visits `start` and what the caller pushes, each tensor once.

    Yields `(t, stack)`: the caller appends to `stack` the tensors to visit
    after `t`. `seen` (a set of `tensor.ref()`, filled as tensors are
    visited) lets the caller ask whether a tensor was reached.
    """
    seen = set() if seen is None else seen
    stack = [start]
    while stack:
        t = stack.pop()
        if t.ref() in seen:
            continue
        seen.add(t.ref())
        yield t, stack


def in_creation_order(ops, graph):
    """`ops` (a set) as a list in the order `graph` created them."""
    return [op for op in graph.get_operations() if op in ops]


def blocks_gradient(op):
    """StopGradient, and ops registered with no gradient (tf.no_gradient)."""
    if op.type == "StopGradient":
        return True
    try:
        return gradient_registry.lookup(op.type) is None
    except LookupError:
        return False


def has_replaced_gradient(op):
    """Whether `op`'s gradient was replaced (tf.custom_gradient,
    gradient_override_map)."""
    try:
        op.get_attr("_gradient_op_type")
    except ValueError:
        return False
    return True


# graph -> {(loss ref, graph version): refs}. Weak on the graph, and keyed
# on its version (it grows as ops are added), so no answer outlives the
# graph it was about or depends on an earlier call's graph.
_GRADIENT_PATHS = weakref.WeakKeyDictionary()


def gradient_paths(loss, loss_ancestors=None):
    """Refs of the tensors a gradient of `loss` flows back into.

    Not through StopGradient or ops without a gradient, nor along integer
    or boolean tensors (`tf.shape(z)` feeding a reshape, an argmax): a
    batch statistic taken under `tf.stop_gradient` couples nothing.

    Args:
      loss: a tensor.
      loss_ancestors: `ancestors(loss)` (computed if None).

    Returns:
      A frozenset of `tensor.ref()`.
    """
    graph = loss.graph
    key = (loss.ref(), graph.version)
    cache = _GRADIENT_PATHS.setdefault(graph, {})
    if key in cache:
        return cache[key]
    if loss_ancestors is None:
        loss_ancestors = ancestors(loss)
    live = set()
    queue = collections.deque([loss])
    while queue:
        t = queue.popleft()
        if t.ref() in live:
            continue
        live.add(t.ref())
        if blocks_gradient(t.op):
            continue
        queue.extend(i for i in t.op.inputs if i.op in loss_ancestors
                     and backprop_util.IsTrainable(i))
    cache.clear()       # one loss at a time is what the planners ask about
    cache[key] = frozenset(live)
    return cache[key]
