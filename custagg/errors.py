"""Error helpers shared by the public functions."""

import tensorflow as tf
from custagg._tf_compat import ops


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
    if isinstance(t, ops.EagerTensor):
        raise TypeError(
            "%s: %s holds an eager tensor (%r); graph tensors are needed. "
            "Build it inside the graph (e.g. tf.compat.v1.placeholder) instead "
            "of creating it eagerly." % (fn_name, arg, t))


def check_graph_tensors(ts, arg, fn_name):
    """`check_graph_tensor` for each of the list `ts`, named `arg[i]`.

    The name is formatted only on failure: ys can hold thousands of slices.
    """
    for i, t in enumerate(ts):
        if isinstance(t, ops.EagerTensor):
            check_graph_tensor(t, "%s[%d]" % (arg, i), fn_name)
