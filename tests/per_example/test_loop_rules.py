"""Per-example rules inside while-loop bodies
(custagg/per_example/forms/loop_rules.py).

Every RNN of tests/test_loops.py (dynamic batch, float64) takes the loop
rules for its cell weights, and every public function (per-example
gradients, norms, clipped sums global and per x, weighted sums, second
moments) matches one `tf.compat.v1.gradients(loss[i], xs)` per example at
B in {1, 5, 32, 33}. Loops that mix examples, or that the rules cannot
read, are refused with the op's name and take an exact form instead; a
loop whose examples are proved apart inside it but not after it takes the
certified loop rules (checked at the loop's outputs at run time).
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import batch_axis
from custagg import testing

import per_example_reference
import test_loops

# The default run checks B in {1, 5}; `-m slow` adds {32, 33} (the loop
# reference, one tf.gradients through the loop per example, costs most of
# each test: 33 backward while loops).
BATCHES = (1, 5)
LARGE_BATCHES = (32, 33)
RTOL = 1e-7
# The dense head outside the loop has ordinary rules.
HEAD = ("readout/",)

# dynamic_rnn with sequence_length: padding steps contribute nothing (TF's
# Select keeps the state, and the taps' dz there is 0). The default run
# checks these (hand-written with AddV2 bias and a weight also used outside,
# Keras GRU with its Unpack bias; dynamic_rnn with sequence_length runs in
# test_v1_control_flow_loops_take_loop_rules); `python -m pytest -m slow
# tests/per_example/test_loop_rules.py` every model at both batch sets.
DEFAULT_MODELS = frozenset(["hand_while_rnn", "weight_inside_and_outside",
                            "keras_gru_sequence"])
V2_MODELS = [pytest.param(n, b, marks=() if n in DEFAULT_MODELS and
                          b == BATCHES else pytest.mark.slow,
                          id="%s-%s" % (n, "large" if b == LARGE_BATCHES
                                        else "small"))
             for n in sorted(test_loops.MODELS)
             for b in (BATCHES, LARGE_BATCHES)]


def _check_all(loss, xs, feed, batches=BATCHES, seed=0, rtol=RTOL,
               coupled=False):
    """Every public function against the loop reference: one graph of
    reference gradients built for the largest batch and sliced (the first
    b examples' gradients are those of a batch of b, as the models keep
    examples apart), or with `coupled` built for each batch."""
    built, weights = per_example_reference.build_functions(loss, xs, "auto")
    ref = test_loops.loop_reference(loss, xs, max(batches))
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for b, small, want in test_loops.sliced_batches(sess, ref, feed,
                                                        batches, seed):
            refs = None if coupled else ([True] * len(xs), want)
            msg = per_example_reference.check(
                sess, loss, xs, small, built, weights, rtol=rtol,
                label="B=%d" % b, refs=refs)
            assert msg is None, msg
    return built


@pytest.mark.parametrize("name,batches", V2_MODELS)
def test_rnn_weights_take_loop_rules_and_match_the_loop(graph, name, batches):
    loss, xs, feed = test_loops.MODELS[name]()
    plan = custagg.plan_per_example(loss, xs)
    for a in plan.assignments:
        want = "rules" if a.name.startswith(HEAD) else "loop-rules"
        assert a.form == want, str(plan)
    assert not plan.slow(), str(plan)
    assert "in loop '" in str(plan), str(plan)
    built = _check_all(loss, xs, feed, batches=batches)
    # Plan == execution: the per-example graph is the loop rules' (with the
    # shared backward pass of the rules), never a recompute or whole pass.
    for a, g in zip(plan.assignments, built["per_example_gradients"]):
        behind = per_example_reference.forms_behind(g)
        if a.form == "loop-rules":
            assert behind == {"loop-rules", "rules"}, (a.name, behind)
        else:
            assert behind == {"rules"}, (a.name, behind)


def test_microbatch_norms_and_strategy_rules(graph):
    """num_microbatches (the group Gram form of the loop's Outer) and
    strategy='rules', which loop rules satisfy."""
    loss, xs, feed = test_loops.MODELS["keras_gru_sequence"]()
    norms = custagg.per_example_norms(loss, xs, strategy="rules",
                                      num_microbatches=2)
    ref = test_loops.loop_reference(loss, xs, 6)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        fd = feed(6, np.random.default_rng(4))
        got, per_ex = sess.run([norms, ref], fd)
    want = np.sqrt(sum(np.sum(np.square(g.reshape(2, 3, -1).sum(1)), axis=1)
                       for g in per_ex))
    np.testing.assert_allclose(got, want, rtol=RTOL)


@pytest.mark.parametrize("batches", [
    BATCHES, pytest.param(LARGE_BATCHES, marks=pytest.mark.slow)])
def test_float32_hand_lstm(graph, batches):
    """The benchmarks' LSTM (float32, tf.nn.bias_add, tf.split gates)."""
    steps, din, hidden = 4, 3, 5
    x = tf.compat.v1.placeholder(tf.float32, [None, steps, din])
    y = tf.compat.v1.placeholder(tf.int32, [None])
    rng = np.random.default_rng(0)
    kernel = tf.compat.v1.Variable(
        0.4 * rng.normal(size=(din + hidden, 4 * hidden)).astype(np.float32),
        use_resource=True, name="kernel")
    bias = tf.compat.v1.Variable(np.zeros(4 * hidden, np.float32),
                                 use_resource=True, name="bias")
    dense = tf.compat.v1.Variable(
        0.4 * rng.normal(size=(hidden, 3)).astype(np.float32),
        use_resource=True, name="dense")
    x_tm = tf.transpose(x, [1, 0, 2])
    h0 = tf.zeros(tf.stack([tf.shape(x)[0], hidden]))

    def body(t, h, c):
        z = tf.nn.bias_add(tf.matmul(tf.concat([tf.gather(x_tm, t), h], 1),
                                     kernel), bias)
        i, f, g, o = tf.split(z, 4, axis=1)
        c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
        return t + 1, tf.sigmoid(o) * tf.tanh(c), c

    _, h, _ = tf.compat.v1.while_loop(lambda t, h, c: t < steps, body,
                                      (tf.constant(0), h0, h0))
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.matmul(h, dense))
    xs = [kernel, bias, dense]
    assert custagg.plan_per_example(loss, xs).forms() == [
        "loop-rules", "loop-rules", "rules"]

    def feed(b, r):
        return {x: r.normal(size=(b, steps, din)).astype(np.float32),
                y: r.integers(0, 3, size=b)}
    _check_all(loss, xs, feed, batches=batches, rtol=1e-4)


