"""custagg.privacy.dp_query's tree aggregation on TF 2.21, in graph mode.

References, written out in numpy from the definitions: the noise at leaf t
is one node per set bit k of t + 1 (level k covers 2^k steps); the plain
tree's node has variance sigma^2, Honaker's weighted node sigma^2 /
(2 - 2^-k); with noise 0 the queries return the clipped sample sums
(residual) or their running sums (cumulative). Noise variances are measured
over many coordinates at a fixed seed, tolerances at ~6 standard errors.
"""

import numpy as np
import pytest
import tensorflow as tf

from custagg.privacy.dp_query import quantile_estimator_query as qe
from custagg.privacy.dp_query import tree_aggregation as ta
from custagg.privacy.dp_query import tree_aggregation_query as tq


def _levels(t):
    """The tree levels of the nodes covering leaves [0, t]."""
    return [k for k in range(32) if (t + 1) >> k & 1]


def _efficient_var(t, sigma2=1.0):
    return sum(sigma2 / (2.0 - 0.5 ** k) for k in _levels(t))


def _stepper(sess, init, step_fn):
    """TF1 loop: `step_fn(state) -> (output, new_state)` built once over
    placeholders shaped like `init` (dynamic dims: the tree's buffer grows);
    returns `run(n, feeds=None) -> outputs`, the state fed back each time."""
    ph = tf.nest.map_structure(
        lambda t: tf.compat.v1.placeholder(t.dtype, [None] * t.shape.rank),
        init)
    out, new_state = step_fn(ph)
    # An unseeded noise generator's key comes from a checkpointed noise
    # stream (custagg.privacy.noise), whose variables need initializing.
    sess.run(tf.compat.v1.global_variables_initializer())
    state = [sess.run(init)]

    def run(n, feeds=None):
        outs = []
        for _ in range(n):
            feed = dict(zip(tf.nest.flatten(ph), tf.nest.flatten(state[0])))
            feed.update(feeds or {})
            o, state[0] = sess.run((out, new_state), feed)
            outs.append(o)
        return outs
    return run


def _run_aggregator(sess, agg, steps):
    def step(state):
        noise, new = agg.get_cumsum_and_update(state)
        return (noise, ta.get_step_idx(state)), new
    outs = _stepper(sess, agg.init_state(), step)(steps)
    return [o[0] for o in outs], [int(o[1]) for o in outs]


@pytest.mark.parametrize("efficient", [False, True])
def test_constant_nodes_against_numpy(sess, efficient):
    """Every draw = 1: the plain tree's noise counts the nodes, popcount(t+1);
    Honaker's node at level k holds k + 1 (1 + the mean of two children
    holding k) and counts with weight 1 / (2 - 2^-k)."""
    cls = ta.EfficientTreeAggregator if efficient else ta.TreeAggregator
    noises, idx = _run_aggregator(sess, cls(lambda: tf.constant(1.0)), 21)
    assert idx == list(range(21))
    for t, n in enumerate(noises):
        if efficient:
            expect = sum((k + 1) / (2.0 - 0.5 ** k) for k in _levels(t))
        else:
            expect = len(_levels(t))
        assert n == pytest.approx(expect, rel=1e-6), t


@pytest.mark.parametrize("efficient", [False, True])
def test_noise_variance_per_leaf_and_level(sess, efficient):
    """N(0, 1) node noise, 20000 independent coordinates, leaves 0..15:
    the variance at leaf t (nodes at the set bits of t + 1; one node at level
    k for t = 2^k - 1), means 0, and fresh noise after `reset_state`."""
    n = 20000
    cls = ta.EfficientTreeAggregator if efficient else ta.TreeAggregator
    agg = cls(ta.GaussianNoiseGenerator(1.0, tf.TensorSpec([n]), seed=7))

    def step(state):
        noise, new = agg.get_cumsum_and_update(state)
        # The noise at leaf 0 of a tree restarted from here.
        restarted, _ = agg.get_cumsum_and_update(agg.reset_state(new))
        return (noise, restarted), new
    outs = _stepper(sess, agg.init_state(), step)(16)
    noises, restarted = [o[0] for o in outs], outs[-1][1]
    for t, x in enumerate(noises):
        expect = _efficient_var(t) if efficient else len(_levels(t))
        assert np.var(x) == pytest.approx(expect, rel=6 * np.sqrt(2 / n)), t
        assert abs(np.mean(x)) < 6 * np.sqrt(expect / n), t
    # Leaf 0 of the new tree: one fresh level-0 node, not the old tree's.
    assert np.var(restarted) == pytest.approx(1.0, rel=6 * np.sqrt(2 / n))
    assert abs(np.corrcoef(restarted, noises[0])[0, 1]) < 6 / np.sqrt(n)


