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
  returned;
* two certified first layers whose static proofs stop at different ops
  (a hidden Softplus, a real roll) are two groups: the apart one keeps its
  rules while the coupled one takes the exact form; xs stopped at the same
  op share one exact form;
* rule rows that cannot be examples (a concat with a fixed-size block as
  nce_loss gathers, when the gather rule does not read the split; sampled
  ids, Unique's ids, an unread fold) are refused at plan time
  (`forms/rows.py`), with the reason in the plan; the block sliced as
  nce_loss slices it is on rules (`gather.NceSplit`);
* loop rules proved apart inside a dynamic_rnn but not after it (a hidden
  Softplus) are certified at the loop's stacked outputs: a roll after the
  loop fails the check at B > 1 and the exact form runs;
* a projection on `tf.reshape(rnn_out, [-1, H])` (rules on `[B*T]` rows of
  a fold whose example-major order is proved) is certified, its check
  passes and the rules' values are returned (the exact form replaced by a
  wrong one shows it never ran); a roll of those rows by one row fails
  the check at B > 1 and the exact form runs; a time-major fold stays
  refused;
* an embedding gather of fed ids that the walk back from the loss never
  reached (ptb_lm's shape: gather -> while loop -> a reshape by the ids'
  own B -> loss; by hand and the benchmark's model itself) is a rule
  consumer, not a batch-free chain, and is certified: its check passes
  and the rules' values are returned (the exact form replaced by a wrong
  one); rolled along the batch before the loop, its check fails at B > 1
  and the exact form runs; gathered rows that are not the loss's B at a
  step fail the check (no run-time error); ops on constants, variables
  and scalar feeds still chain.
"""

import os
import re

import numpy as np
import pytest
import tensorflow as tf

import custagg
import per_example_reference
from custagg import testing
from custagg.batch_axis import table as table_lib
from custagg.per_example import certificate as certificate_lib
from custagg.per_example import engine as engine_lib
from custagg.per_example.forms import rows as rows_lib

from benchmarks import zoo_models as tf1_models

RTOL = 1e-9
DEFAULT_BATCHES = per_example_reference.DEFAULT_BATCHES
SLOW_BATCHES = per_example_reference.SLOW_BATCHES
BATCHES = per_example_reference.BATCHES

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


def _checks(graph, oks, x, y, batches, seed, feed_fn=None):
    """{b: the certificates `oks` run on a random feed of b examples}
    (`feed_fn(rng, b)`, default `_model`'s)."""
    feed_fn = feed_fn or (lambda rng, b: _feed(x, y, rng, b))
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        rng = np.random.default_rng(seed)
        return {b: sess.run(oks, feed_fn(rng, b)) for b in batches}


def _run(graph, x, y, loss, xs, batches, extra=None, feed_fn=None,
         per_example=True):
    """Runs custagg's per-example gradients (unless not `per_example`),
    norms and clipped sum next to the loop reference at each B; returns
    {B: values}. `feed_fn(rng, b)`: the feed of b examples (default
    `_model`'s, on `x` and `y`)."""
    clip = tf.compat.v1.placeholder(loss.dtype, [])
    fetches = {
        "ref": testing.loop_per_example(loss, xs, max(batches), rows=True),
        "clipped": custagg.clipped_gradients(loss, xs, clip,
                                             return_norms=True),
    }
    if per_example:
        fetches["per_example"] = custagg.per_example_gradients(loss, xs)
    fetches.update(extra or {})
    rng = np.random.default_rng(sum(batches))
    out = {}
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for b in batches:
            feed = feed_fn(rng, b) if feed_fn else _feed(x, y, rng, b)
            values = per_example_reference.run_at_median_clip(
                sess, dict(fetches, ref=fetches["ref"][:b]), feed, clip)
            values["reference"] = per_example_reference.stacked(
                values["ref"])
            values["clip"] = feed[clip]
            out[b] = values
    return out


def _check_exact(values, label):
    per_example_reference.assert_exact(values, label, RTOL)


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
    for b, oks in _checks(graph, certs, x, y, batches, seed=0).items():
        assert all(oks), b


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
    lines = [l for l in text.splitlines() if l.startswith("  w1") or
             l.startswith("  b1")]
    assert len(lines) == 2, text
    for line in lines:
        assert "rules (certified at run time) via" in line, text
    # Why the static proof failed, once: the op it could not follow, and
    # the variables it holds up.
    causes = text.split("why not a cheaper form")[1].splitlines()
    assert [l for l in causes if "Tanh" in l and "static proof" in l], text
    assert [l for l in causes if "holds up: w1:0, b1:0" in l], text
    w2 = [l for l in text.splitlines() if l.startswith("  w2")][0]
    assert "certified" not in w2 and "rules via MatMul" in w2, text


def test_certificate_tolerances_are_documented():
    # The tolerances docs/strategies.md states are the ones the code uses.
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs",
                        "strategies.md")
    with open(path) as f:
        text = " ".join(f.read().split())
    found = re.search(r"with `rtol` (\S+) for float64 and (\S+) for float32",
                      text)
    assert found, "docs/strategies.md no longer states the tolerances"
    assert certificate_lib.CERTIFICATE_RTOL[tf.float64] == float(found.group(1))
    assert certificate_lib.CERTIFICATE_RTOL[tf.float32] == float(found.group(2))


