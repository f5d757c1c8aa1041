"""TF Privacy's `dp_optimizer_vectorized`, computed by custagg.

    # was: from tensorflow_privacy.privacy.optimizers import dp_optimizer_vectorized
    from custagg.privacy import dp_optimizer_vectorized

    opt = dp_optimizer_vectorized.VectorizedDPSGD(
        l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=256,
        learning_rate=0.15)
    train_op = opt.minimize(loss=vector_loss, global_step=global_step)

`make_vectorized_optimizer_class(cls)` returns a subclass of the TF1
optimizer class `cls` taking `(l2_norm_clip, noise_multiplier,
num_microbatches=None, *args, **kwargs)`; `VectorizedDPSGD`,
`VectorizedDPAdam`, `VectorizedDPAdagrad` (and their `...Optimizer` names)
are its results. The gradient is TF Privacy's `(sum_m clip(g_m) + N(0,
(noise_multiplier * l2_norm_clip)^2)) / M` with `g_m` the gradient of
microbatch m's mean loss. TF Privacy vectorizes the M microbatch gradients
with `tf.vectorized_map` (materializing `[M, ...]`); custagg forms the
clipped sum from its rules' norms in one weighted pass (the same code as
`dp_optimizer`'s Gaussian classes). Unlike TF Privacy's, these classes also
run eagerly (a callable loss, optionally with a `gradient_tape`).
"""

from __future__ import annotations

import tensorflow as tf

from custagg.privacy import checks
from custagg.privacy import dp_optimizer
from custagg.privacy.dp_query import gaussian_query

__all__ = ["make_vectorized_optimizer_class", "VectorizedDPAdagrad",
           "VectorizedDPAdagradOptimizer", "VectorizedDPAdam",
           "VectorizedDPAdamOptimizer", "VectorizedDPSGD",
           "VectorizedDPSGDOptimizer"]

AdagradOptimizer = tf.compat.v1.train.AdagradOptimizer
AdamOptimizer = tf.compat.v1.train.AdamOptimizer
GradientDescentOptimizer = tf.compat.v1.train.GradientDescentOptimizer


def make_vectorized_optimizer_class(cls):
    """A vectorized DP-SGD subclass of the TF1 optimizer class `cls`.

    Args:
      cls: a `tf.compat.v1.train.Optimizer` subclass.

    Returns:
      A subclass of `cls` whose constructor takes `(l2_norm_clip,
      noise_multiplier, num_microbatches=None, *args, **kwargs)`; `*args,
      **kwargs` construct `cls`.

    Raises:
      TypeError: `cls` is not a TF1 optimizer class.
    """
    base = dp_optimizer.make_optimizer_class(cls)

    class VectorizedDPOptimizerClass(base):  # pylint: disable=missing-docstring

        def __init__(self, l2_norm_clip, noise_multiplier,
                     num_microbatches=None, *args, **kwargs):  # pylint: disable=keyword-arg-before-vararg
            self._l2_norm_clip = l2_norm_clip
            self._noise_multiplier = noise_multiplier
            query = gaussian_query.GaussianSumQuery(
                l2_norm_clip, l2_norm_clip * noise_multiplier)
            super().__init__(query, num_microbatches, False, 10, *args,
                             **kwargs)

    return checks.named_after(
        VectorizedDPOptimizerClass, cls, "VectorizedDP%sOptimizer",
        "Vectorized DP-SGD (Gaussian mechanism) around "
        "`tf.compat.v1.train.%s`; see `custagg.privacy."
        "dp_optimizer_vectorized`.")


VectorizedDPAdagradOptimizer = make_vectorized_optimizer_class(AdagradOptimizer)
VectorizedDPAdamOptimizer = make_vectorized_optimizer_class(AdamOptimizer)
VectorizedDPSGDOptimizer = make_vectorized_optimizer_class(
    GradientDescentOptimizer)

VectorizedDPAdagrad = VectorizedDPAdagradOptimizer
VectorizedDPAdam = VectorizedDPAdamOptimizer
VectorizedDPSGD = VectorizedDPSGDOptimizer
