"""Every TensorFlow internal custagg uses, in one place (TF 2.12-2.21).

custagg re-implements parts of `tf.compat.v1.gradients`, so it needs some
of TensorFlow's private modules and attributes. They all go through this
module: nothing else in custagg imports `tensorflow.python` or reads a
private attribute of a TensorFlow object (`tests/test_tf_compat.py` scans
the sources). Each entry says which releases it was checked on and what
the other releases get instead; when a release moves something, this is
the one file to change.

"2.12-2.21" below means present and used on the four releases checked:
2.12.1, 2.15.1, 2.18.1 and 2.21.0 (the CI, `.ci/run`, runs the suite on
2.21, 2.15 and 2.12; docs/tf-releases.md has the counts). The releases in
between (2.13, 2.14, 2.16, 2.17, 2.19, 2.20) were not run; where an entry
differs between checked releases it names them, and releases in between
get whichever branch the attribute lookup finds.
"""

import tensorflow as tf

# Protocol buffers: generated modules, stable across releases. 2.12-2.21.
from tensorflow.core.framework import attr_value_pb2  # noqa: F401
from tensorflow.core.framework import node_def_pb2
from tensorflow.core.framework import types_pb2  # noqa: F401

# Modules, each 2.12-2.21 under the same path and with the functions custagg
# calls: backprop_util.IsTrainable; composite_tensor.CompositeTensor;
# composite_tensor_gradient.get_flat_tensors_for_gradients /
# replace_flat_tensors_for_gradients; tensor_util.constant_value (the same
# function as the public tf.get_static_value); indexed_slices.IndexedSlices /
# internal_convert_to_tensor_or_indexed_slices /
# convert_n_to_tensor_or_indexed_slices; ops (Graph, EagerTensor,
# get_default_graph, get_gradient_function); v1 loop state
# (control_flow_state.MaybeCreateControlFlowState / ZerosLike and the
# ControlFlowState methods, control_flow_util.Is*); default_gradient
# (get_zeros_dtype, supports_default_grad); gen_functional_ops
# (symbolic_gradient); resource_variable_ops (is_resource_variable,
# variable_shape, get_eager_safe_handle_data); pfor; object_identity.
from tensorflow.python.eager import backprop_util  # noqa: F401
from tensorflow.python.framework import composite_tensor  # noqa: F401
from tensorflow.python.framework import composite_tensor_gradient  # noqa: F401
from tensorflow.python.framework import indexed_slices  # noqa: F401
from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor_util  # noqa: F401
from tensorflow.python.ops import control_flow_state  # noqa: F401
from tensorflow.python.ops import control_flow_util  # noqa: F401
from tensorflow.python.ops import default_gradient  # noqa: F401
from tensorflow.python.ops import gen_functional_ops  # noqa: F401
from tensorflow.python.ops import resource_variable_ops  # noqa: F401
from tensorflow.python.ops.parallel_for import control_flow_ops as pfor_ops  # noqa: F401
from tensorflow.python.util import object_identity  # noqa: F401
# The nested DP query maps over a structure up to a shallower one
# (nest.map_structure_up_to), which tf.nest does not export.
from tensorflow.python.util import nest  # noqa: F401

from custagg import op_kinds

# pylint: disable=protected-access

TF_VERSION = tuple(int(p) for p in tf.__version__.split(".")[:2])

# The public alias of ops._gradient_registry (both names on 2.12-2.21).
gradient_registry = getattr(ops, "gradient_registry", None) or \
    ops._gradient_registry

def value_consumers(t):
    """The ops that read the values of tensor `t` (not only its shape:
    `op_kinds.SHAPE_ONLY`). TF 2.12 and 2.15 add a `Shape` of the reshaped
    tensor in the `Reshape` gradient (2.18 and 2.21 do not), so a backward
    pass already in the graph changes consumer counts there; counts that
    prove something skip these."""
    return [c for c in t.consumers() if c.type not in op_kinds.SHAPE_ONLY]


def made_by_backward_pass(op):
    """Whether `op` was built by a gradient function.

    `tf.compat.v1.gradients` and custagg's traversal call each op's gradient
    function inside `graph._original_op(op)` (`original_op` below), which
    records `op._original_op` on what it builds. 2.12-2.21; False where the
    attribute is missing.
    """
    return getattr(op, "_original_op", None) is not None


