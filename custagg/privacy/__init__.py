"""Differential privacy with custagg: TF Privacy's TF1 optimizers and ε.

Migrating from TensorFlow Privacy is a change of import:

    # was: from tensorflow_privacy.privacy.optimizers import dp_optimizer
    from custagg.privacy import dp_optimizer
    # was: from tensorflow_privacy.privacy.dp_query import gaussian_query
    from custagg.privacy import gaussian_query
    # was: from tensorflow_privacy.privacy.analysis import compute_dp_sgd_privacy_lib
    from custagg.privacy import compute_dp_sgd_privacy_lib

* `dp_optimizer`: `make_optimizer_class`, `make_gaussian_optimizer_class`,
  `DPGradientDescentOptimizer` (and Adagrad, Adam, Momentum, RMSProp, Ftrl)
  taking a `dp_sum_query`, and the `...GaussianOptimizer` classes taking
  `l2_norm_clip, noise_multiplier, num_microbatches, unroll_microbatches`.
* `gaussian_query.GaussianSumQuery(l2_norm_clip, stddev)` (TF Privacy's own
  query objects are accepted as well).
* `dp_optimizer_vectorized`: `VectorizedDPSGD`, `VectorizedDPAdam`,
  `VectorizedDPAdagrad`, `make_vectorized_optimizer_class`.
* `dp_query.<module>` (`dp_query`, `gaussian_query`, `no_privacy_query`,
  `normalized_query`, `nested_query`, `quantile_estimator_query`,
  `quantile_adaptive_clip_sum_query`): TF Privacy's DPQuery family;
  adaptive (Andrew et al.) and per-layer (nested) clipping in the DP
  optimizers get norms and clipped sums from custagg's rules.
* `compute_dp_sgd_privacy(n, batch_size, noise_multiplier, epochs, delta)`:
  `(epsilon, order)` with TF Privacy's meaning, from dp-accounting, and
  `compute_dp_sgd_privacy_statement(...)`, TF Privacy's statement (shuffled
  and Poisson ε, microbatching's doubled sensitivity, user-level ε; with
  `number_of_users` and `users_per_batch` the ε of user-level clipping).
* User-level DP: the optimizers take `group_ids=` (a `[B]` tensor of user
  ids; each user's examples clipped together), docs/privacy.md section 6.
* The guarantee end to end (docs/privacy.md section 7): `NoiseStream` (the
  optimizers' checkpointed noise: a restore never repeats a draw),
  `PrivacyBudget` / `PrivacyBudgetHook` (ε of the steps the run took,
  across restarts), `noise_multiplier_for` (σ for a target ε), and
  `sampling.poisson_batches` / `sampling.PoissonSampler` (the sampling the
  accounting assumes).

All of custagg's DP lives here: `core` (the one clip-and-noise core every
DP optimizer calls), `wrappers` (`custagg.DPOptimizer`, `ClippedOptimizer`),
`dp_optimizer` / `dp_optimizer_vectorized` (TF Privacy's faces) and
`distributed` (public as `custagg.distributed`); docs/architecture.md,
"Inside `privacy/`".
"""

from custagg.privacy import accounting
from custagg.privacy import dp_optimizer
from custagg.privacy import dp_optimizer_vectorized
from custagg.privacy import dp_query
from custagg.privacy import gaussian_query
from custagg.privacy.accounting import compute_dp_sgd_privacy
from custagg.privacy.accounting import compute_dp_sgd_privacy_statement
from custagg.privacy.gaussian_query import GaussianSumQuery
from custagg.privacy import budget
from custagg.privacy import noise
from custagg.privacy import sampling
from custagg.privacy.budget import PrivacyBudget
from custagg.privacy.budget import PrivacyBudgetHook
from custagg.privacy.budget import dp_sgd_epsilon
from custagg.privacy.budget import noise_multiplier_for
from custagg.privacy.noise import NoiseStream
from custagg.privacy.sampling import PoissonSampler
from custagg.privacy.sampling import poisson_batches

# TF Privacy's module name for the accountant function.
compute_dp_sgd_privacy_lib = accounting

__all__ = ["accounting", "compute_dp_sgd_privacy",
           "compute_dp_sgd_privacy_lib", "compute_dp_sgd_privacy_statement",
           "dp_optimizer", "dp_optimizer_vectorized", "dp_query",
           "gaussian_query", "GaussianSumQuery", "budget", "PrivacyBudget",
           "PrivacyBudgetHook", "dp_sgd_epsilon", "noise_multiplier_for",
           "noise", "NoiseStream", "sampling", "PoissonSampler",
           "poisson_batches"]
