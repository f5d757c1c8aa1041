"""Regression tests: results that were wrong with no error, and crashes.

Each case is checked for every strategy and every public function against one
`tf.compat.v1.gradients(loss[i])` per example (tests/per_example_reference.py),
with `None` exactly where `tf.compat.v1.gradients` gives `None`:

1. an `Identity` between a variable and its consumer whose gradient is
   overridden (`gradient_override_map`): the rules must not see through it;
   a rule's own op with an overridden gradient is no rule case either;
2. a path through an integer cast: no gradient (None), as in TF;
3. a variable whose only use is under `tf.stop_gradient`: None, no crash;
4. a placeholder as x under "auto" with a dynamic batch of 32 (and 33);
5. `strategy="pfor"` on a Conv2D with explicit padding (TF's pfor converter
   of Conv2DBackpropFilter drops `explicit_paddings`), both pfor forms;
6. a `Reshape` of an embedding table before `tf.gather`: results describe
   the variable's shape (TF's Reshape gradient is dense), not the table's;
7. a convolution with explicit padding that sees no batch data (one image
   held in a variable, broadcast over the batch): its filter and image get
   their per-example gradients through the conv's own gradient under pfor
   (a chain; or, under "pfor", the boundary form's pass back from the add),
   which must not meet TF's pfor fallback that drops `explicit_paddings`
   (fresh randomized seeds 440733 and 740734);
8. a `tf.roll` along a negative axis where pfor runs (a batch coupling's
   whole pass, a boundary pass, a chain, the copies, planned as their
   while loop): TF's pfor converter
   rolls along `axis + 1`, one axis too far for a negative axis (found by
   a review: per-example gradients off by 2.08, norms wrong, no error);
9. a table reached through a gather by constant ids (a chain) with a
   dynamic batch: the chain's pfor was typed with the handle's dtype, and
   the graph then failed in every `session.run`, the initializer's too;
10. a Conv3D whose spatial sizes are known only at run time (two -1 in
   one reshape);
11. a random op inside a loop body (dropout in an RNN cell): no copies.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
import per_example_reference as ref

ALL = ("rules", "auto", "pfor", "loop")


@tf.RegisterGradient("CustaggTestTwice")
def _twice_grad(op, grad):  # pylint: disable=unused-argument
    return 2.0 * grad


@tf.RegisterGradient("CustaggTestMatMulHalf")
def _half_matmul_grad(op, grad):
    a, b = op.inputs
    return (0.5 * tf.matmul(grad, b, transpose_b=True),
            0.5 * tf.matmul(a, grad, transpose_a=True))


def _var(name, shape, dtype=tf.float64, seed=0):
    value = np.random.default_rng(seed).normal(size=shape)
    return tf.compat.v1.get_variable(
        name, initializer=tf.constant(value, dtype), use_resource=True)


def _check(graph, loss, xs, feed, strategies=ALL, functions=ref.FUNCTIONS):
    """Every strategy and function equals the loop, for each fed batch."""
    built = {}
    for s in strategies:
        with tf.name_scope(s):
            built[s] = ref.build_functions(loss, xs, s, functions)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for f in (feed if isinstance(feed, list) else [feed]):
            batch = int(sess.run(tf.shape(loss)[0], f))
            refs = ref.references(sess, loss, xs, f, batch)
            for s, (fetches, weights) in built.items():
                msg = ref.check(sess, loss, xs, f, fetches, weights,
                                label="strategy=%s B=%d" % (s, batch),
                                refs=refs)
                assert msg is None, msg


def _batch(rng, shape, dtype=np.float64):
    return rng.normal(size=shape).astype(dtype)


def test_overridden_identity_is_not_seen_through(graph, rng):
    x = tf.compat.v1.placeholder(tf.float64, [4, 3])
    w = _var("w", [3, 2])
    with graph.gradient_override_map({"Identity": "CustaggTestTwice"}):
        wi = tf.identity(w)
    loss = tf.reduce_sum(tf.square(tf.matmul(x, wi)), 1)
    _check(graph, loss, [w], {x: _batch(rng, [4, 3])})


def test_overridden_identity_in_the_batch_region(graph, rng):
    # The override sits on the path of both x (an input) and w.
    x = tf.compat.v1.placeholder(tf.float64, [5, 3])
    w = _var("w", [3, 2])
    with graph.gradient_override_map({"Identity": "CustaggTestTwice"}):
        h = tf.identity(tf.matmul(x, w))
    loss = tf.reduce_sum(tf.tanh(h), 1)
    with pytest.raises(ValueError, match="Identity.*replaced gradient"):
        custagg.plan_per_example(loss, [w], strategy="rules")
    _check(graph, loss, [w], {x: _batch(rng, [5, 3])},
           strategies=("auto", "pfor", "loop"))


def test_rule_op_with_overridden_gradient_falls_back(graph, rng):
    x = tf.compat.v1.placeholder(tf.float64, [4, 3])
    w = _var("w", [3, 2])
    with graph.gradient_override_map({"MatMul": "CustaggTestMatMulHalf"}):
        z = tf.matmul(x, w)
    loss = tf.reduce_sum(tf.square(z), 1)
    with pytest.raises(ValueError, match="MatMul.*overridden"):
        custagg.plan_per_example(loss, [w], strategy="rules")
    assert custagg.plan_per_example(loss, [w]).strategy_for(w) == "pfor"
    _check(graph, loss, [w], {x: _batch(rng, [4, 3])},
           strategies=("auto", "pfor", "loop"))


@pytest.mark.parametrize("other_use", [False, True])
def test_integer_cast_gives_none(graph, rng, other_use):
    x = tf.compat.v1.placeholder(tf.float64, [4, 3])
    w = _var("w", [3, 2])
    v = _var("v", [3, 2], seed=1)
    wc = tf.cast(tf.cast(w * 5.0, tf.int32), tf.float64)
    loss = tf.reduce_sum(tf.matmul(x, wc) * tf.matmul(x, v), 1)
    if other_use:      # w also reaches the loss on a float path
        loss += tf.reduce_sum(tf.matmul(x, w), 1)
    xs = [w, v]
    assert (tf.compat.v1.gradients(tf.reduce_sum(loss), w)[0] is None) != \
        other_use
    _check(graph, loss, xs, {x: _batch(rng, [4, 3])})


def test_only_use_under_stop_gradient_gives_none(graph, rng):
    x = tf.compat.v1.placeholder(tf.float64, [4, 3])
    w = _var("w", [3, 2])
    loss = tf.reduce_sum(tf.matmul(x, tf.stop_gradient(w)), 1)
    for s in ALL:
        assert custagg.per_example_gradients(loss, [w], strategy=s) == [None]
    _check(graph, loss, [w], {x: _batch(rng, [4, 3])})


def test_stop_gradient_next_to_a_live_use(graph, rng):
    x = tf.compat.v1.placeholder(tf.float64, [4, 3])
    w = _var("w", [3, 2])
    loss = tf.reduce_sum(tf.matmul(x, tf.stop_gradient(w)) *
                         tf.matmul(x, w), 1)
    _check(graph, loss, [w], {x: _batch(rng, [4, 3])})


@pytest.mark.parametrize("model", ["dense", "relu", "input_only"])
def test_placeholder_as_x_with_a_dynamic_batch(graph, rng, model):
    x = tf.compat.v1.placeholder(tf.float64, [None, 3])
    w = _var("w", [3, 2])
    if model == "dense":
        loss = tf.reduce_sum(tf.square(tf.matmul(x, w)), 1)
        xs = [x, w]
    elif model == "relu":
        loss = tf.reduce_sum(tf.square(tf.nn.relu(tf.matmul(x, w))), 1)
        xs = [w, x]
    else:
        loss = tf.reduce_sum(x * x * tf.reduce_sum(w), 1)
        xs = [x]
    feeds = [{x: _batch(rng, [b, 3])}
             for b in ((32, 33, 1) if model == "dense" else (32,))]
    _check(graph, loss, xs, feeds, strategies=("auto",))
    _check(graph, loss, xs, feeds[:1], strategies=("pfor", "loop"),
           functions=("per_example_gradients", "clipped_gradients"))
    with pytest.raises(ValueError, match="strategy='rules'"):
        custagg.per_example_gradients(loss, [x], strategy="rules")


@pytest.mark.parametrize("coupled", [False, True])
def test_pfor_on_conv2d_with_explicit_padding(graph, rng, coupled):
    x = tf.compat.v1.placeholder(tf.float64, [3, 5, 5, 2])
    w = _var("w", [3, 3, 2, 2])
    y = tf.nn.conv2d(x, w, strides=1,
                     padding=[[0, 0], [1, 1], [2, 0], [0, 0]])
    loss = tf.reduce_sum(tf.square(y), [1, 2, 3])
    if coupled:
        # Batch coupling: no boundary form, pfor of the whole pass.
        loss = loss - 0.5 * tf.reduce_mean(loss)
    form = custagg.plan_per_example(loss, [w], strategy="pfor").form_for(w)
    assert form == ("whole-pass" if coupled else "boundary")
    _check(graph, loss, [w], {x: _batch(rng, [3, 5, 5, 2])},
           strategies=("auto", "pfor", "loop") if coupled else ALL)


@pytest.mark.parametrize("batch", [1, 3])
def test_chain_through_conv2d_with_explicit_padding(graph, rng, batch):
    image = tf.compat.v1.Variable(_batch(rng, [1, 4, 4, 2]), name="image",
                                  use_resource=True)
    w = _var("w", [2, 2, 2, 2])
    shared = tf.reshape(tf.nn.conv2d(
        image, w, strides=1, padding=[[0, 0], [1, 0], [0, 2], [0, 0]]),
        [1, -1])                                          # [1, 40]
    table = _var("table", [6, 40], seed=1)
    ids = tf.compat.v1.placeholder(tf.int32, [None, 2])
    h = shared + tf.reduce_sum(tf.gather(table, ids), 1)   # [B, 40]
    loss = tf.reduce_sum(tf.square(h), 1)
    plan = custagg.plan_per_example(loss, [w, image])
    assert "through Conv2D" in str(plan), str(plan)
    assert custagg.plan_per_example(
        loss, [w, image], strategy="pfor").forms() == ["boundary"] * 2
    _check(graph, loss, [w, image, table],
           {ids: rng.integers(0, 6, size=(batch, 2))},
           strategies=("rules", "auto", "pfor"))


def test_reshaped_table_before_gather(graph, rng):
    w = _var("w", [5, 2])
    ids = tf.compat.v1.placeholder(tf.int32, [3, 2])
    e = tf.gather(tf.reshape(w, [10, 1]), ids)
    loss = tf.reduce_sum(tf.square(e), [1, 2])
    _check(graph, loss, [w], {ids: np.array([[1, 3], [7, 9], [0, 0]])})
    grads = custagg.clipped_gradients(loss, [w], 1.0, strategy="rules")
    g = grads[0]
    shape = g.dense_shape if hasattr(g, "dense_shape") else tf.shape(g)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        assert list(sess.run(shape, {ids: [[1, 3], [7, 9], [0, 0]]})) == \
            [5, 2]


def test_gather_on_the_variable_stays_sparse(graph):
    # Not reshaped: TF gives IndexedSlices of the variable's shape; so do we.
    w = _var("w", [5, 2])
    ids = tf.compat.v1.placeholder(tf.int32, [3, 2])
    loss = tf.reduce_sum(tf.square(tf.gather(w, ids)), [1, 2])
    g, = custagg.clipped_gradients(loss, [w], 1.0, strategy="rules")
    assert isinstance(g, tf.IndexedSlices)
    _check(graph, loss, [w], {ids: np.array([[1, 3], [4, 4], [0, 2]])})


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("coupled", [False, True])
def test_roll_along_a_negative_axis(graph, rng, batch, coupled):
    x = tf.compat.v1.placeholder(tf.float64, [None, 4, 3])
    w = _var("w", [3, 5])
    h = tf.einsum("btd,dk->btk", x, w)
    if coupled:
        h = h - tf.reduce_mean(h, 0)          # a batch coupling (whole pass)
    h = tf.roll(h, shift=1, axis=-2)          # along time, within examples
    loss = tf.reduce_sum(tf.sin(h), [1, 2])
    _check(graph, loss, [w], {x: _batch(rng, [batch, 4, 3])},
           strategies=("auto", "pfor", "loop") if coupled else ALL)


@pytest.mark.parametrize("batch", [1, 3])
def test_roll_after_a_loop_plans_the_copies_loop(graph, rng, batch):
    """The per-example copies (a loop with no rule inside) with a roll along
    a negative axis after them: planned as the copies' while loop, so the
    plan says what runs (pfor of the copies would roll the wrong axis)."""
    steps = 4
    x = tf.compat.v1.placeholder(tf.float64, [None, steps, 3])
    power = _var("power", [3])
    x_tm = tf.transpose(x, [1, 0, 2])

    def body(t, h):
        k = tf.math.pow(1.0 + tf.square(tf.gather(x_tm, t)), power)
        return t + 1, 0.5 * h + 0.5 * tf.tanh(k - 0.5)

    _, h = tf.compat.v1.while_loop(lambda t, h: t < steps, body,
                                   (tf.constant(0), tf.zeros_like(x[:, 0])))
    h = tf.roll(h, shift=1, axis=-1)
    loss = tf.reduce_sum(tf.sin(h) * tf.range(1.0, 4.0, dtype=tf.float64), 1)
    for strategy in ("auto", "pfor"):
        plan = custagg.plan_per_example(loss, [power], strategy=strategy)
        assert plan.forms() == ["recompute-loop"], str(plan)
        assert "pfor converts wrongly" in str(plan), str(plan)
    _check(graph, loss, [power], {x: _batch(rng, [batch, steps, 3])},
           strategies=("auto", "pfor", "loop"))


@pytest.mark.parametrize("batch", [1, 3])
def test_chain_through_a_roll_of_a_weight(graph, rng, batch):
    x = tf.compat.v1.placeholder(tf.float64, [None, 4, 5])
    table = _var("table", [4, 5])
    h = tf.tanh(x) * tf.roll(table, shift=1, axis=-1)
    loss = tf.reduce_sum(tf.sin(h), [1, 2])
    _check(graph, loss, [table], {x: _batch(rng, [batch, 4, 5])})


@pytest.mark.parametrize("batch", [1, 3])
def test_chain_through_a_gather_by_constant_ids_dynamic_batch(graph, rng,
                                                               batch):
    x = tf.compat.v1.placeholder(tf.float64, [None, 4, 5])
    positions = _var("positions", [6, 5])
    h = tf.tanh(x) + tf.gather(positions, [0, 2, 2, 5])
    loss = tf.reduce_sum(tf.sin(h), [1, 2])
    _check(graph, loss, [positions], {x: _batch(rng, [batch, 4, 5])})


@pytest.mark.parametrize("batch", [1, 2])
def test_conv3d_with_run_time_spatial_sizes(graph, rng, batch):
    x = tf.compat.v1.placeholder(tf.float64, [None, None, None, None, 2])
    k = _var("k", [2, 2, 2, 2, 3])
    y = tf.nn.conv3d(x, k, strides=[1, 1, 1, 1, 1], padding="SAME")
    loss = tf.reduce_sum(tf.square(y), [1, 2, 3, 4])
    _check(graph, loss, [k], [{x: _batch(rng, [batch, 3, 4, 3, 2])},
                              {x: _batch(rng, [batch, 2, 2, 5, 2])}])


@pytest.mark.parametrize("batch", [1, 3])
def test_random_op_inside_a_loop_body_refuses_the_copies(graph, rng, batch):
    """11. Dropout inside an RNN cell (`DropoutWrapper` in `dynamic_rnn`):
    the random op sits in the loop's body, where the copies' check for
    random ops did not look. The copies were planned, drew new masks, failed
    their run-time check at every step and then ran the exact form anyway
    (11.7x the plain gradient in a review's seq2seq model; 2.8x with the
    exact form planned)."""
    tf1 = tf.compat.v1
    keep = tf1.placeholder_with_default(tf.constant(0.7, tf.float64), [])
    x = tf1.placeholder(tf.float64, [None, 4, 3])
    cell = tf1.nn.rnn_cell.DropoutWrapper(
        tf1.nn.rnn_cell.GRUCell(5, dtype=tf.float64), output_keep_prob=keep)
    out, _ = tf1.nn.dynamic_rnn(cell, x, dtype=tf.float64)
    loss = tf.reduce_sum(tf.square(out), [1, 2])
    xs = tf1.trainable_variables()
    plan = custagg.plan_per_example(loss, xs)
    assert not any(f.startswith("recompute") for f in plan.forms()), str(plan)
    assert "inside 'rnn/while'" in str(plan) or "inside loop" in str(plan)
    # Masks of ones (keep = 1) make the reference loop's runs agree.
    _check(graph, loss, xs, {x: _batch(rng, [batch, 4, 3]), keep: 1.0},
           strategies=("auto",))