def forward_consumers(t):
    """`value_consumers(t)` less the ops backward passes added: what the
    model itself computes from `t`, whatever gradients exist already."""
    return [c for c in value_consumers(t) if not made_by_backward_pass(c)]


# ------------------------------------------------------------------ ops

if hasattr(ops.Operation, "_node_def"):
    # 2.15, 2.18, 2.21: the serialized NodeDef, parsed here (what
    # `op.node_def` does, one Python frame fewer on the CUSTOM list form's
    # hot path).
    _parse_node_def = node_def_pb2.NodeDef.FromString

    def node_def(op):
        """`op.node_def`, the op's parsed NodeDef."""
        return _parse_node_def(op._node_def)
else:
    # 2.12 has no `_node_def`; the public property parses it the same way.
    def node_def(op):
        """`op.node_def`, the op's parsed NodeDef."""
        return op.node_def


def control_flow_context(op):
    """The v1 control-flow context op was built in (None outside loops and
    conds). `op._control_flow_context`, 2.12-2.21."""
    return op._control_flow_context


def operation_by_name_fn(graph):
    """A fast `graph.get_operation_by_name` (no argument checks).

    `graph._get_operation_by_name` on 2.15, 2.18 and 2.21,
    `graph._get_operation_by_name_unsafe` on 2.12, else the public method.
    """
    for name in ("_get_operation_by_name", "_get_operation_by_name_unsafe"):
        fn = getattr(graph, name, None)
        if fn is not None:
            return fn
    return graph.get_operation_by_name


# ---------------------------------------------------------------- graphs

def building_function(graph):
    """True for a FuncGraph (tf.function, v2 control-flow bodies).

    `graph._building_function`, 2.12-2.21; False where absent.
    """
    return getattr(graph, "_building_function", False)


def graph_control_flow_context(graph):
    """The graph's current v1 control-flow context.
    `graph._get_control_flow_context()`, 2.12-2.21."""
    return graph._get_control_flow_context()


def set_graph_control_flow_context(graph, ctxt):
    """Makes `ctxt` the graph's current v1 control-flow context.
    `graph._set_control_flow_context(ctxt)`, 2.12-2.21."""
    graph._set_control_flow_context(ctxt)


def is_function(graph, name):
    """Whether `name` is a function defined in `graph` (an op type that is a
    call). `graph._is_function`, 2.12-2.21."""
    return graph._is_function(name)


def get_function(graph, name):
    """The function `name` defined in `graph`, or None.
    `graph._get_function`, 2.12-2.21."""
    return graph._get_function(name)


def original_op(graph, op):
    """Context: ops made inside record `op` as their original op (gradient
    ops do). `graph._original_op`, 2.12-2.21."""
    return graph._original_op(op)


def attr_scope(graph, attrs):
    """Context: ops made inside get the attrs `{name: AttrValue}`.
    `graph._attr_scope`, 2.12-2.21."""
    return graph._attr_scope(attrs)


def create_op(graph, op_type, inputs, dtypes, name, attrs, op_def):
    """A new op from its parts. `graph._create_op_internal`, 2.12-2.21 (the
    deprecated public `create_op` checks and warns)."""
    return graph._create_op_internal(
        op_type, inputs, dtypes=dtypes, name=name, attrs=attrs, op_def=op_def)


def colocate_with_for_gradient(op, gradient_uid, ignore_existing=False):
    """Context: colocate with `op` the way TF's gradients do.
    `ops._colocate_with_for_gradient`, 2.12-2.21."""
    return ops._colocate_with_for_gradient(
        op, gradient_uid, ignore_existing=ignore_existing)


# -------------------------------------------------------------- functions

def python_grad_func(func):
    """The Python gradient of a graph function (`Defun(grad_func=...)`).
    `func.python_grad_func`, 2.12-2.21."""
    return func.python_grad_func


def function_def(func):
    """A graph function's FunctionDef proto.

    `func.cached_definition` on 2.15, 2.18 and 2.21; `func.definition` on
    2.12, whose `_DefinedFunction` has no cached form.
    """
    try:
        return func.cached_definition
    except AttributeError:
        return func.definition


