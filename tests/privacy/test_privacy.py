"""custagg.privacy: TF Privacy's TF1 optimizer API, and ε from dp-accounting.

References are numpy: per-example gradients of `0.5 ||x_i - v||^2` are
`v - x_i`, averaged per microbatch, clipped by global norm, averaged over
microbatches (TF Privacy's definition). TF Privacy's own test file runs in
tests/privacy/test_tfp_dp_optimizer_suite.py where TF Privacy is installed.
"""

import math
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

from custagg import optimizers as opt_lib
from custagg.privacy import compute_dp_sgd_privacy
from custagg.privacy import dp_optimizer
from custagg.privacy import gaussian_query

QUERY_CLASSES = [dp_optimizer.DPGradientDescentOptimizer,
                 dp_optimizer.DPAdagradOptimizer,
                 dp_optimizer.DPAdamOptimizer,
                 dp_optimizer.DPMomentumOptimizer,
                 dp_optimizer.DPRMSPropOptimizer,
                 dp_optimizer.DPFtrlOptimizer]
DATA = np.array([[3.0, 4.0], [6.0, 8.0], [-9.0, -12.0], [-12.0, -16.0]])
V0 = np.array([1.0, 2.0])


def _kwargs(cls):
    kw = dict(learning_rate=2.0)
    if cls is dp_optimizer.DPMomentumOptimizer:
        kw["momentum"] = 0.9
    return kw


def _loss(data, var):
    return 0.5 * tf.reduce_sum(tf.math.squared_difference(data, var), axis=1)


def np_expected(v, data, clip, m):
    per_example = v - data
    mb = per_example.reshape(m, -1, per_example.shape[1]).mean(axis=1)
    norms = np.linalg.norm(mb, axis=1)
    scale = np.minimum(1.0, clip / np.maximum(norms, 1e-30))
    return (mb * scale[:, None]).mean(axis=0)


def _grad(opt, loss, var, sess):
    gv = opt.compute_gradients(loss, [var])
    sess.run(tf.compat.v1.global_variables_initializer())
    return sess.run(gv[0][0])


@pytest.mark.parametrize("cls", QUERY_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("m", [None, 1, 2, 4])
@pytest.mark.parametrize("clip", [1e9, 1.0])
def test_query_classes_clip_like_tf_privacy(cls, m, clip, sess):
    var = tf.Variable(V0)
    data = tf.constant(DATA)
    opt = cls(gaussian_query.GaussianSumQuery(clip, 0.0),
              num_microbatches=m, **_kwargs(cls))
    assert isinstance(opt, cls.__mro__[1])        # a subclass of the TF1 class
    got = _grad(opt, _loss(data, var), var, sess)
    np.testing.assert_allclose(got, np_expected(V0, DATA, clip, m or 4),
                               rtol=1e-10)


@pytest.mark.parametrize("m", [1, 2])
def test_gaussian_classes_noise_std(m, sess):
    var = tf.Variable([0.0])
    data = tf.zeros([4, 1], tf.float32)
    opt = dp_optimizer.DPGradientDescentGaussianOptimizer(
        l2_norm_clip=4.0, noise_multiplier=2.0, num_microbatches=m,
        learning_rate=2.0)
    assert isinstance(opt, tf.compat.v1.train.GradientDescentOptimizer)
    g = opt.compute_gradients(_loss(data, var), [var])[0][0]
    sess.run(tf.compat.v1.global_variables_initializer())
    draws = np.array([sess.run(g) for _ in range(400)])
    assert abs(draws.std() - 8.0 / m) < 0.1 * 8.0 / m


def test_other_queries_use_their_own_methods(sess):
    """A DPQuery that is not a Gaussian sum query goes through
    accumulate_record per microbatch (loop and unrolled) with the same
    result."""

    class HalfQuery(gaussian_query.GaussianSumQuery):
        def accumulate_record(self, params, sample_state, record):
            record = [0.5 * r for r in record]
            return super().accumulate_record(params, sample_state, record)

    var = tf.Variable(V0)
    data = tf.constant(DATA)
    grads = []
    for unroll in (False, True):
        opt = dp_optimizer.DPGradientDescentOptimizer(
            HalfQuery(1e9, 0.0), num_microbatches=2,
            unroll_microbatches=unroll, learning_rate=1.0)
        grads.append(opt.compute_gradients(_loss(data, var), [var])[0][0])
    sess.run(tf.compat.v1.global_variables_initializer())
    expected = np_expected(V0, DATA, 1e9, 2) * 0.5
    for g in sess.run(grads):
        np.testing.assert_allclose(g, expected, rtol=1e-10)


def test_trailing_axes_are_averaged_per_example(sess):
    var = tf.Variable(V0)
    data = tf.constant(DATA)
    per_coord = 0.5 * tf.math.squared_difference(data, var)        # [B, 2]
    opt = dp_optimizer.DPGradientDescentOptimizer(
        gaussian_query.GaussianSumQuery(1.0, 0.0), num_microbatches=2,
        learning_rate=1.0)
    got = _grad(opt, per_coord, var, sess)
    # The mean over the 2 coordinates is half the summed loss.
    np.testing.assert_allclose(got, _half_loss_expected(), rtol=1e-10)


def _half_loss_expected():
    per_example = 0.5 * (V0 - DATA)
    mb = per_example.reshape(2, -1, 2).mean(axis=1)
    scale = np.minimum(1.0, 1.0 / np.linalg.norm(mb, axis=1))
    return (mb * scale[:, None]).mean(axis=0)


def test_string_variable_gets_none_and_minimize_runs(sess):
    var = tf.Variable(V0)
    data = tf.constant(DATA)
    extra = tf.Variable("foo", trainable=True, dtype=tf.string)
    opt = dp_optimizer.DPGradientDescentOptimizer(
        gaussian_query.GaussianSumQuery(1e9, 0.0), num_microbatches=2,
        learning_rate=2.0)
    gv = opt.compute_gradients(_loss(data, var), [var, extra])
    assert gv[1][0] is None and gv[1][1] is extra
    step = opt.minimize(loss=_loss(data, var), var_list=[var, extra])
    sess.run(tf.compat.v1.global_variables_initializer())
    sess.run(step)
    np.testing.assert_allclose(sess.run(var),
                               V0 - 2.0 * np_expected(V0, DATA, 1e9, 2))


@pytest.mark.parametrize("make", [
    lambda: dp_optimizer.DPAdamOptimizer(
        gaussian_query.GaussianSumQuery(1.0, 0.0), num_microbatches=1,
        learning_rate=1.0),
    lambda: dp_optimizer.DPAdamGaussianOptimizer(1.0, 0.0, 1,
                                                 learning_rate=1.0),
    lambda: opt_lib.DPOptimizer(tf.compat.v1.train.AdamOptimizer(1.0), 1.0,
                                0.0),
    lambda: opt_lib.ClippedOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0), 1.0),
], ids=["query", "gaussian", "custagg_dp", "custagg_clipped"])
def test_apply_before_compute_raises(make):
    opt = make()
    var = tf.Variable([0.0])
    with pytest.raises(AssertionError, match="compute_gradients"):
        opt.apply_gradients([(tf.constant([1.0]), var)])
    with pytest.raises(opt_lib.ComputeGradientsNotCalledError):
        opt.apply_gradients([(tf.constant([1.0]), var)])
    gv = opt.compute_gradients(_loss(tf.zeros([2, 1]), var), [var])
    opt.apply_gradients(gv)


