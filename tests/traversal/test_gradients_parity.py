"""custagg.gradients against tf.compat.v1.gradients, case by case.

Each case is a `build(rng, gradients_fn)` function that makes a small graph
and returns a `Case` (ys, xs, feed, extra keyword arguments). `assert_parity`
builds the case twice, in two fresh graphs, once differentiated by
`tf.compat.v1.gradients` and once by `custagg.gradients`, and checks:

* structure: `None` in the same places, `Tensor` vs `IndexedSlices`, dtypes
  and static shapes;
* values: run in a session with the same feed (rtol 1e-5 for float32, 1e-12
  for float64, 1e-3 for float16);
* the graph: the ops added by the gradients call, as (name, type) pairs, are
  the same (a drop-in adds no op and names them as TF does).

`gradients_fn` is passed to `build` so cases that differentiate twice
(second derivatives) use the same implementation at both levels.
"""

import collections
import json

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import function as function_lib
from tensorflow.python.framework import indexed_slices as indexed_slices_lib

import custagg

Case = collections.namedtuple("Case", ["ys", "xs", "feed", "kwargs"])


def case(ys, xs, feed=None, **kwargs):
    return Case(ys, xs, feed or {}, kwargs)


_TOLERANCES = {tf.float16: (1e-3, 1e-3), tf.float32: (1e-5, 1e-6),
               tf.float64: (1e-12, 1e-12)}


def _structure(g):
    if g is None:
        return None
    if isinstance(g, tf.RaggedTensor):
        return ("RaggedTensor", g.dtype.name, g.ragged_rank)
    if isinstance(g, tf.IndexedSlices):
        return ("IndexedSlices", g.values.dtype.name, g.values.shape.as_list()
                if g.values.shape.rank is not None else None,
                g.indices.dtype.name, g.dense_shape is not None)
    return ("Tensor", g.dtype.name,
            g.shape.as_list() if g.shape.rank is not None else None)


Built = collections.namedtuple("Built", ["structure", "values", "dtypes",
                                         "ops", "grads"])


