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
before `import custagg` (README, "Keras 2 layers").
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

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
    "ClippedOptimizer": "custagg.training.optimizers",
    "DPAdagradGaussianOptimizer": "custagg.training.optimizers",
    "DPAdamGaussianOptimizer": "custagg.training.optimizers",
    "DPGradientDescentGaussianOptimizer": "custagg.training.optimizers",
    "DPMomentumGaussianOptimizer": "custagg.training.optimizers",
    "DPOptimizer": "custagg.training.optimizers",
    "PerExampleOptimizer": "custagg.training.optimizers",
    "WeightedOptimizer": "custagg.training.optimizers",
    "make_gaussian_optimizer_class": "custagg.training.optimizers",
}
# Submodules that are part of the public surface (`custagg.testing`, ...).
# The application (`custagg.app`: the CLI, its models and data) is not: the
# library never imports it.
# `custagg.privacy` (TF Privacy's TF1 surface and epsilon) loads on its own:
# it also imports dp-accounting's modules when epsilon is computed. So do
# `custagg.optimizers` (the public path binds privacy's short names, below)
# and `custagg.distributed` (it imports privacy).
_SUBMODULES = ("testing",)
_LAZY_SUBMODULES = ("optimizers", "privacy", "distributed")

# Public module paths whose code lives in a layer folder (docs/architecture.md,
# "Public paths"). No file stands at the public path: `_PublicPaths` below
# answers an import of `custagg.optimizers` with the module
# `custagg.training.optimizers` itself, registered in sys.modules under both
# names, so `custagg.optimizers.X`, `from custagg.optimizers import X` and
# `import custagg.optimizers` all reach one module object.
_PUBLIC_PATHS = {
    "custagg.optimizers": "custagg.training.optimizers",
    "custagg.distributed": "custagg.training.distributed",
}
# Names a public path shows that a higher layer defines. TF Privacy's short
# names (`custagg.optimizers.DPAdamOptimizer`, ...) are
# `custagg.privacy.dp_optimizer`'s query-based classes; `training` sits below
# `privacy` (privacy's classes are built on the optimizers' helpers), so the
# optimizers module cannot import them itself: this package, above both
# layers, binds them when the public path is first imported.
_PUBLIC_EXTRAS = {
    "custagg.optimizers": ("custagg.privacy.dp_optimizer", (
        "DPGradientDescentOptimizer", "DPAdagradOptimizer",
        "DPAdamOptimizer", "DPMomentumOptimizer")),
}

__all__ = (["__version__"] + list(_API) + list(_SUBMODULES)
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
    if name in _LAZY_SUBMODULES:
        # import_module binds the submodule on this package as it loads.
        return importlib.import_module("custagg." + name)
    raise AttributeError("module 'custagg' has no attribute %r" % (name,))


def __dir__():
    return sorted(set(globals()) | set(__all__))


class _PublicPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads the public module paths of `_PUBLIC_PATHS`.

    `create_module` imports the module where it lives and returns that very
    object (so nothing runs twice and `isinstance` checks see one class);
    `exec_module` only restores the module's own `__spec__`, which the
    import system overwrote with the public path's, and binds
    `_PUBLIC_EXTRAS`. The import system then registers the module under the
    public name in sys.modules and on this package.
    """

    def find_spec(self, fullname, path=None, target=None):
        del path, target  # Only the name decides.
        if fullname not in _PUBLIC_PATHS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(_PUBLIC_PATHS[spec.name])
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        public = module.__spec__
        module.__spec__ = public.loader_state
        source, names = _PUBLIC_EXTRAS.get(public.name, (None, ()))
        if source is not None:
            defining = importlib.import_module(source)
            for name in names:
                setattr(module, name, getattr(defining, name))


if not any(isinstance(f, _PublicPaths) for f in sys.meta_path):
    sys.meta_path.append(_PublicPaths())