def test_override_warning_is_tf_privacy_s():
    class SimpleOptimizer(tf.compat.v1.train.Optimizer):
        def compute_gradients(self):  # pylint: disable=arguments-differ
            return 0

    with mock.patch("absl.logging.warning") as warn:
        dp_optimizer.make_optimizer_class(SimpleOptimizer)
    warn.assert_called_once()
    assert "overrides method compute_gradients()" in warn.call_args[0][0]
    assert warn.call_args[0][1] == "SimpleOptimizer"


def test_keras_optimizer_class_rejected_with_reason():
    with pytest.raises(TypeError, match="Keras optimizer classes"):
        dp_optimizer.make_gaussian_optimizer_class(tf.keras.optimizers.SGD)
    with pytest.raises(TypeError, match="Pass the class"):
        dp_optimizer.make_optimizer_class(
            tf.compat.v1.train.AdamOptimizer(0.1))


def test_slots_and_checkpoint_names_are_the_base_optimizer_s():
    def names(make):
        with tf.Graph().as_default():
            var = tf.compat.v1.get_variable("v", initializer=V0)
            data = tf.constant(DATA)
            step = tf.compat.v1.train.get_or_create_global_step()
            opt = make()
            opt.minimize(loss=_loss(data, var), global_step=step)
            return (sorted(v.name for v in tf.compat.v1.global_variables()),
                    opt.get_slot_names())

    plain = names(lambda: tf.compat.v1.train.AdamOptimizer(0.1))
    dp = names(lambda: dp_optimizer.DPAdamGaussianOptimizer(
        1.0, 1.1, None, learning_rate=0.1))
    # Plus the noise stream's key and counter (custagg.privacy.noise).
    noise_state = [n for n in dp[0] if "_noise_" in n]
    assert sorted(noise_state) == ["Adam_noise_key:0",
                                   "Adam_noise_step:0"]
    assert plain == ([n for n in dp[0] if n not in noise_state], dp[1])
    assert "v/Adam:0" in dp[0] and "beta1_power:0" in dp[0]