# --------------------------------------------------------------------------
# Refusals: the loop rules never guess.


def _rnn(mix=None, after=None, changing=False, inside=None):
    """A hand-written RNN whose body applies `mix(h)` (a coupling) to the
    new state; `after(loss)` post-processes the loss; with `changing` the
    weight is a loop variable the body updates; `inside(z)` another op on
    the tapped output."""
    x, y = test_loops._inputs()  # pylint: disable=protected-access
    rng = np.random.default_rng(5)
    w = tf.compat.v1.Variable(0.5 * rng.normal(size=(test_loops.D +
                                                     test_loops.H,
                                                     test_loops.H)),
                              use_resource=True, name="cell_w")
    h0 = tf.zeros(tf.stack([tf.shape(x)[0], test_loops.H]), tf.float64)
    if changing:
        def body(t, h, v):
            z = tf.matmul(tf.concat([x[:, t, :], h], axis=1), v)
            return t + 1, tf.tanh(z), v * 0.9
        _, h, _ = tf.compat.v1.while_loop(
            lambda t, h, v: t < test_loops.T, body, [0, h0, w.read_value()])
    else:
        def body(t, h):
            z = tf.matmul(tf.concat([x[:, t, :], h], axis=1), w)
            if inside is not None:
                z = inside(z)
            h = tf.tanh(z)
            if mix is not None:
                h = mix(h)
            return t + 1, h
        _, h = tf.compat.v1.while_loop(lambda t, h: t < test_loops.T, body,
                                       [0, h0])
    loss, head = test_loops._head(h, y)  # pylint: disable=protected-access
    if after is not None:
        loss = after(loss)
    return loss, [w] + head, test_loops._feed(x, y)  # pylint: disable=protected-access


