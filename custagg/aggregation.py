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

import tensorflow as tf
from tensorflow.python.framework import indexed_slices as indexed_slices_lib
from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor_util

from custagg import errors


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
        # pylint: disable=protected-access
        with ops._colocate_with_for_gradient(group[0].op, gradient_uid,
                                             ignore_existing=True):
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


_Slice = collections.namedtuple("_Slice", ["source", "index"])


def _const_int_vector(t):
    value = tensor_util.constant_value(t)
    if value is None:
        return None
    return [int(v) for v in value.reshape(-1)]


def _strided_slice_index(op):
    """Index k when `op` computes `source[k]` (shrunk on axis 0), else None."""
    begin, end, strides = (_const_int_vector(t) for t in op.inputs[1:4])
    if begin is None or end is None or strides is None:
        return None
    shrink = op.get_attr("shrink_axis_mask")
    if (not shrink & 1 or strides[0] != 1 or op.get_attr("begin_mask") & 1
            or op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask")):
        return None
    # Every other axis given must be taken whole.
    begin_mask, end_mask = op.get_attr("begin_mask"), op.get_attr("end_mask")
    for axis in range(1, len(begin)):
        if (shrink >> axis & 1 or not begin_mask >> axis & 1
                or not end_mask >> axis & 1):
            return None
        if strides[axis] != 1:
            return None
    if shrink >> len(begin):
        return None
    return begin[0]


def slice_of(y):
    """Recognizes `y` as one example of a batch tensor.

    Recognized: `loss[k]` (StridedSlice), `tf.gather(loss, k)` with a constant
    scalar k on axis 0, and the outputs of `tf.unstack(loss)`.

    Returns:
      `_Slice(source, k)` with `0 <= k < B` when B is static (or `k >= 0`
      otherwise), or `None`.
    """
    op = y.op
    index = None
    if op.type == "StridedSlice":
        index = _strided_slice_index(op)
    elif op.type in ("GatherV2", "Gather"):
        ids = tensor_util.constant_value(op.inputs[1])
        axis = (tensor_util.constant_value(op.inputs[2])
                if op.type == "GatherV2" else 0)
        if (ids is not None and ids.ndim == 0 and axis is not None
                and int(axis) == 0 and (op.type == "Gather" or
                                        op.get_attr("batch_dims") == 0)):
            index = int(ids)
    elif op.type == "Unpack" and op.get_attr("axis") == 0:
        index = y.value_index
    if index is None:
        return None
    source = op.inputs[0]
    if source.shape.rank is None or source.shape.rank < 1:
        return None
    batch = tf.compat.dimension_value(source.shape[0])
    if index < 0:
        if batch is None:
            return None
        index += batch
    if batch is not None and not 0 <= index < batch:
        return None
    return _Slice(source, index)


def _as_factor_vector(gradient_factors, n_terms, dtype):
    """Checks `gradient_factors` ([B], numeric) and casts it to `dtype`.

    `n_terms` is the static number of per-example terms, or a scalar tensor
    when it is only known at run time.
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
        checks.append(tf.debugging.assert_equal(
            tf.shape(f, out_type=tf.int64)[0] if rank != 0 else
            tf.constant(0, tf.int64),
            tf.cast(n_terms, tf.int64),
            message="custagg.gradients: the fed gradient_factors must have "
            "one factor per example (its length must equal the number of "
            "per-example terms in ys)"))
    if checks:
        with tf.control_dependencies(checks):
            f = tf.identity(f, name="checked_gradient_factors")
    if f.dtype.base_dtype != dtype:
        f = tf.cast(f, dtype, name="gradient_factors_cast")
    return f


def _broadcast_factor(f, y):
    """Reshapes `f` [B] to broadcast along the leading axis of `y` [B, ...]."""
    rank = y.shape.rank
    if rank is None:
        raise ValueError(
            "custagg.gradients: with AggregationMethod.CUSTOM, ys given as one "
            "tensor needs a known rank (its leading axis is the batch); got "
            "%s of unknown rank. Set its shape or pass a list of slices."
            % y.name)
    return tf.reshape(f, [-1] + [1] * (rank - 1))


def _ones_like_seed(y):
    return tf.ones(tf.shape(y), dtype=y.dtype)


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
    dtype = ys[0].dtype.base_dtype
    vector_form = len(ys) == 1 and (ys[0].shape.rank is None
                                    or ys[0].shape.rank >= 1)
    if vector_form:
        y, gy = ys[0], grad_ys[0]
        n_terms = tf.compat.dimension_value(y.shape[0]) \
            if y.shape.rank else None
        if n_terms is None:
            n_terms = tf.shape(y)[0] if y.shape.rank is not None else None
        if n_terms is None:
            _broadcast_factor(None, y)  # raises the unknown-rank error
        f = _as_factor_vector(gradient_factors, n_terms, dtype)
        seed = _broadcast_factor(f, y) * (_ones_like_seed(y) if gy is None
                                          else gy)
        return [y], [seed]

    f = _as_factor_vector(gradient_factors, len(ys), dtype)
    by_source = collections.OrderedDict()  # source tensor -> [(k, j)]
    seed_ys, seed_grads = [], []
    for j, (y, gy) in enumerate(zip(ys, grad_ys)):
        weighted = f[j] * (_ones_like_seed(y) if gy is None else gy)
        s = slice_of(y)
        if s is None:
            seed_ys.append(y)
            seed_grads.append(weighted)
        else:
            by_source.setdefault(s.source.ref(), []).append(
                (s.index, j, weighted, gy))
    for source_ref, terms in by_source.items():
        source = source_ref.deref()
        seed_ys.append(source)
        seed_grads.append(_source_seed(source, terms, f))
    return seed_ys, seed_grads


def _source_seed(source, terms, f):
    """The `[B, ...]` seed of a tensor whose slices were weighted."""
    batch = tf.compat.dimension_value(source.shape[0])
    indices = [k for k, _, _, _ in terms]
    whole = (batch is not None and sorted(indices) == list(range(batch)))
    if whole and all(gy is None for _, _, _, gy in terms):
        order = [j for _, j in sorted((k, j) for k, j, _, _ in terms)]
        factors = f if order == list(range(len(order))) else tf.gather(
            f, order)
        return _broadcast_factor(factors, source) * _ones_like_seed(source)
    if whole:
        return tf.stack([w for _, w in sorted(
            (k, w) for k, _, w, _ in terms)], axis=0)
    # Some rows missing or repeated: scatter (repeats add up).
    return tf.scatter_nd(
        tf.constant([[k] for k in indices], dtype=tf.int64),
        tf.stack([w for _, _, w, _ in terms], axis=0),
        tf.shape(source, out_type=tf.int64))


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
