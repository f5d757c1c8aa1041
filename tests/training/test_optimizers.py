"""custagg's non-DP optimizer wrappers (`custagg.training.optimizers`:
`PerExampleOptimizer`, `WeightedOptimizer`) against updates written by hand
in numpy (float64), on the model of tests/optimizer_reference.py. custagg's
DP wrappers are tested in tests/privacy/test_wrappers.py.
"""

import numpy as np
import pytest
import tensorflow as tf

from custagg import optimizers as opt_lib

from optimizer_reference import B
from optimizer_reference import STRATEGY
from optimizer_reference import Model
from optimizer_reference import batches
from optimizer_reference import gd
from optimizer_reference import np_run
from optimizer_reference import run_steps


@pytest.mark.parametrize("num_steps", [1, 4])
def test_sum(num_steps):
    steps = batches(num_steps)
    w, b, norms, _ = run_steps(
        lambda: opt_lib.PerExampleOptimizer(gd(), strategy=STRATEGY), steps)
    ew, eb, enorms = np_run(steps, lambda gw, gb, i: (gw.sum(0), gb.sum(0)))
    np.testing.assert_allclose(w, ew, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(b, eb, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(norms, enorms, rtol=1e-10)


def factors_for(i):
    return np.random.RandomState(100 + i).uniform(-0.5, 1.5, B)


@pytest.mark.parametrize("num_steps", [1, 4])
def test_weighted(num_steps):
    steps = batches(num_steps, seed=1)
    w, b, _, opt = run_steps(
        lambda: opt_lib.WeightedOptimizer(gd(), strategy=STRATEGY), steps,
        feeds_extra=lambda opt, i: {opt.gradient_factors: factors_for(i)})
    ew, eb, _ = np_run(steps, lambda gw, gb, i: (
        np.einsum("n,ndk->dk", factors_for(i), gw), factors_for(i) @ gb))
    np.testing.assert_allclose(w, ew, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(b, eb, rtol=1e-10, atol=1e-12)
    assert opt.gradient_factors.shape.as_list() == [B]


def test_weighted_with_given_placeholder_on_ref_variables():
    steps = batches(2, seed=2)
    holder = {}

    def make():
        holder["f"] = tf.compat.v1.placeholder(tf.float64, [B])
        return opt_lib.WeightedOptimizer(gd(), gradient_factors=holder["f"])

    w, b, _, _ = run_steps(make, steps, use_resource=False,
                           feeds_extra=lambda o, i: {holder["f"]:
                                                     factors_for(i)})
    ew, eb, _ = np_run(steps, lambda gw, gb, i: (
        np.einsum("n,ndk->dk", factors_for(i), gw), factors_for(i) @ gb))
    np.testing.assert_allclose(w, ew, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(b, eb, rtol=1e-10, atol=1e-12)


def test_apply_gradients_tf1_semantics():
    xb, yb = batches(1)[0]
    with tf.Graph().as_default():
        model = Model()
        unused = tf.compat.v1.get_variable(
            "unused", initializer=tf.constant(1.0, tf.float64))
        opt = opt_lib.PerExampleOptimizer(gd(), strategy=STRATEGY)
        gv = opt.compute_gradients(model.loss)
        assert [v for _, v in gv] == [model.w, model.b, unused]
        assert gv[2][0] is None
        train = opt.apply_gradients(gv, global_step=model.global_step)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train, model.feed(xb, yb))
            assert sess.run(model.global_step) == 1
            assert sess.run(unused) == 1.0


def test_keras_optimizer_rejected():
    with pytest.raises(TypeError, match="tf.compat.v1.train"):
        opt_lib.PerExampleOptimizer(tf.keras.optimizers.SGD(0.1))


def test_weighted_attributes_before_compute():
    with pytest.raises(ValueError, match="created by compute_gradients"):
        _ = opt_lib.WeightedOptimizer(gd()).gradient_factors
    with pytest.raises(TypeError, match="gradient_factors must be a"):
        opt_lib.WeightedOptimizer(gd(), gradient_factors=[1.0, 2.0])
