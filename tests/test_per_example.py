"""The per-example front door (`custagg.per_example`) against obvious references.

Per-op rules, one attribute set at a time, are in tests/rules; this file
checks what the front door adds on top of them, each against the loop
reference (`custagg.testing.loop_per_example`) or a numpy oracle:

* softmax regression against the hand-written per-example gradients;
* shared weights (a variable used by two ops, tied embeddings): exact
  per-example sums and exact norms;
* auto's fallback for ops without a rule, and strategy="rules"'s error;
* norms, global and per-x clipping, weighted sums and second moments from
  numpy on the materialized reference, with every strategy, an unconnected
  x included; clip factors that gradients do not flow through;
* a model built with `tf.compat.v1.layers`;
* argument errors.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

# tf.compat.v1.layers needs legacy Keras (the tf-keras package) on TF 2.21.
# TF reads this when tf.compat.v1.layers is first touched, so setting it
# here works unless an earlier test module touched the layers with Keras 3
# (tests/conftest.py sets it before importing TF as well).
if importlib.util.find_spec("tf_keras"):  # TF 2.15 without it: Keras 2
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.core.protobuf import rewriter_config_pb2  # noqa: E402

import custagg  # noqa: E402
from custagg import testing  # noqa: E402

import per_example_reference as ref  # noqa: E402

RTOL = 1e-9
ALL_STRATEGIES = ("rules", "pfor", "loop", "auto")


def _atan2_gradient_reduces_broadcast():
    """False on TF 2.12 (2.15-2.21: True): its Atan2 gradient returns the
    broadcast shape for a broadcast input, so tf.gradients itself fails."""
    with tf.Graph().as_default():
        y, x = tf.ones([2, 3]), tf.ones([3])
        try:
            g = tf.compat.v1.gradients(tf.math.atan2(y, x), [x])[0]
        except ValueError:
            return False
        return g.shape.as_list() == [3]


ATAN2_SKIP = ("TF 2.12's Atan2 gradient does not sum a broadcast input back "
              "to its shape: tf.gradients (the reference) fails on this model")
NEEDS_ATAN2_BROADCAST = pytest.mark.skipif(
    not _atan2_gradient_reduces_broadcast(), reason=ATAN2_SKIP)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SESSION_CONFIG = tf.compat.v1.ConfigProto(
    graph_options=tf.compat.v1.GraphOptions(
        rewrite_options=rewriter_config_pb2.RewriterConfig(
            disable_meta_optimizer=True)))


@pytest.fixture
def graph():
    """A fresh graph for the test (also when tests/conftest.py is absent)."""
    g = tf.Graph()
    with g.as_default():
        yield g


def _session(graph):
    return tf.compat.v1.Session(graph=graph, config=SESSION_CONFIG)


def _var(rng, shape, name=None, dtype=np.float64):
    return tf.compat.v1.Variable(rng.normal(size=shape).astype(dtype),
                                 use_resource=True, name=name)


def _run(sess, fetches, feed=None):
    """`sess.run` over a structure that may hold None (kept as None)."""
    flat = tf.nest.flatten(fetches)
    live = [f for f in flat if f is not None]
    values = iter(sess.run(live, feed))
    return tf.nest.pack_sequence_as(
        fetches, [None if f is None else next(values) for f in flat])


def _check_lists(got, want, label, rtol=RTOL):
    assert len(got) == len(want), label
    for j, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, "%s x%d: expected None" % (label, j)
        else:
            testing.assert_close(g, w, rtol, "%s x%d" % (label, j))


# --------------------------------------------------------------------------
# A hand-written oracle


def _softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_softmax_regression_matches_numpy_oracle(graph):
    rng = np.random.default_rng(0)
    batch, d, c = 5, 4, 3
    x_val = rng.normal(size=(batch, d))
    y_val = np.array([0, 2, 1, 2, 0])
    x = tf.compat.v1.placeholder(tf.float64, [batch, d])
    y = tf.compat.v1.placeholder(tf.int32, [batch])
    w, b = _var(rng, [d, c]), _var(rng, [c])
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.matmul(x, w) + b)
    fetch = {s: custagg.per_example_gradients(loss, [w, b], strategy=s)
             for s in ALL_STRATEGIES}
    fetch["norms"] = custagg.per_example_norms(loss, [w, b], strategy="rules")
    with _session(graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        w_val, b_val = sess.run([w, b])
        got = sess.run(fetch, {x: x_val, y: y_val})
    # d l_i / d logits_i = softmax_i - onehot_i; the weight's is its outer
    # product with x_i.
    delta = _softmax(x_val @ w_val + b_val) - np.eye(c)[y_val]
    want_w = x_val[:, :, None] * delta[:, None, :]
    for s in ALL_STRATEGIES:
        _check_lists(got[s], [want_w, delta], "strategy " + s)
    want_norms = np.sqrt(np.sum(x_val ** 2, 1) * np.sum(delta ** 2, 1) +
                         np.sum(delta ** 2, 1))
    testing.assert_close(got["norms"], want_norms, RTOL, "norms")


# --------------------------------------------------------------------------
# Reductions against numpy on the materialized reference


def _reference_checks(sess, loss, xs, feed, strategies, clip_ph, clips_ph,
                      weights_ph):
    """Builds every front-door quantity per strategy; compares with numpy."""
    ref = testing.loop_per_example(loss, [x for x in xs])
    fetch = {}
    # pfor in chunks of 3 examples: B=4 makes an uneven last chunk.
    chunk = {"pfor_chunk_size": 3}
    for s in strategies:
        fetch[s] = {
            "per_example": custagg.per_example_gradients(loss, xs, s,
                                                         **chunk),
            "norms": custagg.per_example_norms(loss, xs, s, **chunk),
            "clipped": custagg.clipped_gradients(
                loss, xs, clip_ph, s, return_norms=True, **chunk),
            "clipped_per_x": custagg.clipped_gradients(
                loss, xs, clips_ph, s, return_norms=True, **chunk),
            "moments": custagg.gradient_second_moments(loss, xs, s,
                                                       **chunk)}
    weighted = custagg.weighted_gradients(loss, xs, weights_ph)
    ref_val = sess.run(ref, feed)
    connected = [r if np.any(r) else None for r in ref_val]
    live = [r for r in ref_val if r is not None]
    norms = testing.numpy_norms(live)
    clip = 0.6 * float(np.median(norms))
    per_x_norms = [testing.numpy_norms([r]) for r in ref_val]
    clips = [0.6 * float(np.median(n)) + 1e-3 for n in per_x_norms]
    weights = np.linspace(-1.0, 2.0, len(norms))
    feed = dict(feed)
    feed.update({clip_ph: clip, weights_ph: weights})
    feed.update(dict(zip(clips_ph, clips)))
    got = _run(sess, {"strategies": fetch, "weighted": weighted}, feed)

    def masked(values):
        return [v if c is not None else None
                for v, c in zip(values, connected)]

    clipped, _ = testing.numpy_clipped(ref_val, clip)
    clipped_per_x, _ = testing.numpy_clipped(ref_val, clips, per_x=True)
    for s in strategies:
        g = got["strategies"][s]
        _check_lists(g["per_example"], masked(ref_val), s + " per_example")
        testing.assert_close(g["norms"], norms, RTOL, s + " norms")
        _check_lists(g["clipped"][0], masked(clipped), s + " clipped")
        testing.assert_close(g["clipped"][1], norms, RTOL, s + " clip norms")
        _check_lists(g["clipped_per_x"][0], masked(clipped_per_x),
                     s + " clipped per x")
        _check_lists(g["clipped_per_x"][1], per_x_norms,
                     s + " per-x clip norms")
        _check_lists(g["moments"],
                     masked(testing.numpy_second_moments(ref_val)),
                     s + " moments")
    _check_lists(got["weighted"],
                 masked([np.tensordot(weights, r, axes=1) for r in ref_val]),
                 "weighted_gradients")


@NEEDS_ATAN2_BROADCAST
@pytest.mark.parametrize("strategies", [("auto",), ("pfor", "loop")],
                         ids=["auto", "pfor+loop"])
def test_reductions_match_numpy(graph, strategies):
    """A mixed model: rule xs, a pfor x (atan2), an unconnected x."""
    rng = np.random.default_rng(1)
    batch = 4
    x = tf.compat.v1.placeholder(tf.float64, [batch, 5])
    y = tf.compat.v1.placeholder(tf.int32, [batch])
    w1, b1 = _var(rng, [5, 4], "w1"), _var(rng, [4], "b1")
    w2, s = _var(rng, [4, 3], "w2"), _var(rng, [3], "s")
    unused = _var(rng, [2], "unused")
    # Atan2 meets batch data and has no rule: s takes pfor.
    logits = tf.math.atan2(tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2),
                           tf.sin(s) + 2.0)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                          logits=logits)
    xs = [w1, b1, w2, s, unused]
    plan = custagg.plan_per_example(loss, xs)
    assert plan.strategies() == ["rules", "rules", "rules", "pfor", None]
    clip_ph = tf.compat.v1.placeholder(tf.float64, [])
    clips_ph = [tf.compat.v1.placeholder(tf.float64, []) for _ in xs]
    weights_ph = tf.compat.v1.placeholder(tf.float64, [batch])
    feed = {x: rng.normal(size=(batch, 5)), y: [0, 1, 2, 1]}
    with _session(graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        _reference_checks(sess, loss, xs, feed, strategies, clip_ph,
                          clips_ph, weights_ph)


def test_clip_factors_are_constants(graph):
    """Nothing flows back through the clip factors: the gradient of the
    clipped sum w.r.t. the clip norm C (which only enters through the
    factors) is None. Without a stop_gradient it would not be."""
    rng = np.random.default_rng(2)
    x = tf.compat.v1.placeholder(tf.float64, [3, 4])
    w, b = _var(rng, [4, 2]), _var(rng, [2])
    s = _var(rng, [2])
    loss = tf.reduce_sum(tf.sin((tf.matmul(x, w) + b) * tf.sin(s)), axis=1)
    clip = tf.compat.v1.placeholder(tf.float64, [])
    for strategy in ("rules", "pfor"):
        xs = [w, b] if strategy == "rules" else [w, b, s]
        total = tf.add_n([tf.reduce_sum(g) for g in custagg.clipped_gradients(
            loss, xs, clip, strategy=strategy)])
        assert tf.compat.v1.gradients(total, [clip]) == [None], strategy
    per_x = custagg.clipped_gradients(loss, [w, s], [clip, 2.0 * clip])
    total = tf.reduce_sum(per_x[0]) + tf.reduce_sum(per_x[1])
    assert tf.compat.v1.gradients(total, [clip]) == [None]


# --------------------------------------------------------------------------
# Shared weights


def _check_strategies_vs_loop(graph, loss, xs, feed, strategies):
    """Per-example gradients, norms, clipped sums for each strategy (the
    clip norm is set between the smallest and largest example norm)."""
    ref = testing.loop_per_example(loss, xs)
    clip = tf.compat.v1.placeholder(loss.dtype, [])
    fetch = {s: (custagg.per_example_gradients(loss, xs, s),
                 custagg.per_example_norms(loss, xs, s),
                 custagg.clipped_gradients(loss, xs, clip, s))
             for s in strategies}
    with _session(graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        ref_val = sess.run(ref, feed)
        norms = testing.numpy_norms(ref_val)
        clip_val = float(np.mean([norms.min(), norms.max()]))
        feed = dict(feed)
        feed[clip] = clip_val
        got = sess.run(fetch, feed)
    clipped, _ = testing.numpy_clipped(ref_val, clip_val)
    for s in strategies:
        per, got_norms, got_clipped = got[s]
        _check_lists(per, ref_val, s + " per_example")
        testing.assert_close(got_norms, norms, RTOL, s + " norms")
        _check_lists(got_clipped, clipped, s + " clipped")


def test_variable_used_by_two_matmuls(graph):
    rng = np.random.default_rng(3)
    x = tf.compat.v1.placeholder(tf.float64, [3, 4])
    w, b = _var(rng, [4, 4]), _var(rng, [4])
    h = tf.tanh(tf.matmul(x, w) + b)
    loss = tf.reduce_sum(tf.sin(tf.matmul(h, w, transpose_b=True)), axis=1)
    plan = custagg.plan_per_example(loss, [w, b])
    assert plan.strategies() == ["rules", "rules"]
    assert [c.op.type for c in plan.assignments[0].consumers] == [
        "MatMul", "MatMul"]
    _check_strategies_vs_loop(graph, loss, [w, b],
                              {x: rng.normal(size=(3, 4))},
                              ALL_STRATEGIES)


def test_tied_embeddings(graph):
    """The table is looked up (ids repeat) and reused as output projection."""
    rng = np.random.default_rng(4)
    vocab, dim, batch = 6, 3, 4
    ids = tf.compat.v1.placeholder(tf.int32, [batch, 5])
    labels = tf.compat.v1.placeholder(tf.int32, [batch])
    table = _var(rng, [vocab, dim], "table")
    hidden = tf.reduce_mean(tf.nn.embedding_lookup(table, ids), axis=1)
    logits = tf.matmul(tf.tanh(hidden), table, transpose_b=True)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                          logits=logits)
    plan = custagg.plan_per_example(loss, [table])
    assert plan.strategies() == ["rules"]
    assert sorted(c.op.type for c in plan.assignments[0].consumers) == [
        "MatMul", "ResourceGather"]
    id_val = rng.integers(0, vocab, size=(batch, 5))
    id_val[:, 1] = id_val[:, 0]
    _check_strategies_vs_loop(
        graph, loss, [table], {ids: id_val, labels: [0, 5, 3, 3]},
        ALL_STRATEGIES)


def test_embedding_clipped_sum_stays_sparse(graph):
    rng = np.random.default_rng(5)
    ids = tf.compat.v1.placeholder(tf.int32, [3, 4])
    table = _var(rng, [7, 2])
    loss = tf.reduce_sum(tf.sin(tf.nn.embedding_lookup(table, ids)),
                         axis=[1, 2])
    clipped, = custagg.clipped_gradients(loss, [table], 0.5)
    moments, = custagg.gradient_second_moments(loss, [table])
    assert isinstance(clipped, tf.IndexedSlices)
    ref, = testing.loop_per_example(loss, [table])
    id_val = np.array([[1, 1, 1, 2], [0, 6, 6, 0], [3, 4, 5, 3]])
    with _session(graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got, got_moments, ref_val = sess.run([clipped, moments, ref],
                                             {ids: id_val})
    want, _ = testing.numpy_clipped([ref_val], 0.5)
    testing.assert_close(got, want[0], RTOL, "clipped")
    testing.assert_close(got_moments, np.sum(ref_val ** 2, axis=0), RTOL,
                         "moments")


# --------------------------------------------------------------------------
# Fallback for ops without a rule


@pytest.mark.parametrize("op_type", ["MatrixInverse", "Sin"])
def test_batch_free_ops_on_a_parameter_chain_into_rules(graph, op_type):
    """`inv(w)` / `sin(w)` see no batch data: TF's gradient of that op
    carries each example's rule gradient back to w."""
    rng = np.random.default_rng(6)
    x = tf.compat.v1.placeholder(tf.float64, [None, 3])
    init = 3.0 * np.eye(3) + 0.3 * rng.normal(size=(3, 3))
    w = tf.compat.v1.Variable(init, use_resource=True, name="odd_weight")
    b = _var(rng, [3], "b")
    used = tf.linalg.inv(w) if op_type == "MatrixInverse" else tf.sin(w)
    loss = tf.reduce_sum(tf.tanh(tf.matmul(x, used) + b), axis=1)
    plan = custagg.plan_per_example(loss, [w, b], strategy="rules")
    assert plan.strategies() == ["rules", "rules"]
    assert "through " + op_type in str(plan)
    fixed = tf.compat.v1.placeholder_with_default(x, [3, 3])
    static = tf.reduce_sum(tf.tanh(tf.matmul(fixed, used) + b), axis=1)
    ref = testing.loop_per_example(static, [w, b])
    clip = custagg.clipped_gradients(loss, [w, b], 0.5, strategy="rules",
                                     return_norms=True)
    got = custagg.per_example_gradients(loss, [w, b], strategy="rules")
    with _session(graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got_val, (clip_val, norms), ref_val = sess.run(
            [got, clip, ref], {x: rng.normal(size=(3, 3))})
    _check_lists(got_val, ref_val, op_type)
    want, want_norms = testing.numpy_clipped(ref_val, 0.5)
    testing.assert_close(norms, want_norms, RTOL, "norms")
    _check_lists(clip_val, want, op_type + " clipped")


@pytest.mark.parametrize("op_type", ["Atan2", "Pow"])
def test_auto_falls_back_where_no_rule(graph, op_type):
    if op_type == "Atan2" and not _atan2_gradient_reduces_broadcast():
        pytest.skip(ATAN2_SKIP)
    rng = np.random.default_rng(6)
    x = tf.compat.v1.placeholder(tf.float64, [3, 3])
    w = tf.compat.v1.Variable(1.0 + 0.3 * rng.uniform(size=[3]),
                              use_resource=True, name="odd_weight")
    b = _var(rng, [3], "b")
    h = tf.matmul(x, tf.eye(3, dtype=tf.float64)) + b
    used = (tf.math.atan2(h, w) if op_type == "Atan2"
            else tf.pow(tf.abs(h) + 1.0, w))
    loss = tf.reduce_sum(tf.tanh(used), axis=1)
    plan = custagg.plan_per_example(loss, [w, b])
    assert plan.strategies() == ["pfor", "rules"]
    assert op_type in plan.assignments[0].reason
    text = str(plan)
    assert "odd_weight" in text and "pfor" in text and op_type in text
    with pytest.raises(ValueError) as info:
        custagg.per_example_gradients(loss, [w, b], strategy="rules")
    message = str(info.value)
    for part in (op_type, "odd_weight", "'auto'", "'pfor'"):
        assert part in message, message
    _check_strategies_vs_loop(graph, loss, [w, b],
                              {x: rng.normal(size=(3, 3))},
                              ("auto", "pfor"))


def test_rnn_weight_in_a_while_loop_warns_of_the_quadratic_form(graph, caplog):
    rng = np.random.default_rng(9)
    x = tf.compat.v1.placeholder(tf.float64, [4, 3, 2])
    w = tf.compat.v1.Variable(0.5 * rng.normal(size=(2, 2)), use_resource=True,
                              name="cell_w")
    v = _var(rng, [2], "readout")

    def body(t, h):
        # Centred over the batch at every step, examples interact inside
        # the loop: w cannot take the loop rules (certified or not: the
        # loop is not proved apart even inside) nor the O(B) per-example
        # copies, only the whole pass (v: no coupling after its own op,
        # an O(B) form). A coupling after the loop only takes the
        # certified loop rules (tests/per_example/test_loop_rules.py).
        h = tf.tanh(tf.matmul(x[:, t, :] + h, w))
        return t + 1, h - tf.reduce_mean(h, axis=0)

    _, h = tf.compat.v1.while_loop(lambda t, h: t < 3, body,
                                   [0, tf.zeros([4, 2], tf.float64)])
    loss = tf.reduce_sum(h * v, axis=1)
    with caplog.at_level("WARNING", logger="custagg"):
        got = custagg.per_example_gradients(loss, [w, v])
        again = custagg.per_example_norms(loss, [w, v])
    warned = [r.getMessage() for r in caplog.records
              if "B^2" in r.getMessage()]
    # One short line per graph, not one per call.
    assert len(warned) == 1 and "cell_w" in warned[0], warned
    assert "readout" not in warned[0] and len(warned[0]) < 500, warned[0]
    plan = custagg.plan_per_example(loss, [w, v])
    # (v: an O(B) form; which one depends on how far the batch is traced
    # back through the mixing loop; where the walk back from the loss
    # stops at the loop, the rules certified at run time.)
    assert plan.forms()[0] == "whole-pass", str(plan)
    assert plan.forms()[1] in ("rules", "certified", "boundary"), str(plan)
    assert "O(B^2)" in str(plan)
    del again
    ref = testing.loop_per_example(loss, [w, v])
    with _session(graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got_val, ref_val = sess.run([got, ref],
                                    {x: rng.normal(size=(4, 3, 2))})
    _check_lists(got_val, ref_val, "rnn")


# --------------------------------------------------------------------------
# tf.compat.v1.layers


def _layers_model_check():
    """A small CNN from tf.compat.v1.layers: auto takes rules everywhere and
    matches the loop. Returns the plan's strategies."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        rng = np.random.default_rng(7)
        layers = tf.compat.v1.layers
        x = tf.compat.v1.placeholder(tf.float64, [3, 6, 6, 1])
        y = tf.compat.v1.placeholder(tf.int32, [3])
        h = layers.conv2d(x, 2, 3, padding="same", activation=tf.nn.relu)
        h = layers.max_pooling2d(h, 2, 2)
        h = layers.dense(layers.flatten(h), 4, activation=tf.tanh)
        logits = layers.dense(h, 3)
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                              logits=logits)
        xs = tf.compat.v1.trainable_variables()
        plan = custagg.plan_per_example(loss, xs)
        assert plan.strategies() == ["rules"] * 6, str(plan)
        ref = testing.loop_per_example(loss, xs)
        got = custagg.per_example_gradients(loss, xs)
        norms = custagg.per_example_norms(loss, xs)
        feed = {x: rng.normal(size=(3, 6, 6, 1)), y: [0, 1, 2]}
        with _session(graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            ref_val, got_val, norms_val = sess.run([ref, got, norms], feed)
        _check_lists(got_val, ref_val, "layers model")
        testing.assert_close(norms_val, testing.numpy_norms(ref_val), RTOL,
                             "layers model norms")
        return plan.strategies()


def _legacy_layers_available():
    try:
        return callable(getattr(tf.compat.v1.layers, "dense"))
    except (AttributeError, ImportError):
        return False


def test_tf_compat_v1_layers_model():
    """In this process when legacy Keras is active (TF_USE_LEGACY_KERAS=1
    was set before tf.compat.v1.layers was first touched), else in a fresh
    Python that sets it before importing TensorFlow."""
    if _legacy_layers_available():
        _layers_model_check()
        return
    code = textwrap.dedent("""
        import os, sys
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
        sys.path.insert(0, %r)
        import tensorflow as tf
        tf.compat.v1.disable_eager_execution()
        import test_per_example
        test_per_example._layers_model_check()
        print("LAYERS-OK")
    """ % os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                            text=True, env=env, timeout=300)
    assert "LAYERS-OK" in result.stdout, result.stderr[-3000:]


# --------------------------------------------------------------------------
# Errors


def _small_model():
    x = tf.compat.v1.placeholder(tf.float64, [None, 2])
    w = tf.compat.v1.Variable(np.ones((2, 2)), use_resource=True, name="w")
    z = tf.matmul(x, w)
    return x, w, z, tf.reduce_sum(tf.sin(z), axis=1)


FRONT_DOOR = {
    "per_example_gradients": custagg.per_example_gradients,
    "per_example_norms": custagg.per_example_norms,
    "gradient_second_moments": custagg.gradient_second_moments,
    "plan_per_example": custagg.plan_per_example,
    "clipped_gradients": lambda loss, xs, **kw: custagg.clipped_gradients(
        loss, xs, 1.0, **kw),
}


@pytest.mark.parametrize("name", sorted(FRONT_DOOR))
def test_argument_errors(graph, name):
    fn = FRONT_DOOR[name]
    _, w, z, loss = _small_model()
    with pytest.raises(ValueError, match=r"shape \[B\]"):
        fn(z, [w])                                   # rank 2
    with pytest.raises(ValueError, match=r"shape \[B\]"):
        fn(tf.reduce_sum(loss), [w])                 # a scalar
    with pytest.raises(TypeError, match="tf.stack"):
        fn([loss[0], loss[1]], [w])
    with pytest.raises(ValueError, match="unknown strategy 'vmap'") as info:
        fn(loss, [w], strategy="vmap")
    assert "'auto'" in str(info.value) and "'pfor'" in str(info.value)
    other = tf.Graph()
    with other.as_default():
        foreign = [tf.compat.v1.Variable(np.ones(2), use_resource=True),
                   tf.compat.v1.Variable(np.ones(2), use_resource=False),
                   tf.constant([1.0, 2.0])]
    for f in foreign:
        with pytest.raises(ValueError, match="another graph"):
            fn(loss, [w, f])


def test_unconnected_xs_give_none(graph):
    x, w, _, loss = _small_model()
    lonely = tf.compat.v1.Variable(np.ones(3), use_resource=True)
    plan = custagg.plan_per_example(loss, [w, lonely])
    assert plan.strategies() == ["rules", None]
    assert "unconnected" in str(plan)
    per = custagg.per_example_gradients(loss, [lonely, w])
    clipped = custagg.clipped_gradients(loss, [lonely, w], 1.0)
    clipped_per_x = custagg.clipped_gradients(loss, [lonely, w], [1.0, 1.0])
    moments = custagg.gradient_second_moments(loss, [lonely, w])
    assert per[0] is None and clipped[0] is None and moments[0] is None
    assert clipped_per_x[0] is None
    assert per[1] is not None and clipped[1] is not None
    alone = custagg.per_example_norms(loss, [lonely])
    both = custagg.per_example_norms(loss, [lonely, w])
    only_w = custagg.per_example_norms(loss, [w])
    with _session(graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got = sess.run([alone, both, only_w], {x: np.ones((2, 2))})
    np.testing.assert_array_equal(got[0], np.zeros(2))
    np.testing.assert_allclose(got[1], got[2], rtol=1e-12)
    with pytest.raises(ValueError, match="one clip norm per x"):
        custagg.clipped_gradients(loss, [lonely, w], [1.0])


def test_eager_inputs_are_rejected():
    """Eager mode cannot come back once a graph-mode test ran: a fresh Python."""
    code = textwrap.dedent("""
        import numpy as np
        import tensorflow as tf
        import custagg
        eager_loss = tf.constant([1.0, 2.0])
        eager_x = tf.constant([1.0])
        try:
            custagg.per_example_gradients(eager_loss, [eager_x])
        except RuntimeError as e:
            assert "graph mode" in str(e) and "disable_eager_execution" in str(
                e), e
            print("EAGER-MODE-OK")
        with tf.Graph().as_default():
            x = tf.compat.v1.placeholder(tf.float32, [None, 1])
            loss = tf.reduce_sum(x * 2.0, axis=1)
            for args in ((loss, [eager_x]), (eager_loss, [x])):
                try:
                    custagg.per_example_gradients(*args)
                except TypeError as e:
                    assert "eager tensor" in str(e), e
                    print("EAGER-TENSOR-OK")
    """)
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.stdout.count("EAGER-MODE-OK") == 1, result.stderr[-3000:]
    assert result.stdout.count("EAGER-TENSOR-OK") == 2, result.stderr[-3000:]


# --------------------------------------------------------------------------
# The plan is what runs


@NEEDS_ATAN2_BROADCAST
@pytest.mark.parametrize("strategy", ["auto", "pfor", "loop", "rules"])
def test_plan_equals_what_runs(graph, strategy):
    """Each x's per-example gradient is built by the form its plan names:
    rules, rules certified at run time, pfor at the boundary ops (O(B)),
    pfor over the whole pass (O(B^2), here under a batch mean), or the
    loop."""
    rng = np.random.default_rng(11)
    x = tf.compat.v1.placeholder(tf.float64, [None, 3])
    w1, b1 = _var(rng, [3, 4], "w1"), _var(rng, [4], "b1")
    w2, s = _var(rng, [4, 2], "w2"), _var(rng, [2], "s")
    h = tf.tanh(tf.matmul(x, w1) + b1)
    z = tf.math.atan2(tf.matmul(h, w2), tf.exp(s))     # s: no rule, O(B)
    if strategy != "rules":
        z = z - tf.reduce_mean(z, axis=0)              # couples w1, b1, w2, s
    loss = tf.reduce_sum(tf.sin(z), axis=1)
    xs = [w1, b1, w2] + ([s] if strategy != "rules" else [])
    plan = custagg.plan_per_example(loss, xs, strategy=strategy)
    got = custagg.per_example_gradients(loss, xs, strategy=strategy)
    for a, g in zip(plan.assignments, got):
        assert ref.forms_behind(g) == ref.BEHIND.get(a.form, {a.form}), (
            a.name, a.form, ref.forms_behind(g), str(plan))
    # auto: w1, b1 and w2 have rules the static proof cannot clear (the
    # batch mean after them): certified at run time (the check fails here,
    # every step, and the exact form runs); s has no rule.
    expected = {"auto": ["certified"] * 3 + ["whole-pass"],
                "pfor": ["whole-pass"] * 4,
                "loop": ["loop"] * 4, "rules": ["rules"] * 3}[strategy]
    assert plan.forms() == expected, str(plan)
    if strategy == "auto":
        # Uncoupled, s is the boundary form and the rest rules.
        plain = tf.reduce_sum(tf.sin(tf.math.atan2(tf.matmul(h, w2),
                                                   tf.exp(s))), axis=1)
        free = custagg.plan_per_example(plain, xs)
        assert free.forms() == ["rules", "rules", "rules", "boundary"]
        for a, g in zip(free.assignments,
                        custagg.per_example_gradients(plain, xs)):
            assert ref.forms_behind(g) == {a.form}, (a.name, a.form)
        assert "O(B)" in str(free) and "O(B^2)" in str(plan)


def test_dense_on_a_dynamic_batch_keeps_the_outer_product_identities(graph):
    """`[None, D]` inputs: norms and clipped sums of a dense layer use
    ||a|| ||g|| and A^T diag(c) G, never a [B, D, K] tensor (T = 1 stays
    static when B does not)."""
    x = tf.compat.v1.placeholder(tf.float32, [None, 784])
    w = tf.compat.v1.Variable(tf.zeros([784, 10]), use_resource=True)
    b = tf.compat.v1.Variable(tf.zeros([10]), use_resource=True)
    labels = tf.compat.v1.placeholder(tf.float32, [None, 10])
    loss = tf.nn.softmax_cross_entropy_with_logits(
        labels=labels, logits=tf.matmul(x, w) + b)
    before = set(graph.get_operations())
    custagg.per_example_norms(loss, [w, b])
    custagg.clipped_gradients(loss, [w, b], 1.0)
    for op in set(graph.get_operations()) - before:
        for out in op.outputs:
            dims = out.shape.as_list() if out.shape.rank else []
            assert not (len(dims) >= 3 and dims[-2:] == [784, 10]), (
                "materialized per-example gradients: %s %s" % (op.name,
                                                              out.shape))
