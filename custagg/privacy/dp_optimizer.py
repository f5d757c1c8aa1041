"""TF Privacy's TF1 DP optimizers, computed by custagg: change the import.

Mirrors `tensorflow_privacy.privacy.optimizers.dp_optimizer` (0.9.0):

    # was: from tensorflow_privacy.privacy.optimizers import dp_optimizer
    from custagg.privacy import dp_optimizer

    opt = dp_optimizer.DPGradientDescentGaussianOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=256,
        learning_rate=0.15)
    train_op = opt.minimize(loss=vector_loss, global_step=global_step)

As with TF Privacy, the ε of a run (`compute_dp_sgd_privacy`,
`custagg.privacy.PrivacyBudgetHook`) assumes Poisson-sampled batches
(`custagg.privacy.sampling`); with fixed-size shuffled batches, track the
run with `PrivacyBudget(..., sampling="shuffle")`, which claims no
amplification by sampling. The noise is drawn from a stream whose key and
counter are saved with checkpoints (`custagg.privacy.noise`): a restored
run never repeats a draw.

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
* These classes are thin faces on custagg's clip-and-noise core
  (`custagg.privacy.core`), as `custagg.DPOptimizer` is.

What differs, by design: the per-microbatch gradients of a Gaussian sum
query (custagg's `GaussianSumQuery` or TF Privacy's) come from custagg's
one-pass clipped sum (microbatch norms from the rules' group forms, never
materializing the `[M, ...]` microbatch gradients where a form exists;
see docs/privacy.md), not from a loop of M backward passes, so
`unroll_microbatches` and `while_loop_parallel_iterations` do not change
the graph for them (they are accepted). Every query with a
`ClippedSumForm` (`DPQuery.clipped_sum_form`: normalized, nested
(per-layer) and adaptive-clip queries of custagg's `dp_query` package, or
a user's own) gets norms and clipped sums from the rules too; other
DPQuery objects still run one `accumulate_record` per microbatch, in a
Python loop when `unroll_microbatches=True` and M is static, else a
`tf.while_loop` (`custagg.privacy.core`). Eagerly (TF Privacy's
callable loss, optionally with a `gradient_tape`) the microbatch gradients
come from the tape and go through the query record by record. `cls` must be a `tf.compat.v1.train.Optimizer` subclass, not a
Keras optimizer class.
"""

from __future__ import annotations

from absl import logging
import tensorflow as tf

