"""TF1 optimizers that aggregate per-example gradients: summed and weighted.

Each class wraps any `tf.compat.v1.train.Optimizer` (GradientDescent,
Momentum, Adam, ...) and is itself one. It changes only how gradients are
computed; applying them, the slots (`get_slot`, `get_slot_names`),
`variables()`, `global_step` and the update op's `name` are the wrapped
optimizer's, so checkpoints hold exactly what they would hold without the
wrapper.

The loss passed to `compute_gradients` / `minimize` is the per-example loss
vector `[B]` (e.g. `tf.nn.sparse_softmax_cross_entropy_with_logits(...)`
without `tf.reduce_mean`). With `g_i` the gradient of `loss[i]`:

| class                 | gradient                                                   |
|-----------------------|------------------------------------------------------------|
| `PerExampleOptimizer` | `sum_i g_i` (what TF1 computes for a vector loss)          |
| `WeightedOptimizer`   | `sum_i f_i g_i`, `f` = `gradient_factors` fed each step     |

The DP wrappers built on `PerExampleOptimizer` (`DPOptimizer`,
`ClippedOptimizer`) are in `custagg.privacy.wrappers`; all of them are
public as `custagg.optimizers`.
"""

from __future__ import annotations

import tensorflow as tf

from custagg import _tf_compat
from custagg import errors
from custagg.per_example import api as per_example_api
from custagg.traversal import aggregation
from custagg.traversal import gradients as traversal_gradients

__all__ = [
    "PerExampleOptimizer",
    "WeightedOptimizer",
    "computed",
    "differentiable",
    "per_example_loss_vector",
    "read_only",
    "var_name",
]

_Optimizer = tf.compat.v1.train.Optimizer


def var_name(v):
    """A variable's name without its ":0"."""
    return v.name[:-2] if v.name.endswith(":0") else v.name


def computed(value, owner, attr, when="compute_gradients() or minimize()"):
    """`value`, or a ValueError saying `owner.attr` needs `when` first."""
    if value is None:
        raise ValueError("%s.%s is available after %s has been called."
                         % (type(owner).__name__, attr, when))
    return value


def read_only(attr, doc=None):
    """A property returning `self.<attr>`."""
    return property(lambda self: getattr(self, attr), doc=doc)




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
        errors.check_graph_tensor(grad_loss, "grad_loss", fn)
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
        per_example_api.check_strategy(strategy, cls_name)
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
        """Applies gradients with the wrapped optimizer (TF1 semantics; the
        update op is named as the wrapped optimizer names it)."""
        return self._optimizer.apply_gradients(
            grads_and_vars, global_step=global_step, name=name)

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
                    [var_name(v) for _, v in grads_and_vars],
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
        for i, v in enumerate(var_list):
            if not isinstance(v, tf.Variable):
                raise TypeError(
                    "%s.compute_gradients: var_list must hold tf.Variables; "
                    "got %r." % (cls_name, v))
            try:
                graph = v.graph
            except (AttributeError, RuntimeError):   # an eager variable
                graph = None
            if graph is not loss.graph and not _tf_compat.building_function(
                    loss.graph):
                raise ValueError(
                    "%s.compute_gradients: var_list[%d] (%s) is %s; create "
                    "the variables in the graph that builds the loss." % (
                        cls_name, i, v.name, "an eager variable"
                        if graph is None else "of another graph than the "
                        "loss"))
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
        # The placeholders made when none was given: one per (graph, loss
        # dtype, static B), so the optimizer works in another graph or on a
        # loss of another batch size as a TF1 optimizer does; the latest is
        # `gradient_factors`.
        self._made = {}
        self._latest = None

    @property
    def gradient_factors(self):
        """The `[B]` factors tensor to feed: the one given, else the
        placeholder the last compute_gradients()/minimize() made."""
        if self._factors is not None:
            return self._factors
        if self._latest is None:
            raise ValueError(
                "WeightedOptimizer.gradient_factors: the placeholder is "
                "created by compute_gradients()/minimize(); call it first, or "
                "pass gradient_factors= to the constructor.")
        return self._latest

    def _aggregate(self, loss, var_list, grad_loss, gate_gradients,
                   aggregation_method, colocate_gradients_with_ops):
        factors = self._factors
        if factors is None:
            batch = tf.compat.dimension_value(loss.shape[0])
            key = (loss.graph, loss.dtype.base_dtype, batch)
            factors = self._made.get(key)
            if factors is None:
                with loss.graph.name_scope(None):
                    factors = self._made[key] = tf.compat.v1.placeholder(
                        loss.dtype, [batch], name="gradient_factors")
            self._latest = factors
        return list(traversal_gradients.gradients(
            loss, var_list, grad_ys=grad_loss, gate_gradients=gate_gradients,
            aggregation_method=aggregation.AggregationMethod.CUSTOM,
            gradient_factors=factors,
            colocate_gradients_with_ops=colocate_gradients_with_ops))