def test_weak_coupling_fails_the_check(graph, monkeypatch):
    """A coupling far below float32's resolution but far above float64's
    rounding (loss i reads example i-1's hidden row with weight 1e-9) must
    fail the float64 check, and the exact form then gives the loop's values
    to 1e-12. Found by a fresh randomized seed (640329: an in-batch
    log-sum-exp whose off-diagonal softmax weights were ~1e-9), which a
    float64 tolerance of 1e-8 let through with a 1.6e-7 error in a clipped
    sum."""
    _hide(monkeypatch, "Roll")
    x = tf.compat.v1.placeholder(tf.float64, [None, D_IN], name="x")
    y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
    init = tf.compat.v1.random_normal_initializer(seed=3, dtype=tf.float64)
    w1 = tf.compat.v1.get_variable("w1", [D_IN, HIDDEN], tf.float64, init)
    w2 = tf.compat.v1.get_variable("w2", [HIDDEN, CLASSES], tf.float64, init)
    w3 = tf.compat.v1.get_variable("w3", [D_IN, CLASSES], tf.float64, init)
    h = tf.tanh(tf.matmul(x, w1))
    h = h + 1e-9 * tf.roll(h, shift=1, axis=0)
    logits = tf.matmul(h, w2) + tf.matmul(x, w3)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                          logits=logits)
    xs = [w1, w2, w3]
    assert custagg.plan_per_example(loss, xs).forms()[0] == "certified"
    results = _run(graph, x, y, loss, xs, (7,))
    for b, oks in _checks(graph, _certificates(graph), x, y, (7,),
                          seed=1).items():
        assert not all(oks), b
    values = results[7]
    for j, g in enumerate(values["reference"]):
        testing.assert_close(values["per_example"][j], g, 1e-12,
                             "weak coupling per_example[%d]" % j)


# --------------------------------------------------------------------------
# One cond per group: a failing check sends only its own group to the exact
# form.


def _two_branch_model():
    """Two certified first layers side by side, float64, dynamic batch:
    `wa` behind Softplus (hidden from the table by the tests: truly apart),
    `wb` behind a roll of its activations along the batch (truly coupled at
    B > 1); `w2` reads their sum and `w3` is a linear skip (both static
    rules)."""
    x = tf.compat.v1.placeholder(tf.float64, [None, D_IN], name="x")
    y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
    init = tf.compat.v1.random_normal_initializer(seed=5, dtype=tf.float64)
    wa = tf.compat.v1.get_variable("wa", [D_IN, HIDDEN], tf.float64, init)
    wb = tf.compat.v1.get_variable("wb", [D_IN, HIDDEN], tf.float64, init)
    w2 = tf.compat.v1.get_variable("w2", [HIDDEN, CLASSES], tf.float64, init)
    w3 = tf.compat.v1.get_variable("w3", [D_IN, CLASSES], tf.float64, init)
    ha = tf.math.softplus(tf.matmul(x, wa))
    hb = tf.tanh(tf.matmul(x, wb))
    hb = hb + 0.5 * tf.roll(hb, shift=1, axis=0)
    logits = tf.matmul(ha + hb, w2) + tf.matmul(x, w3)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=logits)
    return x, y, loss, [wa, wb, w2, w3]


@pytest.mark.parametrize("batches", BATCHES)
def test_only_the_coupled_group_takes_the_exact_form(
        batches, graph, monkeypatch):
    _hide(monkeypatch, "Softplus")
    x, y, loss, xs = _two_branch_model()
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms() == ["certified", "certified", "rules", "rules"], \
        str(plan)
    a_apart, a_coupled = plan.assignments[:2]
    # Their static proofs stopped at different ops: two groups, two conds.
    assert a_apart.blocker.type == "Softplus", str(plan)
    assert a_coupled.blocker.type == "Roll", str(plan)
    engine = engine_lib.Engine(plan, 32)
    assert engine.coupled_group(a_apart) == [a_apart]
    assert engine.coupled_group(a_coupled) == [a_coupled]
    oks = [engine.certificate(a_apart), engine.certificate(a_coupled)]
    results = _run(graph, x, y, loss, xs, batches)
    for b, values in results.items():
        _check_exact(values, "two branches B=%d" % b)
    for b, (ok_apart, ok_coupled) in _checks(graph, oks, x, y, batches,
                                             seed=2).items():
        # wa keeps its rules; only wb (at B > 1, where the roll mixes)
        # takes the exact form.
        assert ok_apart, b
        assert ok_coupled == (b == 1), b


def test_a_group_builds_one_exact_form(graph, monkeypatch):
    """w1 and b1 stop at the same hidden Tanh: one group, one cond whose
    exact branch is built once for both (and each x keeps its rules where
    its own check holds)."""
    _tell_apart(monkeypatch, "Roll")
    _hide(monkeypatch, "Tanh")
    x, y, loss, xs = _model(roll=True)
    plan = custagg.plan_per_example(loss, xs)
    engine = engine_lib.Engine(plan, 32)
    w1, b1 = plan.assignments[:2]
    assert engine.coupled_group(w1) == [w1, b1]
    norms = [engine.squared_norms(a) for a in (w1, b1)]
    outer = [op for op in graph.get_operations()
             if op.type in ("If", "StatelessIf")
             and op.name.split("/")[-1].startswith("certified")
             and not op.name.split("/")[-1].startswith("certified_x")]
    assert len(outer) == 1, [op.name for op in outer]
    reference = testing.loop_per_example(loss, xs[:2], 7)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got, ref = sess.run([norms, reference],
                            _feed(x, y, np.random.default_rng(4), 7))
    for g, r in zip(got, ref):
        testing.assert_close(g, np.sum(np.square(r.reshape(7, -1)), 1), RTOL,
                             "group norms")


