"""Sum and average queries without clipping or noise (TF Privacy's
`no_privacy_query`): baselines, and the exact counts of the non-private
quantile estimator. Their `DpEvent` is `NonPrivateDpEvent`."""

from __future__ import annotations

import tensorflow as tf

from custagg.privacy.dp_query import dp_query
from custagg.privacy.dp_query.gaussian_query import non_private_event

__all__ = ["NoPrivacySumQuery", "NoPrivacyAverageQuery"]


class NoPrivacySumQuery(dp_query.SumAggregationDPQuery):
    """The plain sum of the records."""

    def get_noised_result(self, sample_state, global_state):
        return sample_state, global_state, non_private_event()


class NoPrivacyAverageQuery(dp_query.SumAggregationDPQuery):
    """The weighted mean of the records: `sum_i w_i r_i / sum_i w_i`.

    The sample state is `(weighted sum, total weight)`; weights default to
    1. Dividing by the actual count is not private under Poisson sampling:
    a baseline only.
    """

    def initial_sample_state(self, template=None):
        return super().initial_sample_state(template), tf.constant(0.0)

    def preprocess_record(self, params, record, weight=1):
        del params
        return (tf.nest.map_structure(lambda t: weight * t, record),
                tf.cast(weight, tf.float32))

    def accumulate_record(self, params, sample_state, record, weight=1):
        return self.accumulate_preprocessed_record(
            sample_state, self.preprocess_record(params, record, weight))

    def get_noised_result(self, sample_state, global_state):
        total, weight = sample_state
        result = tf.nest.map_structure(
            lambda t: t / tf.cast(weight, tf.as_dtype(t.dtype)), total)
        return result, global_state, non_private_event()
