"""The forward walk from a tensor that the planners share."""


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
