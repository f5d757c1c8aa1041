"""`NormalizedQuery`: a sum query's noised result divided by a public
denominator (TF Privacy's class), e.g. the expected number of records under
Poisson sampling, which keeps the average unbiased without revealing the
actual count."""

from __future__ import annotations

import collections

import tensorflow as tf

from custagg.privacy.dp_query import dp_query

__all__ = ["NormalizedQuery"]


class NormalizedQuery(dp_query.SumAggregationDPQuery):
    """`numerator_query`'s result / `denominator`.

    Args:
      numerator_query: a `SumAggregationDPQuery` (e.g. `GaussianSumQuery`).
      denominator: a number or scalar tensor (the public record count).
    """

    _GlobalState = collections.namedtuple("_GlobalState",
                                          ["numerator_state", "denominator"])

    def __init__(self, numerator_query, denominator):
        if not isinstance(numerator_query, dp_query.SumAggregationDPQuery):
            raise TypeError(
                "NormalizedQuery: numerator_query must be a "
                "SumAggregationDPQuery (e.g. GaussianSumQuery); got %r."
                % (numerator_query,))
        self._numerator = numerator_query
        self._denominator = denominator

    def initial_global_state(self):
        return self._GlobalState(self._numerator.initial_global_state(),
                                 tf.cast(self._denominator, tf.float32))

    def derive_sample_params(self, global_state):
        return self._numerator.derive_sample_params(
            global_state.numerator_state)

    def initial_sample_state(self, template=None):
        return self._numerator.initial_sample_state(template)

    def preprocess_record(self, params, record):
        return self._numerator.preprocess_record(params, record)

    def get_noised_result(self, sample_state, global_state):
        total, numerator_state, event = self._numerator.get_noised_result(
            sample_state, global_state.numerator_state)

        def divide(v):
            return v / tf.cast(global_state.denominator, v.dtype)
        # The denominator is public: the privacy cost is the numerator's.
        return (tf.nest.map_structure(divide, total),
                self._GlobalState(numerator_state, global_state.denominator),
                event)

    def derive_metrics(self, global_state):
        return self._numerator.derive_metrics(global_state.numerator_state)

    def clipped_sum_form(self):
        """The numerator's form (the sample params and state are the
        numerator's), not Gaussian: the result is divided. Exact class
        only."""
        # pylint: disable-next=unidiomatic-typecheck
        if type(self) is not NormalizedQuery:
            return None
        inner = dp_query.clipped_sum_form_of(self._numerator)
        if inner is None or isinstance(inner,
                                       dp_query.NestedClippedSumForm):
            return None
        return dp_query.ClippedSumForm(
            clip=inner.clip, sample_state=inner.sample_state,
            adaptive=inner.adaptive)
