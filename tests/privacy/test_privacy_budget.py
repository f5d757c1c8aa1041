"""`custagg.privacy.budget`: ε tracked by the run across restarts, and the
noise multiplier for a target ε; checked against dp-accounting called
directly (RDP over TF Privacy's orders, and PLD)."""

import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

from custagg import privacy
from custagg.privacy import accounting
from custagg.privacy import budget as budget_lib

import checkpoint_runs

Q, SIGMA, DELTA = 0.01, 1.1, 1e-5


def _reference(steps, q=Q, sigma=SIGMA, delta=DELTA, kind="rdp"):
    """dp-accounting's ε of `steps` Poisson-subsampled Gaussian steps."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            q, dp_accounting.GaussianDpEvent(sigma)), steps)
    acc = (dp_accounting.pld.PLDAccountant() if kind == "pld" else
           dp_accounting.rdp.RdpAccountant(list(accounting.RDP_ORDERS)))
    return acc.compose(event).get_epsilon(delta)


def _monitored_run(ckpt_dir, steps, kind, lines, every=5, **budget_kwargs):
    """`steps` steps in a MonitoredTrainingSession; returns the hook."""
    with tf.Graph().as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        b = budget_lib.PrivacyBudget(SIGMA, Q, DELTA, accountant=kind,
                                     **budget_kwargs)
        train = b.track(tf.compat.v1.assign_add(step, 1))
        hook = budget_lib.PrivacyBudgetHook(b, every_n_steps=every,
                                            log=lines.append)
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=ckpt_dir, hooks=[hook],
                save_checkpoint_steps=1, save_summaries_steps=None,
                log_step_count_steps=None) as sess:
            for _ in range(steps):
                sess.run(train)
    return hook


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_hook_epsilon_continues_across_a_restore(tmp_path, kind):
    n, every = 40, (5 if kind == "rdp" else 20)   # PLD: ~1 s a figure
    lines = []
    whole = _monitored_run(str(tmp_path / "whole"), n, kind, lines, every)
    half = _monitored_run(str(tmp_path / "split"), n // 2, kind, [], every)
    assert half.last_steps == n // 2
    resumed = _monitored_run(str(tmp_path / "split"), n // 2, kind, [],
                             every)
    ref = _reference(n, kind=kind)
    assert whole.last_steps == resumed.last_steps == n
    np.testing.assert_allclose(whole.last_epsilon, ref, rtol=1e-9)
    np.testing.assert_allclose(resumed.last_epsilon, ref, rtol=1e-9)
    np.testing.assert_allclose(half.last_epsilon, _reference(n // 2, kind=kind),
                               rtol=1e-9)
    # Logged every `every` steps (the end, step n, once).
    assert sum("privacy: " in line for line in lines) == n // every
    assert ("%d steps" % n) in lines[-1]


def test_session_loop_and_saver(tmp_path):
    """The plain function in a Session loop, a Saver restore at N/2."""
    ckpt = str(tmp_path / "ckpt")
    for part, restore in ((0, None), (1, ckpt)):
        with tf.Graph().as_default():
            b = privacy.PrivacyBudget(SIGMA, Q, DELTA)
            train = b.track(tf.no_op())
            _, (eps, steps) = checkpoint_runs.session_steps(
                lambda sess: sess.run(train), 15, restore, ckpt,
                after=b.epsilon)
        assert steps == 15 * (part + 1)
        np.testing.assert_allclose(eps, _reference(steps), rtol=1e-9)


def test_final_figure_is_compute_dp_sgd_privacy():
    n, batch, epochs = 1000, 10, 0.4          # 40 steps at q = 0.01
    b_steps = 40
    for kind in ("rdp", "pld"):
        got = budget_lib.dp_sgd_epsilon(b_steps, batch / n, SIGMA, DELTA,
                                        accountant=kind)
        want = privacy.compute_dp_sgd_privacy(n, batch, SIGMA, epochs, DELTA,
                                              accountant=kind)[0]
        assert got == want


def test_stop_at_epsilon_stops_before_exceeding(tmp_path):
    target = 2.0
    with tf.Graph().as_default():
        tf.compat.v1.train.get_or_create_global_step()
        b = budget_lib.PrivacyBudget(SIGMA, Q, DELTA)
        train = b.track(tf.no_op())
        hook = budget_lib.PrivacyBudgetHook(b, every_n_steps=1000,
                                            stop_at_epsilon=target,
                                            log=lambda line: None)
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=str(tmp_path), hooks=[hook],
                save_summaries_steps=None, log_step_count_steps=None) as sess:
            runs = 0
            while not sess.should_stop() and runs < 100000:
                sess.run(train)
                runs += 1
    steps = hook.last_steps
    assert steps == runs
    assert _reference(steps) <= target < _reference(steps + 1)


def test_shuffled_run_says_so_and_quotes_no_poisson_epsilon(sess):
    b = privacy.PrivacyBudget(SIGMA, Q, DELTA, sampling="shuffle")
    poisson = privacy.PrivacyBudget(SIGMA, Q, DELTA)
    train = tf.group(b.track(tf.no_op()), poisson.track(tf.no_op()))
    sess.run(tf.compat.v1.global_variables_initializer())
    for _ in range(250):                       # 2.5 epochs
        sess.run(train)
    text = b.statement(sess)
    assert "no Poisson epsilon is claimed" in text
    assert "3 Gaussian steps" in text
    eps, _ = b.epsilon(sess)
    acc = dp_accounting.rdp.RdpAccountant(list(accounting.RDP_ORDERS))
    want = acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(SIGMA), 3)).get_epsilon(DELTA)
    np.testing.assert_allclose(eps, want, rtol=1e-12)
    assert eps > _reference(250)
    text = poisson.statement(sess)
    assert "assuming Poisson sampling" in text
    assert "%.6g" % _reference(250) in text


def test_microbatching_halves_sigma(sess):
    b = privacy.PrivacyBudget(SIGMA, Q, DELTA, used_microbatching=True)
    sess.run(tf.compat.v1.global_variables_initializer())
    sess.run(b.track(tf.no_op()))
    np.testing.assert_allclose(b.epsilon(sess)[0],
                               _reference(1, sigma=SIGMA / 2), rtol=1e-12)


def test_restore_with_other_settings_is_refused(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with tf.Graph().as_default():
        b = privacy.PrivacyBudget(SIGMA, Q, DELTA)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.save(sess, ckpt)
    with tf.Graph().as_default():
        b = privacy.PrivacyBudget(2 * SIGMA, Q, DELTA)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            saver.restore(sess, ckpt)
            with pytest.raises(ValueError, match="noise_multiplier"):
                b.epsilon(sess)


@pytest.mark.parametrize("kind,steps,target", [
    ("rdp", 1000, 0.5), ("rdp", 1000, 2.0), ("rdp", 1000, 8.0),
    ("rdp", 10, 1.0), ("pld", 200, 2.0)])   # PLD: ~1 s a figure
def test_calibration_meets_the_target_within_one_percent(kind, steps, target):
    sigma = privacy.noise_multiplier_for(target, DELTA, Q, steps=steps,
                                         accountant=kind)
    eps = _reference(steps, sigma=sigma, kind=kind)
    assert eps <= target
    assert eps >= 0.99 * target, (sigma, eps)


def test_calibration_by_epochs_and_microbatching():
    a = privacy.noise_multiplier_for(2.0, DELTA, Q, epochs=5)
    b = privacy.noise_multiplier_for(2.0, DELTA, Q, steps=500)
    assert a == b
    m = privacy.noise_multiplier_for(2.0, DELTA, Q, steps=500,
                                     used_microbatching=True)
    np.testing.assert_allclose(m, 2 * a, rtol=1e-9)


@pytest.mark.parametrize("kwargs,arg", [
    (dict(target_delta=0.0), "target_delta"),
    (dict(target_delta=1.0), "target_delta"),
    (dict(target_epsilon=-1.0), "target_epsilon"),
    (dict(target_epsilon=0.01, target_delta=1e-12), "target_epsilon"),
    (dict(sampling_probability=0.0), "sampling_probability"),
    (dict(sampling_probability=1.5), "sampling_probability"),
    (dict(steps=None), "steps"),
    (dict(epochs=3), "steps"),
    (dict(accountant="moments"), "accountant"),
])
def test_calibration_errors_name_the_argument(kwargs, arg):
    args = dict(target_epsilon=1.0, target_delta=DELTA,
                sampling_probability=Q, steps=100)
    args.update(kwargs)
    with pytest.raises(ValueError, match="`%s`" % arg):
        privacy.noise_multiplier_for(**args)


@pytest.mark.parametrize("kwargs,arg", [
    (dict(sampling_probability=0.0), "sampling_probability"),
    (dict(sampling_probability=1.01), "sampling_probability"),
    (dict(delta=1.0), "delta"),
    (dict(sampling="random"), "sampling"),
    (dict(noise_multiplier=-1.0), "noise_multiplier"),
])
def test_budget_errors_name_the_argument(kwargs, arg):
    args = dict(noise_multiplier=SIGMA, sampling_probability=Q, delta=DELTA)
    args.update(kwargs)
    with pytest.raises(ValueError, match="`%s`" % arg):
        privacy.PrivacyBudget(**args)


def test_no_steps_no_epsilon_and_no_noise_infinite():
    assert budget_lib.dp_sgd_epsilon(0, Q, SIGMA, DELTA) == 0.0
    assert math.isinf(budget_lib.dp_sgd_epsilon(3, Q, 0.0, DELTA))


BAD_Q = [0.0, -0.1, 1.5, float("nan")]
BAD_DELTA = [0.0, 1.0, -1e-5, 1.5, float("nan")]
# Each public entry point that takes q or δ: `f(q, delta)` and the name its
# error must give for each (None: it takes no such argument).
ENTRY_POINTS = {
    "dp_sgd_epsilon": (lambda q, d: budget_lib.dp_sgd_epsilon(10, q, SIGMA, d),
                       "sampling_probability", "delta"),
    "PrivacyBudget": (lambda q, d: privacy.PrivacyBudget(SIGMA, q, d),
                      "sampling_probability", "delta"),
    "noise_multiplier_for": (
        lambda q, d: privacy.noise_multiplier_for(1.0, d, q, steps=10),
        "sampling_probability", "target_delta"),
    "PoissonSampler": (lambda q, d: privacy.PoissonSampler(10, q),
                       "sampling_probability", None),
    "poisson_batches": (lambda q, d: privacy.poisson_batches(q),
                        "sampling_probability", None),
    "compute_dp_sgd_privacy": (
        lambda q, d: privacy.compute_dp_sgd_privacy(1000, 10, SIGMA, 1, d),
        None, "delta"),
    "compute_dp_sgd_privacy_statement": (
        lambda q, d: privacy.compute_dp_sgd_privacy_statement(
            1000, 10, 1, SIGMA, d), None, "delta"),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_entry_point_names_a_bad_q_or_delta(entry):
    """q outside (0, 1] and δ outside (0, 1), at every public function that
    takes them: a ValueError naming the argument (and no figure)."""
    call, q_arg, delta_arg = ENTRY_POINTS[entry]
    if q_arg is not None:
        call(Q, DELTA)                                  # good values pass
        for q in BAD_Q:
            with pytest.raises(ValueError, match=r"\b%s\b" % q_arg):
                call(q, DELTA)
    if delta_arg is not None:
        call(Q, DELTA)
        for d in BAD_DELTA:
            with pytest.raises(ValueError, match=r"\b%s\b" % delta_arg):
                call(Q, d)


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_unreachable_target_names_target_epsilon(kind):
    """A target ε no σ reaches (up to the search's bound) is an error
    naming `target_epsilon`, for each accountant; never a σ above the
    target."""
    with pytest.raises(ValueError, match="`target_epsilon`.*not reached"):
        privacy.noise_multiplier_for(1e-3, 1e-12, Q, steps=1000,
                                     accountant=kind)
