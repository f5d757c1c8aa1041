"""custagg's DP-SGD wrappers: `DPOptimizer` and `ClippedOptimizer`.

Each wraps any `tf.compat.v1.train.Optimizer` (GradientDescent, Momentum,
Adam, ...) and is itself one (a `PerExampleOptimizer`, from
`custagg.training.optimizers`): applying the gradients, the slots,
`variables()`, `global_step` and the update op's `name` are the wrapped
optimizer's, plus the noise stream's key and counter
(`custagg.privacy.noise`). The clipped sum and the
noise are the clip-and-noise core's (`custagg.privacy.core`):

| class              | gradient                                                   |
|--------------------|------------------------------------------------------------|
| `ClippedOptimizer` | `(1/M) sum_m clip(g_m)`                                    |
| `DPOptimizer`      | `(1/M) (sum_m clip(g_m) + N(0, (noise_multiplier * C)^2))` |

where `clip(g) = g * min(1, C / ||g||)` with `C = l2_norm_clip`, and
`m` runs over `M = num_microbatches` microbatches (default: `M = B`, each
example its own microbatch). As in TF Privacy, a microbatch's gradient is
that of its *mean* loss, and it is the unit that is clipped. With per-layer
clip norms `C_l`, each variable is clipped by its own norm and the noise is
scaled by the global bound `C = sqrt(sum_l C_l^2)`, so `noise_multiplier`
keeps its meaning for privacy accounting.

`make_dp_wrapper_class(cls)` gives a `DPOptimizer` around `cls(*args,
**kwargs)` with TF Privacy's leading arguments `(l2_norm_clip,
noise_multiplier, num_microbatches=None, *args)`; `DPGradientDescent-`,
`DPMomentum-`, `DPAdagrad-` and `DPAdamGaussianWrapper` are its results.
Their names before this module existed, `DP...GaussianOptimizer` and
`make_gaussian_optimizer_class` under `custagg` and `custagg.optimizers`,
still name them but warn (`EARLIER_NAMES`): TF Privacy's classes of those names
(`custagg.privacy.dp_optimizer`) are other classes: subclasses of `cls`
whose fourth argument is `unroll_microbatches`, not `cls`'s first.

**Sampling and ε.** The ε that `custagg.privacy` computes (and
`PrivacyBudgetHook` tracks) assumes each batch is a Poisson sample: every
example in independently with probability q, so batch sizes vary and may
be 0 (`custagg.privacy.sampling.poisson_batches` for `tf.data`,
`PoissonSampler` for feeds; an empty batch steps with the noise alone).
Fixed-size shuffled batches are not what the accountant assumes: say so
with `PrivacyBudget(..., sampling="shuffle")`, whose statement then claims
no amplification by sampling (docs/privacy.md).

Example:

    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=z)
    opt = custagg.DPOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1),
        l2_norm_clip=1.0, noise_multiplier=1.1, seed=0)
    train_op = opt.minimize(loss, global_step=global_step)
    norms = opt.per_example_norms   # fetch with train_op to watch clipping
"""

from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf

from custagg.privacy import checks
from custagg.privacy import core
from custagg.privacy import noise as noise_lib
from custagg.training import optimizers as training

__all__ = [
    "ClippedOptimizer",
    "DPOptimizer",
    "make_dp_wrapper_class",
    "DPAdagradGaussianWrapper",
    "DPAdamGaussianWrapper",
    "DPGradientDescentGaussianWrapper",
    "DPMomentumGaussianWrapper",
]


def _to_dtype(value, dtype):
    """A Python number straight to `dtype` (tf.cast would round via float32)."""
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return tf.cast(value, dtype)
    return tf.constant(value, dtype)


