"""Per-example gradients, norms, clipped and weighted sums: the front door.

Every function takes a per-example loss `per_example_loss` of shape `[B]`
(B may be unknown until run time) and a list `xs` of variables or tensors.
Results are gradients of the per-example losses as given: a mean loss scales
each example's gradient by 1/B. `None` stands for "no gradient" (the loss
does not depend on that x), as in `tf.gradients`.

Strategies (chosen per x by `plan_per_example`):

* `"loop"`: one backward pass per example (`custagg.gradients(loss[i], x)`);
  obviously correct, needs a static B, graph and time grow with B^2.
* `"pfor"`: TF's vectorization (`parallel_for.pfor`) of the backward pass
  seeded with `one_hot(i)`, in chunks of `pfor_chunk_size` examples so
  memory stays bounded. Exact for any graph pfor can convert (it falls back
  to a while loop for ops it cannot).
* `"rules"`: one backward pass of the summed loss to the outputs of the ops
  that consume x, then a per-op rule (`custagg.rules`) forms each example's
  gradient from the op's inputs and that output gradient (outer products).
  About one backward pass; norms and clipped sums never materialize
  `[B, *x.shape]`. Needs a rule for every consumer and no batch coupling
  downstream; otherwise it is an error that says what to use instead.
* `"auto"`: "rules" for each x that qualifies, "pfor" for the others (and
  "loop" if pfor cannot build and B is static). An x whose ops all have
  rules but whose separation the static analysis cannot prove is on
  "rules (certified at run time)" (form "certified"): one more seeded
  backward pass checks it each step, and a step that fails takes the
  exact form under `tf.cond` (docs/strategies.md).

"pfor" takes, per x, the first form that applies: the boundary ops (O(B));
per-example copies of the forward pass, vectorized by pfor ("recompute",
O(B): `per_example.forms.copies`, for weights inside loops and ops no rule covers),
or run in a while loop when pfor cannot convert the copies
("recompute-loop", O(B)); the whole backward pass per example (O(B^2), the
last resort, used where examples interact or the forward pass cannot be
copied). `str(plan)` gives each choice and why.

Layers (docs/architecture.md): this module checks the arguments and
dispatches; `planning` decides (a `Plan`, never changed once returned);
`forms` hold each form behind one interface (plan, then build); `engine`
builds what the plan says and reduces each quantity.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from custagg import errors
from custagg._tf_compat import indexed_slices as indexed_slices_lib
from custagg._tf_compat import resource_variable_ops
from custagg.traversal.aggregation import AggregationMethod
from custagg.traversal.gradients import gradients
from custagg.per_example import engine as engine_lib
from custagg.per_example import planning
from custagg.per_example.planning import Plan  # noqa: F401  (public name)
from custagg.per_example.planning import warn_slow
from custagg.rules import conv as conv_rules
from custagg.rules import registry as registry_lib
from custagg.rules import segments as segments_lib

STRATEGIES = ("auto", "rules", "pfor", "loop")


# --------------------------------------------------------------------------
# Arguments


def _check_loss(per_example_loss, fn_name):
    errors.check_not_eager(fn_name)
    if isinstance(per_example_loss, (list, tuple)):
        raise TypeError(
            "%s: per_example_loss must be one tensor of shape [B] (the loss of "
            "each example); got a %s. Use tf.stack(...) on the per-example "
            "terms." % (fn_name, type(per_example_loss).__name__))
    errors.check_graph_tensor(per_example_loss, "per_example_loss", fn_name)
    loss = tf.convert_to_tensor(per_example_loss)
    if loss.shape.rank is None and loss.dtype.is_floating:
        # `[B]` unless run time says otherwise (`tf.squeeze` of a `[B, 1]`
        # prediction: a batch of one squeezes to a scalar): checked there.
        return _rank_checked(loss, fn_name)
    if loss.shape.rank != 1:
        raise ValueError(
            "%s: per_example_loss must have shape [B], one loss per example; "
            "got shape %s. Reduce the other axes per example first (e.g. "
            "tf.reduce_sum(loss, axis=1)), and do not average over the "
            "batch." % (fn_name, loss.shape))
    if not loss.dtype.is_floating:
        raise TypeError("%s: per_example_loss must be floating point; got %s."
                        % (fn_name, loss.dtype.name))
    return loss


def _rank_checked(loss, fn_name):
    """`loss` of unknown static rank as a `[B]` tensor, with a run-time
    check that it has rank 1 (a step whose loss has another rank stops
    with the check's message)."""
    message = (
        "%s: per_example_loss must have shape [B], one loss per example "
        "(its static rank is unknown, so this is checked at run time). Give "
        "it a static rank: tf.squeeze(p, axis=-1) rather than tf.squeeze(p), "
        "or tf.reshape(loss, [-1]) when each example has one loss; got shape"
        % fn_name)
    check = tf.debugging.Assert(tf.equal(tf.rank(loss), 1),
                                [message, tf.shape(loss)])
    with tf.control_dependencies([check]):
        loss = tf.identity(loss)
    loss.set_shape([None])
    return loss


def check_strategy(strategy, fn_name):
    """A ValueError naming `fn_name` unless `strategy` is one of
    `STRATEGIES`."""
    if strategy not in STRATEGIES:
        raise ValueError("%s: unknown strategy %r; expected one of %s."
                         % (fn_name, strategy, ", ".join(map(repr,
                                                             STRATEGIES))))


def _as_tensor(x, i, fn_name):
    if resource_variable_ops.is_resource_variable(x):
        # Inside a tf.function an eagerly created variable's handle is an
        # eager tensor: the conversion below captures it.
        x = x.handle
    errors.check_graph_tensor(x, "xs[%d]" % i, fn_name)
    return indexed_slices_lib.internal_convert_to_tensor_or_indexed_slices(
        x, as_ref=True)


def plan_per_example(per_example_loss, xs, strategy="auto", registry=None):
    """Decides, per x, which strategy computes its per-example gradients.

    Args:
      per_example_loss: `[B]` tensor.
      xs: list of variables or tensors.
      strategy: "auto", "rules", "pfor" or "loop".
      registry: a `custagg.RuleRegistry` (default: the built-in rules).

    Returns:
      A `Plan`; `str(plan)` shows the choice and, where rules were not used,
      why.

    Raises:
      ValueError: a bad argument; "rules" asked for an x it cannot handle
        (the message names the op and suggests a strategy); "loop" with an
        unknown batch size.
    """
    fn = "custagg.plan_per_example"
    loss = _check_loss(per_example_loss, fn)
    check_strategy(strategy, fn)
    registry = registry or registry_lib.default_registry()
    xs = list(xs) if isinstance(xs, (list, tuple)) else [xs]
    tensors = []
    for i, x in enumerate(xs):
        t = _as_tensor(x, i, fn)
        if t.graph is not loss.graph:
            raise ValueError(
                "custagg: xs[%d] (%s) is from another graph than "
                "per_example_loss." % (i, getattr(x, "name", x)))
        tensors.append(t)
    return planning.make_plan(loss, xs, tensors, strategy, registry)


def _engine(per_example_loss, xs, strategy, registry, pfor_chunk_size, fn):
    check_strategy(strategy, fn)
    plan = plan_per_example(per_example_loss, xs, strategy, registry)
    warn_slow(plan)
    return plan, engine_lib.Engine(plan, pfor_chunk_size)


# --------------------------------------------------------------------------
# Public functions


def per_example_gradients(per_example_loss, xs, strategy="auto",
                          registry=None, pfor_chunk_size=32,
                          name="per_example_gradients"):
    """The gradient of each example's loss, before TensorFlow sums them.

    Args:
      per_example_loss: `[B]` tensor, the loss of each example (B may be
        unknown until run time). Gradients are of these losses as given: a
        mean loss scales each one by 1/B.
      xs: a variable/tensor or list of them.
      strategy: "auto" (default), "rules", "pfor" or "loop" (see module doc).
      registry: rule registry (default: the built-in rules).
      pfor_chunk_size: the fewest examples vectorized at once by "pfor";
        passes grow up to `custagg.graph.pfor.PASS_BYTES` of
        outputs (the
        whole-pass form keeps exactly this many: its memory is not in its
        outputs).
      name: name scope.

    Returns:
      List aligned with `xs`; entry j is `[B, *xs[j].shape]` whose row i is
      `d per_example_loss[i] / d xs[j]`, or `None` if the loss does not
      depend on `xs[j]`.

    Example:
      >>> loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
      ...     labels=y, logits=tf.matmul(x, w) + b)          # [B]
      >>> gw, gb = custagg.per_example_gradients(loss, [w, b])
      >>> # gw: [B, 784, 10], gb: [B, 10]
    """
    fn = "custagg.per_example_gradients"
    with tf.name_scope(name):
        plan, engine = _engine(per_example_loss, xs, strategy, registry,
                               pfor_chunk_size, fn)
        return [engine.per_example(a) for a in plan.assignments]


def per_example_norms(per_example_loss, xs, strategy="auto", registry=None,
                      pfor_chunk_size=32, name="per_example_norms",
                      num_microbatches=None, group_ids=None):
    """`[B]` global L2 norms of the per-example gradients over all `xs`.

    With rules, computed without materializing per-example gradients
    (`||a_b|| ||dz_b||` for dense layers, the Gram form for sequences, sparse
    rows for embeddings). Unconnected xs count as zero.

    With `num_microbatches` M (a Python int dividing B; B may be dynamic):
    `[M]` norms of the microbatch gradients, microbatch m being examples
    `m*B/M ... (m+1)*B/M - 1` (TF Privacy's `tf.reshape(loss, [M, -1])`)
    and its gradient that of its summed loss, `sum_{b in m} g_b`, again
    without materializing where the rules allow (see `Rule.
    group_squared_norms`).

    With `group_ids` (a `[B]` integer tensor, e.g. fed user ids of any
    values; not with `num_microbatches`): `[U]` norms of each user's summed
    gradient `sum_{b: group_ids[b] = u} g_b`, users in order of first
    appearance in the batch (`tf.unique`'s order); any group sizes, U known
    at run time (see `Rule.segment_squared_norms`).
    """
    fn = "custagg.per_example_norms"
    with tf.name_scope(name):
        plan, engine = _engine(per_example_loss, xs, strategy, registry,
                               pfor_chunk_size, fn)
        groups, check = _groups(plan.loss, num_microbatches, fn, group_ids)
        with tf.control_dependencies(check):
            return tf.sqrt(_total_squared_norms(plan, engine,
                                                plan.assignments, groups))


def _groups(loss, num_microbatches, fn, group_ids=None):
    """(M or None when M = B is static, or a `Segments` for `group_ids`;
    [run-time assertions on them])."""
    if group_ids is not None:
        if num_microbatches is not None:
            raise ValueError(
                "%s: pass num_microbatches or group_ids, not both; "
                "group_ids=[0, 0, 1, 1, ...] (each example's microbatch) "
                "groups like num_microbatches and allows unequal groups."
                % fn)
        return group_segments(loss, group_ids, fn)
    if num_microbatches is None:
        return None, []
    m = num_microbatches
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
        raise ValueError("%s: num_microbatches must be a positive Python int "
                         "dividing the batch size, or None; got %r." % (fn, m))
    m = int(m)
    batch = tf.compat.dimension_value(loss.shape[0])
    if batch is not None:
        if batch % m:
            raise ValueError("%s: num_microbatches=%d does not divide the "
                             "batch size %d." % (fn, m, batch))
        return (None if m == batch else m), []
    return m, [tf.debugging.assert_equal(
        tf.shape(loss)[0] % m, 0,
        message="%s: num_microbatches=%d must divide the batch size" % (fn, m))]


def group_segments(per_example_loss, group_ids, fn="custagg.group_segments"):
    """Checks fed group ids against the loss and groups the examples.

    Args:
      per_example_loss: `[B]` tensor.
      group_ids: `[B]` integer tensor (any values: user ids).
      fn: the caller's name, for error messages.

    Returns:
      `(segments.Segments, [run-time assertions])`: each example's user in
      `0 .. U-1` (order of first appearance) and U; the assertions check
      rank and length where they are not static.

    Raises:
      TypeError: an eager tensor outside a function, or a non-integer dtype.
      ValueError: a static rank other than 1, a static length other than
        the loss's, or another graph.
    """
    loss = per_example_loss
    errors.check_graph_tensor(group_ids, "group_ids", fn)
    ids = tf.convert_to_tensor(group_ids)
    if not ids.dtype.is_integer:
        raise TypeError(
            "%s: group_ids must be an integer tensor of shape [B] (one user "
            "id per example, e.g. a tf.int64 placeholder); got dtype %s. "
            "Map other keys to integers first (e.g. a lookup table)."
            % (fn, ids.dtype.name))
    if ids.graph is not loss.graph:
        raise ValueError("%s: group_ids is from another graph than "
                         "per_example_loss." % fn)
    checks = []
    if ids.shape.rank is not None and ids.shape.rank != 1:
        raise ValueError(
            "%s: group_ids must have shape [B], one id per example of "
            "per_example_loss %s; got shape %s." % (fn, loss.shape,
                                                    ids.shape))
    if ids.shape.rank is None:
        checks.append(tf.debugging.assert_rank(
            ids, 1, message="%s: group_ids must have shape [B]" % fn))
        ids = tf.reshape(ids, [-1])
    n, b = (tf.compat.dimension_value(ids.shape[0]),
            tf.compat.dimension_value(loss.shape[0]))
    if n is not None and b is not None:
        if n != b:
            raise ValueError(
                "%s: group_ids has %d entries but per_example_loss has %d "
                "examples; give one id per example." % (fn, n, b))
    else:
        checks.append(tf.debugging.assert_equal(
            tf.shape(ids)[0], tf.shape(loss)[0],
            message="%s: group_ids must hold one id per example of "
                    "per_example_loss (the same length B)" % fn))
    with tf.control_dependencies(checks):
        ids = tf.identity(ids)
    return segments_lib.Segments.from_ids(ids), checks


def _group_weights(factors, loss, groups):
    """`[M]` (`[U]`) group factors -> `[B]` (each example its group's)."""
    if groups is None:
        return factors
    if isinstance(groups, segments_lib.Segments):
        return groups.spread(factors)
    k = tf.shape(loss)[0] // groups
    return tf.reshape(tf.tile(factors[:, None], tf.stack([1, k])), [-1])


def _total_squared_norms(plan, engine, group, groups=None):
    parts = [engine.squared_norms(a, groups) for a in group if a.strategy]
    if not parts:
        return tf.zeros([engine_lib.group_count(groups)] if groups
                        is not None else tf.shape(plan.loss), plan.loss.dtype)
    return tf.add_n(parts)


def _clip_factors(sq_norms, clip, dtype):
    """min(1, C / norm), written C / max(norm, C) so norm 0 gives 1.

    C = 0 gives factor 0 for every example (norm 0 included: 0/0 is taken
    as 0, never NaN), so every clipped gradient is exactly 0.
    """
    # dtype_hint: a Python float must not pass through float32 on its way
    # to a float64 loss.
    c = tf.cast(tf.convert_to_tensor(clip, dtype_hint=dtype), dtype)
    return tf.stop_gradient(
        tf.math.divide_no_nan(c, tf.maximum(tf.sqrt(sq_norms), c)))


def clipped_gradients(per_example_loss, xs, l2_norm_clip, strategy="auto",
                      return_norms=False, registry=None, pfor_chunk_size=32,
                      name="clipped_gradients", num_microbatches=None,
                      group_ids=None):
    """`sum_b min(1, C / ||g_b||) g_b`: the per-example clipped sum (DP-SGD).

    The clip factors are constants (never differentiated through). For xs
    covered by rules the sum is formed from the norm pass's own activations
    and output gradients (`a^T diag(c) dz` for a MatMul): about one backward
    pass, no per-example gradient materialized. Other xs get a second
    backward pass weighted by the factors (`AggregationMethod.CUSTOM`).

    Args:
      per_example_loss: `[B]` per-example losses.
      xs: variables/tensors.
      l2_norm_clip: C >= 0, a float or scalar tensor (one global norm over
        all xs), or a list aligned with xs (each x clipped by its own norm).
        C = 0 makes every clipped gradient exactly 0; a negative, NaN or
        infinite C raises (tensors: a run-time assertion).
      strategy: as for `per_example_gradients`.
      return_norms: also return the `[B]` norms before clipping (global, or
        a list of per-x norms with per-x clip norms).
      num_microbatches: M (a Python int dividing B), or None for M = B:
        `sum_m min(1, C / ||G_m||) G_m` with `G_m` the gradient of
        microbatch m's summed loss (see `per_example_norms`); the norms are
        then `[M]`. The same one-pass sum with each example weighted by its
        microbatch's factor: a DP step with M < B costs about what M = B
        costs.
      group_ids: None, or a `[B]` integer tensor (fed user ids: any values,
        any order, groups of any size; the number of users U may vary from
        batch to batch) for user-level DP: `sum_u min(1, C / ||G_u||) G_u`
        with `G_u = sum_{b: group_ids[b] = u} g_b` the user's summed
        gradient, each user clipped once. The norms are then `[U]`, users
        in order of first appearance in the batch. Computed like
        microbatches (group norms from the rules' identities, one weighted
        pass); not together with `num_microbatches`. A wrong rank, dtype
        or length raises (run-time assertions where shapes are dynamic).

    Returns:
      List aligned with xs (`Tensor`, `IndexedSlices` for embedding tables,
      or `None`), and the norms if `return_norms`.
    """
    fn = "custagg.clipped_gradients"
    l2_norm_clip = errors.checked_clip_norm(l2_norm_clip, fn)
    per_x = isinstance(l2_norm_clip, (list, tuple))
    with tf.name_scope(name):
        plan, engine = _engine(per_example_loss, xs, strategy, registry,
                               pfor_chunk_size, fn)
        live = [a for a in plan.assignments if a.strategy]
        groups, check = _groups(plan.loss, num_microbatches, fn, group_ids)
        with tf.control_dependencies(check):
            grads, norms = _clipped(plan, engine, live, l2_norm_clip, per_x,
                                    groups, fn)
        return (grads, norms) if return_norms else grads


def _clipped(plan, engine, live, l2_norm_clip, per_x, groups, fn):
    """`clipped_gradients`' sums (aligned with the plan's xs) and norms."""
    dtype = plan.loss.dtype

    def weights(sq, clip):
        return _group_weights(_clip_factors(sq, clip, dtype), plan.loss,
                              groups)
    if per_x:
        if len(l2_norm_clip) != len(plan.assignments):
            raise ValueError(
                "%s: l2_norm_clip has %d entries but xs has %d; give one "
                "clip norm per x, or one number." % (
                    fn, len(l2_norm_clip), len(plan.assignments)))
        sums, norms = {}, []
        for a, clip in zip(plan.assignments, l2_norm_clip):
            if not a.strategy:
                norms.append(tf.zeros([engine_lib.group_count(groups)]
                                      if groups is not None else
                                      tf.shape(plan.loss), dtype))
                continue
            sq = engine.squared_norms(a, groups)
            norms.append(tf.sqrt(sq))
            sums.update(engine.weighted_sums([a], weights(sq, clip)))
    else:
        found = _clipped_from_chunks(plan, engine, live, l2_norm_clip, groups)
        if found is not None:
            sums, sq = found
        else:
            sq = _total_squared_norms(plan, engine, live, groups)
            sums = engine.weighted_sums(live, weights(sq, l2_norm_clip))
        norms = tf.sqrt(sq)
    return [sums.get(id(a)) for a in plan.assignments], norms


def _chunk_clippable(engine, a):
    """(rule, ctx) of an x whose clipped sum may come from its norms'
    chunks (`rule.chunk_clip_parts`: the convolution rules), or None: one
    consumer on plain rules, no chain."""
    if a.form != "rules" or engine._chains(a):
        return None
    pairs = engine.shared.contexts(a)
    if len(pairs) != 1:
        return None
    rule, ctx = pairs[0]
    ready = getattr(rule, "chunk_clip_ready", None)
    if ready is None or not ready(ctx):
        return None
    return rule, ctx


def _clipped_from_chunks(plan, engine, live, clip, groups):
    """The clipped sums and `[B]` squared norms with the convolutions'
    weighted sums taken from their norms' per-example kernels, or None
    (no such x, or microbatches / user groups).

    The other xs' squared norms come first (dense layers: their identities,
    no per-example gradient). Then one `tf.while_loop` over chunks of
    examples builds each convolution's per-example kernels of the chunk
    (`rule.chunk_clip_parts`), adds their squared norms to the others' for
    those examples, so the chunk's clip factors `f` are final, and adds
    `sum_b f_b G_b` over the chunk to each convolution's sum. Exact: example b's factor depends
    only on its own total norm, and its clipped gradient is `f_b G_b`.
    Each convolution's filter gradient is then built once, per chunk,
    where the norms and a weighted backprop-filter call built it twice
    (issue 26: mnist_deep's second convolution, ~15% of its step each).
    One chunk's rows of every convolution are live at once: the chunk is
    the smallest of the rules' (each within `_CHUNK_MAX_ELEMENTS`).
    """
    if groups is not None:
        return None
    fused, rest = [], []
    for a in live:
        found = _chunk_clippable(engine, a)
        if found is None:
            rest.append(a)
        else:
            fused.append((a,) + found)
    if not fused:
        return None
    dtype = plan.loss.dtype
    rest_sq = _total_squared_norms(plan, engine, rest, None)
    batch = tf.shape(plan.loss)[0]
    # Every convolution's kernels of one chunk are live together (the
    # factors need all the norms): at most `_CHUNK_KERNELS_MAX_ELEMENTS`
    # of them, and each rule's own chunk (its other temporaries).
    chunk = max(1, _CHUNK_KERNELS_MAX_ELEMENTS // sum(
        _outer_size(ctx) for _, _, ctx in fused))
    for _, rule, ctx in fused:
        size = rule.chunk_size(ctx)
        if isinstance(chunk, int) and isinstance(size, int):
            chunk = min(chunk, size)
        else:
            chunk = tf.minimum(chunk, size)
    chunk = conv_rules.even_chunks(chunk, tf.compat.dimension_value(
        plan.loss.shape[0]) or batch)

    def body(start, sq_acc, *sums):
        stop = tf.minimum(start + chunk, batch)
        parts = [rule.chunk_clip_parts(ctx, start, stop)
                 for _, rule, ctx in fused]
        chunk_sq = rest_sq[start:stop] + tf.add_n([
            tf.cast(sq, dtype) for sq, _ in parts])
        factors = _clip_factors(chunk_sq, clip, dtype)
        sums = [acc + weigh(tf.cast(factors, acc.dtype))
                for acc, (_, weigh) in zip(sums, parts)]
        return [stop, tf.concat([sq_acc, chunk_sq], 0)] + sums

    initial = [tf.zeros([_outer_size(ctx)], ctx.grad.dtype)
               for _, _, ctx in fused]
    # The first chunk starts once every dz is there: else the slices of
    # the images (ready long before) run while the backward pass still
    # holds the forward activations, and add to its peak.
    with tf.control_dependencies([ctx.grad for _, _, ctx in fused]):
        start = tf.constant(0)
    out = tf.compat.v1.while_loop(
        lambda start, *_: start < batch, body,
        [start, tf.zeros([0], dtype)] + initial,
        shape_invariants=[tf.TensorShape([]), tf.TensorShape([None])] +
        [t.shape for t in initial],
        parallel_iterations=1, back_prop=False, name="clipped_chunks")
    sq = tf.reshape(out[1], tf.shape(plan.loss))
    sums = {}
    if rest:
        sums.update(engine.weighted_sums(rest, _clip_factors(sq, clip,
                                                             dtype)))
    for (a, _, ctx), total in zip(fused, out[2:]):
        sums[id(a)] = engine.to_x(
            tf.reshape(total, ctx.param.shape), a, False)
    return sums, sq


