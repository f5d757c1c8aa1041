"""The certified forms next to the one-pass loop rules (issue 26): a
certified step runs one forward pass of each loop, and a failing check
still gives the exact values.

`Engine.certified` builds `tf.cond(checks, rules, exact)`. A v2 cond takes
every tensor either branch captures as an input, computed on every step, so
an exact form built on the original loss would run the original loops
forward (and hold their activations) on a step that takes the rules. The
exact form differentiates the loss recomputed from the rebuilt loops
(`SharedPass.one_pass`) instead, and the one pass copies every op after the
loops, through control edges too (a labels' reshape waiting on the
`Assert` that reads the logits' shape, as `sparse_softmax_cross_entropy`
builds it).

Checked here, float64, against the loop reference (one tf.gradients per
example), B in {1, 7} (`-m slow`: {32, 33}):

* a dynamic_rnn whose output passes a hidden Softplus (its cell's weights
  certified at the loop's outputs): apart, the checks pass and the rules'
  values are returned (the exact form replaced by a wrong one); rolled
  along the batch after the loop, the checks fail at B > 1 and the exact
  form, on the recomputed graph, gives the values;
* benchmarks/zoo_models.py's ptb_lm and bilstm_tagger (small) with every
  check forced to fail: the exact form alone gives every value;
* the structure: the nodes the executor ran in one traced step (the
  `LoopCond` of each lowered While) hold no original loop, and one forward
  loop rebuilt with its taps per original loop (no loop of its counter),
  on a certified step and on a failing one (whose exact form's pfor runs
  loops of its own in the cond's else branch); ptb_lm's check after the
  loop is copied, not read.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
import per_example_reference
from custagg import op_kinds
from custagg.graph import walks
from custagg.per_example import certificate as certificate_lib
from custagg.per_example import engine as engine_lib

import test_certified
from benchmarks import zoo_models as tf1_models

RTOL = 1e-9
BATCHES = (1, 7)
SLOW_BATCHES = (32, 33)
FLOATS = frozenset([tf.float16, tf.bfloat16, tf.float32, tf.float64])


def _rnn_model(roll):
    """test_certified's dynamic_rnn (a tanh cell, a v2 loop) whose output
    passes a Softplus (hidden by the tests: the static proof stops there,
    after the loop) and, with `roll`, a roll by one example along the
    batch, summed over time into a dense head. Float64, dynamic B.
    Returns (loss, xs, feed)."""
    x, y, loss, xs = test_certified._rnn_model(roll)  # pylint: disable=protected-access

    def feed(rng, b):
        return {x: rng.normal(size=[b, test_certified.STEPS,
                                    test_certified.D_IN]),
                y: rng.integers(0, test_certified.CLASSES, size=[b])}
    return loss, xs, feed


def _originals(graph):
    return [op for op in graph.get_operations()
            if op.type in op_kinds.V2_LOOPS]


def _ran_loops(fetches, feed):
    """The names of the While ops whose frames ran in one traced step
    (Grappler lowers each While to a frame with one `LoopCond`, named under
    the While's name; a gradient loop's name ends in `_grad`)."""
    meta = tf.compat.v1.RunMetadata()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(fetches, feed, options=tf.compat.v1.RunOptions(
            trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
            run_metadata=meta)
    ran = {n.node_name for d in meta.step_stats.dev_stats
           for n in d.node_stats}
    return {name.split("/LoopCond")[0] for name in ran if "/LoopCond" in name}


def _forward(loops):
    return sorted(n for n in loops if not n.split("/")[-1].endswith("_grad"))


def _carries_floats(name, graph):
    return any(tf.as_dtype(d) in FLOATS
               for d in graph.get_operation_by_name(name).get_attr("T"))


def _clipped(loss, xs):
    sums, norms = custagg.clipped_gradients(loss, xs, 0.5,
                                            return_norms=True)
    return [tf.convert_to_tensor(s) for s in sums if s is not None] + [norms]


def _assert_one_forward_per_loop(graph, originals, loops):
    """No original loop ran; per original loop, one rebuilt forward loop,
    the tapped one (carrying floats)."""
    names = {op.name for op in originals}
    assert not names & loops, sorted(names & loops)
    # (On a failing step the exact form's pfor runs loops of its own in
    # the cond's else branch: the vectorized backward pass, no forward.)
    forward = [n for n in _forward(loops) if "/else/" not in n]
    assert all("loop_rules_one_pass" in n for n in forward), forward
    with_floats = [n for n in forward if _carries_floats(n, graph)]
    assert len(with_floats) == len(originals), forward
    assert len(forward) == len(originals), forward


@pytest.mark.parametrize("batches", [
    BATCHES, pytest.param(SLOW_BATCHES, marks=pytest.mark.slow)])
@pytest.mark.parametrize("roll", [False, True], ids=["apart", "rolled"])
def test_certified_behind_a_loop_is_exact(batches, roll, graph,
                                          monkeypatch):
    """Apart: the checks pass at every B and the rules' values are returned
    (the exact form replaced by a wrong one: a step that took it would
    show). Rolled: the checks fail at B > 1 and the real exact form, on the
    loss recomputed from the rebuilt loop, gives the loop reference's
    per-example gradients, norms and clipped sums."""
    test_certified._hide(monkeypatch, "Softplus")  # pylint: disable=protected-access
    loss, xs, feed = _rnn_model(roll)
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms() == ["certified", "certified", "rules"], str(plan)
    engine = engine_lib.Engine(plan, 32)
    assert engine.shared.one_pass() is not None
    oks = [engine.certificate(a) for a in plan.assignments]
    if not roll:
        test_certified._wrong_exact_form(monkeypatch)  # pylint: disable=protected-access
    values = test_certified._run(  # pylint: disable=protected-access
        graph, None, None, loss, xs, batches, feed_fn=feed)
    for b, got in values.items():
        per_example_reference.assert_exact(
            got, "rnn roll=%s B=%d" % (roll, b), RTOL)
    checks = test_certified._checks(  # pylint: disable=protected-access
        graph, oks, None, None, batches, seed=3, feed_fn=feed)
    for b, got in checks.items():
        assert all(got) == (not roll or b == 1), (b, got)


@pytest.mark.parametrize("roll", [False, True], ids=["apart", "rolled"])
def test_a_certified_step_runs_one_forward_of_the_loop(roll, graph,
                                                       monkeypatch):
    """The executed step (B=7): the apart model's certified step and the
    rolled model's failing one (whose exact form runs) both run one
    forward pass of the loop, the rebuilt one."""
    test_certified._hide(monkeypatch, "Softplus")  # pylint: disable=protected-access
    loss, xs, feed = _rnn_model(roll)
    originals = _originals(graph)
    assert len(originals) == 1
    # (One call: each of custagg's calls builds its own per-example graph.)
    fetches = _clipped(loss, xs)
    loops = _ran_loops(fetches, feed(np.random.default_rng(0), 7))
    _assert_one_forward_per_loop(graph, originals, loops)


def _fail_every_check(monkeypatch):
    """Every certificate fails at every step: the exact form gives every
    certified value."""
    monkeypatch.setattr(certificate_lib, "_agree",
                        lambda *args: tf.constant(False))


@pytest.mark.skipif(not tf1_models.has_tf1_layers(),
                    reason="the v1 RNN cells need the tf-keras package")
@pytest.mark.parametrize("name, dtype, batches", [
    pytest.param("ptb_lm", tf.float64, BATCHES, id="ptb_lm-batches0"),
    pytest.param("bilstm_tagger", tf.float64, BATCHES,
                 id="bilstm_tagger-batches0"),
    pytest.param("ptb_lm", tf.float32, BATCHES, id="ptb_lm-float32"),
    pytest.param("ptb_lm", tf.float64, SLOW_BATCHES, id="ptb_lm-batches1",
                 marks=pytest.mark.slow),
    pytest.param("bilstm_tagger", tf.float64, SLOW_BATCHES,
                 id="bilstm_tagger-batches1", marks=pytest.mark.slow),
    pytest.param("bilstm_tagger", tf.float32, SLOW_BATCHES,
                 id="bilstm_tagger-float32-batches1",
                 marks=pytest.mark.slow)])
def test_failing_checks_on_tf1_models_are_exact(name, dtype, batches, graph,
                                                monkeypatch):
    """ptb_lm (every variable certified, an embedding below a two-layer
    LSTM) and bilstm_tagger (loop rules and a certified projection on
    folded rows), small, with every check failing: the exact form on the
    recomputed graph (the loop over the examples, `EXACT_BEHIND_LOOPS`)
    gives the loop reference's values; the step still runs no original
    loop."""
    _fail_every_check(monkeypatch)
    model = tf1_models.MODELS[name](dtype, np.random.default_rng(26))
    originals = _originals(graph)
    plan = custagg.plan_per_example(model.loss, model.xs)
    assert "certified" in plan.forms(), str(plan)
    assert engine_lib.Engine(plan, 32).shared.one_pass() is not None

    def feed(rng, b):
        return model.feed(rng, b, 3 if b == min(batches) else None)
    values = test_certified._run(  # pylint: disable=protected-access
        graph, None, None, model.loss, model.xs, batches, feed_fn=feed)
    for b, got in values.items():
        per_example_reference.assert_exact(
            got, "%s %s B=%d" % (name, dtype.name, b),
            RTOL if dtype == tf.float64 else 1e-4)
    fetches = _clipped(model.loss, model.xs)
    loops = _ran_loops(fetches, feed(np.random.default_rng(1), 7))
    assert not {op.name for op in originals} & loops


@pytest.mark.skipif(not tf1_models.has_tf1_layers(),
                    reason="the v1 RNN cells need the tf-keras package")
@pytest.mark.parametrize("name", ["ptb_lm", "bilstm_tagger"])
def test_tf1_models_certified_step_runs_one_forward_of_each_loop(name,
                                                                 graph):
    """The benchmark's models (small, float64, B=7), clipped sums and
    norms: the executed step runs no original loop and one tapped forward
    loop per original (ptb_lm's one loop of two cells, the tagger's two
    directions)."""
    model = tf1_models.MODELS[name](tf.float64, np.random.default_rng(26))
    originals = _originals(graph)
    loops = _ran_loops(_clipped(model.loss, model.xs),
                       model.feed(np.random.default_rng(2), 7))
    _assert_one_forward_per_loop(graph, originals, loops)


@pytest.mark.skipif(not tf1_models.has_tf1_layers(),
                    reason="the v1 RNN cells need the tf-keras package")
def test_checks_after_the_loop_are_copied(graph):
    """ptb_lm's per-token sparse softmax cross-entropy reshapes its labels
    after an `Assert` of the logits' shape (after the loop). The one pass
    copies that reshape, waiting on the copied `Assert`: nothing behind
    the recomputed loss reads the original loop or the original check."""
    model = tf1_models.ptb_lm(tf.float64, np.random.default_rng(26))
    original = _originals(graph)[0]
    after = [op for op in graph.get_operations() if op.type == "Assert"
             and original in walks.upstream(list(op.inputs))]
    assert after, "the loss has no check after the loop"
    plan = custagg.plan_per_example(model.loss, model.xs)
    one = engine_lib.Engine(plan, 32).shared.one_pass()
    assert one is not None
    behind = walks.upstream([one.loss], control=True)
    assert original not in behind
    assert not set(after) & behind, [op.name for op in after]
    copied = [op for op in behind if op.type == "Assert"
              and "loop_rules_one_pass" in op.name]
    assert len(copied) == len(after), [op.name for op in copied]


def test_the_certificate_runs_only_its_seeded_pass(graph, monkeypatch):
    """The check at the loop's outputs reads g1 from the rules' shared pass
    (`SharedPass.check_gradient`), so the certificate builds one backward
    pass, the seeded one (issue 34: a pass of its own to the outputs was
    the whole backward pass below them once more); the values stay the
    loop reference's (float64, B in {1, 7})."""
    test_certified._hide(monkeypatch, "Softplus")  # pylint: disable=protected-access
    loss, xs, feed = _rnn_model(False)
    calls = []
    real = certificate_lib.gradients

    def counted(ys, targets, **kwargs):
        calls.append(kwargs.get("grad_ys") is not None)
        return real(ys, targets, **kwargs)
    monkeypatch.setattr(certificate_lib, "gradients", counted)
    plan = custagg.plan_per_example(loss, xs)
    assert plan.forms() == ["certified", "certified", "rules"], str(plan)
    engine = engine_lib.Engine(plan, 32)
    uses = [c for a in plan.assignments for c in a.consumers
            if getattr(c, "checks", None)]
    assert uses, "no check at the loop's outputs"
    for a in plan.assignments:
        engine.certificate(a)
    assert calls == [True], calls
    for u in uses:
        for t, _ in u.checks:
            found, g1 = engine.shared.check_gradient(
                engine.shared.tensor_of(t))
            assert found and g1 is not None, t
    values = test_certified._run(  # pylint: disable=protected-access
        graph, None, None, loss, xs, BATCHES, feed_fn=feed)
    assert sorted(values) == list(BATCHES)
    for b, got in values.items():
        per_example_reference.assert_exact(got, "rnn B=%d" % b, RTOL)