@pytest.mark.parametrize("what,build,names", [
    ("a mean over the batch in the body",
     lambda: _rnn(mix=lambda h: h - tf.reduce_mean(h, axis=0)), "Mean"),
    ("the batch reversed in the body",
     lambda: _rnn(mix=lambda h: tf.reverse(h, [0])), "Reverse"),
    ("a Gram matrix over the batch",
     lambda: _rnn(mix=lambda h: tf.matmul(h, tf.matmul(
         h, h, transpose_a=True))), "MatMul"),
    ("the weight changes inside the loop",
     lambda: _rnn(changing=True), "loop variable"),
    ("random numbers inside the loop",
     lambda: _rnn(inside=lambda z: tf.nn.dropout(z, rate=0.5)),
     "random"),
])
def test_loops_the_rules_cannot_prove_are_refused(graph, what, build, names):
    loss, xs, _ = build()
    plan = custagg.plan_per_example(loss, xs)
    cell = plan.assignments[0]
    assert cell.form != "loop-rules" and cell.strategy != "rules", (
        what, str(plan))
    assert names in cell.reason, (what, cell.reason)
    with pytest.raises(ValueError, match="strategy='rules' cannot"):
        custagg.plan_per_example(loss, xs[:1], strategy="rules")


def test_coupling_after_the_loop_is_certified_and_exact(graph):
    """The loss mixes examples after the loop (a mean of the losses): the
    static proof holds inside the loop only, so the cell weight takes the
    certified loop rules (the plan names the Mean; strategy "rules"
    refuses); the run-time check at the loop's outputs fails at B > 1 and
    the exact form runs: values against the loop reference."""
    loss, xs, feed = _rnn(after=lambda l: l - 0.5 * tf.reduce_mean(l))
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms()[0] == "certified", str(plan)
    assert "Mean" in plan.assignments[0].reason, str(plan)
    with pytest.raises(ValueError, match="strategy='rules' cannot"):
        custagg.plan_per_example(loss, xs[:1], strategy="rules")
    _check_all(loss, xs, feed, batches=(1, 5), coupled=True)


def test_dropout_before_the_loop_keeps_loop_rules(graph):
    """A random op upstream of the loop is read, not rerun, by the rebuilt
    loop: the rules and the reference see the same mask in one run."""
    loss, xs, feed = test_loops.hand_rnn(
        prep=lambda x: tf.nn.dropout(x, rate=0.5))
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms()[:2] == ["loop-rules"] * 2, str(plan)
    got = custagg.per_example_gradients(loss, xs)
    ref = test_loops.loop_reference(loss, xs, 5)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        g, r = sess.run([got, ref], feed(5, np.random.default_rng(2)))
    for a, b in zip(g, r):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-12)


def test_layer_before_a_loop_keeps_its_rules(graph):
    """A Dense layer feeding a Keras LSTM: the coupling check follows the
    batch through the loop body, so the Dense kernel takes rules."""
    x, y = test_loops._inputs()  # pylint: disable=protected-access
    pre = tf.keras.layers.Dense(4, dtype=tf.float64, name="pre")
    lstm = tf.keras.layers.LSTM(test_loops.H, dtype=tf.float64)
    loss, head = test_loops._head(lstm(tf.tanh(pre(x))), y)  # pylint: disable=protected-access
    xs = pre.trainable_weights + lstm.trainable_weights + head
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms()[:2] == ["rules", "rules"], str(plan)
    assert plan.forms()[2:5] == ["loop-rules"] * 3, str(plan)
    _check_all(loss, xs, test_loops._feed(x, y), batches=(1, 5))  # pylint: disable=protected-access


