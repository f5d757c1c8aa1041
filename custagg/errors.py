"""Error helpers shared by the public functions."""

import numbers

import numpy as np
import tensorflow as tf
from custagg import _tf_compat
from custagg._tf_compat import ops

# Every public function goes through this module. Inside a tf.function,
# custagg's code must run as written (it builds the graph itself), not be
# rewritten by autograph as user code is.
_tf_compat.autograph_do_not_convert("custagg")


def check_not_eager(fn_name):
    """Raises when called in eager mode: custagg builds graphs."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "%s builds graph-mode gradients and needs graph mode, but eager "
            "execution is on. Call tf.compat.v1.disable_eager_execution() at "
            "the start of the program, or build the model inside "
            "`with tf.Graph().as_default():` and run it with "
            "tf.compat.v1.Session." % fn_name)


def capturing_eager_tensors():
    """True while a FuncGraph is being built (inside a `tf.function`).

    There an eager tensor (a constant, or the handle of a variable created
    eagerly) is an ordinary input: converting it captures it into the
    function graph, as `tf.gradients` does for its xs.
    """
    return _tf_compat.building_function(ops.get_default_graph())


def check_graph_tensor(t, arg, fn_name):
    """Raises for eager tensors outside a function graph.

    Inside a `tf.function` an eager tensor is accepted: the caller converts
    it (`tf.convert_to_tensor` or TF's internal conversions), which captures
    it into the function graph.
    """
    if isinstance(t, ops.EagerTensor) and not capturing_eager_tensors():
        raise TypeError(
            "%s: %s holds an eager tensor (%r); graph tensors are needed. "
            "Build it inside the graph (e.g. tf.compat.v1.placeholder) instead "
            "of creating it eagerly, or call %s inside a tf.function, which "
            "captures eager tensors and variables." % (fn_name, arg, t,
                                                       fn_name))


def check_graph_tensors(ts, arg, fn_name):
    """`check_graph_tensor` for each of the list `ts`, named `arg[i]`.

    The name is formatted only on failure: ys can hold thousands of slices.
    """
    for i, t in enumerate(ts):
        if isinstance(t, ops.EagerTensor):
            check_graph_tensor(t, "%s[%d]" % (arg, i), fn_name)


# Keras 3 where a Keras 2 layer was meant (TF >= 2.16 without tf-keras or
# with TF_USE_LEGACY_KERAS unset when Keras was first touched).
KERAS2_FIX = (
    "TensorFlow >= 2.16 routes tf.keras and tf.compat.v1.layers to Keras 3, "
    "which has no TF1 layers; TF1 graph code needs Keras 2: `pip install "
    "tf-keras` (the release of your TensorFlow's minor version, e.g. "
    "tf-keras==2.21.* for TF 2.21; `pip install custagg` installs it) and "
    "set TF_USE_LEGACY_KERAS=1 before TensorFlow first loads Keras (export "
    "it in the shell, or `import custagg` before using any Keras layer).")


def is_keras3_error(exc):
    """Whether `exc` is TensorFlow refusing a TF1/Keras-2 API under Keras 3."""
    return "Keras 3" in str(exc)


def keras3_hint(exc):
    """`exc`'s message followed by the fix, for errors met under Keras 3."""
    return "%s\n%s" % (exc, KERAS2_FIX)


def check_argument(ok, where, arg, expected, value, error=ValueError):
    """Raise `error` naming `where`'s argument `arg` unless `ok`.

    The message reads "<where>: `<arg>` must be <expected>, got <value>."
    (one wording for the constructors' argument checks).
    """
    if not ok:
        raise error("%s: `%s` must be %s, got %r." % (where, arg, expected,
                                                        value))


def _is_real_number(x):
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def checked_clip_norm(clip, fn, arg="l2_norm_clip"):
    """`clip` after checking that it is a usable clip norm C >= 0.

    C = 0 is allowed: every clipped gradient is then exactly 0 (the factors
    C / max(norm, C) are taken as 0 where both are 0, never 0/0).

    Args:
      clip: a Python number, a scalar tensor or variable, or a list/tuple of
        them (per-x clip norms).
      fn: the public function, for messages.
      arg: the argument's name, for messages (`l2_norm_clip[i]` per entry).

    Returns:
      `clip` unchanged for Python numbers; for tensors, the same value behind
      run-time assertions (`tf.debugging`) that it is finite and >= 0. Lists
      keep their type and order.

    Raises:
      TypeError: not a real number or a numeric scalar tensor.
      ValueError: a negative, NaN or infinite number, or a tensor that is not
        a scalar (or whose constant value is out of range).
    """
    if isinstance(clip, (list, tuple)):
        return type(clip)(checked_clip_norm(c, fn, "%s[%d]" % (arg, i))
                          for i, c in enumerate(clip))
    expected = ("%s: %s must be a finite number >= 0 (the L2 norm each "
                "per-example gradient is clipped to), a scalar tensor, or one "
                "such value per x" % (fn, arg))
    if _is_real_number(clip):
        if not np.isfinite(clip) or clip < 0:
            raise ValueError(
                "%s; got %r. Use a positive clip norm (e.g. 1.0); for no "
                "clipping use custagg.per_example_gradients or "
                "custagg.gradients instead." % (expected, clip))
        return clip
    if isinstance(clip, (tf.Tensor, tf.Variable)):
        dtype = clip.dtype.base_dtype
        if not (dtype.is_floating or dtype.is_integer):
            raise TypeError("%s; got a tensor of dtype %s."
                            % (expected, dtype.name))
        if clip.shape.rank not in (None, 0):
            raise ValueError("%s; got a tensor of shape %s."
                             % (expected, clip.shape))
        static = tf.get_static_value(clip) if isinstance(clip, tf.Tensor) \
            else None
        if static is not None:
            checked_clip_norm(float(static), fn, arg)
            return clip
        check_not_eager(fn)
        value = tf.convert_to_tensor(clip)
        message = "%s (checked at run time)" % expected
        checks = [tf.debugging.assert_non_negative(value, message=message)]
        if dtype.is_floating:
            checks.append(tf.debugging.assert_all_finite(value, message))
        with tf.control_dependencies(checks):
            return tf.identity(value)
    raise TypeError("%s; got %r." % (expected, clip))
