"""custagg: per-example gradients and custom gradient aggregation for TF graph mode.

Gradients are of the per-example losses as given: custagg never rescales. A
mean loss (`tf.reduce_mean`) therefore scales each example's gradient by 1/B;
pass the per-example loss vector to get each example's own gradient.
`None` always means "no gradient" (the loss does not depend on that x), as in
`tf.gradients`.

Importing the package is cheap: TensorFlow and the library modules are
imported the first time a public name is used (`custagg.gradients`,
`custagg.optimizers`, ...), so `python -m custagg --help` can answer, and
set TensorFlow's log level, before TensorFlow loads.

Keras 2 for TF1 code: on TensorFlow 2.16 and later `tf.keras` is Keras 3,
which has no `tf.compat.v1.layers` and no graph-mode Keras; the tf-keras
package (installed with custagg where TensorFlow needs it) is Keras 2, and
TensorFlow routes to it when `TF_USE_LEGACY_KERAS=1`. Importing custagg sets
that variable when tf-keras is installed and the variable is unset (a value
the user set, `0` included, is kept). TensorFlow reads it the first time
`tf.keras` or `tf.compat.v1.layers` is used, so this works whether custagg is
imported before or after TensorFlow, as long as no Keras layer was touched
before `import custagg` (docs/install.md, "Keras 2 layers").
"""

import importlib
import importlib.util
import os

from custagg._version import __version__

# Without tf-keras the variable is left alone: TF 2.12-2.15's tf.keras is
# Keras 2 already, and with the variable set TF 2.15 would look for tf-keras.
if "TF_USE_LEGACY_KERAS" not in os.environ and \
        importlib.util.find_spec("tf_keras") is not None:
    os.environ["TF_USE_LEGACY_KERAS"] = "1"

# Public name -> the module that defines it. `custagg.<name>` imports all of
# them at once on first use, so the package looks exactly as if this file
# had imported them eagerly.
_API = {
    "AggregationMethod": "custagg.traversal.aggregation",
    "gradients": "custagg.traversal.gradients",
    "use_as_tf_gradients": "custagg.install",
    "STRATEGIES": "custagg.per_example.api",
    "Plan": "custagg.per_example.api",
    "clipped_gradients": "custagg.per_example.api",
    "gradient_second_moments": "custagg.per_example.api",
    "per_example_gradients": "custagg.per_example.api",
    "per_example_norms": "custagg.per_example.api",
    "plan_per_example": "custagg.per_example.api",
    "weighted_gradients": "custagg.per_example.api",
    "Rule": "custagg.rules.registry",
    "RuleContext": "custagg.rules.registry",
    "RuleRegistry": "custagg.rules.registry",
    "default_registry": "custagg.rules.registry",
    "register_rule": "custagg.rules.registry",
    "ClippedOptimizer": "custagg.privacy.wrappers",
    "DPOptimizer": "custagg.privacy.wrappers",
    "PerExampleOptimizer": "custagg.training.optimizers",
    "WeightedOptimizer": "custagg.training.optimizers",
}
# Submodules that are part of the public surface (`custagg.testing`, ...).
# The application (`custagg.app`: the CLI, its models and data) is not: the
# library never imports it. `custagg.optimizers` and `custagg.distributed`
# are small modules at the package's top that re-export from `training/` and
# `privacy/` (docs/architecture.md, "Public paths"); they, and
# `custagg.privacy` (TF Privacy's TF1 surface and epsilon), load on first
# use.
_SUBMODULES = ("testing",)
_LAZY_SUBMODULES = ("optimizers", "privacy", "distributed")

# Earlier names of custagg's DP wrappers: they work but warn on each access
# (custagg.privacy.wrappers.EARLIER_NAMES: TF Privacy's classes of the same
# names take other arguments).
_EARLIER = ("DPAdagradGaussianOptimizer", "DPAdamGaussianOptimizer",
            "DPGradientDescentGaussianOptimizer", "DPMomentumGaussianOptimizer",
            "make_gaussian_optimizer_class")

__all__ = (["__version__"] + list(_API) + list(_EARLIER) + list(_SUBMODULES)
           + list(_LAZY_SUBMODULES))


def _load():
    """Imports every public name into this module's namespace."""
    namespace = globals()
    for name in _SUBMODULES:
        namespace[name] = importlib.import_module("custagg." + name)
    for name, module in _API.items():
        namespace[name] = getattr(importlib.import_module(module), name)


def __getattr__(name):
    if name in _API or name in _SUBMODULES:
        _load()
        return globals()[name]
    if name in _EARLIER:
        wrappers = importlib.import_module("custagg.privacy.wrappers")
        return wrappers.earlier_name(__name__, name)
    if name in _LAZY_SUBMODULES:
        # import_module binds the submodule on this package as it loads.
        return importlib.import_module("custagg." + name)
    raise AttributeError("module 'custagg' has no attribute %r" % (name,))


def __dir__():
    return sorted(set(globals()) | set(__all__))
