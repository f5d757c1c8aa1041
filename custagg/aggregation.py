"""How gradient contributions are combined: `AggregationMethod` and CUSTOM seeds.

Two places combine gradients during reverse mode:

1. Several consumers of one tensor each send back a contribution; they are
   summed just before the producer's gradient function runs
   (`aggregate_contributions`, with the methods TF offers).
2. With `AggregationMethod.CUSTOM`, the per-example terms of the loss are
   weighted by `gradient_factors` before the backward pass starts
   (`custom_seeds`). Weighting the seeds is exactly weighting each example's
   contribution: reverse mode is linear in the seed, so
   `sum_i f_i * d y_i/dx == d/dx <f, y>` computed with seed `f`.
"""

from __future__ import annotations

import collections

import numpy as np
import tensorflow as tf

from custagg import _tf_compat
from custagg import errors
from custagg._tf_compat import indexed_slices as indexed_slices_lib
from custagg._tf_compat import ops
from custagg._tf_compat import types_pb2


class AggregationMethod(object):
    """How custagg combines gradient terms.

    The first four have the values and meaning of `tf.AggregationMethod`, so
    TF's constants are accepted too:

    * `ADD_N` / `DEFAULT`: one `AddN` per device, then one across devices.
    * `EXPERIMENTAL_TREE` / `EXPERIMENTAL_ACCUMULATE_N`: a left-fold chain of
      two-input `AddN`s (gradients can be freed earlier).
    * `CUSTOM`: the per-example terms of `ys` are combined as
      `sum_i gradient_factors[i] * d ys_i / d x` (see `custagg.gradients`).
      Contributions inside the graph are summed with `ADD_N`.
    """

    ADD_N = 0
    DEFAULT = ADD_N
    EXPERIMENTAL_TREE = 1
    EXPERIMENTAL_ACCUMULATE_N = 2
    CUSTOM = "custom"

    _SUMMING = (ADD_N, EXPERIMENTAL_TREE, EXPERIMENTAL_ACCUMULATE_N)


def check_method(aggregation_method):
    """Returns the method to sum contributions with; raises on unknown values."""
    if aggregation_method is None:
        return AggregationMethod.DEFAULT
    if aggregation_method == AggregationMethod.CUSTOM:
        return AggregationMethod.ADD_N
    # `True == 1` in Python; a bool is never a method.
    if (isinstance(aggregation_method, bool)
            or aggregation_method not in AggregationMethod._SUMMING):
        raise ValueError(
            "custagg.gradients: unknown aggregation_method %r. Expected one of "
            "custagg.AggregationMethod.ADD_N (0), DEFAULT (0), "
            "EXPERIMENTAL_TREE (1), EXPERIMENTAL_ACCUMULATE_N (2), CUSTOM "
            "(%r), or None." % (aggregation_method, AggregationMethod.CUSTOM))
    return aggregation_method


# --------------------------------------------------------------------------
# Summing contributions that reach one tensor.


def _add_n_by_device(tensors, gradient_uid):
    """Sums per device first, then across devices (as TF's ADD_N does)."""
    by_device = collections.OrderedDict()
    for t in tensors:
        by_device.setdefault(t.device or "", []).append(t)
    partial_sums = []
    for device in sorted(by_device):
        group = by_device[device]
        with _tf_compat.colocate_with_for_gradient(
                group[0].op, gradient_uid, ignore_existing=True):
            partial_sums.append(tf.math.add_n(group))
    return tf.math.add_n(partial_sums)


def _flatten_nested_slices(g):
    """IndexedSlices whose values are IndexedSlices -> one level."""
    if isinstance(g.values, indexed_slices_lib.IndexedSlices):
        inner = _flatten_nested_slices(g.values)
        return indexed_slices_lib.IndexedSlices(
            inner.values, tf.gather(g.indices, inner.indices), g.dense_shape)
    return g


def _concat_slices(slices):
    """Sum of IndexedSlices, kept sparse: rows are concatenated, not merged."""
    flat = [_flatten_nested_slices(s) for s in slices]
    # Indices may be int32 or int64; concat needs one type.
    if len(set(s.indices.dtype for s in flat)) > 1:
        flat = [indexed_slices_lib.IndexedSlices(
            s.values, tf.cast(s.indices, tf.int64), s.dense_shape)
            for s in flat]
    return indexed_slices_lib.IndexedSlices(
        tf.concat([s.values for s in flat], axis=0),
        tf.concat([s.indices for s in flat], axis=0),
        flat[0].dense_shape)


