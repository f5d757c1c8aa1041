"""Symbolic shapes: what a dynamic dimension is, in terms of other ones.

The batch-axis analysis (`custagg.batch_axis`) must prove, for a graph
built on `[None, ...]` placeholders, that a `Reshape` keeps each example's
entries together. TF's static shapes say `(None, None)` for the reshape in
`tf.nn.softmax_cross_entropy_with_logits`; the target it reshapes to,
though, is built from `tf.shape(logits)` and constants, so its value is
known as an expression of `logits`'s own dimensions. This module evaluates
such shape tensors symbolically.

A dimension is a `Dim`: an integer coefficient times a product of symbols,
each symbol standing for one unknown dimension `(tensor name, axis)`. Two
`Dim`s that compare equal are equal at run time; unequal ones may still be
equal (the analysis then refuses, which is the safe side). `None` means
"nothing known".
"""

from __future__ import annotations

import collections

import tensorflow as tf

from custagg import op_kinds
from custagg._tf_compat import tensor_util


class Dim(collections.namedtuple("Dim", ["coef", "factors"])):
    """`coef * prod(factors)`; `factors` a sorted tuple of symbol keys."""

    @classmethod
    def of(cls, value):
        return cls(int(value), ())

    @property
    def static(self):
        """The int value when no symbol is involved, else None."""
        return None if self.factors else self.coef

    def __mul__(self, other):
        return Dim(self.coef * other.coef,
                   tuple(sorted(self.factors + other.factors)))

    def divide(self, other):
        """`self / other` when it is a Dim (exact), else None."""
        if other.coef == 0 or self.coef % other.coef:
            return None
        rest = list(self.factors)
        for f in other.factors:
            if f not in rest:
                return None
            rest.remove(f)
        return Dim(self.coef // other.coef, tuple(rest))


ONE = Dim(1, ())
# The `-1` of a reshape target ("whatever makes the sizes agree").
WILDCARD = Dim(-1, ())


def product(dims):
    out = ONE
    for d in dims:
        if d is None:
            return None
        out = out * d
    return out


def _symbol(t, axis):
    return Dim(1, (("%s" % t.name, axis),))


class ShapeCache(object):
    """Memoized `shape(t)` and `value(t)` for one analysis."""

    def __init__(self):
        self._shapes = {}
        self._values = {}

    # -- shapes --

    def shape(self, t):
        """List of `Dim` (one per axis) for tensor `t`, or None (rank unknown)."""
        key = t.ref()
        if key not in self._shapes:
            self._shapes[key] = None      # guards against cycles (loops)
            self._shapes[key] = self._shape(t)
        return self._shapes[key]

    def _static_shape(self, t):
        if t.shape.rank is None:
            return None
        return [Dim.of(d) if d is not None else _symbol(t, i)
                for i, d in enumerate(t.shape.as_list())]

    def _shape(self, t):
        static = self._static_shape(t)
        op = t.op
        if op.type == "Reshape" and t.value_index == 0:
            target = self.value(op.inputs[1])
            if target is not None:
                return self._resolve_target(op.inputs[0], target, static)
        if op.type == "Transpose" and t.value_index == 0:
            return _merge(static, self._transposed(op))
        if op.type == "Slice" and t.value_index == 0:
            return _merge(static, self._sliced(op))
        if op.type == "Split":
            return _merge(static, self._split(op))
        if op.type == "MatMul" and t.value_index == 0:
            return _merge(static, self._matmul(op))
        if (op.type in op_kinds.SAME_SHAPE and t.value_index == 0 and op.inputs
                and op.inputs[0].dtype != tf.resource):
            inner = self.shape(op.inputs[0])
            if inner is not None and (static is None or
                                      len(inner) == len(static)):
                return _merge(static, inner)
        return static

    def _transposed(self, op):
        """`tf.transpose(x, perm)`: x's dims in the order of a constant perm
        (`tf.tensordot` moves its contracted axes last, often by the
        identity perm)."""
        inner = self.shape(op.inputs[0])
        perm = _ints(self, op.inputs[1])
        if inner is None or not isinstance(perm, list) or \
                sorted(perm) != list(range(len(inner))):
            return None
        return [inner[k] for k in perm]

    def _sliced(self, op):
        """`tf.slice(x, begin, size)`: `size`, its -1 entries ("to the end")
        worked out as x's dim minus `begin` where that is known (nce_loss
        slices `[n, -1]` off its gathered weights: the width stays D)."""
        inner = self.shape(op.inputs[0])
        begin, size = self.value(op.inputs[1]), self.value(op.inputs[2])
        if not isinstance(size, list) or not isinstance(begin, list) or \
                inner is None or not len(inner) == len(size) == len(begin):
            return None
        dims = []
        for d, b, n in zip(inner, begin, size):
            if n is None or n != WILDCARD:
                dims.append(n)
            elif b is not None and b.static == 0:
                dims.append(d)
            elif d is not None and d.static is not None and \
                    b is not None and b.static is not None:
                dims.append(Dim.of(d.static - b.static))
            else:
                dims.append(None)
        return dims

    def _split(self, op):
        """Each output of `tf.split(x, n, axis)`: x's dims with that axis
        divided by n (the op requires it to divide)."""
        inner = self.shape(op.inputs[1])
        axis = _ints(self, op.inputs[0])
        if inner is None or not isinstance(axis, int) or \
                not -len(inner) <= axis < len(inner):
            return None
        dims = list(inner)
        axis %= len(dims)
        if dims[axis] is None:
            return None
        dims[axis] = dims[axis].divide(Dim.of(op.get_attr("num_split")))
        return dims

    def _matmul(self, op):
        """`[M, K] x [K, N]` -> `[M, N]` (transposes read from the attrs)."""
        a, b = self.shape(op.inputs[0]), self.shape(op.inputs[1])
        if a is None or b is None or len(a) != 2 or len(b) != 2:
            return None
        rows = a[1] if op.get_attr("transpose_a") else a[0]
        cols = b[0] if op.get_attr("transpose_b") else b[1]
        return [rows, cols]

    def _resolve_target(self, x, target, static):
        """The output shape of reshape(x, target), the -1 worked out."""
        if not isinstance(target, list) or (
                static is not None and len(static) != len(target)):
            return static
        dims = list(target)
        if WILDCARD in dims:
            k = dims.index(WILDCARD)
            others = product(dims[:k] + dims[k + 1:])
            total = product(self.shape(x) or [None])
            dims[k] = (total.divide(others)
                       if total is not None and others is not None else None)
            if dims[k] is None:
                dims[k] = static[k] if static is not None else None
        return _merge(static, dims)

    # -- equalities checked at run time --

    def equal(self, a, b, at):
        """Whether `Dim`s a and b are equal whenever op `at` runs.

        Equal as expressions, or once the run-time checks `at` depends on
        are taken into account: a `tf.debugging.assert_equal` of two
        shape vectors (`Assert(All(Equal(u, v)))`, which
        `sparse_softmax_cross_entropy_with_logits` adds between the labels'
        shape and the logits' for logits of rank 3) equates their entries
        in every run where `at` runs, since the assert is among its
        ancestors (data or control) and a failed one stops the run. Only
        entries that are single symbols or ints are equated."""
        if a is None or b is None:
            return False
        if a == b:
            return True
        find = self._checked(at)
        return find is not None and _canonical(a, find) == \
            _canonical(b, find)

    def _checked(self, op):
        """The union-find (a `find` function) of the equalities that the
        asserts among `op`'s ancestors check, or None if there are none."""
        asserts = [a for a in op.graph.get_operations()
                   if a.type == "Assert" and _equal_operands(a)]
        if not asserts:
            return None
        wanted = set(asserts)
        found = []
        seen = set()
        stack = [op]
        while stack and wanted:
            o = stack.pop()
            if o in seen:
                continue
            seen.add(o)
            if o in wanted:
                wanted.discard(o)
                found.append(o)
            stack.extend(t.op for t in o.inputs)
            stack.extend(o.control_inputs)
        if not found:
            return None
        parent = {}

        def find(node):
            while parent.get(node, node) != node:
                node = parent[node]
            return node

        for a in found:
            u, v = _equal_operands(a)
            left, right = self.value(u), self.value(v)
            if isinstance(left, Dim):
                left, right = [left], [right]
            if not isinstance(left, list) or not isinstance(right, list) or \
                    len(left) != len(right):
                continue
            for x, y in zip(left, right):
                nx, ny = _atom(x), _atom(y)
                if nx is None or ny is None:
                    continue
                rx, ry = find(nx), find(ny)
                if rx != ry:
                    # An int represents its class; else the smaller key.
                    if rx[0] == "int" or (ry[0] != "int" and rx < ry):
                        parent[ry] = rx
                    else:
                        parent[rx] = ry
        return find

    # -- values of integer shape tensors --

    def value(self, t):
        """List of `Dim` for a 1-D int tensor, one `Dim` for a scalar, or None."""
        key = t.ref()
        if key not in self._values:
            self._values[key] = None
            try:
                self._values[key] = self._value(t)
            except (ValueError, TypeError, IndexError):
                self._values[key] = None
        return self._values[key]

    def _value(self, t):
        if not t.dtype.is_integer or t.shape.rank not in (0, 1):
            return None
        const = tensor_util.constant_value(t)
        if const is not None:
            if const.ndim == 0:
                return Dim.of(const)
            return [Dim.of(v) for v in const.tolist()]
        op = t.op
        fn = _VALUE_TABLE.get(op.type)
        return fn(self, op) if fn is not None else None


def _equal_operands(assert_op):
    """(u, v) when `assert_op` checks `reduce_all(u == v)`, else None."""
    cond = assert_op.inputs[0].op
    if cond.type != "All" or cond.inputs[0].op.type != "Equal":
        return None
    u, v = cond.inputs[0].op.inputs
    if not (u.dtype.is_integer and v.dtype.is_integer):
        return None
    return u, v


def _atom(dim):
    """A union-find node for a Dim that is one symbol or an int."""
    if dim is None:
        return None
    if dim.static is not None:
        return ("int", dim.static)
    if dim.coef == 1 and len(dim.factors) == 1:
        return ("sym", dim.factors[0])
    return None


def _canonical(dim, find):
    """`dim` with each symbol replaced by its class's representative."""
    coef, factors = dim.coef, []
    for f in dim.factors:
        rep = find(("sym", f))
        if rep[0] == "int":
            coef *= rep[1]
        else:
            factors.append(rep[1])
    return Dim(coef, tuple(sorted(factors)))


def _merge(static, dims):
    """`dims`, with TF's static knowledge where `dims` has none."""
    if dims is None or (static is not None and len(static) != len(dims)):
        return static
    if static is None:
        return list(dims)
    return [s if (d is None or (s.static is not None and d.static is None))
            else d for s, d in zip(static, dims)]


def _v_shape(cache, op):
    return cache.shape(op.inputs[0])


def _v_rank(cache, op):
    rank = op.inputs[0].shape.rank
    return None if rank is None else Dim.of(rank)


def _v_cast(cache, op):
    return cache.value(op.inputs[0])


def _ints(cache, t):
    v = cache.value(t)
    if v is None:
        return None
    seq = v if isinstance(v, list) else [v]
    if any(d is None or d.static is None for d in seq):
        return None
    return [d.static for d in seq] if isinstance(v, list) else seq[0].static


def slice_vector(op, seq, begin, end, strides):
    """What StridedSlice `op` takes of the 1-D `seq` (a list; one item for a
    shrunk axis), given its int `begin`, `end` and `strides`; None where
    they are not of the one-axis kind."""
    if None in (begin, end, strides) or len(begin) != 1:
        return None
    if op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask"):
        return None
    b = None if op.get_attr("begin_mask") & 1 else begin[0]
    e = None if op.get_attr("end_mask") & 1 else end[0]
    if op.get_attr("shrink_axis_mask") & 1:
        try:
            return seq[begin[0]]
        except IndexError:
            return None
    return list(seq[slice(b, e, strides[0])])


def _v_strided_slice(cache, op):
    v = cache.value(op.inputs[0])
    if not isinstance(v, list):
        return None
    return slice_vector(op, v, *(_ints(cache, op.inputs[k])
                                 for k in (1, 2, 3)))


def _v_slice(cache, op):
    v = cache.value(op.inputs[0])
    begin, size = _ints(cache, op.inputs[1]), _ints(cache, op.inputs[2])
    if not isinstance(v, list) or begin is None or size is None:
        return None
    start = begin[0]
    return v[start:] if size[0] == -1 else v[start:start + size[0]]


def _v_pack(cache, op):
    if op.get_attr("axis") != 0:
        return None
    parts = [cache.value(i) for i in op.inputs]
    return parts if all(isinstance(p, Dim) for p in parts) else None


def _v_concat(cache, op):
    n = op.get_attr("N")
    if _ints(cache, op.inputs[n]) not in ([0], 0, [-1], -1):
        return None
    out = []
    for i in op.inputs[:n]:
        v = cache.value(i)
        if not isinstance(v, list):
            return None
        out.extend(v)
    return out


def _v_gather(cache, op):
    """Entries of a shape vector picked by constant positions
    (`tf.tensordot`'s `gather(tf.shape(x), free)`)."""
    v = cache.value(op.inputs[0])
    picks = _ints(cache, op.inputs[1])
    if not isinstance(v, list) or picks is None or \
            _ints(cache, op.inputs[2]) not in (0, [0]) or \
            op.get_attr("batch_dims") != 0:
        return None
    if isinstance(picks, int):
        return v[picks] if -len(v) <= picks < len(v) else None
    if any(not -len(v) <= k < len(v) for k in picks):
        return None
    return [v[k] for k in picks]


def _v_prod(cache, op):
    v = cache.value(op.inputs[0])
    if not isinstance(v, list) or op.get_attr("keep_dims"):
        return None
    if _ints(cache, op.inputs[1]) not in ([0], 0, [-1], -1):
        return None
    return product(v)


def _v_mul(cache, op):
    a, b = cache.value(op.inputs[0]), cache.value(op.inputs[1])
    if isinstance(a, Dim) and isinstance(b, Dim):
        return a * b
    return None


def _v_arith(cache, op):
    a, b = _ints(cache, op.inputs[0]), _ints(cache, op.inputs[1])
    if not isinstance(a, int) or not isinstance(b, int):
        return None
    if op.type == "FloorDiv":
        return Dim.of(a // b) if b else None
    return Dim.of({"Sub": a - b, "Add": a + b, "AddV2": a + b,
                   "Maximum": max(a, b), "Minimum": min(a, b)}[op.type])


_VALUE_TABLE = {
    "Shape": _v_shape, "Rank": _v_rank, "Cast": _v_cast,
    "Identity": _v_cast, "StridedSlice": _v_strided_slice,
    "Slice": _v_slice, "Pack": _v_pack, "ConcatV2": _v_concat,
    "GatherV2": _v_gather, "Prod": _v_prod, "Mul": _v_mul, "Sub": _v_arith, "Add": _v_arith,
    "AddV2": _v_arith, "FloorDiv": _v_arith, "Maximum": _v_arith,
    "Minimum": _v_arith,
}
