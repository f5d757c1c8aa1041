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
double the sensitivity for microbatches of more than one example (TF
Privacy deprecated it for that). `compute_dp_sgd_privacy_statement` (TF
Privacy's replacement, same arguments and figures) states both the
shuffled-batches and the Poisson ε, doubles the sensitivity when
`used_microbatching`, and gives user-level ε with `max_examples_per_user`
(group privacy), and, with `number_of_users` and `users_per_batch`
(custagg's addition), the user-level ε of training with user-level
clipping (`group_ids`; `user_clipping_epsilon`).

dp-accounting is imported when first needed, so `import custagg` does not
pay for it (and stays importable where it is missing).
"""

from __future__ import annotations

import math
import numbers

__all__ = ["compute_dp_sgd_privacy", "compute_dp_sgd_privacy_statement",
           "AccountantType", "dp_sgd_epsilons", "RDP_ORDERS", "dp_sgd_steps",
           "user_clipping_epsilon"]

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


# ---------------------------------------------------------------------------
# The privacy statement (TF Privacy's compute_dp_sgd_privacy_statement).

import enum  # noqa: E402
import textwrap  # noqa: E402


class AccountantType(enum.Enum):
    """Which dp-accounting accountant composes the steps."""
    RDP = "RDP"
    PLD = "PLD"

    def get_accountant(self):
        dpa = _dp_accounting()
        if self is AccountantType.RDP:
            return dpa.rdp.RdpAccountant()
        return dpa.pld.PLDAccountant()


class UserLevelDPComputationError(Exception):
    """The search for the example-level delta behind a user-level bound
    failed."""


def _accountant_type(accountant_type):
    if isinstance(accountant_type, AccountantType):
        return accountant_type
    # TF Privacy's own enum, or a string.
    value = getattr(accountant_type, "value", accountant_type)
    try:
        return AccountantType(str(value).upper())
    except ValueError:
        raise ValueError("accountant_type must be AccountantType.RDP or .PLD "
                         "(or 'RDP' / 'PLD'); got %r." % (accountant_type,)) \
            from None


def example_epsilon(num_epochs, noise_multiplier, delta,
                    used_microbatching=True,
                    poisson_subsampling_probability=None,
                    accountant_type=AccountantType.RDP):
    """Add-or-remove-one-example ε of DP-SGD (all checkpoints released).

    Each step is a Gaussian mechanism with `noise_multiplier` (halved when
    microbatches of more than one example were used: replacing one example
    moves a microbatch's clipped gradient by up to 2C). Without sampling,
    every example is in one step per epoch: `ceil(num_epochs)` composed
    steps. With Poisson sampling at rate q: `ceil(num_epochs / q)` steps of
    the subsampled mechanism.
    """
    if num_epochs <= 0:
        raise ValueError("num_epochs must be positive; got %r." % num_epochs)
    if noise_multiplier < 0:
        raise ValueError("noise_multiplier must be non-negative; got %r."
                         % noise_multiplier)
    if not 0 <= delta <= 1:
        raise ValueError("delta must be in [0, 1]; got %r." % delta)
    dpa = _dp_accounting()
    sigma = noise_multiplier / 2 if used_microbatching else noise_multiplier
    event = dpa.GaussianDpEvent(sigma)
    if poisson_subsampling_probability is None:
        steps = int(math.ceil(num_epochs))
    else:
        event = dpa.PoissonSampledDpEvent(
            sampling_probability=poisson_subsampling_probability, event=event)
        steps = int(math.ceil(num_epochs / poisson_subsampling_probability))
    acc = _accountant_type(accountant_type).get_accountant()
    acc.compose(dpa.SelfComposedDpEvent(count=steps, event=event))
    return float(acc.get_epsilon(delta))


def _log_expm1(x):
    """log(e^x - 1) without overflow for large x."""
    return x + math.log(-math.expm1(-x))


def user_epsilon(num_epochs, noise_multiplier, user_delta,
                 max_examples_per_user, used_microbatching=True,
                 poisson_subsampling_probability=None,
                 accountant_type=AccountantType.RDP):
    """Add-or-remove-one-user ε from the example-level guarantee by group
    privacy (Vadhan 2017, Lemma 2.2): an (ε, δ) guarantee for one example
    gives `(k ε, δ (e^{kε} - 1) / (e^ε - 1))` for k examples. The
    example-level δ is searched (bisection on log δ) so that the user-level
    δ equals `user_delta`; inf when no finite bound exists.
    """
    k = max_examples_per_user
    if isinstance(k, bool) or int(k) != k or k <= 0:
        raise ValueError("max_examples_per_user must be a positive integer; "
                         "got %r." % (k,))
    args = (used_microbatching, poisson_subsampling_probability,
            accountant_type)
    if k == 1:
        return example_epsilon(num_epochs, noise_multiplier, user_delta, *args)
    target = math.log(user_delta)
    cache = {}

    def eps_at(log_delta):
        if log_delta not in cache:
            cache[log_delta] = example_epsilon(
                num_epochs, noise_multiplier, math.exp(log_delta), *args)
        return cache[log_delta]

    def gap(log_delta):
        eps = eps_at(log_delta)
        if not math.isfinite(eps) or eps <= 0:
            return math.inf if not math.isfinite(eps) else -math.inf
        return log_delta + _log_expm1(k * eps) - _log_expm1(eps) - target

    # gap grows with log_delta; at log_delta = target it is >= 0. Walk down
    # by decades until it is negative, then bisect.
    high, low = target, target - math.log(10)
    g_low = gap(low)
    while g_low > 0:
        high, low = low, low - max(math.log(10), g_low)
        g_low = gap(low)
        if not math.isfinite(g_low) or low < -1e4:
            return math.inf
    for _ in range(200):
        mid = 0.5 * (low + high)
        if gap(mid) > 0:
            high = mid
        else:
            low = mid
        if high - low < 1e-12:
            break
    if not math.isfinite(gap(low)):
        raise UserLevelDPComputationError(
            "the search for the example-level delta did not converge")
    return k * eps_at(low)


def user_clipping_epsilon(num_epochs, noise_multiplier, delta,
                          user_sampling_probability=None,
                          accountant_type=AccountantType.RDP):
    """Add-or-remove-one-user ε of DP-SGD with user-level clipping.

    With `group_ids` each user's examples form one clipped contribution
    (norm at most C), so adding or removing a user moves the noised sum by
    at most C: each step is a Gaussian mechanism with `noise_multiplier`
    over users (no halving, unlike example-level adjacency with
    microbatches, where a microbatch stays when one example leaves it),
    whatever the number of examples per user. Without sampling each user is
    in one step per epoch (`ceil(num_epochs)` steps); with Poisson sampling
    of users at rate q, `ceil(num_epochs / q)` subsampled steps.
    """
    return example_epsilon(num_epochs, noise_multiplier, delta,
                           used_microbatching=False,
                           poisson_subsampling_probability=(
                               user_sampling_probability),
                           accountant_type=accountant_type)


def _check_users(number_of_users, users_per_batch):
    fn = "custagg.privacy.compute_dp_sgd_privacy_statement"
    if number_of_users is None and users_per_batch is None:
        return None
    if number_of_users is None or users_per_batch is None:
        raise ValueError(
            "%s: user-level clipping (group_ids) needs both number_of_users "
            "(users in the training set) and users_per_batch (users in each "
            "step, or the expected number under Poisson sampling); got "
            "number_of_users=%r, users_per_batch=%r." % (
                fn, number_of_users, users_per_batch))
    if isinstance(number_of_users, bool) or not isinstance(
            number_of_users, numbers.Integral) or number_of_users < 1:
        raise ValueError("%s: number_of_users must be a positive int; got %r."
                         % (fn, number_of_users))
    if isinstance(users_per_batch, bool) or not isinstance(
            users_per_batch, numbers.Real) or not (
                0 < users_per_batch <= number_of_users):
        raise ValueError(
            "%s: users_per_batch must be a number in (0, number_of_users=%d] "
            "(users per step, or their expected number); got %r."
            % (fn, number_of_users, users_per_batch))
    return users_per_batch / number_of_users


def compute_dp_sgd_privacy_statement(number_of_examples, batch_size,
                                     num_epochs, noise_multiplier, delta,
                                     used_microbatching=True,
                                     max_examples_per_user=None,
                                     accountant_type=AccountantType.RDP,
                                     number_of_users=None,
                                     users_per_batch=None):
    """A statement of DP-SGD's guarantee, TF Privacy's arguments and figures.

    Gives the example-level ε (add-or-remove-one adjacency, every checkpoint
    released) twice -- each example once per epoch (shuffled batches, no
    amplification by sampling) and assuming Poisson sampling at rate
    `batch_size / number_of_examples` -- and, with `max_examples_per_user`
    and RDP, the user-level ε by group privacy.

    Args:
      number_of_examples: dataset size n.
      batch_size: examples per step (whatever the microbatching).
      num_epochs: epochs trained (may be fractional).
      noise_multiplier: noise stddev / clip norm (constant; the clip may
        adapt).
      delta: the target δ.
      used_microbatching: microbatches of more than one example (doubles the
        sensitivity; see Ponomareva et al. 2023, "How to DP-fy ML", 5.6).
      max_examples_per_user: a cap on any user's examples, for user-level ε.
      accountant_type: `AccountantType.RDP` (default) or `.PLD` (also TF
        Privacy's enum, or "RDP" / "PLD"); user-level ε needs RDP.
      number_of_users, users_per_batch: custagg's addition, for training
        with user-level clipping (`group_ids`: each user's examples clipped
        together): the number of users in the training set and the users
        in each step (the expected number under Poisson sampling of
        users). The statement then adds the add-or-remove-one-user ε of
        that training (each user once per epoch, and Poisson sampling of
        users at `users_per_batch / number_of_users`), which needs no bound
        on examples per user (`user_clipping_epsilon`). `num_epochs`
        counts passes over the users. Without them the statement is TF
        Privacy's, word for word.

    Returns:
      The statement (str, several paragraphs).

    Example:
      >>> print(compute_dp_sgd_privacy_statement(60000, 256, 60, 1.1, 1e-5,
      ...                                        used_microbatching=False))
    """
    acc = _accountant_type(accountant_type)
    figures = dp_sgd_epsilons(number_of_examples, batch_size, num_epochs,
                              noise_multiplier, delta, used_microbatching,
                              max_examples_per_user, acc, number_of_users,
                              users_per_batch)

    def fill(text):
        return textwrap.fill(text, width=80)

    def fmt(x):
        return "    inf (**)" if math.isinf(x) else "%12.3f" % x

    users = ("at most %d examples per user." % max_examples_per_user
             if max_examples_per_user is not None else
             "no bound on number of examples per user.")
    parts = [
        fill("DP-SGD performed over %s examples with %s examples per "
             "iteration, noise multiplier %s for %s epochs %s microbatching, "
             "and %s" % (number_of_examples, batch_size, noise_multiplier,
                         num_epochs,
                         "with" if used_microbatching else "without", users)),
        fill("This privacy guarantee protects the release of all model "
             "checkpoints in addition to the final model."),
        fill("Example-level DP with add-or-remove-one adjacency at delta = %s "
             "computed with %s accounting:" % (delta, acc.value)) +
        "\n    Epsilon with each example occurring once per epoch:  %s"
        "\n    Epsilon assuming Poisson sampling (*):               %s"
        % (fmt(figures["example_epsilon"]),
           fmt(figures["example_epsilon_poisson"]))]
    if max_examples_per_user is None:
        parts.append(fill("No user-level privacy guarantee is possible "
                          "without a bound on the number of examples per "
                          "user."))
    elif acc is AccountantType.PLD:
        parts.append(fill("User-level DP epsilon computation is not supported "
                          "for PLD accounting at this time. Use RDP "
                          "accounting to obtain user-level DP guarantees."))
    else:
        parts.append(
            fill("User-level DP with add-or-remove-one adjacency at delta = "
                 "%s computed using %s accounting and group privacy:"
                 % (delta, acc.value)) +
            "\n    Epsilon with each example occurring once per epoch:  %s"
            "\n    Epsilon assuming Poisson sampling (*):               %s"
            % (fmt(figures["user_epsilon"]),
               fmt(figures["user_epsilon_poisson"])))
    if number_of_users is not None:
        parts.append(
            fill("User-level DP with user-level clipping (all examples of a "
                 "user clipped together, group_ids) over %s users with %s "
                 "users per iteration, add-or-remove-one-user adjacency at "
                 "delta = %s computed with %s accounting (no bound on "
                 "examples per user needed):"
                 % (number_of_users, users_per_batch, delta, acc.value)) +
            "\n    Epsilon with each user occurring once per epoch:     %s"
            "\n    Epsilon assuming Poisson sampling of users (*):      %s"
            % (fmt(figures["user_clipping_epsilon"]),
               fmt(figures["user_clipping_epsilon_poisson"])))
        parts.append(fill(
            "This user-level guarantee assumes that in every step all of a "
            "user's examples in the batch carry that user's one id (so they "
            "form one clipped contribution), and that users, not examples, "
            "are sampled: each user in one step per epoch for the first "
            "figure, each user independently with probability %.6g per step "
            "for the second." % (users_per_batch / number_of_users)))
    parts.append(fill(
        "(*) Poisson sampling is not usually done in training pipelines, but "
        "assuming that the data was randomly shuffled, it is believed that "
        "the actual epsilon should be closer to this value than the "
        "conservative assumption of an arbitrary data order."))
    if any(math.isinf(figures.get(k, 0.0)) for k in
           ("user_epsilon", "user_epsilon_poisson")):
        parts.append(fill(
            "(**) A finite example-level epsilon implies a finite user-level "
            "epsilon at any `max_examples_per_user`, but because conversion "
            "from example-level to user-level DP is not exact, it is possible "
            "for the upper bound on the user-level epsilon to still be "
            "infinite."))
    return "\n\n".join(parts) + "\n"


def dp_sgd_epsilons(number_of_examples, batch_size, num_epochs,
                    noise_multiplier, delta, used_microbatching=True,
                    max_examples_per_user=None,
                    accountant_type=AccountantType.RDP, number_of_users=None,
                    users_per_batch=None):
    """The statement's figures as a dict: `example_epsilon` (each example
    once per epoch), `example_epsilon_poisson`, with
    `max_examples_per_user` and RDP `user_epsilon`, `user_epsilon_poisson`
    (group privacy), and with `number_of_users` and `users_per_batch`
    `user_clipping_epsilon`, `user_clipping_epsilon_poisson` (user-level
    clipping).
    """
    user_q = _check_users(number_of_users, users_per_batch)
    _check(number_of_examples, batch_size, noise_multiplier,
           max(num_epochs, 1e-300), delta)
    acc = _accountant_type(accountant_type)
    q = batch_size / number_of_examples
    out = {
        "example_epsilon": example_epsilon(
            num_epochs, noise_multiplier, delta, used_microbatching, None,
            acc),
        "example_epsilon_poisson": example_epsilon(
            num_epochs, noise_multiplier, delta, used_microbatching, q, acc)}
    if max_examples_per_user is not None and acc is AccountantType.RDP:
        out["user_epsilon"] = user_epsilon(
            num_epochs, noise_multiplier, delta, max_examples_per_user,
            used_microbatching, None, acc)
        out["user_epsilon_poisson"] = user_epsilon(
            num_epochs, noise_multiplier, delta, max_examples_per_user,
            used_microbatching, q, acc)
    if user_q is not None:
        out["user_clipping_epsilon"] = user_clipping_epsilon(
            num_epochs, noise_multiplier, delta, None, acc)
        out["user_clipping_epsilon_poisson"] = user_clipping_epsilon(
            num_epochs, noise_multiplier, delta, user_q, acc)
    return out
