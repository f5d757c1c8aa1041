"""The form interface (custagg/per_example/forms/): plan then build, a Plan
never changed after it is returned, no state between calls, and no bug
hidden as a slower form."""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import testing
from custagg.per_example import engine as engine_lib
from custagg.per_example import forms
from custagg.per_example.forms import base
from custagg.per_example.forms import loop as loop_form
from custagg.per_example.forms import pfor as pfor_forms


def _mlp(batch=None, coupled=False, dtype=tf.float64):
    """[B, 3] -> tanh(x w1 + b1) w2 per-example squared loss; `coupled`
    subtracts the batch mean of the hidden layer (no rules, no copies)."""
    rng = np.random.default_rng(0)
    x = tf.compat.v1.placeholder(dtype, [batch, 3])
    w1 = tf.compat.v1.Variable(rng.normal(size=(3, 4)), dtype=dtype,
                               use_resource=True, name="w1")
    b1 = tf.compat.v1.Variable(rng.normal(size=(4,)), dtype=dtype,
                               use_resource=True, name="b1")
    w2 = tf.compat.v1.Variable(rng.normal(size=(4, 2)), dtype=dtype,
                               use_resource=True, name="w2")
    h = tf.tanh(tf.matmul(x, w1) + b1)
    if coupled:
        h = h - 0.5 * tf.reduce_mean(h, axis=0, keepdims=True)
    loss = tf.reduce_sum(tf.square(tf.matmul(h, w2)), axis=1)

    def feed(b, seed=1):
        return {x: np.random.default_rng(seed).normal(size=(b, 3))}
    return loss, [w1, b1, w2], feed


def test_every_form_is_behind_the_interface():
    assert set(forms.FORMS) == {"rules", "loop-rules", "certified",
                                "boundary",
                                "recompute", "recompute-loop", "whole-pass",
                                "loop"}
    for name, form in forms.FORMS.items():
        assert isinstance(form, base.Form) and form.name == name
        assert form.strategy in ("rules", "pfor", "loop")
        assert form.what and form.cost
    for strategy, chain in forms.CHAINS.items():
        assert strategy in custagg.STRATEGIES
        assert all(f in forms.FORMS.values() for f in chain)


def test_a_plan_is_read_only(graph):
    loss, xs, _ = _mlp()
    plan = custagg.plan_per_example(loss, xs)
    a = plan.assignments[0]
    with pytest.raises(AttributeError, match="read-only"):
        a.form = "loop"
    with pytest.raises(AttributeError, match="read-only"):
        a.strategy = "loop"
    assert isinstance(plan.assignments, tuple)


def _refuse(*args, **kwargs):
    raise base.Refused("refused by the test")


def test_a_build_fallback_changes_neither_the_plan_nor_later_plans(
        graph, monkeypatch):
    """The whole pass refused at build time under "auto": the loop runs,
    the engine records it, the returned plan and a later plan of the same
    loss still say "whole-pass" (no module state), and the values are the
    loop reference's."""
    loss, xs, feed = _mlp(coupled=True)
    xs = xs[:2]                  # w2, after the coupling, is on rules
    # Without the certified rules (which would take w1 and b1; their exact
    # form is this whole pass too, under tf.cond).
    monkeypatch.setitem(forms.CHAINS, "auto", tuple(
        f for f in forms.CHAINS["auto"] if f.name != "certified"))
    before = custagg.plan_per_example(loss, xs)
    assert set(before.forms()) == {"whole-pass"}, str(before)
    monkeypatch.setattr(pfor_forms.WholePassForm, "build", _refuse)
    plan = custagg.plan_per_example(loss, xs)
    engine = engine_lib.Engine(plan, 32)
    got = [engine.per_example(a) for a in plan.assignments]
    assert set(plan.forms()) == {"whole-pass"}, str(plan)
    assert {name: form for name, (form, _) in engine.built.items()} == {
        a.name: "loop" for a in plan.assignments}
    assert all("refused by the test" in why
               for _, why in engine.built.values())
    assert custagg.plan_per_example(loss, xs).forms() == before.forms()
    ref = testing.loop_per_example(loss, xs, 5)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        g, r = sess.run([got, ref], feed(5))
    for j, (a, b) in enumerate(zip(g, r)):
        testing.assert_close(a, b, 1e-10, "x %d" % j)


def test_asked_for_pfor_reports_a_refused_build(graph, monkeypatch):
    loss, xs, _ = _mlp(coupled=True)
    monkeypatch.setattr(pfor_forms.WholePassForm, "build", _refuse)
    with pytest.raises(base.Refused, match="refused by the test"):
        custagg.per_example_gradients(loss, xs, strategy="pfor")


def test_a_bug_in_a_build_is_never_a_slower_form(graph, monkeypatch):
    """An error raised in custagg's (here the test's) code propagates: it
    is no refusal, so "auto" does not turn it into the O(B^2) loop."""
    loss, xs, _ = _mlp(coupled=True)

    def broken(self, engine, group):
        raise ValueError("an internal bug")
    monkeypatch.setattr(pfor_forms.WholePassForm, "build", broken)
    with pytest.raises(ValueError, match="an internal bug"):
        custagg.per_example_gradients(loss, xs)


def test_is_refusal_tells_tf_errors_from_bugs():
    assert base.is_refusal(base.Refused("no"))
    try:
        tf.reshape(tf.zeros([2]), [3])      # TF raises, inside TF
    except (ValueError, tf.errors.InvalidArgumentError) as e:
        assert base.is_refusal(e)
    else:
        raise AssertionError("TF accepted a bad reshape")
    try:
        raise ValueError("raised in custagg or a test")
    except ValueError as e:
        assert not base.is_refusal(e)
    assert not base.is_refusal(KeyError("x"))


class _ReversedLoopForm(loop_form.LoopForm):
    """A new form, for the test: the per-example loop run backwards."""

    name = "reversed-loop"
    what = "one backward pass per example, last example first"
    scope = "reversed_loop_form"

    def build(self, engine, group):
        batch = engine.batch_size
        out = {id(a): [] for a in group}
        for i in reversed(range(batch)):
            grads = tf.compat.v1.gradients(
                engine.loss[i], [a.tensor for a in group],
                unconnected_gradients=tf.UnconnectedGradients.ZERO)
            for a, g in zip(group, grads):
                out[id(a)].insert(0, tf.convert_to_tensor(g))
        return {k: tf.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("batch", [1, 5])
def test_a_new_form_is_one_class(graph, monkeypatch, batch):
    """A form added to FORMS and to a strategy's chain is planned, printed
    and built like the built-in ones."""
    new = _ReversedLoopForm()
    monkeypatch.setitem(forms.FORMS, new.name, new)
    monkeypatch.setitem(forms.CHAINS, "loop", (new,))
    loss, xs, feed = _mlp(batch=batch)
    plan = custagg.plan_per_example(loss, xs, strategy="loop")
    assert plan.forms() == ["reversed-loop"] * 3, str(plan)
    assert "last example first" in str(plan)
    got = custagg.per_example_gradients(loss, xs, strategy="loop")
    norms = custagg.per_example_norms(loss, xs, strategy="loop")
    ref = testing.loop_per_example(loss, xs)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        g, n, r = sess.run([got, norms, ref], feed(batch))
    for j, (a, b) in enumerate(zip(g, r)):
        testing.assert_close(a, b, 1e-12, "x %d" % j)
    testing.assert_close(n, testing.numpy_norms(r), 1e-12, "norms")
