"""custagg's `GaussianSumQuery` (kept importable here; it lives in
`custagg.privacy.dp_query.gaussian_query`, TF Privacy's module path).

`custagg.privacy.dp_optimizer`'s query-based classes take a `dp_sum_query`
first, as TF Privacy's do. They accept this class and TF Privacy's own
`tensorflow_privacy.privacy.dp_query.gaussian_query.GaussianSumQuery` (when
TF Privacy is installed); for either, the optimizer reads the clip norm and
the noise stddev from `initial_global_state()` and forms the clipped sum in
one pass (no per-microbatch loop). Other DPQuery objects go through their own
`accumulate_record` / `get_noised_result` methods, one microbatch at a time.

    query = GaussianSumQuery(l2_norm_clip=1.0, stddev=1.1)
    opt = dp_optimizer.DPGradientDescentOptimizer(query, num_microbatches=None,
                                                  learning_rate=0.1)
"""

from __future__ import annotations

from custagg.privacy.core import gaussian_sum_params
from custagg.privacy.dp_query.gaussian_query import GaussianSumQuery

__all__ = ["GaussianSumQuery", "gaussian_sum_params"]

