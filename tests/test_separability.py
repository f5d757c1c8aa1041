"""Batch-coupling detection (`custagg.batch_axis`) through the front door.

Rules are exact only when example b's loss sees the rule op's output only
through row b. Models that mix examples downstream of a rule op (batch
statistics, reductions, reshapes or softmax across axis 0) must make "auto"
fall back (and still match the loop) and make strategy="rules" raise an
error that says why; ordinary models (MLP, CNN with max-pool and flatten,
LayerNorm, embedding with mean-pool, attention) must not be flagged.

Each model is a `build(rng)` returning `(xs, inputs, loss_fn)`; the loss is
built twice on the same variables: dynamic B for the plan, static B for the
values against `custagg.testing.loop_per_example`.
"""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.core.protobuf import rewriter_config_pb2  # noqa: E402

import custagg  # noqa: E402
from custagg import batch_axis  # noqa: E402
from custagg import graph as graph_lib  # noqa: E402
from custagg import testing  # noqa: E402

BATCH = 4
RTOL = 1e-9
SESSION_CONFIG = tf.compat.v1.ConfigProto(
    graph_options=tf.compat.v1.GraphOptions(
        rewrite_options=rewriter_config_pb2.RewriterConfig(
            disable_meta_optimizer=True)))


def _var(rng, shape, name=None):
    return tf.compat.v1.Variable(rng.normal(size=shape), use_resource=True,
                                 name=name)


def _labels(classes):
    """An int32 `[B]` labels input in `[0, classes)`."""
    return ("labels", classes)


def _head(z):
    return tf.reduce_sum(tf.sin(z) + 0.25 * tf.square(z),
                         axis=list(range(1, z.shape.rank)))


# --------------------------------------------------------------------------
# Models that mix examples after a rule op


def nn_batch_norm(rng):
    """Batch statistics (tf.nn.moments over axis 0) in training mode."""
    w1, w2 = _var(rng, [3, 4], "w1"), _var(rng, [4, 2], "w2")
    gamma, beta = _var(rng, [4], "gamma"), _var(rng, [4], "beta")

    def loss(x):
        h = tf.matmul(x, w1)
        mean, variance = tf.nn.moments(h, axes=[0])
        h = tf.nn.batch_normalization(h, mean, variance, beta, gamma, 1e-3)
        return _head(tf.matmul(tf.tanh(h), w2))
    # w2 sits after the normalization: its examples stay apart.
    return [w1, w2], [(3,)], loss, ["pfor", "rules"]


def layers_batch_norm(rng):
    """tf.compat.v1.layers.batch_normalization(training=True) after a conv."""
    f = _var(rng, [2, 2, 1, 2], "filter")
    bn_scope = "bn_%d" % rng.integers(1 << 30)

    def loss(x):
        h = tf.nn.conv2d(x, f, 1, "SAME")
        h = tf.compat.v1.layers.batch_normalization(
            h, training=True, name=bn_scope, reuse=tf.compat.v1.AUTO_REUSE)
        return _head(h)
    return [f], [(3, 3, 1)], loss, ["pfor"]


def batch_mean_in_loss(rng):
    """Each loss adds the batch mean of a layer's output."""
    w = _var(rng, [3, 2], "w")

    def loss(x):
        z = tf.matmul(x, w)
        return _head(z) + tf.reduce_mean(tf.square(z))
    return [w], [(3,)], loss, ["pfor"]


def reshape_across_batch(rng):
    """A reshape that does not keep axis 0 as the batch."""
    w = _var(rng, [3, 2], "w")

    def loss(x):
        z = tf.reshape(tf.sin(tf.matmul(x, w)), [2, -1])     # [2, B]
        return _head(tf.reshape(tf.tanh(z) * z, [-1, 2]))
    return [w], [(3,)], loss, ["pfor"]


def softmax_over_batch(rng):
    """A softmax across examples (a contrastive-style normalization)."""
    w = _var(rng, [3, 2], "w")

    def loss(x):
        return _head(tf.nn.softmax(tf.matmul(x, w), axis=0))
    return [w], [(3,)], loss, ["pfor"]


COUPLED = [nn_batch_norm, layers_batch_norm, batch_mean_in_loss,
           reshape_across_batch, softmax_over_batch]


# --------------------------------------------------------------------------
# Ordinary models: no coupling


def mlp(rng):
    w1, b1 = _var(rng, [5, 4]), _var(rng, [4])
    w2, b2 = _var(rng, [4, 3]), _var(rng, [3])

    def loss(x, y):
        h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w1), b1))
        return tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=tf.matmul(h, w2) + b2)
    return [w1, b1, w2, b2], [(5,), _labels(3)], loss, ["rules"] * 4