def test_list_descriptors():
    """TensorList items keep their batch axis; a list reaching another op
    mixes."""
    with tf.Graph().as_default():
        t = tf.compat.v1.placeholder(tf.float32, [3, None, 2])
        lst = tf.raw_ops.TensorListFromTensor(
            tensor=t, element_shape=tf.constant([-1, 2]))
        item = tf.raw_ops.TensorListGetItem(
            input_handle=lst, index=0, element_shape=tf.constant([-1, 2]),
            element_dtype=tf.float32)
        stacked = tf.raw_ops.TensorListStack(
            input_handle=lst, element_shape=tf.constant([-1, 2]),
            element_dtype=tf.float32)
        assert batch_axis.propagate(lst.op, 0, 1) == batch_axis.ListOf(0)
        assert batch_axis.propagate(lst.op, 0, 0) is batch_axis.MIXES
        assert batch_axis.propagate(item.op, 0,
                                      batch_axis.ListOf(0)) == 0
        assert batch_axis.propagate(stacked.op, 0,
                                      batch_axis.ListOf(0)) == 1
        other = tf.identity(lst)
        assert batch_axis.propagate(other.op, 0,
                                      batch_axis.ListOf(0)) == \
            batch_axis.ListOf(0)


# --------------------------------------------------------------------------
# v1 control flow (Enter/Exit frames): the same models under
# `disable_v2_behavior`, in a fresh interpreter.

V1_CODE = """
import sys
import tensorflow as tf
tf.compat.v1.disable_v2_behavior()
sys.path.insert(0, "tests")
sys.path.insert(0, "tests/per_example")
import custagg
import test_loop_rules
import test_loops
for name in sys.argv[1].split(","):
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(0)
        loss, xs, feed = test_loops.MODELS[name]()
        assert any(op.type == "Enter" for op in
                   tf.compat.v1.get_default_graph().get_operations())
        plan = custagg.plan_per_example(loss, xs)
        for a in plan.assignments:
            want = ("rules" if a.name.startswith(test_loop_rules.HEAD)
                    else "loop-rules")
            assert a.form == want, str(plan)
        test_loop_rules._check_all(loss, xs, feed)
        print("V1-OK", name)
"""

V1_DEFAULT = ("dynamic_rnn_lstm_seqlen",)


@pytest.mark.parametrize("names", [
    ",".join(V1_DEFAULT),
    pytest.param(",".join(sorted(set(test_loops.MODELS) - set(V1_DEFAULT))),
                 marks=pytest.mark.slow)])
def test_v1_control_flow_loops_take_loop_rules(run_python, names):
    result = run_python(V1_CODE.replace("sys.argv[1]", repr(names)),
                        timeout=1200)
    assert result.stdout.count("V1-OK") == len(names.split(",")), (
        result.stdout[-3000:] + result.stderr[-5000:])


# --------------------------------------------------------------------------
# The loop rules ask the registry: a user's rule applies inside a body.


class _SquaredDifferenceRule(custagg.Rule):
    """`z = (a - c)^2` with `c` `[N]` broadcast over `a` `[B, N]`:
    `g_b = dz_b * 2 (c - a_b)` (a user's rule, `per_example` only)."""

    def unsupported(self, ctx):
        a = ctx.op.inputs[1 - ctx.input_index]
        if ctx.param.shape.rank != 1 or a.shape.rank != 2:
            return "not a [B, N] and [N] pair"
        return None

    def per_example(self, ctx):
        a = ctx.op.inputs[1 - ctx.input_index]
        sign = 1.0 if ctx.input_index == 1 else -1.0
        return sign * 2.0 * (ctx.param[None] - a) * ctx.grad


