"""User-level (group) DP: `group_ids` against the obvious reference.

The reference: each example's gradient from its own `tf.compat.v1.gradients`
(`custagg.testing.loop_per_example`), summed per user in numpy, each user's
sum clipped once, the clipped sums added. `clipped_gradients(...,
group_ids=g)` and `per_example_norms(..., group_ids=g)` must give that
(users in order of first appearance) for a dense MLP, a CNN and an
embedding model (IndexedSlices), float64, every graph with a dynamic batch,
B = 1, 5, 32, 33, ids of any values (negative, large int64, int32), groups of
unequal sizes with singletons and one user holding the whole batch. The DP
optimizers (custagg's, TF Privacy's named classes, the vectorized ones, the
per-layer fast path and the generic query path) with zero noise must give
`(1/U) sum_u clip(G_u / n_u)` (each user's mean gradient clipped, TF
Privacy's microbatch record), and reduce to the M = B and M < B steps for
singleton and equal consecutive groups. Then the errors, the graph (no
`[B, D, K]` for a dense layer), and the user-level ε against dp-accounting.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import testing
from custagg.privacy import accounting
from custagg.privacy import dp_optimizer
from custagg.privacy import dp_optimizer_vectorized
from custagg.privacy.dp_query import gaussian_query
from custagg.privacy.dp_query import nested_query
from custagg.privacy.dp_query import no_privacy_query

MAX_B = 33
RTOL = 1e-9


def _id_patterns(rng):
    """(label, ids) per batch size: singletons, one user for the whole batch,
    unequal groups in any order, ids of any values."""
    big = np.int64(2) ** 40
    return {
        1: [("one user", np.array([7]))],
        5: [("unequal", np.array([3, 3, 10, 3, -2])),
            ("all one user", np.array([4, 4, 4, 4, 4])),
            ("singletons", np.array([9, 1, 5, 0, 2]))],
        32: [("pairs", np.arange(32) // 2 * -3)],
        MAX_B: [("random", np.concatenate([
            [big + 5], rng.choice([big, -1, 17, 3], MAX_B - 2), [99]]))],
    }


# --------------------------------------------------------------------------
# Models: dynamic batch, float64; each returns (loss, xs, feed(rng, b)).


def _mlp(rng, d=6, k=5):
    x = tf.compat.v1.placeholder(tf.float64, [None, d])
    y = tf.compat.v1.placeholder(tf.int32, [None])
    w1 = tf.Variable(rng.normal(size=[d, k]), name="w1")
    b1 = tf.Variable(rng.normal(size=[k]) * 0.1, name="b1")
    w2 = tf.Variable(rng.normal(size=[k, 3]), name="w2")
    h = tf.nn.relu(tf.matmul(x, w1) + b1)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.matmul(h, w2))
    return loss, [w1, b1, w2], lambda r, b: {x: r.normal(size=[b, d]),
                                             y: r.integers(0, 3, b)}


def _cnn(rng):
    x = tf.compat.v1.placeholder(tf.float64, [None, 6, 6, 2])
    y = tf.compat.v1.placeholder(tf.int32, [None])
    f = tf.Variable(rng.normal(size=[3, 3, 2, 4]) * 0.5, name="filter")
    c = tf.Variable(rng.normal(size=[4]) * 0.1, name="conv_bias")
    w = tf.Variable(rng.normal(size=[2 * 2 * 4, 3]) * 0.3, name="dense")
    h = tf.nn.relu(tf.nn.bias_add(
        tf.nn.conv2d(x, f, strides=2, padding="VALID"), c))       # [B,2,2,4]
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.matmul(tf.reshape(h, [-1, 16]), w))
    return loss, [f, c, w], lambda r, b: {x: r.normal(size=[b, 6, 6, 2]),
                                          y: r.integers(0, 3, b)}


def _embedding(rng, vocab=7, dim=4, t=3):
    ids = tf.compat.v1.placeholder(tf.int32, [None, t])
    y = tf.compat.v1.placeholder(tf.int32, [None])
    table = tf.Variable(rng.normal(size=[vocab, dim]), name="table")
    w = tf.Variable(rng.normal(size=[dim, 3]), name="w")
    e = tf.reduce_mean(tf.nn.embedding_lookup(table, ids), axis=1)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.matmul(tf.tanh(e), w))
    # Few ids: repeats within an example and across a user's examples.
    return loss, [table, w], lambda r, b: {ids: r.integers(0, 4, [b, t]),
                                           y: r.integers(0, 3, b)}


MODELS = {"mlp": _mlp, "cnn": _cnn, "embedding": _embedding}


# --------------------------------------------------------------------------
# The reference, in numpy.


def _user_sums(per_example, ids):
    """Per x, `[U, ...]`: each user's summed gradient, users in order of
    first appearance."""
    users = list(dict.fromkeys(ids.tolist()))
    return [np.stack([g[ids == u].sum(axis=0) for u in users])
            for g in per_example]


def _reference_rows(sess, rows, feed, b):
    """The loop reference's first b rows, stacked per x: `[b, *x]`."""
    got = sess.run(rows[:b], feed)
    return [np.stack([r[j] for r in got]) for j in range(len(got[0]))]