def cnn(flatten):
    """Conv, max-pool, flatten ([-1, D] or [tf.shape(h)[0], -1]), dense."""

    def build(rng):
        f, fb = _var(rng, [3, 3, 1, 2]), _var(rng, [2])
        w, b = _var(rng, [8, 3]), _var(rng, [3])

        def loss(x, y):
            h = tf.nn.relu(tf.nn.conv2d(x, f, 1, "SAME") + fb)
            h = tf.nn.max_pool2d(h, 2, 2, "VALID")                # [B,2,2,2]
            if flatten == "static":
                h = tf.reshape(h, [-1, 8])
            else:
                h = tf.reshape(h, [tf.shape(h)[0], -1])
                h = tf.ensure_shape(h, [None, 8])
            return tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=tf.matmul(h, w) + b)
        return [f, fb, w, b], [(4, 4, 1), _labels(3)], loss, ["rules"] * 4

    build.__name__ = "cnn_flatten_" + flatten
    return build


def layer_norm_model(rng):
    gamma, beta = _var(rng, [4]), _var(rng, [4])
    w = _var(rng, [4, 2])

    def loss(x):
        mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
        h = (x - mean) * tf.math.rsqrt(variance + 1e-3) * gamma + beta
        return _head(tf.einsum("btd,dk->btk", h, w))
    return [gamma, beta, w], [(3, 4)], loss, ["rules"] * 3


def embedding_mean_pool(rng):
    table, w = _var(rng, [6, 3]), _var(rng, [3, 2])

    def loss(ids, y):
        h = tf.reduce_mean(tf.nn.embedding_lookup(table, ids), axis=1)
        return tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=tf.matmul(h, w))
    return [table, w], [("ids", 6, 5), _labels(2)], loss, ["rules"] * 2


def attention(rng):
    """One self-attention block: fused qkv split, scores, softmax over keys."""
    d = 4
    w_qkv, w_out = _var(rng, [d, 3 * d]), _var(rng, [d, d])
    gamma = _var(rng, [d])

    def loss(x):                                              # [B, T, D]
        q, k, v = tf.split(tf.matmul(x, w_qkv), 3, axis=-1)
        scores = tf.einsum("btd,bsd->bts", q, k) / np.sqrt(d)
        attended = tf.einsum("bts,bsd->btd", tf.nn.softmax(scores), v)
        h = x + tf.matmul(attended, w_out)
        return _head(tf.reduce_mean(h * gamma, axis=1))
    return [w_qkv, w_out, gamma], [(3, d)], loss, ["rules"] * 3


ORDINARY = [mlp, cnn("static"), cnn("shape"), layer_norm_model,
            embedding_mean_pool, attention]


# --------------------------------------------------------------------------
# The checks


def _placeholder(inp, batch):
    if inp and inp[0] == "labels":
        return tf.compat.v1.placeholder(tf.int32, [batch])
    if inp and inp[0] == "ids":
        return tf.compat.v1.placeholder(tf.int32, [batch, inp[2]])
    return tf.compat.v1.placeholder(tf.float64, (batch,) + tuple(inp))


def _sample(inp, rng):
    if inp and inp[0] == "labels":
        return rng.integers(0, inp[1], size=BATCH)
    if inp and inp[0] == "ids":
        return rng.integers(0, inp[1], size=(BATCH, inp[2]))
    return rng.normal(size=(BATCH,) + tuple(inp))


def _build(model):
    if model is layers_batch_norm and not _legacy_layers():
        pytest.skip("tf.compat.v1.layers needs TF_USE_LEGACY_KERAS=1 set "
                    "before the layers are first used (tf-keras); "
                    "tests/test_per_example.py covers the layers in a "
                    "subprocess")
    rng = np.random.default_rng(sum(map(ord, model.__name__)))
    xs, inputs, loss_fn, expected = model(rng)
    dynamic = [_placeholder(i, None) for i in inputs]
    static = [_placeholder(i, BATCH) for i in inputs]
    feed = dict(zip(static, [_sample(i, rng) for i in inputs]))
    return xs, loss_fn(*dynamic), loss_fn(*static), feed, expected


def _legacy_layers():
    try:
        return callable(getattr(tf.compat.v1.layers, "batch_normalization"))
    except (AttributeError, ImportError):
        return False


def _check_auto_matches_loop(graph, loss, xs, feed):
    ref = testing.loop_per_example(loss, xs)
    got = custagg.per_example_gradients(loss, xs, strategy="auto")
    norms = custagg.per_example_norms(loss, xs, strategy="auto")
    with tf.compat.v1.Session(graph=graph, config=SESSION_CONFIG) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        ref_val, got_val, norms_val = sess.run([ref, got, norms], feed)
    for j, (g, r) in enumerate(zip(got_val, ref_val)):
        testing.assert_close(g, r, RTOL, "x%d" % j)
    testing.assert_close(norms_val, testing.numpy_norms(ref_val), RTOL,
                         "norms")


