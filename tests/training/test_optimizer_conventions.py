"""TF1 conventions a review found missing in the optimizer wrappers, each
against what the wrapped TF1 optimizer does or a clear error naming the
argument:

* WeightedOptimizer's own `gradient_factors` placeholder, made per graph
  and static batch size (it was made once, for the first graph and B);
* the update op named as the wrapped optimizer names it;
* `strategy` checked when the optimizer is made;
* eager `grad_loss`, eager variables in `var_list`, an eager clip norm;
* a loss-scale optimizer around a DP or clipping optimizer refused (its
  scaled loss made the noise smaller by the loss scale).
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg.privacy import dp_optimizer

GD = tf.compat.v1.train.GradientDescentOptimizer


def _model(batch, dtype=tf.float64):
    x = tf.compat.v1.placeholder(dtype, [batch, 3])
    w = tf.compat.v1.get_variable("w", [3, 1], dtype=dtype)
    return x, w, tf.reduce_sum(tf.square(tf.matmul(x, w)), axis=1)


def test_weighted_optimizer_in_two_graphs_and_two_batch_sizes():
    opt = custagg.WeightedOptimizer(GD(0.1))
    rng = np.random.default_rng(0)
    for graph_batches in ([4, 8], [8]):
        with tf.Graph().as_default():
            w = tf.compat.v1.get_variable("w", [3, 1], dtype=tf.float64)
            got, feeds = [], []
            for batch in graph_batches:
                xb = tf.compat.v1.placeholder(tf.float64, [batch, 3])
                lb = tf.reduce_sum(tf.square(tf.matmul(xb, w)), axis=1)
                g = opt.compute_gradients(lb, var_list=[w])[0][0]
                f = opt.gradient_factors
                assert f.shape.as_list() == [batch] and f.graph is lb.graph
                values = rng.normal(size=(batch, 3))
                factors = rng.normal(size=batch)
                want = tf.compat.v1.gradients(lb, [w], grad_ys=tf.constant(
                    factors))[0]
                got.append((g, want))
                feeds.append({xb: values, f: factors})
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                for (g, want), feed in zip(got, feeds):
                    a, b = sess.run([g, want], feed)
                    np.testing.assert_allclose(a, b, rtol=1e-12)


@pytest.mark.parametrize("make", [
    lambda o: custagg.PerExampleOptimizer(o),
    lambda o: custagg.WeightedOptimizer(o),
    lambda o: custagg.DPOptimizer(o, 1.0, 1.1),
    lambda o: custagg.ClippedOptimizer(o, 1.0)])
def test_update_op_named_as_the_wrapped_optimizer_names_it(make):
    with tf.Graph().as_default():
        _, _, loss = _model(4)
        plain = tf.compat.v1.train.AdamOptimizer(0.1, name="Adam")
        op = make(plain).minimize(loss)
        assert op.name == "Adam"
        named = make(tf.compat.v1.train.AdamOptimizer(0.1)).minimize(
            loss, name="step")
        assert named.name == "step"


@pytest.mark.parametrize("cls", [custagg.PerExampleOptimizer,
                                 custagg.WeightedOptimizer])
def test_strategy_checked_when_made(cls):
    with pytest.raises(ValueError, match="unknown strategy 'fastest'"):
        cls(GD(0.1), strategy="fastest")


def test_eager_arguments_get_errors_naming_them(run_python):
    proc = run_python("""
        import numpy as np
        import tensorflow as tf
        import custagg
        eager_gl = tf.ones([4])
        eager_clip = tf.constant(2.0)
        eager_var = tf.Variable(tf.ones([3, 1]))
        tf.compat.v1.disable_eager_execution()
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        w = tf.compat.v1.get_variable("w", [3, 1])
        loss = tf.reduce_sum(tf.matmul(x, w), axis=1)
        gd = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        try:
            custagg.PerExampleOptimizer(gd).compute_gradients(
                loss, grad_loss=eager_gl)
        except TypeError as e:
            assert "grad_loss holds an eager tensor" in str(e), e
        else:
            raise AssertionError("no error for an eager grad_loss")
        try:
            custagg.PerExampleOptimizer(gd).compute_gradients(
                loss, var_list=[eager_var])
        except ValueError as e:
            assert "var_list[0]" in str(e) and "eager variable" in str(e), e
        else:
            raise AssertionError("no error for an eager variable")
        opt = custagg.DPOptimizer(gd, eager_clip, 0.0)   # its value, 2.0
        assert opt.l2_norm_clip == 2.0
        opt.minimize(loss)
        print("OK")
    """)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("make", [
    lambda: custagg.DPOptimizer(GD(0.1), 1.0, 1.1),
    lambda: custagg.ClippedOptimizer(GD(0.1), 1.0),
    lambda: dp_optimizer.DPGradientDescentGaussianOptimizer(
        1.0, 1.1, learning_rate=0.1)])
def test_loss_scale_optimizer_around_dp_is_refused(make):
    with tf.Graph().as_default():
        _, w, loss = _model(4, tf.float32)
        opt = tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
            make(), tf.compat.v1.mixed_precision.FixedLossScale(128.0))
        with pytest.raises(ValueError, match="loss-scale optimizer"):
            opt.compute_gradients(loss, var_list=[w])


def test_loss_scale_optimizer_around_a_sum_is_the_plain_gradient():
    with tf.Graph().as_default():
        x, w, loss = _model(4, tf.float32)
        scaled = tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
            custagg.PerExampleOptimizer(GD(0.1)),
            tf.compat.v1.mixed_precision.FixedLossScale(128.0))
        g = scaled.compute_gradients(loss, var_list=[w])[0][0]
        want = tf.compat.v1.gradients(loss, [w])[0]
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            a, b = sess.run([g, want], {x: np.random.default_rng(1).normal(
                size=(4, 3))})
        np.testing.assert_allclose(a, b, rtol=1e-5)
