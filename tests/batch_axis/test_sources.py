"""Batch sources inferred from the loss (`custagg.batch_axis.infer`).

The same three models -- an MLP, a small CNN and an LSTM -- are fed from
every kind of input pipeline a TF1 user has: placeholders (with and without
a default), each tf.data iterator kind, TF1 queues with their runner
threads, a batch held in variables or constants, a `py_function` with a set
shape, `ParseExample` on serialized `tf.train.Example`s, and a feed into an
intermediate tensor. For each (model, source, B) the test checks, in ONE
`session.run` (a queue or an iterator hands out a new batch per run):

* per-example gradients and norms (strategy "auto") against the loop
  reference, one `tf.compat.v1.gradients(loss[i], xs)` per example, float64;
* that `plan_per_example` gives the same forms as the same model on a
  placeholder of the same static shape, and no O(B^2) form.

Before the batch came from the loss, every source but placeholders and
iterators left the rules (pfor over the whole backward pass).
"""

import threading

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import batch_axis
from custagg import testing

T, D, CLASSES = 3, 2, 3
SHAPES = {"mlp": (4,), "cnn": (6, 6, 2), "lstm": (T, D)}
RTOL = 1e-7


# --------------------------------------------------------------------------
# Models: (x [B, ...] float64, y [B] int32) -> (loss [B], xs).


def mlp(x, y):
    h = tf.compat.v1.layers.Dense(5, tf.tanh, name="h", dtype=tf.float64)
    out = tf.compat.v1.layers.Dense(CLASSES, name="out", dtype=tf.float64)
    logits = out(h(x))
    return _xent(y, logits), h.trainable_weights + out.trainable_weights


def cnn(x, y):
    conv = tf.compat.v1.layers.Conv2D(3, 3, padding="same",
                                      activation=tf.nn.relu, name="conv",
                                      dtype=tf.float64)
    out = tf.compat.v1.layers.Dense(CLASSES, name="out", dtype=tf.float64)
    h = tf.compat.v1.layers.max_pooling2d(conv(x), 2, 2)
    logits = out(tf.reshape(h, [-1, 3 * 3 * 3]))
    return _xent(y, logits), conv.trainable_weights + out.trainable_weights


def lstm(x, y):
    cell = tf.keras.layers.LSTM(3, dtype=tf.float64, name="lstm")
    out = tf.compat.v1.layers.Dense(CLASSES, name="out", dtype=tf.float64)
    logits = out(cell(x))
    return _xent(y, logits), cell.trainable_weights + out.trainable_weights


def _xent(y, logits):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                          logits=logits)


MODELS = {"mlp": mlp, "cnn": cnn, "lstm": lstm}


# --------------------------------------------------------------------------
# Sources: (shape, X [b, ...], Y [b]) -> Source. Each delivers exactly the
# batch (X, Y) (a queue: a permutation of it) on every run.


class Source(object):
    """x, y tensors; the feed a run needs; start/stop for queue threads;
    whether the batch size is static (it then shapes the placeholder the
    plan is compared with)."""

    def __init__(self, x, y, feed=None, static=False, start=None):
        self.x, self.y, self.feed = x, y, dict(feed or {})
        self.static = static
        self._start = start
        self._stop = None

    def start(self, sess):
        if self._start is not None:
            self._stop = self._start(sess)

    def stop(self):
        if self._stop is not None:
            self._stop()


def placeholder(shape, xs, ys):
    x = tf.compat.v1.placeholder(tf.float64, (None,) + shape, name="x")
    y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
    return Source(x, y, {x: xs, y: ys})


def placeholder_with_default(shape, xs, ys):
    x = tf.compat.v1.placeholder_with_default(tf.constant(xs),
                                              (None,) + shape, name="x")
    y = tf.compat.v1.placeholder_with_default(tf.constant(ys), [None],
                                              name="y")
    return Source(x, y)


def _dataset(xs, ys, batch=None):
    batch = len(ys) if batch is None else batch
    return tf.data.Dataset.from_tensor_slices((xs, ys)).batch(batch).repeat()


def one_shot_iterator(shape, xs, ys):
    x, y = tf.compat.v1.data.make_one_shot_iterator(
        _dataset(xs, ys)).get_next()
    return Source(x, y)


