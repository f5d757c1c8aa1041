"""`QuantileEstimatorQuery`: a private running estimate of a quantile of
scalar records (Andrew, Thakkar, McMahan, Ramaswamy 2021, "Differentially
Private Learning with Adaptive Clipping", arXiv:1905.03871).

Each round every record r contributes the indicator `[r <= estimate]`. The
fraction of records at or below the estimate, `b`, is estimated privately
by a Gaussian sum of `[r <= estimate] - 1/2` (sensitivity 1/2 instead of 1)
divided by the expected number of records, plus 1/2, clamped to [0, 1].
The estimate then takes one gradient step on the quantile loss, whose
derivative is `b - target_quantile`:

    arithmetic: estimate <- estimate - lr * (b - target)
    geometric:  estimate <- estimate * exp(-lr * (b - target))

TF Privacy 0.9.0's class names, arguments and `_GlobalState`.
"""

from __future__ import annotations

import collections

import tensorflow as tf

from custagg import errors
from custagg.privacy.dp_query import dp_query
from custagg.privacy.dp_query import gaussian_query
from custagg.privacy.dp_query import no_privacy_query
from custagg.privacy.dp_query import normalized_query
from custagg.privacy.dp_query import tree_aggregation_query

__all__ = ["QuantileEstimatorQuery", "NoPrivacyQuantileEstimatorQuery",
           "TreeQuantileEstimatorQuery"]


class QuantileEstimatorQuery(dp_query.SumAggregationDPQuery):
    """Private estimate of the `target_quantile` of scalar records.

    Args:
      initial_estimate: the starting estimate.
      target_quantile: in [0, 1]; 0.8 looks for a value with 80% of the
        records at or below it.
      learning_rate: step size: the estimate moves by at most
        `learning_rate` per round (arithmetic) or by a factor of at most
        `exp(learning_rate)` (geometric). Andrew et al. suggest 0.2 with
        geometric updates.
      below_estimate_stddev: noise stddev on the count of records below the
        estimate; Andrew et al. suggest `expected_num_records / 20`.
      expected_num_records: records per round (public; the count's
        denominator).
      geometric_update: multiplicative updates, for positive records that
        span orders of magnitude (gradient norms).

    Raises:
      ValueError: `target_quantile` outside [0, 1] or a negative
        `learning_rate`.
    """

    _GlobalState = collections.namedtuple("_GlobalState", [
        "current_estimate", "target_quantile", "learning_rate",
        "below_estimate_state"])
    _SampleParams = collections.namedtuple(
        "_SampleParams", ["current_estimate", "below_estimate_params"])

    def __init__(self, initial_estimate, target_quantile, learning_rate,
                 below_estimate_stddev, expected_num_records,
                 geometric_update=False):
        where = "QuantileEstimatorQuery"
        errors.check_argument(0 <= target_quantile <= 1, where,
                              "target_quantile", "between 0 and 1",
                              target_quantile)
        errors.check_argument(learning_rate >= 0, where, "learning_rate",
                              "non-negative", learning_rate)
        self._initial_estimate = initial_estimate
        self._target_quantile = target_quantile
        self._learning_rate = learning_rate
        self._geometric_update = geometric_update
        self._below_estimate_query = self._construct_below_estimate_query(
            below_estimate_stddev, expected_num_records)

    def _construct_below_estimate_query(self, below_estimate_stddev,
                                        expected_num_records):
        # Records are +-1/2, so a Gaussian sum with clip 1/2 never clips:
        # the clip only states the sensitivity.
        return normalized_query.NormalizedQuery(
            gaussian_query.GaussianSumQuery(l2_norm_clip=0.5,
                                            stddev=below_estimate_stddev),
            denominator=expected_num_records)

    def initial_global_state(self):
        return self._GlobalState(
            tf.cast(self._initial_estimate, tf.float32),
            tf.cast(self._target_quantile, tf.float32),
            tf.cast(self._learning_rate, tf.float32),
            self._below_estimate_query.initial_global_state())

    def derive_sample_params(self, global_state):
        return self._SampleParams(
            global_state.current_estimate,
            self._below_estimate_query.derive_sample_params(
                global_state.below_estimate_state))

    def initial_sample_state(self, template=None):
        del template  # records are scalars
        return self._below_estimate_query.initial_sample_state(0.0)

    def below_estimate_record(self, params, norms):
        """`[r <= estimate] - 1/2` for a tensor of records (any shape)."""
        below = tf.cast(norms <= tf.cast(params.current_estimate, norms.dtype),
                        tf.float32)
        return below - 0.5

    def preprocess_record(self, params, record):
        record = tf.convert_to_tensor(record)
        if record.shape.rank is not None and record.shape.rank != 0:
            raise ValueError(
                "QuantileEstimatorQuery: a record must be a scalar (e.g. one "
                "gradient norm); got shape %s." % (record.shape,))
        return self._below_estimate_query.preprocess_record(
            params.below_estimate_params,
            self.below_estimate_record(params, record))

    def get_noised_result(self, sample_state, global_state):
        """`(new estimate, new global state, the count's DpEvent)`."""
        fraction, below_state, event = (
            self._below_estimate_query.get_noised_result(
                sample_state, global_state.below_estimate_state))
        fraction = tf.clip_by_value(fraction + 0.5, 0.0, 1.0)
        step = global_state.learning_rate * (
            fraction - global_state.target_quantile)
        if self._geometric_update:
            estimate = global_state.current_estimate * tf.exp(-step)
        else:
            estimate = global_state.current_estimate - step
        return estimate, global_state._replace(
            current_estimate=estimate, below_estimate_state=below_state), event

    def derive_metrics(self, global_state):
        return collections.OrderedDict(estimate=global_state.current_estimate)


