"""`custagg.privacy.noise.stateless_gaussian`: the sampler of every DP noise
draw (Box-Muller over TF's stateless uniforms in float32).

* Against a reference: the same uniforms put through Box-Muller in float64
  numpy, for even, odd, empty, dynamic and `TensorShape` shapes, a tensor
  stddev, float16 and bfloat16 (drawn in float32, then cast); float64 is
  TF's `stateless_normal` itself.
* The transform at the uniforms' extremes: finite, bounded by 5.65 stddev.
* As a distribution, over 2^21 values from fixed seeds (so the outcome is
  the same at every run): the Kolmogorov-Smirnov distance to N(0, 1) within
  the 1e-6 critical value, the mean, the variance and the 3-sigma tail
  within 5 standard errors, and the two values made from one uniform pair
  uncorrelated, in themselves and in their squares (which share a radius).
* A pure function of the seed: the same seed, the same noise; another
  seed (either word), other noise.
"""

import math
import re

import numpy as np
import pytest
import tensorflow as tf

from custagg.privacy import gaussian
from custagg.privacy import noise

N_STAT = 1 << 21


def _reference(sess, shape, seed, stddev=1.0):
    """Box-Muller in float64 numpy over the sampler's own uniforms: `[h]`
    from each of the two seeds split from `seed`."""
    n = int(np.prod(shape, dtype=np.int64))
    half = (n + 1) // 2
    seeds = tf.random.experimental.stateless_split(seed, 2)
    u, v = (sess.run(tf.random.stateless_uniform([half], seed=seeds[i]))
            .astype(np.float64) for i in (0, 1))
    r = stddev * np.sqrt(-2.0 * np.log(1.0 - u))
    z = np.concatenate([r * np.cos(2 * np.pi * v), r * np.sin(2 * np.pi * v)])
    return z[:n].reshape(shape)


@pytest.mark.parametrize("shape", [[6, 5], [7], [3, 1, 3], [1], [0], [2, 0]])
def test_matches_box_muller_on_the_same_uniforms(sess, shape):
    seed = tf.constant([11, 3], tf.int64)
    got = sess.run(noise.stateless_gaussian(shape, seed, 0.7))
    assert got.dtype == np.float32 and got.shape == tuple(shape)
    np.testing.assert_allclose(got, _reference(sess, shape, seed, 0.7),
                               rtol=2e-5, atol=2e-6)