def _build(build, gradients_fn, session_config=None, **kwargs):
    """Builds `build` in a fresh graph, differentiates it, runs the result."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(7)
        c = build(np.random.default_rng(7), gradients_fn)
        before = set(graph.get_operations())
        grads = gradients_fn(c.ys, c.xs, **dict(c.kwargs, **kwargs))
        new_ops = sorted((op.name, op.type) for op in graph.get_operations()
                         if op not in before)
        init = tf.compat.v1.global_variables_initializer()
        fetch = [g for g in grads if g is not None]
        with tf.compat.v1.Session(config=session_config) as sess:
            sess.run(init)
            values = sess.run(fetch, c.feed)
    dtypes = [g.dtype for g in fetch]
    return Built([_structure(g) for g in grads], values, dtypes, new_ops,
                 grads)


def _assert_values_close(expected, actual, dtype):
    rtol, atol = _TOLERANCES.get(dtype.base_dtype, (0, 0))
    if isinstance(expected, indexed_slices_lib.IndexedSlicesValue):
        np.testing.assert_array_equal(expected.indices, actual.indices)
        np.testing.assert_array_equal(expected.dense_shape,
                                      actual.dense_shape)
        expected, actual = expected.values, actual.values
    if isinstance(expected, tf.compat.v1.ragged.RaggedTensorValue):
        np.testing.assert_array_equal(expected.row_splits, actual.row_splits)
        expected, actual = expected.flat_values, actual.flat_values
    np.testing.assert_allclose(np.asarray(actual, np.float64),
                               np.asarray(expected, np.float64),
                               rtol=rtol, atol=atol)


def assert_parity(build, same_ops=True, gradients_fn=custagg.gradients,
                  **kwargs):
    """`gradients_fn` gives what tf.compat.v1.gradients gives for `build`.

    Returns the two `Built` results (TF's first) for extra checks.
    """
    ref = _build(build, tf.compat.v1.gradients, **kwargs)
    ours = _build(build, gradients_fn, **kwargs)
    assert ours.structure == ref.structure
    assert len(ours.values) == len(ref.values)
    for e, a, dtype in zip(ref.values, ours.values, ref.dtypes):
        _assert_values_close(e, a, dtype)
    if same_ops:
        assert ours.ops == ref.ops
    return ref, ours


def test_harness_detects_a_wrong_gradient():
    """A gradient off by a factor of 2 fails on values and on ops."""
    def doubled(ys, xs, **kwargs):
        return [None if g is None else 2.0 * g
                for g in custagg.gradients(ys, xs, **kwargs)]

    def identity_added(ys, xs, **kwargs):
        return [tf.identity(g) for g in custagg.gradients(ys, xs, **kwargs)]

    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        assert_parity(_build_basic, same_ops=False, gradients_fn=doubled)
    with pytest.raises(AssertionError):
        assert_parity(_build_basic, gradients_fn=identity_added)


# --------------------------------------------------------------------------
# Small graphs: the arguments of tf.gradients.


def _build_basic(rng, grad_fn):
    x = tf.compat.v1.placeholder(tf.float32, [4, 3], name="x")
    w = tf.compat.v1.get_variable("w", [3, 2])
    b = tf.compat.v1.get_variable("b", [2])
    y = tf.reduce_sum(tf.tanh(tf.matmul(x, w) + b))
    return case([y], [w, b, x], {x: rng.normal(size=(4, 3))})


def test_basic():
    assert_parity(_build_basic)


def test_several_ys_and_grad_ys():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        w = tf.compat.v1.get_variable("w", [3, 2])
        h = tf.matmul(x, w)
        y1 = tf.reduce_sum(tf.sin(h), axis=1)          # [4]
        y2 = tf.reduce_sum(h * h)                      # scalar
        y3 = tf.exp(h)                                 # [4, 2]
        g1 = tf.constant(rng.normal(size=4), tf.float32)
        return case([y1, y2, y3], [w, x], {x: rng.normal(size=(4, 3))},
                    grad_ys=[g1, 3.0, None])
    assert_parity(build)


def test_grad_ys_as_numpy_and_python_values():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float64, [3])
        return case([x * x, tf.reduce_sum(x)], [x],
                    {x: rng.normal(size=3)},
                    grad_ys=[np.array([1.0, 2.0, 3.0]), np.float64(2.0)])
    assert_parity(build)


def test_intermediate_tensors_as_xs():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [5, 4])
        w1 = tf.compat.v1.get_variable("w1", [4, 6])
        w2 = tf.compat.v1.get_variable("w2", [6, 2])
        h = tf.nn.relu(tf.matmul(x, w1))
        z = tf.matmul(h, w2)
        y = tf.reduce_mean(tf.square(z))
        return case(y, [h, z, w1, w2], {x: rng.normal(size=(5, 4))})
    assert_parity(build)


def test_ys_that_are_also_xs():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [3])
        h = x * 2.0
        y = tf.reduce_sum(h * h)
        # h is both an x and a y; y is both too.
        return case([h, y], [x, h, y], {x: rng.normal(size=3)})
    assert_parity(build)


def test_fan_out_and_shared_weights():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        w = tf.compat.v1.get_variable("w", [3, 3])
        h1 = tf.matmul(x, w)
        h2 = tf.matmul(tf.tanh(h1), w)          # w shared by two layers
        h3 = tf.matmul(h1 + h2, w)              # h1 fans out twice
        y = tf.reduce_sum(h1 * h2 * h3) + tf.reduce_sum(w)
        return case(y, [w, x, h1], {x: rng.normal(size=(4, 3))})
    assert_parity(build)


@pytest.mark.parametrize("method", [
    None, custagg.AggregationMethod.ADD_N, custagg.AggregationMethod.DEFAULT,
    custagg.AggregationMethod.EXPERIMENTAL_TREE,
    custagg.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N,
    tf.AggregationMethod.ADD_N, tf.AggregationMethod.EXPERIMENTAL_TREE,
    tf.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N])
def test_aggregation_methods(method):
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [4])
        h = tf.sin(x)
        y = h * h + 2.0 * h + tf.exp(h)        # three consumers of h
        emb = tf.compat.v1.get_variable("emb", [6, 2])
        e = tf.gather(emb, [0, 2]) + tf.gather(emb, [2, 3])  # sparse + sparse
        return case([y, e], [x, emb], {x: rng.normal(size=4)},
                    aggregation_method=method)
    ref, ours = assert_parity(build)
    if method in (1, 2):
        assert any("_gradient_sum/" in name for name, _ in ours.ops)


@pytest.mark.parametrize("use_resource", [True, False])
def test_variables_resource_and_ref(use_resource):
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        w = tf.compat.v1.Variable(rng.normal(size=(3, 2)).astype(np.float32),
                                  use_resource=use_resource, name="w")
        v = tf.compat.v1.Variable(1.5, use_resource=use_resource, name="v")
        unused = tf.compat.v1.Variable(np.zeros(5, np.float32),
                                       use_resource=use_resource)
        y = tf.reduce_sum(tf.matmul(x, w) * v) + v * v
        return case(y, [w, v, unused], {x: rng.normal(size=(4, 3))})
    ref, _ = assert_parity(build)
    assert ref.structure[2] is None
    assert_parity(build, unconnected_gradients=tf.UnconnectedGradients.ZERO)


@pytest.mark.parametrize("use_resource", [True, False])
def test_indexed_slices(use_resource):
    def build(rng, grad_fn):
        ids = tf.compat.v1.placeholder(tf.int32, [5])
        emb = tf.compat.v1.Variable(rng.normal(size=(10, 4)).astype(
            np.float32), use_resource=use_resource, name="emb")
        table = tf.compat.v1.Variable(rng.normal(size=(7, 4)).astype(
            np.float32), use_resource=use_resource, name="table")
        both = tf.compat.v1.Variable(rng.normal(size=(6, 4)).astype(
            np.float32), use_resource=use_resource, name="both")
        p = tf.compat.v1.placeholder(tf.float32, [8, 4])
        looked = tf.nn.embedding_lookup(emb, ids)                  # sparse
        gathered = tf.gather(table, tf.constant([1, 1, 3], tf.int64))
        mixed = tf.gather(both, [0, 5]) * 2.0                      # + dense:
        y = (tf.reduce_sum(tf.square(looked)) + tf.reduce_sum(gathered) +
             tf.reduce_sum(mixed) + tf.reduce_sum(both * both) +
             tf.reduce_sum(tf.gather(p, [7, 0, 7])))
        return case(y, [emb, table, both, p],
                    {ids: [1, 3, 3, 9, 0], p: rng.normal(size=(8, 4))})
    ref, _ = assert_parity(build)
    kinds = [s[0] for s in ref.structure]
    assert kinds == ["IndexedSlices", "IndexedSlices", "Tensor",
                     "IndexedSlices"]


def test_variables_and_indexed_slices_as_ys_and_grad_ys():
    def build(rng, grad_fn):
        v = tf.compat.v1.get_variable("v", [3], use_resource=True)
        r = tf.compat.v1.Variable([1.0, 2.0], use_resource=False, name="r")
        emb = tf.compat.v1.get_variable("emb", [6, 2])
        seed = tf.IndexedSlices(tf.ones([2, 2]), tf.constant([1, 3]),
                                tf.constant([6, 2]))
        return case([v, r, emb * 2.0], [v, r, emb],
                    grad_ys=[None, [3.0, 4.0], seed])
    assert_parity(build)


def test_ragged_tensors_as_ys_and_xs():
    def build(rng, grad_fn):
        v = tf.compat.v1.placeholder(tf.float32, [5])
        w = tf.compat.v1.get_variable("w", [])
        r = tf.RaggedTensor.from_row_lengths(v, [2, 3])
        s = tf.RaggedTensor.from_row_lengths(tf.sin(v), [4, 1])
        return case([r * w, tf.reduce_sum(s * s)], [v, w, s],
                    {v: rng.normal(size=5)})
    ref, _ = assert_parity(build)
    assert ref.structure[2][0] == "RaggedTensor"


def test_stop_gradients():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [3])
        a = tf.sin(x)
        b = a * a
        c = tf.exp(b) + a
        return case(c, [x, a, b], {x: rng.normal(size=3)},
                    stop_gradients=[a, b])
    assert_parity(build)

    def build_sg_op(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [3])
        y = tf.reduce_sum(tf.stop_gradient(x * 2.0) * x)
        return case(y, [x], {x: rng.normal(size=3)})
    assert_parity(build_sg_op)


@pytest.mark.parametrize("unconnected", [
    tf.UnconnectedGradients.NONE, tf.UnconnectedGradients.ZERO, "zero",
    "none"])
def test_unconnected_gradients(unconnected):
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [3, 2])
        z = tf.compat.v1.placeholder(tf.float32, [None, 2])  # not connected
        v = tf.compat.v1.get_variable("v", [4])               # not connected
        first, second = tf.split(x, 2, axis=1)                # second unused
        i = tf.compat.v1.placeholder(tf.int32, [3])
        y = tf.reduce_sum(first * 3.0) + tf.cast(tf.reduce_sum(i), tf.float32)
        return case(y, [x, z, v, second, i],
                    {x: rng.normal(size=(3, 2)), z: np.ones((5, 2)),
                     i: [1, 2, 3]},
                    unconnected_gradients=unconnected)
    ref, _ = assert_parity(build)
    if str(unconnected).lower().endswith("none"):
        # TF gives zeros, not None, for the unused output of an op whose
        # other output is used (the zeros fed to Split's gradient).
        assert ref.structure[1:] == [None, None, ("Tensor", "float32",
                                                  [3, 1]), None]


def test_integer_and_bool_paths():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [6])
        n = tf.compat.v1.placeholder(tf.int32, [6])
        rounded = tf.cast(tf.cast(x * 10.0, tf.int32), tf.float32)  # no grad
        mask = x > 0.0                                               # bool
        picked = tf.where(mask, x * x, -x)
        k = tf.argmax(x)
        y = (tf.reduce_sum(picked) + tf.reduce_sum(rounded) +
             tf.cast(k, tf.float32) + tf.reduce_sum(tf.cast(n, tf.float32)))
        ints = n * 2 + tf.cast(x, tf.int32)
        return case([y, tf.cast(ints, tf.float32)], [x, n],
                    {x: rng.normal(size=6), n: np.arange(6)})
    assert_parity(build)


@pytest.mark.parametrize("dtype", [tf.float16, tf.float32, tf.float64])
def test_float_dtypes(dtype):
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(dtype, [4, 3])
        w = tf.compat.v1.get_variable("w", [3, 2], dtype=dtype)
        b = tf.compat.v1.get_variable("b", [2], dtype=dtype)
        logits = tf.matmul(x, w) + b
        y = tf.reduce_sum(tf.nn.softmax(logits) * tf.sigmoid(logits))
        return case(y, [w, b, x], {x: rng.normal(size=(4, 3))})
    ref, _ = assert_parity(build)
    assert all(s[1] == dtype.name for s in ref.structure)


def test_mixed_float_dtypes_through_casts():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float64, [3])
        h = tf.cast(x, tf.float16)
        y = tf.reduce_sum(tf.cast(h * h, tf.float32))
        return case(y, [x, h], {x: rng.normal(size=3)})
    assert_parity(build)


def test_name_scopes():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        w = tf.compat.v1.get_variable("w", [3, 2])
        y = tf.reduce_sum(tf.square(tf.matmul(x, w)))
        return case(y, [w], {x: rng.normal(size=(4, 3))})

    ref, ours = assert_parity(build, name="my_grads")
    assert all(name.startswith("my_grads/") for name, _ in ours.ops)
    # None means "gradients"; "" means the root scope (TF's v1 name scope).
    _, ours = assert_parity(build, name=None)
    assert all(name.startswith("gradients/") for name, _ in ours.ops)
    _, ours = assert_parity(build, name="")
    assert ("MatMul_grad/MatMul_1", "MatMul") in ours.ops

    def build_in_scope(rng, grad_fn):
        c = build(rng, grad_fn)
        first = grad_fn(c.ys, c.xs, name="my_grads")  # takes the name
        with tf.name_scope("outer"):
            second = grad_fn(c.ys, c.xs, name="my_grads")
        assert first[0].name.startswith("my_grads/")
        assert second[0].name.startswith("outer/my_grads/")
        return c

    _, ours = assert_parity(build_in_scope, name="my_grads")
    # The third call is the one compared; its scope is made unique.
    assert all(name.startswith("my_grads_1/") for name, _ in ours.ops)


def test_colocate_gradients_with_ops():
    def build(rng, grad_fn):
        with tf.device("/cpu:0"):
            x = tf.compat.v1.placeholder(tf.float32, [4, 3])
            w = tf.compat.v1.get_variable("w", [3, 2])
            h = tf.matmul(x, w)
        y = tf.reduce_sum(h * h) + tf.reduce_sum(w)
        return case([y, h], [w, x], {x: rng.normal(size=(4, 3))})

    def placement(graph_ops_owner, built):
        graph = built.grads[0].graph
        return sorted((name, graph.get_operation_by_name(name).device,
                       tuple(graph.get_operation_by_name(name)
                             .colocation_groups()))
                      for name, _ in built.ops)

    for colocate in (False, True):
        ref, ours = assert_parity(build, colocate_gradients_with_ops=colocate)
        assert placement(None, ours) == placement(None, ref)
    matmul_grad = ours.grads[0].graph.get_operation_by_name(
        "gradients/MatMul_grad/MatMul_1")
    assert matmul_grad.colocation_groups() == [b"loc:@MatMul"]


def test_gate_gradients():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        w = tf.compat.v1.get_variable("w", [3, 2])
        b = tf.compat.v1.get_variable("b", [2])
        y = tf.reduce_sum(tf.nn.bias_add(tf.matmul(x, w), b) ** 2)
        return case(y, [w, b, x], {x: rng.normal(size=(4, 3))})
    ref, ours = assert_parity(build, gate_gradients=True)
    assert any(t == "NoOp" for _, t in ours.ops)     # the tf.tuple's group


def test_xla_compile_attributes():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [3])
        attrs = {"_XlaCompile": tf.compat.v1.AttrValue(b=True),
                 "_XlaSeparateCompiledGradients":
                     tf.compat.v1.AttrValue(b=True),
                 "_XlaScope": tf.compat.v1.AttrValue(s=b"fwd")}
        with tf.compat.v1.get_default_graph()._attr_scope(attrs):  # pylint: disable=protected-access
            y = tf.reduce_sum(tf.sin(x) * x)
        return case(y, [x], {x: rng.normal(size=3)})

    def scopes(built):
        graph = built.grads[0].graph
        out = []
        for name, _ in built.ops:
            op = graph.get_operation_by_name(name)
            try:
                out.append((name, op.get_attr("_XlaScope")))
            except ValueError:
                out.append((name, None))
        return out

    ref, ours = assert_parity(
        build, session_config=tf.compat.v1.ConfigProto(
            graph_options=tf.compat.v1.GraphOptions(
                optimizer_options=tf.compat.v1.OptimizerOptions(
                    global_jit_level=tf.compat.v1.OptimizerOptions.OFF))))
    assert scopes(ours) == scopes(ref)
    assert any(s and s.startswith(b"fwd_grad_") for _, s in scopes(ours))


# --------------------------------------------------------------------------
# Gradient lookup: overrides, custom gradients, no-gradient ops, functions.


@tf.RegisterGradient("CustaggTestTripleGrad")
def _triple_grad(op, grad):
    return 3.0 * grad


tf.no_gradient("CustaggTestNoGradient")


def test_gradient_override_map():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [3])
        g = tf.compat.v1.get_default_graph()
        with g.gradient_override_map({"Identity": "CustaggTestTripleGrad",
                                      "Square": "CustaggTestNoGradient"}):
            a = tf.identity(x)
            b = tf.square(x)
        y = tf.reduce_sum(a * x) + tf.reduce_sum(b)
        return case(y, [x, a, b], {x: rng.normal(size=3)})
    assert_parity(build)


def test_no_gradient_ops_give_none():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [5])
        # Registered with no gradient in TF: shapes, random ops, comparisons.
        shape_y = tf.cast(tf.shape(x)[0], tf.float32)
        noisy = tf.random.uniform([5], seed=1) + tf.floor(x)
        y = tf.reduce_sum(noisy) + shape_y + tf.reduce_sum(
            tf.cast(tf.equal(x, 0.0), tf.float32))
        return case(y, [x], {x: rng.normal(size=5)})
    ref, _ = assert_parity(build)


def test_op_without_registered_gradient_raises_like_tf():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [3])
        g = tf.compat.v1.get_default_graph()
        with g.gradient_override_map({"Sin": "CustaggTestUnregistered"}):
            s = tf.sin(x)
        return case(tf.reduce_sum(s), [x], {x: rng.normal(size=3)})
    with pytest.raises(LookupError):
        _build(build, tf.compat.v1.gradients)
    with pytest.raises(LookupError, match="Sin.*RegisterGradient"):
        _build(build, custagg.gradients)


def test_custom_gradient():
    @tf.custom_gradient
    def clipped_square(v):
        def grad(dy):
            return tf.clip_by_value(dy * 2.0 * v, -1.0, 1.0)
        return tf.square(v), grad

    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [6])
        y = tf.reduce_sum(clipped_square(x * 3.0)) + tf.reduce_sum(x)
        return case(y, [x], {x: rng.normal(size=6)})
    assert_parity(build)


def test_custom_gradient_with_variable():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        w = tf.compat.v1.get_variable("w", [3, 2], use_resource=True)

        @tf.custom_gradient
        def layer(inp):
            out = tf.matmul(inp, w)

            def grad(dy, variables=None):
                dx = tf.matmul(dy, w, transpose_b=True)
                return dx, [0.5 * tf.matmul(inp, dy, transpose_a=True)]
            return out, grad
        y = tf.reduce_sum(tf.tanh(layer(x)))
        return case(y, [x, w], {x: rng.normal(size=(4, 3))})
    assert_parity(build)


def test_tf_function_call_ops():
    @tf.function
    def block(a, w):
        return tf.tanh(tf.matmul(a, w))

    @tf.function
    def outer_fn(a, w):
        return block(a, w) * 2.0 + a[:, :2]

    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        w = tf.compat.v1.get_variable("w", [3, 2], use_resource=True)
        w_value = tf.convert_to_tensor(w)
        y = tf.reduce_sum(outer_fn(x, w_value)) + tf.reduce_sum(
            block(x, w_value))
        return case(y, [x, w], {x: rng.normal(size=(4, 3))})
    ref, ours = assert_parity(build)
    assert any(t in ("PartitionedCall", "StatefulPartitionedCall")
               for _, t in ours.ops)


def test_tf_function_capturing_a_variable():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        w = tf.compat.v1.get_variable("w", [3, 2], use_resource=True)

        @tf.function
        def f(a):
            return tf.reduce_sum(tf.sin(tf.matmul(a, w)))
        return case(f(x), [x, w], {x: rng.normal(size=(4, 3))})
    assert_parity(build)


def test_defun_functions_with_and_without_python_gradient():
    def doubled_grad(op, grad):
        return [2.0 * grad * tf.cos(op.inputs[0])]

    @function_lib.Defun(tf.float32, python_grad_func=doubled_grad)
    def sin_with_grad(v):
        return tf.sin(v)

    @function_lib.Defun(tf.float32)
    def sin_symbolic(v):      # differentiated by a SymbolicGradient node
        return tf.sin(v) * v

    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [3])
        y = tf.reduce_sum(sin_with_grad(x)) + tf.reduce_sum(sin_symbolic(x))
        return case(y, [x], {x: rng.normal(size=3)})
    ref, ours = assert_parity(build)
    assert any(t == "SymbolicGradient" for _, t in ours.ops)


def test_gradients_inside_a_tf_function():
    """Called while tracing a tf.function: xs outside, captured inside."""
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        w = tf.compat.v1.get_variable("w", [3, 2], use_resource=True)
        c = tf.constant(2.0)

        @tf.function
        def grads_fn(a):
            y = tf.reduce_sum(tf.sin(tf.matmul(a, w)) * c)
            return grad_fn(y, [a, w, c])
        gx, gw, gc = grads_fn(x)
        return case(tf.reduce_sum(gx) + tf.reduce_sum(gw) + gc, [x],
                    {x: rng.normal(size=(4, 3))})
    # The outer call goes through a function call; which gradients function
    # built the inner graph shows only in the values (function bodies differ
    # in uids), so compare those.
    assert_parity(build, same_ops=False)

    def build_direct(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        out = {}

        @tf.function
        def fn(a):
            w = tf.constant(rng.normal(size=(3, 2)), tf.float32)
            y = tf.reduce_sum(tf.sin(tf.matmul(a, w)))
            gw, ga = grad_fn(y, [w, a])
            return gw, ga
        gw, ga = fn(x)
        out["x"] = x
        return case([tf.identity(gw), tf.identity(ga)], [x],
                    {x: rng.normal(size=(4, 3))})
    assert_parity(build_direct, same_ops=False)


def test_second_derivatives():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float64, [4, 3])
        w = tf.compat.v1.get_variable("w", [3, 2], dtype=tf.float64)
        v = tf.compat.v1.placeholder(tf.float64, [3, 2])
        y = tf.reduce_sum(tf.tanh(tf.matmul(x, w)) ** 3)
        gw, = grad_fn(y, [w])
        hvp = tf.reduce_sum(gw * v)     # Hessian-vector product next
        return case(hvp, [w, x, v], {x: rng.normal(size=(4, 3)),
                                      v: rng.normal(size=(3, 2))})
    assert_parity(build)

    def build_third(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float64, [])
        y = x ** 4 + tf.sin(x)
        d1, = grad_fn(y, x)
        d2, = grad_fn(d1, x)
        return case(d2, [x], {x: 0.7})
    ref, _ = assert_parity(build_third)
    np.testing.assert_allclose(ref.values[0], 24 * 0.7 - np.cos(0.7))


# --------------------------------------------------------------------------
# Control flow v2 (the default under disable_eager_execution).


def test_while_loop_v2():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        w = tf.compat.v1.get_variable("w", [3, 3])

        def body(i, h):
            return i + 1, tf.tanh(tf.matmul(h, w)) + x
        _, h = tf.compat.v1.while_loop(lambda i, h: i < 3, body, [0, x])
        y = tf.reduce_sum(h * h)
        return case(y, [x, w], {x: rng.normal(size=(4, 3))})
    ref, ours = assert_parity(build)
    assert any(t in ("While", "StatelessWhile") for _, t in ours.ops)


def _while_capturing_w(dtype=tf.float64):
    x = tf.compat.v1.placeholder(dtype, [4, 3])
    w = tf.compat.v1.get_variable("w", [3, 3], dtype)

    def body(i, h):
        return i + 1, tf.tanh(tf.matmul(h, w)) + x
    _, h = tf.compat.v1.while_loop(lambda i, h: i < 3, body, [0, x])
    return x, w, tf.reduce_sum(h * h)


def test_only_x_keeps_the_while_gradient_of_every_capture_by_default():
    """d/dx alone: the drop-in builds TF's While gradient, with w's."""
    def build(rng, grad_fn):
        x, _, y = _while_capturing_w(tf.float32)
        return case(y, [x], {x: rng.normal(size=(4, 3))})
    assert_parity(build)


def _grad_while_outputs(graph, before):
    return sum(len(op.outputs) for op in graph.get_operations()
               if op not in before and op.type in ("While", "StatelessWhile"))


def test_skip_unneeded_captures_leaves_w_out_of_the_gradient_loop():
    """`skip_unneeded_captures=True` (the per-example engine's passes): the
    gradient loop of d/dx carries nothing for the captured w (fewer loop
    variables than TF's), and d/dx is TF's value."""
    rng = np.random.default_rng(0)
    counts, values = {}, {}
    for skip in (False, True):
        graph = tf.Graph()
        with graph.as_default():
            x, _, y = _while_capturing_w()
            before = set(graph.get_operations())
            g, = custagg.gradients(y, [x], skip_unneeded_captures=skip)
            counts[skip] = _grad_while_outputs(graph, before)
            ref, = tf.compat.v1.gradients(y, [x])
            feed = {x: rng.normal(size=(4, 3))}
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                values[skip] = sess.run([g, ref], feed)
        np.testing.assert_allclose(values[skip][0], values[skip][1],
                                   rtol=1e-12, atol=1e-12)
    assert counts[True] < counts[False], counts


def test_cond_v2_and_nesting():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [3])
        p = tf.compat.v1.placeholder(tf.bool, [])
        w = tf.compat.v1.get_variable("w", [3])

        def true_fn():
            return tf.compat.v1.cond(tf.reduce_sum(x) > 0,
                                     lambda: x * w, lambda: tf.sin(x))
        y = tf.compat.v1.cond(p, true_fn, lambda: tf.exp(w))

        def body(i, acc):
            return i + 1, acc + tf.compat.v1.cond(
                i > 1, lambda: acc * w, lambda: tf.square(acc))
        _, z = tf.compat.v1.while_loop(lambda i, a: i < 4, body, [0, y])
        return case(tf.reduce_sum(z), [x, w], {x: rng.normal(size=3),
                                               p: True})
    assert_parity(build)


def test_while_loop_gradient_of_unused_output_and_intermediate_xs():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float64, [2])
        res = tf.compat.v1.while_loop(
            lambda i, a, b: i < 3,
            lambda i, a, b: (i + 1, a * x, b + tf.reduce_sum(a)),
            [0, x, tf.constant(0.0, tf.float64)])
        return case(res[1], [x], {x: rng.normal(size=2)},
                    unconnected_gradients="zero")
    assert_parity(build)


# --------------------------------------------------------------------------
# Control flow v1 (Switch/Merge; Enter/Exit) in this process.


def test_cond_v1(control_flow_v1):
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [3])
        w = tf.compat.v1.get_variable("w", [3])
        emb = tf.compat.v1.get_variable("emb", [5, 3])
        y = tf.compat.v1.cond(tf.reduce_sum(x) > 0,
                              lambda: x * w + tf.gather(emb, 1),
                              lambda: tf.sin(w))
        z = tf.compat.v1.cond(tf.reduce_sum(x) > 0,
                              lambda: tf.compat.v1.cond(
                                  x[0] > 0, lambda: y * y, lambda: -y),
                              lambda: y)
        inside = tf.compat.v1.get_default_graph().get_tensor_by_name(
            "cond/mul:0")                       # x * w, inside the branch
        return case(tf.reduce_sum(z), [x, w, emb, inside],
                    {x: np.abs(rng.normal(size=3))})
    ref, ours = assert_parity(build)
    assert any(t == "Merge" for _, t in ours.ops)
    assert_parity(build, unconnected_gradients="zero")


def _v1_simple_loop(rng, grad_fn):
    x = tf.compat.v1.placeholder(tf.float32, [4, 3])
    w = tf.compat.v1.get_variable("w", [3, 3])
    _, h = tf.compat.v1.while_loop(
        lambda i, h: i < 3,
        lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w)) + x), [0, x])
    return case(tf.reduce_sum(h * h), [x, w], {x: rng.normal(size=(4, 3))})


def _v1_unused_exit(rng, grad_fn):
    x = tf.compat.v1.placeholder(tf.float64, [2])
    res = tf.compat.v1.while_loop(
        lambda i, a, b: i < 3,
        lambda i, a, b: (i + 1, a * x, b + tf.reduce_sum(a)),
        [0, x, tf.constant(0.0, tf.float64)])
    return case([res[2], res[1]], [x], {x: rng.normal(size=2)},
                grad_ys=[None, tf.zeros([2], tf.float64)])


def _v1_nested_loops(rng, grad_fn):
    x = tf.compat.v1.placeholder(tf.float32, [3])

    def outer(i, a):
        _, b = tf.compat.v1.while_loop(lambda j, b: j < 2,
                                       lambda j, b: (j + 1, b * x + 1.0),
                                       [0, a])
        return i + 1, b
    _, y = tf.compat.v1.while_loop(lambda i, a: i < 2, outer, [0, x])
    return case(tf.reduce_sum(y), [x], {x: rng.normal(size=3)})


def _v1_cond_in_loop(rng, grad_fn):
    x = tf.compat.v1.placeholder(tf.float32, [3])

    def body(i, acc):
        return i + 1, acc + tf.compat.v1.cond(
            i > 1, lambda: acc * x, lambda: tf.square(acc))
    _, z = tf.compat.v1.while_loop(lambda i, a: i < 4, body, [0, x])
    return case(tf.reduce_sum(z), [x], {x: rng.normal(size=3)})


def _v1_dynamic_shapes_and_zero(rng, grad_fn):
    x = tf.compat.v1.placeholder(tf.float32, [None])
    n = tf.compat.v1.placeholder(tf.int32, [])
    _, h, _ = tf.compat.v1.while_loop(
        lambda i, h, u: i < n, lambda i, h, u: (i + 1, h * x, u + 1.0),
        [0, x, tf.zeros_like(x)])
    return case(tf.reduce_sum(h), [x, n], {x: rng.normal(size=3), n: 3},
                unconnected_gradients="zero")


def _v1_ref_variable_rnn(rng, grad_fn):
    steps, batch, n_in, n_hidden = 4, 3, 2, 5
    x = tf.compat.v1.placeholder(tf.float32, [batch, steps, n_in])
    w_x = tf.compat.v1.Variable(rng.normal(size=(n_in, n_hidden)).astype(
        np.float32), use_resource=False)
    w_h = tf.compat.v1.Variable(rng.normal(size=(n_hidden, n_hidden)).astype(
        np.float32) * 0.3, use_resource=False)
    inputs = tf.TensorArray(tf.float32, size=steps).unstack(
        tf.transpose(x, [1, 0, 2]))

    def body(t, h):
        return t + 1, tf.tanh(tf.matmul(inputs.read(t), w_x) +
                              tf.matmul(h, w_h))
    _, h = tf.compat.v1.while_loop(
        lambda t, h: t < steps, body,
        [tf.constant(0), tf.zeros([batch, n_hidden])])
    return case(tf.reduce_sum(tf.square(h)), [w_x, w_h, x],
                {x: rng.normal(size=(batch, steps, n_in))})


def _v1_second_derivative(rng, grad_fn):
    x = tf.compat.v1.placeholder(tf.float64, [3])
    _, h = tf.compat.v1.while_loop(lambda i, h: i < 3,
                                   lambda i, h: (i + 1, tf.sin(h) * x),
                                   [0, x])
    g, = grad_fn(tf.reduce_sum(h), x)
    return case(tf.reduce_sum(g * g), [x], {x: rng.normal(size=3)})


@pytest.mark.parametrize("build", [
    _v1_simple_loop, _v1_unused_exit, _v1_nested_loops, _v1_cond_in_loop,
    _v1_dynamic_shapes_and_zero, _v1_ref_variable_rnn],
    ids=lambda f: f.__name__[4:])
def test_while_v1(build, control_flow_v1):
    ref, ours = assert_parity(build)
    assert any(t == "Exit" for _, t in ours.ops)     # a v1 gradient loop


def test_while_v1_second_derivative_unsupported_like_tf(control_flow_v1):
    for grad_fn in (tf.compat.v1.gradients, custagg.gradients):
        with tf.Graph().as_default():
            with pytest.raises(TypeError, match="Second-order gradient for "
                               "while loops not supported"):
                _build(_v1_second_derivative, grad_fn)


def test_while_v1_gradient_inside_the_loop_wrt_initial_value(control_flow_v1):
    """TF's limit: no gradient through a loop variable's initial value.

    custagg's message is TF's, word for word (naming the x asked about, not
    the loop's Switch), then custagg's guidance.
    """
    def build(grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [3], name="asked_x")

        def body(i, h):
            g, = grad_fn(tf.reduce_sum(h * h), x)
            return i + 1, h + g
        tf.compat.v1.while_loop(lambda i, h: i < 2, body, [0, x])

    messages = []
    for grad_fn in (tf.compat.v1.gradients, custagg.gradients):
        with tf.Graph().as_default():
            with pytest.raises(ValueError) as info:
                build(grad_fn)
            messages.append(str(info.value))
    tf_msg, ours = messages
    assert tf_msg.startswith("Cannot compute gradient inside while loop with "
                             "respect to op 'asked_x'."), tf_msg
    assert ours.startswith(tf_msg + " custagg.gradients:"), ours
    assert "while/Switch" not in ours.split("custagg.gradients:")[0]


def _v1_xla_loop_without_maximum_iterations(grad_fn):
    from tensorflow.python.ops import control_flow_ops
    x = tf.compat.v1.placeholder(tf.float32, [3])
    xla = control_flow_ops.XLAControlFlowContext()
    xla.Enter()
    try:
        _, y = tf.compat.v1.while_loop(lambda i, h: i < 3,
                                       lambda i, h: (i + 1, h * h), [0, x])
    finally:
        xla.Exit()
    return grad_fn(tf.reduce_sum(y), x)


def test_while_v1_error_of_a_gradient_function_is_not_masked(control_flow_v1):
    """An error raised while the gradient loop's context is entered (TF's
    accumulator refuses an XLA loop without maximum_iterations) reaches the
    user as TF raises it; the graph is usable afterwards."""
    messages = []
    for grad_fn in (tf.compat.v1.gradients, custagg.gradients):
        with tf.Graph().as_default() as g:
            with pytest.raises(ValueError) as info:
                _v1_xla_loop_without_maximum_iterations(grad_fn)
            messages.append(str(info.value))
            if grad_fn is custagg.gradients:
                # The graph's control-flow context was put back.
                assert g._get_control_flow_context() is None
    assert messages[0].startswith("Cannot create a gradient accumulator for "
                                  "tensor"), messages[0]
    assert messages[1] == messages[0]


def test_disable_v2_behavior_in_subprocess(run_python):
    """Under disable_v2_behavior (ref variables, v1 cond and while loops) as
    TF; after enable_control_flow_v2(), While loops as TF too."""
    proc = run_python("""
        import json, os
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        import numpy as np
        import tensorflow as tf
        tf.compat.v1.disable_v2_behavior()
        import custagg
        out = {}
        x = tf.compat.v1.placeholder(tf.float32, [3])
        w = tf.compat.v1.Variable([1.0, -2.0, 3.0], name="w")
        out["ref_variable"] = type(w).__name__ == "RefVariable"
        y = tf.compat.v1.cond(tf.reduce_sum(x) > 0, lambda: x * w,
                              lambda: tf.sin(w))
        loss = tf.reduce_sum(y * y)
        out["cond_ops"] = sorted(set(op.type for op in
                                     loss.graph.get_operations()
                                     if op.type in ("Switch", "Merge", "If",
                                                    "StatelessIf")))
        ref = tf.compat.v1.gradients(loss, [x, w])
        ours = custagg.gradients(loss, [x, w])
        _, h = tf.compat.v1.while_loop(lambda i, h: i < 3,
                                       lambda i, h: (i + 1, h * w), [0, x])
        out["while_ops"] = sorted(set(op.type for op in
                                      h.graph.get_operations()
                                      if op.type in ("Enter", "Exit",
                                                     "While")))
        ref1 = tf.compat.v1.gradients(tf.reduce_sum(h), [x, w])
        ours1 = custagg.gradients(tf.reduce_sum(h), [x, w])
        tf.compat.v1.enable_control_flow_v2()
        _, h2 = tf.compat.v1.while_loop(lambda i, h: i < 3,
                                        lambda i, h: (i + 1, h * w), [0, x])
        ref2 = tf.compat.v1.gradients(tf.reduce_sum(h2), [x, w])
        ours2 = custagg.gradients(tf.reduce_sum(h2), [x, w])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for xv in ([1.0, 2.0, 0.5], [-1.0, -2.0, 0.5]):
                a, b, a1, b1, a2, b2 = sess.run(
                    [ref, ours, ref1, ours1, ref2, ours2], {x: xv})
                out.setdefault("cond_err", []).append(max(
                    float(np.max(np.abs(p - q))) for p, q in zip(a, b)))
                out.setdefault("while_v1_err", []).append(max(
                    float(np.max(np.abs(p - q))) for p, q in zip(a1, b1)))
                out.setdefault("while_v2_err", []).append(max(
                    float(np.max(np.abs(p - q))) for p, q in zip(a2, b2)))
        print("RESULT" + json.dumps(out))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
    out = json.loads(line[len("RESULT"):])
    assert out["ref_variable"] is True
    assert out["cond_ops"] == ["Merge", "Switch"]
    assert out["cond_err"] == [0.0, 0.0]
    assert out["while_ops"] == ["Enter", "Exit"]
    assert out["while_v1_err"] == [0.0, 0.0]
    assert out["while_v2_err"] == [0.0, 0.0]


# --------------------------------------------------------------------------
# Model-sized graphs.


def _dense(h, n_out, name, dtype=tf.float32, use_resource=True):
    w = tf.compat.v1.get_variable(
        name + "_w", [h.shape[-1], n_out], dtype=dtype,
        use_resource=use_resource)
    b = tf.compat.v1.get_variable(
        name + "_b", [n_out], dtype=dtype, use_resource=use_resource,
        initializer=tf.compat.v1.random_normal_initializer(stddev=0.1))
    return tf.matmul(h, w) + b


def _xent(logits, labels):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits))


def _mnist_batch(rng, n, shape=(784,)):
    return (rng.uniform(size=(n,) + shape).astype(np.float32),
            rng.integers(0, 10, size=n))


def test_model_softmax_regression_mnist_shaped():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [None, 784])
        labels = tf.compat.v1.placeholder(tf.int64, [None])
        loss = _xent(_dense(x, 10, "softmax"), labels)
        xb, yb = _mnist_batch(rng, 32)
        return case(loss, tf.compat.v1.trainable_variables(),
                    {x: xb, labels: yb})
    assert_parity(build)