class DPOptimizer(training.PerExampleOptimizer):
    """DP-SGD (Abadi et al. 2016) around any TF1 optimizer, as TF Privacy.

    Gradient: `(1/M) * (sum_m clip(g_m) + N(0, sigma^2 I))` with
    `sigma = noise_multiplier * l2_norm_clip`; `g_m` is the gradient of the
    mean loss of microbatch m (M = `num_microbatches`, default B: one
    example per microbatch). The names and meanings of `l2_norm_clip`,
    `noise_multiplier` and `num_microbatches` are TF Privacy's.

    The clipped sum comes from `custagg.clipped_gradients` (with
    `num_microbatches` for M < B): one backward pass, and per-example or
    per-microbatch gradients are never materialized where the rules'
    (group) forms avoid it, so M < B costs about what M = B costs.

    Args:
      optimizer: the wrapped `tf.compat.v1.train.Optimizer`.
      l2_norm_clip: clip norm C > 0: a number, a scalar tensor, or per-layer
        clip norms: a list aligned with `var_list`, or a dict from variable
        (or its name, with or without ":0") to clip norm.
      noise_multiplier: sigma / C >= 0.
      num_microbatches: M, which must divide the batch size; None means B.
      group_ids: None, or a `[B]` integer tensor of user ids fed with each
        batch (any values and group sizes; not with `num_microbatches`):
        user-level DP. Each user is one microbatch, TF Privacy's way: `g_m`
        is the gradient of the user's mean loss, clipped once, and M is the
        number of users U in the batch. One example per user is the M = B
        step; equal groups of consecutive examples are `num_microbatches`.
      seed: None: the noise is a function of `(key, step)`, both variables
        of this optimizer saved in checkpoints (`step` counts evaluations of
        the noise; the key comes from the graph-level seed when one is set,
        else from fresh entropy): a restored run continues the stream,
        never repeating a draw. An int makes the key that int: runs repeat
        exactly, also across save and restore.
      strategy: see `PerExampleOptimizer`.
      name: see `PerExampleOptimizer`.

    Attributes (after compute_gradients):
      per_example_norms: `[M]` norms before clipping.
      per_example_clipped_norms: `[M]` norms of the clipped contributions
        (each `<= C`).
      noise_stddev: the scalar `sigma` tensor.
    """

    _has_noise = True
    _name_prefix = "DP"

    def __init__(self, optimizer, l2_norm_clip, noise_multiplier,
                 num_microbatches=None, seed=None, strategy="auto",
                 name=None, group_ids=None):
        super().__init__(optimizer, strategy=strategy, name=name)
        cls_name = type(self).__name__
        self._group_ids = checks.check_group_ids(group_ids, num_microbatches,
                                                 cls_name)
        self._l2_norm_clip = self._check_clip(l2_norm_clip)
        self._noise_multiplier = checks.check_positive(
            noise_multiplier, "noise_multiplier", cls_name, allow_zero=True)
        self._num_microbatches = checks.check_microbatches(num_microbatches,
                                                           cls_name)
        if seed is not None and (isinstance(seed, bool) or not isinstance(
                seed, (int, np.integer))):
            raise ValueError("%s: seed must be an int or None; got %r."
                             % (cls_name, seed))
        self._seed = None if seed is None else int(seed)
        self._clipped_norms = None
        self._noise_stddev = None

    def _check_clip(self, clip):
        cls_name = type(self).__name__
        if isinstance(clip, dict):
            if not clip:
                raise ValueError("%s: l2_norm_clip is an empty dict." %
                                 cls_name)
            return {k: checks.check_positive(c, "l2_norm_clip[%r]" % (k,),
                                             cls_name)
                    for k, c in clip.items()}
        if isinstance(clip, (list, tuple)):
            if not clip:
                raise ValueError("%s: l2_norm_clip is an empty list." %
                                 cls_name)
            return [checks.check_positive(c, "l2_norm_clip[%d]" % i,
                                          cls_name)
                    for i, c in enumerate(clip)]
        return checks.check_positive(clip, "l2_norm_clip", cls_name)

    l2_norm_clip = training.read_only("_l2_norm_clip")
    noise_multiplier = training.read_only("_noise_multiplier")
    num_microbatches = training.read_only("_num_microbatches")
    group_ids = training.read_only("_group_ids",
                                   "The `[B]` user ids (or None).")

    @property
    def per_example_clipped_norms(self):
        """`[M]` global norms of the clipped per-microbatch contributions."""
        return training.computed(self._clipped_norms, self,
                                 "per_example_clipped_norms")

    @property
    def noise_stddev(self):
        return training.computed(self._noise_stddev, self, "noise_stddev",
                                 "compute_gradients()")

    def hand_over_noise(self):
        """Stops this optimizer adding noise; returns `dtype -> sigma`
        (`noise_stddev`, known after `compute_gradients`), the noise the
        caller now adds once itself (`custagg.distributed`: after the
        replicas' aggregation). The clipping and the division by M stay."""
        self._has_noise = False
        return lambda dtype: tf.cast(self.noise_stddev, dtype)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Applies gradients from this optimizer's `compute_gradients`.

        Raises:
          ComputeGradientsNotCalledError (an `AssertionError`, as in TF
          Privacy): `compute_gradients` (or `minimize`) was never called, so
          the gradients applied were not clipped and noised here and the
          training would not be differentially private.
        """
        checks.check_compute_gradients_called(self)
        return super().apply_gradients(grads_and_vars, global_step=global_step,
                                       name=name)

    # ------------------------------------------------------------ internals

    def _clips_for(self, var_list, dtype):
        """A scalar clip norm, or a list aligned with var_list (per layer)."""
        cls_name = type(self).__name__
        clip = self._l2_norm_clip
        if isinstance(clip, list):
            if len(clip) != len(var_list):
                raise ValueError(
                    "%s: l2_norm_clip holds %d per-layer clip norms but "
                    "var_list has %d variables (%s); give one per variable, "
                    "in var_list's order, or a dict keyed by variable name."
                    % (cls_name, len(clip), len(var_list),
                       ", ".join(training.var_name(v) for v in var_list)))
            per_layer = clip
        elif isinstance(clip, dict):
            # Keys may be variables, their refs, or names with or without
            # ":0"; all are compared by the variable's name.
            by_name = {}
            for k, c in clip.items():
                key = _key_name(k)
                if key in by_name:
                    raise ValueError("%s: l2_norm_clip gives variable %r twice."
                                     % (cls_name, key))
                by_name[key] = c
            per_layer = []
            for v in var_list:
                if training.var_name(v) not in by_name:
                    raise ValueError(
                        "%s: l2_norm_clip has no clip norm for variable %r; "
                        "its keys are %s." % (cls_name, training.var_name(v),
                                              sorted(by_name)))
                per_layer.append(by_name[training.var_name(v)])
            names = [training.var_name(v) for v in var_list]
            unused = set(by_name) - set(names)
            if unused:
                raise ValueError(
                    "%s: l2_norm_clip names %s, which are not in var_list "
                    "(%s)." % (cls_name, sorted(unused), ", ".join(names)))
        else:
            return _to_dtype(clip, dtype)
        return [_to_dtype(c, dtype) for c in per_layer]

    def _noise_source(self):
        """This optimizer's checkpointed noise stream
        (`custagg.privacy.noise`): `<name>_noise_step` counts the draws,
        `<name>_noise_key` (unseeded) holds the key, so a restored run
        continues the stream, never repeating a draw; with `seed`, the key
        is the seed and the noise of step t is `(seed, t)`'s, as always."""
        return noise_lib.stream_of(self, self._name + "_noise",
                                   seed=self._seed, owner=self)

    def _aggregate(self, loss, var_list, grad_loss, gate_gradients,
                   aggregation_method, colocate_gradients_with_ops):
        checks.check_not_loss_scaled(self, type(self).__name__ +
                                     ".compute_gradients")
        if grad_loss is not None:
            loss = loss * tf.stop_gradient(grad_loss)
            self._last_loss = loss
        clips = self._clips_for(var_list, loss.dtype)

        def noise():
            global_clip = (clips if not isinstance(clips, list) else
                           tf.sqrt(tf.add_n([tf.square(c) for c in clips])))
            self._noise_stddev = tf.identity(
                _to_dtype(self._noise_multiplier, loss.dtype) * global_clip,
                name="noise_stddev")
            if not self._has_noise:
                return None
            return self._noise_stddev, self._noise_source

        grads, self._norms, self._clipped_norms = core.noised_mean(
            loss, var_list, clips, self._num_microbatches, self._strategy,
            type(self).__name__, self._group_ids, noise)
        return grads