class NoPrivacyQuantileEstimatorQuery(QuantileEstimatorQuery):
    """The same estimator with the exact fraction below the estimate (no
    noise, the actual record count as denominator): no privacy."""

    def __init__(self, initial_estimate, target_quantile, learning_rate,
                 geometric_update=False):
        super().__init__(initial_estimate, target_quantile, learning_rate,
                         below_estimate_stddev=None,
                         expected_num_records=None,
                         geometric_update=geometric_update)

    def _construct_below_estimate_query(self, below_estimate_stddev,
                                        expected_num_records):
        del below_estimate_stddev, expected_num_records
        return no_privacy_query.NoPrivacyAverageQuery()


class TreeQuantileEstimatorQuery(QuantileEstimatorQuery):
    """The estimator with the below-estimate count noised by tree
    aggregation (a `TreeResidualSumQuery`) instead of independent Gaussian
    noise per round (Kairouz et al. 2021, arXiv:2103.00039, for the tree;
    Andrew et al. for the update).

    The estimate's updates add up the rounds' fractions below it, so what
    privacy needs to protect is their running sum: with residual tree noise
    the sum over rounds 0..t carries the noise of at most log2(t + 2) tree
    nodes, not t + 1 independent draws. Each node's noise has stddev
    `below_estimate_stddev` on the count (records are +-1/2, clip 1/2).
    Same arguments as `QuantileEstimatorQuery`; `expected_num_records` is
    required (the public denominator).

    Call `reset_state(estimate, global_state)` to start a new tree (e.g.
    once per epoch).
    """

    def _construct_below_estimate_query(self, below_estimate_stddev,
                                        expected_num_records):
        if below_estimate_stddev is None or expected_num_records is None:
            raise ValueError(
                "TreeQuantileEstimatorQuery: `below_estimate_stddev` and "
                "`expected_num_records` must be numbers, got %r and %r; for "
                "an exact, non-private estimate use "
                "NoPrivacyQuantileEstimatorQuery." % (
                    below_estimate_stddev, expected_num_records))
        # Clip 1/2 states the +-1/2 records' sensitivity; the multiplier
        # makes the node stddev clip * multiplier = below_estimate_stddev.
        tree_sum = (tree_aggregation_query.TreeResidualSumQuery
                    .build_l2_gaussian_query(
                        clip_norm=0.5,
                        noise_multiplier=2.0 * below_estimate_stddev,
                        record_specs=tf.TensorSpec([], tf.float32)))
        return normalized_query.NormalizedQuery(
            tree_sum, denominator=expected_num_records)

    def reset_state(self, noised_results, global_state):
        """`global_state` with the count's tree restarted (the estimate
        kept)."""
        below = global_state.below_estimate_state
        tree_sum = self._below_estimate_query._numerator  # pylint: disable=protected-access
        return global_state._replace(below_estimate_state=below._replace(
            numerator_state=tree_sum.reset_state(noised_results,
                                                 below.numerator_state)))
