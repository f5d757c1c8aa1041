"""ε spent by the run itself, and the noise multiplier for a target ε.

`PrivacyBudget` keeps the accountant's inputs with the run, in variables
saved by checkpoints: the steps taken (counted by the op `track(train_op)`
returns), the sampling probability q, the noise multiplier σ, and whether
microbatches of several examples were used (their sensitivity is 2C, so σ
is halved for the accounting) or users are the unit (`group_ids`: q is then
the user sampling probability). ε at δ is then a function of the
variables' values, whatever happened before a restart:

    budget = PrivacyBudget(noise_multiplier=1.1, sampling_probability=256 / 60000,
                           delta=1e-5)
    train_op = budget.track(opt.minimize(loss, global_step=step))
    hook = PrivacyBudgetHook(budget, every_n_steps=100, stop_at_epsilon=3.0)
    with tf.compat.v1.train.MonitoredTrainingSession(
            checkpoint_dir=d, hooks=[hook]) as sess: ...
    # or, in a Session loop: budget.epsilon(sess)

`sampling="poisson"` (default) quotes the Poisson-subsampled Gaussian ε of
the steps taken (`custagg.privacy.sampling` gives that sampler): it equals
`compute_dp_sgd_privacy(n, B, σ, epochs, δ)` for `q = B/n` and
`steps = epochs·n/B`. `sampling="shuffle"` (or "fixed_size"): the batches
are fixed-size slices of a shuffled order, which the Poisson analysis does
not cover; the figure is then the one that holds for any order, each
example in one step per epoch (`ceil(steps·q)` Gaussian steps, no
amplification), and the statement says so.

`noise_multiplier_for(target_epsilon, target_delta, sampling_probability,
steps=... | epochs=...)` calibrates σ with dp-accounting's
`calibrate_dp_mechanism`, never above the target.

RDP uses TF Privacy's orders (`accounting.RDP_ORDERS`); PLD dp-accounting's
`PLDAccountant` (tighter).
"""

from __future__ import annotations

import logging
import math
import numbers

import numpy as np
import tensorflow as tf

from custagg.privacy import accounting

__all__ = ["PrivacyBudget", "PrivacyBudgetHook", "dp_sgd_epsilon",
           "noise_multiplier_for", "SAMPLINGS"]

_log = logging.getLogger("custagg")

# "fixed_size" is another name for "shuffle": fixed-size batches.
SAMPLINGS = ("poisson", "shuffle", "fixed_size")
_ACCOUNTANTS = ("rdp", "pld")


def _check_real(value, arg, fn, low, high, low_open=True, high_open=True):
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and \
        math.isfinite(value) and (value > low if low_open else value >= low) \
        and (value < high if high_open else value <= high)
    if not ok:
        raise ValueError("%s: `%s` must be a number in %s%g, %g%s, got %r." % (
            fn, arg, "(" if low_open else "[", low, high,
            ")" if high_open else "]", value))
    return float(value)


def _check_choice(value, arg, fn, choices):
    if value not in choices:
        raise ValueError("%s: `%s` must be one of %s, got %r." % (
            fn, arg, ", ".join(repr(c) for c in choices), value))
    return value


def _dpa():
    try:
        import dp_accounting  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise ImportError("custagg.privacy's budget and calibration need the "
                          "dp-accounting package: pip install dp-accounting.") \
            from e
    return dp_accounting


def _accountant(kind):
    dpa = _dpa()
    if kind == "pld":
        return dpa.pld.PLDAccountant()
    return dpa.rdp.RdpAccountant(list(accounting.RDP_ORDERS))


def _event(steps, q, sigma, sampling):
    dpa = _dpa()
    gaussian = dpa.GaussianDpEvent(sigma)
    if sampling == "poisson":
        step = gaussian if q == 1 else dpa.PoissonSampledDpEvent(
            sampling_probability=q, event=gaussian)
        return dpa.SelfComposedDpEvent(step, int(steps))
    # Shuffled fixed-size batches: each example in one step per epoch.
    return dpa.SelfComposedDpEvent(gaussian, int(math.ceil(steps * q - 1e-9)))