def test_coupled_embedding_is_exact_either_way(graph):
    """A certified embedding table (its clipped sum IndexedSlices) and a
    bias, behind a roll: their checks pass at B=1 and fail at B=7, so both
    branches of their conds return slices; values exact either way."""
    x = tf.compat.v1.placeholder(tf.float64, [None, D_IN], name="x")
    y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
    init = tf.compat.v1.random_normal_initializer(seed=9, dtype=tf.float64)
    table = tf.compat.v1.get_variable("emb", [CLASSES + 2, D_IN], tf.float64,
                                      init)
    bias = tf.compat.v1.get_variable("bias", [D_IN], tf.float64, init)
    w = tf.compat.v1.get_variable("w", [D_IN, 1], tf.float64, init)
    e = tf.nn.embedding_lookup(table, y) + bias         # [B, D]
    e = e + 0.5 * tf.roll(e, shift=1, axis=0)
    loss = tf.reduce_sum(tf.tanh(e * x), 1) + tf.squeeze(tf.matmul(x, w), 1)
    xs = [table, bias, w]
    plan = custagg.plan_per_example(loss, xs)
    # table and bias: one group (both stop at the roll), each x its own
    # inner cond where the group's check fails.
    assert plan.forms() == ["certified", "certified", "rules"], str(plan)
    for b, values in _run(graph, x, y, loss, xs,
                          DEFAULT_BATCHES).items():
        _check_exact(values, "coupled embedding B=%d" % b)
    certs = _certificates(graph)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        rng = np.random.default_rng(3)
        for b in DEFAULT_BATCHES:
            assert all(sess.run(certs, _feed(x, y, rng, b))) == (b == 1), b


# --------------------------------------------------------------------------
# Plan-time refusal: rule rows that cannot be examples.

VOCAB, BLOCK = 9, (0, 3, 5)


def _fixed_block_model(split=False):
    """A table gathered by `concat([labels, (0, 3, 5)])`, as nce_loss
    gathers its true and sampled rows: the first B rows are the examples'
    own (a dot with x), the last 3 a block every example meets (logits
    against x). Float64, dynamic batch. With `split`, the rows are sliced
    at `tf.shape(labels)[0]` as nce_loss slices them (the gather rule reads
    the split, `gather.NceSplit`); else at `tf.size(labels)`, which it does
    not read."""
    x = tf.compat.v1.placeholder(tf.float64, [None, D_IN], name="x")
    y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
    init = tf.compat.v1.random_normal_initializer(seed=7, dtype=tf.float64)
    table = tf.compat.v1.get_variable("table", [VOCAB, D_IN], tf.float64,
                                      init)
    w = tf.compat.v1.get_variable("w", [D_IN, 1], tf.float64, init)
    ids = tf.concat([y, tf.constant(BLOCK, tf.int32)], 0)
    rows = tf.nn.embedding_lookup(table, ids)           # [B + 3, D]
    batch = tf.shape(y)[0] if split else tf.size(y)
    own = tf.slice(rows, [0, 0], tf.stack([batch, -1]))
    block = tf.slice(rows, tf.stack([batch, 0]), [-1, -1])
    logits = tf.matmul(x, block, transpose_b=True)      # [B, 3]
    # The labels' own term makes them a batch source the analysis finds
    # (so the gather is batch data, not a batch-free chain).
    loss = (tf.reduce_sum(x * own, 1) + tf.reduce_logsumexp(logits, 1) +
            tf.squeeze(tf.matmul(x, w), 1) + 0.01 * tf.cast(y, tf.float64))
    return x, y, loss, [table, w]


@pytest.mark.parametrize("batches", BATCHES)
def test_fixed_block_rows_are_refused_at_plan_time(batches, graph):
    x, y, loss, xs = _fixed_block_model()
    plan = custagg.plan_per_example(loss, xs)
    table = plan.assignments[0]
    assert table.form != "certified", str(plan)
    assert "no certified rules" in table.reason, str(plan)
    assert "block of 3 rows" in table.reason, str(plan)
    assert plan.forms()[1] == "rules", str(plan)

    def feed(rng, b):
        return {x: rng.normal(size=[b, D_IN]),
                y: rng.integers(0, VOCAB, size=[b])}
    for b, values in _run(graph, x, y, loss, xs, batches,
                          feed_fn=feed).items():
        _check_exact(values, "fixed block B=%d" % b)


@pytest.mark.parametrize("batches", BATCHES)
def test_fixed_block_split_as_nce_is_on_rules(batches, graph):
    """The same rows sliced as nce_loss slices them: the gather rule splits
    the examples' rows from the shared block (each example's gradient on
    the block its own row of the logits' gradient), exact on rules."""
    x, y, loss, xs = _fixed_block_model(split=True)
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms() == ["rules", "rules"], str(plan)

    def feed(rng, b):
        return {x: rng.normal(size=[b, D_IN]),
                y: rng.integers(0, VOCAB, size=[b])}
    for b, values in _run(graph, x, y, loss, xs, batches,
                          feed_fn=feed).items():
        _check_exact(values, "split block B=%d" % b)


def _rows_of(t):
    return rows_lib.non_example_rows(t, 0, tf.zeros([3]))


def test_non_example_rows_reads_the_graph(graph):
    """What `rows.non_example_rows` refuses (sampled ids, Unique's ids, a
    fold of the batch with another axis) and what it leaves to the run-time
    check (a plain batch, ids of [B, T], a fold it cannot read)."""
    table = tf.zeros([20, 4])
    labels = tf.compat.v1.placeholder(tf.int64, [None, 1])
    sampled, _, _ = tf.random.log_uniform_candidate_sampler(
        labels, 1, 5, True, 20)
    ids = tf.concat([tf.reshape(labels, [-1]), sampled], 0)
    why = _rows_of(tf.gather(table, ids))
    assert why is not None and "LogUniformCandidateSampler" in why, why
    unique, _ = tf.unique(tf.reshape(labels, [-1]))
    why = _rows_of(tf.gather(table, unique))
    assert why is not None and "Unique" in why, why
    # A fold of two axes is read either way at run time (example- or
    # time-major); of three, its order is not read: refused.
    seq = tf.compat.v1.placeholder(tf.float32, [None, None, 4])
    folded = tf.matmul(tf.reshape(seq, [-1, 4]), tf.zeros([4, 2]))
    assert _rows_of(folded) is None
    assert rows_lib.fold_of(folded, 0, tf.zeros([3])).either
    grid = tf.compat.v1.placeholder(tf.float32, [None, None, None, 4])
    folded = tf.matmul(tf.reshape(grid, [-1, 4]), tf.zeros([4, 2]))
    why = _rows_of(folded)
    assert why is not None and "fold the batch" in why, why
    # Rows a run-time check may well map to examples: not refused.
    assert _rows_of(tf.gather(table, tf.reshape(labels, [-1]))) is None
    tokens = tf.compat.v1.placeholder(tf.int32, [None, None])
    assert _rows_of(tf.gather(table, tokens)) is None
    unit = tf.compat.v1.placeholder(tf.float32, [None, 1, 4])
    assert _rows_of(tf.matmul(tf.reshape(unit, [-1, 4]),
                              tf.zeros([4, 2]))) is None
    # Static row counts: refused only when both are known and differ.
    assert rows_lib.non_example_rows(tf.zeros([4, 2]), 0,
                                     tf.zeros([3])) is not None
    assert rows_lib.non_example_rows(tf.zeros([3, 2]), 0,
                                     tf.zeros([3])) is None


