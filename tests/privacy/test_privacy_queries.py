"""custagg.privacy.dp_query and dp_optimizer_vectorized on TF 2.21.

References: per-example gradients from `custagg.testing.loop_per_example`
(one `tf.gradients` per example), averaged per microbatch, then TF
Privacy's documented semantics written out in numpy (clip by global norm,
sum, divide by M; the quantile update of Andrew et al.). Noise is off where
values are compared and measured where it is on. Eager mode runs in a
subprocess (this process has eager execution disabled).
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

from custagg import testing
from custagg.privacy import dp_optimizer
from custagg.privacy import dp_optimizer_vectorized
from custagg.privacy.dp_query import dp_query
from custagg.privacy.dp_query import gaussian_query
from custagg.privacy.dp_query import nested_query
from custagg.privacy.dp_query import no_privacy_query
from custagg.privacy.dp_query import normalized_query
from custagg.privacy.dp_query import quantile_adaptive_clip_sum_query as qa
from custagg.privacy.dp_query import quantile_estimator_query as qe

D, H, K = 7, 6, 5


def _run_records(query, records, global_state=None):
    """The DPQuery protocol over a Python list of records."""
    if global_state is None:
        global_state = query.initial_global_state()
    params = query.derive_sample_params(global_state)
    state = query.initial_sample_state(records[0])
    for r in records:
        state = query.accumulate_record(params, state, r)
    result, new_state, _ = query.get_noised_result(state, global_state)
    return result, new_state


def _np_clip(rows, clip):
    norm = np.sqrt(sum(np.sum(np.square(r)) for r in rows))
    f = min(1.0, clip / norm) if norm > 0 else 1.0
    return [r * f for r in rows], norm


# ------------------------------------------------------------- queries alone

def test_gaussian_nested_normalized_no_privacy_against_numpy(sess, rng):
    recs = [[rng.normal(size=(3,)), rng.normal(size=(2, 2))] for _ in range(5)]
    tf_recs = [[tf.constant(a), tf.constant(b)] for a, b in recs]
    gauss, _ = _run_records(gaussian_query.GaussianSumQuery(1.5, 0.0), tf_recs)
    expect = [sum(_np_clip(r, 1.5)[0][i] for r in recs) for i in range(2)]
    nested = nested_query.NestedSumQuery([
        gaussian_query.GaussianSumQuery(0.5, 0.0),
        normalized_query.NormalizedQuery(
            gaussian_query.GaussianSumQuery(1.0, 0.0), denominator=4.0)])
    nres, _ = _run_records(nested, tf_recs)
    nexp = [sum(_np_clip([r[0]], 0.5)[0][0] for r in recs),
            sum(_np_clip([r[1]], 1.0)[0][0] for r in recs) / 4.0]
    avg, _ = _run_records(no_privacy_query.NoPrivacyAverageQuery(), tf_recs)
    total, _ = _run_records(no_privacy_query.NoPrivacySumQuery(), tf_recs)
    got = sess.run([gauss, nres, avg, total])
    for a, b in zip(got[0], expect):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    for a, b in zip(got[1], nexp):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    for i in range(2):
        np.testing.assert_allclose(got[2][i], np.mean([r[i] for r in recs], 0),
                                   rtol=1e-12)
        np.testing.assert_allclose(got[3][i], np.sum([r[i] for r in recs], 0),
                                   rtol=1e-12)


def test_nested_query_structure_errors_and_metrics():
    q = gaussian_query.GaussianSumQuery(1.0, 0.0)
    with pytest.raises(ValueError):
        _run_records(nested_query.NestedSumQuery([q, q]), [[tf.constant(1.0)]])
    with pytest.raises(TypeError):
        nested_query.NestedSumQuery([no_privacy_query.NoPrivacySumQuery(),
                                     object()])
    adaptive = qa.QuantileAdaptiveClipSumQuery(2.0, 1.0, 0.5, 0.2, 0.0, 10)
    metrics = nested_query.NestedSumQuery(
        {"a": adaptive, "b": [q]}).derive_metrics(
            {"a": adaptive.initial_global_state(), "b": [q.initial_global_state()]})
    assert list(metrics) == ["a/clip"]


@pytest.mark.parametrize("geometric", [False, True])
def test_quantile_estimator_update(sess, geometric):
    """One step: b = fraction of records <= estimate; estimate moves by
    lr * (b - target) (or by the factor exp(-lr (b - target)))."""
    records = [0.5, 1.0, 2.0, 3.0, 4.0]
    est, target, lr = 2.0, 0.8, 0.3
    q = qe.QuantileEstimatorQuery(est, target, lr, below_estimate_stddev=0.0,
                                  expected_num_records=len(records),
                                  geometric_update=geometric)
    new, state = _run_records(q, [tf.constant(r) for r in records])
    b = np.mean([r <= est for r in records])
    want = est * np.exp(-lr * (b - target)) if geometric else est - lr * (b - target)
    got, got_state = sess.run([new, state.current_estimate])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_state, want, rtol=1e-6)
    with pytest.raises(ValueError, match="scalar"):
        qe.NoPrivacyQuantileEstimatorQuery(1.0, 0.5, 1.0).accumulate_record(
            None, None, tf.constant([1.0, 2.0]))
    with pytest.raises(ValueError, match="target_quantile"):
        qe.QuantileEstimatorQuery(1.0, 1.5, 0.1, 0.0, 10)


def test_adaptive_clip_query_alone(sess, rng):
    recs = [[rng.normal(size=(4,)) * s] for s in (0.1, 1.0, 3.0, 10.0)]
    q = qa.QuantileAdaptiveClipSumQuery(
        initial_l2_norm_clip=2.0, noise_multiplier=0.0,
        target_unclipped_quantile=0.5, learning_rate=0.2,
        clipped_count_stddev=0.0, expected_num_records=4)
    res, state = _run_records(q, [[tf.constant(r[0])] for r in recs])
    got, clip, metric = sess.run([res, state.sum_state.l2_norm_clip,
                                  q.derive_metrics(state)["clip"]])
    np.testing.assert_allclose(got[0], sum(_np_clip(r, 2.0)[0][0] for r in recs),
                               rtol=1e-12)
    b = np.mean([_np_clip(r, 2.0)[1] <= 2.0 for r in recs])
    np.testing.assert_allclose(clip, 2.0 * np.exp(-0.2 * (b - 0.5)), rtol=1e-6)
    assert metric == clip


# -------------------------------------------------- optimizers: fast path

def _model(batch, dtype, dynamic, rng):
    x_np = rng.normal(size=(batch, D)).astype(dtype)
    y_np = rng.integers(0, K, size=batch)
    x = tf.compat.v1.placeholder(dtype, [None if dynamic else batch, D])
    y = tf.compat.v1.placeholder(tf.int32, [None if dynamic else batch])
    w1 = tf.Variable(rng.normal(size=(D, H)).astype(dtype), name="w1")
    b1 = tf.Variable(rng.normal(size=(H,)).astype(dtype) * 0.1, name="b1")
    w2 = tf.Variable(rng.normal(size=(H, K)).astype(dtype), name="w2")
    logits = tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                          logits=logits)
    return loss, [w1, b1, w2], {x: x_np, y: y_np}, (x, y, x_np, y_np)


def _microbatch_grads(sess, loss, var_list, feed, inputs, m):
    """Reference `[M, ...]` microbatch mean gradients: loop_per_example on a
    static-batch copy of the loss."""
    x, y, x_np, y_np = inputs
    per_ex = testing.loop_per_example(loss, var_list)
    g = sess.run(per_ex, feed)
    b = x_np.shape[0]
    m = b if m is None else m
    return [a.reshape((m, b // m) + a.shape[1:]).mean(axis=1) for a in g], m


def _no_big_tensors(graph, batch, m=None):
    """No op output shaped like per-example weight gradients `[B, D, H]`
    (custagg may form `[M, D, H]` microbatch sums, M < B, when that is
    cheaper than the Gram form)."""
    for op in graph.get_operations():
        for t in op.outputs:
            s = t.shape
            if (s.rank == 3 and s[1:].as_list() in ([D, H], [H, K]) and
                    s[0] in (None, batch) and s[0] != m):
                return False
    return True


SETTINGS = [(1, None, np.float64, False), (5, None, np.float64, True),
            (32, 8, np.float32, False), (33, 11, np.float64, True),
            (33, None, np.float32, True)]


@pytest.mark.parametrize("batch,m,dtype,dynamic", SETTINGS)
def test_adaptive_clip_optimizer_matches_reference_and_adapts(
        batch, m, dtype, dynamic, sess, rng):
    loss, vs, feed, inputs = _model(batch, dtype, dynamic, rng)
    records = batch if m is None else m
    query = qa.QuantileAdaptiveClipSumQuery(
        initial_l2_norm_clip=0.3, noise_multiplier=0.0,
        target_unclipped_quantile=0.5, learning_rate=0.2,
        clipped_count_stddev=0.0, expected_num_records=records)
    opt = dp_optimizer.DPGradientDescentOptimizer(
        query, num_microbatches=m, learning_rate=0.0)
    gv = opt.compute_gradients(loss, vs)
    assert _no_big_tensors(tf.compat.v1.get_default_graph(), batch, m)
    clip_var = [v for v in opt._state_variables if v.shape.rank == 0]
    sess.run(tf.compat.v1.global_variables_initializer())
    ref, mm = (_microbatch_grads(sess, loss, vs, feed, inputs, m)
               if not dynamic else _dyn_ref(sess, vs, inputs, m))
    clip = 0.3
    for step in range(3):
        grads = sess.run([g for g, _ in gv], feed)
        rows = [[r[i] for r in ref] for i in range(mm)]
        clipped = [_np_clip(r, clip) for r in rows]
        want = [sum(c[0][j] for c in clipped) / mm for j in range(len(vs))]
        for a, b in zip(grads, want):
            np.testing.assert_allclose(a, b, rtol=2e-4 if dtype == np.float32
                                       else 1e-9, atol=1e-6)
        frac = np.mean([c[1] <= clip for c in clipped])
        clip = clip * np.exp(-0.2 * (frac - 0.5))
    state = sess.run(opt._state_variables)
    assert any(np.isclose(s, clip, rtol=1e-5) for s in state if np.ndim(s) == 0)
    assert clip_var


def _dyn_ref(sess, vs, inputs, m):
    """The reference for a dynamic-batch model: rebuild the loss with the
    batch fed as constants (static B), then loop_per_example."""
    x, y, x_np, y_np = inputs
    w1, b1, w2 = vs
    logits = tf.matmul(tf.tanh(tf.matmul(tf.constant(x_np), w1) + b1), w2)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.constant(y_np, tf.int32), logits=logits)
    return _microbatch_grads(sess, loss, vs, None, inputs, m)


@pytest.mark.parametrize("batch,m,dtype,dynamic", SETTINGS)
@pytest.mark.parametrize("layout", ["per_variable", "one_leaf", "normalized"])
def test_nested_per_layer_clipping_matches_reference(
        batch, m, dtype, dynamic, layout, sess, rng):
    loss, vs, feed, inputs = _model(batch, dtype, dynamic, rng)
    g = gaussian_query.GaussianSumQuery
    if layout == "per_variable":
        clips = [0.2, 0.05, 0.3]
        query = nested_query.NestedSumQuery([g(c, 0.0) for c in clips])
        groups, denom = [[0], [1], [2]], 1.0
    elif layout == "one_leaf":
        # A single leaf takes the whole record (TF Privacy's records are
        # the flat gradient list, so leaves are per variable or the whole).
        clips = [0.25]
        query = nested_query.NestedSumQuery(g(0.25, 0.0))
        groups, denom = [[0, 1, 2]], 1.0
    else:
        clips = [0.4]
        query = normalized_query.NormalizedQuery(g(0.4, 0.0), denominator=3.0)
        groups, denom = [[0, 1, 2]], 3.0
    var_list = vs
    opt = dp_optimizer.DPGradientDescentOptimizer(
        query, num_microbatches=m, learning_rate=0.0)
    gv = opt.compute_gradients(loss, var_list)
    assert _no_big_tensors(tf.compat.v1.get_default_graph(), batch, m)
    sess.run(tf.compat.v1.global_variables_initializer())
    grads = sess.run([g_ for g_, _ in gv], feed)
    ref, mm = (_microbatch_grads(sess, loss, vs, feed, inputs, m)
               if not dynamic else _dyn_ref(sess, vs, inputs, m))
    want = [None] * 3
    for grp, c in zip(groups, clips):
        parts = [_np_clip([ref[j][i] for j in grp], c)[0] for i in range(mm)]
        for k, j in enumerate(grp):
            want[j] = sum(p[k] for p in parts) / mm / denom
    for a, b in zip(grads, want):
        np.testing.assert_allclose(a, b, rtol=2e-4 if dtype == np.float32
                                   else 1e-9, atol=1e-6)


def test_fast_path_noise_std(sess, rng):
    """Noise on: the std of the averaged gradient is sigma * C / M per leaf
    (per-layer clip norms), the adaptive query's sigma * C(t) likewise."""
    loss, vs, feed, _ = _model(8, np.float64, False, rng)
    query = nested_query.NestedSumQuery([
        gaussian_query.GaussianSumQuery(1.0, 2.0),
        gaussian_query.GaussianSumQuery(0.5, 0.25),
        qa.QuantileAdaptiveClipSumQuery(3.0, 1.0, 0.5, 0.0, 0.0, 8)])
    opt = dp_optimizer.DPGradientDescentOptimizer(query, num_microbatches=4,
                                                  learning_rate=0.0)
    gv = opt.compute_gradients(loss, vs)
    sess.run(tf.compat.v1.global_variables_initializer())
    draws = [sess.run([g for g, _ in gv], feed) for _ in range(60)]
    for j, expect in enumerate([2.0 / 4, 0.25 / 4, 3.0 / 4]):
        std = np.std(np.stack([d[j] for d in draws]), axis=0).mean()
        assert abs(std / expect - 1) < 0.15, (j, std, expect)


