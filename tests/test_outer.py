"""custagg.rules.outer.Outer's closed forms against materialized gradients."""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import testing
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


_VIEWS = ("Reshape", "Identity", "StridedSlice", "Shape", "Const", "Pack",
          "ReadVariableOp", "ExpandDims", "Squeeze")


@pytest.mark.parametrize("batch", [1, 4])
def test_forward_terms_of_the_norms_wait_for_the_gradient(batch):
    """An activations' Gram and an id mask (`[B, T, T]`, forward values
    alone) run after the gradient terms they multiply: built as soon as
    their inputs exist they would run in the forward pass and be held to
    the backward pass (`outer.after_gradient`; a transformer block at
    B = 512: peak 1.13x -> 1.09x the aggregated gradient's). Values
    against one tf.gradients per example, float64."""
    rng = np.random.RandomState(batch)
    steps, d, k, vocab = 2, 8, 8, 5
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float64, [None, steps, d])
        ids = tf.compat.v1.placeholder(tf.int32, [None, steps])
        w = tf.Variable(rng.randn(d, k))
        table = tf.Variable(rng.randn(vocab, k))
        h = tf.tanh(tf.einsum("btd,dk->btk", x, w) +
                    tf.nn.embedding_lookup(table, ids))
        loss = tf.reduce_sum(tf.square(h), axis=[1, 2])
        with tf.name_scope("norms"):
            norms = custagg.per_example_norms(loss, [w, table])
        early = []
        for op in tf.compat.v1.get_default_graph().get_operations():
            if (not op.name.startswith("norms/") or "/gradients/" in op.name
                    or op.type in _VIEWS):
                continue
            if any(o.shape.rank is not None and o.shape.rank >= 3
                   for o in op.outputs) and \
                    not testing.waits_for_backward_pass(op):
                early.append("%s (%s)" % (op.name, op.type))
        assert not early, early
        ref = testing.loop_per_example(loss, [w, table], batch)
        feed = {x: rng.randn(batch, steps, d),
                ids: rng.randint(0, vocab, [batch, steps])}
        feed[ids][:, 1] = feed[ids][:, 0]        # a repeated id per example
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got, per = sess.run([norms, ref], feed)
    want = np.sqrt(sum(np.sum(np.reshape(g, [batch, -1]) ** 2, axis=1)
                       for g in per))
    np.testing.assert_allclose(got, want, rtol=1e-10)