def dp_sgd_epsilon(steps, sampling_probability, noise_multiplier, delta,
                   accountant="rdp", sampling="poisson",
                   used_microbatching=False):
    """ε at `delta` of `steps` DP-SGD steps (add-or-remove-one adjacency,
    every step's update released).

    Args:
      steps: steps taken (int >= 0).
      sampling_probability: q in (0, 1] (B/n; users per step / users with
        user-level clipping).
      noise_multiplier: σ >= 0 (noise std / clip norm).
      delta: δ in (0, 1).
      accountant: "rdp" (TF Privacy's orders) or "pld".
      sampling: "poisson" (the subsampled Gaussian) or "shuffle" /
        "fixed_size" (no amplification: `ceil(steps q)` Gaussian steps).
      used_microbatching: microbatches of more than one example (σ halved).

    Returns:
      ε (float; inf for σ = 0, 0 for no steps).
    """
    fn = "custagg.privacy.dp_sgd_epsilon"
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) \
            or steps < 0:
        raise ValueError("%s: `steps` must be an int >= 0, got %r."
                         % (fn, steps))
    q = _check_real(sampling_probability, "sampling_probability", fn, 0, 1,
                    high_open=False)
    sigma = _check_real(noise_multiplier, "noise_multiplier", fn, 0,
                        math.inf, low_open=False)
    delta = _check_real(delta, "delta", fn, 0, 1)
    _check_choice(accountant, "accountant", fn, _ACCOUNTANTS)
    _check_choice(sampling, "sampling", fn, SAMPLINGS)
    if steps == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    if used_microbatching:
        sigma /= 2
    acc = _accountant(accountant)
    acc.compose(_event(steps, q, sigma, sampling))
    return float(acc.get_epsilon(delta))


def _steps_for(epochs, q, fn):
    if epochs is not None:
        epochs = _check_real(epochs, "epochs", fn, 0, math.inf)
        return int(math.ceil(epochs / q - 1e-9))
    return None