def test_fixed_seed_repeats_and_seeds_differ(sess):
    spec = tf.TensorSpec([4], tf.float64)
    a = ta.GaussianNoiseGenerator(2.0, spec, seed=3)
    s0 = a.initialize()
    x1, s1 = a.next(s0)
    x2, _ = a.next(s1)
    y1, _ = ta.GaussianNoiseGenerator(2.0, spec, seed=3).next(
        ta.GaussianNoiseGenerator(2.0, spec, seed=3).initialize())
    z1, _ = ta.GaussianNoiseGenerator(2.0, spec, seed=4).next(
        ta.GaussianNoiseGenerator(2.0, spec, seed=4).initialize())
    x1, x2, y1, z1 = sess.run([x1, x2, y1, z1])
    assert x1.dtype == np.float64
    np.testing.assert_array_equal(x1, y1)
    assert not np.allclose(x1, x2) and not np.allclose(x1, z1)


def _clip_rows(rows, clip):
    norm = np.sqrt(sum(np.sum(np.square(r)) for r in rows))
    return [r * min(1.0, clip / norm) if norm > 0 else r for r in rows]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_residual_and_cumulative_sums_noise_off(sess, rng, dtype):
    """noise_multiplier 0: the residual query returns each sample's clipped
    sum, the cumulative query their running sum (numpy), for samples of 1,
    5, 32 and 33 records of two parts."""
    specs = [tf.TensorSpec([3], dtype), tf.TensorSpec([2, 2], dtype)]
    clip = 1.3
    res_q = tq.TreeResidualSumQuery.build_l2_gaussian_query(
        clip, 0.0, specs, noise_seed=1)
    cum_q = tq.TreeCumulativeSumQuery.build_l2_gaussian_query(
        clip, 0.0, specs, noise_seed=1, use_efficient=False)
    samples = [[[rng.normal(size=(3,)).astype(dtype) * 2,
                 rng.normal(size=(2, 2)).astype(dtype)] for _ in range(b)]
               for b in (1, 5, 33)]
    outs = {}
    for name, q in (("res", res_q), ("cum", cum_q)):
        recs_ph = [tf.compat.v1.placeholder(dtype, [None, 3]),
                   tf.compat.v1.placeholder(dtype, [None, 2, 2])]

        def one_round(gs, q=q, recs_ph=recs_ph):
            params = q.derive_sample_params(gs)
            st = tf.foldl(lambda st, r: q.accumulate_record(params, st, r),
                          recs_ph, initializer=q.initial_sample_state(specs))
            result, gs, _ = q.get_noised_result(st, gs)
            return result, gs
        run = _stepper(sess, q.initial_global_state(), one_round)
        outs[name] = [run(1, {recs_ph[0]: np.stack([r[0] for r in recs]),
                              recs_ph[1]: np.stack([r[1] for r in recs])})[0]
                      for recs in samples]
    running = [np.zeros(3), np.zeros((2, 2))]
    for i, recs in enumerate(samples):
        x = [sum(_clip_rows(r, clip)[j] for r in recs) for j in range(2)]
        running = [a + b for a, b in zip(running, x)]
        tol = 1e-5 if dtype == np.float32 else 1e-12
        for j in range(2):
            assert outs["res"][i][j].dtype == dtype
            np.testing.assert_allclose(outs["res"][i][j], x[j], atol=tol)
            np.testing.assert_allclose(outs["cum"][i][j], running[j],
                                       atol=tol)


@pytest.mark.parametrize("efficient", [False, True])
def test_residual_releases_sum_to_cumulative_release(sess, efficient):
    """Same seed, same data: the running sum of the residual query's
    releases equals the cumulative query's release at every call (both
    are s_t + N_t), with the noise on; a release's noise is N_t - N_{t-1}."""
    spec = tf.TensorSpec([2])
    kw = dict(noise_seed=11, use_efficient=efficient)
    res_q = tq.TreeResidualSumQuery.build_l2_gaussian_query(1.0, 2.0, spec,
                                                            **kw)
    cum_q = tq.TreeCumulativeSumQuery.build_l2_gaussian_query(1.0, 2.0, spec,
                                                              **kw)
    xs = [tf.constant([0.3 * t, -0.1]) for t in range(6)]
    res_out, cum_out = [], []
    rs, cs = res_q.initial_global_state(), cum_q.initial_global_state()
    for x in xs:
        r, rs, _ = res_q.get_noised_result(x, rs)
        c, cs, _ = cum_q.get_noised_result(x, cs)
        res_out.append(r)
        cum_out.append(c)
    res_out, cum_out, xs = sess.run([res_out, cum_out, xs])
    np.testing.assert_allclose(np.cumsum(res_out, axis=0), cum_out,
                               atol=1e-4)
    assert np.abs(np.asarray(res_out) - np.asarray(xs)).max() > 0.1


