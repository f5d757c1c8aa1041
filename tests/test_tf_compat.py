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