def test_custagg_wrappers_take_loss_keyword_and_old_name(sess):
    var = tf.Variable(V0)
    data = tf.constant(DATA)
    opt = opt_lib.ClippedOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(1.0), 1.0,
        num_microbatches=2)
    extra = tf.Variable("s", dtype=tf.string)
    g_new = opt.compute_gradients(loss=_loss(data, var),
                                  var_list=[var, extra])
    assert g_new[1][0] is None
    g_old = opt.compute_gradients(per_example_loss=_loss(data, var),
                                  var_list=[var])
    g_2d = opt.compute_gradients(
        loss=0.5 * tf.math.squared_difference(data, var), var_list=[var])
    with pytest.raises(TypeError, match="pass the loss once"):
        opt.compute_gradients(loss=_loss(data, var),
                              per_example_loss=_loss(data, var))
    sess.run(tf.compat.v1.global_variables_initializer())
    a, b, c = sess.run([g_new[0][0], g_old[0][0], g_2d[0][0]])
    np.testing.assert_allclose(a, np_expected(V0, DATA, 1.0, 2), rtol=1e-10)
    np.testing.assert_allclose(b, a, rtol=1e-12)
    np.testing.assert_allclose(c, _half_loss_expected(), rtol=1e-10)


def test_optimizers_short_names_are_the_query_classes():
    assert opt_lib.DPAdamOptimizer is dp_optimizer.DPAdamOptimizer
    assert opt_lib.DPMomentumOptimizer is dp_optimizer.DPMomentumOptimizer
    with pytest.raises(AttributeError):
        _ = opt_lib.DPNoSuchOptimizer


# --------------------------------------------------------------------------
# ε

# Measured with TF Privacy 0.9.0's compute_dp_sgd_privacy_lib.
# compute_dp_sgd_privacy on TF 2.15.1 (dp-accounting 0.4.3), 2026-12-03: its
# MNIST tutorial's settings, the three cases of its own test file, and the
# main job's (bundled digits, 1438 training images, batch 64, 10 epochs,
# delta = 1/n). dp-accounting 0.6.0 gives the last one 1.3e-4 higher
# (fractional RDP orders are computed differently), hence rel=1e-3.
TFP_REFERENCE = [
    ((60000, 256, 1.1, 60, 1e-5), 2.597079519657094, 8.0),
    ((60000, 150, 1.3, 15, 1e-5), 0.7242234026109595, 19.0),
    ((100000, 100, 1.0, 30, 1e-7), 1.4154988495444842, 13.0),
    ((100000000, 1024, 0.1, 10, 1e-7), 5907982.311381949, 1.25),
    ((1438, 64, 1.1, 10, 1 / 1438), 3.0013605322572454, 4.5),
]


@pytest.mark.parametrize("args, eps, order", TFP_REFERENCE)
def test_epsilon_matches_tf_privacy_reference(args, eps, order):
    got, got_order = compute_dp_sgd_privacy(*args)
    assert got == pytest.approx(eps, rel=1e-3)
    assert got_order == order


@pytest.mark.parametrize("args", [a for a, _, _ in TFP_REFERENCE])
def test_pld_is_tighter_than_rdp(args):
    rdp, _ = compute_dp_sgd_privacy(*args)
    pld, order = compute_dp_sgd_privacy(*args, accountant="pld")
    assert order is None
    assert 0 < pld <= rdp * (1 + 1e-9)


def test_epsilon_monotone_in_noise_and_epochs():
    by_sigma = [compute_dp_sgd_privacy(60000, 256, s, 10, 1e-5)[0]
                for s in (0.6, 0.8, 1.1, 1.5, 2.0)]
    assert all(a > b for a, b in zip(by_sigma, by_sigma[1:]))
    by_epochs = [compute_dp_sgd_privacy(60000, 256, 1.1, e, 1e-5)[0]
                 for e in (0.5, 1, 5, 20, 60)]
    assert all(a < b for a, b in zip(by_epochs, by_epochs[1:]))
    # Small delta costs more epsilon.
    assert compute_dp_sgd_privacy(60000, 256, 1.1, 5, 1e-7)[0] > \
        compute_dp_sgd_privacy(60000, 256, 1.1, 5, 1e-5)[0]
    assert compute_dp_sgd_privacy(100, 10, 0.0, 1, 1e-5)[0] == math.inf


@pytest.mark.parametrize("kwargs, match", [
    (dict(n=10, batch_size=20), "at least the batch size"),
    (dict(batch_size=0), "batch_size must be a positive int"),
    (dict(noise_multiplier=-1.0), "noise_multiplier"),
    (dict(epochs=0), "epochs must be positive"),
    (dict(delta=0.0), r"delta must be in \(0, 1\)"),
    (dict(accountant="gdp"), "accountant must be"),
])
def test_epsilon_bad_arguments(kwargs, match):
    args = dict(n=1000, batch_size=10, noise_multiplier=1.0, epochs=1,
                delta=1e-5)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        compute_dp_sgd_privacy(**args)
