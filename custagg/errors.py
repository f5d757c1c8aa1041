"""Error helpers shared by the public functions."""

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
