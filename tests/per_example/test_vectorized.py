"""custagg.per_example.vectorized on its own: the chunked pfor, the batch
region, the boundary ops, and both per-example forms against one tf.gradients per
example (custagg.testing.loop_per_example)."""

import collections

import numpy as np
import pytest
import tensorflow as tf

from custagg import testing
from custagg import batch_axis
from custagg.graph import pfor as pfor_lib
from custagg.per_example import vectorized


def ancestors(t):
    """Every op `t` depends on, `t.op` included."""
    seen, queue = set(), collections.deque([t.op])
    while queue:
        op = queue.popleft()
        if op in seen:
            continue
        seen.add(op)
        queue.extend(i.op for i in op.inputs)
        queue.extend(op.control_inputs)
    return seen


def mlp(rng, batch, hidden=3):
    x = tf.compat.v1.placeholder(tf.float64, [batch, 4], name="x")
    w1 = tf.constant(rng.normal(size=(4, hidden)), name="w1")
    w2 = tf.constant(rng.normal(size=(hidden, 2)), name="w2")
    h = tf.tanh(tf.matmul(x, w1))
    loss = tf.reduce_sum(tf.square(tf.matmul(h, w2)), axis=1)
    return x, w1, w2, loss


@pytest.mark.parametrize("n, chunk", [(1, 4), (5, 2), (6, 3), (4, 1), (3, 8)])
def test_chunked_pfor_matches_a_loop(sess, n, chunk):
    n_fed = tf.compat.v1.placeholder(tf.int32, [])

    def loop_fn(i):
        f = tf.cast(i, tf.float64)
        return [f * f * tf.ones([3], tf.float64), tf.reshape(i, [1])]

    static = pfor_lib.chunked_pfor(loop_fn, n, chunk, [tf.float64, tf.int32])
    dynamic = pfor_lib.chunked_pfor(loop_fn, n_fed, chunk,
                                      [tf.float64, tf.int32])
    want_sq = np.repeat((np.arange(n) ** 2)[:, None], 3, 1).astype(float)
    want_i = np.arange(n)[:, None]
    for got in sess.run([static, dynamic], {n_fed: n}):
        np.testing.assert_array_equal(got[0], want_sq)
        np.testing.assert_array_equal(got[1], want_i)


@pytest.mark.parametrize("n, chunk, max_pass_bytes", [
    (11, 2, 3 * 32), (11, 2, None), (7, 3, 0), (9, 4, 1), (2, 1, 2 ** 40)])
def test_passes_that_grow_match_a_loop(sess, n, chunk, max_pass_bytes):
    """Passes after the first take max(chunk, max_pass_bytes // 32) here
    (32 bytes of outputs per iteration): 2 then 3s, all at once, chunk."""
    n_fed = tf.compat.v1.placeholder(tf.int32, [])

    def loop_fn(i):
        f = tf.cast(i, tf.float64)
        return [tf.stack([f, f * f, -f]), tf.reshape(i, [1]) * 3, i + 1]

    dtypes = [tf.float64, tf.int32, tf.int32]
    static = pfor_lib.chunked_pfor(loop_fn, n, chunk, dtypes,
                                     max_pass_bytes=max_pass_bytes)
    dynamic = pfor_lib.chunked_pfor(loop_fn, n_fed, chunk, dtypes,
                                      max_pass_bytes=max_pass_bytes)
    assert static[0].shape.as_list() == [n, 3]
    assert dynamic[0].shape.as_list() == [None, 3]
    i = np.arange(n)
    for got in sess.run([static, dynamic], {n_fed: n}):
        np.testing.assert_array_equal(got[0], np.stack([i, i * i, -i], 1))
        np.testing.assert_array_equal(got[1], 3 * i[:, None])
        np.testing.assert_array_equal(got[2], i + 1)


def test_later_pass_size():
    f64, i32 = tf.float64, tf.int32
    shapes = [tf.TensorShape([3]), tf.TensorShape([1]), tf.TensorShape([])]
    # 3 * 8 + 4 + 4 = 32 bytes per iteration.
    assert pfor_lib.later_pass_size(shapes, [f64, i32, i32], 2, 96) == 3
    assert pfor_lib.later_pass_size(shapes, [f64, i32, i32], 5, 96) == 5
    assert pfor_lib.later_pass_size(shapes, [f64, i32, i32], 2, 0) == 2
    assert pfor_lib.later_pass_size(
        [tf.TensorShape([None, 2])], [f64], 4, 2 ** 30) == 4
    assert pfor_lib.later_pass_size(
        [tf.TensorShape([0])], [f64], 1, 2 ** 40) == 2 ** 31 - 1