# --------------------------------------------------------------------------
# Loop rules: proved apart inside the loop, certified after it.

STEPS = 3


def _rnn_model(roll):
    """dynamic_rnn (a tanh cell) whose output sequence passes a Softplus
    (hidden by the tests) and, with `roll`, a roll along the batch, summed
    over time into a dense head. Float64, dynamic batch."""
    x = tf.compat.v1.placeholder(tf.float64, [None, STEPS, D_IN], name="x")
    y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
    cell = tf.compat.v1.nn.rnn_cell.BasicRNNCell(HIDDEN, dtype=tf.float64)
    out, _ = tf.compat.v1.nn.dynamic_rnn(cell, x, dtype=tf.float64)
    h = tf.reduce_sum(tf.math.softplus(out), 1)              # [B, H]
    if roll:
        h = h + 0.5 * tf.roll(h, shift=1, axis=0)
    init = tf.compat.v1.random_normal_initializer(seed=11, dtype=tf.float64)
    w = tf.compat.v1.get_variable("head", [HIDDEN, CLASSES], tf.float64, init)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.matmul(h, w))
    return x, y, loss, cell.trainable_weights + [w]


# The default run: the rolled model at B in {1, 7} (the check passes at
# B=1, fails at B=7); `-m slow`: the apart model (passing at every B) and
# B in {32, 33}.
@pytest.mark.parametrize("roll", [
    pytest.param(False, id="apart", marks=pytest.mark.slow),
    pytest.param(True, id="rolled")])
@pytest.mark.parametrize("batches", BATCHES)
def test_loop_rules_are_certified_after_the_loop(
        batches, roll, graph, monkeypatch):
    """The cell's weights: the static proof holds inside the loop and stops
    at the hidden Softplus after it, so the certified form checks the
    loop's stacked outputs at run time. Apart: the check passes and the
    loop rules' values are returned; rolled: it fails at B > 1 and the
    exact form's are."""
    _hide(monkeypatch, "Softplus")
    x, y, loss, xs = _rnn_model(roll)
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms() == ["certified", "certified", "rules"], str(plan)
    assert "in loop '" in str(plan), str(plan)
    engine = engine_lib.Engine(plan, 32)
    oks = [engine.certificate(a) for a in plan.assignments[:2]]

    def feed(rng, b):
        return {x: rng.normal(size=[b, STEPS, D_IN]),
                y: rng.integers(0, CLASSES, size=[b])}
    # Norms and clipped sums (the per-example gradients' cond is the same
    # code, checked on the models above; building it again here doubles
    # the cost of the loop's exact form).
    for b, values in _run(graph, x, y, loss, xs, batches, feed_fn=feed,
                          per_example=False).items():
        _check_exact(values, "rnn roll=%s B=%d" % (roll, b))
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        rng = np.random.default_rng(6)
        for b in batches:
            got = sess.run(oks, feed(rng, b))
            assert all(got) == (not roll or b == 1), (b, got)


# --------------------------------------------------------------------------
# Rules on the rows of a fold: a projection on `tf.reshape(rnn_out, [-1, H])`.

FOLD_STEPS = 4


def _fold_model(roll=False, time_major=False):
    """A tagger's head: dynamic_rnn (a tanh cell) on `[B, T, D]` (dynamic B
    and T), its outputs reshaped to `[B*T, H]` rows, a projection
    `rows @ W + b`, reshaped back to `[B, T, C]` by `tf.shape(h)[1]` (the
    static proof stops there), a per-token softmax cross-entropy summed per
    sequence. With `roll`, the `[B*T, C]` rows are rolled by one row
    before the reshape back: the last token of example b feeds example
    b+1's first (a coupling across the examples' rows of one fold; at B=1
    it stays inside the one example). With `time_major`, the outputs are
    transposed to `[T, B, H]` before the fold: row r is example r mod B,
    an order the fold's proof does not read. Float64; xs are W and b."""
    x = tf.compat.v1.placeholder(tf.float64, [None, None, D_IN], name="x")
    y = tf.compat.v1.placeholder(tf.int32, [None, None], name="y")
    cell = tf.compat.v1.nn.rnn_cell.BasicRNNCell(HIDDEN, dtype=tf.float64)
    h, _ = tf.compat.v1.nn.dynamic_rnn(cell, x, dtype=tf.float64)
    init = tf.compat.v1.random_normal_initializer(seed=5, dtype=tf.float64)
    w = tf.compat.v1.get_variable("proj_w", [HIDDEN, CLASSES], tf.float64,
                                  init)
    b = tf.compat.v1.get_variable("proj_b", [CLASSES], tf.float64, init)
    steps = tf.shape(h)[1]
    if time_major:
        h = tf.transpose(h, [1, 0, 2])
    pred = tf.matmul(tf.reshape(h, [-1, HIDDEN]), w) + b
    if roll:
        pred = tf.roll(pred, shift=1, axis=0)
    if time_major:
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.transpose(y),
            logits=tf.reshape(pred, [steps, -1, CLASSES]))      # [T, B]
        return x, y, tf.reduce_sum(losses, 0), [w, b]
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.reshape(pred, [-1, steps, CLASSES]))
    return x, y, tf.reduce_sum(losses, 1), [w, b]


