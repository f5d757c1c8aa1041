"""TF1 optimizers that aggregate per-example gradients: weighted, clipped, DP-SGD.

Each class wraps any `tf.compat.v1.train.Optimizer` (GradientDescent,
Momentum, Adam, ...) and is itself one. It changes only how gradients are
computed; applying them, the slots (`get_slot`, `get_slot_names`),
`variables()`, `global_step` and the update op's `name` are the wrapped
optimizer's, so checkpoints hold exactly what they would hold without the
wrapper (plus a noise counter for seeded DP-SGD).

The loss passed to `compute_gradients` / `minimize` is the per-example loss
vector `[B]` (e.g. `tf.nn.sparse_softmax_cross_entropy_with_logits(...)`
without `tf.reduce_mean`). Which gradient each class returns, with `g_i` the
gradient of `per_example_loss[i]`:

| class                 | gradient                                                   |
|-----------------------|------------------------------------------------------------|
| `PerExampleOptimizer` | `sum_i g_i` (what TF1 computes for a vector loss)          |
| `WeightedOptimizer`   | `sum_i f_i g_i`, `f` = `gradient_factors` fed each step     |
| `ClippedOptimizer`    | `(1/M) sum_m clip(g_m)`                                    |
| `DPOptimizer`         | `(1/M) (sum_m clip(g_m) + N(0, (noise_multiplier * C)^2))` |

where `clip(g) = g * min(1, C / ||g||)` with `C = l2_norm_clip`, and
`m` runs over `M = num_microbatches` microbatches (default: `M = B`, each
example its own microbatch). As in TF Privacy, a microbatch's gradient is
that of its *mean* loss, and it is the unit that is clipped. With per-layer
clip norms `C_l`, each variable is clipped by its own norm and the noise is
scaled by the global bound `C = sqrt(sum_l C_l^2)`, so `noise_multiplier`
keeps its meaning for privacy accounting.

Every class exposes `per_example_norms` after `compute_gradients`: the
`[B]` (or `[M]`) global L2 norms of the per-example (per-microbatch)
gradients before clipping.

Example:

    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=z)
    opt = custagg.optimizers.DPOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1),
        l2_norm_clip=1.0, noise_multiplier=1.1, seed=0)
    train_op = opt.minimize(loss, global_step=global_step)
    norms = opt.per_example_norms   # fetch with train_op to watch clipping
"""

from __future__ import annotations

import numbers

import numpy as np
import tensorflow as tf

from custagg import _tf_compat
from custagg import errors
from custagg.per_example import api as per_example_api
from custagg.traversal import aggregation
from custagg.traversal import gradients as traversal_gradients

__all__ = [
    "PerExampleOptimizer",
    "WeightedOptimizer",
    "ClippedOptimizer",
    "DPOptimizer",
    "make_gaussian_optimizer_class",
    "DPGradientDescentGaussianOptimizer",
    "DPMomentumGaussianOptimizer",
    "DPAdagradGaussianOptimizer",
    "DPAdamGaussianOptimizer",
    "ComputeGradientsNotCalledError",
]

_Optimizer = tf.compat.v1.train.Optimizer


