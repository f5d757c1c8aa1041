"""The clip-and-noise core (custagg.privacy.core) and its DPQuery interface.

* A user's own sum query reaches the fast path by returning a
  `ClippedSumForm` (no record is preprocessed: the clipped sum comes from
  the rules), and gives what TF Privacy's record-by-record path gives for
  the same query without a form, and what numpy gives from the loop
  reference (`custagg.testing.loop_per_example`), B = 1, 5, 12, M = B and
  M < B, float64.
* A subclass of a fast-path query that processes records its own way is
  not taken on the fast path unless it opts in.
* `add_noise`: the one noise draw; seeded, it is `stateless_normal` of the
  seed split in order; from a noise stream, each tensor's noise has the std
  asked and the next step's draw is another.
* `hand_over_noise`: both DP faces stop adding noise and report sigma.
"""

import numpy as np
import pytest
import tensorflow as tf

from custagg import testing
from custagg import optimizers
from custagg.privacy import core
from custagg.privacy import dp_optimizer
from custagg.privacy import noise
from custagg.privacy.dp_query import dp_query
from custagg.privacy.dp_query import gaussian_query

D, K = 4, 3


class ClipSumQuery(dp_query.SumAggregationDPQuery):
    """Records clipped to `clip` (global norm), summed, scaled by `scale`
    (a stand-in for a mechanism: no noise, so values compare exactly).
    `preprocessed` counts records preprocessed (graph construction)."""

    def __init__(self, clip, scale, fast=True):
        self._clip, self._scale, self._fast = clip, scale, fast
        self.preprocessed = 0

    def derive_sample_params(self, global_state):
        return tf.constant(self._clip, tf.float64)

    def preprocess_record(self, params, record):
        self.preprocessed += 1
        flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(record)]
        clipped, _ = tf.clip_by_global_norm(flat, tf.cast(params,
                                                          flat[0].dtype))
        return tf.nest.pack_sequence_as(record, clipped)

    def get_noised_result(self, sample_state, global_state):
        return (tf.nest.map_structure(lambda s: s * self._scale, sample_state),
                global_state, None)

    def clipped_sum_form(self):
        if not self._fast:
            return None
        return dp_query.ClippedSumForm(clip=lambda params: params)


def _model(batch, rng):
    x = tf.compat.v1.placeholder(tf.float64, [batch, D])
    y = tf.compat.v1.placeholder(tf.int32, [batch])
    w = tf.Variable(rng.normal(size=(D, K)), name="w")
    b = tf.Variable(rng.normal(size=(K,)) * 0.1, name="b")
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.matmul(x, w) + b)
    feed = {x: rng.normal(size=(batch, D)) * 3.0,
            y: rng.integers(0, K, size=batch)}
    return loss, [w, b], feed