def test_output_shapes_come_from_a_trace_that_never_runs(sess):
    x = tf.compat.v1.placeholder(tf.float64, [None, 3])
    n_ops = len(tf.compat.v1.get_default_graph().get_operations())

    def loop_fn(i):
        return [tf.gather(x, i) * 2.0, tf.reshape(i, [1, 1])]

    shapes = pfor_lib.output_shapes(loop_fn)
    assert [s.as_list() for s in shapes] == [[3], [1, 1]]
    assert len(tf.compat.v1.get_default_graph().get_operations()) == n_ops

    def broken(i):
        raise ValueError("not here")

    assert pfor_lib.output_shapes(broken) is None


def test_batch_region_and_boundary(rng):
    x, w1, w2, loss = mlp(rng, 5)
    anc = ancestors(loss)
    region = batch_axis.batch_region(loss, anc)
    assert x.op in region and loss.op in region
    assert w1.op not in region and w2.op not in region
    bounds, why = vectorized.find_boundary(w1, loss, anc, region, 5)
    assert why is None
    assert [(b.op.type, b.batch_inputs) for b in bounds] == [("MatMul", [0])]
    assert bounds[0].op.inputs[0] is x


def test_no_boundary_without_batch_data(rng):
    x = tf.compat.v1.placeholder(tf.float64, [3, 2])
    v = tf.constant(2.0, tf.float64)
    loss = tf.reduce_sum(x, axis=1) + v
    anc = ancestors(loss)
    region = batch_axis.batch_region(loss, anc)
    bounds, why = vectorized.find_boundary(v, loss, anc, region, 3)
    # v meets batch data only at the final Add, whose other input is a
    # batch tensor: that Add is the boundary.
    assert why is None and [b.op.type for b in bounds] == ["AddV2"]
    # A [3] constant holds one value per example: batch data (a constant
    # holding a batch), so v meets it at the Mul.
    loss1 = tf.ones([3], tf.float64) * v
    anc1 = ancestors(loss1)
    bounds, why = vectorized.find_boundary(
        v, loss1, anc1, batch_axis.batch_region(loss1, anc1), 3)
    assert why is None and [b.op.type for b in bounds] == ["Mul"]
    # Tiling a scalar makes B equal rows from no batch data: no source.
    loss2 = tf.tile(tf.reshape(v, [1]), [3])
    anc2 = ancestors(loss2)
    bounds, why = vectorized.find_boundary(
        v, loss2, anc2, batch_axis.batch_region(loss2, anc2), 3)
    assert bounds is None and "without meeting batch data" in why


def test_coupled_batch_has_no_boundary_form(rng):
    x, w1, _, _ = mlp(rng, 4)
    z = tf.matmul(x, w1)
    loss = tf.reduce_sum(z - tf.reduce_mean(z, axis=0), axis=1)
    anc = ancestors(loss)
    bounds, why = vectorized.find_boundary(
        w1, loss, anc, batch_axis.batch_region(loss, anc), 4)
    assert bounds is None and why


@pytest.mark.parametrize("batch, chunk", [(1, 2), (5, 2), (4, 4)])
def test_both_forms_match_the_loop(sess, rng, batch, chunk):
    x, w1, w2, loss = mlp(rng, batch)
    anc = ancestors(loss)
    region = batch_axis.batch_region(loss, anc)
    Group = collections.namedtuple("Group", ["tensor"])
    group = [Group(w1), Group(w2)]
    bounds = [vectorized.find_boundary(g.tensor, loss, anc, region, batch)[0]
              for g in group]
    fast = vectorized.boundary_per_example(loss, group, bounds, batch, chunk)
    slow = vectorized.whole_pass_per_example(
        loss, [w1, w2], [lambda: tf.zeros([4, 3], tf.float64),
                         lambda: tf.zeros([3, 2], tf.float64)], batch, chunk)
    ref = testing.loop_per_example(loss, [w1, w2])
    feed = {x: rng.normal(size=(batch, 4))}
    fast_v, slow_v, ref_v = sess.run([fast, slow, ref], feed)
    for f, s, r in zip(fast_v, slow_v, ref_v):
        assert f.shape == r.shape == s.shape
        assert np.abs(r).max() > 0
        np.testing.assert_allclose(f, r, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(s, r, rtol=1e-10, atol=1e-12)


def test_whole_pass_zeros_where_unconnected(sess, rng):
    x, w1, _, loss = mlp(rng, 3)
    unused = tf.constant(rng.normal(size=(2,)))
    got = vectorized.whole_pass_per_example(
        loss, [w1, unused], [lambda: tf.zeros([4, 3], tf.float64),
                             lambda: tf.zeros([2], tf.float64)], 3, 2)
    g_w1, g_unused = sess.run(got, {x: rng.normal(size=(3, 4))})
    assert g_w1.shape == (3, 4, 3) and np.abs(g_w1).max() > 0
    np.testing.assert_array_equal(g_unused, np.zeros((3, 2)))