def _dense(v):
    return testing.to_numpy(v)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_clipped_gradients_match_loop_reference(model):
    rng = np.random.default_rng(sum(map(ord, model)))
    graph = tf.Graph()
    with graph.as_default():
        loss, xs, feed_fn = MODELS[model](rng)
        group_ids = tf.compat.v1.placeholder(tf.int64, [None])
        clip = tf.compat.v1.placeholder(tf.float64, [])
        norms = custagg.per_example_norms(loss, xs, group_ids=group_ids)
        clipped, clip_norms = custagg.clipped_gradients(
            loss, xs, clip, return_norms=True, group_ids=group_ids)
        clipped = [tf.convert_to_tensor(g) for g in clipped]
        rows = testing.loop_per_example(loss, xs, MAX_B, rows=True)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            checked_clipping = False
            for b, patterns in sorted(_id_patterns(rng).items()):
                for label, ids in patterns:
                    feed = feed_fn(rng, b)
                    feed[group_ids] = ids
                    per_example = _reference_rows(sess, rows, feed, b)
                    sums = _user_sums(per_example, ids)
                    ref_norms = testing.numpy_norms(sums)
                    name = "%s B=%d %s" % (model, b, label)
                    testing.assert_close(sess.run(norms, feed), ref_norms,
                                         RTOL, name + " norms")
                    # The median norm: about half the users clipped.
                    feed[clip] = float(np.median(ref_norms)) * 0.999
                    ref_sums, ref_norms2 = testing.numpy_clipped(sums,
                                                                 feed[clip])
                    got, got_norms = sess.run([clipped, clip_norms], feed)
                    testing.assert_close(got_norms, ref_norms2, RTOL,
                                         name + " clip norms")
                    for j, s in enumerate(ref_sums):
                        testing.assert_close(got[j], s, RTOL,
                                             "%s clipped[%d]" % (name, j))
                    checked_clipping |= bool((ref_norms > feed[clip]).any())
            assert checked_clipping