@pytest.mark.parametrize("model", COUPLED, ids=lambda m: m.__name__)
def test_coupling_falls_back(model):
    graph = tf.Graph()
    with graph.as_default():
        xs, dynamic_loss, static_loss, feed, expected = _build(model)
        for loss in (dynamic_loss, static_loss):
            plan = custagg.plan_per_example(loss, xs)
            # A coupled x whose ops all have rules is certified at run time
            # (issue 24; its check then fails and the exact form runs),
            # else on pfor: never on the plain rules.
            assert [a.strategy if a.form != "certified" else "pfor"
                    for a in plan.assignments] == expected, str(plan)
            for a in plan.assignments:
                if a.strategy == "pfor" or a.form == "certified":
                    assert "mixes examples" in a.reason, str(plan)
            coupled = xs[expected.index("pfor")]
            with pytest.raises(ValueError) as info:
                custagg.plan_per_example(loss, [coupled], strategy="rules")
            message = str(info.value)
            for part in ("batch coupling", "examples do not interact",
                         "'auto'", coupled.name):
                assert part in message, message
        _check_auto_matches_loop(graph, static_loss, xs, feed)


@pytest.mark.parametrize("model", ORDINARY, ids=lambda m: m.__name__)
def test_no_false_positive(model):
    graph = tf.Graph()
    with graph.as_default():
        xs, dynamic_loss, static_loss, feed, expected = _build(model)
        for loss in (dynamic_loss, static_loss):
            plan = custagg.plan_per_example(loss, xs, strategy="rules")
            assert plan.strategies() == expected, str(plan)
        _check_auto_matches_loop(graph, static_loss, xs, feed)


# --------------------------------------------------------------------------
# The propagation table on single ops


def _coupling(build_rest, rows=None):
    """coupling() from `z = x @ w` to the loss `build_rest(z, batch)`.

    x is a `[None, 3]` placeholder, or a `[rows, 3]` constant (no batch);
    `batch` is a `[None, 4]` placeholder the rest may combine z with.
    """
    with tf.Graph().as_default():
        x = (tf.compat.v1.placeholder(tf.float64, [None, 3]) if rows is None
             else tf.ones([rows, 3], tf.float64))
        batch = tf.compat.v1.placeholder(tf.float64, [None, 4])
        w = tf.compat.v1.Variable(np.ones((3, 4)), use_resource=True)
        z = tf.matmul(x, w)
        loss = build_rest(z, batch)
        return batch_axis.coupling(z, 0, loss, graph_lib.ancestors(loss))


PROPAGATION = {
    "sum_features": (lambda z, _: tf.reduce_sum(z, axis=1), False),
    "sum_batch": (lambda z, _: tf.reduce_sum(z, axis=0)[:1] *
                  tf.reduce_sum(z, axis=1), True),
    "stop_gradient_of_batch_mean": (lambda z, _: tf.reduce_sum(
        tf.stop_gradient(tf.reduce_mean(z, 0)) * z, 1), False),
    "split_features": (lambda z, _: tf.add_n(tf.split(z, 2, axis=1))[:, 0],
                       False),
    "split_batch": (lambda z, _: tf.reduce_sum(
        tf.concat(tf.split(z, 2, axis=0), 1), 1), True),
    "reshape_with_shape_of_z": (lambda z, _: tf.reduce_sum(
        tf.reshape(z, [tf.shape(z)[0], 2, 2]), [1, 2]), False),
    "double_transpose": (lambda z, _: tf.reduce_sum(
        tf.transpose(tf.transpose(z)), 1), False),
    "gather_features": (lambda z, _: tf.reduce_sum(
        tf.gather(z, [0, 2], axis=1), 1), False),
    "gather_rows": (lambda z, _: tf.reduce_sum(tf.gather(z, [0, 0]), 1),
                    True),
    "unknown_op_cumsum": (lambda z, _: tf.reduce_sum(tf.cumsum(z, axis=1), 1),
                          True),
    "unstack_features": (lambda z, _: tf.unstack(z, axis=1)[0] +
                         tf.unstack(z, axis=1)[3], False),
}


@pytest.mark.parametrize("name", sorted(PROPAGATION))
def test_propagation(name):
    rest, mixes = PROPAGATION[name]
    reason = _coupling(rest)
    assert (reason is not None) == mixes, reason


@pytest.mark.parametrize("rest", [
    lambda z, batch: tf.reduce_sum(batch * z, 1),
    lambda z, batch: tf.reduce_sum(tf.matmul(
        batch[:, None, :], z[None, :, :], transpose_b=True), [1, 2]),
], ids=["elementwise", "batch_matmul"])
def test_size_1_axis_broadcast_over_the_batch_is_not_the_batch(rest):
    """z = c @ w with a constant [1, 3] c has no batch; one op later it is
    broadcast against the batch, so its axis 0 must not count as one."""
    reason = _coupling(rest, rows=1)
    assert reason is not None and "mixes examples" in reason, reason


def test_custom_gradient_counts_as_mixing():
    """An op whose gradient was replaced may mix examples backwards even
    when its forward does not."""

    @tf.custom_gradient
    def batch_centered_grad(z):
        def grad(dz):
            return dz - tf.reduce_mean(dz, axis=0)
        return tf.identity(z), grad

    reason = _coupling(lambda z, _: tf.reduce_sum(batch_centered_grad(z), 1))
    assert reason is not None and "gradient" in reason, reason