def _is_number(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_positive(value, arg, cls_name, allow_zero=False):
    """Python numbers (and tensors of known constant value) are checked now;
    other tensors are taken as they are (a clip norm tensor is checked at
    run time by `clipped_gradients`).

    Raises:
      TypeError: a tensor of a non-numeric dtype.
      ValueError: not a number, out of range, NaN or infinite; a tensor that
        is no scalar.
    """
    kind = "non-negative" if allow_zero else "positive"
    if isinstance(value, (tf.Tensor, tf.Variable)):
        dtype = value.dtype.base_dtype
        if not (dtype.is_floating or dtype.is_integer):
            raise TypeError("%s: %s must be a %s number or a numeric scalar "
                            "tensor; got a tensor of dtype %s." % (
                                cls_name, arg, kind, dtype.name))
        if value.shape.rank not in (None, 0):
            raise ValueError("%s: %s must be a scalar; got a tensor of shape "
                             "%s." % (cls_name, arg, value.shape))
        static = (tf.get_static_value(value)
                  if isinstance(value, tf.Tensor) else None)
        if static is not None:
            check_positive(float(static), arg, cls_name, allow_zero)
        return value
    if not _is_number(value):
        # ValueError, as this check always raised (TF Privacy raises none).
        raise ValueError("%s: %s must be a %s number (a Python float) or a "
                         "scalar tensor; got %r." % (cls_name, arg, kind,
                                                     value))
    if not np.isfinite(value) or (value < 0 if allow_zero else value <= 0):
        raise ValueError("%s: %s must be a %s finite number; got %r.%s" % (
            cls_name, arg, kind, value,
            " DP-SGD needs noise_multiplier >= 0 (0: no noise)."
            if arg == "noise_multiplier" else
            " The clip norm C bounds each per-example gradient's L2 norm; "
            "use e.g. 1.0." if arg.startswith("l2_norm_clip") else ""))
    return float(value)


def _to_dtype(value, dtype):
    """A Python number straight to `dtype` (tf.cast would round via float32)."""
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return tf.cast(value, dtype)
    return tf.constant(value, dtype)


def _var_name(v):
    return v.name[:-2] if v.name.endswith(":0") else v.name


class ComputeGradientsNotCalledError(AssertionError):
    """`apply_gradients` on a DP optimizer whose `compute_gradients` was
    never called (TF Privacy raises an `AssertionError` there too)."""


def computed(value, owner, attr, when="compute_gradients() or minimize()"):
    """`value`, or a ValueError saying `owner.attr` needs `when` first."""
    if value is None:
        raise ValueError("%s.%s is available after %s has been called."
                         % (type(owner).__name__, attr, when))
    return value


def read_only(attr, doc=None):
    """A property returning `self.<attr>`."""
    return property(lambda self: getattr(self, attr), doc=doc)


def check_compute_gradients_called(opt):
    if not getattr(opt, "_was_compute_gradients_called", False):
        raise ComputeGradientsNotCalledError(
            "%s.apply_gradients: compute_gradients() on the differentially "
            "private optimizer was not called, so the gradients to apply were "
            "not clipped and noised by it and the training would not be "
            "differentially private. Call minimize(loss) or "
            "compute_gradients(loss) on this optimizer first (Keras' "
            "model.fit does not)." % type(opt).__name__)


def check_tf1_optimizer_class(cls, fn):
    """TypeError unless `cls` is a `tf.compat.v1.train.Optimizer` subclass."""
    if isinstance(cls, type) and issubclass(cls, _Optimizer):
        return
    hint = ""
    if isinstance(cls, type) and any(
            "keras" in (k.__module__ or "") for k in cls.__mro__):
        hint = (" Keras optimizer classes (OptimizerV2, "
                "tf.keras.optimizers.legacy.*, Keras 3) are not supported: "
                "custagg builds TF1 graphs; use the tf.compat.v1.train class "
                "of the same algorithm (e.g. tf.compat.v1.train.AdamOptimizer)"
                ", or TF Privacy's dp_optimizer_keras for Keras models.")
    elif isinstance(cls, _Optimizer):
        hint = " Pass the class, not an instance."
    raise TypeError("%s: cls must be a tf.compat.v1.train.Optimizer subclass; "
                    "got %r.%s" % (fn, cls, hint))


def differentiable(v):
    """Float variables get gradients; others (string, int) get None, as in
    TF1's `compute_gradients`."""
    return v.dtype.base_dtype.is_floating


def _pick_loss(loss, per_example_loss, fn):
    """`loss` (TF1's and TF Privacy's name) or `per_example_loss` (custagg's
    old name), exactly one of them."""
    if per_example_loss is not None:
        if loss is not None:
            raise TypeError("%s: pass the loss once, as loss= (per_example_loss "
                            "is its old name)." % fn)
        return per_example_loss
    if loss is None:
        raise TypeError("%s: missing the per-example loss (argument loss)."
                        % fn)
    return loss


def per_example_loss_vector(loss, grad_loss, fn):
    """Checks a per-example loss and brings it to `[B]`.

    A `[B, ...]` loss is averaged over its trailing axes per example, as TF
    Privacy does (`tf.reshape(loss, [M, -1])` then a mean per microbatch
    gives the same microbatch losses). `grad_loss`, of the loss's shape,
    multiplies in first.

    Returns:
      `(loss [B], grad_loss [B] or None)`.

    Raises:
      TypeError: not a float graph tensor (or a callable: eager-mode only).
      ValueError: a scalar loss, or `grad_loss` of another shape.
    """
    if callable(loss) and not isinstance(loss, (tf.Tensor, tf.Variable)):
        raise TypeError(
            "%s: loss must be a graph tensor of shape [B]; a callable loss is "
            "an eager-mode feature and custagg builds graphs." % fn)
    if not isinstance(loss, tf.Tensor):
        raise TypeError("%s: loss must be a tf.Tensor of shape [B] (one loss "
                        "per example); got %r." % (fn, loss))
    errors.check_graph_tensor(loss, "loss", fn)
    if not loss.dtype.is_floating:
        raise TypeError("%s: loss must be a float tensor; got dtype %s."
                        % (fn, loss.dtype.name))
    if loss.shape.rank == 0 or loss.shape.rank is None:
        raise ValueError(
            "%s: loss must be the vector of per-example losses, shape [B] (or "
            "[B, ...], averaged per example); got shape %s. Pass e.g. "
            "tf.nn.sparse_softmax_cross_entropy_with_logits(...) without "
            "tf.reduce_mean." % (fn, loss.shape))
    if grad_loss is not None:
        grad_loss = tf.convert_to_tensor(grad_loss, dtype=loss.dtype)
        if not grad_loss.shape.is_compatible_with(loss.shape):
            raise ValueError("%s: grad_loss must have the shape of the loss "
                             "%s; got %s." % (fn, loss.shape, grad_loss.shape))
    if loss.shape.rank > 1:
        if grad_loss is not None:
            loss, grad_loss = loss * tf.stop_gradient(grad_loss), None
        static = loss.shape[1:]
        if static.is_fully_defined():
            loss = tf.reduce_mean(loss, axis=list(range(1, loss.shape.rank)))
        else:
            loss = tf.reduce_mean(
                tf.reshape(loss, tf.stack([tf.shape(loss)[0], -1])), axis=1)
    return loss, grad_loss


class PerExampleOptimizer(_Optimizer):
    """Wraps a TF1 optimizer; takes the per-example loss `[B]`, sums over it.

    The gradient is `sum_i g_i`, exactly what the wrapped optimizer computes
    for the same vector loss; in addition the per-example gradient norms are
    available as `per_example_norms` (built on first access). Subclasses
    change `_aggregate`.

    Args:
      optimizer: the `tf.compat.v1.train.Optimizer` that applies the
        gradients (and owns the slots).
      strategy: how per-example quantities are computed: "auto", "rules",
        "pfor" or "loop" (see `custagg.per_example_gradients`).
      name: the wrapper's name; defaults to the class name plus the wrapped
        optimizer's name. Slots are named by the wrapped optimizer.
    """

    _name_prefix = "PerExample"

    def __init__(self, optimizer, strategy="auto", name=None):
        cls_name = type(self).__name__
        if not isinstance(optimizer, _Optimizer):
            hint = ""
            if isinstance(optimizer, type) and issubclass(optimizer,
                                                          _Optimizer):
                hint = (" Pass an instance, e.g. %s(learning_rate=0.1)."
                        % optimizer.__name__)
            elif hasattr(optimizer, "build") or hasattr(optimizer,
                                                        "iterations"):
                hint = (" Keras optimizers (tf.keras.optimizers.*) are not "
                        "TF1 optimizers; use tf.compat.v1.train.* instead.")
            raise TypeError(
                "%s: optimizer must be a tf.compat.v1.train.Optimizer "
                "instance (GradientDescentOptimizer, MomentumOptimizer, "
                "AdamOptimizer, ...); got %r.%s" % (cls_name, optimizer, hint))
        if not isinstance(strategy, str):
            raise TypeError("%s: strategy must be a string such as 'auto', "
                            "'rules', 'pfor' or 'loop'; got %r."
                            % (cls_name, strategy))
        super().__init__(use_locking=False,
                         name=name or self._name_prefix + optimizer.get_name())
        self._optimizer = optimizer
        self._strategy = strategy
        self._last_loss = None
        self._last_var_list = None
        self._norms = None
        self._was_compute_gradients_called = False
        # Object-based checkpoints (tf.train.Checkpoint) reach the slots
        # through the wrapped optimizer.
        _tf_compat.track_trackable(self, optimizer, name="optimizer")

    # ---------------------------------------------------------------- access

    optimizer = read_only("_optimizer",
                          "The wrapped `tf.compat.v1.train.Optimizer`.")
    strategy = read_only("_strategy")

    @property
    def per_example_norms(self):
        """`[B]` L2 norms (over all variables) of the per-example gradients of
        the last `compute_gradients` call, before any clipping."""
        computed(self._last_loss, self, "per_example_norms")
        if self._norms is None:
            with self._last_loss.graph.as_default():
                self._norms = per_example_api.per_example_norms(
                    self._last_loss, self._last_var_list,
                    strategy=self._strategy)
        return self._norms

    # ------------------------------------------------------ TF1 optimizer API

    def compute_gradients(self, loss=None, var_list=None,
                          gate_gradients=_Optimizer.GATE_OP,
                          aggregation_method=None,
                          colocate_gradients_with_ops=False, grad_loss=None,
                          per_example_loss=None):
        """Aggregated gradients of a per-example loss, as `[(grad, var)]`.

        Args:
          loss: float `[B]` tensor, one loss per example (do not reduce it
            to a mean), or `[B, ...]`, whose trailing axes are averaged per
            example (as TF Privacy does).
          var_list: variables to differentiate; defaults to the graph's
            trainable variables (as in TF1). Variables that cannot be
            differentiated (e.g. string variables) get a `None` gradient,
            as in TF1.
          gate_gradients: `GATE_NONE`, `GATE_OP` or `GATE_GRAPH` (TF1's
            meaning).
          aggregation_method: a summing `tf.AggregationMethod` / custagg
            method for contributions inside the graph, or None.
          colocate_gradients_with_ops: as in TF1.
          grad_loss: optional tensor of the loss's shape multiplying each
            example's loss (TF1's seed of the backward pass).
          per_example_loss: the old name of `loss` (still accepted).

        Returns:
          A list of `(gradient, variable)` pairs; the gradient is None for
          variables the loss does not depend on or that are not
          differentiable.
        """
        loss = _pick_loss(loss, per_example_loss,
                          type(self).__name__ + ".compute_gradients")
        loss, var_list, grad_loss = self._prepare(
            loss, var_list, gate_gradients, aggregation_method, grad_loss)
        live = [v for v in var_list if differentiable(v)]
        self._last_var_list = live
        grads = [None] * len(var_list)
        if live:
            with tf.name_scope(self._name + "_gradients"):
                live_grads = self._aggregate(
                    loss, live, grad_loss=grad_loss,
                    gate_gradients=gate_gradients == _Optimizer.GATE_OP,
                    aggregation_method=aggregation_method,
                    colocate_gradients_with_ops=colocate_gradients_with_ops)
            it = iter(live_grads)
            grads = [next(it) if differentiable(v) else None
                     for v in var_list]
        self._was_compute_gradients_called = True
        if gate_gradients == _Optimizer.GATE_GRAPH:
            present = [i for i, g in enumerate(grads) if g is not None]
            gated = tf.tuple([grads[i] for i in present])
            for i, g in zip(present, gated):
                grads[i] = g
        return list(zip(grads, var_list))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Applies gradients with the wrapped optimizer (TF1 semantics)."""
        return self._optimizer.apply_gradients(
            grads_and_vars, global_step=global_step, name=name or self._name)

    def minimize(self, loss=None, global_step=None, var_list=None,
                 gate_gradients=_Optimizer.GATE_OP, aggregation_method=None,
                 colocate_gradients_with_ops=False, name=None,
                 grad_loss=None, per_example_loss=None):
        """`compute_gradients` then `apply_gradients`, as TF1's `minimize`.

        `loss` is the per-example loss (`[B]` or `[B, ...]`, see
        `compute_gradients`); `per_example_loss` is its old name.

        Returns:
          The update op; it increments `global_step` when one is given.

        Raises:
          ValueError: no variable receives a gradient.
        """
        loss = _pick_loss(loss, per_example_loss,
                          type(self).__name__ + ".minimize")
        grads_and_vars = self.compute_gradients(
            loss, var_list=var_list,
            gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            grad_loss=grad_loss)
        if all(g is None for g, _ in grads_and_vars):
            raise ValueError(
                "%s.minimize: no gradients for any variable: %s. The "
                "per-example loss %s does not depend on them." % (
                    type(self).__name__,
                    [_var_name(v) for _, v in grads_and_vars],
                    loss.name))
        return self.apply_gradients(grads_and_vars, global_step=global_step,
                                    name=name)

    def get_slot(self, var, name):
        return self._optimizer.get_slot(var, name)

    def get_slot_names(self):
        return self._optimizer.get_slot_names()

    def variables(self):
        """The wrapped optimizer's variables plus this wrapper's own (the DP
        noise counter), in the current graph, sorted by name."""
        graph = tf.compat.v1.get_default_graph()
        own = [v for v in _tf_compat.non_slot_variables(self)
               if v.graph is graph]
        return sorted(list(self._optimizer.variables()) + own,
                      key=lambda v: v.name)

    # -------------------------------------------------------------- helpers

    def _prepare(self, loss, var_list, gate_gradients, aggregation_method,
                 grad_loss):
        """Checks arguments; returns `(loss [B], var_list, grad_loss)`."""
        cls_name = type(self).__name__
        errors.check_not_eager(cls_name + ".compute_gradients")
        loss, grad_loss = per_example_loss_vector(
            loss, grad_loss, cls_name + ".compute_gradients")
        if gate_gradients not in (_Optimizer.GATE_NONE, _Optimizer.GATE_OP,
                                  _Optimizer.GATE_GRAPH):
            raise ValueError(
                "%s.compute_gradients: gate_gradients must be one of "
                "Optimizer.GATE_NONE (0), GATE_OP (1), GATE_GRAPH (2); got "
                "%r." % (cls_name, gate_gradients))
        if aggregation_method is not None:
            if aggregation_method == aggregation.AggregationMethod.CUSTOM:
                raise ValueError(
                    "%s.compute_gradients: aggregation_method=CUSTOM is what "
                    "WeightedOptimizer does; here pass None or a summing "
                    "method." % cls_name)
            aggregation.check_method(aggregation_method)
        if var_list is None:
            var_list = (tf.compat.v1.trainable_variables() +
                        tf.compat.v1.get_collection(
                            tf.compat.v1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES))
            # A resource variable may be in both collections.
            seen, unique = set(), []
            for v in var_list:
                if id(v) not in seen:
                    seen.add(id(v))
                    unique.append(v)
            var_list = unique
        else:
            var_list = tf.nest.flatten(var_list)
        if not var_list:
            raise ValueError("%s.compute_gradients: no variables to optimize "
                             "(var_list is empty and the graph has no "
                             "trainable variables)." % cls_name)
        for v in var_list:
            if not isinstance(v, tf.Variable):
                raise TypeError(
                    "%s.compute_gradients: var_list must hold tf.Variables; "
                    "got %r." % (cls_name, v))
        self._last_loss = loss
        self._norms = None
        return loss, list(var_list), grad_loss

    def _aggregate(self, loss, var_list, grad_loss, gate_gradients,
                   aggregation_method, colocate_gradients_with_ops):
        """Returns the list of aggregated gradients aligned with `var_list`."""
        return list(traversal_gradients.gradients(
            loss, var_list, grad_ys=grad_loss, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops))


class WeightedOptimizer(PerExampleOptimizer):
    """`sum_i f_i * g_i`, with per-example factors `f` fed every step.

    Built with `custagg.gradients(..., aggregation_method=CUSTOM,
    gradient_factors=f)`: one backward pass, no per-example gradients are
    materialized. `f = 1/B` everywhere gives the gradient of the mean loss;
    zeros drop examples; any other weights (importance sampling,
    re-weighting of classes) work the same way.

    Args:
      optimizer: the wrapped `tf.compat.v1.train.Optimizer`.
      gradient_factors: a `[B]` float tensor (usually a placeholder). None
        creates `tf.compat.v1.placeholder(loss.dtype, [B])` named
        "gradient_factors" in `compute_gradients`; read it back from the
        `gradient_factors` attribute to feed it.
      strategy: used for `per_example_norms` only.
      name: see `PerExampleOptimizer`.
    """

    _name_prefix = "Weighted"

    def __init__(self, optimizer, gradient_factors=None, strategy="auto",
                 name=None):
        super().__init__(optimizer, strategy=strategy, name=name)
        if gradient_factors is not None and not isinstance(
                gradient_factors, (tf.Tensor, tf.Variable)):
            raise TypeError(
                "WeightedOptimizer: gradient_factors must be a [B] tensor "
                "(e.g. tf.compat.v1.placeholder(tf.float32, [B])) or None; "
                "got %r. To use fixed weights, wrap them in tf.constant."
                % (gradient_factors,))
        self._factors = gradient_factors

    @property
    def gradient_factors(self):
        """The `[B]` factors tensor (to feed); created by compute_gradients."""
        if self._factors is None:
            raise ValueError(
                "WeightedOptimizer.gradient_factors: the placeholder is "
                "created by compute_gradients()/minimize(); call it first, or "
                "pass gradient_factors= to the constructor.")
        return self._factors

    def _aggregate(self, loss, var_list, grad_loss, gate_gradients,
                   aggregation_method, colocate_gradients_with_ops):
        if self._factors is None:
            with loss.graph.name_scope(None):
                self._factors = tf.compat.v1.placeholder(
                    loss.dtype, [tf.compat.dimension_value(loss.shape[0])],
                    name="gradient_factors")
        return list(traversal_gradients.gradients(
            loss, var_list, grad_ys=grad_loss, gate_gradients=gate_gradients,
            aggregation_method=aggregation.AggregationMethod.CUSTOM,
            gradient_factors=self._factors,
            colocate_gradients_with_ops=colocate_gradients_with_ops))


class DPOptimizer(PerExampleOptimizer):
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
      seed: None draws the noise with a stateful `tf.random.normal` (TF's
        graph-level seed applies). An int makes the noise a function of
        `(seed, step)` where `step` counts evaluations of the noise and is a
        variable of this optimizer (saved in checkpoints): runs repeat
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
        self._group_ids = check_group_ids(group_ids, num_microbatches,
                                          cls_name)
        self._l2_norm_clip = self._check_clip(l2_norm_clip)
        self._noise_multiplier = check_positive(
            noise_multiplier, "noise_multiplier", cls_name, allow_zero=True)
        if num_microbatches is not None and (
                isinstance(num_microbatches, bool)
                or not isinstance(num_microbatches, (int, np.integer))
                or num_microbatches < 1):
            raise ValueError(
                "%s: num_microbatches must be a positive int dividing the "
                "batch size, or None (one example per microbatch); got %r."
                % (cls_name, num_microbatches))
        self._num_microbatches = (None if num_microbatches is None
                                  else int(num_microbatches))
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
            return {k: check_positive(c, "l2_norm_clip[%r]" % (k,), cls_name)
                    for k, c in clip.items()}
        if isinstance(clip, (list, tuple)):
            if not clip:
                raise ValueError("%s: l2_norm_clip is an empty list." %
                                 cls_name)
            return [check_positive(c, "l2_norm_clip[%d]" % i, cls_name)
                    for i, c in enumerate(clip)]
        return check_positive(clip, "l2_norm_clip", cls_name)

    l2_norm_clip = read_only("_l2_norm_clip")
    noise_multiplier = read_only("_noise_multiplier")
    num_microbatches = read_only("_num_microbatches")
    group_ids = read_only("_group_ids", "The `[B]` user ids (or None).")

    @property
    def per_example_clipped_norms(self):
        """`[M]` global norms of the clipped per-microbatch contributions."""
        return computed(self._clipped_norms, self,
                        "per_example_clipped_norms")

    @property
    def noise_stddev(self):
        return computed(self._noise_stddev, self, "noise_stddev",
                        "compute_gradients()")

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Applies gradients from this optimizer's `compute_gradients`.

        Raises:
          ComputeGradientsNotCalledError (an `AssertionError`, as in TF
          Privacy): `compute_gradients` (or `minimize`) was never called, so
          the gradients applied were not clipped and noised here and the
          training would not be differentially private.
        """
        check_compute_gradients_called(self)
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
                       ", ".join(_var_name(v) for v in var_list)))
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
                if _var_name(v) not in by_name:
                    raise ValueError(
                        "%s: l2_norm_clip has no clip norm for variable %r; "
                        "its keys are %s." % (cls_name, _var_name(v),
                                              sorted(by_name)))
                per_layer.append(by_name[_var_name(v)])
            unused = set(by_name) - set(_var_name(v) for v in var_list)
            if unused:
                raise ValueError(
                    "%s: l2_norm_clip names %s, which are not in var_list "
                    "(%s)." % (cls_name, sorted(unused),
                               ", ".join(_var_name(v) for v in var_list)))
        else:
            return _to_dtype(clip, dtype)
        return [_to_dtype(c, dtype) for c in per_layer]

    def _noise_counter(self, colocate_with):
        with tf.compat.v1.get_default_graph().name_scope(None):
            return _tf_compat.create_non_slot_variable(
                self, initial_value=np.int64(0),
                name=self._name + "_noise_step", colocate_with=colocate_with)

    def _noise(self, grads, stddev, var_list):
        """Gaussian noise for each present gradient, one draw per step.

        Each draw waits for the clipped sums (a control dependency): it
        needs nothing from the backward pass, so without one TF runs it when
        the step starts and the noise (with the seeded split, two copies of
        the parameters) stays live through the whole backward pass
        (mnist_deep B=256: 13 MB of the DP step's 97 MB peak); waiting for
        one gradient only, a large layer's noise is drawn while the other
        layers' backward tensors are still live (B=64: 1.25x the plain
        step's peak, against 1.0x). Unseeded, each variable's noise is its
        own draw, added in the noise's buffer (no `[P]` vector and split
        copy); seeded, one `[P]` draw split into pieces, the stream
        `(seed, step)` has always given."""
        present = [g for g in grads if g is not None]
        if self._seed is None:
            return noise_after(grads, stddev)
        # The counter variable is made outside the control dependencies (its
        # initializer must not wait for a step's gradients).
        counter = self._noise_counter(var_list[0])
        with tf.control_dependencies(present):
            return self._seeded_noise(grads, present, stddev, counter)

    def _seeded_noise(self, grads, present, stddev, counter):
        sizes = [tf.size(g) for g in present]
        total = tf.add_n(sizes) if len(sizes) > 1 else sizes[0]
        dtype = present[0].dtype
        step = tf.compat.v1.assign_add(counter, 1)
        flat = tf.random.stateless_normal(
            [total], seed=tf.stack([tf.constant(self._seed, tf.int64), step]),
            stddev=stddev, dtype=dtype)
        pieces = tf.split(flat, sizes)
        it = iter(pieces)
        return [None if g is None else tf.reshape(next(it), tf.shape(g))
                for g in grads]

    def _aggregate(self, loss, var_list, grad_loss, gate_gradients,
                   aggregation_method, colocate_gradients_with_ops):
        if grad_loss is not None:
            loss = loss * tf.stop_gradient(grad_loss)
            self._last_loss = loss
        clips = self._clips_for(var_list, loss.dtype)
        grads, num_units = self._clipped_sum(loss, var_list, clips)
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        global_clip = (clips if not isinstance(clips, list) else
                       tf.sqrt(tf.add_n([tf.square(c) for c in clips])))
        self._noise_stddev = tf.identity(
            _to_dtype(self._noise_multiplier, loss.dtype) * global_clip,
            name="noise_stddev")
        if self._has_noise and any(g is not None for g in grads):
            noise = self._noise(grads, self._noise_stddev, var_list)
            grads = [None if g is None else g + n
                     for g, n in zip(grads, noise)]
        return [None if g is None else g / num_units for g in grads]

    def _clipped_sum(self, loss, var_list, clips):
        """`sum_m clip(g_m)` per variable, and M as a `loss.dtype` scalar.

        Also sets the norms before and after clipping.
        """
        grads, num_units, self._norms, self._clipped_norms = \
            clipped_microbatch_sum(loss, var_list, clips,
                                   self._num_microbatches, self._strategy,
                                   type(self).__name__,
                                   group_ids=self._group_ids)
        return grads, num_units