def _reference(per_example, m, clip, scale):
    """numpy: microbatch means, clipped by global norm, summed, scaled, / M."""
    b = per_example[0].shape[0]
    means = [g.reshape((m, b // m) + g.shape[1:]).mean(axis=1)
             for g in per_example]
    out = [np.zeros_like(g[0]) for g in means]
    for i in range(m):
        norm = np.sqrt(sum(np.sum(g[i] ** 2) for g in means))
        f = min(1.0, clip / norm) if norm > 0 else 1.0
        for o, g in zip(out, means):
            o += f * g[i]
    return [o * scale / m for o in out]


@pytest.mark.parametrize("batch,m", [(1, None), (5, None), (12, 4)])
def test_a_users_query_with_a_form_takes_the_fast_path(batch, m, sess, rng):
    loss, xs, feed = _model(batch, rng)
    fast = ClipSumQuery(0.7, 0.5)
    slow = ClipSumQuery(0.7, 0.5, fast=False)
    got = [dp_optimizer.DPGradientDescentOptimizer(
        q, num_microbatches=m, learning_rate=0.1).compute_gradients(loss, xs)
        for q in (fast, slow)]
    assert fast.preprocessed == 0   # the rules' clipped sum, no records
    assert slow.preprocessed > 0    # TF Privacy's path
    per_example = testing.loop_per_example(loss, xs)
    sess.run(tf.compat.v1.global_variables_initializer())
    (g_fast, g_slow), pe = sess.run(
        ([[g for g, _ in gv] for gv in got], per_example), feed)
    want = _reference(pe, batch if m is None else m, 0.7, 0.5)
    for a, s, r in zip(g_fast, g_slow, want):
        np.testing.assert_allclose(a, r, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(s, r, rtol=1e-10, atol=1e-13)


def test_a_subclass_that_processes_records_is_not_taken_fast(sess, rng):
    class Doubling(gaussian_query.GaussianSumQuery):
        def preprocess_record(self, params, record):
            return [2.0 * t for t in super().preprocess_record(params,
                                                               record)]

    q = Doubling(10.0, 0.0)
    assert dp_query.clipped_sum_form_of(q) is None
    assert core.gaussian_sum_params(q) is None
    assert core.gaussian_sum_params(gaussian_query.GaussianSumQuery(
        1.5, 2.0)) is not None
    loss, xs, feed = _model(4, rng)
    gv = dp_optimizer.DPGradientDescentOptimizer(
        q, learning_rate=0.1).compute_gradients(loss, xs)
    per_example = testing.loop_per_example(loss, xs)
    sess.run(tf.compat.v1.global_variables_initializer())
    got, pe = sess.run(([g for g, _ in gv], per_example), feed)
    for a, r in zip(got, _reference(pe, 4, 10.0, 2.0)):
        np.testing.assert_allclose(a, r, rtol=1e-10)


def test_add_noise_seeded_is_one_stateless_draw_split_in_order(sess):
    a = tf.constant(np.zeros((2, 3)))
    b = tf.constant(np.ones(4))
    seed = tf.constant([5, 9], tf.int64)
    na, none, nb = core.add_noise([a, None, b], 0.5, seed)
    assert none is None
    flat = tf.random.stateless_normal([10], seed=seed, stddev=0.5,
                                      dtype=tf.float64)
    got_a, got_b, want = sess.run([na, nb, flat])
    np.testing.assert_array_equal(got_a.ravel(), want[:6])
    np.testing.assert_array_equal(got_b, 1.0 + want[6:])


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("table", [6, 40])
def test_add_noise_adds_indexed_slices_into_the_noise(sess, dtype, stream,
                                                      table):
    """An `IndexedSlices` sum (repeated rows included) comes out dense, its
    rows added into the noise drawn for its dense shape: the same noise a
    dense tensor of that shape gets from the same seed. 5 rows of a table
    of 40 are added into the noise (`TensorScatterAdd`), of 6 densified
    first."""
    rng = np.random.RandomState(0)
    values = rng.randn(5, 3)
    rows = np.array([4, 0, 4, 2, 4])
    # An int64 dense_shape beside the dense b's int32 shape.
    sparse = tf.IndexedSlices(tf.constant(values, dtype),
                              tf.constant(rows, tf.int64),
                              tf.constant([table, 3], tf.int64))
    dense = np.zeros((table, 3))
    np.add.at(dense, rows, values)
    b = tf.constant(np.ones(4), dtype)

    def seed():
        return (noise.NoiseStream("n", seed=3) if stream
                else tf.constant([5, 9], tf.int64))
    noised = core.add_noise([sparse, None, b], 0.5, seed())
    assert (noised[0].op.type == "TensorScatterAdd") == (table == 40)
    zeros = core.add_noise([tf.zeros([table, 3], dtype), None, b * 0], 0.5,
                           seed())
    assert noised[1] is None and zeros[1] is None
    sess.run(tf.compat.v1.global_variables_initializer())
    (got, got_b), (pure, pure_b) = (sess.run([t[0], t[2]])
                                    for t in (noised, zeros))
    assert got.shape == (table, 3)
    tol = 1e-6 if dtype == tf.float32 else 1e-12
    np.testing.assert_allclose(got, dense + pure, rtol=tol, atol=tol)
    np.testing.assert_allclose(got_b, 1.0 + pure_b, rtol=tol, atol=tol)
    assert np.std(pure) > 0.1


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("batch", [1, 7, 32])
@pytest.mark.parametrize("static", [True, False])
def test_dp_optimizer_noises_an_embedding_sum(sess, rng, dtype, batch,
                                              static):
    """`DPOptimizer(seed=4)` on a bag-of-ids model: the step is the loop
    reference's clipped mean plus the stream's first joint draw over the
    table and the dense weight, / B. With a static batch the table's sparse
    sum (few rows) goes into its noise in place (`TensorScatterAdd`); with
    a fed batch its row count is unknown and it is made dense first."""
    vocab, dim, lookups, clip, z = 400, 3, 2, 0.5, 1.3
    ids = tf.compat.v1.placeholder(tf.int32, [batch if static else None,
                                              lookups])
    y = tf.compat.v1.placeholder(tf.int32, [batch if static else None])
    table = tf.Variable(rng.normal(size=(vocab, dim)), dtype=dtype)
    w = tf.Variable(rng.normal(size=(dim, K)), dtype=dtype)
    pooled = tf.reduce_mean(tf.nn.embedding_lookup(table, ids), axis=1)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.matmul(pooled, w))
    opt = optimizers.DPOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), clip, z, seed=4)
    grads = [g for g, _ in opt.compute_gradients(loss, var_list=[table, w])]
    scattered = any(op.type == "TensorScatterAdd"
                    for op in tf.compat.v1.get_default_graph()
                    .get_operations())
    assert scattered == static
    per_example = testing.loop_per_example(loss, [table, w], batch=batch)
    draw = noise.joint_gaussian([[vocab, dim], [dim, K]],
                                tf.constant([4, 1], tf.int64), clip * z, dtype)
    feed = {ids: rng.integers(0, vocab, size=(batch, lookups)),
            y: rng.integers(0, K, size=batch)}
    sess.run(tf.compat.v1.global_variables_initializer())
    got, pe, drawn = sess.run((grads, per_example, draw), feed)
    tol = 2e-5 if dtype == tf.float32 else 1e-10
    for g, r, n in zip(got, _reference(pe, batch, clip, 1.0), drawn):
        np.testing.assert_allclose(g, r + n / batch, rtol=tol, atol=tol)