def test_per_variable_clips_int32_ids_and_gram_choices():
    """Per-x clip norms; int32 ids; a [None, 3, D] sequence dense layer
    (several rows per example) where D K is small, so the dynamic run-time
    choice (masked Gram vs per-example [B, D, K] summed) takes both
    branches as B grows."""
    rng = np.random.default_rng(11)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float64, [None, 3, 2])
        w = tf.Variable(rng.normal(size=[2, 3]), name="w")
        v = tf.Variable(rng.normal(size=[3]), name="v")
        z = tf.tanh(tf.einsum("btd,dk->btk", x, w))
        loss = tf.reduce_sum(z * v, axis=[1, 2]) ** 2
        g = tf.compat.v1.placeholder(tf.int32, [None])
        clips = [0.3, 0.2]
        clipped, norms = custagg.clipped_gradients(
            loss, [w, v], clips, return_norms=True, group_ids=g)
        rows = testing.loop_per_example(loss, [w, v], 12, rows=True)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            # B T^2 against D K = 6: B = 1 takes the Gram, B = 12 the full.
            for b, ids in ((1, np.array([5], np.int32)),
                           (12, rng.integers(-3, 3, 12).astype(np.int32))):
                feed = {x: rng.normal(size=[b, 3, 2]), g: ids}
                sums = _user_sums(_reference_rows(sess, rows, feed, b), ids)
                ref_sums, ref_norms = testing.numpy_clipped(sums, clips,
                                                            per_x=True)
                got, got_norms = sess.run([clipped, norms], feed)
                for j in range(2):
                    testing.assert_close(got_norms[j], ref_norms[j], RTOL,
                                         "B=%d norms[%d]" % (b, j))
                    testing.assert_close(got[j], ref_sums[j], RTOL,
                                         "B=%d clipped[%d]" % (b, j))


def test_shared_weight_and_weight_decay_cross_terms():
    """A weight used by two MatMuls plus an L2 penalty on it: the user
    norms come from the cross terms (SegmentedOuter inner products and the
    scalar chain)."""
    rng = np.random.default_rng(12)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float64, [None, 4])
        w = tf.Variable(rng.normal(size=[4, 4]) * 0.5, name="w")
        h = tf.tanh(tf.matmul(tf.tanh(tf.matmul(x, w)), w))
        loss = tf.reduce_sum(h ** 2, axis=1) + 0.1 * tf.nn.l2_loss(w)
        g = tf.compat.v1.placeholder(tf.int64, [None])
        norms = custagg.per_example_norms(loss, [w], strategy="rules",
                                          group_ids=g)
        clipped = custagg.clipped_gradients(loss, [w], 0.5, strategy="rules",
                                            group_ids=g)
        rows = testing.loop_per_example(loss, [w], 5, rows=True)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            ids = np.array([2, 8, 2, 2, 8])
            feed = {x: rng.normal(size=[5, 4]), g: ids}
            sums = _user_sums(_reference_rows(sess, rows, feed, 5), ids)
            ref_sums, ref_norms = testing.numpy_clipped(sums, 0.5)
            got_norms, got = sess.run([norms, clipped], feed)
            testing.assert_close(got_norms, ref_norms, RTOL, "norms")
            testing.assert_close(got[0], ref_sums[0], RTOL, "clipped")


def test_dense_user_norms_do_not_materialize(graph):
    """A [B, 784] x [784, 512] layer: no [B, 784, 512] or [U, 784, 512]
    tensor with a static B (the masked Gram is chosen in the graph), and
    none outside the run-time branch with a dynamic B."""
    for batch in (256, None):
        x = tf.compat.v1.placeholder(tf.float32, [batch, 784])
        w = tf.Variable(tf.zeros([784, 512]))
        loss = tf.reduce_sum(tf.tanh(tf.matmul(x, w)), axis=1)
        g = tf.compat.v1.placeholder(tf.int64, [batch])
        custagg.clipped_gradients(loss, [w], 1.0, group_ids=g)
    for op in graph.get_operations():
        if "cond" in op.name:
            continue
        for t in op.outputs:
            if t.shape.rank == 3 and t.shape.as_list()[1:] == [784, 512]:
                raise AssertionError("materialized: %s %s" % (op.name,
                                                              t.shape))


# --------------------------------------------------------------------------
# The DP optimizers (noise 0).