def noise_after(sums, stddev):
    """`N(0, stddev^2)` noise shaped as each present tensor of `sums` (None
    where it is None), each its own draw, drawn once every sum exists: with
    a static shape folded to a constant, a draw would otherwise run when
    the step starts and stay live through the backward pass."""
    present = [g for g in sums if g is not None]
    with tf.control_dependencies(present):
        return [None if g is None else tf.random.normal(
            tf.shape(g), stddev=stddev, dtype=g.dtype) for g in sums]


def check_group_ids(group_ids, num_microbatches, owner):
    """`group_ids` for a DP optimizer: None or an integer tensor (checked
    further against the loss in `compute_gradients`)."""
    if group_ids is None:
        return None
    if num_microbatches is not None:
        raise ValueError(
            "%s: pass num_microbatches or group_ids, not both (with "
            "group_ids each user is one microbatch)." % owner)
    if not isinstance(group_ids, (tf.Tensor, tf.Variable)):
        raise TypeError(
            "%s: group_ids must be a [B] integer tensor of user ids, e.g. "
            "tf.compat.v1.placeholder(tf.int64, [None]) fed each step; got "
            "%r." % (owner, group_ids))
    if not group_ids.dtype.base_dtype.is_integer:
        raise TypeError("%s: group_ids must be an integer tensor (user ids); "
                        "got dtype %s." % (owner, group_ids.dtype.name))
    return group_ids


