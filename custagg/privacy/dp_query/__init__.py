"""TF Privacy's DPQuery family under its module names, for TF 2.12-2.21.

    # was: from tensorflow_privacy.privacy.dp_query import quantile_adaptive_clip_sum_query
    from custagg.privacy.dp_query import quantile_adaptive_clip_sum_query

Modules: `dp_query` (the `DPQuery` and `SumAggregationDPQuery` base classes),
`gaussian_query`, `no_privacy_query`, `normalized_query`, `nested_query`,
`quantile_estimator_query` (with `TreeQuantileEstimatorQuery`),
`quantile_adaptive_clip_sum_query`, `tree_aggregation` and
`tree_aggregation_query` (DP-FTRL's tree-noised sums). The classes
keep TF Privacy 0.9.0's names, constructor arguments, state namedtuples and
the `(result, new_global_state, dp_event)` triple of `get_noised_result`.
They work on their own (a Python loop of `accumulate_record`, graph or
eager) and inside `custagg.privacy.dp_optimizer`, which gives Gaussian,
normalized, nested and adaptive-clip queries their clipped sums from
custagg's rules (norms and one weighted pass, no per-example records; see
docs/privacy.md).
"""

from custagg.privacy.dp_query import dp_query
from custagg.privacy.dp_query import gaussian_query
from custagg.privacy.dp_query import nested_query
from custagg.privacy.dp_query import no_privacy_query
from custagg.privacy.dp_query import normalized_query
from custagg.privacy.dp_query import quantile_adaptive_clip_sum_query
from custagg.privacy.dp_query import quantile_estimator_query
from custagg.privacy.dp_query import tree_aggregation
from custagg.privacy.dp_query import tree_aggregation_query

__all__ = ["dp_query", "gaussian_query", "nested_query", "no_privacy_query",
           "normalized_query", "quantile_adaptive_clip_sum_query",
           "quantile_estimator_query", "tree_aggregation",
           "tree_aggregation_query"]