def test_step_built_once_run_with_fed_state(sess):
    """TF1 loop: one step's graph over placeholders for the tree state
    (dynamic buffer length), run 12 times feeding the state back; the
    noise equals the unrolled graph's at the same seed."""
    spec = tf.TensorSpec([3])
    q = tq.TreeResidualSumQuery.build_l2_gaussian_query(1.0, 1.0, spec,
                                                        noise_seed=5)
    init = q.initial_global_state()
    ph = tf.nest.map_structure(
        lambda t: tf.compat.v1.placeholder(
            t.dtype, [None] * t.shape.rank if t.shape.rank else []), init)
    x = tf.compat.v1.placeholder(tf.float32, [3])
    step = q.get_noised_result(x, ph)[:2]
    unrolled, gs = [], init
    for _ in range(12):
        r, gs, _ = q.get_noised_result(tf.zeros([3]), gs)
        unrolled.append(r)
    state, fed = sess.run(init), []
    for _ in range(12):
        feed = dict(zip(tf.nest.flatten(ph), tf.nest.flatten(state)))
        feed[x] = np.zeros(3, np.float32)
        r, state = sess.run(step, feed)
        fed.append(r)
    assert sess.run(ta.get_step_idx(state.tree_state)) == 12
    np.testing.assert_allclose(fed, sess.run(unrolled), atol=1e-6)


def test_tree_quantile_estimator_noise_off_against_numpy(sess, rng):
    """below_estimate_stddev 0: the estimates of Andrew et al.'s update
    (arithmetic and geometric) over 4 rounds of 1, 5, 32 or 33 records,
    against numpy."""
    for geometric in (False, True):
        q = qe.TreeQuantileEstimatorQuery(
            initial_estimate=1.0, target_quantile=0.7, learning_rate=0.4,
            below_estimate_stddev=0.0, expected_num_records=8.0,
            geometric_update=geometric)
        rounds = [rng.uniform(0, 3, size=b).astype(np.float32)
                  for b in (1, 5, 32, 33)]
        recs_ph = tf.compat.v1.placeholder(tf.float32, [None])

        def one_round(gs, q=q, recs_ph=recs_ph):
            params = q.derive_sample_params(gs)
            st = tf.foldl(lambda st, r: q.accumulate_record(params, st, r),
                          recs_ph,
                          initializer=q.initial_sample_state(
                              tf.constant(0.0)))
            est, gs, _ = q.get_noised_result(st, gs)
            return est, gs
        run = _stepper(sess, q.initial_global_state(), one_round)
        outs = [run(1, {recs_ph: recs})[0] for recs in rounds]
        est = 1.0
        for recs, got in zip(rounds, outs):
            frac = np.clip(np.sum((recs <= est) - 0.5) / 8.0 + 0.5, 0, 1)
            step = 0.4 * (frac - 0.7)
            est = est * np.exp(-step) if geometric else est - step
            assert got == pytest.approx(est, rel=1e-5)


def test_tree_quantile_estimator_noise_and_reset(sess):
    """A round's estimate moves by lr * noise / expected_num_records with
    noise of stddev below_estimate_stddev (no signal: half the records
    below); `reset_state` restarts the count's tree and keeps the
    estimate."""
    q = qe.TreeQuantileEstimatorQuery(5.0, 0.5, 1.0, 0.1, 2.0)

    def one_round(gs):
        params = q.derive_sample_params(gs)
        st = q.initial_sample_state(tf.constant(0.0))
        for r in (1.0, 10.0):
            st = q.accumulate_record(params, st, tf.constant(r))
        est, gs, _ = q.get_noised_result(st, gs)
        gs = q.reset_state(est, gs)._replace(current_estimate=tf.constant(
            5.0))
        return (est - 5.0, gs.below_estimate_state.numerator_state), gs
    outs = _stepper(sess, q.initial_global_state(), one_round)(300)
    moves, tree = [o[0] for o in outs], outs[-1][1]
    assert np.std(moves) == pytest.approx(0.05, rel=0.2)
    assert tree.tree_state.level_buffer_idx.tolist() == [0]
    assert tree.previous_tree_noise == 0.0


def test_bad_arguments_name_the_argument():
    spec = tf.TensorSpec([])
    with pytest.raises(ValueError, match="clip_norm.*non-negative"):
        tq.TreeResidualSumQuery.build_l2_gaussian_query(-1.0, 1.0, spec)
    with pytest.raises(ValueError, match="noise_multiplier.*non-negative"):
        tq.TreeCumulativeSumQuery.build_l2_gaussian_query(1.0, -0.5, spec)
    with pytest.raises(TypeError, match="value_generator"):
        ta.TreeAggregator(3.0)
    with pytest.raises(ValueError, match="expected_num_records.*"
                                         "NoPrivacyQuantileEstimatorQuery"):
        qe.TreeQuantileEstimatorQuery(1.0, 0.5, 0.1, 0.1, None)
    with pytest.raises(ValueError, match="noise_std"):
        ta.GaussianNoiseGenerator(-1.0, spec)