def initializable_iterator(shape, xs, ys):
    px = tf.compat.v1.placeholder(tf.float64, (None,) + shape)
    py = tf.compat.v1.placeholder(tf.int32, [None])
    it = tf.compat.v1.data.make_initializable_iterator(
        _dataset(px, py, len(ys)))
    x, y = it.get_next()

    def start(sess):
        sess.run(it.initializer, {px: xs, py: ys})
    return Source(x, y, start=start)


def reinitializable_iterator(shape, xs, ys):
    data = _dataset(xs, ys)
    it = tf.compat.v1.data.Iterator.from_structure(
        tf.compat.v1.data.get_output_types(data),
        tf.compat.v1.data.get_output_shapes(data))
    init = it.make_initializer(data)
    x, y = it.get_next()
    return Source(x, y, start=lambda sess: sess.run(init))


def string_handle_iterator(shape, xs, ys):
    data = _dataset(xs, ys)
    handle = tf.compat.v1.placeholder(tf.string, [])
    it = tf.compat.v1.data.Iterator.from_string_handle(
        handle, tf.compat.v1.data.get_output_types(data),
        tf.compat.v1.data.get_output_shapes(data))
    x, y = it.get_next()
    train = tf.compat.v1.data.make_one_shot_iterator(data)
    source = Source(x, y)

    def start(sess):
        source.feed[handle] = sess.run(train.string_handle())
    source._start = start  # pylint: disable=protected-access
    return source


def _queue_threads(sess):
    coord = tf.compat.v1.train.Coordinator()
    threads = tf.compat.v1.train.start_queue_runners(sess=sess, coord=coord)

    def stop():
        coord.request_stop()
        coord.join(threads, stop_grace_period_secs=10)
        alive = [t.name for t in threads if t.is_alive()]
        assert not alive, alive
    return stop


def shuffle_batch_queue(shape, xs, ys):
    """The TF1 tutorials' pipeline: slice_input_producer + shuffle_batch
    (QueueDequeueManyV2; batch_size fixes B statically)."""
    x1, y1 = tf.compat.v1.train.slice_input_producer(
        [tf.constant(xs), tf.constant(ys)], shuffle=True, seed=1)
    x, y = tf.compat.v1.train.shuffle_batch(
        [x1, y1], batch_size=len(ys), capacity=2 * len(ys) + 4,
        min_after_dequeue=len(ys), seed=2)
    return Source(x, y, static=True, start=_queue_threads)


def batch_queue_up_to(shape, xs, ys):
    """tf.compat.v1.train.batch with allow_smaller_final_batch
    (QueueDequeueUpToV2, dynamic B)."""
    x1, y1 = tf.compat.v1.train.slice_input_producer(
        [tf.constant(xs), tf.constant(ys)], shuffle=False)
    x, y = tf.compat.v1.train.batch([x1, y1], batch_size=len(ys),
                                    allow_smaller_final_batch=True)
    return Source(x, y, start=_queue_threads)


def variables(shape, xs, ys):
    """The batch in non-trainable variables: a resource variable (read by
    ReadVariableOp) and a ref variable (VariableV2)."""
    x = tf.compat.v1.Variable(xs, trainable=False, use_resource=True,
                              name="x_data")
    y = tf.compat.v1.Variable(ys, trainable=False, use_resource=False,
                              name="y_data")

    def start(sess):
        sess.run([x.initializer, y.initializer])
    return Source(tf.identity(x), tf.identity(y), static=True, start=start)


def constants(shape, xs, ys):
    return Source(tf.constant(xs), tf.constant(ys), static=True)


def py_function(shape, xs, ys):
    x, y = tf.py_function(lambda: (xs, ys), [], [tf.float64, tf.int32])
    x.set_shape((None,) + shape)
    y.set_shape([None])
    return Source(x, y)


def parse_example(shape, xs, ys):
    def record(row, label):
        return tf.train.Example(features=tf.train.Features(feature={
            "x": tf.train.Feature(float_list=tf.train.FloatList(
                value=row.reshape(-1))),
            "y": tf.train.Feature(int64_list=tf.train.Int64List(
                value=[label]))})).SerializeToString()
    serialized = tf.compat.v1.placeholder(tf.string, [None])
    parsed = tf.io.parse_example(serialized, {
        "x": tf.io.FixedLenFeature(shape, tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64)})
    return Source(tf.cast(parsed["x"], tf.float64),
                  tf.cast(parsed["y"], tf.int32),
                  {serialized: [record(r, l) for r, l in zip(xs, ys)]})


