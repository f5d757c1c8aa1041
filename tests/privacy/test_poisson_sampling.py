"""`custagg.privacy.sampling`: Poisson-sampled batches (tf.data and numpy),
their sizes against Binomial(n, q), empty batches through the DP
optimizers (the update is the noise alone), and per-example gradients on
Poisson batches against the loop reference."""

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

import custagg
from custagg import testing
from custagg.privacy import dp_optimizer
from custagg.privacy import dp_optimizer_vectorized
from custagg.privacy import sampling
from custagg.privacy.dp_query import gaussian_query

N, Q, STEPS = 60, 0.1, 400


def _tf_batches(dataset, q, seed, start_step=0, num_steps=STEPS, **kwargs):
    ds = dataset.apply(sampling.poisson_batches(q, seed=seed,
                                                start_step=start_step,
                                                num_steps=num_steps, **kwargs))
    it = tf.compat.v1.data.make_one_shot_iterator(ds).get_next()
    out = []
    with tf.compat.v1.Session() as sess:
        try:
            while True:
                out.append(sess.run(it))
        except tf.errors.OutOfRangeError:
            pass
    return out


def _binomial_fit(sizes, n, q):
    """Chi-square p-value of batch sizes against Binomial(n, q), tails
    pooled so every bin expects at least 5."""
    sizes = np.asarray(sizes)
    pmf = scipy.stats.binom.pmf(np.arange(n + 1), n, q) * len(sizes)
    lo = int(np.argmax(np.cumsum(pmf) >= 5))
    hi = n - int(np.argmax(np.cumsum(pmf[::-1]) >= 5))
    edges = list(range(lo + 1, hi))
    observed = np.bincount(np.clip(sizes, lo, hi), minlength=n + 1)
    obs = [observed[:lo + 1].sum()] + [observed[k] for k in edges] + [
        observed[hi:].sum()]
    exp = [pmf[:lo + 1].sum()] + [pmf[k] for k in edges] + [pmf[hi:].sum()]
    return scipy.stats.chisquare(obs, np.array(exp) * sum(obs) / sum(exp))[1]


def test_tf_data_batch_sizes_are_binomial():
    x = np.arange(N, dtype=np.float64)[:, None] * np.ones([1, 2])
    batches = _tf_batches(tf.data.Dataset.from_tensor_slices(x), Q, seed=3)
    assert len(batches) == STEPS
    sizes = [len(b) for b in batches]
    assert _binomial_fit(sizes, N, Q) > 1e-3
    # Each example about q of the steps, and batches keep dataset order.
    counts = np.bincount(np.concatenate([b[:, 0] for b in batches]).astype(
        int), minlength=N)
    assert abs(counts.mean() / STEPS - Q) < 5 * np.sqrt(Q * (1 - Q) /
                                                         (STEPS * N))
    assert all(np.all(np.diff(b[:, 0]) > 0) for b in batches if len(b) > 1)


def test_numpy_sampler_batch_sizes_are_binomial():
    sampler = sampling.PoissonSampler(N, Q, seed=5)
    sizes = [len(sampler.indices(t)) for t in range(STEPS)]
    assert _binomial_fit(sizes, N, Q) > 1e-3
    # Sizes vary, as Poisson sampling's do.
    assert len(set(sizes)) > 5


def test_empty_batches_are_emitted_and_resume_continues():
    x = {"x": np.arange(5, dtype=np.float32)[:, None],
         "y": np.arange(5, dtype=np.int64)}
    ds = tf.data.Dataset.from_tensor_slices(x)
    a = _tf_batches(ds, 0.1, seed=1, num_steps=30)
    assert len(a) == 30
    empty = [b for b in a if len(b["y"]) == 0]
    assert empty and empty[0]["x"].shape == (0, 1)
    b = _tf_batches(ds, 0.1, seed=1, start_step=10, num_steps=20)
    for u, v in zip(a[10:], b):
        np.testing.assert_array_equal(u["y"], v["y"])
    c = _tf_batches(ds, 0.1, seed=2, num_steps=30)
    assert any(len(u["y"]) != len(v["y"]) or not np.array_equal(u["y"], v["y"])
               for u, v in zip(a, c))
    sampler = sampling.PoissonSampler(5, 0.1, seed=1)
    got = list(sampler.batches([x["x"], x["y"]], start_step=3, num_steps=4))
    assert len(got) == 4
    for t, (bx, by) in enumerate(got):
        np.testing.assert_array_equal(by, sampler.indices(3 + t))
        assert bx.shape == (len(by), 1)


