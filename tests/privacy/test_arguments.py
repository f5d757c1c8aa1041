"""Out-of-range clip norms, noise multipliers and microbatch counts.

`l2_norm_clip` C >= 0 (C = 0: every clipped gradient exactly 0, never
NaN), `noise_multiplier` >= 0 and `num_microbatches` >= 1: bad Python
values raise at once naming the argument; tensors are checked at run time.
Clipped sums are compared with the loop reference
(`custagg.testing.loop_per_example`, one tf.gradients per example).
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import testing

D, K = 4, 3


def _model(batch, dtype=tf.float64):
    """A [batch, D] -> K linear model; example i's loss is scaled by m[i]
    (m[i] = 0: a per-example gradient that is exactly zero)."""
    x = tf.compat.v1.placeholder(dtype, [batch, D])
    t = tf.compat.v1.placeholder(dtype, [batch, K])
    m = tf.compat.v1.placeholder(dtype, [batch])
    w = tf.compat.v1.get_variable(
        "w", [D, K], dtype,
        initializer=tf.compat.v1.random_normal_initializer(seed=1))
    b = tf.compat.v1.get_variable(
        "b", [K], dtype,
        initializer=tf.compat.v1.random_normal_initializer(seed=2))
    loss = m * 0.5 * tf.reduce_sum(tf.square(tf.matmul(x, w) + b - t), 1)
    return x, t, m, [w, b], loss


def _feed(x, t, m, n, rng, zero_rows=()):
    mask = np.ones(n)
    mask[list(zero_rows)] = 0.0
    return {x: rng.normal(size=(n, D)), t: rng.normal(size=(n, K)), m: mask}


@pytest.mark.parametrize("batch", [1, 5, 32, 33])
@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
def test_zero_clip_gives_exact_zeros_and_positive_clip_matches_loop(
        sess, rng, batch, static):
    """C = 0: exact zeros (every example, zero-gradient ones included); C > 0
    with zero-gradient examples: the loop reference, no NaN."""
    n = batch
    x, t, m, xs, loss = _model(n if static else None)
    clip = tf.compat.v1.placeholder(tf.float64, [])
    got, norms = custagg.clipped_gradients(loss, xs, clip, return_norms=True)
    zero_py = custagg.clipped_gradients(loss, xs, 0.0)
    sess.run(tf.compat.v1.global_variables_initializer())
    zero_rows = range(0, n, 2)  # example 0 always, so B=1 is all-zero
    feed = _feed(x, t, m, n, rng, zero_rows)

    # The reference: a static-B copy of the same graph's loss.
    xr = tf.compat.v1.placeholder(tf.float64, [n, D])
    tr = tf.compat.v1.placeholder(tf.float64, [n, K])
    mr = tf.compat.v1.placeholder(tf.float64, [n])
    ref_loss = mr * 0.5 * tf.reduce_sum(
        tf.square(tf.matmul(xr, xs[0]) + xs[1] - tr), 1)
    per_example = sess.run(testing.loop_per_example(ref_loss, xs),
                           {xr: feed[x], tr: feed[t], mr: feed[m]})

    for c in (0.0, 0.3, 1e3):
        got_v, norms_v = sess.run([got, norms], {**feed, clip: c})
        if c == 0.0:
            want = [np.zeros_like(g[0]) for g in per_example]
            want_norms = testing.numpy_norms(per_example)
        else:
            want, want_norms = testing.numpy_clipped(per_example, c)
        for g in got_v:
            assert np.all(np.isfinite(testing.to_numpy(g))), c
        testing.assert_allclose_list(
            [testing.to_numpy(g) for g in got_v], want, rtol=1e-10,
            atol=1e-12)
        np.testing.assert_allclose(norms_v, want_norms, rtol=1e-10,
                                   atol=1e-12)
        if c == 0.0:
            for g in got_v:
                assert not np.any(testing.to_numpy(g)), "C=0 must give 0"
    for g in sess.run(zero_py, feed):
        assert not np.any(testing.to_numpy(g))


@pytest.mark.parametrize("bad,err,text", [
    (-1.0, ValueError, r"l2_norm_clip must be a finite number >= 0.*got -1"),
    (float("nan"), ValueError, r"l2_norm_clip must be a finite number.*nan"),
    (float("inf"), ValueError, r"l2_norm_clip must be a finite.*for no clip"),
    ("1.0", TypeError, r"l2_norm_clip must be a finite number.*'1.0'"),
    (True, TypeError, r"l2_norm_clip must be a finite number.*True"),
    (None, TypeError, r"l2_norm_clip must be.*None"),
    ([1.0, -2.0], ValueError, r"l2_norm_clip\[1\] must be a finite"),
], ids=["negative", "nan", "inf", "string", "bool", "none", "list_entry"])
def test_bad_python_clip_raises_naming_the_argument(bad, err, text):
    _, _, _, xs, loss = _model(4)
    with pytest.raises(err, match=text):
        custagg.clipped_gradients(loss, xs, bad)


def test_bad_clip_tensors(sess, rng):
    _, _, _, xs, loss = _model(4)
    with pytest.raises(ValueError, match=r"l2_norm_clip must be.*got -2"):
        custagg.clipped_gradients(loss, xs, tf.constant(-2.0))
    with pytest.raises(TypeError, match=r"l2_norm_clip.*dtype string"):
        custagg.clipped_gradients(loss, xs, tf.constant("1"))
    with pytest.raises(ValueError, match=r"l2_norm_clip.*shape \(2,\)"):
        custagg.clipped_gradients(loss, xs, tf.constant([1.0, 2.0]))


@pytest.mark.parametrize("value", [-0.5, np.nan, np.inf])
def test_fed_clip_out_of_range_fails_at_run_time(sess, rng, value):
    x, t, m, xs, loss = _model(3)
    clip = tf.compat.v1.placeholder(tf.float64, [])
    got = custagg.clipped_gradients(loss, xs, clip)
    sess.run(tf.compat.v1.global_variables_initializer())
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"l2_norm_clip must be a finite number >= 0"):
        sess.run(got, {**_feed(x, t, m, 3, rng), clip: value})


def test_int_clip_tensor_is_accepted(sess, rng):
    x, t, m, xs, loss = _model(3)
    clip = tf.compat.v1.placeholder(tf.int32, [])
    got = custagg.clipped_gradients(loss, xs, clip)
    sess.run(tf.compat.v1.global_variables_initializer())
    for g in sess.run(got, {**_feed(x, t, m, 3, rng), clip: 0}):
        assert not np.any(g)


def test_microbatches_out_of_range(rng):
    _, _, _, xs, loss = _model(4)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="num_microbatches must be a "
                                             "positive"):
            custagg.clipped_gradients(loss, xs, 1.0, num_microbatches=bad)


def _sgd():
    return tf.compat.v1.train.GradientDescentOptimizer(0.1)


@pytest.mark.parametrize("kwargs,err,text", [
    (dict(l2_norm_clip=-1.0), ValueError, r"l2_norm_clip must be a positive"),
    (dict(l2_norm_clip=float("nan")), ValueError, r"l2_norm_clip.*nan"),
    (dict(l2_norm_clip=tf.constant(-1.0)), ValueError,
     r"l2_norm_clip must be a positive"),
    (dict(l2_norm_clip=tf.constant("x")), TypeError,
     r"l2_norm_clip must be.*dtype string"),
    (dict(noise_multiplier=-0.1), ValueError,
     r"noise_multiplier must be a non-negative.*>= 0 \(0: no noise\)"),
    (dict(noise_multiplier=float("inf")), ValueError,
     r"noise_multiplier must be a non-negative finite"),
    (dict(num_microbatches=0), ValueError, r"num_microbatches must be a "
                                           r"positive int"),
], ids=["clip_negative", "clip_nan", "clip_const_tensor", "clip_string_tensor",
        "noise_negative", "noise_inf", "microbatches_zero"])
def test_dp_optimizer_constructor_checks(kwargs, err, text):
    args = dict(l2_norm_clip=1.0, noise_multiplier=1.1)
    args.update(kwargs)
    with pytest.raises(err, match=text):
        custagg.DPOptimizer(_sgd(), **args)


def test_privacy_constructors_check():
    from custagg.privacy import dp_optimizer, gaussian_query
    with pytest.raises(ValueError, match=r"GaussianSumQuery: l2_norm_clip "
                                         r"must be a non-negative"):
        gaussian_query.GaussianSumQuery(-1.0, 1.0)
    with pytest.raises(ValueError, match=r"GaussianSumQuery: stddev"):
        gaussian_query.GaussianSumQuery(1.0, float("nan"))
    with pytest.raises(ValueError, match=r"noise_multiplier must be a "
                                         r"non-negative"):
        dp_optimizer.DPGradientDescentGaussianOptimizer(
            l2_norm_clip=1.0, noise_multiplier=-1.0, learning_rate=0.1)
    with pytest.raises(ValueError, match=r"num_microbatches must be a "
                                         r"positive int"):
        dp_optimizer.DPGradientDescentGaussianOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=0,
            learning_rate=0.1)


def test_privacy_zero_clip_trains_nothing_and_never_nan(sess, rng):
    """TF Privacy's Gaussian optimizer with C = 0 (so noise 0): the update is
    exactly 0, never NaN."""
    from custagg.privacy import dp_optimizer
    x, t, m, xs, loss = _model(4)
    opt = dp_optimizer.DPGradientDescentGaussianOptimizer(
        l2_norm_clip=0.0, noise_multiplier=1.0, learning_rate=0.1)
    grads = [g for g, _ in opt.compute_gradients(loss, var_list=xs)]
    sess.run(tf.compat.v1.global_variables_initializer())
    for g in sess.run(grads, _feed(x, t, m, 4, rng, zero_rows=[1])):
        assert not np.any(g)