# ------------------------------------------------------------- optimizers
# The TF1 `tf.compat.v1.train.Optimizer` keeps its non-slot variables (the DP
# noise counter) and its checkpoint dependencies behind protected methods
# that subclasses are meant to call. 2.12-2.21.

def track_trackable(obj, child, name):
    """Makes `child` a checkpoint dependency of `obj` named `name`."""
    return obj._track_trackable(child, name=name)


def create_non_slot_variable(optimizer, initial_value, name, colocate_with):
    """An optimizer variable that is not per-parameter (one per graph),
    always a resource variable: TF makes it a ref variable when
    `colocate_with` is one, and the noise streams' variables are assigned
    inside v2 control flow, which takes no ref input (every DP optimizer
    failed to build on a model of ref variables)."""
    def resource(next_creator, **kwargs):
        kwargs["use_resource"] = True
        return next_creator(**kwargs)

    with tf.compat.v1.variable_creator_scope(resource):
        return optimizer._create_non_slot_variable(
            initial_value=initial_value, name=name,
            colocate_with=colocate_with)


def non_slot_variables(optimizer):
    """The optimizer's non-slot variables, all graphs."""
    return optimizer._non_slot_variables()


# -------------------------------------------------------------- platform

def is_mkl_enabled():
    """Whether TF's oneDNN (MKL) kernels are built in.

    `_pywrap_util_port.IsMklEnabled`, 2.12-2.21; False where the probe is
    missing.
    """
    try:
        from tensorflow.python.util import _pywrap_util_port  # pylint: disable=g-import-not-at-top
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return False


# -------------------------------------------------------------- tf.gradients

def gradients_modules():
    """TF's modules that hold `tf.gradients` and its internal helper.

    `(gradients, gradients_impl, gradients_util)`: `gradients.gradients` and
    `gradients_impl.gradients` / `gradients_v2` are the public functions;
    `gradients_util._GradientsHelper` is what they, cond_v2, while_v2 and
    tf.function backward passes call (with `src_graph=`), looked up on the
    module at each call. Same names in 2.12-2.21.
    """
    from tensorflow.python.ops import gradients as gradients_mod  # pylint: disable=g-import-not-at-top
    from tensorflow.python.ops import gradients_impl  # pylint: disable=g-import-not-at-top
    from tensorflow.python.ops import gradients_util  # pylint: disable=g-import-not-at-top
    return gradients_mod, gradients_impl, gradients_util


# ---------------------------------------------------------- graph copies
# graph.copier re-creates forward ops op by op; what TF's Python keeps
# beside the C op must come along. 2.12-2.21.

from tensorflow.python.ops import handle_data_util  # noqa: E402


def copy_handle_data(source, target):
    """Shape/dtype of the resource or variant behind `source` onto `target`
    (TensorLists out of a While op need it downstream)."""
    handle_data_util.copy_handle_data(source, target)


def gradient_function(op):
    """The gradient function set on the op itself (tf.function call sites,
    v2 control flow), or None. `op._gradient_function`."""
    return getattr(op, "_gradient_function", None)


def set_gradient_function(op, fn):
    """Sets `op._gradient_function` (a copied call op keeps its gradient)."""
    op._gradient_function = fn


def autograph_do_not_convert(package):
    """Autograph calls functions of `package` as they are, unconverted.

    Inside a `tf.function`, autograph rewrites the Python control flow of
    every function it reaches unless its module is listed (TF's own modules
    are). A library that builds graphs itself must not be rewritten: a loop
    over a tensor would silently become a `tf.while_loop`.
    `autograph.core.config.CONVERSION_RULES`, 2.12-2.21; nothing where
    absent.
    """
    try:
        from tensorflow.python.autograph.core import config as ag_config
    except ImportError:
        return
    rules = getattr(ag_config, "CONVERSION_RULES", None)
    if rules is None or any(
            isinstance(r, ag_config.DoNotConvert) and
            getattr(r, "_prefix", None) == package for r in rules):
        return
    ag_config.CONVERSION_RULES = (ag_config.DoNotConvert(package),) + tuple(
        rules)