def test_q_one_takes_everything_and_unseeded_runs_differ():
    s = sampling.PoissonSampler(7, 1.0)
    np.testing.assert_array_equal(s.indices(0), np.arange(7))
    a = sampling.PoissonSampler(1000, 0.5)
    b = sampling.PoissonSampler(1000, 0.5)
    assert not np.array_equal(a.indices(0), b.indices(0))


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5, float("nan"), "0.1", True])
def test_bad_q_names_the_argument(q):
    with pytest.raises(ValueError, match="`sampling_probability`"):
        sampling.poisson_batches(q)
    with pytest.raises(ValueError, match="`sampling_probability`"):
        sampling.PoissonSampler(10, q)


def test_bad_other_arguments():
    with pytest.raises(ValueError, match="`n`"):
        sampling.PoissonSampler(0, 0.1)
    with pytest.raises(TypeError, match="`seed`"):
        sampling.PoissonSampler(5, 0.1, seed=1.5)
    with pytest.raises(ValueError, match="`start_step`"):
        sampling.poisson_batches(0.1, start_step=-1)
    with pytest.raises(ValueError, match="rows"):
        list(sampling.PoissonSampler(5, 0.1).batches([np.zeros(4)]))


# --------------------------------------------------------------------------
# Empty batches through the DP optimizers.

D, K = 3, 2
GD = tf.compat.v1.train.GradientDescentOptimizer


class _RecordByRecordQuery(gaussian_query.GaussianSumQuery):
    """The Gaussian query without a clipped-sum form: TF Privacy's record
    path (`core.accumulated_step`)."""

    def clipped_sum_form(self):
        return None


OPTIMIZERS = {
    "custagg.DPOptimizer": lambda: custagg.DPOptimizer(GD(0.5), 1.0, 1.1),
    "DPGradientDescentGaussianOptimizer":
        lambda: dp_optimizer.DPGradientDescentGaussianOptimizer(
            1.0, 1.1, learning_rate=0.5),
    "VectorizedDPSGD": lambda: dp_optimizer_vectorized.VectorizedDPSGD(
        1.0, 1.1, learning_rate=0.5),
    "record path": lambda: dp_optimizer.DPGradientDescentOptimizer(
        _RecordByRecordQuery(1.0, 1.1), learning_rate=0.5),
    "group_ids": None,
}


def _model(dtype=tf.float64):
    x = tf.compat.v1.placeholder(dtype, [None, D])
    y = tf.compat.v1.placeholder(tf.int64, [None])
    w = tf.compat.v1.get_variable("w", [D, K], dtype)
    b = tf.compat.v1.get_variable("b", [K], dtype,
                                  initializer=tf.compat.v1.zeros_initializer())
    h = tf.compat.v1.layers.dense(x, 4, activation=tf.nn.tanh, name="h")
    logits = tf.matmul(x, w) + b + tf.reduce_sum(h) * 0.0
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                          logits=logits)
    return x, y, [w, b], loss


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_empty_batch_update_is_the_noise_alone(name):
    x, y, variables, loss = _model()
    feed = {x: np.zeros([0, D]), y: np.zeros([0], np.int64)}
    if name == "group_ids":
        users = tf.compat.v1.placeholder(tf.int64, [None])
        opt = custagg.DPOptimizer(GD(0.5), 1.0, 1.1, group_ids=users)
        feed[users] = np.zeros([0], np.int64)
    else:
        opt = OPTIMIZERS[name]()
    gv = opt.compute_gradients(loss, var_list=variables)
    grads = [g for g, _ in gv]
    train = opt.apply_gradients(gv)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        draws = []
        for _ in range(30):
            before = sess.run(variables)
            g, _ = sess.run([grads, train], feed)
            after = sess.run(variables)
            for v0, v1, gi in zip(before, after, g):
                np.testing.assert_allclose(v1 - v0, -0.5 * gi, rtol=1e-12,
                                           atol=1e-14)
            draws.append(np.concatenate([gi.ravel() for gi in g]))
    draws = np.stack(draws)
    # Noise alone, divided by 1: N(0, (1.1 * 1.0)^2) per coordinate.
    assert np.isfinite(draws).all()
    n = draws.size
    assert abs(draws.mean()) < 5 * 1.1 / np.sqrt(n)
    assert abs(draws.std() - 1.1) < 5 * 1.1 / np.sqrt(2 * n)