def _wrong_exact_form(monkeypatch):
    """The exact form (per-example gradients, and the weighted pass of the
    clipped sum) gives 1e3 everywhere: a step that took it shows."""
    def fill(self, a, lead):
        return tf.fill(tf.concat([lead, tf.shape(a.x)], 0),
                       tf.constant(1e3, tf.float64))
    monkeypatch.setattr(
        engine_lib.Engine, "exact", lambda self, group: [
            fill(self, a, tf.shape(self.loss)[:1]) for a in group])
    monkeypatch.setattr(
        engine_lib.Engine, "weighted_pass", lambda self, group, weights: [
            fill(self, a, tf.zeros([0], tf.int32)) for a in group])


def _rules_run_and_checks_hold(graph, monkeypatch, x, y, loss, xs, batches,
                               feed, label):
    """With the exact form wrong (`_wrong_exact_form`), every value is
    still exact and every certificate holds, at each B."""
    _wrong_exact_form(monkeypatch)
    for b, values in _run(graph, x, y, loss, xs, batches,
                          feed_fn=feed).items():
        _check_exact(values, "%s B=%d" % (label, b))
    certs = _certificates(graph)
    assert certs, "no certified tf.cond in the graph"
    for b, oks in _checks(graph, certs, x, y, batches, seed=2,
                          feed_fn=feed).items():
        assert all(oks), b


def _fold_feed(x, y):
    def feed(rng, b):
        # A shorter T at the first B: a T frozen at the first run shows.
        t = FOLD_STEPS - 1 if b == 1 else FOLD_STEPS
        return {x: rng.normal(size=[b, t, D_IN]),
                y: rng.integers(0, CLASSES, size=[b, t])}
    return feed


@pytest.mark.parametrize("time_major", [False, True],
                         ids=["example-major", "time-major"])
@pytest.mark.parametrize("batches", BATCHES)
def test_fold_rows_are_certified_and_the_rules_run(
        batches, graph, monkeypatch, time_major):
    """W and b on `[B*T]` rows: certified (the fold's order is proved; a
    time-major `[T, B, H]` fold, row r of example r mod B, is not, so it is
    read either way: `RowFold.either`, the certificate checking both maps
    each step and the rules taking the one that holds), the check passes
    at every B, and the values are the rules': the exact form is replaced
    by a wrong one here, so a step that took it would show."""
    x, y, loss, xs = _fold_model(time_major=time_major)
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms() == ["certified", "certified"], str(plan)
    rows = [op for op in graph.get_operations() if op.type == "MatMul"
            and op.inputs[1].op.inputs[0] is xs[0].handle][0].outputs[0]
    fold = rows_lib.fold_of(rows, 0, loss)
    assert fold is not None and fold.source.shape.rank == 3, fold
    assert fold.either == time_major, fold
    assert rows_lib.non_example_rows(rows, 0, loss) is None

    _rules_run_and_checks_hold(graph, monkeypatch, x, y, loss, xs, batches,
                               _fold_feed(x, y), "fold")


@pytest.mark.parametrize("time_major", [False, True],
                         ids=["example-major", "time-major"])
@pytest.mark.parametrize("batches", BATCHES)
def test_coupling_across_fold_rows_is_caught(batches, graph, monkeypatch,
                                             time_major):
    """A roll of the `[B*T]` rows by one row (told to keep rows apart, so
    only the certificate stands between it and a wrong value): the check
    fails at B > 1 (passes at B=1, where the roll stays inside the one
    example) and every value is exact; a time-major fold (read either way
    at run time) fails both maps."""
    _tell_apart(monkeypatch, "Roll")
    x, y, loss, xs = _fold_model(roll=True, time_major=time_major)
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms() == ["certified", "certified"], str(plan)
    feed = _fold_feed(x, y)
    for b, values in _run(graph, x, y, loss, xs, batches,
                          feed_fn=feed).items():
        _check_exact(values, "fold roll B=%d" % b)
    certs = _certificates(graph)
    assert certs
    for b, oks in _checks(graph, certs, x, y, batches, seed=3,
                          feed_fn=feed).items():
        assert all(oks) == (b == 1), b


@pytest.mark.parametrize("time_major", [False, True],
                         ids=["example-major", "time-major"])
def test_fold_rows_group_quantities_are_exact(graph, monkeypatch,
                                              time_major):
    """The other quantities of rules on fold rows (`folded_rows.FoldedRows`):
    microbatch norms (M=3 at B=6), norms of users' sums (fed group ids) and
    the elementwise second moments, against the loop reference; the exact
    form replaced by a wrong one (its check passes: the rules' values);
    for an example-major fold and a time-major one (read at run time)."""
    x, y, loss, xs = _fold_model(time_major=time_major)
    _wrong_exact_form(monkeypatch)
    users = tf.compat.v1.placeholder(tf.int32, [None], name="users")
    fetches = {
        "ref": testing.loop_per_example(loss, xs, 6, rows=True),
        "micro": custagg.per_example_norms(loss, xs, num_microbatches=3),
        "users": custagg.per_example_norms(loss, xs, group_ids=users),
        "moments": custagg.gradient_second_moments(loss, xs),
    }
    rng = np.random.default_rng(4)
    feed = _fold_feed(x, y)(rng, 6)
    feed[users] = np.array([2, 0, 2, 1, 0, 2])
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        values = sess.run(fetches, feed)
    per_example_reference.assert_group_quantities(values, feed[users], RTOL)


