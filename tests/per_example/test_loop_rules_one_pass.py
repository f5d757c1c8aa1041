"""The loop rules in one forward and one backward pass of each loop
(issue 26; per_example/forms/loop_rules.py, `OnePass`).

The per-example graph rebuilds each v2 loop once on the whole batch with
its taps and computes the loss again from the rebuilt loops; the rules'
one backward pass differentiates that loss. So when only per-example
quantities are fetched the original loop never runs: the graph behind the
fetches holds, per loop, the tapped rebuild and its gradient loop only (the eps
lists start empty, so no loop counts the iterations first). What cannot be
copied after the loop (a random op drawing by more than shapes, a side
effect) and v1 frames keep the two-pass build,
whose values are checked here too; dropout after the loop (drawn by the
output's shape) keeps its mask: the copy reads the original draw; certified xs next to the loop rules (bilstm_tagger's
projection on folded rows) take the one pass, checked on its graph. Values: the loop reference (one tf.gradients per
example), float64, B in {1, 7} (`-m slow`: {32, 33}).
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import op_kinds
from custagg.graph import walks

import test_loop_rules
import test_loops
from benchmarks import zoo_models as tf1_models
from custagg.per_example import engine as engine_lib

BATCHES = (1, 7)
LARGE_BATCHES = (32, 33)
V2 = sorted(test_loops.MODELS)
FLOATS = frozenset([tf.float16, tf.bfloat16, tf.float32, tf.float64])


def _loops(graph):
    return [op for op in graph.get_operations()
            if op.type in op_kinds.V2_LOOPS]


def _carries_floats(loop):
    return any(tf.as_dtype(d) in FLOATS for d in loop.get_attr("T"))


def _clipped_fetches(loss, xs):
    sums, norms = custagg.clipped_gradients(loss, xs, 0.5,
                                            return_norms=True)
    return [tf.convert_to_tensor(s) for s in sums if s is not None] + [norms]


def _reached(fetches, before):
    """(original loops the fetches run, new loops they run)."""
    behind = walks.upstream(fetches, control=True)
    loops = [op for op in behind if op.type in op_kinds.V2_LOOPS]
    return ([op for op in loops if op in before],
            [op for op in loops if op not in before])


@pytest.mark.parametrize("name", V2)
def test_clipped_sums_run_one_forward_and_one_backward_loop(graph, name):
    loss, xs, _ = test_loops.MODELS[name]()
    before = set(_loops(graph))
    originals, new = _reached(_clipped_fetches(loss, xs), before)
    assert not originals, [op.name for op in originals]
    # Per original loop: the tapped rebuild and its gradient, both on the
    # float state.
    assert len(new) == 2 * len(before), [op.name for op in new]
    with_floats = [op for op in new if _carries_floats(op)]
    assert len(with_floats) == 2 * len(before), [op.name for op in new]


@pytest.mark.parametrize("name", V2)
def test_pushed_rows_take_no_zeros_in_the_backward_pass(graph, name):
    """The rows a rebuilt loop pushes for its taps (the lists it starts
    from `EmptyTensorList`) are no input of its gradient loop: no
    `[T, B, ...]` list of zeros is made for them and popped at every step
    (`loop_rebuild._as_bits`)."""
    loss, xs, _ = test_loops.MODELS[name]()
    zeros = []
    for op in walks.upstream(_clipped_fetches(loss, xs), control=True):
        if op.type != "ZerosLike" or op.inputs[0].dtype != tf.variant:
            continue
        loop, k = op.inputs[0].op, op.inputs[0].value_index
        start = loop.inputs[k].op
        # The eps lists start empty too; their gradient is the one list
        # the backward loop pushes dz onto (ZerosLike of the empty list).
        if loop.type in op_kinds.V2_LOOPS and \
                start.type == "EmptyTensorList" and \
                not start.get_attr("element_dtype").is_floating:
            zeros.append(op.name)
    assert not zeros, zeros


def test_the_executed_step_runs_no_original_loop(graph):
    """The same from the run's step stats: the nodes the executor ran."""
    loss, xs, feed = test_loops.MODELS["keras_lstm_sequence"]()
    before = _loops(graph)
    fetches = _clipped_fetches(loss, xs)
    meta = tf.compat.v1.RunMetadata()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(fetches, feed(3, np.random.default_rng(0)),
                 options=tf.compat.v1.RunOptions(
                     trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
                 run_metadata=meta)
    ran = {n.node_name for d in meta.step_stats.dev_stats
           for n in d.node_stats}
    # Grappler lowers each While to a frame: one LoopCond node per loop
    # run, named under the While's name.
    loops = {name.split("/LoopCond")[0] for name in ran
             if "/LoopCond" in name}
    assert len(before) == 1
    assert before[0].name not in loops, loops
    # The tapped loop and its gradient loop.
    assert len(loops) == 2, loops


@pytest.mark.parametrize("name,batches", [
    pytest.param(n, b, marks=() if b == BATCHES else pytest.mark.slow,
                 id="%s-%s" % (n, "large" if b == LARGE_BATCHES else "small"))
    for n in ("hand_while_rnn", "keras_lstm_sequence", "stacked_lstm",
              "dynamic_rnn_lstm_seqlen", "weight_inside_and_outside")
    for b in (BATCHES, LARGE_BATCHES)])
def test_one_pass_matches_the_loop(graph, name, batches):
    loss, xs, feed = test_loops.MODELS[name]()
    before = set(_loops(graph))
    built = test_loop_rules._check_all(  # pylint: disable=protected-access
        loss, xs, feed, batches=batches)
    fetches = [tf.convert_to_tensor(t) for t in
               built["per_example_gradients"] if t is not None]
    assert not _reached(fetches, before)[0]


def _embedded_rnn():
    """An embedding below the loop: its rule's gradient comes back through
    the rebuilt loop (bilstm_tagger's layout, small)."""
    ids = tf.compat.v1.placeholder(tf.int32, [None, test_loops.T], "ids")
    y = tf.compat.v1.placeholder(tf.int32, [None], "y")
    rng = np.random.default_rng(5)
    table = tf.compat.v1.Variable(rng.normal(size=(6, test_loops.D)),
                                  use_resource=True, name="table")
    x = tf.nn.embedding_lookup(table, ids)
    layer = tf.keras.layers.GRU(test_loops.H, dtype=tf.float64)
    loss, head = test_loops._head(  # pylint: disable=protected-access
        layer(x), y)

    def feed(b, r):
        return {ids: r.integers(0, 6, size=(b, test_loops.T)),
                y: r.integers(0, 2, size=b)}
    return loss, [table] + layer.trainable_weights + head, feed


@pytest.mark.parametrize("batches", [
    BATCHES, pytest.param(LARGE_BATCHES, marks=pytest.mark.slow)])
def test_rules_below_the_loop_take_the_rebuilt_loops_gradient(graph,
                                                              batches):
    loss, xs, feed = _embedded_rnn()
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms()[:4] == ["rules"] + ["loop-rules"] * 3, str(plan)
    before = set(_loops(graph))
    built = test_loop_rules._check_all(  # pylint: disable=protected-access
        loss, xs, feed, batches=batches)
    fetches = [tf.convert_to_tensor(t) for t in
               built["per_example_gradients"] if t is not None]
    originals, new = _reached(fetches, before)
    assert not originals
    # The tapped rebuild and its gradient.
    assert len(new) == 2, [op.name for op in new]


def _dropout_after_loop():
    x, y = test_loops._inputs()  # pylint: disable=protected-access
    rng = np.random.default_rng(3)
    w = tf.compat.v1.Variable(
        0.5 * rng.normal(size=(test_loops.D + test_loops.H, test_loops.H)),
        use_resource=True, name="cell_w")
    h0 = tf.zeros(tf.stack([tf.shape(x)[0], test_loops.H]), tf.float64)

    def body(t, h):
        return t + 1, tf.tanh(tf.matmul(tf.concat([x[:, t, :], h], 1), w))

    _, h = tf.compat.v1.while_loop(lambda t, h: t < test_loops.T, body,
                                   [0, h0])
    h = tf.nn.dropout(h, rate=0.4, seed=7)
    loss, head = test_loops._head(h, y)  # pylint: disable=protected-access
    return loss, [w] + head, test_loops._feed(x, y)  # pylint: disable=W0212


def _random_ops(fetches):
    return [op for op in walks.upstream(fetches, control=True)
            if op.type in op_kinds.RANDOM]


@pytest.mark.parametrize("batches", [
    BATCHES, pytest.param(LARGE_BATCHES, marks=pytest.mark.slow)])
def test_dropout_after_the_loop_keeps_its_mask_in_one_pass(graph, batches):
    """Dropout after the loop draws by the loop output's shape only: the
    one pass reads the original draw (the mask the loss uses: no second
    RandomUniform) instead of falling back to two passes. So the loop's
    backward runs once, the rebuilt loop's (no second tapped rebuild, no
    gradient of the original loop); the original loop runs forward only,
    for the shape the mask is drawn at. Values: the reference's, fetched
    in the same run (one mask)."""
    loss, xs, feed = _dropout_after_loop()
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms()[0] == "loop-rules", str(plan)
    before = set(_loops(graph))
    randoms = set(_random_ops([loss]))
    assert len(before) == 1 and len(randoms) == 1
    sums, norms = custagg.clipped_gradients(loss, xs, 0.3,
                                            return_norms=True)
    per_example = custagg.per_example_gradients(loss, xs)
    fetches = [norms] + [tf.convert_to_tensor(t) for t in sums]
    originals, new = _reached(fetches, before)
    # The tapped rebuild and its gradient: the two-pass build would add a
    # second rebuild and its gradient.
    assert len(new) == 2, [op.name for op in new]
    assert len([op for op in new if _carries_floats(op)]) == 2
    assert originals == list(before), "no forward of the original loop?"
    assert set(_random_ops(fetches)) == randoms, "the dropout was copied"
    refs = {b: test_loops.loop_reference(loss, xs, b) for b in batches}
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for b in batches:
            _assert_matches(sess.run([per_example, norms, sums, refs[b]],
                                     feed(b, np.random.default_rng(b))),
                            0.3)


def _assert_matches(got, clip):
    """Per-example gradients, norms and clipped sums (at `clip`) against
    the reference's per-example gradients, as one `sess.run` gave them."""
    per_example, norms, sums, want = got
    for g, w in zip(per_example, want):
        np.testing.assert_allclose(g, w, rtol=1e-7, atol=1e-12)
    want_norms = np.sqrt(sum(np.sum(np.square(w.reshape(len(w), -1)), 1)
                             for w in want))
    np.testing.assert_allclose(norms, want_norms, rtol=1e-7)
    factors = clip / np.maximum(want_norms, clip)
    for g, w in zip(sums, want):
        np.testing.assert_allclose(g, np.tensordot(factors, w, axes=1),
                                   rtol=1e-7, atol=1e-12)


def test_fetching_the_loss_too(graph):
    """The user's loss next to the clipped sums: the original forward runs
    for the loss (fine), the sums are unchanged."""
    loss, xs, feed = test_loops.MODELS["hand_while_rnn"]()
    fetches = _clipped_fetches(loss, xs)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        fd = feed(5, np.random.default_rng(2))
        alone = sess.run(fetches, fd)
        both = sess.run(fetches + [loss], fd)
    for a, b in zip(alone, both):
        np.testing.assert_array_equal(a, b)


def _float_condition():
    """A loop whose condition reads a float loop variable (a step count kept
    as a float): its iterations cannot be counted without the loop itself,
    and need not be (the eps lists start empty)."""
    x, y = test_loops._inputs()  # pylint: disable=protected-access
    rng = np.random.default_rng(4)
    w = tf.compat.v1.Variable(
        0.5 * rng.normal(size=(test_loops.D + test_loops.H, test_loops.H)),
        use_resource=True, name="cell_w")
    h0 = tf.zeros(tf.stack([tf.shape(x)[0], test_loops.H]), tf.float64)

    def body(t, s, h):
        h = tf.tanh(tf.matmul(tf.concat([x[:, t, :], h], 1), w))
        return t + 1, s + 1.0, h

    _, _, h = tf.compat.v1.while_loop(
        lambda t, s, h: s < test_loops.T - 0.5, body,
        [0, tf.constant(0.0, tf.float64), h0])
    loss, head = test_loops._head(h, y)  # pylint: disable=protected-access
    return loss, [w] + head, test_loops._feed(x, y)  # pylint: disable=W0212


def test_a_condition_on_float_state_takes_one_pass(graph):
    loss, xs, feed = _float_condition()
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms()[0] == "loop-rules", str(plan)
    before = set(_loops(graph))
    built = test_loop_rules._check_all(  # pylint: disable=protected-access
        loss, xs, feed, batches=BATCHES)
    fetches = [tf.convert_to_tensor(t) for t in
               built["per_example_gradients"] if t is not None]
    originals, new = _reached(fetches, before)
    assert not originals and len(new) == 2, [op.name for op in new]


@pytest.mark.skipif(not tf1_models.has_tf1_layers(),
                    reason="the v1 RNN cells need the tf-keras package")
def test_certified_xs_next_to_the_loop_rules_take_one_pass(graph):
    """bilstm_tagger (small, float64): an embedding below two loops, a
    projection on `[B*T, 2H]` rows after them (certified at run time). The
    certificate and the rules read the recomputed graph; values are the
    loop reference's (B in {1, 7})."""
    model = tf1_models.bilstm_tagger(tf.float64, np.random.default_rng(0))
    plan = custagg.plan_per_example(model.loss, model.xs)
    assert "certified" in plan.forms() and "loop-rules" in plan.forms(), \
        str(plan)
    assert engine_lib.Engine(plan, 32).shared.one_pass() is not None
    test_loop_rules._check_all(  # pylint: disable=protected-access
        model.loss, model.xs, lambda b, r: model.feed(r, b),
        batches=BATCHES)


def _rnn_with_folded_projection():
    """A per-token projection written by hand after a dynamic_rnn with a
    static T: `reshape(h, [-1, H]) @ w` then `reshape(.., [-1, T, C])`,
    a per-token sparse softmax summed over T. The MatMul's `[B*T]` rows are
    proved example-major on the original graph; its copy after the rebuilt
    loop must be too (the rebuilt loop's outputs lost the static T, so the
    rule took its B*T rows for examples and failed at run time)."""
    t, classes = test_loops.T, 3
    x = tf.compat.v1.placeholder(tf.float64, [None, t, test_loops.D], "x")
    y = tf.compat.v1.placeholder(tf.int32, [None, t], "y")
    cell = tf.compat.v1.nn.rnn_cell.BasicRNNCell(test_loops.H,
                                                 dtype=tf.float64)
    out, _ = tf.compat.v1.nn.dynamic_rnn(cell, x, dtype=tf.float64)
    rng = np.random.default_rng(11)
    w = tf.compat.v1.Variable(rng.normal(size=(test_loops.H, classes)),
                              use_resource=True, name="proj")
    h = tf.math.softplus(out)
    logits = tf.reshape(tf.matmul(tf.reshape(h, [-1, test_loops.H]), w),
                        [-1, t, classes])
    losses = tf.compat.v1.losses.sparse_softmax_cross_entropy(
        y, logits, reduction=tf.compat.v1.losses.Reduction.NONE)

    def feed(b, r):
        return {x: r.normal(size=(b, t, test_loops.D)),
                y: r.integers(0, classes, size=(b, t))}
    return tf.reduce_sum(losses, 1), cell.trainable_weights + [w], feed


@pytest.mark.parametrize("batches", [
    BATCHES, pytest.param(LARGE_BATCHES, marks=pytest.mark.slow)])
def test_a_folded_projection_after_the_rebuilt_loop(graph, batches):
    loss, xs, feed = _rnn_with_folded_projection()
    plan = custagg.plan_per_example(loss, xs)
    assert [a.form for a in plan.assignments] == [
        "loop-rules", "loop-rules", "rules"], str(plan)
    before = set(_loops(graph))
    test_loop_rules._check_all(  # pylint: disable=protected-access
        loss, xs, feed, batches=batches)
    assert not _reached(_clipped_fetches(loss, xs), before)[0]


@pytest.mark.parametrize("steps", [0, 1, test_loops.T])
@pytest.mark.parametrize("two_pass", [False, True], ids=["one", "two"])
def test_a_loop_that_runs_no_step(graph, steps, two_pass):
    """The steps fed at run time, 0 included: the loop rules' lists are
    then empty and the weights' per-example gradients zero (TF's own
    gradient too). In one pass and in the two-pass fallback (a random draw
    by the loop's output after it, whose mask both the loss and the
    reference read in one run)."""
    _check_fed_steps(graph, steps, two_pass, two_pass)


@pytest.mark.parametrize("steps", [0, 1, test_loops.T])
def test_a_v1_frame_that_runs_no_step(graph, control_flow_v1, steps):
    """The same in a v1 frame (two passes, eps `[T, B, ...]` zeros with at
    least one row: TF's v1 gradient of reads from an empty eps fails)."""
    del control_flow_v1
    _check_fed_steps(graph, steps, False, None)


def _check_fed_steps(graph, steps, two_pass, runs_original):
    x, y = test_loops._inputs()  # pylint: disable=protected-access
    n = tf.compat.v1.placeholder_with_default(steps, [], name="steps")
    rng = np.random.default_rng(6)
    w = tf.compat.v1.Variable(
        0.5 * rng.normal(size=(test_loops.D + test_loops.H, test_loops.H)),
        use_resource=True, name="cell_w")
    b = tf.compat.v1.Variable(0.1 * rng.normal(size=(test_loops.H,)),
                              use_resource=True, name="cell_b")
    h0 = tf.fill(tf.stack([tf.shape(x)[0], test_loops.H]),
                 tf.constant(0.3, tf.float64))

    def body(t, h):
        z = tf.matmul(tf.concat([x[:, t, :], h], axis=1), w)
        return t + 1, tf.tanh(tf.nn.bias_add(z, b))

    _, h = tf.compat.v1.while_loop(lambda t, h: t < n, body, [0, h0])
    if two_pass:
        h = h * tf.random.uniform(tf.shape(h) + tf.cast(h[0, 0] * 0, tf.int32),
                                  0.5, 1.5, tf.float64, seed=3)
    loss, head = test_loops._head(h, y)  # pylint: disable=protected-access
    xs = [w, b] + head
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms()[:2] == ["loop-rules"] * 2, str(plan)
    before = set(_loops(graph))
    sums, norms = custagg.clipped_gradients(loss, xs, 0.4, return_norms=True)
    per_example = custagg.per_example_gradients(loss, xs)
    # Two passes run the original loop, one pass does not.
    originals, _ = _reached([norms], before)
    if runs_original is not None:       # (a v1 frame is no While op)
        assert bool(originals) == runs_original, originals
    ref = test_loops.loop_reference(loss, xs, 7)
    feed = test_loops._feed(x, y)  # pylint: disable=protected-access
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for batch in (1, 7):
            ref_b = ref if batch == 7 else test_loops.loop_reference(
                loss, xs, batch)
            got = sess.run([per_example, norms, sums, ref_b],
                           feed(batch, np.random.default_rng(batch)))
            _assert_matches(got, 0.4)
            if steps == 0:
                assert not np.any(got[0][0]) and not np.any(got[0][1])