def _optimizer_cases(clip, lr, group_ids, num_vars):
    g = gaussian_query.GaussianSumQuery
    return {
        "custagg.DPOptimizer": lambda: custagg.DPOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(lr), clip, 0.0,
            group_ids=group_ids),
        "DPGradientDescentGaussianOptimizer": lambda: (
            dp_optimizer.DPGradientDescentGaussianOptimizer(
                clip, 0.0, learning_rate=lr, group_ids=group_ids)),
        "VectorizedDPSGD": lambda: dp_optimizer_vectorized.VectorizedDPSGD(
            clip, 0.0, learning_rate=lr, group_ids=group_ids),
        "NestedSumQuery (one clip per variable)": lambda: (
            dp_optimizer.DPGradientDescentOptimizer(
                nested_query.NestedSumQuery([g(clip, 0.0)] * num_vars),
                learning_rate=lr, group_ids=group_ids)),
    }


def _mean_reference(per_example, ids, clip, per_x=False):
    """`(1/U) sum_u clip(G_u / n_u)`."""
    users = list(dict.fromkeys(ids.tolist()))
    counts = np.array([(ids == u).sum() for u in users], np.float64)
    sums = _user_sums(per_example, ids)
    means = [s / counts.reshape([-1] + [1] * (s.ndim - 1)) for s in sums]
    clipped, norms = testing.numpy_clipped(means, clip, per_x=per_x)
    return [c / len(users) for c in clipped], norms


def test_dp_optimizers_step_is_clipped_user_means():
    rng = np.random.default_rng(21)
    graph = tf.Graph()
    with graph.as_default():
        loss, xs, feed_fn = _embedding(rng)
        group_ids = tf.compat.v1.placeholder(tf.int64, [None])
        clip, lr = 0.25, 0.5
        grads = {}
        for name, make in _optimizer_cases(clip, lr, group_ids,
                                                  len(xs)).items():
            opt = make()
            grads[name] = [tf.convert_to_tensor(g) for g, _ in
                           opt.compute_gradients(loss, var_list=xs)]
        rows = testing.loop_per_example(loss, xs, 13, rows=True)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for b, ids in ((1, np.array([3])),
                           (5, np.array([3, 3, 10, 3, -2])),
                           (13, rng.integers(0, 4, 13))):
                feed = feed_fn(rng, b)
                feed[group_ids] = ids
                per_example = _reference_rows(sess, rows, feed, b)
                got = sess.run(grads, feed)
                for name, values in got.items():
                    per_x = name.startswith("Nested")
                    ref, norms = _mean_reference(
                        per_example, ids, [clip] * len(xs) if per_x else clip,
                        per_x)
                    if b > 1:
                        assert (np.concatenate([np.ravel(n) for n in norms])
                                > clip).any()
                    for j, r in enumerate(ref):
                        testing.assert_close(values[j], r, RTOL,
                                             "%s B=%d [%d]" % (name, b, j))


def test_generic_query_path_averages_user_means():
    """A query off the fast path (NoPrivacySumQuery: records accumulated
    one by one in a while loop): `(1/U) sum_u G_u / n_u`, unclipped."""
    rng = np.random.default_rng(22)
    graph = tf.Graph()
    with graph.as_default():
        loss, xs, feed_fn = _mlp(rng)
        group_ids = tf.compat.v1.placeholder(tf.int64, [None])
        opt = dp_optimizer.DPGradientDescentOptimizer(
            no_privacy_query.NoPrivacySumQuery(), learning_rate=0.1,
            group_ids=group_ids)
        grads = [g for g, _ in opt.compute_gradients(loss, var_list=xs)]
        rows = testing.loop_per_example(loss, xs, 5, rows=True)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            ids = np.array([4, 1, 4, 4, 0])
            feed = feed_fn(rng, 5)
            feed[group_ids] = ids
            ref, _ = _mean_reference(_reference_rows(sess, rows, feed, 5),
                                     ids, 1e300)
            got = sess.run(grads, feed)
            for j, r in enumerate(ref):
                testing.assert_close(got[j], r, RTOL, "grad[%d]" % j)