# --------------------------------------------------------------------------
# An embedding behind a loop, outside the batch region (ptb_lm's shape of
# problem): the gather of fed ids is a rule consumer, never a chain.

EMB_VOCAB, EMB_DIM, EMB_STEPS = 11, 4, 4


def _embedding_loop_model(roll=False):
    """ptb_lm's shape of problem, written by hand: ids `[B, T]` (dynamic B
    and T) gathered from a table, a weight-free recurrence over time in a
    `tf.while_loop` (`h_t = tanh(e_t + 0.5 h_{t-1})`), its outputs folded
    to `[B*T, D]` rows and projected, reshaped back by `tf.shape(ids)[0]`
    (the ids' B: another symbol than the loop output's, so the walk back
    from the loss stops at that reshape and the gather lies outside the
    batch region), a per-token softmax cross-entropy summed per sequence.
    With `roll`, the gathered rows are rolled along the batch before the
    loop (`e + 0.5 roll(e, 1, axis=0)`): example b's loss reads example
    b-1's ids. Float64; xs are the table, W and b."""
    ids = tf.compat.v1.placeholder(tf.int32, [None, None], name="ids")
    y = tf.compat.v1.placeholder(tf.int32, [None, None], name="y")
    init = tf.compat.v1.random_normal_initializer(seed=13, dtype=tf.float64)
    table = tf.compat.v1.get_variable("table", [EMB_VOCAB, EMB_DIM],
                                      tf.float64, init)
    w = tf.compat.v1.get_variable("proj_w", [EMB_DIM, CLASSES], tf.float64,
                                  init)
    b = tf.compat.v1.get_variable("proj_b", [CLASSES], tf.float64, init)
    e = tf.nn.embedding_lookup(table, ids)                   # [B, T, D]
    if roll:
        e = e + 0.5 * tf.roll(e, shift=1, axis=0)
    steps = tf.shape(ids)[1]
    inputs = tf.TensorArray(tf.float64, size=steps).unstack(
        tf.transpose(e, [1, 0, 2]))

    def body(t, h, outs):
        h = tf.tanh(inputs.read(t) + 0.5 * h)
        return t + 1, h, outs.write(t, h)
    _, _, outs = tf.compat.v1.while_loop(
        lambda t, h, outs: t < steps, body,
        [0, tf.zeros_like(e[:, 0]), tf.TensorArray(tf.float64, size=steps)])
    h = tf.transpose(outs.stack(), [1, 0, 2])                # [B, T, D]
    logits = tf.matmul(tf.reshape(h, [-1, EMB_DIM]), w) + b
    logits = tf.reshape(logits, [tf.shape(ids)[0], -1, CLASSES])
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                            logits=logits)
    return ids, y, tf.reduce_sum(losses, 1), [table, w, b]


def _ids_feed(ids, y, vocab, steps):
    def feed(rng, b):
        # A shorter T at B=1: a T frozen at the first run shows.
        t = steps - 1 if b == 1 else steps
        text = rng.integers(0, vocab, size=[b, t + 1])
        # Repeated ids inside an example and across examples.
        text[:, 1] = text[:, 0]
        return {ids: text[:, :-1], y: text[:, 1:] % CLASSES}
    return feed


def test_gather_of_fed_ids_outside_the_region_is_no_chain(graph):
    """The gather reads fed ids the walk from the loss did not reach: it is
    outside `batch_region` yet inside `data_region`, so the rules form
    asks its rule's static proof (which fails at the reshape) instead of
    chaining through it; the certified form takes it."""
    from custagg import batch_axis
    from custagg import graph as graph_lib
    ids, _, loss, xs = _embedding_loop_model()
    gather = [op for op in graph.get_operations()
              if op.type == "ResourceGather"][0]
    ancestors = graph_lib.ancestors(loss)
    assert gather not in batch_axis.batch_region(loss, ancestors)
    assert gather in batch_axis.data_region(ancestors)
    assert ids.op in batch_axis.data_region(ancestors)
    # The table's own read and the weights are no data.
    assert not any(batch_axis.brings_data(op) for op in ancestors
                   if op.type in ("ReadVariableOp", "VarHandleOp", "Const"))
    with pytest.raises(ValueError) as info:
        custagg.plan_per_example(loss, xs[:1], strategy="rules")
    assert "embedding_lookup" in str(info.value), str(info.value)
    assert "coupling" in str(info.value), str(info.value)
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms() == ["certified"] * 3, str(plan)
    line = str(plan).splitlines()[1]
    assert "via ResourceGather" in line, str(plan)
    # The cause, once, after the variables: the reshape the proof stopped at.
    assert "Reshape" in str(plan).split("why not a cheaper form")[1], \
        str(plan)
    assert "(through" not in line, str(plan)


def test_batch_free_ops_still_chain(graph):
    """Ops whose other inputs are constants, variables or a scalar feed (a
    `keep_prob`) are still chains: `l2_loss(w)` and `w * keep_prob`."""
    x = tf.compat.v1.placeholder(tf.float64, [None, D_IN], name="x")
    keep = tf.compat.v1.placeholder(tf.float64, [], name="keep_prob")
    init = tf.compat.v1.random_normal_initializer(seed=15, dtype=tf.float64)
    w = tf.compat.v1.get_variable("w", [D_IN, CLASSES], tf.float64, init)
    loss = (tf.reduce_sum(tf.tanh(tf.matmul(x, w * keep)), 1) +
            0.1 * tf.nn.l2_loss(w))
    plan = custagg.plan_per_example(loss, [w], strategy="rules")
    assert plan.forms() == ["rules"], str(plan)
    kinds = sorted(c.op.type for c in plan.assignments[0].consumers)
    assert kinds == ["L2Loss", "Mul"], str(plan)
    ref = testing.loop_per_example(loss, [w], 3)
    got = custagg.per_example_gradients(loss, [w], strategy="rules")
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        feed = {x: np.random.default_rng(5).normal(size=[3, D_IN]),
                keep: 0.7}
        g, r = sess.run([got, ref], feed)
    testing.assert_close(g[0], r[0], RTOL, "chained w")