def intermediate_feed(shape, xs, ys):
    """A constant pipeline whose output tensor is fed directly."""
    raw = tf.constant(np.zeros(xs.shape, np.uint8))
    x = tf.cast(raw, tf.float64) / 255.0
    y = tf.compat.v1.placeholder(tf.int32, [None])
    return Source(x, y, {x: xs, y: ys}, static=True)


SOURCES = {f.__name__: f for f in (
    placeholder, placeholder_with_default, one_shot_iterator,
    initializable_iterator, reinitializable_iterator, string_handle_iterator,
    shuffle_batch_queue, batch_queue_up_to, variables, constants, py_function,
    parse_example, intermediate_feed)}


# --------------------------------------------------------------------------


def _data(model, batch, seed):
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(batch,) + SHAPES[model])
    if model == "cnn":
        xs = np.abs(xs)
    # float32 round trip: ParseExample stores float32.
    return xs.astype(np.float32).astype(np.float64), \
        rng.integers(0, CLASSES, size=batch).astype(np.int32)


def _placeholder_forms(model, batch, static):
    with tf.Graph().as_default():
        shape = ((batch if static else None),) + SHAPES[model]
        x = tf.compat.v1.placeholder(tf.float64, shape)
        y = tf.compat.v1.placeholder(tf.int32, shape[:1])
        loss, xs = MODELS[model](x, y)
        plan = custagg.plan_per_example(loss, xs)
        return plan.forms(), str(plan)


def _reference_rows(loss, xs, batch):
    """[B, *x.shape] per x: one tf.compat.v1.gradients per example."""
    rows = [tf.compat.v1.gradients(loss[i], xs) for i in range(batch)]
    return [tf.stack(list(col)) for col in zip(*rows)]


def check(model, source_name, batch, seed=0):
    xs_np, ys_np = _data(model, batch, seed)
    with tf.Graph().as_default() as g:
        tf.compat.v1.set_random_seed(seed)
        source = SOURCES[source_name](SHAPES[model], xs_np, ys_np)
        loss, xs = MODELS[model](source.x, source.y)
        found = batch_axis.infer(loss)
        plan = custagg.plan_per_example(loss, xs)
        want_forms, want_plan = _placeholder_forms(model, batch,
                                                   source.static)
        assert plan.forms() == want_forms, (str(plan), want_plan)
        assert not plan.slow(), str(plan)
        grads = custagg.per_example_gradients(loss, xs)
        norms = custagg.per_example_norms(loss, xs)
        ref = _reference_rows(loss, xs, batch)
        init = tf.compat.v1.global_variables_initializer()
        with tf.compat.v1.Session(graph=g) as sess:
            sess.run(init)
            source.start(sess)
            try:
                got, got_norms, want, x_fed = sess.run(
                    [grads, norms, ref, source.x], source.feed)
            finally:
                source.stop()
    assert x_fed.shape[0] == batch
    testing.assert_allclose_list(got, want, rtol=RTOL, atol=1e-12,
                                 names=[v.name for v in xs])
    np.testing.assert_allclose(got_norms, testing.numpy_norms(want),
                               rtol=RTOL)
    return found


# The default run: the MLP and the CNN from every source, the LSTM (its
# loop reference costs most) from a placeholder; the slow run has the LSTM from every
# source, and B in {1, 32, 33} from every source for the MLP and the CNN and
# from a placeholder and a queue for the LSTM (at B=33 its loop reference is
# 33 backward while loops a case).
_LSTM_FAST = ("placeholder",)
FAST = [(m, s, 5) for m in ("mlp", "cnn") for s in SOURCES] + [
    ("lstm", s, 5) for s in _LSTM_FAST]
SLOW = [("lstm", s, 5) for s in SOURCES if s not in _LSTM_FAST] + [
    (m, s, b) for m in ("mlp", "cnn") for s in SOURCES
    for b in (1, 32, 33)] + [
    ("lstm", s, b) for s in ("placeholder", "shuffle_batch_queue")
    for b in (1, 32, 33)]


