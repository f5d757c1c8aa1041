"""ε for DP-SGD, from Google's dp-accounting library (RDP and PLD).

`compute_dp_sgd_privacy(n, batch_size, noise_multiplier, epochs, delta)` has
TF Privacy's meaning (`compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy`,
0.9.0): `ceil(epochs * n / batch_size)` steps, each a Gaussian mechanism
with `noise_multiplier` on a Poisson-subsampled batch with probability
`q = batch_size / n`, composed by an RDP accountant over TF Privacy's list
of orders; it returns `(epsilon, optimal RDP order)` at `delta`.
`accountant="pld"` composes the same events with dp-accounting's privacy
loss distribution accountant instead (tighter; the order is then None).

Like TF Privacy's function, this assumes Poisson sampling and does not
double the sensitivity for microbatches of more than one example; see TF
Privacy's `compute_dp_sgd_privacy_statement` for the caveats.

dp-accounting is imported when first needed, so `import custagg` does not
pay for it (and stays importable where it is missing).
"""

from __future__ import annotations

import math
import numbers

__all__ = ["compute_dp_sgd_privacy", "RDP_ORDERS", "dp_sgd_steps"]

# TF Privacy 0.9.0's orders for compute_dp_sgd_privacy, so the optimal order
# (and epsilon) match its result.
RDP_ORDERS = tuple([1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5] +
                   list(range(5, 64)) + [128, 256, 512])


def _dp_accounting():
    try:
        import dp_accounting  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise ImportError(
            "custagg.privacy.compute_dp_sgd_privacy needs the dp-accounting "
            "package (Google's differential-privacy accountant library): "
            "pip install dp-accounting (it is a dependency of custagg; a "
            "--no-deps install skips it).") from e
    return dp_accounting


def dp_sgd_steps(n, batch_size, epochs):
    """Steps TF Privacy counts for `epochs` epochs: `ceil(epochs * n / B)`."""
    return int(math.ceil(epochs * n / batch_size))


def _check(n, batch_size, noise_multiplier, epochs, delta):
    fn = "custagg.privacy.compute_dp_sgd_privacy"
    for name, value in (("n", n), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(
                value, numbers.Integral) or value < 1:
            raise ValueError("%s: %s must be a positive int; got %r."
                             % (fn, name, value))
    if batch_size > n:
        raise ValueError("%s: n (%d) must be at least the batch size (%d)."
                         % (fn, n, batch_size))
    if not isinstance(noise_multiplier, numbers.Real) or not (
            noise_multiplier >= 0):
        raise ValueError("%s: noise_multiplier must be a non-negative number; "
                         "got %r." % (fn, noise_multiplier))
    if not isinstance(epochs, numbers.Real) or not epochs > 0:
        raise ValueError("%s: epochs must be positive (may be fractional); "
                         "got %r." % (fn, epochs))
    if not isinstance(delta, numbers.Real) or not 0 < delta < 1:
        raise ValueError("%s: delta must be in (0, 1); got %r." % (fn, delta))


def compute_dp_sgd_privacy(n, batch_size, noise_multiplier, epochs, delta,
                           accountant="rdp"):
    """ε of DP-SGD after `epochs` epochs, as TF Privacy computes it.

    Args:
      n: number of training examples.
      batch_size: examples per step (whatever the number of microbatches).
      noise_multiplier: noise stddev / l2_norm_clip.
      epochs: epochs trained (may be fractional).
      delta: the target δ (commonly < 1/n).
      accountant: "rdp" (TF Privacy's, default) or "pld".

    Returns:
      `(epsilon, order)`: the RDP order that gives the bound (None for
      "pld"). `epsilon` is inf for `noise_multiplier=0`.

    Example:
      >>> eps, order = compute_dp_sgd_privacy(60000, 256, 1.1, 60, 1e-5)
      >>> round(eps, 3), order      # TF Privacy's MNIST tutorial settings
      (2.597, 8.0)
    """
    _check(n, batch_size, noise_multiplier, epochs, delta)
    if accountant not in ("rdp", "pld"):
        raise ValueError("custagg.privacy.compute_dp_sgd_privacy: accountant "
                         "must be 'rdp' or 'pld'; got %r." % (accountant,))
    if noise_multiplier == 0:
        return math.inf, None
    dpa = _dp_accounting()
    event = dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(
            sampling_probability=batch_size / n,
            event=dpa.GaussianDpEvent(noise_multiplier)),
        dp_sgd_steps(n, batch_size, epochs))
    if accountant == "pld":
        acc = dpa.pld.PLDAccountant()
        acc.compose(event)
        return float(acc.get_epsilon(delta)), None
    acc = dpa.rdp.RdpAccountant(list(RDP_ORDERS))
    acc.compose(event)
    eps, order = acc.get_epsilon_and_optimal_order(delta)
    return float(eps), float(order)
