"""The fast path of the DP optimizers for queries that need only norms and a
clipped sum.

A sum-aggregation query's sample state after accumulating the M microbatch
records is the sum of the preprocessed records. For the queries below that
sum is a clipped sum (and, for adaptive clipping, a count of the records
whose norm is at most the clip), so custagg forms it from its rules --
microbatch norms and one weighted pass, no `[M, ...]` records -- and hands
it to the query's own `get_noised_result`:

| query | sample state built here |
|---|---|
| `GaussianSumQuery` (custagg's or TF Privacy's) | `sum_m clip_C(g_m)` |
| `NormalizedQuery(numerator=one of these)` | the numerator's |
| `QuantileAdaptiveClipSumQuery` | `(sum_m clip_C(g_m), sum_m [||g_m|| <= C] - 1/2)` |
| `NestedQuery` / `NestedSumQuery` of these (per-layer) | each leaf's, over its part of `var_list` |

`g_m` is the gradient of microbatch m's mean loss (TF Privacy's record).
Any other query returns None from `leaf_kind` / `plan` and the optimizer
falls back to accumulating materialized records.
"""

from __future__ import annotations

import tensorflow as tf

from custagg.privacy.dp_query import gaussian_query as _gq
from custagg.privacy.dp_query import nested_query as _nq
from custagg.privacy.dp_query import normalized_query as _normq
from custagg.privacy.dp_query import quantile_adaptive_clip_sum_query as _qa


def leaf_kind(query):
    """"gaussian", "normalized", "adaptive" or None (not on the fast path)."""
    # Exact classes only: a subclass may process records its own way (it
    # then goes through accumulate_record like any other query).
    cls = type(query)
    if cls is _gq.GaussianSumQuery or (
            cls.__name__ == "GaussianSumQuery" and
            cls.__module__.startswith("tensorflow_privacy.")):
        return "gaussian"
    if type(query) is _normq.NormalizedQuery:  # pylint: disable=unidiomatic-typecheck
        return ("normalized"
                if leaf_kind(query._numerator) in ("gaussian", "normalized",  # pylint: disable=protected-access
                                                   "adaptive") else None)
    if type(query) is _qa.QuantileAdaptiveClipSumQuery:  # pylint: disable=unidiomatic-typecheck
        return "adaptive"
    return None


def plan(query):
    """`(leaf queries, nested or None)` when every leaf is on the fast path,
    else None."""
    if isinstance(query, _nq.NestedQuery):
        leaves = query.leaf_queries()
        if leaves and all(leaf_kind(q) for q in leaves):
            return leaves, query
        return None
    return ([query], None) if leaf_kind(query) else None


def has_adaptive_state(query):
    """Whether the query's global state changes from step to step."""
    p = plan(query)
    if p is None:
        return False
    return any(_innermost(q)[1] == "adaptive" for q in p[0])


def _innermost(query):
    kind = leaf_kind(query)
    while kind == "normalized":
        query = query._numerator  # pylint: disable=protected-access
        kind = leaf_kind(query)
    return query, kind


def leaf_clip(query, params):
    """The clip norm in a leaf's sample params (a normalized query's params
    are its numerator's)."""
    _, kind = _innermost(query)
    return params.sum_params if kind == "adaptive" else params


def leaf_sample_state(query, params, clipped_sum, norms):
    """The sample state accumulating the M records would have given."""
    inner, kind = _innermost(query)
    if kind == "adaptive":
        return inner.sample_state_from_sums(params, clipped_sum, norms)
    return clipped_sum


