"""What the loop rules keep per iteration (per_example/forms/loop_rules.py).

Inside a rebuilt loop body each tapped op's inputs other than x are pushed
to a list, `[T, B, ...]`, for the rule to read after the loop. A rule that
reads none of them (`Rule.reads_other_inputs = False`: BiasAdd reads only
dz and its data format) must not have them pushed: for an LSTM cell's
`bias_add(matmul(...), b)` that list was a whole `[T, B, 4H]` copy of the
pre-activations (issue 23's before/after benchmark: the LSTM's peak memory
rose 1.45-1.80x). Values stay those of one tf.gradients per example.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import testing
from custagg.rules import broadcast

T, D, H = 4, 3, 5


def _rnn(batch):
    rng = np.random.RandomState(batch)
    x = tf.compat.v1.placeholder(tf.float64, [None, T, D])
    kernel = tf.Variable(rng.normal(size=(D + H, 4 * H)) * 0.5)
    bias = tf.Variable(rng.normal(size=(4 * H,)) * 0.5)
    x_tm = tf.transpose(x, [1, 0, 2])
    h0 = tf.zeros(tf.stack([tf.shape(x)[0], H]), tf.float64)

    def body(t, h):
        z = tf.nn.bias_add(tf.matmul(tf.concat([tf.gather(x_tm, t), h], 1),
                                     kernel), bias)
        i, f, g, o = tf.split(z, 4, axis=1)
        return t + 1, tf.sigmoid(o) * tf.tanh(tf.sigmoid(i) * tf.tanh(g) +
                                              tf.sigmoid(f))

    _, h = tf.compat.v1.while_loop(lambda t, h: t < T, body,
                                   (tf.constant(0), h0))
    loss = tf.reduce_sum(tf.square(h), 1)
    return x, loss, [kernel, bias], {x: rng.normal(size=(batch, T, D))}


def _pushes(graph):
    """TensorListPushBack ops in the graph and its function bodies."""
    lib = graph.as_graph_def().library.function
    return (sum(op.type == "TensorListPushBack"
                for op in graph.get_operations()) +
            sum(n.op == "TensorListPushBack" for f in lib for n in f.node_def))


def _built(batch, reads):
    with tf.Graph().as_default() as graph:
        x, loss, xs, feed = _rnn(batch)
        before = _pushes(graph)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(broadcast.BiasAddRule, "reads_other_inputs", reads)
            plan = str(custagg.plan_per_example(loss, xs))
            grads = custagg.per_example_gradients(loss, xs)
        pushes = _pushes(graph) - before
        reference = testing.loop_per_example(loss, xs, batch=batch)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got, want = sess.run([grads, reference], feed)
    return plan, pushes, got, want


def test_bias_value_is_not_pushed_per_iteration():
    plan, pushes, got, want = _built(3, reads=False)
    assert "rules via BiasAdd in loop" in plan, plan
    # The control: a BiasAdd rule that read its value would push more (in
    # each copy of the rebuilt body the function library holds).
    _, pushes_if_read, got_if_read, _ = _built(3, reads=True)
    assert pushes_if_read > pushes, (pushes_if_read, pushes)
    for g, r, w in zip(got, got_if_read, want):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(r, w, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("batch", [1, pytest.param(33, marks=pytest.mark.slow)])
def test_values_match_the_loop(batch):
    _, _, got, want = _built(batch, reads=False)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)
