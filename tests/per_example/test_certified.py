"""The certified rules form (issue 24): rules whose separation the static
batch-axis proof cannot reach, checked at run time by one seeded backward
pass, with the exact form under `tf.cond` on a step whose check fails.

Every value is checked against the loop reference (`custagg.testing`,
one `tf.compat.v1.gradients(loss[i])` per example), float64, with a
dynamic batch fed at B=1 and B=7 (`-m slow`: 32 and 33, at the pfor chunk
size and past it). The batch-axis table is changed per test only, with
pytest's `monkeypatch` on `custagg.batch_axis.table._TABLE` (restored
after the test):

* hiding an innocent op (Tanh) makes the static proof fail where the
  examples are truly apart: the certified form runs, its check passes,
  and the rules' values are returned;
* telling the table that `Roll` keeps rows apart plants a coupling the
  static proof would miss: with Tanh known the plain rules run and are
  wrong (the control: the plant is real); with Tanh hidden the certified
  form runs, its check fails at B=7, and the exact form's value is
  returned.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import testing
from custagg.batch_axis import table as table_lib
from custagg.per_example import engine as engine_lib

RTOL = 1e-9
DEFAULT_BATCHES = (1, 7)
SLOW_BATCHES = (32, 33)
BATCHES = [pytest.param(DEFAULT_BATCHES, id="B1,7"),
           pytest.param(SLOW_BATCHES, id="B32,33", marks=pytest.mark.slow)]

D_IN, HIDDEN, CLASSES = 5, 6, 3


def _model(roll):
    """A two-layer net on a dynamic batch, float64. With `roll`, the hidden
    layer's rows are mixed along the batch (`h + 0.5 * roll(h, 1)`): loss i
    then depends on example i-1's first layer (its W1 and b1 couple the
    examples; W2, b2 and the skip's W3 see the mixed rows as inputs, or
    none, and stay apart)."""
    x = tf.compat.v1.placeholder(tf.float64, [None, D_IN], name="x")
    y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
    init = tf.compat.v1.random_normal_initializer(seed=3, dtype=tf.float64)
    w1 = tf.compat.v1.get_variable("w1", [D_IN, HIDDEN], tf.float64, init)
    b1 = tf.compat.v1.get_variable("b1", [HIDDEN], tf.float64, init)
    w2 = tf.compat.v1.get_variable("w2", [HIDDEN, CLASSES], tf.float64, init)
    b2 = tf.compat.v1.get_variable("b2", [CLASSES], tf.float64, init)
    w3 = tf.compat.v1.get_variable("w3", [D_IN, CLASSES], tf.float64, init)
    h = tf.tanh(tf.matmul(x, w1) + b1)
    if roll:
        h = h + 0.5 * tf.roll(h, shift=1, axis=0)
    # The linear skip keeps a path from x to the loss that avoids Tanh, so
    # the batch region is found with Tanh hidden too.
    logits = tf.matmul(h, w2) + b2 + tf.matmul(x, w3)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=logits)
    return x, y, loss, [w1, b1, w2, b2, w3]


def _hide(monkeypatch, op_type):
    """The table forgets `op_type`: the static proof counts it as mixing."""
    assert op_type in table_lib._TABLE
    monkeypatch.delitem(table_lib._TABLE, op_type)


def _tell_apart(monkeypatch, op_type):
    """The table is told `op_type` keeps rows apart (the batch stays on the
    axis it came in on), true or not."""
    monkeypatch.setitem(table_lib._TABLE, op_type,
                        table_lib.Entry(lambda op, index, axis: axis))


def _certificates(graph):
    """The predicates of the certified forms' `tf.cond`s in `graph`."""
    return [op.inputs[0] for op in graph.get_operations()
            if op.type in ("If", "StatelessIf", "Switch")
            and op.name.split("/")[-1].startswith("certified")]


def _feed(x, y, rng, b):
    """A random batch of b examples for `_model`'s placeholders."""
    return {x: rng.normal(size=[b, D_IN]),
            y: rng.integers(0, CLASSES, size=[b])}


def _run(graph, x, y, loss, xs, batches, extra=None):
    """Runs custagg's per-example gradients, norms and clipped sum next to
    the loop reference at each B; returns {B: values}."""
    clip = tf.compat.v1.placeholder(tf.float64, [])
    fetches = {
        "ref": testing.loop_per_example(loss, xs, max(batches), rows=True),
        "per_example": custagg.per_example_gradients(loss, xs),
        "clipped": custagg.clipped_gradients(loss, xs, clip,
                                             return_norms=True),
    }
    fetches.update(extra or {})
    rng = np.random.default_rng(sum(batches))
    out = {}
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for b in batches:
            feed = _feed(x, y, rng, b)
            feed[clip] = 1.0
            values = sess.run(dict(fetches, ref=fetches["ref"][:b]), feed)
            per_example = [np.stack(col) for col in zip(*values["ref"])]
            feed[clip] = float(np.median(
                testing.numpy_norms(per_example))) or 1.0
            values = sess.run(dict(fetches, ref=fetches["ref"][:b]), feed)
            values["reference"] = per_example
            values["clip"] = feed[clip]
            out[b] = values
    return out