def test_generic_query_still_runs(sess, rng):
    """A query off the fast path (NoPrivacyAverageQuery) gets materialized
    records, one accumulate_record per microbatch."""
    loss, vs, feed, inputs = _model(6, np.float64, False, rng)
    opt = dp_optimizer.DPGradientDescentOptimizer(
        no_privacy_query.NoPrivacyAverageQuery(), num_microbatches=3,
        learning_rate=0.0)
    gv = opt.compute_gradients(loss, vs)
    sess.run(tf.compat.v1.global_variables_initializer())
    grads = sess.run([g for g, _ in gv], feed)
    ref, mm = _microbatch_grads(sess, loss, vs, feed, inputs, 3)
    # NoPrivacyAverageQuery divides by the count (3), then the optimizer by M.
    for a, r in zip(grads, ref):
        np.testing.assert_allclose(a, r.mean(axis=0) / 3, rtol=1e-9)


@pytest.mark.parametrize("cls", [dp_optimizer_vectorized.VectorizedDPSGD,
                                 dp_optimizer_vectorized.VectorizedDPAdam,
                                 dp_optimizer_vectorized.VectorizedDPAdagrad])
@pytest.mark.parametrize("batch,m,dtype,dynamic", SETTINGS[:4])
def test_vectorized_optimizers(cls, batch, m, dtype, dynamic, sess, rng):
    loss, vs, feed, inputs = _model(batch, dtype, dynamic, rng)
    opt = cls(l2_norm_clip=0.5, noise_multiplier=0.0, num_microbatches=m,
              learning_rate=0.1)
    assert isinstance(opt, cls.__mro__[1]) and cls.__name__.startswith(
        "VectorizedDP")
    gv = opt.compute_gradients(loss, vs)
    train = opt.apply_gradients(gv)
    sess.run(tf.compat.v1.global_variables_initializer())
    grads = sess.run([g for g, _ in gv], feed)
    ref, mm = (_microbatch_grads(sess, loss, vs, feed, inputs, m)
               if not dynamic else _dyn_ref(sess, vs, inputs, m))
    rows = [_np_clip([r[i] for r in ref], 0.5)[0] for i in range(mm)]
    for j, a in enumerate(grads):
        np.testing.assert_allclose(a, sum(r[j] for r in rows) / mm,
                                   rtol=2e-4 if dtype == np.float32 else 1e-9,
                                   atol=1e-6)
    sess.run(train, feed)


