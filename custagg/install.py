"""custagg as the process-wide `tf.gradients`, for a block of code.

`use_as_tf_gradients()` replaces TensorFlow's gradient functions with
custagg's for the duration of a `with` block and puts TF's back on exit (also
when the block raises):

* `tf.gradients` (TF 2's signature), `tf.compat.v1.gradients` and the same
  functions in TF's own modules (`gradients`, `gradients_impl`), so code
  and tests written against TF call custagg;
* with `internal=True` (the default), also TF's internal helper that
  `tf.gradients`, cond_v2, while_v2 and `tf.function` backward passes call
  with `src_graph=` (a function body's gradient built in another graph):
  then every gradient TF builds in graph mode goes through custagg's
  traversal, nested ones included.

Eager `tf.GradientTape` is not affected. Not thread-safe: the replacement is
process-wide while the block runs.

Example:
  >>> with custagg.use_as_tf_gradients():
  ...     train_op = tf.compat.v1.train.AdamOptimizer().minimize(loss)
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from custagg import _tf_compat
from custagg.traversal.gradients import gradients as _gradients

_HELPER = "_GradientsHelper"


def gradients_v1(ys, xs, grad_ys=None, name="gradients",
                 colocate_gradients_with_ops=False, gate_gradients=False,
                 aggregation_method=None, stop_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
    """`tf.compat.v1.gradients`'s signature, computed by custagg."""
    return _gradients(ys, xs, grad_ys, name, colocate_gradients_with_ops,
                      gate_gradients, aggregation_method, stop_gradients,
                      unconnected_gradients)


def gradients_v2(ys, xs, grad_ys=None, name="gradients",
                 gate_gradients=False, aggregation_method=None,
                 stop_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
    """`tf.gradients`'s (TF 2) signature, computed by custagg."""
    return _gradients(ys, xs, grad_ys, name, False, gate_gradients,
                      aggregation_method, stop_gradients,
                      unconnected_gradients)


def gradients_helper(ys, xs, grad_ys=None, name="gradients",
                     colocate_gradients_with_ops=False, gate_gradients=False,
                     aggregation_method=None, stop_gradients=None,
                     unconnected_gradients=tf.UnconnectedGradients.NONE,
                     src_graph=None, optimize_identity_n=False):
    """TF's internal helper's signature, computed by custagg."""
    return _gradients(ys, xs, grad_ys, name, colocate_gradients_with_ops,
                      gate_gradients, aggregation_method, stop_gradients,
                      unconnected_gradients, src_graph=src_graph,
                      optimize_identity_n=optimize_identity_n)


def _targets(internal):
    """(object, attribute, replacement) for each TF entry point."""
    mod, impl, util = _tf_compat.gradients_modules()
    found = [(tf, "gradients", gradients_v2),
             (tf.compat.v1, "gradients", gradients_v1),
             (tf.compat.v2, "gradients", gradients_v2),
             (mod, "gradients", gradients_v1),
             (mod, "gradients_v2", gradients_v2),
             (impl, "gradients", gradients_v1),
             (impl, "gradients_v2", gradients_v2)]
    if internal:
        found.append((util, _HELPER, gradients_helper))
    return [(obj, attr, new) for obj, attr, new in found
            if hasattr(obj, attr)]


@contextlib.contextmanager
def use_as_tf_gradients(internal=True):
    """Within the block, TF's gradient functions are custagg's.

    Args:
      internal: also replace TF's internal helper (used by cond_v2,
        while_v2 and tf.function backward passes, with `src_graph=`).

    Yields:
      None. On exit every replaced attribute holds TF's function again.
    """
    saved = []
    try:
        for obj, attr, new in _targets(internal):
            saved.append((obj, attr, getattr(obj, attr)))
            setattr(obj, attr, new)
        yield
    finally:
        for obj, attr, old in reversed(saved):
            setattr(obj, attr, old)