@pytest.mark.parametrize("batches", BATCHES)
def test_embedding_behind_a_loop_is_certified_and_the_rules_run(
        batches, graph, monkeypatch):
    """The hand-written graph: table, W and b certified; the checks pass at
    every B and the values are the rules' (the exact form replaced by a
    wrong one: a step that took it would show)."""
    ids, y, loss, xs = _embedding_loop_model()
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms() == ["certified"] * 3, str(plan)
    _wrong_exact_form(monkeypatch)
    feed = _ids_feed(ids, y, EMB_VOCAB, EMB_STEPS)
    for b, values in _run(graph, ids, y, loss, xs, batches,
                          feed_fn=feed).items():
        _check_exact(values, "embedding behind a loop B=%d" % b)
    certs = _certificates(graph)
    assert certs, "no certified tf.cond in the graph"
    for b, oks in _checks(graph, certs, ids, y, batches, seed=7,
                          feed_fn=feed).items():
        assert all(oks), b


@pytest.mark.parametrize("batches", BATCHES)
def test_rolled_embedding_behind_a_loop_is_caught(batches, graph):
    """The negative control: the gathered rows rolled along the batch
    before the loop. The gather is outside the region just the same (no
    chain, certified); its check fails at B > 1 (at B=1 the roll is the
    identity) and the exact form's values are returned."""
    ids, y, loss, xs = _embedding_loop_model(roll=True)
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms()[0] == "certified", str(plan)
    engine = engine_lib.Engine(plan, 32)
    ok = engine.certificate(plan.assignments[0])
    feed = _ids_feed(ids, y, EMB_VOCAB, EMB_STEPS)
    for b, values in _run(graph, ids, y, loss, xs, batches, feed_fn=feed,
                          per_example=False).items():
        _check_exact(values, "rolled embedding B=%d" % b)
    for b, got in _checks(graph, [ok], ids, y, batches, seed=8,
                          feed_fn=feed).items():
        assert got[0] == (b == 1), b


def test_gathered_rows_not_the_losses_b_fail_the_check(graph):
    """The gather rule reads B from its ids' rows; the certificate first
    checks those rows against the loss's B. Ids fed with B' rows pooled
    into one vector every example reads (`u = sum of the rows`, `loss_i =
    tanh(x_i . u)`): at B' != B the check fails without reshaping
    mismatched rows (no run-time error) and the values are exact."""
    x = tf.compat.v1.placeholder(tf.float64, [None, EMB_DIM], name="x")
    ids = tf.compat.v1.placeholder(tf.int32, [None, 2], name="ids")
    init = tf.compat.v1.random_normal_initializer(seed=17, dtype=tf.float64)
    table = tf.compat.v1.get_variable("table", [EMB_VOCAB, EMB_DIM],
                                      tf.float64, init)
    u = tf.reduce_sum(tf.nn.embedding_lookup(table, ids), [0, 1])  # [D]
    loss = tf.tanh(tf.reduce_sum(x * u, 1))
    plan = custagg.plan_per_example(loss, [table])
    assert plan.forms() == ["certified"], str(plan)
    ok = engine_lib.Engine(plan, 32).certificate(plan.assignments[0])
    clip = 0.3
    clipped = custagg.clipped_gradients(loss, [table], clip,
                                        return_norms=True)
    ref = testing.loop_per_example(loss, [table], 4, rows=True)
    rng = np.random.default_rng(9)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for b, b_ids in ((1, 1), (3, 4), (4, 3)):
            feed = {x: rng.normal(size=[b, EMB_DIM]),
                    ids: rng.integers(0, EMB_VOCAB, size=[b_ids, 2])}
            got_ok, (sums, norms), rows = sess.run([ok, clipped, ref[:b]],
                                                   feed)
            assert got_ok == (b == 1), (b, b_ids)
            want = [np.stack(col) for col in zip(*rows)]
            testing.assert_close(norms, testing.numpy_norms(want), RTOL,
                                 "norms B=%d B'=%d" % (b, b_ids))
            want_sums, _ = testing.numpy_clipped(want, clip)
            testing.assert_close(sums[0], want_sums[0], RTOL,
                                 "clipped B=%d B'=%d" % (b, b_ids))


@pytest.mark.skipif(not tf1_models.has_tf1_layers(),
                    reason="the v1 RNN cells need the tf-keras package on "
                           "this TensorFlow")
@pytest.mark.parametrize("batches", BATCHES)
def test_ptb_embedding_is_certified_and_the_rules_run(
        batches, graph, monkeypatch):
    """benchmarks/zoo_models.py's PTB language model (small sizes, float64,
    dynamic B and T): every variable certified, the embedding through its
    ResourceGather rule (no chain, no O(B^2) form); the checks pass and the
    values are the rules' (the exact form replaced by a wrong one), against
    the loop reference. (tests/per_example/test_tf1_models.py runs the
    model with the real exact form built, under `-m slow`.)"""
    rng = np.random.default_rng(24)
    model = tf1_models.ptb_lm(tf.float64, rng)
    plan = custagg.plan_per_example(model.loss, model.xs)
    assert plan.forms() == ["certified"] * len(model.xs), str(plan)
    assert model.xs[0].name == "Model/embedding:0"
    assert "via ResourceGather" in str(plan).splitlines()[1], str(plan)
    _wrong_exact_form(monkeypatch)

    def feed(rng, b):
        return model.feed(rng, b, 3 if b == min(batches) else None)
    for b, values in _run(graph, None, None, model.loss, model.xs, batches,
                          feed_fn=feed).items():
        _check_exact(values, "ptb B=%d" % b)
    certs = _certificates(graph)
    assert certs, "no certified tf.cond in the graph"
    for b, oks in _checks(graph, certs, None, None, batches, seed=9,
                          feed_fn=feed).items():
        assert all(oks), b