@pytest.mark.parametrize("use_resource", [True, False])
def test_model_mlp(use_resource):
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [16, 784])
        labels = tf.compat.v1.placeholder(tf.int64, [16])
        h = tf.nn.relu(_dense(x, 64, "l1", use_resource=use_resource))
        h = tf.nn.relu(_dense(h, 32, "l2", use_resource=use_resource))
        loss = _xent(_dense(h, 10, "l3", use_resource=use_resource), labels)
        xb, yb = _mnist_batch(rng, 16)
        return case(loss, tf.compat.v1.trainable_variables(),
                    {x: xb, labels: yb})
    assert_parity(build)


def test_model_cnn():
    def build(rng, grad_fn):
        x = tf.compat.v1.placeholder(tf.float32, [8, 28, 28, 1])
        labels = tf.compat.v1.placeholder(tf.int64, [8])
        k1 = tf.compat.v1.get_variable("k1", [5, 5, 1, 4])
        k2 = tf.compat.v1.get_variable("k2", [3, 3, 4, 8])
        b1 = tf.compat.v1.get_variable("b1", [4])
        h = tf.nn.relu(tf.nn.bias_add(
            tf.nn.conv2d(x, k1, strides=2, padding="SAME"), b1))
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        h = tf.nn.relu(tf.nn.conv2d(h, k2, strides=1, padding="VALID"))
        h = tf.reshape(h, [8, -1])
        loss = _xent(_dense(h, 10, "out"), labels)
        xb, yb = _mnist_batch(rng, 8, (28, 28, 1))
        return case(loss, tf.compat.v1.trainable_variables(),
                    {x: xb, labels: yb})
    assert_parity(build)