def _rnn_with_squared_difference():
    """A hand RNN whose body's `(z_t - c)^2` reads a `[H]` variable c."""
    x, y = test_loops._inputs()  # pylint: disable=protected-access
    rng = np.random.default_rng(11)
    w = tf.compat.v1.Variable(0.5 * rng.normal(size=(test_loops.D +
                                                     test_loops.H,
                                                     test_loops.H)),
                              use_resource=True, name="cell_w")
    c = tf.compat.v1.Variable(0.3 * rng.normal(size=(test_loops.H,)),
                              use_resource=True, name="centre")
    h0 = tf.zeros(tf.stack([tf.shape(x)[0], test_loops.H]), tf.float64)

    def body(t, h):
        z = tf.matmul(tf.concat([x[:, t, :], h], axis=1), w)
        return t + 1, tf.tanh(tf.math.squared_difference(z, c))
    _, h = tf.compat.v1.while_loop(lambda t, h: t < test_loops.T, body,
                                   [0, h0])
    loss, head = test_loops._head(h, y)  # pylint: disable=protected-access
    return loss, [w, c] + head, test_loops._feed(x, y)  # pylint: disable=protected-access


def test_user_rule_applies_inside_a_loop_body(graph):
    """With the default rules the centre c has no rule inside the loop (an
    exact O(B) form instead); with a registry holding the user's
    SquaredDifference rule, c takes the loop rules, and every quantity
    matches the loop reference at B in {1, 5, 32, 33} (dynamic batch)."""
    loss, xs, feed = _rnn_with_squared_difference()
    plain = custagg.plan_per_example(loss, xs)
    assert plain.forms()[1] != "loop-rules", str(plain)
    assert "SquaredDifference" in plain.assignments[1].reason, str(plain)

    registry = custagg.default_registry().copy()
    custagg.register_rule("SquaredDifference", registry=registry)(
        _SquaredDifferenceRule)
    plan = custagg.plan_per_example(loss, xs, registry=registry)
    assert plan.forms()[:2] == ["loop-rules", "loop-rules"], str(plan)
    assert "SquaredDifference in loop" in str(plan), str(plan)
    assert not custagg.default_registry().lookup("SquaredDifference")

    clip = tf.compat.v1.placeholder(tf.float64, [])
    weights = tf.compat.v1.placeholder(tf.float64, [None])
    got = {
        "per_example": custagg.per_example_gradients(loss, xs,
                                                     registry=registry),
        "norms": custagg.per_example_norms(loss, xs, registry=registry),
        "clipped": custagg.clipped_gradients(loss, xs, clip,
                                             return_norms=True,
                                             registry=registry),
        "moments": custagg.gradient_second_moments(loss, xs,
                                                   registry=registry)}
    for g in got["per_example"][:2]:
        assert per_example_reference.forms_behind(g) == {
            "loop-rules", "rules"}
    ref = testing.loop_per_example(loss, xs, max(BATCHES))
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for b, small, want in test_loops.sliced_batches(
                sess, ref, feed, BATCHES, seed=3):
            small[clip] = float(np.median(testing.numpy_norms(want)))
            small[weights] = np.linspace(-1.0, 2.0, b)
            values = sess.run(got, small)
            label = "B=%d" % b
            for j, w in enumerate(want):
                testing.assert_close(values["per_example"][j], w, RTOL,
                                     "%s per_example[%d]" % (label, j))
            testing.assert_close(values["norms"], testing.numpy_norms(want),
                                 RTOL, label + " norms")
            sums, norms = testing.numpy_clipped(want, small[clip])
            clipped, clip_norms = values["clipped"]
            testing.assert_close(clip_norms, norms, RTOL, label + " clip")
            for j, s in enumerate(sums):
                testing.assert_close(clipped[j], s, RTOL,
                                     "%s clipped[%d]" % (label, j))
            for j, s in enumerate(testing.numpy_second_moments(want)):
                testing.assert_close(values["moments"][j], s, RTOL,
                                     "%s moments[%d]" % (label, j))