def aggregate_contributions(contribs, method, op, gradient_uid):
    """Combines the gradient contributions received by one tensor.

    Args:
      contribs: list of `Tensor` / `IndexedSlices` (or `None`) contributions.
      method: a summing `AggregationMethod` (already checked).
      op: the producer op (used for naming).
      gradient_uid: the id of this gradients call (for colocation).

    Returns:
      A `Tensor`, `IndexedSlices` or `None` (no contribution at all).
    """
    if not contribs:
        return None
    if len(contribs) == 1:
        return contribs[0]
    bad = [c for c in contribs if c is not None and not isinstance(
        c, (tf.Tensor, indexed_slices_lib.IndexedSlices))]
    if bad:
        raise TypeError(
            "custagg.gradients: a gradient function of a consumer of '%s' "
            "returned %r; gradients must be Tensors or IndexedSlices."
            % (op.name, bad[0]))
    present = [c for c in contribs if c is not None]
    if all(isinstance(c, tf.Tensor) for c in present):
        if method == AggregationMethod.ADD_N:
            return _add_n_by_device(present, gradient_uid)
        with tf.name_scope(op.name + "_gradient_sum"):
            total = present[0]
            for c in present[1:]:
                total = tf.math.add_n([total, c])
            return total
    if any(isinstance(c, tf.Tensor) for c in present):
        # One dense contribution makes the sum dense.
        return tf.math.add_n(present)
    return _concat_slices(present)


# --------------------------------------------------------------------------
# CUSTOM: per-example seeds weighted by gradient_factors.
#
# The list form must build in about the time of the vector form although B
# is often 512 or more, so the work per slice is kept to reading two or
# three parsed NodeDefs (`op.node_def` costs a few microseconds; each
# `op.get_attr` or `tensor_util.constant_value` call costs 10-100x that) and
# no op is created per slice: the seeds are built per source tensor with a
# constant number of ops.


_Slice = collections.namedtuple("_Slice", ["source", "index"])

_INT_DTYPES = {types_pb2.DT_INT32: np.int32, types_pb2.DT_INT64: np.int64}


# `Operation.node_def`, parsed from the bytes TF serializes for the op where
# the release has them (`_tf_compat.node_def`): the finder calls it directly,
# saving the property's Python frame twice per example of the list form.
_parse_node_def = _tf_compat.node_def


def _split_input_name(name):
    """NodeDef input "op" / "op:2" -> ("op", 2)."""
    op_name, _, index = name.partition(":")
    return op_name, int(index) if index else 0


def _const_ints(op):
    """The values of the integer Const `op` as a flat list; else None.

    Unlike `tensor_util.constant_value`, the Const is not marked unfeedable
    (that costs a few microseconds per slice): the indices read here are
    the Consts TF's slicing made, which no one feeds.
    """
    if op.type != "Const":
        return None
    proto = op.node_def.attr["value"].tensor
    dtype = proto.dtype
    np_dtype = _INT_DTYPES.get(dtype)
    if np_dtype is None:
        return None
    size = 1
    for dim in proto.tensor_shape.dim:
        size *= dim.size
    content = proto.tensor_content
    if content:
        values = np.frombuffer(content, np_dtype).tolist()
    else:
        values = list(proto.int_val if dtype == types_pb2.DT_INT32
                      else proto.int64_val)
        # A Const stores a run of equal trailing values once.
        if values and len(values) < size:
            values += [values[-1]] * (size - len(values))
    if len(values) != size:
        return None
    return values


def _first_int(node_def):
    """The first value of an integer Const, given its parsed NodeDef (index 0
    of a StridedSlice `begin`, whose dtype TF restricts to int32/int64);
    else None.

    The fast form of `_const_ints(op)[0]`: `loss[k]` is read once per
    example, and every proto field touched costs about a microsecond. The
    caller parses the NodeDef, and the op type is read from it, not from
    `op.type` (another call into TF).
    """
    if node_def.op != "Const":
        return None
    proto = node_def.attr["value"].tensor
    # Int32 values live in int_val, int64 in int64_val (a run of equal
    # values stored once), or all of them in tensor_content.
    values = proto.int_val or proto.int64_val
    if values:
        return values[0]
    content = proto.tensor_content
    np_dtype = _INT_DTYPES.get(proto.dtype)
    if not content or np_dtype is None:
        return None
    return int(np.frombuffer(content, np_dtype, count=1)[0])