@pytest.mark.parametrize("model, source, batch", FAST)
def test_every_source_matches_the_loop_with_the_placeholder_plan(
        model, source, batch):
    check(model, source, batch)


@pytest.mark.slow
@pytest.mark.parametrize("model, source, batch", SLOW)
def test_every_source_at_more_batch_sizes(model, source, batch):
    check(model, source, batch)


# --------------------------------------------------------------------------
# What the inference finds, and what it refuses to guess.


def test_sources_are_the_data_not_the_weights():
    xs_np, ys_np = _data("mlp", 4, 0)
    x = tf.compat.v1.Variable(xs_np, trainable=False, name="x_data")
    w = tf.compat.v1.Variable(np.ones((4, 4)), name="w")   # [D, D]: B == D
    y = tf.constant(ys_np)
    loss = _xent(y, tf.matmul(tf.matmul(x, w), w[:, :CLASSES]))
    found = batch_axis.infer(loss)
    kinds = sorted((t.op.type, t.op.inputs[0] is x.handle if t.op.inputs
                    else None) for t, _ in found.sources)
    assert kinds == [("Const", None), ("ReadVariableOp", True)], kinds
    assert all(d == 0 for _, d in found.sources)
    assert not found.carries_batch(w.handle)


def test_inverse_reads_the_table_backward():
    a = tf.compat.v1.placeholder(tf.float32, [None, 3])
    w = tf.compat.v1.placeholder(tf.float32, [3, 4])
    z = tf.matmul(a, w)
    assert batch_axis.inverse(z.op, 0, 0) == [frozenset([0]), frozenset()]
    zt = tf.matmul(w, a, transpose_a=True, transpose_b=True)   # [4, B]
    assert batch_axis.inverse(zt.op, 0, 1) == [frozenset(), frozenset([0])]
    s = tf.reduce_sum(tf.transpose(tf.reshape(a, [-1, 3, 1]), [0, 2, 1]),
                      axis=1)
    assert batch_axis.inverse(s.op, 0, 0)[0] == frozenset([0])
    assert batch_axis.forward(z.op, 1, 0) is batch_axis.MIXES


def test_an_unknown_op_is_not_guessed():
    x = tf.compat.v1.placeholder(tf.float32, [None, 3])
    z = tf.raw_ops.MatrixInverse(input=tf.reshape(x, [-1, 1, 3])[:, :, :1])
    loss = tf.reshape(z, [-1]) + tf.reduce_sum(x, axis=1)
    found = batch_axis.infer(loss)
    # Found through the Sum; the MatrixInverse path is reported, not
    # guessed through.
    assert [t for t, _ in found.sources] == [x]
    assert any("MatrixInverse" in r for r in found.blocked), found.blocked
    only = batch_axis.infer(tf.reshape(z, [-1]))
    assert not only.sources
    assert "MatrixInverse" in batch_axis.no_sources_reason(only)


def test_a_py_function_with_batch_inputs_is_not_a_source():
    x = tf.compat.v1.placeholder(tf.float32, [None, 3])
    (z,) = tf.py_function(lambda t: t * 2.0, [x], [tf.float32])
    z.set_shape([None, 3])
    found = batch_axis.infer(tf.reduce_sum(z, axis=1))
    assert not found.sources and found.blocked


def test_rules_with_the_batch_in_variables_name_the_real_cause():
    """strategy='rules' on a batch held in variables used to fail naming
    the cross-entropy op ("reaches the loss through no float output")."""
    xs_np, ys_np = _data("mlp", 5, 1)
    x = tf.compat.v1.Variable(xs_np, trainable=False)
    y = tf.compat.v1.Variable(ys_np, trainable=False)
    loss, xs = mlp(x, y)
    plan = custagg.plan_per_example(loss, xs, strategy="rules")
    assert plan.forms() == ["rules"] * 4, str(plan)
    # Examples mixed before the loss: the refusal names the mixing op.
    mixed = loss - tf.reduce_mean(loss, name="batch_mean")
    with pytest.raises(ValueError, match="batch_mean"):
        custagg.plan_per_example(mixed, xs, strategy="rules")


def test_queue_threads_stop():
    before = threading.active_count()
    check("mlp", "shuffle_batch_queue", 3)
    assert threading.active_count() <= before + 1