def clipped_mean_sum(loss, xs, clips, num_microbatches, owner,
                     group_ids=None):
    """`sum_m clip(g_m)` with `g_m` the gradient of microbatch m's mean loss.

    Args:
      loss: `[B]` per-example losses.
      xs: variables.
      clips: one clip norm (global norm over xs), or a list aligned with xs.
      num_microbatches: M (a Python int dividing B) or None (M = B).
      group_ids: None, or `[B]` user ids: each user a microbatch (of any
        size), M the number of users U.

    Returns:
      `(sums aligned with xs (None where unconnected), norms ([M], or a list
      of [M] per x with per-x clips), M as a loss.dtype scalar)`.
    """
    import custagg  # pylint: disable=g-import-not-at-top
    if group_ids is not None:
        from custagg import optimizers  # pylint: disable=g-import-not-at-top
        loss, m = optimizers.user_mean_loss(loss, group_ids, owner)
        sums, norms = custagg.clipped_gradients(
            loss, xs, clips, return_norms=True, group_ids=group_ids)
        return sums, norms, m
    static_b = tf.compat.dimension_value(loss.shape[0])
    mb = num_microbatches
    if mb is not None and static_b is not None and static_b % mb:
        raise ValueError("%s: num_microbatches=%d does not divide the batch "
                         "size %d." % (owner, mb, static_b))
    per_x = isinstance(clips, list)
    if mb is None or mb == static_b:
        k, m = None, (tf.cast(tf.shape(loss)[0], loss.dtype) if mb is None
                      else tf.constant(mb, loss.dtype))
        scaled = clips
    else:
        # g_m = G_m / k with G_m the microbatch's summed-loss gradient (k =
        # B/M): clip_C(g_m) = clip_{kC}(G_m) / k.
        k = tf.cast(tf.shape(loss)[0] // mb, loss.dtype)
        m = tf.constant(mb, loss.dtype)
        scaled = [c * k for c in clips] if per_x else clips * k
    sums, norms = custagg.clipped_gradients(
        loss, xs, scaled, return_norms=True, num_microbatches=mb)
    if k is not None:
        sums = [None if g is None else _scale(g, 1.0 / k) for g in sums]
        norms = [n / k for n in norms] if per_x else norms / k
    return sums, norms, m


def _scale(g, factor):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype),
                                g.indices, g.dense_shape)
    return g * tf.cast(factor, g.dtype)


def fast_gradients(query, global_state, loss, var_list, num_microbatches,
                   owner, group_ids=None):
    """`(averaged noised gradients aligned with var_list, new global state,
    [M] norms of the first leaf)` on the fast path.

    Unconnected variables count as zero gradients (they get the noise, as
    in TF Privacy, whose sample state starts from zeros of every variable).
    """
    leaves, nested = plan(query)
    dtype = loss.dtype
    params = query.derive_sample_params(global_state)
    n = len(var_list)
    if nested is None:
        leaf_params, leaf_idx = [params], [list(range(n))]
    else:
        leaf_params = nested.flatten_record_up_to_queries(params)
        leaf_idx = nested.flatten_record_up_to_queries(list(range(n)))
    clips = [tf.cast(leaf_clip(q, p), dtype)
             for q, p in zip(leaves, leaf_params)]
    sums, norms = [None] * n, []
    singles = all(isinstance(i, int) for i in leaf_idx)
    if nested is not None and singles and len(set(leaf_idx)) == n:
        # One variable per leaf (per-layer clipping): one pass, per-x clips.
        order = [leaf_idx.index(j) for j in range(n)]
        s, nm, m = clipped_mean_sum(loss, var_list, [clips[i] for i in order],
                                    num_microbatches, owner, group_ids)
        for j, i in enumerate(order):
            sums[j] = s[j]
        norms = [nm[order.index(i)] for i in range(len(leaves))]
    else:
        m = None
        for idx, clip in zip(leaf_idx, clips):
            flat = tf.nest.flatten(idx)
            s, nm, m = clipped_mean_sum(loss, [var_list[j] for j in flat],
                                        clip, num_microbatches, owner,
                                        group_ids)
            for j, g in zip(flat, s):
                sums[j] = g
            norms.append(nm)
    sums = [tf.zeros_like(v, dtype=dtype) if g is None else
            (tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g)
            for g, v in zip(sums, var_list)]
    states = []
    for q, p, idx, nm in zip(leaves, leaf_params, leaf_idx, norms):
        part = tf.nest.map_structure(lambda j: sums[j], idx)
        states.append(leaf_sample_state(q, p, part, nm))
    sample_state = states[0] if nested is None else nested.pack_as_queries(
        states)
    result, new_state, _ = query.get_noised_result(sample_state, global_state)
    flat = tf.nest.flatten(result)
    out = [g / tf.cast(m, g.dtype) for g in flat]
    return out, new_state, norms[0]