class _SliceFinder(object):
    """Recognizes ys that are one example of a batch tensor.

    Recognized: `loss[k]` (also `loss[k, :]`, `loss[k, ...]`),
    `tf.gather(loss, k)` with a constant scalar k on axis 0, and the outputs
    of `tf.unstack(loss)` (axis 0). Anything else is a per-example term of
    its own (still correct, seeded and differentiated as a separate y).

    Cost matters here: `find` runs once per example, B times per gradients
    call, against a vector form that builds a dozen ops (~5 ms). A
    StridedSlice is read from its NodeDef alone and its inputs are found by
    name (`op.inputs` would build Tensor objects for all four inputs,
    ~40 us; `op.get_attr` and `tensor_util.constant_value` parse a proto
    per call), and the common path `loss[k]` makes no call it can avoid:
    two NodeDef reads (the slice's, and its `begin` Const's, where k is),
    with the op type taken from the first. That is about 8 us per slice on
    a 2-core CPU, ~6 us of it the two reads (TF serializing NodeDefs that
    are no longer in cache, and parsing them). Reading the Const through
    `op.get_attr` or `TF_TryEvaluateConstant`, or the op type through
    `op.type`, measured slower.
    """

    def __init__(self, graph):
        self._graph = graph
        # The C++ lookup behind get_operation_by_name, without its checks.
        self._op_by_name = _tf_compat.operation_by_name_fn(graph)
        self._sources = {}      # input name -> (tensor, B, rank)
        # Unpack op -> the tensor it unstacks along axis 0 (None: another
        # axis, or not a [B, ...] tensor): its B outputs are B ys.
        self._unpacked = {}

    def find(self, y):
        """`(source, k)` with `0 <= k < B`, or None.

        A negative k is resolved when B is static and not recognized when B
        is dynamic.
        """
        op = y.op
        if op in self._unpacked:
            return self._unpacked_row(y, op)
        # The op type from the NodeDef, which a slice needs anyway (one call
        # into TF fewer than `op.type`).
        node_def = _parse_node_def(op)
        kind = node_def.op
        if kind == "StridedSlice":
            attrs = node_def.attr
            # Axis 0 shrunk to the element at begin[0] (TF then ignores its
            # end, and accepts only stride 1 there); no other axis shrunk or
            # added.
            if (attrs["shrink_axis_mask"].i != 1 or attrs["new_axis_mask"].i
                    or attrs["begin_mask"].i & 1
                    or attrs["ellipsis_mask"].i & 1
                    or op.graph is not self._graph):
                return None
            inputs = node_def.input
            source_name = inputs[0]
            found = self._sources.get(source_name)
            if found is None:
                found = self._source(source_name)
            source, batch, rank = found
            if source is None:
                return None
            begin_name = inputs[1]
            begin_op = self._op_by_name(
                begin_name if ":" not in begin_name
                else _split_input_name(begin_name)[0])
            if rank == 1:
                # Nothing else to check: a rank-1 source has no later axes
                # (TF rejects a spec longer than the rank, an ellipsis aside).
                index = _first_int(_parse_node_def(begin_op))
            else:
                index = self._longer_spec_index(attrs, begin_op, inputs[3])
        else:
            if op.graph is not self._graph:
                return None
            if kind in ("GatherV2", "Gather"):
                index = self._gather_index(op, node_def)
            elif kind == "Unpack":
                source, _, rank = self._source(op.inputs[0].name)
                axis = node_def.attr["axis"].i
                self._unpacked[op] = (
                    source if source is not None and axis in (0, -rank)
                    else None)
                return self._unpacked_row(y, op)
            else:
                return None
            if index is None:
                return None
            source, batch, _ = self._source(op.inputs[0].name)
            if source is None:
                return None
        if index is None:
            return None
        if index < 0:
            if batch is None:
                return None
            index += batch
        if index < 0 or (batch is not None and index >= batch):
            return None
        return source, index

    def _unpacked_row(self, y, op):
        """`(source, k)` for output k of an Unpack along axis 0, else None
        (an Unpack has one output per row: 0 <= k < B holds)."""
        source = self._unpacked[op]
        return None if source is None else (source, y.value_index)

    def _source(self, name):
        """(tensor, static B or None, rank); (None, None, None) when the
        tensor is not [B, ...] of known rank."""
        found = self._sources.get(name)
        if found is None:
            op_name, index = _split_input_name(name)
            source = self._op_by_name(op_name).outputs[index]
            rank = source.shape.rank
            if rank is None or rank < 1:
                found = (None, None, None)
            else:
                found = (source, tf.compat.dimension_value(source.shape[0]),
                         rank)
            self._sources[name] = found
        return found

    def _longer_spec_index(self, attrs, begin_op, strides_name):
        """k when a StridedSlice of a source of rank >= 2 (its masks checked
        for axis 0) takes every later axis whole: `out[k]`, `out[k, :]`."""
        begin = _const_ints(begin_op)
        if not begin:
            return None
        if len(begin) == 1:
            return begin[0]
        strides = _const_ints(self._op_by_name(
            _split_input_name(strides_name)[0]))
        if strides is None:
            return None
        begin_mask, end_mask = attrs["begin_mask"].i, attrs["end_mask"].i
        ellipsis = attrs["ellipsis_mask"].i
        for axis in range(1, len(begin)):
            bit = 1 << axis
            if ellipsis & bit:
                continue
            if not (begin_mask & bit and end_mask & bit
                    and strides[axis] == 1):
                return None
        return begin[0]

    @staticmethod
    def _gather_index(op, node_def):
        """k when the op (NodeDef `node_def`) is `tf.gather(source, k)`,
        constant scalar k on axis 0; else None."""
        if node_def.op == "GatherV2":
            if (node_def.attr["batch_dims"].i != 0
                    or _const_ints(op.inputs[2].op) != [0]):
                return None
        ids = op.inputs[1]
        if ids.shape.rank != 0:
            return None
        value = _const_ints(ids.op)
        # A negative index is an error for tf.gather (unlike loss[-1]): such
        # a y is left to TF's own gradient rather than read as loss[B-1].
        return None if value is None or value[0] < 0 else value[0]