def test_model_embedding():
    def build(rng, grad_fn):
        ids = tf.compat.v1.placeholder(tf.int32, [8, 5])
        labels = tf.compat.v1.placeholder(tf.int64, [8])
        emb = tf.compat.v1.get_variable("emb", [50, 16])
        vectors = tf.nn.embedding_lookup(emb, ids)            # [8, 5, 16]
        h = tf.nn.relu(_dense(tf.reduce_mean(vectors, axis=1), 12, "h"))
        loss = _xent(_dense(h, 10, "out"), labels)
        return case(loss, tf.compat.v1.trainable_variables(),
                    {ids: rng.integers(0, 50, size=(8, 5)),
                     labels: rng.integers(0, 10, size=8)})
    ref, _ = assert_parity(build)
    assert ref.structure[0][0] == "IndexedSlices"


def test_model_rnn_in_while_loop():
    def build(rng, grad_fn):
        steps, batch, n_in, n_hidden = 5, 4, 3, 8
        x = tf.compat.v1.placeholder(tf.float32, [batch, steps, n_in])
        labels = tf.compat.v1.placeholder(tf.int64, [batch])
        w_x = tf.compat.v1.get_variable("w_x", [n_in, n_hidden])
        w_h = tf.compat.v1.get_variable("w_h", [n_hidden, n_hidden])
        b = tf.compat.v1.get_variable("b", [n_hidden])
        inputs = tf.TensorArray(tf.float32, size=steps).unstack(
            tf.transpose(x, [1, 0, 2]))

        def body(t, h):
            x_t = inputs.read(t)
            return t + 1, tf.tanh(tf.matmul(x_t, w_x) +
                                  tf.matmul(h, w_h) + b)
        _, h = tf.compat.v1.while_loop(
            lambda t, h: t < steps, body,
            [tf.constant(0), tf.zeros([batch, n_hidden])])
        loss = _xent(_dense(h, 10, "out"), labels)
        return case(loss, tf.compat.v1.trainable_variables() + [x],
                    {x: rng.normal(size=(batch, steps, n_in)),
                     labels: rng.integers(0, 10, size=batch)})
    assert_parity(build)


