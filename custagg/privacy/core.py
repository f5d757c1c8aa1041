"""The clip-and-noise core of every DP optimizer in custagg.

One step of DP-SGD over M microbatches (M = B: one example each; with
`group_ids`, one user each) is

    (1/M) * noised(sum_m clip_C(g_m))

with `g_m` the gradient of microbatch m's *mean* loss (TF Privacy's
record) and `clip_C(g) = g min(1, C / ||g||)`. The clipped sum comes from
custagg's one-pass `clipped_gradients` (the rules' norms and one weighted
backward pass; no `[M, ...]` records where a form exists). What `noised`
is, is the DP query's business:

* **Gaussian** (`ClippedSumForm.gaussian`: custagg's `GaussianSumQuery`,
  TF Privacy's, and custagg's `DPOptimizer`): `sum + N(0, stddev^2)`,
  drawn here by `add_noise`, the one place the DP optimizers draw noise.
* **Any query with a `ClippedSumForm`** (normalized, adaptive-clip,
  nested / per-layer, or a user's own; `DPQuery.clipped_sum_form` in
  `dp_query/dp_query.py`): the form turns the clipped sums and norms into
  the query's sample state, and the query's own `get_noised_result` noises
  it (`query_step`); `GaussianSumQuery`'s draws with `add_noise` too, so
  every Gaussian noise of custagg's DP comes from that one function, drawn
  from a checkpointed `(key, counter)` stream (`privacy/noise.py`): a
  restored run never repeats a draw. The tree aggregation's noise
  (`dp_query/tree_aggregation.py`) keeps its own `(key, counter)` in the
  query's state (the tree needs to redraw a node's noise); its key comes
  from such a stream too.
* **Any other DPQuery**: TF Privacy's path, materialized microbatch
  records, one `accumulate_record` each (`accumulated_step`).

The faces on this core: `custagg.DPOptimizer` / `ClippedOptimizer`
(`privacy/wrappers.py`), TF Privacy's `dp_optimizer` and
`dp_optimizer_vectorized` classes, and the multi-worker
`DistributedDPOptimizer` (`privacy/distributed.py`, which moves the
noise to after the aggregation through `hand_over_noise`).
"""

from __future__ import annotations

import tensorflow as tf

from custagg.per_example import api as per_example_api
from custagg.privacy import noise as noise_lib
from custagg.privacy.dp_query import dp_query

__all__ = ["accumulated_step", "add_noise", "clipped_microbatch_sum",
           "gaussian_sum_params", "microbatch_records", "noised_mean",
           "norm_pair", "query_step", "user_mean_loss"]


def gaussian_sum_params(query):
    """`(l2_norm_clip, stddev)` of a Gaussian sum query, else None.

    A query is Gaussian when its `ClippedSumForm` says so: custagg's
    `GaussianSumQuery` and TF Privacy's class of the same name (exact
    classes); the clip and stddev are read from `initial_global_state()`.
    """
    form = dp_query.clipped_sum_form_of(query)
    if form is None or not form.gaussian:
        return None
    state = query.initial_global_state()
    return state.l2_norm_clip, state.stddev


def add_noise(tensors, stddev, seed, wait_for=None, colocate_with=None):
    """`t + N(0, stddev^2)` for each present tensor of `tensors` (None stays
    None): THE noise draw of the DP optimizers, one call per step.

    The noise is a function of state saved with the checkpoint, never of
    TF's session-local random state, so a restored or recovered run
    continues the stream instead of repeating its draws (issue 36;
    `custagg.privacy.noise`).

    Each draw waits for every tensor (a control dependency): it needs
    nothing from the backward pass, so without one TF runs it when the step
    starts and the noise stays live through the whole backward pass
    (mnist_deep B=256: 13 MB of the DP step's 97 MB peak).

    Args:
      tensors: a list of tensors (the clipped sums) or None.
      stddev: a scalar (tensor or number) of the tensors' dtype.
      seed: a `noise.NoiseStream` (the optimizer's or query's checkpointed
        `(key, counter)` stream): one draw of it. Unseeded (`seed=None`
        given to the stream), each tensor its own draw, a dense float32
        one added into its own buffer piece by piece
        (`noise.add_stateless_gaussian`: the draw's peak is the tensor and
        one piece); with an int seed, one `[P]` draw of all the entries
        split in `tensors`' order, the stream `(seed, step)`
        `DPOptimizer(seed=...)` has always drawn. Or a `[2]` int64 tensor:
        that one `noise.stateless_gaussian` draw of all the entries, split
        in `tensors`' order, a function of `seed` only.
      wait_for: the tensors the draws wait for (default: `tensors`), e.g.
        a query's whole sample state when it noises one part at a time.
      colocate_with: a variable the stream's variables go with (needed
        when the stream has an optimizer as `owner`).

    Returns:
      The noised tensors, aligned with `tensors` (dense; an `IndexedSlices`
      is added into its noise).
    """
    tensors = [_dense_unless_fewer(t) for t in tensors]
    present = [t for t in tensors if t is not None]
    if not present:
        return list(tensors)
    waits = [t.values if isinstance(t, tf.IndexedSlices) else t
             for t in (present if wait_for is None else wait_for)]
    with tf.control_dependencies(waits):
        if isinstance(seed, noise_lib.NoiseStream):
            return seed.noised(tensors, stddev, joint=seed.seed is not None,
                               colocate_with=colocate_with)
        pieces = iter(noise_lib.joint_gaussian(
            [noise_lib.dense_shape(t) for t in present], seed, stddev,
            present[0].dtype))
        noise = [None if t is None else next(pieces) for t in tensors]
    return [None if t is None else noise_lib.plus(t, n)
            for t, n in zip(tensors, noise)]