from custagg.privacy import checks
from custagg.privacy import core
from custagg.privacy import noise as noise_lib
from custagg.privacy.dp_query import dp_query
from custagg.privacy.dp_query import gaussian_query
from custagg.training import optimizers as training

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
    checks.check_tf1_optimizer_class(cls, "make_optimizer_class")
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
            self._num_microbatches = checks.check_microbatches(
                num_microbatches, type(self).__name__, allow_tensor=True)
            # User-level DP (custagg's addition; keyword only): each user
            # one microbatch, see custagg.optimizers.DPOptimizer.
            self._group_ids = checks.check_group_ids(
                group_ids, num_microbatches, type(self).__name__)
            self._unroll_microbatches = bool(unroll_microbatches)
            self._while_loop_parallel_iterations = int(
                while_loop_parallel_iterations)
            self._global_state = None
            self._state_variables = None
            self._global_state_read = None
            self._was_compute_gradients_called = False
            self._dp_norms = None

        num_microbatches = training.read_only(
            "_num_microbatches",
            "M, the number of microbatches (None: one example each).")

        @property
        def global_state(self):
            """The query's global state after the last `compute_gradients`
            (graph tensors; for adaptive queries the values that step
            writes to the state variables). E.g.
            `query.derive_metrics(opt.global_state)["clip"]`."""
            return training.computed(self._global_state, self,
                                     "global_state")

        @property
        def per_microbatch_norms(self):
            """`[M]` global L2 norms of the microbatch gradients before
            clipping, from the last `compute_gradients` (Gaussian queries)."""
            return training.computed(
                self._dp_norms, self, "per_microbatch_norms",
                "compute_gradients() with a Gaussian sum query")

        def hand_over_noise(self):
            """Stops this optimizer adding noise; returns `dtype -> sigma`,
            the noise the caller now adds once itself
            (`custagg.distributed`: after the replicas' aggregation), or
            None, leaving the optimizer as it was, when the query is not a
            Gaussian sum query (its noise is made inside
            `get_noised_result` and cannot move). The query is replaced by
            a `GaussianSumQuery` of the same clip and zero noise."""
            params = core.gaussian_sum_params(self._dp_sum_query)
            if params is None:
                return None
            clip, stddev = params
            self._dp_sum_query = gaussian_query.GaussianSumQuery(clip, 0.0)
            return lambda dtype: tf.cast(stddev, dtype)

        def compute_gradients(self, loss, var_list=None,
                              gate_gradients=_GATE_OP,
                              aggregation_method=None,
                              colocate_gradients_with_ops=False,
                              grad_loss=None, gradient_tape=None):
            """DP-SGD gradients `(sum_m clip(g_m) + noise) / M`, TF Privacy's
            arguments; `loss` is `[B]` or `[B, ...]`."""
            del aggregation_method, colocate_gradients_with_ops
            name = type(self).__name__ + ".compute_gradients"
            checks.check_not_loss_scaled(self, name)
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
            loss, grad_loss = training.per_example_loss_vector(
                loss, grad_loss, name)
            if grad_loss is not None:
                loss = loss * tf.stop_gradient(grad_loss)
            var_list = _var_list(var_list, name)
            live = [v for v in var_list if training.differentiable(v)]
            grads = [None] * len(var_list)
            if live:
                with tf.name_scope(self._name + "_dp_gradients"):
                    live_grads = self._dp_gradients(loss, live)
                it = iter(live_grads)
                grads = [next(it) if training.differentiable(v) else None
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
            checks.check_compute_gradients_called(self)
            return super().apply_gradients(grads_and_vars,
                                           global_step=global_step, name=name)

        def _initial_state(self):
            """The query's initial global state; in graph mode, read from
            variables when it changes between steps (adaptive clipping), so
            it carries over from one `session.run` to the next."""
            state = self._dp_sum_query.initial_global_state()
            form = dp_query.clipped_sum_form_of(self._dp_sum_query)
            if tf.executing_eagerly() or form is None or not form.adaptive:
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

        def _gaussian_noise(self, stddev, dtype):
            """`core.noised_mean`'s noise: None when the query's stddev is
            statically 0 (noise handed over: no draw, no stream variables),
            else `(stddev, this optimizer's checkpointed noise stream)`."""
            if tf.get_static_value(stddev) == 0:
                return None
            stream = noise_lib.stream_of(self, self._name + "_noise",
                                         owner=self)
            return tf.cast(stddev, dtype), lambda: stream

        def _dp_gradients(self, loss, var_list):
            """The core's step for this query: Gaussian (noise drawn by the
            core), another query with a `ClippedSumForm` (noise by the
            query), or any other query (records accumulated)."""
            query = self._dp_sum_query
            form = dp_query.clipped_sum_form_of(query)
            owner = type(self).__name__
            if form is not None and form.gaussian:
                clip, stddev = core.gaussian_sum_params(query)
                dtype = loss.dtype
                grads, self._dp_norms, _ = core.noised_mean(
                    loss, var_list, tf.cast(clip, dtype),
                    self._num_microbatches, "auto", owner, self._group_ids,
                    lambda: self._gaussian_noise(stddev, dtype))
                return grads
            if form is not None:
                self._global_state_read = self._global_state
                grads, new_state, self._dp_norms = core.query_step(
                    query, form, self._global_state, loss, var_list,
                    self._num_microbatches, owner, group_ids=self._group_ids)
                return self._save_state(new_state, grads)
            grads, self._global_state = core.accumulated_step(
                query, self._global_state, loss, var_list,
                self._num_microbatches, owner, group_ids=self._group_ids,
                unroll=self._unroll_microbatches,
                parallel_iterations=self._while_loop_parallel_iterations)
            return grads

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

    return checks.named_after(
        DPOptimizerClass, cls, "DP%sOptimizer",
        "Differentially private subclass of `tf.compat.v1.train.%s` taking "
        "a DPQuery (`dp_sum_query`) first; see `custagg.privacy.dp_optimizer`.")


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
            checks.check_positive(l2_norm_clip, "l2_norm_clip", owner,
                                  allow_zero=True)
            checks.check_positive(noise_multiplier, "noise_multiplier",
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

    return checks.named_after(
        DPGaussianOptimizerClass, cls, "DP%sGaussianOptimizer",
        "DP-SGD with the Gaussian mechanism around `tf.compat.v1.train.%s`; "
        "see `custagg.privacy.dp_optimizer`.")


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