def test_add_noise_from_a_stream_has_the_std_asked_and_never_repeats(sess):
    a = tf.zeros([200, 100], tf.float64)
    (na,) = core.add_noise([a], 2.5, noise.NoiseStream("n"))
    sess.run(tf.compat.v1.global_variables_initializer())
    first, second = sess.run(na), sess.run(na)
    assert abs(np.std(first) - 2.5) < 0.05
    assert not np.any(first == second)


def test_both_faces_hand_over_their_noise(sess):
    """After `hand_over_noise` the step is the clipped mean without noise
    (sigma = 3 would show), and the returned function gives sigma."""
    faces = [optimizers.DPOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), 2.0, 1.5),
        dp_optimizer.DPGradientDescentGaussianOptimizer(
            2.0, 1.5, learning_rate=0.1)]
    stddevs = [opt.hand_over_noise() for opt in faces]
    w = tf.Variable(np.ones((3, 1)))
    # Example i's gradient is 3 e_i (norm 3), clipped to 2 e_i.
    loss = tf.reduce_sum(tf.matmul(3.0 * tf.constant(np.eye(3)), w), axis=1)
    grads = [opt.compute_gradients(loss, [w])[0][0] for opt in faces]
    sess.run(tf.compat.v1.global_variables_initializer())
    for g, stddev in zip(sess.run(grads), stddevs):
        np.testing.assert_allclose(g.ravel(), np.full(3, 2.0 / 3))
        assert sess.run(stddev(tf.float64)) == pytest.approx(3.0)
    query = dp_optimizer.DPGradientDescentOptimizer(
        ClipSumQuery(1.0, 1.0), learning_rate=0.1)
    assert query.hand_over_noise() is None   # its noise cannot move
