"""`QuantileAdaptiveClipSumQuery`: a Gaussian sum whose clip norm follows a
quantile of the record norms (Andrew et al. 2021, arXiv:1905.03871).

Each round the records are clipped to the current norm C and summed with
`N(0, (noise_multiplier * C)^2)` noise; a `QuantileEstimatorQuery` on the
records' norms moves C toward the `target_unclipped_quantile` of the norms
(0.5: the median). The step's privacy is the composition of the two
Gaussian mechanisms (the event is a `ComposedDpEvent`). TF Privacy 0.9.0's
class, arguments and state.

In custagg's DP optimizers the norms come from the rules (the same norms
that clip), so adapting the clip adds a comparison and a scalar update to a
fixed-clip step; in graph mode the state lives in variables so the clip
adapts across `session.run` calls (see docs/privacy.md).
"""

from __future__ import annotations

import collections

import tensorflow as tf

from custagg.privacy.dp_query import dp_query
from custagg.privacy.dp_query import gaussian_query
from custagg.privacy.dp_query import quantile_estimator_query

__all__ = ["QuantileAdaptiveClipSumQuery"]


class QuantileAdaptiveClipSumQuery(dp_query.SumAggregationDPQuery):
    """Gaussian sum query with an adaptive clip norm.

    Args:
      initial_l2_norm_clip: the first round's clip norm.
      noise_multiplier: sum noise stddev / current clip norm.
      target_unclipped_quantile: fraction of records to leave unclipped
        (Andrew et al.: 0.5).
      learning_rate: clip adaptation rate (geometric: a factor of at most
        `exp(learning_rate)` per round; Andrew et al.: 0.2).
      clipped_count_stddev: noise stddev on the unclipped count (Andrew et
        al.: `expected_num_records / 20`).
      expected_num_records: records per round (public).
      geometric_update: multiplicative clip updates (recommended).
    """

    _GlobalState = collections.namedtuple(
        "_GlobalState",
        ["noise_multiplier", "sum_state", "quantile_estimator_state"])
    _SampleState = collections.namedtuple(
        "_SampleState", ["sum_state", "quantile_estimator_state"])
    _SampleParams = collections.namedtuple(
        "_SampleParams", ["sum_params", "quantile_estimator_params"])

    def __init__(self, initial_l2_norm_clip, noise_multiplier,
                 target_unclipped_quantile, learning_rate,
                 clipped_count_stddev, expected_num_records,
                 geometric_update=True):
        self._noise_multiplier = noise_multiplier
        self._quantile_estimator_query = (
            quantile_estimator_query.QuantileEstimatorQuery(
                initial_l2_norm_clip, target_unclipped_quantile,
                learning_rate, clipped_count_stddev, expected_num_records,
                geometric_update))
        self._sum_query = gaussian_query.GaussianSumQuery(
            initial_l2_norm_clip, noise_multiplier * initial_l2_norm_clip)

    def initial_global_state(self):
        return self._GlobalState(
            tf.cast(self._noise_multiplier, tf.float32),
            self._sum_query.initial_global_state(),
            self._quantile_estimator_query.initial_global_state())

    def derive_sample_params(self, global_state):
        return self._SampleParams(
            self._sum_query.derive_sample_params(global_state.sum_state),
            self._quantile_estimator_query.derive_sample_params(
                global_state.quantile_estimator_state))

    def initial_sample_state(self, template=None):
        return self._SampleState(
            self._sum_query.initial_sample_state(template),
            self._quantile_estimator_query.initial_sample_state())

    def preprocess_record(self, params, record):
        clipped, norm = self._sum_query.preprocess_record_impl(
            params.sum_params, record)
        unclipped = self._quantile_estimator_query.preprocess_record(
            params.quantile_estimator_params, norm)
        return self._SampleState(clipped, unclipped)

    def sample_state_from_sums(self, params, clipped_sum, norms):
        """The sample state of a round from its clipped sum and the `[M]`
        record norms (what accumulating the M records gives): custagg's
        optimizers use it instead of accumulating records one by one."""
        below = self._quantile_estimator_query.below_estimate_record(
            params.quantile_estimator_params, norms)
        return self._SampleState(clipped_sum, tf.reduce_sum(below))

    def clipped_sum_form(self):
        """The clip is the sum query's params; the sample state adds the
        count of records at most the clip (`sample_state_from_sums`); the
        state changes every step. Exact class only."""
        # pylint: disable-next=unidiomatic-typecheck
        if type(self) is not QuantileAdaptiveClipSumQuery:
            return None
        return dp_query.ClippedSumForm(
            clip=lambda params: params.sum_params,
            sample_state=self.sample_state_from_sums, adaptive=True)

    def get_noised_result(self, sample_state, global_state):
        """`(noised sum, state with the new clip, ComposedDpEvent)`."""
        noised, _, sum_event = self._sum_query.get_noised_result(
            sample_state.sum_state, global_state.sum_state)
        clip, estimator_state, count_event = (
            self._quantile_estimator_query.get_noised_result(
                sample_state.quantile_estimator_state,
                global_state.quantile_estimator_state))
        clip = tf.maximum(clip, 0.0)
        sum_state = self._sum_query.make_global_state(
            l2_norm_clip=clip, stddev=clip * global_state.noise_multiplier)
        return (noised,
                self._GlobalState(global_state.noise_multiplier, sum_state,
                                  estimator_state),
                gaussian_query.composed_event([sum_event, count_event]))

    def derive_metrics(self, global_state):
        """The current clip norm, as `clip`."""
        return collections.OrderedDict(
            clip=global_state.sum_state.l2_norm_clip)