EAGER = r"""
import numpy as np, tensorflow as tf
from custagg.privacy import dp_optimizer, dp_optimizer_vectorized
from custagg.privacy.dp_query import gaussian_query, nested_query
from custagg.privacy.dp_query import quantile_adaptive_clip_sum_query as qa
assert tf.executing_eagerly()
rng = np.random.default_rng(0)
data = rng.normal(size=(6, 3))
def clip(rows, c):
    n = np.sqrt(sum((r ** 2).sum() for r in rows)); f = min(1.0, c / n)
    return [r * f for r in rows], n
for m in (None, 2, 3):
    v = tf.Variable(rng.normal(size=(3,))); u = tf.Variable(rng.normal(size=(3,)))
    loss = lambda: 0.5 * tf.reduce_sum((data - v) ** 2 + (data - 2 * u) ** 2, axis=1)
    mm = 6 if m is None else m
    per = [(v.numpy() - data), 2 * (2 * u.numpy() - data)]
    mb = [p.reshape(mm, -1, 3).mean(axis=1) for p in per]
    q = qa.QuantileAdaptiveClipSumQuery(1.0, 0.0, 0.5, 0.2, 0.0, mm)
    opt = dp_optimizer.DPGradientDescentOptimizer(q, num_microbatches=m, learning_rate=0.0)
    c = 1.0
    for step in range(2):
        with tf.GradientTape(persistent=True) as tape:
            gv = opt.compute_gradients(loss, [v, u], gradient_tape=tape)
        cl = [clip([mb[0][i], mb[1][i]], c) for i in range(mm)]
        for j in range(2):
            # the clip is float32 state: 1e-6
            np.testing.assert_allclose(gv[j][0].numpy(), sum(x[0][j] for x in cl) / mm, rtol=1e-6)
        frac = np.mean([x[1] <= c for x in cl]); c = c * np.exp(-0.2 * (frac - 0.5))
    np.testing.assert_allclose(opt._global_state.sum_state.l2_norm_clip.numpy(), c, rtol=1e-5)
    nq = nested_query.NestedSumQuery([gaussian_query.GaussianSumQuery(0.5, 0.0),
                                      gaussian_query.GaussianSumQuery(0.1, 0.0)])
    gv = dp_optimizer.DPAdamOptimizer(nq, num_microbatches=m).compute_gradients(loss, [v, u])
    for j, cj in enumerate((0.5, 0.1)):
        want = sum(clip([mb[j][i]], cj)[0][0] for i in range(mm)) / mm
        np.testing.assert_allclose(gv[j][0].numpy(), want, rtol=1e-6)
    vopt = dp_optimizer_vectorized.VectorizedDPSGD(0.7, 0.0, m, learning_rate=1.0)
    gv = vopt.compute_gradients(loss, [v, u])
    cl = [clip([mb[0][i], mb[1][i]], 0.7)[0] for i in range(mm)]
    for j in range(2):
        np.testing.assert_allclose(gv[j][0].numpy(), sum(x[j] for x in cl) / mm, rtol=1e-6)
    vopt.apply_gradients(gv)
print("EAGER OK")
"""