def noise_multiplier_for(target_epsilon, target_delta, sampling_probability,
                         steps=None, epochs=None, accountant="rdp",
                         used_microbatching=False):
    """The smallest noise multiplier σ whose ε at `target_delta` is at most
    `target_epsilon`, for Poisson-sampled DP-SGD (dp-accounting's
    `calibrate_dp_mechanism`; the result is checked and never gives more
    than the target).

    Args:
      target_epsilon: ε > 0.
      target_delta: δ in (0, 1).
      sampling_probability: q in (0, 1] (B / n).
      steps, epochs: the length of training, exactly one of them (`epochs`
        counts as TF Privacy does: `ceil(epochs / q)` steps).
      accountant: "rdp" or "pld".
      used_microbatching: microbatches of more than one example (the σ
        returned is then the optimizer's `noise_multiplier`, twice the
        accounted one).

    Returns:
      σ (float).

    Raises:
      ValueError: an argument out of range, both or neither of `steps` and
        `epochs`, or a target no σ reaches (RDP's orders bound ε from below
        at small δ).

    Example:
      >>> sigma = noise_multiplier_for(3.0, 1e-5, 256 / 60000, epochs=60)
    """
    fn = "custagg.privacy.noise_multiplier_for"
    eps = _check_real(target_epsilon, "target_epsilon", fn, 0, math.inf)
    delta = _check_real(target_delta, "target_delta", fn, 0, 1)
    q = _check_real(sampling_probability, "sampling_probability", fn, 0, 1,
                    high_open=False)
    _check_choice(accountant, "accountant", fn, _ACCOUNTANTS)
    if (steps is None) == (epochs is None):
        raise ValueError("%s: give exactly one of `steps` and `epochs` (the "
                         "length of training), got steps=%r, epochs=%r."
                         % (fn, steps, epochs))
    if steps is not None and (isinstance(steps, bool) or not isinstance(
            steps, numbers.Integral) or steps < 1):
        raise ValueError("%s: `steps` must be a positive int, got %r."
                         % (fn, steps))
    steps = int(steps) if steps is not None else _steps_for(epochs, q, fn)
    factor = 2.0 if used_microbatching else 1.0

    def epsilon(sigma):   # the accounted σ (halved with microbatches)
        return dp_sgd_epsilon(steps, q, sigma, delta, accountant)

    dpa = _dpa()
    rdp_sigma = _calibrate(dpa, "rdp", steps, q, eps, delta)
    if accountant == "rdp":
        sigma = rdp_sigma
    else:
        # PLD's ε is at most RDP's: its σ lies below RDP's (or, where no σ
        # reaches the target by RDP, below the first power of 2 that does).
        high = rdp_sigma
        if high is None:
            high = 1.0
            while dp_sgd_epsilon(steps, q, high, delta, "pld") > eps:
                high *= 2
                if high > 1e3:
                    _unreachable(fn, eps, delta, high, "pld")
        low = high / 2
        while dp_sgd_epsilon(steps, q, low, delta, "pld") <= eps:
            high, low = low, low / 2
        sigma = float(dpa.calibrate_dp_mechanism(
            lambda: _accountant("pld"),
            lambda sigma: _event(steps, q, sigma, "poisson"), eps, delta,
            bracket_interval=dpa.ExplicitBracketInterval(low, high),
            tol=1e-7 * high))
    if sigma is None:
        _unreachable(fn, eps, delta, _HUGE, accountant)
    # Never above the target: step up (growing steps) until the bound holds.
    bump = 1e-7
    while epsilon(sigma) > eps:
        sigma *= 1 + bump
        bump *= 2
    return sigma * factor


# A σ of 1e4 is beyond any use (noise 10^4 C per step).
_HUGE = 1e4


def _unreachable(fn, eps, delta, sigma, accountant):
    raise ValueError(
        "%s: `target_epsilon`=%g is not reached at target_delta=%g by any "
        "noise multiplier up to %g with the %s accountant: raise "
        "target_epsilon or target_delta%s." % (
            fn, eps, delta, sigma, accountant.upper(),
            ", or use accountant='pld'" if accountant == "rdp" else ""))


def _calibrate(dpa, accountant, steps, q, eps, delta):
    """σ from `calibrate_dp_mechanism` over [1e-3, 1e4], or None when even
    σ = 1e4 misses the target (RDP: its orders bound ε from below)."""
    if dp_sgd_epsilon(steps, q, _HUGE, delta, accountant) > eps:
        return None
    return float(dpa.calibrate_dp_mechanism(
        lambda: _accountant(accountant),
        lambda sigma: _event(steps, q, sigma, "poisson"), eps, delta,
        bracket_interval=dpa.ExplicitBracketInterval(1e-3, _HUGE),
        tol=1e-9))