def slice_of(y):
    """`_Slice(source, k)` when `y` is example k of `source`, else None.

    See `_SliceFinder` for what is recognized.
    """
    found = _SliceFinder(y.graph).find(y)
    return None if found is None else _Slice(*found)


def _as_factor_vector(gradient_factors, n_terms):
    """Checks `gradient_factors` ([B], numeric); returns it as a tensor.

    `n_terms` is the static number of per-example terms, or a scalar tensor
    when it is only known at run time; lengths that can only be compared at
    run time get a TF assertion whose message names gradient_factors.
    """
    if isinstance(gradient_factors, (tf.Tensor, tf.Variable)):
        f = gradient_factors
    else:
        try:
            f = tf.convert_to_tensor(gradient_factors)
        except (TypeError, ValueError) as e:
            raise TypeError(
                "custagg.gradients: gradient_factors must be a numeric tensor "
                "of shape [B] (one factor per example); got %r (%s)."
                % (gradient_factors, e))
    errors.check_graph_tensor(f, "gradient_factors", "custagg.gradients")
    graph = ops.get_default_graph()
    f_graph = getattr(f, "graph", None)
    if (f_graph is not None and f_graph is not graph
            and not _tf_compat.building_function(graph)):
        raise ValueError(
            "custagg.gradients: gradient_factors (%s) is from another graph "
            "than ys; build it in the same tf.Graph." % f.name)
    dtype_f = f.dtype.base_dtype
    if not (dtype_f.is_floating or dtype_f.is_integer) or dtype_f.is_bool:
        raise TypeError(
            "custagg.gradients: gradient_factors must have a numeric dtype "
            "(float, or integer which is cast); got %s. Feed float32 factors, "
            "e.g. tf.compat.v1.placeholder(tf.float32, [B])." % dtype_f.name)
    rank = f.shape.rank
    if rank is not None and rank != 1:
        raise ValueError(
            "custagg.gradients: gradient_factors must have rank 1, shape [B] "
            "(one factor per example); got shape %s." % f.shape)
    static_len = tf.compat.dimension_value(f.shape[0]) if rank else None
    if isinstance(n_terms, int) and static_len is not None \
            and static_len != n_terms:
        raise ValueError(
            "custagg.gradients: gradient_factors has length %d but ys holds "
            "%d per-example terms; expected shape [%d]."
            % (static_len, n_terms, n_terms))
    checks = []
    if rank is None:
        checks.append(tf.debugging.assert_rank(
            f, 1, message="custagg.gradients: gradient_factors must have "
            "rank 1, shape [B]"))
    if static_len is None or not isinstance(n_terms, int):
        # After the rank check: tf.shape(f)[0] needs a vector.
        with tf.control_dependencies(checks):
            checks.append(tf.debugging.assert_equal(
                tf.shape(f, out_type=tf.int64)[0],
                tf.cast(n_terms, tf.int64),
                message="custagg.gradients: the fed gradient_factors must "
                "have one factor per example (its length must equal the "
                "number of per-example terms in ys)"))
    if checks:
        with tf.control_dependencies(checks):
            f = tf.identity(f, name="checked_gradient_factors")
    return tf.convert_to_tensor(f)     # a Variable's value