def test_eager_optimizers_and_queries(run_python):
    proc = run_python(EAGER)
    assert "EAGER OK" in proc.stdout, proc.stderr[-4000:]


# ------------------------------------------------------ privacy statement

def test_privacy_statement_figures():
    import math
    import dp_accounting as dpa
    from custagg.privacy import accounting as acc
    n, b, epochs, sigma, delta = 60000, 256, 3, 4.0, 1e-5
    f = acc.dp_sgd_epsilons(n, b, epochs, sigma, delta,
                            used_microbatching=True, max_examples_per_user=3)
    # Microbatching doubles the sensitivity: sigma/2 without it.
    g = acc.dp_sgd_epsilons(n, b, epochs, sigma / 2, delta,
                            used_microbatching=False)
    assert f["example_epsilon"] == g["example_epsilon"]
    # Shuffled: ceil(epochs) Gaussian steps (each example once per epoch).
    rdp = dpa.rdp.RdpAccountant()
    rdp.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(sigma / 2), 3))
    assert math.isclose(f["example_epsilon"], rdp.get_epsilon(delta))
    assert f["example_epsilon_poisson"] < f["example_epsilon"]
    # Group privacy: the user-level epsilon is k times an example-level
    # epsilon at a smaller delta, so more than k times the one at delta.
    assert f["user_epsilon"] > 3 * f["example_epsilon"]
    assert math.isfinite(f["user_epsilon_poisson"])
    one = acc.dp_sgd_epsilons(n, b, epochs, sigma, delta,
                              max_examples_per_user=1)
    assert one["user_epsilon"] == one["example_epsilon"]
    text = acc.compute_dp_sgd_privacy_statement(
        n, b, epochs, sigma, delta, max_examples_per_user=3)
    assert "%12.3f" % f["user_epsilon"] in text
    assert "at most 3 examples per user" in text
    pld = acc.compute_dp_sgd_privacy_statement(n, b, epochs, sigma, delta,
                                               max_examples_per_user=3,
                                               accountant_type="PLD")
    assert "not supported for PLD" in pld
    with pytest.raises(ValueError, match="accountant_type"):
        acc.compute_dp_sgd_privacy_statement(n, b, 1, 1.0, delta,
                                             accountant_type="GDP")
