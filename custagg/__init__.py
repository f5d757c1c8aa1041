"""custagg: per-example gradients and custom gradient aggregation for TF graph mode.

Gradients are of the per-example losses as given: custagg never rescales. A
mean loss (`tf.reduce_mean`) therefore scales each example's gradient by 1/B;
pass the per-example loss vector to get each example's own gradient.
`None` always means "no gradient" (the loss does not depend on that x), as in
`tf.gradients`.
"""

from custagg._version import __version__
from custagg.aggregation import AggregationMethod
from custagg.gradients import gradients

__all__ = ["__version__", "AggregationMethod", "gradients"]
