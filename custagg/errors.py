"""Error helpers shared by the public functions."""

import tensorflow as tf


def check_not_eager(fn_name):
    """Raises when called in eager mode: custagg builds graphs."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "%s builds graph-mode gradients and needs graph mode, but eager "
            "execution is on. Call tf.compat.v1.disable_eager_execution() at "
            "the start of the program, or build the model inside "
            "`with tf.Graph().as_default():` and run it with "
            "tf.compat.v1.Session." % fn_name)


def check_graph_tensor(t, arg, fn_name):
    """Raises for eager tensors, which have no graph to differentiate."""
    if isinstance(t, tf.Tensor) and not hasattr(t, "graph") or \
            type(t).__name__ == "EagerTensor":
        raise TypeError(
            "%s: %s holds an eager tensor (%r); graph tensors are needed. "
            "Build it inside the graph (e.g. tf.compat.v1.placeholder) instead "
            "of creating it eagerly." % (fn_name, arg, t))