class _Factors(object):
    """The checked factors `[n]`, cast (once) to each dtype a seed needs."""

    def __init__(self, f, n_terms):
        self.n_terms = n_terms
        self._by_dtype = {f.dtype.base_dtype: f}
        self._f = f
        self._unstacked = {}

    def vector(self, dtype):
        if dtype not in self._by_dtype:
            self._by_dtype[dtype] = tf.cast(self._f, dtype,
                                            name="gradient_factors_cast")
        return self._by_dtype[dtype]

    def scalars(self, dtype):
        """One scalar per term: one Unpack, not a strided slice per term."""
        if dtype not in self._unstacked:
            self._unstacked[dtype] = tf.unstack(self.vector(dtype),
                                                num=self.n_terms)
        return self._unstacked[dtype]


def _dense_seed(gy, dtype):
    """A given grad_y as a dense tensor of the y's dtype."""
    gy = tf.convert_to_tensor(gy)
    return gy if gy.dtype.base_dtype == dtype else tf.cast(gy, dtype)


def _rows(row_factors, like):
    """`row_factors` [B] broadcast along the leading axis of `like` [B, ...]."""
    rank = like.shape.rank
    if rank == 1:
        return row_factors
    return tf.broadcast_to(tf.reshape(row_factors, [-1] + [1] * (rank - 1)),
                           tf.shape(like))


def _vector_seed(y, gy, gradient_factors):
    """Seed of one `[B, ...]` y: factor i on row i, times grad_y if given."""
    rank = y.shape.rank
    if rank is None:
        raise ValueError(
            "custagg.gradients: with AggregationMethod.CUSTOM, ys given as one "
            "tensor needs a known rank (its leading axis is the batch); got "
            "%s of unknown rank. Set its shape or pass a list of slices."
            % y.name)
    n_terms = tf.compat.dimension_value(y.shape[0])
    if n_terms is None:
        n_terms = tf.shape(y)[0]
    dtype = y.dtype.base_dtype
    f = _Factors(_as_factor_vector(gradient_factors, n_terms),
                 n_terms).vector(dtype)
    if gy is None:
        return _rows(f, y)
    return tf.reshape(f, [-1] + [1] * (rank - 1)) * _dense_seed(gy, dtype)


