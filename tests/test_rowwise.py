"""The row-wise proof (`custagg.batch_axis.rowwise`) that lets the per-example copies run
without their run-time check.

Where the proof holds, the copies of the forward pass run alone (the batch's
own forward pass never runs) and must still match the loop reference.
Where a graph couples examples in a way the static analysis before it does
not see (the batch size used as a number, a reversal over the batch in a
loop body, a row index, a broadcast of a `[K, D]` constant), the proof
must fail and name the op, and the run-time check must then catch the
coupling loudly. A proof that passed any of these would be a silent wrong
answer (for DP-SGD, a broken privacy guarantee).
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import batch_axis
from custagg import testing
from custagg import graph as graph_lib
from custagg.batch_axis import proof_values
from custagg.batch_axis import rowwise
from custagg.graph.copier import CannotCopy
from custagg.per_example.forms import copies

import test_loops

T, D = test_loops.T, test_loops.D


def _forward(loss):
    return copies.analyze(loss, graph_lib.ancestors(loss), None)


def elementwise_rnn(couple=None, dtype=tf.float64):
    """A while-loop RNN with no per-example rule anywhere (Pow and
    SquaredDifference of batch data and weights, as the benchmarks'
    `norule_rnn`), written the way users write it: `tf.zeros(tf.stack(
    [tf.shape(x)[0], D]))`, `tf.gather` of the time-major input, `h[:, None,
    :]`. `couple(h, x)` (in the loop body) adds a coupling."""
    x = tf.compat.v1.placeholder(dtype, [None, T, D], name="x")
    y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
    rng = np.random.default_rng(5)
    center = tf.compat.v1.Variable(rng.normal(size=(D,)), name="center",
                                   dtype=dtype, use_resource=True)
    power = tf.compat.v1.Variable(1.5, dtype=dtype, name="power",
                                  use_resource=True)
    protos = tf.compat.v1.Variable(rng.normal(size=(2, D)), name="protos",
                                   dtype=dtype, use_resource=True)
    x_tm = tf.transpose(x, [1, 0, 2])
    h0 = tf.zeros(tf.stack([tf.shape(x)[0], D]), dtype)
    acc0 = tf.zeros(tf.stack([tf.shape(x)[0], 2]), dtype)

    def body(t, h, acc):
        k = tf.math.pow(tf.math.reciprocal(
            1.0 + tf.math.squared_difference(tf.gather(x_tm, t), center)),
            power)
        h = 0.5 * h + 0.5 * tf.tanh(k - 0.5)
        if couple is not None:
            h = couple(h, x)
        score = -tf.reduce_sum(
            tf.math.squared_difference(h[:, None, :], protos), axis=2)
        return t + 1, h, acc + score

    _, _, acc = tf.compat.v1.while_loop(lambda t, h, acc: t < T, body,
                                        (tf.constant(0), h0, acc0))
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                          logits=acc)
    return loss, [center, power, protos], test_loops._feed(x, y)


def test_model_without_rules_is_proved_and_matches_the_loop(graph):
    plans = test_loops.check_model(elementwise_rnn,
                                   forms=(None, "recompute-loop"))
    for plan in plans:
        assert set(plan.forms()) <= {"recompute", "recompute-loop"}, plan
        assert "proved apart: no run-time check" in str(plan), str(plan)
    loss = plans[0].loss
    got = custagg.per_example_norms(loss, tf.compat.v1.trainable_variables())
    # The batch's own forward pass is not needed any more.
    assert loss.op not in graph_lib.ancestors(got)


def test_proved_copies_in_float32_match_the_loop(graph):
    loss, xs, feed = elementwise_rnn(dtype=tf.float32)
    assert _forward(loss).unproven is None
    ref = test_loops.loop_reference(loss, xs, max(test_loops.BATCHES))
    got = custagg.per_example_gradients(loss, xs)
    norms = custagg.per_example_norms(loss, xs)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for b, small, want in test_loops.sliced_batches(
                sess, ref, feed, test_loops.BATCHES, seed=2):
            g, n = sess.run([got, norms], small)
            for j, (gj, wj) in enumerate(zip(g, want)):
                np.testing.assert_allclose(
                    gj, wj, rtol=1e-4, atol=1e-4 * np.abs(wj).max(),
                    err_msg="B=%d %s" % (b, xs[j].name))
            np.testing.assert_allclose(
                n, custagg.testing.numpy_norms(want), rtol=1e-4,
                err_msg="norms B=%d" % b)


def test_hand_written_loop_is_proved(graph):
    loss, _, _ = test_loops.hand_rnn()
    assert _forward(loss).unproven is None


def _divide_by_batch(loss, x):
    return loss / tf.cast(tf.shape(x)[0], tf.float64)


def _row_index(loss, x):
    index = tf.cast(tf.range(tf.shape(x)[0]), tf.float64)
    return loss * (1.0 + index)


COUPLED = [
    # (name, what the proof must name, couple in the body, couple the loss)
    ("batch size as a number", "Cast", None, _divide_by_batch),
    ("batch mean under an integer path in the body", "batch size",
     lambda h, x: h * tf.cast(tf.shape(h)[0], tf.float64), None),
]


def _assert_gradients_match(sess, got, ref, feed, xs, batches, seed):
    """`got` (per-example gradients aligned with xs) against the loop
    reference `ref` at each B of `batches` (test_loops.sliced_batches)."""
    for b, small, want in test_loops.sliced_batches(sess, ref, feed, batches,
                                                    seed=seed):
        for gj, wj, x in zip(sess.run(got, small), want, xs):
            np.testing.assert_allclose(gj, wj, rtol=1e-7, atol=1e-12,
                                       err_msg="B=%d %s" % (b, x.name))


def test_a_row_index_is_batch_data(graph):
    """`loss * (1 + range(B))`: row b of the index belongs to example b, so
    the index is a batch source (found backward from the loss), each copy
    takes its own row, and the copies are exact -- not a coupling."""
    loss, xs, feed = elementwise_rnn()
    loss = _row_index(loss, tf.compat.v1.get_default_graph().get_tensor_by_name(
        "x:0"))
    found = batch_axis.infer(loss)
    assert "Range" in [t.op.type for t, _ in found.sources], found.sources
    ref = test_loops.loop_reference(loss, xs, 5)
    got = custagg.per_example_gradients(loss, xs)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        _assert_gradients_match(sess, got, ref, feed, xs, (1, 5),
                                seed=3)


@pytest.mark.parametrize("name,names,body,after", COUPLED,
                         ids=[c[0] for c in COUPLED])
def test_hidden_couplings_are_not_proved_and_take_the_exact_form(
        graph, name, names, body, after):
    """The copies' run-time check sees the coupling and the step takes the
    exact form under `tf.cond` (issue 24: no InvalidArgumentError)."""
    loss, xs, feed = elementwise_rnn(couple=body)
    if after is not None:
        loss = after(loss, tf.compat.v1.get_default_graph().get_tensor_by_name(
            "x:0"))
    forward = _forward(loss)
    assert forward.unproven is not None and names in forward.unproven, (
        forward.unproven)
    plan = custagg.plan_per_example(loss, xs)
    assert "checked against the batch's losses at run time" in str(plan)
    got = custagg.per_example_gradients(loss, xs)
    ref = testing.loop_per_example(loss, xs, 4)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got_v, ref_v = sess.run([got, ref], feed(4, np.random.default_rng(0)))
    for j, (g, r) in enumerate(zip(got_v, ref_v)):
        testing.assert_close(g, r, 1e-9, "%s x%d" % (name, j))


def test_reversal_over_the_batch_hides_the_data_and_the_copies_refuse(graph):
    """`tf.reverse(h, [0])` in the body: example b's loss reads example
    B-1-b. Walking back from the loss, the loop's input sequence is not
    reached with a batch axis (the body mixes it), so x is no batch source;
    the copies would read the loop's output (the logits) whole, so they
    refuse (rather than crash or be wrong), and auto falls back to an exact
    form."""
    loss, xs, feed = elementwise_rnn(couple=lambda h, x: tf.reverse(h, [0]))
    with pytest.raises(CannotCopy,
                       match="not computed from the batch sources"):
        _forward(loss)
    plan = custagg.plan_per_example(loss, xs)
    assert not set(plan.forms()) & {"recompute", "recompute-loop"}, str(plan)
    ref = test_loops.loop_reference(loss, xs, 5)
    got = custagg.per_example_gradients(loss, xs)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        _assert_gradients_match(sess, got, ref, feed, xs, (5,), seed=4)


def test_a_constant_holding_a_batch_is_a_source(graph):
    """`h + c` with c `[4, D]`: fed 4 examples the batch adds row b of c to
    example b. c lines up with the batch, so it is batch data (a constant
    holding a batch): each copy takes its row, and the inputs' leading
    dimensions are asserted equal at run time."""
    c = tf.constant(np.arange(4.0 * D).reshape(4, D))
    loss, xs, feed = elementwise_rnn(couple=lambda h, x: h + c)
    forward = _forward(loss)
    assert c in forward.inputs and forward.unproven is None
    ref = test_loops.loop_reference(loss, xs, 4)
    got = custagg.per_example_gradients(loss, xs)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        _assert_gradients_match(sess, got, ref, feed, xs, (4,), seed=4)
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match="other leading dimensions"):
            sess.run(got, feed(5, np.random.default_rng(0)))


def test_condition_on_batch_data_is_not_proved(graph):
    x, y = test_loops._inputs()
    w = tf.compat.v1.Variable(np.ones((D, 2)), use_resource=True, name="w")
    # Each example alone would stop at its own step: the batch stops when
    # every row is below the bound, so rows set each other's step count.
    _, h = tf.compat.v1.while_loop(
        lambda t, h: tf.logical_and(t < 5, tf.reduce_max(h) > 0.5),
        lambda t, h: (t + 1, tf.tanh(h)),
        [0, tf.matmul(x[:, 0, :], w)])
    loss, _ = test_loops._head(h, y)
    why = _forward(loss).unproven
    assert why is not None and "Max" in why, why


def test_side_effect_through_a_control_edge_is_not_proved(graph):
    x, y = test_loops._inputs()
    v = tf.compat.v1.Variable(np.zeros(D), use_resource=True, name="stat")
    update = v.assign(tf.reduce_mean(x[:, 0, :], axis=0))
    with tf.control_dependencies([update]):
        shift = v.read_value()
    loss, _ = test_loops._head(x[:, 0, :] - shift, y)
    why = _forward(loss).unproven
    assert why is not None and "control dependency" in why, why


def test_inputs_of_other_lengths_fail_with_the_inputs_named(graph):
    loss, xs, _ = elementwise_rnn()
    got = custagg.per_example_norms(loss, xs)
    graph = tf.compat.v1.get_default_graph()
    x, y = graph.get_tensor_by_name("x:0"), graph.get_tensor_by_name("y:0")
    rng = np.random.default_rng(0)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match="other leading dimensions"):
            sess.run(got, {x: rng.normal(size=(4, T, D)), y: [0, 1, 0]})


def test_abstract_values_of_shape_paths(graph):
    """`tf.zeros(tf.stack([tf.shape(x)[0], 3]))` is rows on axis 0; the
    batch size reaching arithmetic is not proved."""
    x = tf.compat.v1.placeholder(tf.float64, [None, 4], name="x")
    values = {x.ref(): proof_values.Rows(0)}
    size = tf.shape(x)[0]
    zeros = tf.zeros(tf.stack([size, 3]), tf.float64)
    ops = [op for op in tf.compat.v1.get_default_graph().get_operations()
           if op is not x.op]
    rowwise._Interpreter(values).run(ops)
    assert values[size.ref()] == proof_values.SIZE
    assert values[zeros.ref()] == proof_values.Rows(0)
    bad = tf.cast(size, tf.float64) * tf.ones([], tf.float64)
    with pytest.raises(proof_values.NotProved, match="batch size"):
        rowwise._Interpreter(values).run([bad.op.inputs[0].op])


PROVED = sorted(set(test_loops.MODELS) - {"dynamic_rnn_lstm_seqlen"})


@pytest.mark.parametrize("name", PROVED)
def test_loop_models_are_proved(graph, name):
    """Keras LSTM/GRU (TensorLists of the unstacked inputs and of the
    outputs, element shapes built from the batch size), dynamic_rnn, stacked
    and hand-written loops: every example's loss is its own."""
    if name.startswith("keras"):
        pytest.importorskip("tf_keras")
    loss, _, _ = test_loops.MODELS[name]()
    assert _forward(loss).unproven is None, _forward(loss).unproven


def test_sequence_lengths_are_not_proved(graph):
    """dynamic_rnn with sequence_length runs to the longest sequence of the
    batch (a max over examples): the losses agree, but nothing proves it,
    so the copies keep their check."""
    loss, _, _ = test_loops.MODELS["dynamic_rnn_lstm_seqlen"]()
    why = _forward(loss).unproven
    assert why is not None and "Max" in why, why