def test_singletons_and_equal_groups_are_the_microbatch_steps():
    """group_ids = arange(B) is the M = B step; b // 3 is num_microbatches
    = B / 3 (TF Privacy's consecutive microbatches), on the CNN."""
    rng = np.random.default_rng(23)
    graph = tf.Graph()
    with graph.as_default():
        loss, xs, feed_fn = _cnn(rng)
        group_ids = tf.compat.v1.placeholder(tf.int32, [None])
        clip, batch = 0.3, 12

        def step(**kwargs):
            opt = dp_optimizer.DPGradientDescentGaussianOptimizer(
                clip, 0.0, learning_rate=1.0, **kwargs)
            return [g for g, _ in opt.compute_gradients(loss, var_list=xs)]
        users, plain = step(group_ids=group_ids), step()
        micro = step(num_microbatches=4)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = feed_fn(rng, batch)
            feed[group_ids] = np.arange(batch)
            for a, b in zip(*sess.run([users, plain], feed)):
                testing.assert_close(a, b, 1e-12, "singletons")
            feed[group_ids] = np.arange(batch) // 3 * 7 - 5
            for a, b in zip(*sess.run([users, micro], feed)):
                testing.assert_close(a, b, 1e-12, "equal groups")


def test_noise_is_calibrated_per_user():
    """sigma = noise_multiplier * C on the sum, divided by U: the std of
    the step (all-zero gradients: x = 0) is sigma / U."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float64, [None, 50])
        w = tf.Variable(tf.zeros([50, 40], tf.float64))
        loss = tf.reduce_sum(tf.matmul(x, w), axis=1)
        g = tf.compat.v1.placeholder(tf.int64, [None])
        opt = custagg.DPOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(1.0), 2.0, 1.5,
            group_ids=g, seed=3)
        grad = opt.compute_gradients(loss, var_list=[w])[0][0]
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            value = sess.run(grad, {x: np.zeros([6, 50]),
                                    g: [1, 1, 1, 2, 2, 3]})
    std = float(np.std(value))
    assert abs(std - 1.5 * 2.0 / 3) < 0.1 * (1.5 * 2.0 / 3), std


# --------------------------------------------------------------------------
# Errors.


def test_bad_group_ids_raise_clear_errors():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float64, [None, 3])
        w = tf.Variable(tf.ones([3, 2], tf.float64))
        loss = tf.reduce_sum(tf.matmul(x, w), axis=1)
        static_loss = tf.reduce_sum(tf.matmul(tf.ones([4, 3], tf.float64),
                                              w), axis=1)
        fn = custagg.clipped_gradients
        with pytest.raises(TypeError, match="group_ids must be an integer"):
            fn(loss, [w], 1.0, group_ids=tf.compat.v1.placeholder(
                tf.float32, [None]))
        with pytest.raises(ValueError, match=r"group_ids must have shape \[B\]"):
            fn(loss, [w], 1.0, group_ids=tf.compat.v1.placeholder(
                tf.int64, [None, 2]))
        with pytest.raises(ValueError, match="group_ids has 3 entries but "
                                             "per_example_loss has 4"):
            fn(static_loss, [w], 1.0, group_ids=tf.constant([1, 2, 3]))
        with pytest.raises(ValueError, match="num_microbatches or group_ids"):
            fn(loss, [w], 1.0, num_microbatches=2,
               group_ids=tf.compat.v1.placeholder(tf.int64, [None]))
        with pytest.raises(ValueError, match="num_microbatches or group_ids"):
            custagg.per_example_norms(loss, [w], num_microbatches=2,
                                      group_ids=tf.constant([1, 2]))
        with pytest.raises(ValueError, match="num_microbatches or group_ids"):
            dp_optimizer.DPGradientDescentGaussianOptimizer(
                1.0, 1.0, 2, learning_rate=0.1,
                group_ids=tf.compat.v1.placeholder(tf.int64, [None]))
        with pytest.raises(TypeError, match="group_ids must be a .B. integer "
                                            "tensor"):
            custagg.DPOptimizer(
                tf.compat.v1.train.GradientDescentOptimizer(0.1), 1.0, 1.0,
                group_ids=[0, 1, 2])
        with pytest.raises(TypeError, match="integer tensor"):
            dp_optimizer_vectorized.VectorizedDPSGD(
                1.0, 1.0, learning_rate=0.1,
                group_ids=tf.compat.v1.placeholder(tf.float64, [None]))
        # Run time: the length, and a rank-2 feed of an unshaped placeholder.
        dyn = tf.compat.v1.placeholder(tf.int64, [None])
        unshaped = tf.compat.v1.placeholder(tf.int64)
        by_length = fn(loss, [w], 1.0, group_ids=dyn)
        by_rank = custagg.per_example_norms(loss, [w], group_ids=unshaped)
        opt = dp_optimizer.DPGradientDescentGaussianOptimizer(
            1.0, 0.0, learning_rate=0.1, group_ids=dyn)
        step = opt.minimize(loss, var_list=[w])
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.ones([4, 3])}
            for fetch in (by_length, step):
                with pytest.raises(tf.errors.InvalidArgumentError,
                                   match="one id per example"):
                    sess.run(fetch, {**feed, dyn: [1, 2, 3]})
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"group_ids must have shape \[B\]"):
                sess.run(by_rank, {**feed, unshaped: [[1, 2], [3, 4]]})
            # The same graphs accept good feeds.
            sess.run([by_length, by_rank, step],
                     {**feed, dyn: [1, 2, 1, 9], unshaped: [0, 0, 0, 0]})


# --------------------------------------------------------------------------
# ε: the statement's user-level figures against dp-accounting directly.


@pytest.mark.parametrize("accountant", [
    "RDP", pytest.param("PLD", marks=pytest.mark.slow)])   # PLD: ~15 s
def test_user_level_statement_matches_dp_accounting(accountant):
    dpa = pytest.importorskip("dp_accounting")
    users, per_batch, epochs, sigma, delta = 1000, 100, 3.5, 1.1, 1e-6
    q = per_batch / users

    def direct(event, count):
        acc = (dpa.rdp.RdpAccountant() if accountant == "RDP"
               else dpa.pld.PLDAccountant())
        acc.compose(dpa.SelfComposedDpEvent(event=event, count=count))
        return acc.get_epsilon(delta)
    gaussian = dpa.GaussianDpEvent(sigma)
    expected_shuffled = direct(gaussian, math.ceil(epochs))
    expected_poisson = direct(
        dpa.PoissonSampledDpEvent(sampling_probability=q, event=gaussian),
        math.ceil(epochs / q))
    figures = accounting.dp_sgd_epsilons(
        60000, 600, epochs, sigma, delta, accountant_type=accountant,
        number_of_users=users, users_per_batch=per_batch)
    assert figures["user_clipping_epsilon"] == pytest.approx(
        expected_shuffled, rel=1e-12)
    assert figures["user_clipping_epsilon_poisson"] == pytest.approx(
        expected_poisson, rel=1e-12)
    assert expected_poisson < expected_shuffled
    text = custagg.privacy.compute_dp_sgd_privacy_statement(
        60000, 600, epochs, sigma, delta, accountant_type=accountant,
        number_of_users=users, users_per_batch=per_batch)
    assert "user-level clipping" in text
    assert "%.3f" % expected_shuffled in text
    assert "%.3f" % expected_poisson in text
    assert "users, not examples, are sampled" in " ".join(text.split())
    # Without the new arguments the statement is TF Privacy's.
    plain = custagg.privacy.compute_dp_sgd_privacy_statement(
        60000, 600, epochs, sigma, delta, accountant_type=accountant)
    assert "user-level clipping" not in plain
    assert text.startswith(plain.split("\n\n")[0])


def test_user_level_statement_argument_errors():
    fn = custagg.privacy.compute_dp_sgd_privacy_statement
    with pytest.raises(ValueError, match="needs both number_of_users"):
        fn(1000, 10, 1, 1.0, 1e-5, number_of_users=100)
    with pytest.raises(ValueError, match="users_per_batch must be"):
        fn(1000, 10, 1, 1.0, 1e-5, number_of_users=100, users_per_batch=200)
    with pytest.raises(ValueError, match="number_of_users must be"):
        fn(1000, 10, 1, 1.0, 1e-5, number_of_users=0, users_per_batch=1)


# --------------------------------------------------------------------------
# Every rule's user form, through the model zoo (slow: ~1-2 min).


def _zoo_cases():
    from benchmarks import zoo_models as zoo  # pylint: disable=g-import-not-at-top
    return [pytest.param(name, tf.float32 if name in zoo.FLOAT32_ONLY
                         else tf.float64, id=name) for name in zoo.ZOO]


@pytest.mark.slow
@pytest.mark.parametrize("name, dtype", _zoo_cases())
def test_zoo_user_norms_and_clipped_sums(name, dtype):
    from benchmarks import zoo_models as zoo  # pylint: disable=g-import-not-at-top
    if not zoo.has_keras_layers():
        pytest.skip("tf.compat.v1.layers / Keras 2 layers need tf-keras")
    rtol = RTOL if dtype == tf.float64 else 1e-4
    rng = np.random.default_rng(sum(map(ord, name)) + 9)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(3)
        model = zoo.ZOO[name](dtype, rng)
        loss, xs = model.loss, model.xs
        group_ids = tf.compat.v1.placeholder(tf.int64, [None])
        clip = tf.compat.v1.placeholder(loss.dtype, [])
        clipped, norms = custagg.clipped_gradients(
            loss, xs, clip, return_norms=True, group_ids=group_ids)
        clipped = [None if g is None else tf.convert_to_tensor(g)
                   for g in clipped]
        refs = {b: testing.loop_per_example(loss, xs, b) for b in (1, 5, 12)}
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for b, ids in ((1, np.array([4])),
                           (5, np.array([3, 3, 10, 3, -2])),
                           (12, rng.integers(0, 4, 12))):
                feed = model.feed(rng, b)
                feed[group_ids] = ids
                feed[clip] = 1.0
                label = "%s B=%d" % (name, b)
                # Reference and result in one run: dropout draws anew in
                # each.
                ref, got_norms = sess.run([refs[b], norms], feed)
                ref_norms = testing.numpy_norms(_user_sums(ref, ids))
                testing.assert_close(got_norms, ref_norms, rtol,
                                     label + " norms")
                feed[clip] = float(np.median(ref_norms))
                ref, got, got_norms = sess.run(
                    [refs[b], [g for g in clipped if g is not None], norms],
                    feed)
                ref_sums, ref_norms = testing.numpy_clipped(
                    _user_sums(ref, ids), feed[clip])
                testing.assert_close(got_norms, ref_norms, rtol,
                                     label + " clip norms")
                present = [j for j, g in enumerate(clipped) if g is not None]
                scale = max(float(np.max(np.abs(s))) for s in ref_sums)
                for j, g in zip(present, got):
                    testing.assert_close(g, ref_sums[j], rtol,
                                         "%s clipped[%d]" % (label, j), scale)


@pytest.mark.slow
def test_benchmark_runs_and_reports_ratios():
    pytest.importorskip("sklearn")
    from benchmarks import dp_step  # pylint: disable=g-import-not-at-top
    rows = dp_step.user_level_clipping(batch=16, repeats=1, models=("mlp",),
                                       log=lambda *_: None)
    assert [r["kind"] for r in rows] == list(dp_step.KINDS)
    assert rows[0]["time_ratio"] == 1.0 and rows[0]["memory_ratio"] == 1.0
    assert all(r["peak_mb"] > 0 for r in rows)
    ids = dp_step.user_ids(256, 64, 1)
    assert len(set(ids.tolist())) == 64 and len(ids) == 256
