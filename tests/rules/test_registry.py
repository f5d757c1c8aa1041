"""custagg.RuleRegistry itself: registration, duplicates, overwrite, copies,
the decorator, and an injected registry steering per-example gradients."""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg.rules import registry as registry_lib
from custagg import testing


class ScaledMatMul(custagg.Rule):
    """MatMul's per-example gradient times `scale` (to see which rule ran)."""

    def __init__(self, scale=1.0):
        self.scale = scale

    def per_example(self, ctx):
        a = ctx.other_input()
        assert ctx.input_index == 1
        return self.scale * tf.einsum("bi,bj->bij", a, ctx.grad)


def test_register_and_lookup():
    reg = custagg.RuleRegistry()
    rule = ScaledMatMul()
    assert "MatMul" not in reg and reg.lookup("MatMul") is None
    reg.register("MatMul", rule)
    assert "MatMul" in reg and reg.lookup("MatMul") is rule
    assert reg.op_types() == ["MatMul"]


def test_duplicate_registration_names_the_first():
    reg = custagg.RuleRegistry()
    reg.register("MatMul", ScaledMatMul())  # the line the message names
    line = test_duplicate_registration_names_the_first.__code__.co_firstlineno
    with pytest.raises(KeyError) as e:
        reg.register("MatMul", ScaledMatMul(2.0))
    msg = str(e.value)
    assert "'MatMul' is already registered" in msg
    assert "test_registry.py:%d" % (line + 2) in msg
    assert "overwrite=True" in msg


def test_overwrite_replaces():
    reg = custagg.RuleRegistry()
    reg.register("MatMul", ScaledMatMul())
    second = ScaledMatMul(2.0)
    reg.register("MatMul", second, overwrite=True)
    assert reg.lookup("MatMul") is second


def test_only_rules_register():
    with pytest.raises(TypeError, match="must be a custagg.Rule instance"):
        custagg.RuleRegistry().register("MatMul", lambda ctx: None)


def test_copy_is_independent():
    reg = custagg.RuleRegistry()
    reg.register("MatMul", ScaledMatMul())
    other = reg.copy()
    other.register("BiasAdd", ScaledMatMul())
    other.register("MatMul", ScaledMatMul(3.0), overwrite=True)
    assert "BiasAdd" not in reg and reg.lookup("MatMul").scale == 1.0
    assert other.lookup("MatMul").scale == 3.0


def test_decorator_into_an_injected_registry():
    reg = custagg.RuleRegistry()

    @custagg.register_rule("MyOpA", "MyOpB", registry=reg)
    class MyRule(custagg.Rule):
        def per_example(self, ctx):
            raise NotImplementedError

    assert reg.op_types() == ["MyOpA", "MyOpB"]
    assert isinstance(reg.lookup("MyOpA"), MyRule)
    assert "MyOpA" not in custagg.default_registry()
    with pytest.raises(KeyError):
        custagg.register_rule("MyOpA", registry=reg)(MyRule)


def test_default_registry_has_the_built_in_rules():
    reg = custagg.default_registry()
    assert reg is registry_lib.default_registry()
    for op_type in ("MatMul", "Conv2D", "BiasAdd", "GatherV2"):
        assert op_type in reg


def _linear(rng, batch):
    x = tf.compat.v1.placeholder(tf.float64, [batch, 3])
    w = tf.compat.v1.get_variable("w", initializer=rng.normal(size=(3, 2)),
                                  use_resource=True)
    loss = tf.reduce_sum(tf.square(tf.matmul(x, w)), axis=1)
    return x, w, loss


@pytest.mark.parametrize("batch", [1, 4])
def test_an_injected_registry_is_the_one_used(sess, rng, batch):
    x, w, loss = _linear(rng, batch)
    reg = custagg.RuleRegistry()
    reg.register("MatMul", ScaledMatMul(2.0))
    plan = custagg.plan_per_example(loss, [w], strategy="rules", registry=reg)
    assert "rules via MatMul" in str(plan)
    got, = custagg.per_example_gradients(loss, [w], strategy="rules",
                                         registry=reg)
    default, = custagg.per_example_gradients(loss, [w], strategy="rules")
    ref, = testing.loop_per_example(loss, [w])
    sess.run(tf.compat.v1.global_variables_initializer())
    got_v, default_v, ref_v = sess.run(
        [got, default, ref], {x: rng.normal(size=(batch, 3))})
    assert np.abs(ref_v).max() > 0
    np.testing.assert_allclose(default_v, ref_v, rtol=1e-10)
    np.testing.assert_allclose(got_v, 2.0 * ref_v, rtol=1e-10)


def test_an_empty_registry_falls_back_or_refuses(sess, rng):
    x, w, loss = _linear(rng, 3)
    empty = custagg.RuleRegistry()
    plan = custagg.plan_per_example(loss, [w], registry=empty)
    assert "rules" not in str(plan).split("\n", 1)[1]
    got, = custagg.per_example_gradients(loss, [w], registry=empty)
    ref, = testing.loop_per_example(loss, [w])
    sess.run(tf.compat.v1.global_variables_initializer())
    got_v, ref_v = sess.run([got, ref], {x: rng.normal(size=(3, 3))})
    np.testing.assert_allclose(got_v, ref_v, rtol=1e-10)
    with pytest.raises(Exception, match="MatMul"):
        custagg.per_example_gradients(loss, [w], strategy="rules",
                                      registry=empty)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("batch", [1, 5])
def test_norms_of_materialized_gradients_write_no_squares(dtype, batch):
    """A bias's per-example gradient is its `[B, K]` output gradient: its
    squared norms are one reduction (`registry.squared_norms_of`), not a
    `[B, K]` of squares beside it (the clipped MLP's peak at B = 512).
    Values against one tf.gradients per example."""
    rng = np.random.RandomState(batch)
    xv = rng.randn(batch, 6)
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(dtype, [None, 6])
        w = tf.Variable(rng.randn(6, 7), dtype=dtype)
        b = tf.Variable(rng.randn(7), dtype=dtype)
        v = tf.Variable(rng.randn(7, 3), dtype=dtype)
        loss = tf.reduce_sum(tf.square(tf.matmul(
            tf.tanh(tf.nn.bias_add(tf.matmul(x, w), b)), v)), axis=1)
        with tf.name_scope("norms"):
            norms = custagg.per_example_norms(loss, [w, b, v])
        squares = [op for op in tf.compat.v1.get_default_graph()
                   .get_operations()
                   if op.name.startswith("norms/") and op.type == "Square"
                   and op.inputs[0].shape.rank not in (None, 0, 1)]
        assert not squares, [op.name for op in squares]
        ref = testing.loop_per_example(loss, [w, b, v], batch)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got, per = sess.run([norms, ref], {x: xv})
    want = np.sqrt(sum(np.sum(np.reshape(g, [batch, -1]) ** 2, axis=1)
                       for g in per))
    np.testing.assert_allclose(got, want, rtol=1e-5 if dtype == tf.float32
                               else 1e-12)