def test_optimize_identity_n_like_tfs_helper():
    """TF's internal helper's `optimize_identity_n=True`: an IdentityN output
    with no gradient gives its input None, not zeros; without it, zeros."""
    import inspect
    from tensorflow.python.ops import gradients_util
    from custagg import install
    if "optimize_identity_n" not in inspect.signature(
            gradients_util._GradientsHelper).parameters:
        pytest.skip("this TensorFlow's internal helper has no "
                    "optimize_identity_n")
    a = tf.constant([1.0, 2.0])
    b = tf.constant(3.0)
    c, d = tf.identity_n([a, b])
    for helper in (gradients_util._GradientsHelper, install.gradients_helper):
        assert helper(ys=d, xs=a, optimize_identity_n=True)[0] is None
        assert helper(ys=c, xs=b, optimize_identity_n=True)[0] is None
        assert helper(ys=d, xs=a)[0] is not None        # zeros
        assert helper(ys=[c * b], xs=[a, b], optimize_identity_n=True)[0] \
            is not None
    with tf.compat.v1.Session() as sess:
        ours = sess.run(install.gradients_helper(ys=c * b, xs=[a, b],
                                                 optimize_identity_n=True))
        ref = sess.run(gradients_util._GradientsHelper(
            ys=c * b, xs=[a, b], optimize_identity_n=True))
    np.testing.assert_allclose(ours[0], ref[0])
    np.testing.assert_allclose(ours[1], ref[1])
