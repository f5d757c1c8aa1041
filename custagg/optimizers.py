"""The public path `custagg.optimizers`: every optimizer wrapper, re-exported.

This module defines nothing; it names what users import from one place
(docs/architecture.md, "Public paths"):

* the non-DP wrappers, from `custagg.training.optimizers`:
  `PerExampleOptimizer` (`sum_i g_i`), `WeightedOptimizer` (`sum_i f_i g_i`);
* custagg's DP wrappers, from `custagg.privacy.wrappers`: `DPOptimizer`,
  `ClippedOptimizer`, `make_dp_wrapper_class` and its
  `DP{GradientDescent,Momentum,Adagrad,Adam}GaussianWrapper` classes --
  also under their earlier names `make_gaussian_optimizer_class` and
  `DP...GaussianOptimizer` (the same objects, with a FutureWarning: TF
  Privacy's classes of those names, `custagg.privacy.dp_optimizer`'s, are
  other classes whose fourth argument is `unroll_microbatches`);
* TF Privacy's short names taking a DPQuery first, from
  `custagg.privacy.dp_optimizer`: `DPGradientDescentOptimizer`,
  `DPAdagradOptimizer`, `DPAdamOptimizer`, `DPMomentumOptimizer`;
* `ComputeGradientsNotCalledError`, from `custagg.privacy.checks`.
"""

from custagg.privacy.checks import ComputeGradientsNotCalledError
from custagg.privacy.dp_optimizer import DPAdagradOptimizer
from custagg.privacy.dp_optimizer import DPAdamOptimizer
from custagg.privacy.dp_optimizer import DPGradientDescentOptimizer
from custagg.privacy.dp_optimizer import DPMomentumOptimizer
from custagg.privacy.wrappers import ClippedOptimizer
from custagg.privacy.wrappers import DPAdagradGaussianWrapper
from custagg.privacy.wrappers import DPAdamGaussianWrapper
from custagg.privacy.wrappers import DPGradientDescentGaussianWrapper
from custagg.privacy.wrappers import DPMomentumGaussianWrapper
from custagg.privacy import wrappers as _wrappers
from custagg.privacy.wrappers import DPOptimizer
from custagg.privacy.wrappers import make_dp_wrapper_class
from custagg.training.optimizers import PerExampleOptimizer
from custagg.training.optimizers import WeightedOptimizer

__all__ = [
    "ClippedOptimizer", "ComputeGradientsNotCalledError",
    "DPAdagradGaussianOptimizer", "DPAdagradGaussianWrapper",
    "DPAdagradOptimizer", "DPAdamGaussianOptimizer", "DPAdamGaussianWrapper",
    "DPAdamOptimizer", "DPGradientDescentGaussianOptimizer",
    "DPGradientDescentGaussianWrapper", "DPGradientDescentOptimizer",
    "DPMomentumGaussianOptimizer", "DPMomentumGaussianWrapper",
    "DPMomentumOptimizer", "DPOptimizer", "PerExampleOptimizer",
    "WeightedOptimizer", "make_dp_wrapper_class",
    "make_gaussian_optimizer_class",
]


def __getattr__(name):
    # The earlier names warn on each access (privacy.wrappers.EARLIER_NAMES).
    if name in _wrappers.EARLIER_NAMES:
        return _wrappers.earlier_name(__name__, name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
