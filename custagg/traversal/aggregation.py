"""How gradient contributions are combined: `AggregationMethod` and CUSTOM seeds.

Two places combine gradients during reverse mode:

1. Several consumers of one tensor each send back a contribution; they are
   summed just before the producer's gradient function runs
   (`aggregate_contributions`, with the methods TF offers).
2. With `AggregationMethod.CUSTOM`, the per-example terms of the loss are
   weighted by `gradient_factors` before the backward pass starts
   (`custom_seeds`; `traversal.slice_recognizer` finds the ys that are rows
   of one tensor, so the list form costs one backward pass). Weighting the seeds is exactly weighting each example's
   contribution: reverse mode is linear in the seed, so
   `sum_i f_i * d y_i/dx == d/dx <f, y>` computed with seed `f`.
"""

from __future__ import annotations

import collections

import numpy as np
import tensorflow as tf

from custagg import _tf_compat
from custagg import errors
from custagg.traversal import slice_recognizer
from custagg import sparse
from custagg._tf_compat import indexed_slices as indexed_slices_lib
from custagg._tf_compat import ops


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
    return sparse.concat_slices(present)


# --------------------------------------------------------------------------
# CUSTOM: per-example seeds weighted by gradient_factors.
#
# The list form must build in about the time of the vector form although B
# is often 512 or more: which ys are rows of one tensor is read by
# `traversal.slice_recognizer` (a few microseconds per slice), and no op is
# created per slice: the seeds are built per source tensor with a constant
# number of ops.


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


def _one_term(y, gradient_factors):
    """Whether a single non-scalar y is the list form's one term (B = 1):
    one factor, where y's leading axis (static) is not of length 1, so the
    vector form could only fail. (With a leading axis of 1 both forms give
    `f_0 y`.)"""
    shape = getattr(gradient_factors, "shape", None)
    if shape is None:
        shape = np.shape(gradient_factors)
    shape = tf.TensorShape(shape)
    if shape.rank != 1 or tf.compat.dimension_value(shape[0]) != 1 or \
            y.shape.rank is None:
        return False
    lead = tf.compat.dimension_value(y.shape[0])
    return lead is not None and lead != 1


def custom_seeds(ys, grad_ys, gradient_factors):
    """Turns per-example terms and factors into seeds for one backward pass.

    Args:
      ys: list of `Tensor`. Either B per-example terms (list form), or one
        tensor `[B, ...]` whose leading axis is the batch (vector form). One
        non-scalar y with one factor is the list form's single term when
        its leading axis (static) is not 1.
      grad_ys: list aligned with `ys` (entries may be `None`); multiplies in.
      gradient_factors: `[B]` factors.

    Returns:
      `(seed_ys, seed_grad_ys)`: tensors to start the backward pass from and
      their seeds. Slices of one tensor are replaced by that tensor with one
      `[B, ...]` seed, so the list form costs one backward pass like the
      vector form.
    """
    if len(ys) == 1 and (ys[0].shape.rank is None or ys[0].shape.rank >= 1) \
            and not _one_term(ys[0], gradient_factors):
        return [ys[0]], [_vector_seed(ys[0], grad_ys[0], gradient_factors)]

    n_terms = len(ys)
    factors = _Factors(_as_factor_vector(gradient_factors, n_terms), n_terms)
    find = slice_recognizer.SliceFinder(ys[0].graph).find
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