def user_mean_loss(loss, group_ids, owner):
    """`(loss_b / n_u(b), U)`: each example's loss divided by its user's
    number of examples, so a user's summed gradient is the gradient of the
    user's mean loss (TF Privacy's microbatch record), and the number of
    users U as a `loss.dtype` scalar.

    Raises:
      TypeError, ValueError: `group_ids` of another dtype, rank or length
        than the loss's (run-time assertions where not static).
    """
    from custagg.per_example import api  # pylint: disable=g-import-not-at-top
    segments, checks = api.group_segments(loss, group_ids, owner)
    with tf.control_dependencies(checks):
        sizes = segments.spread(segments.sizes(loss.dtype))
    return (loss / tf.stop_gradient(sizes),
            tf.cast(segments.count, loss.dtype))


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
      `(grads, M as a loss.dtype scalar, norms [M], clipped_norms [M])`;
      `grads` is aligned with `var_list` (None where unconnected).
    """
    if group_ids is not None:
        loss, num_units = user_mean_loss(loss, group_ids, owner)
        grads, norms = per_example_api.clipped_gradients(
            loss, var_list, clips, strategy=strategy, return_norms=True,
            group_ids=group_ids)
        return (grads, num_units) + _norm_pair(norms, clips)
    batch_static = tf.compat.dimension_value(loss.shape[0])
    mb = num_microbatches
    if mb is not None and batch_static is not None and batch_static % mb:
        raise ValueError("%s: num_microbatches=%d does not divide the batch "
                         "size %d." % (owner, mb, batch_static))
    if mb is None or mb == batch_static:
        # One example per microbatch.
        group_size, scaled = None, clips
        num_units = (tf.constant(batch_static, loss.dtype)
                     if batch_static is not None else
                     tf.cast(tf.shape(loss)[0], loss.dtype))
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
    return (grads, num_units) + _norm_pair(norms, clips)


def _norm_pair(norms, clips):
    """`(norms [M], clipped norms [M])` from the clipped sum's norms."""
    if isinstance(clips, list):
        # Per-layer: the norms come per variable and each variable's
        # contribution is clipped on its own.
        clipped_norms = tf.sqrt(tf.add_n([
            tf.square(tf.minimum(n, c)) for n, c in zip(norms, clips)]))
        norms = tf.sqrt(tf.add_n([tf.square(n) for n in norms]))
    else:
        clipped_norms = tf.minimum(norms, clips)
    return norms, clipped_norms