def _dense_unless_fewer(t):
    """`t` itself where it is an `IndexedSlices` with statically at most a
    quarter as many values as its dense shape (its rows then wait for the
    draw and are added into the noise), else `t` densified now, its rows
    freed before the draw. On the text model's `[5000, 64]` table in a DP
    step (`python -m benchmarks --peers --models text --tasks dpsgd`): 65k
    rows' values kept sparse 2.83 MB, densified 3.20; 262k kept 3.64,
    densified 3.20 (the rows' inputs stay live with them); 1M kept 6.89,
    densified 5.76."""
    if not isinstance(t, tf.IndexedSlices):
        return t
    rows = t.values.shape.num_elements()
    dense = tf.TensorShape(tf.get_static_value(t.dense_shape)
                           if t.dense_shape is not None else None)
    if rows is not None and dense.is_fully_defined() and \
            4 * rows <= dense.num_elements():
        return t
    return tf.convert_to_tensor(t)


def user_mean_loss(loss, group_ids, owner):
    """`(loss_b / n_u(b), U)`: each example's loss divided by its user's
    number of examples, so a user's summed gradient is the gradient of the
    user's mean loss (TF Privacy's microbatch record), and the number of
    users U as a `loss.dtype` scalar.

    Raises:
      TypeError, ValueError: `group_ids` of another dtype, rank or length
        than the loss's (run-time assertions where not static).
    """
    segments, checks = per_example_api.group_segments(loss, group_ids, owner)
    with tf.control_dependencies(checks):
        sizes = segments.spread(segments.sizes(loss.dtype))
    # An empty batch (Poisson sampling) has U = 0 users: its noise is
    # divided by 1, not 0.
    return (loss / tf.stop_gradient(sizes),
            tf.maximum(tf.cast(segments.count, loss.dtype), 1))


