"""Shapes known only at run time (issue 34): the table where it can still
read the batch axis, the run-time certificate where it cannot.

* `CTCLoss` (`tf.compat.v1.nn.ctc_loss`, time-major or batch-major logits):
  a per-example loss op in the table, so a dense layer before it is proved
  apart ("rules");
* `tf.slice` and `tf.pad` with run-time offsets, sizes and paddings on the
  other axes (a U-Net's `crop_and_concat`) keep the batch axis;
* `tf.squeeze` without an axis on a tensor of unknown shape (its output
  rank is unknown) and a loss of unknown static rank: the rules are
  certified at run time, the plan says to give the squeeze an axis, and a
  loss that is not `[B]` at run time stops with custagg's message.

Every case is exact against the loop reference (`custagg.testing`) at B=1
and B=7 (32 and 33 under `-m slow`), float64.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from benchmarks import zoo_models
from custagg import testing

tf1 = tf.compat.v1
BATCHES = [pytest.param((1, 7), id="B1,7"),
           pytest.param((32, 33), id="B32,33", marks=pytest.mark.slow)]
F, C, K = 3, 4, 5


def _var(name, shape):
    return tf1.get_variable(name, shape, tf.float64,
                            tf1.random_normal_initializer(seed=3,
                                                          dtype=tf.float64))


def _ctc(time_major):
    """A dense layer on `[B, T, F]` features, CTC on its logits."""
    x = tf1.placeholder(tf.float64, [None, None, F], name="x")
    lengths = tf1.placeholder(tf.int32, [None], name="lengths")
    labels = tf1.sparse_placeholder(tf.int32, name="labels")
    w, b = _var("w", [F, C]), _var("b", [C])
    logits = tf.einsum("btf,fc->btc", x, w) + b
    if time_major:
        logits = tf.transpose(logits, [1, 0, 2])
    loss = tf1.nn.ctc_loss(labels, logits, lengths, time_major=time_major)

    def feed(rng, batch, steps):
        lens = rng.integers(2, steps + 1, batch)
        return {x: rng.normal(size=[batch, steps, F]), lengths: lens,
                labels: zoo_models.ctc_labels(rng, lens, C)}
    return loss, [w, b], feed


def _crop():
    """`crop_and_concat`: a slice at run-time offsets and sizes on the
    image axes, a pad by run-time amounts on them, then a 1x1 layer."""
    a = tf1.placeholder(tf.float64, [None, None, None, F], name="a")
    small = tf1.placeholder(tf.float64, [None, None, None, F], name="small")
    s1, s2 = tf.shape(a), tf.shape(small)
    offsets = [0, (s1[1] - s2[1]) // 2, (s1[2] - s2[2]) // 2, 0]
    crop = tf.slice(a, offsets, [-1, s2[1], s2[2], -1])
    both = tf.concat([crop, small], 3)
    grow = s2[1] // 2
    both = tf.pad(both, [[0, 0], [grow, grow], [0, grow], [0, 0]])
    w = _var("w", [1, 1, 2 * F, K])
    h = tf.nn.conv2d(both, w, [1, 1, 1, 1], "SAME")
    loss = tf.reduce_sum(tf.square(tf.nn.tanh(h)), axis=[1, 2, 3])

    def feed(rng, batch, steps):
        return {a: rng.normal(size=[batch, steps + 2, steps + 3, F]),
                small: rng.normal(size=[batch, steps, steps, F])}
    return loss, [w], feed


def _squeeze():
    """A regressor whose `tf.squeeze(dense(h, 1))` has unknown rank, so
    its L1 loss has too."""
    x = tf1.placeholder(tf.float64, [None, F], name="x")
    y = tf1.placeholder(tf.float64, [None], name="y")
    w1, w2 = _var("w1", [F, K]), _var("w2", [K, 1])
    pred = tf.squeeze(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2))
    loss = tf.abs(pred - y)

    def feed(rng, batch, steps):
        del steps
        return {x: rng.normal(size=[batch, F]), y: rng.normal(size=[batch])}
    return loss, [w1, w2], feed


CASES = {"ctc_time_major": (lambda: _ctc(True), "rules"),
         "ctc_batch_major": (lambda: _ctc(False), "rules"),
         "crop_and_pad": (_crop, "rules"),
         "squeeze_unknown_rank": (_squeeze, "certified")}


@pytest.mark.parametrize("batches", BATCHES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_run_time_shapes_match_the_loop(graph, name, batches):
    build, want = CASES[name]
    loss, xs, feed = build()
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms() == [want] * len(xs), str(plan)
    clip = tf1.placeholder(tf.float64, [])
    ref = testing.loop_per_example(loss, xs, max(batches), rows=True)
    got = custagg.per_example_gradients(loss, xs)
    clipped = custagg.clipped_gradients(loss, xs, clip, return_norms=True)
    rng = np.random.default_rng(len(name) + batches[-1])
    with tf1.Session(graph=graph) as sess:
        sess.run(tf1.global_variables_initializer())
        for batch in batches:
            fd = feed(rng, batch, 4 if batch != batches[-1] else 6)
            fd[clip] = 1.0
            rows = sess.run(ref[:batch], fd)
            per_example = [np.stack(col) for col in zip(*rows)]
            norms = testing.numpy_norms(per_example)
            fd[clip] = float(np.median(norms))
            values, (sums, clip_norms) = sess.run([got, clipped], fd)
            label = "%s B=%d" % (name, batch)
            for j, g in enumerate(per_example):
                testing.assert_close(values[j], g, 1e-9,
                                     "%s per_example[%d]" % (label, j))
            testing.assert_close(clip_norms, norms, 1e-9, label + " norms")
            want_sums, _ = testing.numpy_clipped(per_example, fd[clip])
            for j, s in enumerate(want_sums):
                testing.assert_close(sums[j], s, 1e-9,
                                     "%s clipped[%d]" % (label, j))


def test_squeeze_to_unknown_rank_says_to_give_an_axis(graph):
    loss, xs, _ = _squeeze()
    text = str(custagg.plan_per_example(loss, xs))
    assert "tf.squeeze(t, axis=-1)" in text, text
    # One cause, printed once, holding up both variables.
    assert text.count("tf.squeeze(t, axis=-1)") == 1, text
    assert "holds up: w1:0, w2:0" in text, text


def test_a_loss_of_another_rank_at_run_time_stops_the_step(graph):
    x = tf1.placeholder(tf.float64, [None, None], name="x")
    w = _var("w", [])
    loss = tf.squeeze(tf.square(w * x))         # rank unknown
    norms = custagg.per_example_norms(loss, [w])
    with tf1.Session(graph=graph) as sess:
        sess.run(tf1.global_variables_initializer())
        got = sess.run(norms, {x: [[1.0], [2.0]]})
        np.testing.assert_allclose(got, 2 * np.abs([1.0, 4.0]) *
                                   abs(sess.run(w)), rtol=1e-12)
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match="per_example_loss must have shape"):
            sess.run(norms, {x: [[1.0, 2.0], [3.0, 4.0]]})