def _key_name(k):
    """The variable name a key of a per-layer l2_norm_clip dict stands for."""
    if hasattr(k, "deref"):
        k = k.deref()
    if isinstance(k, tf.Variable):
        return training.var_name(k)
    if isinstance(k, str):
        return k[:-2] if k.endswith(":0") else k
    raise TypeError("l2_norm_clip: dict keys must be variables or variable "
                    "names; got %r." % (k,))


class ClippedOptimizer(DPOptimizer):
    """Per-example clipping without noise: `(1/M) sum_m clip(g_m)`.

    `DPOptimizer` with `noise_multiplier=0` (no noise op is built). See
    `DPOptimizer` for `l2_norm_clip` (global or per layer) and
    `num_microbatches`.
    """

    _has_noise = False
    _name_prefix = "Clipped"

    def __init__(self, optimizer, l2_norm_clip, num_microbatches=None,
                 strategy="auto", name=None, group_ids=None):
        super().__init__(optimizer, l2_norm_clip, noise_multiplier=0.0,
                         num_microbatches=num_microbatches, strategy=strategy,
                         name=name, group_ids=group_ids)


def make_dp_wrapper_class(cls):
    """A `DPOptimizer` class around the TF1 optimizer class `cls`.

    The returned class takes `(l2_norm_clip, noise_multiplier,
    num_microbatches=None, *args, seed=None, strategy="auto",
    group_ids=None, **kwargs)`; `*args, **kwargs` construct `cls` (e.g.
    `learning_rate=0.1`), which it wraps. It is named
    `DP<cls less "Optimizer">GaussianWrapper`. (TF Privacy's
    `dp_optimizer.make_gaussian_optimizer_class` makes a subclass of `cls`
    instead, whose fourth argument is `unroll_microbatches`.)

    Raises:
      TypeError: `cls` is not a `tf.compat.v1.train.Optimizer` subclass.
    """
    checks.check_tf1_optimizer_class(cls, "make_dp_wrapper_class")

    class DPGaussianWrapper(DPOptimizer):  # pylint: disable=missing-docstring

        def __init__(self, l2_norm_clip, noise_multiplier,
                     num_microbatches=None, *args, seed=None,
                     strategy="auto", group_ids=None, **kwargs):
            super().__init__(cls(*args, **kwargs), l2_norm_clip,
                             noise_multiplier,
                             num_microbatches=num_microbatches, seed=seed,
                             strategy=strategy, group_ids=group_ids)

    return checks.named_after(
        DPGaussianWrapper, cls, "DP%sGaussianWrapper",
        "`DPOptimizer` around `%s(*args, **kwargs)`, taking `(l2_norm_clip, "
        "noise_multiplier, num_microbatches=None, *args, seed=None, "
        "strategy='auto', group_ids=None, **kwargs)`.")


