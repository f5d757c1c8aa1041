"""TF Privacy's TF1 DP optimizers, computed by custagg: change the import.

Mirrors `tensorflow_privacy.privacy.optimizers.dp_optimizer` (0.9.0):

    # was: from tensorflow_privacy.privacy.optimizers import dp_optimizer
    from custagg.privacy import dp_optimizer

    opt = dp_optimizer.DPGradientDescentGaussianOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=256,
        learning_rate=0.15)
    train_op = opt.minimize(loss=vector_loss, global_step=global_step)

Same names, arguments and behaviour:

* `make_optimizer_class(cls)` returns a subclass of the TF1 optimizer class
  `cls` taking `(dp_sum_query, num_microbatches=None,
  unroll_microbatches=False, while_loop_parallel_iterations=10, *args,
  **kwargs)`; `*args, **kwargs` construct `cls`. `DPGradientDescentOptimizer`,
  `DPAdagradOptimizer`, `DPAdamOptimizer`, `DPMomentumOptimizer`,
  `DPRMSPropOptimizer`, `DPFtrlOptimizer` are its results.
* `make_gaussian_optimizer_class(cls)`: `(l2_norm_clip, noise_multiplier,
  num_microbatches=None, unroll_microbatches=False, *args, **kwargs)`, a
  `GaussianSumQuery(l2_norm_clip, l2_norm_clip * noise_multiplier)`
  inside; `DP...GaussianOptimizer` are its results.
* The classes *are* subclasses of `cls`: slots, non-slot variables
  (`beta1_power`, ...), the update op and checkpoints are `cls`'s, exactly
  as with TF Privacy.
* `compute_gradients(loss, var_list, ...)` / `minimize(loss=...)`: `loss` is
  `[B]` or `[B, ...]` (averaged per example); each microbatch's gradient is
  that of its mean loss; the result is `(sum_m clip(g_m) + noise) / M`.
  Variables that cannot be differentiated (a string variable) get `None`.
* `apply_gradients` before any `compute_gradients` raises `AssertionError`
  (`custagg.optimizers.ComputeGradientsNotCalledError`).

What differs, by design: the per-microbatch gradients of a Gaussian sum
query (custagg's `GaussianSumQuery` or TF Privacy's) come from custagg's
one-pass clipped sum (microbatch norms from the rules' group forms, never
materializing the `[M, ...]` microbatch gradients where a form exists;
see docs/privacy.md), not from a loop of M backward passes, so
`unroll_microbatches` and `while_loop_parallel_iterations` do not change
the graph for them (they are accepted; other DPQuery objects still run one
`accumulate_record` per microbatch -- except normalized, nested
(per-layer) and adaptive-clip queries of custagg's `dp_query` package,
which get norms and clipped sums from the rules too (see
`custagg.privacy._query_fast`) -- in a Python loop when
`unroll_microbatches=True` and M is static, else a `tf.while_loop`). Eagerly (TF Privacy's
callable loss, optionally with a `gradient_tape`) the microbatch gradients
come from the tape and go through the query record by record. `cls` must be a `tf.compat.v1.train.Optimizer` subclass, not a
Keras optimizer class.
"""

from __future__ import annotations

from absl import logging
import tensorflow as tf

from custagg.per_example import api as per_example_api
from custagg.training import optimizers as _opt
from custagg.privacy import _query_fast as _fast
from custagg.privacy import gaussian_query

__all__ = [
    "make_optimizer_class", "make_gaussian_optimizer_class",
    "DPAdagradOptimizer", "DPAdamOptimizer", "DPFtrlOptimizer",
    "DPGradientDescentOptimizer", "DPMomentumOptimizer", "DPRMSPropOptimizer",
    "DPAdagradGaussianOptimizer", "DPAdamGaussianOptimizer",
    "DPFtrlGaussianOptimizer", "DPGradientDescentGaussianOptimizer",
    "DPMomentumGaussianOptimizer", "DPRMSPropGaussianOptimizer",
]