def test_dynamic_and_tensorshape_shapes(sess):
    seed = tf.constant([5, 8], tf.int64)
    fed = tf.compat.v1.placeholder(tf.int32, [None])
    stddev = tf.compat.v1.placeholder(tf.float32, [])
    dynamic = noise.stateless_gaussian(fed, seed, stddev)
    static = noise.stateless_gaussian(tf.TensorShape([4, 3]), seed)
    assert static.shape.as_list() == [4, 3]
    for shape in ([3, 3], [5], [0]):
        got = sess.run(dynamic, {fed: shape, stddev: 2.0})
        assert got.shape == tuple(shape)
        np.testing.assert_allclose(got, _reference(sess, shape, seed, 2.0),
                                   rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(sess.run(static), _reference(sess, [4, 3], seed),
                               rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_half_precision_is_the_float32_draw_cast(sess, dtype):
    seed = tf.constant([2, 9], tf.int64)
    got = noise.stateless_gaussian([9], seed, 1.5, dtype)
    assert got.dtype == dtype
    want = tf.cast(noise.stateless_gaussian([9], seed, 1.5), dtype)
    a, b = sess.run([tf.cast(got, tf.float32), tf.cast(want, tf.float32)])
    np.testing.assert_array_equal(a, b)


def test_float64_is_tfs_stateless_normal(sess):
    seed = tf.constant([4, 1], tf.int64)
    got = noise.stateless_gaussian([5, 3], seed, 0.5, tf.float64)
    want = tf.random.stateless_normal([5, 3], seed=seed, stddev=0.5,
                                      dtype=tf.float64)
    a, b = sess.run([got, want])
    assert a.dtype == np.float64
    np.testing.assert_array_equal(a, b)


def test_a_python_stddev_keeps_float64_precision(sess):
    # 0.1 is not a float32 number: cast through float32 it would be off by
    # 1.5e-9 relative.
    seed = tf.constant([4, 1], tf.int64)
    got = noise.stateless_gaussian([6], seed, 0.1, tf.float64)
    want = tf.random.stateless_normal(
        [6], seed=seed, stddev=tf.constant(0.1, tf.float64), dtype=tf.float64)
    a, b = sess.run([got, want])
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("args, error, says", [
    (([3], [1, 2], 1.0, tf.int32), TypeError, "`dtype` must be a floating"),
    ((tf.TensorShape([None, 3]), [1, 2]), ValueError, "`shape`"),
    (([3], [1, 2, 3]), ValueError, "`seed` must be a [2]"),
])
def test_bad_arguments_are_named(args, error, says):
    with pytest.raises(error, match=re.escape(says)):
        noise.stateless_gaussian(*args)


def test_extreme_uniforms_stay_finite_and_bounded(sess):
    # u = 0 gives radius 0; the largest float32 uniform below 1 gives the
    # largest radius, sqrt(-2 log 2^-23) = 5.65.
    top = np.float32(1.0) - np.float32(2.0 ** -23)
    u = tf.constant([0.0, top, top, 0.5], tf.float32)
    v = tf.constant([0.0, 0.0, 0.25, 0.5], tf.float32)
    z = sess.run(gaussian._box_muller(v, lambda: u, 1.0))
    assert np.isfinite(z).all()
    bound = math.sqrt(-2.0 * math.log(2.0 ** -23))
    np.testing.assert_allclose(np.abs(z).max(), bound, rtol=1e-5)
    np.testing.assert_allclose(z[[0, 4]], [0.0, 0.0], atol=0)


def _sample(sess):
    draws = [noise.stateless_gaussian([N_STAT // 4], tf.constant(s, tf.int64))
             for s in ([0, 0], [1, 0], [0, 1], [12345, 678])]
    return np.concatenate(sess.run(draws)).astype(np.float64)


def test_is_standard_normal(sess):
    z = _sample(sess)
    n = z.size
    assert np.isfinite(z).all()
    # Kolmogorov-Smirnov distance; critical value at level 1e-6.
    xs = np.sort(z)
    cdf = sess.run(0.5 * (1.0 + tf.math.erf(xs / math.sqrt(2.0))))
    k = np.arange(1, n + 1) / n
    distance = max(np.max(k - cdf), np.max(cdf - (k - 1.0 / n)))
    assert distance < math.sqrt(-math.log(0.5e-6) / (2 * n)), distance
    # Moments and the tail, each within 5 standard errors.
    assert abs(z.mean()) < 5 / math.sqrt(n)
    assert abs(z.var() - 1.0) < 5 * math.sqrt(2.0 / n)
    p3 = math.erfc(3 / math.sqrt(2.0))
    assert abs(np.mean(np.abs(z) > 3) - p3) < 5 * math.sqrt(p3 / n)


def test_the_two_values_of_a_pair_are_independent(sess):
    # A draw of n values pairs value i with value i + n/2 (one radius).
    z = sess.run(noise.stateless_gaussian([N_STAT], tf.constant([3, 3],
                                                                tf.int64)))
    first, second = z[:N_STAT // 2].astype(np.float64), \
        z[N_STAT // 2:].astype(np.float64)
    bound = 5 / math.sqrt(N_STAT // 2)
    assert abs(np.corrcoef(first, second)[0, 1]) < bound
    assert abs(np.corrcoef(first ** 2, second ** 2)[0, 1]) < bound


def test_a_pure_function_of_the_seed(sess):
    def draw(seed):
        return noise.stateless_gaussian([64], tf.constant(seed, tf.int64))
    a, again, other_key, other_counter = sess.run(
        [draw([1, 2]), draw([1, 2]), draw([2, 2]), draw([1, 3])])
    np.testing.assert_array_equal(a, again)
    for other in (other_key, other_counter):
        assert not np.isin(other, a).any()