def custom_seeds(ys, grad_ys, gradient_factors):
    """Turns per-example terms and factors into seeds for one backward pass.

    Args:
      ys: list of `Tensor`. Either B per-example terms (list form), or one
        tensor `[B, ...]` whose leading axis is the batch (vector form).
      grad_ys: list aligned with `ys` (entries may be `None`); multiplies in.
      gradient_factors: `[B]` factors.

    Returns:
      `(seed_ys, seed_grad_ys)`: tensors to start the backward pass from and
      their seeds. Slices of one tensor are replaced by that tensor with one
      `[B, ...]` seed, so the list form costs one backward pass like the
      vector form.
    """
    if len(ys) == 1 and (ys[0].shape.rank is None or ys[0].shape.rank >= 1):
        return [ys[0]], [_vector_seed(ys[0], grad_ys[0], gradient_factors)]

    n_terms = len(ys)
    factors = _Factors(_as_factor_vector(gradient_factors, n_terms), n_terms)
    find = _SliceFinder(ys[0].graph).find
    found = [find(y) for y in ys]   # the work done per example
    # The usual list form, `[loss[i] for i in range(B)]`: every y a row of
    # one tensor. Checked and grouped in C-level passes over the B results
    # (the general grouping below is a Python loop, ~1 us per y). The finder
    # hands back one Tensor object per source, so ids compare sources
    # (graph Tensors are not hashable, and .ref() would cost an object per
    # slice).
    if None not in found:
        sources, ks = zip(*found)
        if len(set(map(id, sources))) == 1:
            no_grad_ys = all(gy is None for gy in grad_ys)
            return [sources[0]], [_source_seed(
                sources[0], list(ks), None, None if no_grad_ys else grad_ys,
                factors)]
    # id(source) -> (source, [k], [j], [gy]).
    by_source = {}
    others = []                             # terms that are not slices
    last_source, group = None, None
    for j, (y, gy, hit) in enumerate(zip(ys, grad_ys, found)):
        if hit is None:
            others.append((j, y, gy))
            continue
        source, k = hit
        if source is not last_source:
            group = by_source.get(id(source))
            if group is None:
                group = by_source[id(source)] = (source, [], [], [])
            last_source = source
        group[1].append(k)
        group[2].append(j)
        group[3].append(gy)
    seed_ys, seeds = [], []
    for j, y, gy in others:
        dtype = y.dtype.base_dtype
        f_j = factors.scalars(dtype)[j]
        seed_ys.append(y)
        if gy is not None:
            seeds.append(f_j * _dense_seed(gy, dtype))
        elif y.shape.rank == 0:
            seeds.append(f_j)
        else:
            seeds.append(tf.fill(tf.shape(y), f_j))
    for source, ks, js, gys in by_source.values():
        seed_ys.append(source)
        seeds.append(_source_seed(source, ks, js, gys, factors))
    return seed_ys, seeds


def _source_seed(source, ks, js, gys, factors):
    """The `[B, ...]` seed of a tensor of which rows `ks` were listed.

    Term `js[n]` of ys is row `ks[n]` of `source`, seeded with `gys[n]` (or
    ones). Row k of the seed is the sum of f[j] * seed_j over the terms that
    are row k: zero for rows not listed, a sum for repeated rows.
    `js=None`: the terms are all of ys, in order (`js = range(len(ys))`);
    `gys=None`: no grad_ys (all ones).
    """
    dtype = source.dtype.base_dtype
    f = factors.vector(dtype)
    batch = tf.compat.dimension_value(source.shape[0])
    in_order = batch is not None and ks == list(range(batch))
    if js is None or js == list(range(factors.n_terms)):
        js, listed = range(factors.n_terms), f
    else:
        listed = tf.gather(f, js)
    n_rows = batch if batch is not None else tf.shape(source)[0]
    if gys is None or all(gy is None for gy in gys):
        if in_order:
            rows = listed
        elif batch is not None and sorted(ks) == list(range(batch)):
            # Each row once, in another order: pick the factors row by row.
            rows = tf.gather(f, [j for _, j in sorted(zip(ks, js))])
        else:
            rows = tf.math.unsorted_segment_sum(listed, ks, n_rows)
        return _rows(rows, source)
    ones = None
    terms = []
    for gy in gys:
        if gy is None:
            if ones is None:
                ones = tf.ones(tf.shape(source)[1:], dtype)
            terms.append(ones)
        else:
            terms.append(_dense_seed(gy, dtype))
    rank = source.shape.rank
    weighted = tf.reshape(listed, [-1] + [1] * (rank - 1)) * tf.stack(terms)
    if in_order:
        return weighted
    return tf.math.unsorted_segment_sum(weighted, ks, n_rows)


def check_factors_usage(aggregation_method, gradient_factors):
    """Errors for CUSTOM without factors and factors without CUSTOM."""
    is_custom = aggregation_method == AggregationMethod.CUSTOM
    if is_custom and gradient_factors is None:
        raise ValueError(
            "custagg.gradients: aggregation_method=AggregationMethod.CUSTOM "
            "needs gradient_factors, a [B] tensor of per-example factors "
            "(usually a tf.compat.v1.placeholder(tf.float32, [B]) fed each "
            "step).")
    if not is_custom and gradient_factors is not None:
        raise ValueError(
            "custagg.gradients: gradient_factors is only used with "
            "aggregation_method=custagg.AggregationMethod.CUSTOM; got "
            "aggregation_method=%r. Pass aggregation_method=CUSTOM, or drop "
            "gradient_factors." % (aggregation_method,))
    errors.check_not_eager("custagg.gradients")
