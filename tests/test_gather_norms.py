"""Embedding norms: each of GatherRule's norm forms against the loop.

`per_example_norms(strategy="rules")` on an embedding table takes one of
three forms by the graph (custagg/rules/gather.py): the pooled form when the
lookups' output gradient is one row per example broadcast along them (mean
or sum pooling), the masked Gram for at most `_MASKED_GRAM_MAX_LOOKUPS`
lookups per example, the per-example sort above that; the pooled form counts
repeated ids by comparison or, for many lookups, by unique counts. Ids are drawn
from a few rows so repeats within an example are the rule, not the
exception; clipped sums (which use the norms) are checked too.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import testing
from custagg.graph import walks
from custagg.rules import gather

tf1 = tf.compat.v1
VOCAB, DIM = 30, 3


def _model(dtype, lookups, pooling, dynamic_t):
    ids = tf1.placeholder(tf.int32, [None, None if dynamic_t else lookups])
    table = tf.Variable(np.random.default_rng(1).normal(
        size=(VOCAB, DIM)), dtype=dtype)
    w = tf.Variable(np.random.default_rng(2).normal(size=(DIM, 2)),
                    dtype=dtype)
    e = tf.nn.embedding_lookup(table, ids)                     # [B, T, D]
    if pooling == "mean":
        h = tf.reduce_mean(e, axis=1)
    elif pooling == "sum":
        h = tf.reduce_sum(e, axis=1)
    else:   # no pooling: each lookup gets its own output gradient
        h = tf.reduce_sum(tf.tanh(e) * tf.cos(tf.cast(
            tf.range(tf.shape(e)[1]), dtype))[None, :, None], axis=1)
    loss = tf.reduce_sum(tf.square(tf.matmul(h, w)), axis=1)  # [B]
    return ids, loss, [table, w]


_SHAPES = [(1, False), (5, False), (32, False), (33, False), (140, False),
           (7, True)]


@pytest.mark.parametrize("pooling", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype, lookups, dynamic_t", [
    (tf.float64,) + shape for shape in _SHAPES] + [
    (tf.float32, 33, False), (tf.float32, 7, True)])
def test_norms_match_loop(dtype, pooling, lookups, dynamic_t):
    rtol = 1e-9 if dtype == tf.float64 else 1e-4
    with tf.Graph().as_default():
        ids, loss, xs = _model(dtype, lookups, pooling, dynamic_t)
        norms = custagg.per_example_norms(loss, xs, strategy="rules")
        clipped = custagg.clipped_gradients(loss, xs, 0.5, strategy="rules")
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            for batch in (1, 4, 32, 33):
                # The loop reference needs a static B: the fed one.
                reference = testing.loop_per_example(
                    tf.reshape(loss, [batch]), xs)
                rng = np.random.default_rng(batch + lookups)
                feed = {ids: rng.choice([0, 3, 7, 29], (batch, lookups))}
                got, clip, per_example = sess.run(
                    [norms, clipped, reference], feed)
                per_example = [testing.to_numpy(p) for p in per_example]
                testing.assert_close(got, testing.numpy_norms(per_example),
                                     rtol, "norms B=%d" % batch)
                sums, _ = testing.numpy_clipped(per_example, 0.5)
                for g, want in zip(clip, sums):
                    testing.assert_close(testing.to_numpy(g), want, rtol,
                                         "clipped B=%d" % batch)


def test_pooled_form_is_recognized_only_for_a_broadcast_row():
    """The pooled form reads no rows: only a broadcast along T qualifies."""
    with tf.Graph().as_default():
        for pooling, expected in (("mean", True), ("sum", True),
                                  ("none", False)):
            ids, loss, xs = _model(tf.float64, 5, pooling, False)
            e = [op for op in loss.graph.get_operations()
                 if op.type == "ResourceGather"][-1].outputs[0]
            grad, = tf1.gradients(loss, e)
            assert (gather._broadcast_row(grad) is not None) is expected, \
                pooling


@pytest.mark.parametrize("pooling", ["mean", "sum"])
@pytest.mark.parametrize("lookups, dynamic_t", [(5, False), (140, False),
                                                (7, True)])
def test_pooled_clipped_sums_of_an_empty_batch(pooling, lookups, dynamic_t):
    """B=0 (a Poisson-sampled batch can be empty): the pooled form's norms
    are `[0]` and its clipped sums zero, through TF's tile of u (mean and
    sum pooling) whose batch multiple the weighted sum recomputes."""
    with tf.Graph().as_default():
        ids, loss, xs = _model(tf.float64, lookups, pooling, dynamic_t)
        clipped, norms = custagg.clipped_gradients(
            loss, xs, 0.5, strategy="rules", return_norms=True)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            got, n = sess.run([clipped, norms],
                              {ids: np.zeros([0, lookups], np.int32)})
    assert n.shape == (0,)
    for g, x in zip(got, xs):
        dense = testing.to_numpy(g)
        assert dense.shape == tuple(x.shape.as_list())
        assert not dense.any()


@pytest.mark.parametrize("pooling", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [tf.float64, tf.float32])
@pytest.mark.parametrize("static_batch, batch", [
    (True, 1), (True, 4), (True, 32), (True, 33), (False, 4), (False, 33),
    (True, 0)])
def test_pooled_weighted_sum_skips_tfs_spread_of_the_rows(static_batch, batch,
                                                          dtype, pooling):
    """Mean or sum pooling: the clipped sum's `[B*T, D]` values come from
    the per-example row u_b scaled, then spread: TF's own spread of u (the
    gradient pass's `[B, T, D]`: a Tile where every shape is static, else a
    BroadcastTo) and a `[B, T, D]` product are not run; the values are
    the loop reference's (B=0: zeros)."""
    pool = {"mean": tf.reduce_mean, "sum": tf.reduce_sum}[pooling]
    with tf.Graph().as_default():
        ids = tf1.placeholder(tf.int32, [batch if static_batch else None, 5])
        table = tf.Variable(np.random.default_rng(1).normal(
            size=(VOCAB, DIM)), dtype=dtype)
        h = pool(tf.nn.embedding_lookup(table, ids), axis=1)
        loss = tf.reduce_sum(tf.square(h), axis=1)                 # [B]
        clipped = custagg.clipped_gradients(loss, [table], 0.5,
                                            strategy="rules")
        behind = walks.upstream([clipped[0].values], control=True)
        spreads = [op.name for op in behind
                   if op.type in ("Tile", "BroadcastTo")]
        pooled_grad = "/gradients/%s_grad/" % h.op.name
        assert any(pooled_grad in op.name for op in behind)
        assert spreads and not any(pooled_grad in name
                                   for name in spreads), spreads
        reference = testing.loop_per_example(tf.reshape(loss, [batch]),
                                             [table]) if batch else []
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            feed = {ids: np.random.default_rng(3).choice([0, 3, 7], (batch,
                                                                     5))}
            got, per_example = sess.run([clipped, reference], feed)
    if not batch:
        assert not testing.to_numpy(got[0]).any()
        return
    want, _ = testing.numpy_clipped([testing.to_numpy(per_example[0])], 0.5)
    testing.assert_close(testing.to_numpy(got[0]), want[0],
                         1e-9 if dtype == tf.float64 else 1e-4, "clipped sum")