# --------------------------------------------------------------------------
# The check's tolerance follows the least precise dtype between the rule op
# and the loss.


def _float32_loss_model(coupling):
    """float64 layers whose loss goes through float32, as
    `tf.compat.v1.losses` computes it (it casts the losses to float32 and
    back): the seeded pass's seeds come out rounded to float32 there.
    `w1` sits behind Tanh (hidden from the table by the tests), and with
    `coupling` loss i also reads example i-1's hidden row."""
    x = tf.compat.v1.placeholder(tf.float64, [None, D_IN], name="x")
    y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
    init = tf.compat.v1.random_normal_initializer(seed=7, dtype=tf.float64)
    w1 = tf.compat.v1.get_variable("w1", [D_IN, HIDDEN], tf.float64, init)
    w2 = tf.compat.v1.get_variable("w2", [HIDDEN, CLASSES], tf.float64, init)
    h = tf.tanh(tf.matmul(x, w1))
    if coupling:
        h = h + coupling * tf.roll(h, shift=1, axis=0)
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
        y, tf.matmul(h, w2), reduction=tf.compat.v1.losses.Reduction.NONE)
    assert loss.dtype == tf.float64
    assert any(op.type == "Cast" and op.outputs[0].dtype == tf.float32
               for op in loss.graph.get_operations())
    return x, y, loss, [w1, w2]


def test_path_rtol_is_the_least_precise_dtype_to_the_loss(graph):
    from custagg.graph import walks
    x, _, loss, _ = _float32_loss_model(0.0)
    ancestors = set(walks.upstream([loss]))
    hidden = [op for op in graph.get_operations() if op.type == "Tanh"][0]
    assert certificate_lib.path_rtol(hidden.outputs[0], ancestors) == \
        certificate_lib.CERTIFICATE_RTOL[tf.float32]
    # A float64 path: float64's own tolerance.
    z = tf.matmul(x, tf.ones([D_IN, 2], tf.float64))
    plain = tf.reduce_sum(tf.square(z), 1)
    assert certificate_lib.path_rtol(z, set(walks.upstream([plain]))) == \
        certificate_lib.CERTIFICATE_RTOL[tf.float64]


@pytest.mark.parametrize("batches", BATCHES)
def test_a_float32_loss_of_a_float64_model_is_certified(
        batches, graph, monkeypatch):
    """With float64's 1e-11 the check failed on every step of such a model
    (the seeds rounded to 1e-8 at the cast) and the exact form ran, whose
    clipped sums (a weighted pass through the cast) are off by ~1e-8: a
    certified step gives the loop's values to 1e-12."""
    _hide(monkeypatch, "Tanh")
    x, y, loss, xs = _float32_loss_model(0.0)
    assert custagg.plan_per_example(loss, xs).forms()[0] == "certified"
    results = _run(graph, x, y, loss, xs, batches)
    for b, oks in _checks(graph, _certificates(graph), x, y, batches,
                          seed=2).items():
        assert all(oks), b
    for b, values in results.items():
        per_example_reference.assert_exact(values, "B=%d" % b, 1e-12)


def test_a_coupling_through_a_float32_loss_is_still_caught(graph,
                                                           monkeypatch):
    """float32's tolerance still resolves a coupling of 1e-2."""
    _hide(monkeypatch, "Roll")
    x, y, loss, xs = _float32_loss_model(1e-2)
    assert custagg.plan_per_example(loss, xs).forms()[0] == "certified"
    results = _run(graph, x, y, loss, xs, (7,))
    for b, oks in _checks(graph, _certificates(graph), x, y, (7,),
                          seed=3).items():
        assert not all(oks), b
    for j, g in enumerate(results[7]["reference"]):
        testing.assert_close(results[7]["per_example"][j], g, 1e-12,
                             "coupled per_example[%d]" % j)


@pytest.mark.parametrize("batches", BATCHES)
def test_dilated_convolution_rows_are_certified_and_the_rules_run(
        batches, graph, monkeypatch):
    """A dilated convolution's rule reads the rows of its space-to-batch
    blocks (row k*B + b of example b), a `tf.squeeze` without an axis
    after it (no static proof). The check read them example-major (row r
    of example r // blocks), failed at every step and ran the exact form
    (5.6x the plain gradient in a review's model, 2.8x certified); here the
    exact form is replaced by a wrong one, so a step that took it shows."""
    x = tf.compat.v1.placeholder(tf.float64, [None, None, None, 2])
    y = tf.compat.v1.placeholder(tf.int32, [None])
    k = tf.compat.v1.get_variable(
        "k", initializer=np.random.default_rng(3).normal(size=[3, 3, 2, 4]))
    h = tf.nn.atrous_conv2d(x, k, rate=2, padding="VALID")   # space-to-batch
    pooled = tf.reduce_mean(tf.nn.relu(h), [1, 2])             # [B, 4]
    w = tf.compat.v1.get_variable(
        "w", initializer=np.random.default_rng(4).normal(size=[4, 1]))
    logits = tf.squeeze(tf.matmul(pooled, w))   # no axis: rank at run time
    loss = tf.square(logits - tf.cast(y, tf.float64))
    xs = [k, w]
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms() == ["certified", "certified"], str(plan)

    def feed(rng, b):
        size = 9 if b == 1 else 10          # image sizes vary too
        return {x: rng.normal(size=[b, size, size, 2]),
                y: rng.integers(0, 3, size=[b])}

    _rules_run_and_checks_hold(graph, monkeypatch, x, y, loss, xs, batches,
                               feed, "dilated")
