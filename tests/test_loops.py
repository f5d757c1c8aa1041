"""Per-example gradients through loops (RNNs): the per-example copies.

Every model here has a dynamic batch (`[None, T, D]` placeholders) and its
weights inside a `while_loop` body. Auto takes the loop rules there
(tests/per_example/test_loop_rules.py); these tests turn them off, as for a loop they
cannot read (v1 control flow, an op they do not know), so custagg copies
each example's forward pass and vectorizes the copies ("recompute", pfor),
or runs them in a while loop ("recompute-loop"). Each form is compared with
the loop reference: one `tf.compat.v1.gradients(loss[i], xs)` per example
(TF's own traversal), at B in {1, 5, 32, 33}.

The reference graph is built once per model for the largest batch (33
examples); a batch of B is its first B examples. That is the loop reference
of the smaller batch too because these models never mix examples (each
example's loss depends on its own rows only).
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg.per_example.forms import loop_rules
from custagg.per_example.forms import Refused
from custagg import testing
from custagg.per_example.forms import copies

import per_example_reference

# The default run checks B in {1, 5}; `-m slow` adds {32, 33} (the loop
# reference builds one backward while loop per example).
BATCHES = (1, 5)
LARGE_BATCHES = (32, 33)
T, D, H = 3, 2, 3
RTOL = 1e-7


# --------------------------------------------------------------------------
# Models: (loss [B], xs, feed_fn(b, rng) -> feed dict). float64 throughout.


def _inputs():
    x = tf.compat.v1.placeholder(tf.float64, [None, T, D], name="x")
    y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
    return x, y


def _feed(x, y, extra=None):
    def feed(b, rng):
        out = {x: rng.normal(size=(b, T, D)), y: rng.integers(0, 2, size=b)}
        if extra is not None:
            out.update(extra(b, rng))
        return out
    return feed


def _head(h, y, name="readout"):
    dense = tf.compat.v1.layers.Dense(2, name=name, dtype=tf.float64)
    logits = dense(h)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                          logits=logits)
    return loss, dense.trainable_weights


def dynamic_rnn_lstm(sequence_length=False):
    x, y = _inputs()
    lengths = None
    extra = None
    if sequence_length:
        lengths = tf.compat.v1.placeholder(tf.int32, [None], name="lengths")
        extra = (lambda b, rng: {lengths: rng.integers(1, T + 1, size=b)})
    cell = tf.compat.v1.nn.rnn_cell.LSTMCell(H, dtype=tf.float64)
    out, state = tf.compat.v1.nn.dynamic_rnn(cell, x, dtype=tf.float64,
                                             sequence_length=lengths)
    loss, head = _head(state.h, y)
    return loss, cell.trainable_weights + head, _feed(x, y, extra)


def keras_rnn(kind, sequences):
    x, y = _inputs()
    layer_type = {"lstm": tf.keras.layers.LSTM,
                  "gru": tf.keras.layers.GRU}[kind]
    layer = layer_type(H, return_sequences=sequences, dtype=tf.float64)
    h = layer(x)
    if sequences:
        h = tf.reduce_sum(tf.tanh(h), axis=1)       # every step counts
    loss, head = _head(h, y)
    return loss, layer.trainable_weights + head, _feed(x, y)


def hand_rnn(reuse_outside=False, prep=None, x=None):
    """`tf.compat.v1.while_loop` over time; with `reuse_outside` the cell
    weight also maps the final state to the logits; `prep(x)` is what the
    loop reads (dropout, a reshape)."""
    placeholder, y = _inputs()
    x = placeholder if x is None else x
    seen = x if prep is None else prep(x)
    rng = np.random.default_rng(3)
    w = tf.compat.v1.Variable(0.5 * rng.normal(size=(D + H, H)),
                              use_resource=True, name="cell_w")
    b = tf.compat.v1.Variable(0.1 * rng.normal(size=(H,)), use_resource=True,
                              name="cell_b")
    h0 = tf.zeros(tf.stack([tf.shape(seen)[0], H]), tf.float64)

    def body(t, h):
        z = tf.matmul(tf.concat([seen[:, t, :], h], axis=1), w) + b
        return t + 1, tf.tanh(z)

    _, h = tf.compat.v1.while_loop(lambda t, h: t < T, body, [0, h0])
    xs = [w, b]
    if reuse_outside:
        h = h + tf.matmul(tf.concat([seen[:, -1, :], h], axis=1), w)
    loss, head = _head(h, y)
    return loss, xs + head, _feed(x, y)


def stacked_lstm():
    x, y = _inputs()
    first = tf.keras.layers.LSTM(H, return_sequences=True, dtype=tf.float64)
    second = tf.keras.layers.LSTM(H, dtype=tf.float64)
    h = second(first(x))
    loss, head = _head(h, y)
    return (loss, first.trainable_weights + second.trainable_weights + head,
            _feed(x, y))


MODELS = {
    "dynamic_rnn_lstm": dynamic_rnn_lstm,
    "dynamic_rnn_lstm_seqlen": lambda: dynamic_rnn_lstm(True),
    "keras_lstm_last": lambda: keras_rnn("lstm", False),
    "keras_lstm_sequence": lambda: keras_rnn("lstm", True),
    "keras_gru_last": lambda: keras_rnn("gru", False),
    "keras_gru_sequence": lambda: keras_rnn("gru", True),
    "hand_while_rnn": hand_rnn,
    "weight_inside_and_outside": lambda: hand_rnn(True),
    "stacked_lstm": stacked_lstm,
}


# --------------------------------------------------------------------------
# Checks


def loop_reference(loss, xs, batch):
    """`[batch, *x.shape]` per x: `custagg.testing.loop_per_example`."""
    return testing.loop_per_example(loss, xs, batch)


def sliced_batches(sess, ref, feed, batches, seed):
    """`(b, feed of b examples, their loop-reference rows)` for each b in
    `batches`: the reference (`loop_reference` for the largest batch) runs
    once, and the first b rows of a batch are the gradients of a batch of b
    because these models keep examples apart."""
    big = feed(max(batches), np.random.default_rng(seed))
    ref_val = sess.run(ref, big)
    for b in batches:
        yield b, {k: v[:b] for k, v in big.items()}, [r[:b] for r in ref_val]


O_B_FORMS = {"recompute", "recompute-loop", "loop-rules"}


def check_model(build, forms=("recompute", "recompute-loop"),
                batches=BATCHES, seed=0, sums=True, pfor=True):
    """Builds the model in the default graph; per-example gradients in each
    form (None: what auto takes, which must be O(B)), and with `sums` norms
    and clipped sums in the first form, against the loop reference. With
    `pfor` False, "recompute" must fall back to "recompute-loop" (a loop
    whose iterations depend on the example). Returns the plans."""
    loss, xs, feed = build()
    ref = loop_reference(loss, xs, max(batches))
    fetch, texts, built = {}, [], {}
    clip = tf.compat.v1.placeholder(tf.float64, [])
    norms = clipped = None
    for form in forms:
        with _forcing(form):
            # The plan is what the build starts from; a fallback the build
            # takes (pfor failing on the copies) is recorded by the engine
            # and shows in the graph's scopes, never in the plan.
            plan = custagg.plan_per_example(loss, xs)
            got = custagg.per_example_gradients(loss, xs)
            texts.append(plan)
            forms_seen = set(plan.forms()) - {"rules"}
            ran = {a.form: a.form for a in plan.assignments}
            if form is None:
                assert forms_seen <= O_B_FORMS and forms_seen, str(plan)
            elif form == "recompute" and not pfor:
                assert forms_seen == {"recompute-loop"}, str(plan)
                assert "condition on batch data" in str(plan), str(plan)
            elif form == "recompute-loop" and pfor:
                # Planned as the vectorized copies; pfor refused at build.
                assert forms_seen <= {"recompute", "recompute-loop"}, \
                    str(plan)
                ran = {"recompute": "recompute-loop",
                       "recompute-loop": "recompute-loop"}
                forms_seen = {"recompute-loop"}
            else:
                assert forms_seen == {form}, str(plan)
            for a, g in zip(plan.assignments, got):
                behind = per_example_reference.forms_behind(g)
                if a.form == "loop-rules":
                    behind -= {"rules"}     # the rules' shared pass
                assert behind == {ran.get(a.form, a.form)}, (a.name,
                                                             str(plan))
            fetch[form] = got
            built[form] = forms_seen
            if norms is None and sums:
                clipped, norms = custagg.clipped_gradients(
                    loss, xs, clip, return_norms=True)
    for form, got in fetch.items():
        for g in got:
            # Each form's graph holds only its own ops (and the rules').
            assert per_example_reference.forms_behind(g) - {"rules"} <= (
                built[form] if form else O_B_FORMS), form
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for b, small, want in sliced_batches(sess, ref, feed, batches, seed):
            for form, got in fetch.items():
                for j, (g, w) in enumerate(zip(sess.run(got, small), want)):
                    np.testing.assert_allclose(
                        g, w, rtol=RTOL, atol=RTOL * np.abs(w).max(),
                        err_msg="%s B=%d %s" % (form, b, xs[j].name))
            if not sums:
                continue
            want_sums, want_norms = custagg.testing.numpy_clipped(
                want, float(np.median(custagg.testing.numpy_norms(want))))
            small[clip] = float(np.median(custagg.testing.numpy_norms(want)))
            n, c = sess.run([norms, clipped], small)
            np.testing.assert_allclose(n, want_norms, rtol=RTOL,
                                       err_msg="norms B=%d" % b)
            for j, (g, w) in enumerate(zip(c, want_sums)):
                np.testing.assert_allclose(
                    g, w, rtol=RTOL, atol=RTOL * np.abs(w).max(),
                    err_msg="clipped B=%d %s" % (b, xs[j].name))
    return texts


class _forcing(object):
    """Makes the engine take `form` for every loop weight: "recompute" by
    turning the loop rules off (what a loop they cannot read gets),
    "recompute-loop" by also making pfor fail (the fallback path auto
    takes when pfor cannot convert an op)."""

    def __init__(self, form):
        self.form = form
        self.saved = copies.per_example_pfor, loop_rules.find

    def __enter__(self):
        if self.form is None:
            return
        loop_rules.find = lambda *args, **kwargs: (
            None, "loop rules off (test)")
        if self.form == "recompute-loop":
            def fail(*args, **kwargs):
                raise Refused("forced off by the test")
            copies.per_example_pfor = fail

    def __exit__(self, *exc):
        copies.per_example_pfor, loop_rules.find = self.saved


# --------------------------------------------------------------------------
# Tests


# Models whose copies pfor vectorizes (the others take the while loop:
# dynamic_rnn with sequence_length runs a different number of steps per
# example, which pfor's while-loop converter does not handle).
PFOR_MODELS = frozenset(MODELS) - {"dynamic_rnn_lstm_seqlen"}
# Norms and clipped sums are checked on these (the rest costs build time).
SUMS_MODELS = frozenset(["dynamic_rnn_lstm_seqlen", "keras_lstm_last",
                         "weight_inside_and_outside"])


# The default run checks this one at B in {1, 5} (each model costs up to
# half a minute of graph building); `python -m pytest -m slow
# tests/test_loops.py` runs every model at both batch sets.
DEFAULT_MODELS = frozenset(["hand_while_rnn"])


@pytest.mark.parametrize("name, batches", [
    pytest.param(n, b, id=n + ("-large" if b == LARGE_BATCHES else ""),
                 marks=() if n in DEFAULT_MODELS and b == BATCHES
                 else pytest.mark.slow)
    for n in sorted(MODELS) for b in (BATCHES, LARGE_BATCHES)])
def test_loop_models_match_the_loop_reference(graph, name, batches):
    plans = check_model(MODELS[name], sums=name in SUMS_MODELS,
                        pfor=name in PFOR_MODELS, batches=batches)
    text = str(plans[0])
    assert "O(B)" in text and "O(B^2)" not in text, text
    assert "copies of the forward pass" in text, text
    if name in PFOR_MODELS:
        assert "recompute" in plans[0].forms(), text
    else:
        # Planned as the while loop from the start (a static check); for
        # the others check_model saw the build fall back to it (the graph's
        # scopes), the plan staying as returned.
        assert "while loop over per-example copies" in str(plans[1]), \
            plans[1]


def test_plan_says_why_and_what_costs(graph):
    loss, xs, _ = hand_rnn()
    assert custagg.plan_per_example(loss, xs).forms() == [
        "loop-rules", "loop-rules", "rules", "rules"]
    with _forcing("recompute"):
        plan = custagg.plan_per_example(loss, xs)
    assert plan.forms() == ["recompute", "recompute", "rules", "rules"]
    text = str(plan)
    assert "per-example copies of the forward pass" in text, text
    assert "cell_w" in text and "no boundary form" in text, text
    assert not plan.slow()


def test_random_ops_are_refused_with_their_name(graph):
    """Dropout between the inputs and the loss: a copy would draw a new
    mask, so the plan keeps the exact whole pass and says why."""
    loss, xs, _ = hand_rnn(prep=lambda x: tf.nn.dropout(x, rate=0.5))
    with _forcing("recompute"):
        plan = custagg.plan_per_example(loss, xs[:2])
    assert plan.forms() == ["whole-pass"] * 2, str(plan)
    assert "random" in str(plan) and "RandomUniform" in str(plan), str(plan)


def test_batch_coupling_is_refused(graph):
    """A mean over the batch inside the forward pass: one example alone has
    another loss, so no copy (pfor takes the whole pass); "auto" certifies
    the loop rules, apart inside the loop, at the loop's outputs (the check
    fails at B > 1 and the exact form runs: tests/per_example/
    test_loop_rules.py)."""
    loss, xs, feed = hand_rnn()
    centred = loss - tf.reduce_mean(loss)
    plan = custagg.plan_per_example(centred, xs[:2])
    assert plan.forms() == ["certified"] * 2, str(plan)
    assert "mixes examples" in str(plan), str(plan)
    plan = custagg.plan_per_example(centred, xs[:2], strategy="pfor")
    assert plan.forms() == ["whole-pass"] * 2, str(plan)
    assert "mixes examples" in str(plan), str(plan)


def test_unknown_rank_input_is_refused(graph):
    x = tf.compat.v1.placeholder(tf.float64, None, name="shapeless")
    loss, xs, _ = hand_rnn(x=x, prep=lambda x: tf.reshape(x, [-1, T, D]))
    with _forcing("recompute"):
        plan = custagg.plan_per_example(loss, xs[:2])
    assert "shapeless" in str(plan) and "unknown rank" in str(plan), str(plan)


def test_a_loop_counted_from_shapes_only_does_not_vary(graph):
    """A loop condition that reads the batch only through ops that read a
    shape (`op_kinds.SHAPE_ONLY`: `Shape`, `OnesLike`, ...) runs the same
    number of iterations in every per-example copy, so pfor may take the
    copies (`copies.varying_loop` is None); one that reads the values
    varies. (copies' own set lacked `ZerosLike`/`OnesLike`: such a loop
    was sent to the while loop over examples.)"""
    x = tf.compat.v1.placeholder(tf.float32, [None, 3])

    def loss_of(n):
        _, acc = tf.while_loop(lambda i, a: i < n,
                               lambda i, a: (i + 1, a + x), [0, x])
        return tf.reduce_sum(acc, 1)

    def varying(loss):
        return copies.varying_loop(copies.Forward(
            [x], graph.get_operations(), loss, None, None))

    by_shape = loss_of(tf.cast(tf.reduce_sum(tf.raw_ops.OnesLike(x=x)),
                               tf.int32))
    assert varying(by_shape) is None
    by_value = loss_of(tf.cast(tf.reduce_max(x), tf.int32))
    assert varying(by_value) is not None


def test_copies_that_disagree_with_the_batch_take_the_exact_form(graph):
    """An interaction no analysis sees (a batch sum inside a loop body): the
    run-time check (the copies' losses against the batch's, or the
    certificate) sees it, and the step takes the exact form under
    `tf.cond` instead of returning wrong gradients or raising (issue
    24)."""
    x, y = _inputs()
    w = tf.compat.v1.Variable(np.ones((D, 2)), use_resource=True, name="w")
    # A loop whose body sums over the batch: not known to the analysis.
    _, total = tf.compat.v1.while_loop(
        lambda i, t: i < 1,
        lambda i, t: (i + 1, t + tf.reduce_sum(tf.matmul(x[:, 0, :], w))),
        [0, tf.zeros([], tf.float64)])
    z = tf.matmul(x[:, 0, :], w) * total
    loss, _ = _head(z, y)
    got = custagg.per_example_gradients(loss, [w])
    ref = testing.loop_per_example(loss, [w], 4)
    rng = np.random.default_rng(1)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got_v, ref_v = sess.run([got, ref], _feed(x, y)(4, rng))
    assert np.abs(ref_v[0]).max() > 0
    testing.assert_close(got_v[0], ref_v[0], 1e-9, "w")


V1_CODE = """
import sys
import numpy as np
import tensorflow as tf
tf.compat.v1.disable_v2_behavior()
sys.path.insert(0, "tests")
import test_loops
for seqlen in (False, True):
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(0)
        plans = test_loops.check_model(
            lambda: test_loops.dynamic_rnn_lstm(seqlen), forms=(None,))
        assert any(op.type == "Enter"
                   for op in tf.compat.v1.get_default_graph().get_operations())
        print("V1-OK", seqlen, str(plans[0]).replace(chr(10), " | "))
"""


@pytest.mark.slow
def test_v1_control_flow_dynamic_rnn(run_python):
    result = run_python(V1_CODE, timeout=900)
    assert result.stdout.count("V1-OK") == 2, (result.stdout[-3000:] +
                                               result.stderr[-5000:])