_V1 = tf.compat.v1.train.Optimizer
_GATE_OP = _V1.GATE_OP


def make_optimizer_class(cls):
    """A DP-SGD subclass of the TF1 optimizer class `cls`, taking a DPQuery.

    Args:
      cls: a `tf.compat.v1.train.Optimizer` subclass.

    Returns:
      A subclass of `cls`; its constructor takes `(dp_sum_query,
      num_microbatches=None, unroll_microbatches=False,
      while_loop_parallel_iterations=10, *args, **kwargs)`.

    Raises:
      TypeError: `cls` is not a TF1 optimizer class (e.g. a Keras one).
    """
    _opt.check_tf1_optimizer_class(cls, "make_optimizer_class")
    if cls.compute_gradients.__code__ is not _V1.compute_gradients.__code__:
        # TF Privacy's warning, word for word (its tests check it).
        logging.warning(
            "WARNING: Calling make_optimizer_class() on class %s that overrides "
            "method compute_gradients(). Check to ensure that "
            "make_optimizer_class() does not interfere with overridden version.",
            cls.__name__)

    class DPOptimizerClass(cls):  # pylint: disable=missing-docstring

        def __init__(self, dp_sum_query, num_microbatches=None,
                     unroll_microbatches=False,
                     while_loop_parallel_iterations=10, *args,
                     group_ids=None, **kwargs):  # pylint: disable=keyword-arg-before-vararg
            super().__init__(*args, **kwargs)
            self._dp_sum_query = dp_sum_query
            self._num_microbatches = _check_microbatches(num_microbatches,
                                                         type(self).__name__)
            # User-level DP (custagg's addition; keyword only): each user
            # one microbatch, see custagg.optimizers.DPOptimizer.
            self._group_ids = _opt.check_group_ids(
                group_ids, num_microbatches, type(self).__name__)
            self._unroll_microbatches = bool(unroll_microbatches)
            self._while_loop_parallel_iterations = int(
                while_loop_parallel_iterations)
            self._global_state = None
            self._state_variables = None
            self._global_state_read = None
            self._was_compute_gradients_called = False
            self._dp_norms = None

        @property
        def global_state(self):
            """The query's global state after the last `compute_gradients`
            (graph tensors; for adaptive queries the values that step
            writes to the state variables). E.g.
            `query.derive_metrics(opt.global_state)["clip"]`."""
            return _opt.computed(self._global_state, self, "global_state")

        @property
        def per_microbatch_norms(self):
            """`[M]` global L2 norms of the microbatch gradients before
            clipping, from the last `compute_gradients` (Gaussian queries)."""
            return _opt.computed(self._dp_norms, self, "per_microbatch_norms",
                                 "compute_gradients() with a Gaussian sum "
                                 "query")

        def compute_gradients(self, loss, var_list=None,
                              gate_gradients=_GATE_OP,
                              aggregation_method=None,
                              colocate_gradients_with_ops=False,
                              grad_loss=None, gradient_tape=None):
            """DP-SGD gradients `(sum_m clip(g_m) + noise) / M`, TF Privacy's
            arguments; `loss` is `[B]` or `[B, ...]`."""
            del aggregation_method, colocate_gradients_with_ops
            name = type(self).__name__ + ".compute_gradients"
            self._was_compute_gradients_called = True
            if tf.executing_eagerly():
                if self._group_ids is not None:
                    raise ValueError(
                        "%s: group_ids (user-level DP) is for graph mode, "
                        "with the ids fed each step; eagerly, group the "
                        "examples of each user into one microbatch "
                        "yourself." % name)
                return self._eager_gradients(loss, var_list, grad_loss,
                                             gradient_tape, name)
            if gradient_tape is not None or (
                    callable(loss) and not isinstance(loss, tf.Tensor)):
                raise ValueError(
                    "%s: in graph mode pass the per-example loss tensor; a "
                    "callable loss or a gradient_tape is for eager execution."
                    % name)
            if self._global_state is None:
                self._global_state = self._initial_state()
            loss, grad_loss = _opt.per_example_loss_vector(loss, grad_loss,
                                                           name)
            if grad_loss is not None:
                loss = loss * tf.stop_gradient(grad_loss)
            var_list = _var_list(var_list, name)
            live = [v for v in var_list if _opt.differentiable(v)]
            grads = [None] * len(var_list)
            if live:
                with tf.name_scope(self._name + "_dp_gradients"):
                    live_grads = self._dp_gradients(loss, live)
                it = iter(live_grads)
                grads = [next(it) if _opt.differentiable(v) else None
                         for v in var_list]
            if gate_gradients == _V1.GATE_GRAPH:
                present = [i for i, g in enumerate(grads) if g is not None]
                for i, g in zip(present,
                                tf.tuple([grads[i] for i in present])):
                    grads[i] = g
            return list(zip(grads, var_list))

        def apply_gradients(self, grads_and_vars, global_step=None,
                            name=None):
            """`cls.apply_gradients`, after checking that compute_gradients
            ran (AssertionError otherwise, as in TF Privacy)."""
            _opt.check_compute_gradients_called(self)
            return super().apply_gradients(grads_and_vars,
                                           global_step=global_step, name=name)

        def _initial_state(self):
            """The query's initial global state; in graph mode, read from
            variables when it changes between steps (adaptive clipping), so
            it carries over from one `session.run` to the next."""
            state = self._dp_sum_query.initial_global_state()
            if tf.executing_eagerly() or not _fast.has_adaptive_state(
                    self._dp_sum_query):
                return state
            with tf.name_scope(self._name + "_dp_query_state"):
                self._state_variables = [
                    tf.compat.v1.Variable(leaf, trainable=False,
                                          use_resource=True,
                                          name="global_state")
                    for leaf in tf.nest.flatten(state)]
            return tf.nest.pack_sequence_as(
                state, [v.read_value() for v in self._state_variables])

        def _save_state(self, new_state, grads):
            """Assigns the new global state to its variables (graph mode,
            adaptive queries) when the gradients are computed."""
            self._global_state = new_state
            if not getattr(self, "_state_variables", None):
                return grads
            reads = tf.nest.flatten(self._global_state_read)
            with tf.control_dependencies(reads + [g for g in grads
                                                  if g is not None]):
                updates = [v.assign(tf.cast(x, v.dtype)) for v, x in
                           zip(self._state_variables,
                               tf.nest.flatten(new_state))]
            with tf.control_dependencies(updates):
                return [None if g is None else tf.identity(g) for g in grads]

        def _dp_gradients(self, loss, var_list):
            params = gaussian_query.gaussian_sum_params(self._dp_sum_query)
            if params is not None:
                return self._gaussian_gradients(loss, var_list, *params)
            if _fast.plan(self._dp_sum_query) is not None:
                self._global_state_read = self._global_state
                grads, new_state, self._dp_norms = _fast.fast_gradients(
                    self._dp_sum_query, self._global_state, loss, var_list,
                    self._num_microbatches, type(self).__name__,
                    group_ids=self._group_ids)
                return self._save_state(new_state, grads)
            return self._query_gradients(loss, var_list)

        def _eager_gradients(self, loss, var_list, grad_loss, tape, name):
            """TF Privacy's eager path: `loss` a callable (evaluated under
            `tape`, or a tape of our own) or a tensor recorded by `tape`;
            the microbatch gradients come from the tape's jacobian and go
            through the query record by record."""
            if var_list is None:
                raise ValueError("%s: in eager mode pass var_list." % name)
            var_list = tf.nest.flatten(var_list)
            if not callable(loss) and tape is None:
                raise ValueError(
                    "%s: in eager mode pass the loss as a callable, or pass "
                    "the gradient_tape that recorded it." % name)
            if callable(loss):
                if tape is None:
                    with tf.GradientTape() as tape:
                        loss = loss()
                else:
                    loss = loss()
            records, m = self._eager_records(tf.convert_to_tensor(loss),
                                             grad_loss, var_list, tape, name)
            return self._eager_query(records, m, var_list)

        def _eager_records(self, loss, grad_loss, var_list, tape, name):
            """`([M, *v.shape] microbatch mean gradients or None, M)`, from
            the tape's jacobian of the (recorded) loss itself, so nothing
            computed here needs to be on the tape."""
            batch = int(loss.shape[0])
            m = batch if self._num_microbatches is None else \
                self._num_microbatches
            if batch % m:
                raise ValueError("%s: num_microbatches=%d does not divide the "
                                 "batch size %d." % (name, m, batch))
            if getattr(tape, "_persistent", False) and m <= 64:
                return self._eager_records_loop(loss, grad_loss, var_list,
                                                tape, m), m
            weights = None if grad_loss is None else tf.reshape(
                tf.cast(grad_loss, loss.dtype), [-1])
            records = []
            for v, j in zip(var_list, tape.jacobian(loss, var_list)):
                if j is None:
                    records.append(None)
                    continue
                shape = v.shape.as_list()
                j = tf.reshape(j, [-1] + shape)   # [B * trailing, *v]
                if weights is not None:
                    j = j * tf.reshape(weights, [-1] + [1] * len(shape))
                records.append(tf.reduce_mean(tf.reshape(j, [m, -1] + shape),
                                              axis=1))
            return records, m

        def _eager_records_loop(self, loss, grad_loss, var_list, tape, m):
            """The same records from M `tape.gradient` calls (a persistent
            tape, few microbatches: cheaper than the jacobian's trace), each
            weighting the loss entries of one microbatch by 1/their count."""
            size = tf.size(loss)
            per_mb = size // m
            scale = tf.cast(1.0, loss.dtype) / tf.cast(per_mb, loss.dtype)
            if grad_loss is not None:
                scale = scale * tf.reshape(tf.cast(grad_loss, loss.dtype),
                                           tf.shape(loss))
            owner = tf.reshape(tf.range(size) // per_mb, tf.shape(loss))
            rows = []
            for i in range(m):
                w = tf.cast(tf.equal(owner, i), loss.dtype) * scale
                rows.append(tape.gradient(loss, var_list, output_gradients=w))
            return [None if rows[0][j] is None else
                    tf.stack([tf.convert_to_tensor(r[j]) for r in rows])
                    for j in range(len(var_list))]

        def _eager_query(self, records, m, var_list):
            query = self._dp_sum_query
            if self._global_state is None:
                self._global_state = query.initial_global_state()
            params = query.derive_sample_params(self._global_state)
            state = query.initial_sample_state(var_list)
            for i in range(m):
                state = query.accumulate_record(
                    params, state,
                    [None if r is None else r[i] for r in records])
            sums, self._global_state, _ = query.get_noised_result(
                state, self._global_state)
            out = [None if s is None else s / tf.cast(m, s.dtype)
                   for s in tf.nest.flatten(sums)]
            return list(zip(out, var_list))

        def _gaussian_gradients(self, loss, var_list, clip, stddev):
            """One-pass clipped sum (no per-microbatch loop) plus noise."""
            dtype = loss.dtype
            sums, num_units, self._dp_norms, _ = _opt.clipped_microbatch_sum(
                loss, var_list, tf.cast(clip, dtype), self._num_microbatches,
                "auto", type(self).__name__, group_ids=self._group_ids)
            stddev = tf.cast(stddev, dtype)
            sums = [None if g is None else tf.convert_to_tensor(g)
                    for g in sums]
            return [None if g is None else
                    (g + noise) / tf.cast(num_units, g.dtype)
                    for g, noise in zip(sums, _opt.noise_after(sums, stddev))]

        def _query_gradients(self, loss, var_list):
            """Any DPQuery: per-microbatch records, one accumulate_record
            each, then the query's noised result."""
            query = self._dp_sum_query
            per_unit, num_units = _microbatch_gradients(
                loss, var_list, self._num_microbatches, self._group_ids,
                type(self).__name__)
            present = [i for i, g in enumerate(per_unit) if g is not None]
            records = [per_unit[i] for i in present]
            params = query.derive_sample_params(self._global_state)
            state = query.initial_sample_state([var_list[i] for i in present])
            static_m = tf.get_static_value(num_units)
            if self._unroll_microbatches and static_m is not None:
                for m in range(int(static_m)):
                    state = query.accumulate_record(
                        params, state, [r[m] for r in records])
            else:
                def body(m, state):
                    return [m + 1, query.accumulate_record(
                        params, state, [tf.gather(r, m) for r in records])]
                _, state = tf.while_loop(
                    lambda m, _: m < num_units, body,
                    [tf.constant(0), state],
                    parallel_iterations=self._while_loop_parallel_iterations)
            result = query.get_noised_result(state, self._global_state)
            sums, self._global_state = result[0], result[1]
            out = [None] * len(var_list)
            for i, s in zip(present, tf.nest.flatten(sums)):
                out[i] = s / tf.cast(num_units, s.dtype)
            return out

    return _named(DPOptimizerClass, cls, "DP%sOptimizer",
                  "Differentially private subclass of "
                  "`tf.compat.v1.train.%s` taking a DPQuery (`dp_sum_query`) "
                  "first; see `custagg.privacy.dp_optimizer`.")


def _named(klass, cls, name_pattern, doc_pattern):
    """`klass` named after `cls` as TF Privacy names it: `name_pattern` with
    cls's name less its "Optimizer" suffix, `doc_pattern` with cls's name."""
    base = cls.__name__[:-len("Optimizer")] if cls.__name__.endswith(
        "Optimizer") else cls.__name__
    klass.__name__ = klass.__qualname__ = name_pattern % base
    klass.__doc__ = doc_pattern % cls.__name__
    return klass


def make_gaussian_optimizer_class(cls):
    """A DP-SGD subclass of `cls` with the Gaussian mechanism built in.

    Args:
      cls: a `tf.compat.v1.train.Optimizer` subclass.

    Returns:
      A subclass of `cls`; its constructor takes `(l2_norm_clip,
      noise_multiplier, num_microbatches=None, unroll_microbatches=False,
      *args, **kwargs)`.
    """

    class DPGaussianOptimizerClass(make_optimizer_class(cls)):  # pylint: disable=missing-docstring

        def __init__(self, l2_norm_clip, noise_multiplier,
                     num_microbatches=None, unroll_microbatches=False,
                     *args, **kwargs):  # pylint: disable=keyword-arg-before-vararg
            owner = type(self).__name__
            # Checked before the product below, so a bad value is named.
            _opt.check_positive(l2_norm_clip, "l2_norm_clip", owner,
                                 allow_zero=True)
            _opt.check_positive(noise_multiplier, "noise_multiplier",
                                 owner, allow_zero=True)
            self._l2_norm_clip = l2_norm_clip
            self._noise_multiplier = noise_multiplier
            self._base_optimizer_class = cls
            query = gaussian_query.GaussianSumQuery(
                l2_norm_clip, l2_norm_clip * noise_multiplier)
            super().__init__(query, num_microbatches, unroll_microbatches,
                             *args, **kwargs)

        def get_config(self):
            """`cls`'s config (where it has one) plus the DP arguments."""
            base = getattr(self._base_optimizer_class, "get_config", None)
            config = dict(base(self)) if base is not None else {}
            config.update({"l2_norm_clip": self._l2_norm_clip,
                           "noise_multiplier": self._noise_multiplier,
                           "num_microbatches": self._num_microbatches})
            return config

    return _named(DPGaussianOptimizerClass, cls, "DP%sGaussianOptimizer",
                  "DP-SGD with the Gaussian mechanism around "
                  "`tf.compat.v1.train.%s`; see `custagg.privacy.dp_optimizer`.")


def _check_microbatches(num_microbatches, owner):
    if num_microbatches is None:
        return None
    if isinstance(num_microbatches, (tf.Tensor, tf.Variable)):
        value = tf.get_static_value(num_microbatches)
        if value is None:
            raise TypeError(
                "%s: num_microbatches must be a Python int (or None for one "
                "example per microbatch); a tensor whose value is known only "
                "at run time is not supported." % owner)
        num_microbatches = value
    if isinstance(num_microbatches, bool) or int(num_microbatches) != \
            num_microbatches or num_microbatches < 1:
        raise ValueError("%s: num_microbatches must be a positive int "
                         "dividing the batch size, or None; got %r."
                         % (owner, num_microbatches))
    return int(num_microbatches)


def _var_list(var_list, fn):
    if var_list is None:
        var_list = (tf.compat.v1.trainable_variables() +
                    tf.compat.v1.get_collection(
                        tf.compat.v1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES))
    var_list = tf.nest.flatten(var_list)
    seen, unique = set(), []
    for v in var_list:
        if not isinstance(v, tf.Variable):
            raise TypeError("%s: var_list must hold tf.Variables; got %r."
                            % (fn, v))
        if id(v) not in seen:
            seen.add(id(v))
            unique.append(v)
    if not unique:
        raise ValueError("%s: no variables to optimize (var_list is empty and "
                         "the graph has no trainable variables)." % fn)
    return unique


def _microbatch_gradients(loss, var_list, num_microbatches, group_ids=None,
                          owner=""):
    """Gradients of each microbatch's mean loss, `[M, *v.shape]` (or None),
    and M as an int32 scalar tensor; with `group_ids` each user's, `[U,
    ...]` (users in order of first appearance)."""
    if group_ids is not None:
        segments, checks = per_example_api.group_segments(loss, group_ids,
                                                          owner)
        with tf.control_dependencies(checks):
            loss, _ = _opt.user_mean_loss(loss, group_ids, owner)
        per_example = per_example_api.per_example_gradients(loss, var_list)
        return [None if g is None else segments.sum(tf.convert_to_tensor(g))
                for g in per_example], segments.count
    per_example = per_example_api.per_example_gradients(loss, var_list)
    batch = tf.shape(loss)[0]
    m = batch if num_microbatches is None else tf.constant(num_microbatches)
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


AdagradOptimizer = tf.compat.v1.train.AdagradOptimizer
AdamOptimizer = tf.compat.v1.train.AdamOptimizer
FtrlOptimizer = tf.compat.v1.train.FtrlOptimizer
GradientDescentOptimizer = tf.compat.v1.train.GradientDescentOptimizer
MomentumOptimizer = tf.compat.v1.train.MomentumOptimizer
RMSPropOptimizer = tf.compat.v1.train.RMSPropOptimizer

DPAdagradOptimizer = make_optimizer_class(AdagradOptimizer)
DPAdamOptimizer = make_optimizer_class(AdamOptimizer)
DPFtrlOptimizer = make_optimizer_class(FtrlOptimizer)
DPGradientDescentOptimizer = make_optimizer_class(GradientDescentOptimizer)
DPMomentumOptimizer = make_optimizer_class(MomentumOptimizer)
DPRMSPropOptimizer = make_optimizer_class(RMSPropOptimizer)

DPAdagradGaussianOptimizer = make_gaussian_optimizer_class(AdagradOptimizer)
DPAdamGaussianOptimizer = make_gaussian_optimizer_class(AdamOptimizer)
DPFtrlGaussianOptimizer = make_gaussian_optimizer_class(FtrlOptimizer)
DPGradientDescentGaussianOptimizer = make_gaussian_optimizer_class(
    GradientDescentOptimizer)
DPMomentumGaussianOptimizer = make_gaussian_optimizer_class(MomentumOptimizer)
DPRMSPropGaussianOptimizer = make_gaussian_optimizer_class(RMSPropOptimizer)
