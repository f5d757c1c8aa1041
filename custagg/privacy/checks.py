"""Argument checks shared by the DP optimizers and the DP queries, and the
naming of the classes the DP optimizer factories make.

Every error names the argument, says what was expected and what to do.
"""

from __future__ import annotations

import numbers
import sys

import numpy as np
import tensorflow as tf

from custagg._tf_compat import ops

__all__ = ["ComputeGradientsNotCalledError", "check_compute_gradients_called",
           "check_group_ids", "check_microbatches", "check_positive",
           "check_tf1_optimizer_class", "named_after"]

_Optimizer = tf.compat.v1.train.Optimizer


def _is_number(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_positive(value, arg, cls_name, allow_zero=False):
    """Python numbers (and tensors of known constant value) are checked now;
    other tensors are taken as they are (a clip norm tensor is checked at
    run time by `clipped_gradients`).

    Returns:
      The value: a Python float, or the tensor.

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
            number = check_positive(float(static), arg, cls_name, allow_zero)
            if isinstance(value, ops.EagerTensor):
                # Made eagerly (before eager execution was turned off): its
                # value, as a number (the graph cannot capture it).
                return number
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


def check_not_loss_scaled(optimizer, fn):
    """Raises when `optimizer`'s gradients are being computed for a loss-scale
    optimizer that wraps it (`tf.compat.v1.mixed_precision.
    MixedPrecisionLossScaleOptimizer`): it passes the loss times the scale
    S and divides the gradients by S afterwards, so the clip would bound
    S times each gradient and the noise would come out S times smaller than
    the privacy accounting assumes. Looks for the wrapper among the few
    callers above (it calls `compute_gradients` directly)."""
    frame = sys._getframe(1)
    for _ in range(8):
        frame = frame.f_back
        if frame is None:
            return
        caller = frame.f_locals.get("self")
        if (caller is not None and caller is not optimizer and
                getattr(caller, "_optimizer", None) is optimizer and
                hasattr(caller, "_loss_scale")):
            raise ValueError(
                "%s: this optimizer is wrapped by a loss-scale optimizer "
                "(%s), which scales the loss: clipping and the DP noise would "
                "act on scaled gradients, and the noise would come out smaller "
                "by the loss scale than the privacy accounting assumes. Train "
                "without loss scaling (float32 variables and loss)."
                % (fn, type(caller).__name__))


def check_microbatches(num_microbatches, owner, allow_tensor=False):
    """`num_microbatches` as a Python int, or None (one example each).

    Args:
      allow_tensor: accept a tensor of known constant value (TF Privacy's
        classes do).

    Raises:
      TypeError: a tensor whose value is known only at run time.
      ValueError: not a positive int.
    """
    if num_microbatches is None:
        return None
    if allow_tensor and isinstance(num_microbatches, (tf.Tensor,
                                                      tf.Variable)):
        value = tf.get_static_value(num_microbatches)
        if value is None:
            raise TypeError(
                "%s: num_microbatches must be a Python int (or None for one "
                "example per microbatch); a tensor whose value is known only "
                "at run time is not supported." % owner)
        num_microbatches = value
    if allow_tensor:
        bad = isinstance(num_microbatches, bool) or int(
            num_microbatches) != num_microbatches or num_microbatches < 1
    else:
        bad = (isinstance(num_microbatches, bool)
               or not isinstance(num_microbatches, (int, np.integer))
               or num_microbatches < 1)
    if bad:
        raise ValueError(
            "%s: num_microbatches must be a positive int dividing the "
            "batch size, or None (one example per microbatch); got %r."
            % (owner, num_microbatches))
    return int(num_microbatches)


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


class ComputeGradientsNotCalledError(AssertionError):
    """`apply_gradients` on a DP optimizer whose `compute_gradients` was
    never called (TF Privacy raises an `AssertionError` there too)."""


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


def named_after(klass, cls, name_pattern, doc_pattern):
    """`klass` named after the TF1 optimizer class `cls` as TF Privacy names
    its classes: `name_pattern` with cls's name less its "Optimizer" suffix
    (`DP%sOptimizer` -> `DPAdamOptimizer`), `doc_pattern` with cls's name."""
    base = cls.__name__[:-len("Optimizer")] if cls.__name__.endswith(
        "Optimizer") else cls.__name__
    klass.__name__ = klass.__qualname__ = name_pattern % base
    klass.__doc__ = doc_pattern % cls.__name__
    return klass