class PrivacyBudget:
    """The accountant's inputs in checkpointed variables, and ε from them.

    Args:
      noise_multiplier: σ of the optimizer (Python number).
      sampling_probability: q in (0, 1]: B/n (expected batch size over the
        data set size), or users per step / users with `group_ids`.
      delta: δ in (0, 1) at which ε is quoted.
      accountant: "rdp" or "pld".
      sampling: "poisson" (batches from `custagg.privacy.sampling`),
        "shuffle" or "fixed_size" (fixed-size batches of a shuffled order:
        the statement quotes no Poisson ε).
      used_microbatching: microbatches of more than one example (σ halved
        in the accounting, TF Privacy's statement's convention).
      user_level: users are the unit (`group_ids`); q samples users.
      name: the variables' name scope.
    """

    def __init__(self, noise_multiplier, sampling_probability, delta,
                 accountant="rdp", sampling="poisson",
                 used_microbatching=False, user_level=False,
                 name="privacy_budget"):
        fn = "custagg.privacy.PrivacyBudget"
        self.noise_multiplier = _check_real(
            noise_multiplier, "noise_multiplier", fn, 0, math.inf,
            low_open=False)
        self.sampling_probability = _check_real(
            sampling_probability, "sampling_probability", fn, 0, 1,
            high_open=False)
        self.delta = _check_real(delta, "delta", fn, 0, 1)
        self.accountant = _check_choice(accountant, "accountant", fn,
                                        _ACCOUNTANTS)
        self.sampling = _check_choice(sampling, "sampling", fn, SAMPLINGS)
        self.used_microbatching = bool(used_microbatching)
        self.user_level = bool(user_level)
        with tf.compat.v1.variable_scope(None, default_name=name):
            def var(vname, value, dtype):
                return tf.compat.v1.get_variable(
                    vname, initializer=tf.constant(value, dtype),
                    trainable=False, use_resource=True)
            self.steps = var("steps", 0, tf.int64)
            self._settings = [
                var("sampling_probability", self.sampling_probability,
                    tf.float64),
                var("noise_multiplier", self.noise_multiplier, tf.float64),
                var("used_microbatching", int(self.used_microbatching),
                    tf.int64),
                var("user_level", int(self.user_level), tf.int64),
                var("poisson", int(self.sampling == "poisson"), tf.int64)]

    def variables(self):
        return [self.steps] + self._settings

    def track(self, train_op):
        """An op that runs `train_op` and then counts one step."""
        with tf.control_dependencies([train_op]):
            return tf.compat.v1.assign_add(self.steps, 1).op

    def _expected(self):
        return [self.sampling_probability, self.noise_multiplier,
                int(self.used_microbatching), int(self.user_level),
                int(self.sampling == "poisson")]

    def check_settings(self, session):
        """ValueError when the variables (restored from a checkpoint) hold
        other settings than this object's: the steps before the restart ran
        with those, and one figure cannot cover both."""
        got = session.run(self._settings)
        names = ["sampling_probability", "noise_multiplier",
                 "used_microbatching", "user_level", "sampling"]
        for name, g, want in zip(names, got, self._expected()):
            if not np.isclose(float(g), float(want), rtol=1e-12, atol=0):
                raise ValueError(
                    "custagg.privacy.PrivacyBudget: the checkpoint's run used "
                    "%s=%r, this run %r. The steps taken before the restart "
                    "were accounted with the checkpoint's value: keep it, or "
                    "start a new run (and budget) from scratch."
                    % (name, g, want))

    def epsilon_at(self, steps):
        """ε after `steps` steps with this budget's settings."""
        return dp_sgd_epsilon(int(steps), self.sampling_probability,
                              self.noise_multiplier, self.delta,
                              self.accountant, self._sampling_kind(),
                              self.used_microbatching)

    def _sampling_kind(self):
        return "poisson" if self.sampling == "poisson" else "shuffle"

    def epsilon(self, session):
        """`(ε, steps taken)` from the variables' values in `session`."""
        self.check_settings(session)
        steps = int(session.run(self.steps))
        return self.epsilon_at(steps), steps

    def max_steps(self, epsilon):
        """The most steps whose ε stays at or below `epsilon`."""
        if self.epsilon_at(1) > epsilon:
            return 0
        low, high = 1, 2
        while self.epsilon_at(high) <= epsilon:
            low, high = high, high * 2
            if high > 1 << 40:
                return high
        while high - low > 1:
            mid = (low + high) // 2
            if self.epsilon_at(mid) <= epsilon:
                low = mid
            else:
                high = mid
        return low

    def statement(self, session):
        """A one-paragraph account of the run's ε (str)."""
        eps, steps = self.epsilon(session)
        unit = "user" if self.user_level else "example"
        text = ("%d DP-SGD steps, noise multiplier %g%s, sampling probability "
                "%g: %s-level epsilon %.6g at delta %g (%s accountant, "
                "add-or-remove-one adjacency, every step's update released)"
                % (steps, self.noise_multiplier,
                   " (halved for microbatches of several examples)"
                   if self.used_microbatching else "",
                   self.sampling_probability, unit, eps, self.delta,
                   self.accountant.upper()))
        if self.sampling == "poisson":
            text += (", assuming Poisson sampling: each %s in each batch "
                     "independently with probability %g." % (
                         unit, self.sampling_probability))
        else:
            text += (". The batches were fixed-size slices of a shuffled "
                     "order, which the Poisson analysis does not cover: the "
                     "figure is the one for any order, each %s in one step "
                     "per epoch (%d Gaussian steps, no amplification by "
                     "sampling); no Poisson epsilon is claimed." % (
                         unit, int(math.ceil(
                             steps * self.sampling_probability - 1e-9))))
        return text