def _check_exact(values, label):
    ref = values["reference"]
    for j, g in enumerate(ref):
        testing.assert_close(values["per_example"][j], g, RTOL,
                             "%s per_example[%d]" % (label, j))
    sums, _ = testing.numpy_clipped(ref, values["clip"])
    clipped, norms = values["clipped"]
    testing.assert_close(norms, testing.numpy_norms(ref), RTOL,
                         label + " norms")
    for j, s in enumerate(sums):
        testing.assert_close(clipped[j], s, RTOL, "%s clipped[%d]" % (label, j))


@pytest.mark.parametrize("batches", BATCHES)
def test_innocent_op_hidden_takes_certified_and_is_exact(
        batches, graph, monkeypatch):
    _hide(monkeypatch, "Tanh")
    x, y, loss, xs = _model(roll=False)
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms() == ["certified", "certified", "rules", "rules", "rules"], \
        str(plan)
    certs = None
    results = _run(graph, x, y, loss, xs, batches)
    certs = _certificates(graph)
    assert certs, "no certified tf.cond in the graph"
    for b, values in results.items():
        _check_exact(values, "hidden Tanh B=%d" % b)
    # The check passes on truly separable rows (so the rules' values ran).
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        rng = np.random.default_rng(0)
        for b in batches:
            feed = _feed(x, y, rng, b)
            assert all(sess.run(certs, feed)), b


@pytest.mark.parametrize("batches", BATCHES)
def test_planted_coupling_is_caught(batches, graph, monkeypatch):
    _tell_apart(monkeypatch, "Roll")
    _hide(monkeypatch, "Tanh")
    x, y, loss, xs = _model(roll=True)
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms() == ["certified", "certified", "rules", "rules", "rules"], \
        str(plan)
    results = _run(graph, x, y, loss, xs, batches)
    for b, values in results.items():
        _check_exact(values, "planted roll B=%d" % b)
    certs = _certificates(graph)
    assert certs
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        rng = np.random.default_rng(1)
        for b in batches:
            feed = _feed(x, y, rng, b)
            # B=1: the roll is the identity, nothing to catch.
            assert all(sess.run(certs, feed)) == (b == 1), b


def test_planted_coupling_fools_the_static_proof(graph, monkeypatch):
    """The control: the plant is real. Told that Roll keeps rows apart,
    the static proof passes, the plain rules run, and they are wrong."""
    _tell_apart(monkeypatch, "Roll")
    x, y, loss, xs = _model(roll=True)
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms() == ["rules"] * 5, str(plan)
    values = _run(graph, x, y, loss, xs, (7,))[7]
    gap = np.max(np.abs(values["per_example"][0] - values["reference"][0]))
    assert gap > 1e-3 * np.max(np.abs(values["reference"][0])), gap


@pytest.mark.parametrize("strategy", ["auto", "pfor"])
def test_roll_model_exact_without_error(strategy, graph, monkeypatch):
    """The tf.roll model, no override: "auto" certifies the first layer
    (whose check then fails at B>1: the exact form runs); asked-for "pfor"
    with Roll unknown to the table takes the copies, whose failed loss
    check now takes the exact form instead of raising InvalidArgumentError.
    (Roll's own entry says a roll along the batch mixes, which makes the
    copies refuse up front: hidden, it is an op the table does not know.)"""
    if strategy == "pfor":
        _hide(monkeypatch, "Roll")
    x, y, loss, xs = _model(roll=True)
    plan = custagg.plan_per_example(loss, xs, strategy=strategy)
    want = "certified" if strategy == "auto" else "recompute"
    assert plan.forms()[:2] == [want, want], str(plan)
    for b, values in _run(graph, x, y, loss, xs, DEFAULT_BATCHES).items():
        _check_exact(values, "roll %s B=%d" % (strategy, b))


def test_plan_says_certified_and_why(graph, monkeypatch):
    _hide(monkeypatch, "Tanh")
    _, _, loss, xs = _model(roll=False)
    text = str(custagg.plan_per_example(loss, xs))
    lines = [l for l in text.splitlines() if "w1" in l or "b1" in l]
    assert len(lines) == 2, text
    for line in lines:
        assert "rules (certified at run time) via" in line, text
        # Why the static proof failed: the op it could not follow.
        assert "Tanh" in line and "coupling" in line, text
    w2 = [l for l in text.splitlines() if "w2" in l][0]
    assert "certified" not in w2 and "rules via MatMul" in w2, text


def test_certificate_tolerances_are_documented():
    # The tolerance the docs state is the one the code uses.
    assert engine_lib.CERTIFICATE_RTOL[tf.float64] == 1e-8
    assert engine_lib.CERTIFICATE_RTOL[tf.float32] == 1e-4
