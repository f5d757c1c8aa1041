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
from custagg.install import use_as_tf_gradients
from custagg.per_example import STRATEGIES
from custagg.per_example import Plan
from custagg.per_example import clipped_gradients
from custagg.per_example import gradient_second_moments
from custagg.per_example import per_example_gradients
from custagg.per_example import per_example_norms
from custagg.per_example import plan_per_example
from custagg.per_example import weighted_gradients
from custagg.registry import Rule
from custagg.registry import RuleContext
from custagg.registry import RuleRegistry
from custagg.registry import default_registry
from custagg.registry import register_rule
from custagg import datasets  # noqa: F401
from custagg import optimizers  # noqa: F401
from custagg import testing  # noqa: F401
from custagg.optimizers import ClippedOptimizer
from custagg.optimizers import DPAdagradGaussianOptimizer
from custagg.optimizers import DPAdamGaussianOptimizer
from custagg.optimizers import DPGradientDescentGaussianOptimizer
from custagg.optimizers import DPMomentumGaussianOptimizer
from custagg.optimizers import DPOptimizer
from custagg.optimizers import PerExampleOptimizer
from custagg.optimizers import WeightedOptimizer
from custagg.optimizers import make_gaussian_optimizer_class

__all__ = [
    "__version__", "AggregationMethod", "gradients", "use_as_tf_gradients",
    "STRATEGIES", "Plan",
    "clipped_gradients", "gradient_second_moments", "per_example_gradients",
    "per_example_norms", "plan_per_example", "weighted_gradients", "Rule",
    "RuleContext", "RuleRegistry", "default_registry", "register_rule",
    "testing", "datasets", "optimizers", "PerExampleOptimizer",
    "WeightedOptimizer", "ClippedOptimizer", "DPOptimizer",
    "make_gaussian_optimizer_class", "DPGradientDescentGaussianOptimizer",
    "DPMomentumGaussianOptimizer", "DPAdagradGaussianOptimizer",
    "DPAdamGaussianOptimizer",
]
