"""TensorFlow internals go through custagg/_tf_compat.py and nowhere else."""

import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "custagg")
COMPAT = os.path.join(ROOT, "_tf_compat.py")

# Private TF attributes custagg needs; only the compat module may name them.
PRIVATE = ["_node_def", "_gradient_registry", "_create_op_internal",
           "_colocate_with_for_gradient", "_building_function",
           "_is_function", "_get_function", "_control_flow_context",
           "_get_control_flow_context", "_original_op", "_attr_scope",
           "_get_operation_by_name", "_track_trackable",
           "_create_non_slot_variable", "_non_slot_variables",
           "_pywrap_util_port", "python_grad_func", "cached_definition",
           "_c_op", "_c_graph"]
_PRIVATE_RE = re.compile(r"(?<!_tf_compat)\.(%s)\b|\b_pywrap_util_port\b"
                         % "|".join(PRIVATE))
_IMPORT_RE = re.compile(r"tensorflow\.python|tensorflow\.core")


def _sources():
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                if path != COMPAT:
                    yield path


@pytest.mark.parametrize("pattern", [_IMPORT_RE, _PRIVATE_RE],
                         ids=["tensorflow_python_imports", "private_attrs"])
def test_only_compat_module_reaches_into_tensorflow(pattern):
    found = []
    for path in _sources():
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if pattern.search(line):
                    found.append("%s:%d: %s" % (os.path.relpath(path, ROOT), n,
                                                line.strip()))
    assert not found, ("TensorFlow internals outside custagg/_tf_compat.py "
                       "(route them through it):\n" + "\n".join(found))


def test_compat_module_imports():
    from custagg import _tf_compat
    assert _tf_compat.TF_VERSION >= (2, 12)
    import tensorflow as tf
    with tf.Graph().as_default():
        c = tf.constant([1, 2])
        assert _tf_compat.node_def(c.op).op == "Const"
        assert _tf_compat.value_consumers(c) == []


def test_compat_entries_work_on_this_release():
    """Each entry on the running release (the CI runs this file on 2.21,
    2.15 and 2.12; docs/tf-releases.md has what differs between them)."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.framework import function  # a Defun, as users write
    from custagg import _tf_compat

    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float64, [None, 3], name="x")
        w = tf.Variable(np.ones((3, 2)), name="w")
        z = tf.matmul(x, w, name="z")
        assert _tf_compat.node_def(z.op).attr["transpose_a"].b is False
        assert _tf_compat.operation_by_name_fn(g)("z") is z.op
        assert _tf_compat.gradient_registry.lookup("MatMul") is not None
        assert _tf_compat.building_function(g) is False
        assert _tf_compat.control_flow_context(z.op) is None
        assert _tf_compat.graph_control_flow_context(g) is None

        @function.Defun(tf.float64, python_grad_func=lambda op, dy: 3 * dy)
        def triple(v):
            return 3 * v
        y = triple(tf.reduce_sum(z))
        assert _tf_compat.is_function(g, y.op.type)
        func = _tf_compat.get_function(g, y.op.type)
        assert func is not None and _tf_compat.python_grad_func(func)
        assert _tf_compat.function_def(func).signature.name == y.op.type

        # The backward pass is marked; the forward ops are not.
        grads = tf.compat.v1.gradients(tf.reduce_sum(tf.tanh(z)), [w])
        assert _tf_compat.made_by_backward_pass(grads[0].op)
        assert not _tf_compat.made_by_backward_pass(z.op)
        assert _tf_compat.forward_consumers(x) == [z.op]
        assert all(not _tf_compat.made_by_backward_pass(c)
                   for c in _tf_compat.forward_consumers(z))
        with _tf_compat.original_op(g, z.op):
            marked = tf.identity(z)
        assert _tf_compat.made_by_backward_pass(marked.op)

        op_def = tf.identity(z).op.op_def
        made = _tf_compat.create_op(g, "Identity", [z], [z.dtype], "made",
                                    {"T": z.op.node_def.attr["T"]}, op_def)
        assert made.type == "Identity"

        opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        v = _tf_compat.create_non_slot_variable(opt, 0.0, "counter", w)
        assert v in _tf_compat.non_slot_variables(opt)
    assert isinstance(_tf_compat.is_mkl_enabled(), bool)