DPGradientDescentGaussianWrapper = make_dp_wrapper_class(
    tf.compat.v1.train.GradientDescentOptimizer)
DPMomentumGaussianWrapper = make_dp_wrapper_class(
    tf.compat.v1.train.MomentumOptimizer)
DPAdagradGaussianWrapper = make_dp_wrapper_class(
    tf.compat.v1.train.AdagradOptimizer)
DPAdamGaussianWrapper = make_dp_wrapper_class(
    tf.compat.v1.train.AdamOptimizer)

# The earlier names of the wrapper classes and their factory, public as
# `custagg.DP...GaussianOptimizer` and `custagg.optimizers.*`. They still
# work (user code calls them with a learning rate as the fourth positional
# argument) but warn on access: TF Privacy's classes of the same names
# (`custagg.privacy.dp_optimizer`) are other classes, whose fourth argument
# is `unroll_microbatches`, and one name should mean one class (issue 35).
EARLIER_NAMES = {
    "DPAdagradGaussianOptimizer": "DPAdagradGaussianWrapper",
    "DPAdamGaussianOptimizer": "DPAdamGaussianWrapper",
    "DPGradientDescentGaussianOptimizer": "DPGradientDescentGaussianWrapper",
    "DPMomentumGaussianOptimizer": "DPMomentumGaussianWrapper",
    "make_gaussian_optimizer_class": "make_dp_wrapper_class",
}


def earlier_name(module, name):
    """The object an earlier name of `module` (e.g. "custagg") stands for,
    with a FutureWarning that says which name to use instead."""
    new = EARLIER_NAMES[name]
    warnings.warn(
        "%s.%s is the earlier name of custagg.optimizers.%s and will be "
        "removed; use that name (same class, same arguments), or TF "
        "Privacy's class of this name, custagg.privacy.dp_optimizer.%s, "
        "whose fourth argument is unroll_microbatches." % (
            module, name, new, name), FutureWarning, stacklevel=3)
    return globals()[new]