def _scale(g, factor):
    """`g * factor` for a Tensor or IndexedSlices (kept sparse)."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype),
                                g.indices, g.dense_shape)
    return g * tf.cast(factor, g.dtype)


def _key_name(k):
    """The variable name a key of a per-layer l2_norm_clip dict stands for."""
    if hasattr(k, "deref"):
        k = k.deref()
    if isinstance(k, tf.Variable):
        return _var_name(k)
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


def make_gaussian_optimizer_class(cls):
    """A DP-SGD class for the TF1 optimizer class `cls`, TF Privacy style.

    The returned class takes `(l2_norm_clip, noise_multiplier,
    num_microbatches=None, *args, seed=None, strategy="auto", **kwargs)`;
    `*args, **kwargs` construct `cls` (e.g. `learning_rate=0.1`).
    """
    check_tf1_optimizer_class(cls, "make_gaussian_optimizer_class")

    class DPGaussianOptimizerClass(DPOptimizer):  # pylint: disable=missing-docstring

        def __init__(self, l2_norm_clip, noise_multiplier,
                     num_microbatches=None, *args, seed=None,
                     strategy="auto", group_ids=None, **kwargs):
            super().__init__(cls(*args, **kwargs), l2_norm_clip,
                             noise_multiplier,
                             num_microbatches=num_microbatches, seed=seed,
                             strategy=strategy, group_ids=group_ids)

    base = cls.__name__.replace("Optimizer", "")
    DPGaussianOptimizerClass.__name__ = "DP%sGaussianOptimizer" % base
    DPGaussianOptimizerClass.__qualname__ = DPGaussianOptimizerClass.__name__
    DPGaussianOptimizerClass.__doc__ = (
        "DP-SGD with `%s` applying the gradients; see `DPOptimizer`."
        % cls.__name__)
    return DPGaussianOptimizerClass


DPGradientDescentGaussianOptimizer = make_gaussian_optimizer_class(
    tf.compat.v1.train.GradientDescentOptimizer)
DPMomentumGaussianOptimizer = make_gaussian_optimizer_class(
    tf.compat.v1.train.MomentumOptimizer)
DPAdagradGaussianOptimizer = make_gaussian_optimizer_class(
    tf.compat.v1.train.AdagradOptimizer)
DPAdamGaussianOptimizer = make_gaussian_optimizer_class(
    tf.compat.v1.train.AdamOptimizer)
# TF Privacy's short names (`DPGradientDescentOptimizer`, `DPAdamOptimizer`,
# ...) take a DPQuery first: they are `custagg.privacy.dp_optimizer`'s
# classes, which build on this module. The public path `custagg.optimizers`
# shows them too: custagg/__init__.py (above both layers) binds them there.