def clipped_microbatch_sum(loss, var_list, clips, num_microbatches,
                           strategy, owner, group_ids=None):
    """`sum_m clip(g_m)` per variable over M microbatches, TF Privacy's way.

    `g_m` is the gradient of microbatch m's mean loss; clipping is by the
    global norm over `var_list` (one clip norm `clips`) or per variable (a
    list of clip norms aligned with `var_list`).

    Args:
      loss: `[B]` per-example losses.
      var_list: float variables.
      clips: a scalar tensor, or a list of them aligned with `var_list`.
      num_microbatches: M (must divide B), or None for M = B.
      strategy: custagg strategy for the per-example quantities.
      owner: name used in error messages.
      group_ids: None, or `[B]` user ids (not with `num_microbatches`): each
        user is a microbatch of any size, `g_m` the gradient of the user's
        mean loss and M the number of users U in the batch.

    Returns:
      `(grads, M as a loss.dtype scalar, norms)`: `grads` aligned with
      `var_list` (None where unconnected); `norms` the `[M]` norms before
      clipping (a list of `[M]` per variable with per-variable clips).
    """
    if group_ids is not None:
        loss, num_units = user_mean_loss(loss, group_ids, owner)
        grads, norms = per_example_api.clipped_gradients(
            loss, var_list, clips, strategy=strategy, return_norms=True,
            group_ids=group_ids)
        return grads, num_units, norms
    batch_static = tf.compat.dimension_value(loss.shape[0])
    mb = num_microbatches
    if mb is not None and batch_static is not None and batch_static % mb:
        raise ValueError("%s: num_microbatches=%d does not divide the batch "
                         "size %d." % (owner, mb, batch_static))
    if mb is None or mb == batch_static:
        # One example per microbatch.
        group_size, scaled = None, clips
        # An empty batch (Poisson sampling) divides its noise by 1, not 0.
        num_units = (tf.constant(max(batch_static, 1), loss.dtype)
                     if batch_static is not None else
                     tf.maximum(tf.cast(tf.shape(loss)[0], loss.dtype), 1))
    else:
        # g_m = G_m / k (k = B/M, G_m the gradient of the microbatch's summed
        # loss), so clip_C(g_m) = clip_{kC}(G_m) / k: custagg's one-pass
        # microbatch clipped sum with clip kC, scaled by 1/k. Nothing per
        # example is materialized where the rules have group forms.
        group_size = (tf.constant(batch_static // mb, loss.dtype)
                      if batch_static is not None else
                      tf.cast(tf.shape(loss)[0] // mb, loss.dtype))
        scaled = ([c * group_size for c in clips] if isinstance(clips, list)
                  else clips * group_size)
        num_units = tf.constant(mb, loss.dtype)
    grads, norms = per_example_api.clipped_gradients(
        loss, var_list, scaled, strategy=strategy, return_norms=True,
        num_microbatches=mb)
    if group_size is not None:
        grads = [None if g is None else _scale(g, 1.0 / group_size)
                 for g in grads]
        norms = ([n / group_size for n in norms] if isinstance(norms, list)
                 else norms / group_size)
    return grads, num_units, norms


def norm_pair(norms, clips):
    """`(norms [M], clipped norms [M])`, global over the variables, from
    `clipped_microbatch_sum`'s norms."""
    if isinstance(clips, list):
        # Per-layer: the norms come per variable and each variable's
        # contribution is clipped on its own.
        clipped_norms = tf.sqrt(tf.add_n([
            tf.square(tf.minimum(n, c)) for n, c in zip(norms, clips)]))
        norms = tf.sqrt(tf.add_n([tf.square(n) for n in norms]))
    else:
        clipped_norms = tf.minimum(norms, clips)
    return norms, clipped_norms


def noised_mean(loss, var_list, clips, num_microbatches, strategy, owner,
                group_ids, noise):
    """The Gaussian step: `(1/M) (sum_m clip(g_m) + N(0, stddev^2))`.

    Args:
      loss, var_list, clips, num_microbatches, strategy, owner, group_ids:
        see `clipped_microbatch_sum`.
      noise: called once the clipped sums exist; returns None (no noise:
        a clip-only step) or `(stddev, seed)` with `seed` a callable giving
        `add_noise`'s seed (called only when noise is drawn; a stream's
        variables go with `var_list[0]`).

    Returns:
      `(gradients aligned with var_list (None where unconnected), [M] norms
      before clipping, [M] norms after)`.
    """
    grads, num_units, norms = clipped_microbatch_sum(
        loss, var_list, clips, num_microbatches, strategy, owner, group_ids)
    norms, clipped_norms = norm_pair(norms, clips)
    drawn = noise()
    if drawn is not None and any(g is not None for g in grads):
        stddev, seed = drawn
        grads = add_noise(grads, stddev, seed(), colocate_with=var_list[0])
    grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
    return ([None if g is None else g / tf.cast(num_units, g.dtype)
             for g in grads], norms, clipped_norms)


def _scale(g, factor):
    """`g * factor` for a Tensor or IndexedSlices (kept sparse)."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype),
                                g.indices, g.dense_shape)
    return g * tf.cast(factor, g.dtype)


def query_step(query, form, global_state, loss, var_list, num_microbatches,
               owner, group_ids=None):
    """One step of a query with a `ClippedSumForm`: clipped sums from the
    rules, the sample state from the form, the noise from the query.

    Unconnected variables count as zero gradients (they get the noise, as
    in TF Privacy, whose sample state starts from zeros of every variable).

    Returns:
      `(averaged noised gradients aligned with var_list, new global state,
      [M] norms of the first leaf)`.
    """
    dtype = loss.dtype
    params = query.derive_sample_params(global_state)
    n = len(var_list)
    leaves = form.leaves(params, n)
    clips = [tf.cast(leaf.clip(p), dtype) for leaf, p, _ in leaves]
    parts = [part for _, _, part in leaves]
    sums, norms = [None] * n, []
    singles = all(isinstance(i, int) for i in parts)
    if singles and len(set(parts)) == n:
        # One variable per leaf (per-layer clipping): one pass, per-x clips.
        order = [parts.index(j) for j in range(n)]
        s, m, nm = clipped_microbatch_sum(
            loss, var_list, [clips[i] for i in order], num_microbatches,
            "auto", owner, group_ids)
        for j in range(n):
            sums[j] = s[j]
        norms = [nm[order.index(i)] for i in range(len(leaves))]
    else:
        m = None
        for part, clip in zip(parts, clips):
            flat = tf.nest.flatten(part)
            s, m, nm = clipped_microbatch_sum(
                loss, [var_list[j] for j in flat], clip, num_microbatches,
                "auto", owner, group_ids)
            for j, g in zip(flat, s):
                sums[j] = g
            norms.append(nm)
    sums = [tf.zeros_like(v, dtype=dtype) if g is None else
            (tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g)
            for g, v in zip(sums, var_list)]
    states = []
    for (leaf, p, part), nm in zip(leaves, norms):
        states.append(leaf.sample_state(
            p, tf.nest.map_structure(lambda j: sums[j], part), nm))
    result, new_state, _ = query.get_noised_result(form.pack(states),
                                                   global_state)
    out = [g / tf.cast(m, g.dtype) for g in tf.nest.flatten(result)]
    return out, new_state, norms[0]


def microbatch_records(loss, var_list, num_microbatches, group_ids=None,
                       owner=""):
    """Gradients of each microbatch's mean loss, `[M, *v.shape]` (or None),
    and M as an int32 scalar tensor; with `group_ids` each user's, `[U,
    ...]` (users in order of first appearance)."""
    if group_ids is not None:
        segments, checks = per_example_api.group_segments(loss, group_ids,
                                                          owner)
        with tf.control_dependencies(checks):
            loss, _ = user_mean_loss(loss, group_ids, owner)
        per_example = per_example_api.per_example_gradients(loss, var_list)
        return [None if g is None else segments.sum(tf.convert_to_tensor(g))
                for g in per_example], segments.count
    per_example = per_example_api.per_example_gradients(loss, var_list)
    batch = tf.shape(loss)[0]
    if num_microbatches is None:
        # One example per microbatch: the records are the per-example
        # gradients (also for an empty batch, B = 0 under Poisson sampling).
        return [None if g is None else tf.convert_to_tensor(g)
                for g in per_example], batch
    m = tf.constant(num_microbatches)
    check = tf.debugging.assert_equal(
        batch % m, 0, message="num_microbatches must divide the batch size")
    out = []
    with tf.control_dependencies([check]):
        for g in per_example:
            if g is None:
                out.append(None)
                continue
            g = tf.convert_to_tensor(g)
            shape = tf.shape(g)[1:]
            out.append(tf.reduce_mean(
                tf.reshape(g, tf.concat([[m, -1], shape], 0)), axis=1))
    return out, m


def accumulated_step(query, global_state, loss, var_list, num_microbatches,
                     owner, group_ids=None, unroll=False,
                     parallel_iterations=10):
    """One step of any DPQuery, TF Privacy's way: the materialized
    microbatch records, one `accumulate_record` each (a Python loop when
    `unroll` and M is static, else a `tf.while_loop`), then the query's
    noised result.

    Returns:
      `(averaged noised gradients aligned with var_list (None where
      unconnected), new global state)`.
    """
    per_unit, num_units = microbatch_records(loss, var_list, num_microbatches,
                                             group_ids, owner)
    present = [i for i, g in enumerate(per_unit) if g is not None]
    records = [per_unit[i] for i in present]
    params = query.derive_sample_params(global_state)
    state = query.initial_sample_state([var_list[i] for i in present])
    static_m = tf.get_static_value(num_units)
    if unroll and static_m is not None:
        for m in range(int(static_m)):
            state = query.accumulate_record(params, state,
                                            [r[m] for r in records])
    else:
        def body(m, state):
            return [m + 1, query.accumulate_record(
                params, state, [tf.gather(r, m) for r in records])]
        _, state = tf.while_loop(
            lambda m, _: m < num_units, body, [tf.constant(0), state],
            parallel_iterations=parallel_iterations)
    result = query.get_noised_result(state, global_state)
    sums, new_state = result[0], result[1]
    out = [None] * len(var_list)
    for i, s in zip(present, tf.nest.flatten(sums)):
        # An empty batch divides its noise by 1, not 0.
        out[i] = s / tf.maximum(tf.cast(num_units, s.dtype), 1)
    return out, new_state