class PrivacyBudgetHook(tf.compat.v1.train.SessionRunHook):
    """Logs the run's ε every `every_n_steps` steps (and at the end), and
    with `stop_at_epsilon` stops before a step would exceed it.

    The steps are `budget.steps` (counted by `budget.track(train_op)`), so
    a run restored from a checkpoint continues the count. After the session
    is created the hook checks that the checkpoint's settings are the
    budget's (`PrivacyBudget.check_settings`).

    Args:
      budget: a `PrivacyBudget`.
      every_n_steps: how often to log (steps counted by the budget).
      stop_at_epsilon: None, or the ε the run may not exceed:
        `request_stop` once the next step would.
      log: a function taking one line (default: the "custagg" logger's
        info).

    Attributes:
      last_epsilon, last_steps: the latest figures computed.
    """

    def __init__(self, budget, every_n_steps=100, stop_at_epsilon=None,
                 log=None):
        fn = "custagg.privacy.PrivacyBudgetHook"
        if not isinstance(budget, PrivacyBudget):
            raise TypeError("%s: `budget` must be a PrivacyBudget, got %r."
                            % (fn, budget))
        if isinstance(every_n_steps, bool) or not isinstance(
                every_n_steps, numbers.Integral) or every_n_steps < 1:
            raise ValueError("%s: `every_n_steps` must be a positive int, got "
                             "%r." % (fn, every_n_steps))
        if stop_at_epsilon is not None:
            _check_real(stop_at_epsilon, "stop_at_epsilon", fn, 0, math.inf)
        self._budget = budget
        self._every = int(every_n_steps)
        self._stop_at = stop_at_epsilon
        self._log = log or _log.info
        self._max_steps = None
        self._reported = None
        self.last_epsilon = None
        self.last_steps = None

    def begin(self):
        if self._stop_at is not None:
            self._max_steps = self._budget.max_steps(self._stop_at)

    def after_create_session(self, session, coord):
        self._budget.check_settings(session)
        self.last_steps = int(session.run(self._budget.steps))
        if self._max_steps is not None and self.last_steps >= self._max_steps:
            self._report(self.last_steps)
            coord.request_stop()

    def after_run(self, run_context, run_values):
        del run_values
        # Read after the run (a fetch in the same run may see the count
        # before or after its increment).
        steps = int(run_context.session.run(self._budget.steps))
        if steps != self.last_steps and steps % self._every == 0:
            self._report(steps)
        self.last_steps = steps
        if self._max_steps is not None and steps + 1 > self._max_steps:
            if steps != self._reported:
                self._report(steps)
            run_context.request_stop()

    def end(self, session):
        steps = int(session.run(self._budget.steps))
        if steps != self._reported:
            self._report(steps)

    def _report(self, steps):
        self.last_steps = self._reported = steps
        self.last_epsilon = self._budget.epsilon_at(steps)
        self._log("privacy: %d steps, epsilon %.6g at delta %g (%s, %s "
                  "sampling)" % (steps, self.last_epsilon, self._budget.delta,
                                 self._budget.accountant.upper(),
                                 self._budget._sampling_kind()))  # pylint: disable=protected-access
