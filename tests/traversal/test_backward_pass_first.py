"""Results do not change when a backward pass is already in the graph.

On TF 2.12 and 2.15 the `Reshape` gradient adds a `Shape` op reading the
reshaped tensor, so consumer counts change once `tf.gradients` ran. The
per-row clipping bug (issue 10): the tensordot fold of a dense layer on
`[None, T, D]` was no longer recognized once any backward pass existed, and
the B*T rows were clipped as if they were examples. Every test here builds
a backward pass first (`tf.compat.v1.gradients` of the loss, then custagg)
and compares with `custagg.testing.loop_per_example`.
"""

import sys

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import _tf_compat
from custagg import op_kinds
from custagg import testing
from custagg.rules import bilinear

T, D, K = 3, 4, 2
BATCHES = (1, 5)
RTOL = 1e-9


def _keras2_available():
    """tf.keras is Keras 2 (TF 2.12-2.15, or tf-keras with
    TF_USE_LEGACY_KERAS=1 on 2.16+)."""
    try:
        package = tf.keras.layers.Dense.__module__.split(".")[0]
        version = getattr(sys.modules[package], "__version__", "")
    except (AttributeError, ImportError, KeyError):
        return False
    return version.startswith("2.")


def _legacy_layers_available():
    try:
        return _keras2_available() and callable(tf.compat.v1.layers.dense)
    except (AttributeError, ImportError):
        return False


NO_KERAS2 = ("tf.keras is not Keras 2 here: TF >= 2.16 needs the tf-keras "
             "package and TF_USE_LEGACY_KERAS=1 (tests/conftest.py sets it "
             "when tf_keras is importable)")


def _model(kind, rng):
    """`layer(x) -> per-example loss [B]` sharing its variables, and the xs."""
    if kind == "tensordot":
        w = tf.Variable(rng.normal(size=(D, K)), name="w")
        b = tf.Variable(rng.normal(size=(K,)), name="b")

        def dense(x):
            return tf.tensordot(x, w, [[2], [0]]) + b
        xs = [w, b]
    elif kind == "tensordot_no_bias":
        # Without a bias nothing fails at run time: the silent case.
        w = tf.Variable(rng.normal(size=(D, K)), name="w")

        def dense(x):
            return tf.tensordot(x, w, [[2], [0]])
        xs = [w]
    elif kind == "keras_dense":
        layer = tf.keras.layers.Dense(K, dtype="float64")
        layer.build(tf.TensorShape([None, T, D]))
        dense, xs = layer, None
    else:
        layer = tf.compat.v1.layers.Dense(K, dtype=tf.float64)
        layer.build(tf.TensorShape([None, T, D]))
        dense, xs = layer, None

    def loss_fn(x):
        h = tf.tanh(dense(x))
        return tf.reduce_sum(tf.square(h - 0.3), axis=[1, 2])

    if xs is None:
        xs = list(layer.trainable_weights)
    return loss_fn, xs


def _kinds():
    return [
        pytest.param("tensordot"),
        pytest.param("tensordot_no_bias"),
        pytest.param("keras_dense", marks=pytest.mark.skipif(
            not _keras2_available(), reason=NO_KERAS2)),
        pytest.param("v1_layers_dense", marks=pytest.mark.skipif(
            not _legacy_layers_available(), reason=NO_KERAS2)),
    ]


@pytest.mark.parametrize("kind", _kinds())
def test_clipped_sum_after_another_backward_pass(kind, graph):
    """The issue's reproducer: a dense layer on `[None, T, D]`, a backward
    pass in the graph first, then custagg's clipped sum, per-example
    gradients and norms; equal to the loop reference at B = 1 and 5."""
    rng = np.random.default_rng(10)
    loss_fn, xs = _model(kind, rng)
    x = tf.compat.v1.placeholder(tf.float64, [None, T, D])
    loss = loss_fn(x)
    plan_before = custagg.plan_per_example(loss, xs)
    # Another backward pass exists before custagg looks at the graph.
    sum_grads = tf.compat.v1.gradients(tf.reduce_sum(loss), xs)
    train = tf.compat.v1.train.GradientDescentOptimizer(0.0).minimize(
        tf.reduce_sum(loss), var_list=xs)
    plan_after = custagg.plan_per_example(loss, xs)
    assert str(plan_after) == str(plan_before)
    assert plan_after.strategies() == ["rules"] * len(xs), str(plan_after)

    clip = tf.compat.v1.placeholder(tf.float64, [])
    clipped, norms = custagg.clipped_gradients(loss, xs, clip,
                                               return_norms=True)
    per_example = custagg.per_example_gradients(loss, xs)
    for g, v in zip(per_example, xs):
        assert g.shape.as_list() == [None] + v.shape.as_list()

    statics = {}
    for batch in BATCHES:
        xb = tf.compat.v1.placeholder(tf.float64, [batch, T, D])
        statics[batch] = (xb, testing.loop_per_example(loss_fn(xb), xs))

    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for batch in BATCHES:
            data = rng.normal(size=(batch, T, D))
            xb, ref = statics[batch]
            ref_value = sess.run(ref, {xb: data})
            want_norms = testing.numpy_norms(ref_value)
            c = 0.7 * float(np.median(want_norms))   # clips some, not all
            want_sums, _ = testing.numpy_clipped(ref_value, c)
            got = sess.run({"clipped": clipped, "norms": norms,
                            "per_example": per_example,
                            "sum_grads": sum_grads},
                           {x: data, clip: c})
            where = "%s B=%d" % (kind, batch)
            for j, (g, r) in enumerate(zip(got["per_example"], ref_value)):
                assert g.shape == r.shape, (where, j, g.shape, r.shape)
                testing.assert_close(g, r, RTOL, "%s per_example[%d]"
                                     % (where, j))
            testing.assert_close(got["norms"], want_norms, RTOL,
                                 where + " norms")
            for j, (g, s) in enumerate(zip(got["clipped"], want_sums)):
                testing.assert_close(g, s, RTOL, "%s clipped[%d]" % (where, j))
            # The earlier backward pass still gives the plain sum.
            for j, (g, r) in enumerate(zip(got["sum_grads"], ref_value)):
                testing.assert_close(g, r.sum(axis=0), RTOL,
                                     "%s sum[%d]" % (where, j))
            sess.run(train, {x: data})