def test_empty_batch_is_exactly_the_seeded_noise():
    x, y, variables, loss = _model()
    opt = custagg.DPOptimizer(GD(0.5), 1.0, 1.1, seed=4)
    grads = [g for g, _ in opt.compute_gradients(loss, var_list=variables)]
    ref = tf.random.stateless_normal([D * K + K], seed=[4, 1], stddev=1.1,
                                     dtype=tf.float64)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got = sess.run(grads, {x: np.zeros([0, D]), y: np.zeros([0])})
        want = sess.run(ref)
    np.testing.assert_allclose(np.concatenate([g.ravel() for g in got]), want,
                               rtol=1e-12)


def test_per_example_gradients_on_poisson_batches_match_the_loop(rng):
    n = 12     # sizes 0, 1 (B = 1), 2, 3, 5 over the 15 steps of seed 11
    xs = rng.normal(size=(n, D))
    ys = rng.integers(0, K, size=n)
    sampler = sampling.PoissonSampler(n, 0.15, seed=11)
    x, y, variables, loss = _model()
    got = custagg.per_example_gradients(loss, variables)
    got = [tf.convert_to_tensor(g) for g in got]
    sizes = set()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        values = sess.run(variables)
        for bx, by in sampler.batches([xs, ys], num_steps=15):
            sizes.add(len(by))
            out = sess.run(got, {x: bx, y: by})
            if len(by) == 0:
                assert [o.shape for o in out] == [(0, D, K), (0, K)]
                continue
            ref = _loop_reference(bx, by, values)
            testing.assert_allclose_list(out, ref, rtol=1e-10)
    assert {0, 1} <= sizes and len(sizes) > 3


def _loop_reference(bx, by, values):
    """One tf.gradients per example, in a graph of the batch's static size."""
    with tf.Graph().as_default():
        x = tf.constant(bx)
        w = tf.constant(values[0])
        b = tf.constant(values[1])
        logits = tf.matmul(x, w) + b
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.constant(by), logits=logits)
        ref = testing.loop_per_example(loss, [w, b])
        with tf.compat.v1.Session() as sess:
            return sess.run(ref)


def test_a_batch_over_max_batch_size_is_an_error_not_a_drop():
    ds = tf.data.Dataset.from_tensor_slices(np.arange(10))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="max_batch_size=3"):
        _tf_batches(ds, 1.0, seed=0, num_steps=1, max_batch_size=3)
    with pytest.raises(ValueError, match="`max_batch_size`"):
        sampling.poisson_batches(0.5, max_batch_size=0)


def test_unseeded_pipeline_key_is_in_no_graph_def(monkeypatch):
    """`poisson_batches(q)` without a seed: the key is drawn in the
    pipeline when its iterator starts, so the GraphDef (what a checkpoint's
    `.meta` and `graph.pbtxt` hold) carries no constant it could be read
    from. Entropy from `os.urandom`, pinned here, must not reach the graph
    (it did: the key was a `tf.constant`)."""
    pinned = (1 << 61) + 12345
    monkeypatch.setattr(sampling.os, "urandom",
                        lambda n: pinned.to_bytes(8, "little")[:n])
    x = np.arange(N, dtype=np.float32)
    with tf.Graph().as_default() as graph:
        ds = tf.data.Dataset.from_tensor_slices(x).apply(
            sampling.poisson_batches(0.5, num_steps=3))
        first = tf.compat.v1.data.make_one_shot_iterator(ds).get_next()
        second = tf.compat.v1.data.make_one_shot_iterator(ds).get_next()
        text = str(graph.as_graph_def())
        with tf.compat.v1.Session() as sess:
            a = [sess.run(first) for _ in range(3)]
            b = [sess.run(second) for _ in range(3)]
    assert str(pinned) not in text
    assert "RandomUniformInt" in text
    for batch in a + b:
        assert set(batch) <= set(x) and np.all(np.diff(batch) > 0)
    # Two iterators, two keys: the batches differ (60 examples at q = 0.5).
    assert any(not np.array_equal(u, v) for u, v in zip(a, b))


def test_unseeded_pipeline_batch_sizes_are_binomial():
    x = np.arange(N, dtype=np.float32)
    with tf.Graph().as_default():
        batches = _tf_batches(tf.data.Dataset.from_tensor_slices(x), Q, None)
    assert _binomial_fit([len(b) for b in batches], N, Q) > 1e-3
