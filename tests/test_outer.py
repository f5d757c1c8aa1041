"""custagg.rules.outer.Outer's closed forms against materialized gradients."""

import numpy as np
import pytest
import tensorflow as tf

from custagg.rules import outer as _outer


@pytest.mark.parametrize("steps", [None, 1, 4])
@pytest.mark.parametrize("batch", [1, 3])
def test_inner_dense_matches_materialized(graph, steps, batch):
    rng = np.random.default_rng(7)
    d, k = 5, 3
    lead = [batch] if steps is None else [batch, steps]
    a = tf.constant(rng.normal(size=lead + [d]))
    g = tf.constant(rng.normal(size=lead + [k]))
    m_batched = tf.constant(rng.normal(size=[batch, d, k]))
    m = tf.constant(rng.normal(size=[d, k]))
    outer = _outer.Outer(a, g, _outer.layout([d], [k], None))
    full = outer.per_example()                                   # [B, D, K]
    want_b = tf.reduce_sum(full * m_batched, axis=[1, 2])
    want = tf.reduce_sum(full * m[None], axis=[1, 2])
    with tf.compat.v1.Session() as sess:
        got_b, got, wb, w = sess.run([outer.inner_dense(m_batched, True),
                                      outer.inner_dense(m, False),
                                      want_b, want])
    np.testing.assert_allclose(got_b, wb, rtol=1e-12)
    np.testing.assert_allclose(got, w, rtol=1e-12)


@pytest.mark.parametrize("dk", [(5, 3), (3, 5)])
@pytest.mark.parametrize("steps", [None, 4])
@pytest.mark.parametrize("batch", [1, 3])
def test_weighted_sum_matches_materialized(graph, dk, steps, batch):
    rng = np.random.default_rng(8)
    d, k = dk
    lead = [batch] if steps is None else [batch, steps]
    a = tf.constant(rng.normal(size=lead + [d]))
    g = tf.constant(rng.normal(size=lead + [k]))
    c = tf.constant(rng.normal(size=[batch]))
    outer = _outer.Outer(a, g, _outer.layout([d], [k], None))
    want = tf.tensordot(c, outer.per_example(), axes=1)
    with tf.compat.v1.Session() as sess:
        got, want = sess.run([outer.weighted_sum(c), want])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