def test_backward_pass_shape_reader_is_not_a_consumer(graph):
    """What `_folded_rows` counts: the tensordot product has one forward
    consumer (the unfolding Reshape) before and after `tf.gradients`, on
    every release, whatever the Reshape gradient reads."""
    rng = np.random.default_rng(3)
    loss_fn, xs = _model("tensordot", rng)
    x = tf.compat.v1.placeholder(tf.float64, [None, T, D])
    loss = loss_fn(x)
    product = [op for op in graph.get_operations() if op.type == "MatMul"]
    assert len(product) == 1
    z = product[0].outputs[0]
    assert [c.type for c in _tf_compat.forward_consumers(z)] == ["Reshape"]
    tf.compat.v1.gradients(loss, xs)
    assert [c.type for c in _tf_compat.forward_consumers(z)] == ["Reshape"]
    for c in z.consumers():
        # Whatever a release's Reshape gradient adds reads z's shape only
        # or is marked as built by a gradient function.
        assert (c.type in op_kinds.SHAPE_ONLY
                or _tf_compat.made_by_backward_pass(c)
                or c.type == "Reshape"), c
    # A value reader the model adds does count (the fold is then refused).
    extra = tf.reduce_sum(z)
    assert sorted(c.type for c in _tf_compat.forward_consumers(z)) == [
        "Reshape", "Sum"]
    assert extra.op in _tf_compat.forward_consumers(z)


def test_second_custagg_call_sees_the_same_fold(graph):
    """Norms first (their backward pass is custagg's own), then the clipped
    sum: both treat the B examples, not the B*T rows."""
    rng = np.random.default_rng(4)
    loss_fn, xs = _model("tensordot", rng)
    x = tf.compat.v1.placeholder(tf.float64, [None, T, D])
    loss = loss_fn(x)
    norms = custagg.per_example_norms(loss, xs)
    clipped = custagg.clipped_gradients(loss, xs, 0.5)
    xb = tf.compat.v1.placeholder(tf.float64, [4, T, D])
    ref = testing.loop_per_example(loss_fn(xb), xs)
    data = rng.normal(size=(4, T, D))
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        ref_value = sess.run(ref, {xb: data})
        got_norms, got_clipped = sess.run([norms, clipped], {x: data})
    assert got_norms.shape == (4,)
    testing.assert_close(got_norms, testing.numpy_norms(ref_value), RTOL,
                         "norms")
    want, _ = testing.numpy_clipped(ref_value, 0.5)
    for j, (g, s) in enumerate(zip(got_clipped, want)):
        testing.assert_close(g, s, RTOL, "clipped[%d]" % j)


class _RowsAsExamples(bilinear.MatMulRule):
    """A wrong MatMul rule: plans with the fold (as the built-in rule), then
    takes the B*T rows for examples (what the TF <= 2.15 bug did once a
    backward pass hid the fold from the rule)."""

    def per_example(self, ctx):
        a = ctx.other_input()                        # [B*T, D] rows
        return tf.einsum("nd,nk->ndk", a, ctx.grad)

    def squared_norms(self, ctx):
        a = ctx.other_input()
        return (tf.reduce_sum(tf.square(a), 1)
                * tf.reduce_sum(tf.square(ctx.grad), 1))

    def weighted_sum(self, ctx, weights):
        a = ctx.other_input()
        return tf.einsum("nd,nk->dk", a * weights[:, None], ctx.grad)


@pytest.mark.parametrize("batch", [None, 1, 4])
def test_rows_taken_for_examples_raise(batch, graph):
    """A rule whose rows are not the B examples raises (static B: at graph
    build; dynamic B: when run), never clips or norms per row; B = 1 too,
    where weights [1] would broadcast silently over the rows."""
    rng = np.random.default_rng(5)
    registry = custagg.default_registry().copy()
    registry.register("MatMul", _RowsAsExamples(), overwrite=True)
    loss_fn, xs = _model("tensordot_no_bias", rng)
    x = tf.compat.v1.placeholder(tf.float64, [batch, T, D])
    loss = loss_fn(x)
    plan = custagg.plan_per_example(loss, xs, registry=registry)
    assert plan.strategies() == ["rules"], str(plan)
    if batch is not None:
        with pytest.raises(ValueError, match="rows, but the batch has"):
            custagg.per_example_norms(loss, xs, registry=registry)
        with pytest.raises(ValueError, match="rows, but the batch has"):
            custagg.clipped_gradients(loss, xs, 1.0, registry=registry)
        with pytest.raises(ValueError, match="rows, but the batch has"):
            custagg.per_example_gradients(loss, xs, registry=registry)
        return
    fetches = [custagg.per_example_norms(loss, xs, registry=registry),
               custagg.clipped_gradients(loss, xs, 1.0, registry=registry),
               custagg.per_example_gradients(loss, xs, registry=registry)]
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for n in (1, 3):
            for f in fetches:
                with pytest.raises(tf.errors.InvalidArgumentError,
                                   match="another number of rows"):
                    sess.run(f, {x: rng.normal(size=(n, T, D))})