# Elements of the per-example kernels of one chunk, all convolutions
# together, in `_clipped_from_chunks`: 16 MB of float32 (mnist_deep: 52k per
# example, the rules' own chunks of 8 are smaller; a ResNet-18's 11M conv
# weights: one example per chunk).
_CHUNK_KERNELS_MAX_ELEMENTS = 1 << 22


def _outer_size(ctx):
    return ctx.param.shape.num_elements()


def weighted_gradients(per_example_loss, xs, weights, name="weighted_gradients"):
    """`sum_b weights[b] * d per_example_loss[b] / dx` in one backward pass.

    The same as `custagg.gradients(per_example_loss, xs,
    aggregation_method=CUSTOM, gradient_factors=weights)`; exact for any
    graph, batch coupling included, since the weights are constants.
    """
    _check_loss(per_example_loss, "custagg.weighted_gradients")
    with tf.name_scope(name):
        return gradients(per_example_loss, xs,
                         aggregation_method=AggregationMethod.CUSTOM,
                         gradient_factors=weights)


def gradient_second_moments(per_example_loss, xs, strategy="auto",
                            registry=None, pfor_chunk_size=32,
                            name="gradient_second_moments"):
    """`sum_b g_b ** 2` (elementwise) for each x.

    With the gradient sum `sum_b g_b` this gives the per-coordinate variance
    of per-example gradients: `E[g^2] - E[g]^2`. Rules give it without
    materializing for dense layers (`(a^2)^T (dz^2)`) and embeddings.
    """
    fn = "custagg.gradient_second_moments"
    with tf.name_scope(name):
        plan, engine = _engine(per_example_loss, xs, strategy, registry,
                               pfor_chunk_size, fn)
        return [engine.squared_sum(a) if a.strategy else None
                for a in plan.assignments]
