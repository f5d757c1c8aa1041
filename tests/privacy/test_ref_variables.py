"""DP optimizers on models of ref variables (`use_resource=False`, TF1's
default in `tf.compat.v1.Variable` and under `variable_scope(use_resource=
False)`): every noisy optimizer failed to build (its noise stream's
variables became ref variables beside a ref `var_list[0]`, and are assigned
in v2 control flow). They build, draw noise, and with no noise and a clip
no gradient reaches equal the wrapped optimizer on the mean loss."""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg.privacy import dp_optimizer
from custagg.privacy import dp_optimizer_vectorized
from custagg.privacy import noise
from custagg._tf_compat import resource_variable_ops

is_resource = resource_variable_ops.is_resource_variable

GD = tf.compat.v1.train.GradientDescentOptimizer

MAKERS = {
    "DPOptimizer": lambda c, z: custagg.DPOptimizer(GD(0.1), c, z),
    "DPOptimizer_seeded": lambda c, z: custagg.DPOptimizer(GD(0.1), c, z,
                                                           seed=3),
    "tfp_class": lambda c, z: dp_optimizer.DPGradientDescentGaussianOptimizer(
        c, z, learning_rate=0.1),
    "vectorized": lambda c, z: dp_optimizer_vectorized.VectorizedDPSGD(
        c, z, learning_rate=0.1),
}


def _model(x):
    w = tf.compat.v1.Variable(np.full([3, 2], 0.5), use_resource=False,
                              name="w")
    b = tf.compat.v1.Variable(np.zeros([2]), use_resource=False, name="b")
    loss = tf.reduce_sum(tf.square(tf.matmul(x, w) + b), axis=1)
    return [w, b], loss


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("batch", [1, 4])
def test_dp_optimizers_on_ref_variables(kind, batch):
    rng = np.random.default_rng(batch)
    feed_x = rng.normal(size=(batch, 3))
    results = {}
    for z in (0.0, 1.0):
        with tf.Graph().as_default():
            x = tf.compat.v1.placeholder(tf.float64, [None, 3])
            variables, loss = _model(x)
            assert not any(map(is_resource, variables))
            op = MAKERS[kind](1e6, z).minimize(loss)
            assert noise.noise_state_variables() or z == 0.0 or \
                kind == "DPOptimizer_seeded"
            assert all(map(is_resource, noise.noise_state_variables()))
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                for _ in range(2):
                    sess.run(op, {x: feed_x})
                results[z] = sess.run(variables)
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float64, [None, 3])
        variables, loss = _model(x)
        op = GD(0.1).minimize(tf.reduce_mean(loss))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(2):
                sess.run(op, {x: feed_x})
            want = sess.run(variables)
    for got, w in zip(results[0.0], want):
        np.testing.assert_allclose(got, w, rtol=1e-10)
    # With noise the update differs from the plain one.
    assert not np.allclose(results[1.0][0], want[0])
