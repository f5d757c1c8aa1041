"""The systems the benchmark compares, as data (import-light: no frameworks).

A system computes a task's quantity for a model's per-example loss. Every
configuration also measures the "floor" in the same process: the plain
aggregated gradient of the summed loss in the system's own framework
(tf.compat.v1.gradients for TensorFlow systems, jit(grad) for JAX,
loss.sum().backward() for PyTorch), so `ratio_to_floor` never compares
numbers from two processes.
"""
import collections

TASKS = collections.OrderedDict([
    ("grads", "(a) per-example gradients materialized and consumed "
              "(fetch sum of squares per example)"),
    ("norms", "(b) per-example global L2 norms [B]"),
    ("clip", "(b2) clipped sum sum_i min(1, C/||g_i||) g_i (DP-SGD without the noise)"),
    ("dpsgd", "(c) one DP-SGD step: sum_i min(1, C/||g_i||) g_i + N(0, (sigma C)^2)"),
    ("custom", "(d) custom weighted sum sum_i f_i g_i (custagg CUSTOM aggregation)"),
    ("step", "(e) the zoo's DP step: DPOptimizer around Adam, over the plain Adam step"),
])
TASK_ALIASES = {"a": "grads", "b": "norms", "b2": "clip", "c": "dpsgd", "d": "custom"}

System = collections.namedtuple("System", "name framework tasks quadratic description")

_ABC = ("grads", "norms", "dpsgd")
# The clipped sum alone, for custagg, the TF vectorized baseline (the
# issue-3 comparison) and the vmap peers (issue 11); Opacus on dpsgd only.
_ABC_CLIP = ("grads", "norms", "clip", "dpsgd")
_CD = ("clip", "dpsgd")

SYSTEMS = collections.OrderedDict((s.name, s) for s in [
    System("custagg_auto", "tf", _ABC_CLIP + ("custom",), False,
           'custagg, strategy="auto" (per_example_gradients / per_example_norms / '
           "clipped_gradients / weighted_gradients)"),
    System("custagg_rules", "tf", _ABC_CLIP, False, 'custagg, strategy="rules"'),
    System("custagg_pfor", "tf", _ABC_CLIP, False, 'custagg, strategy="pfor"'),
    System("custagg_loop", "tf", _ABC, True, 'custagg, strategy="loop"'),
    System("custagg_custom_vector", "tf", ("custom",), False,
           "custagg.gradients(loss[B], xs, aggregation_method=CUSTOM, gradient_factors=f)"),
    System("custagg_custom_slices", "tf", ("custom",), False,
           "custagg.gradients([loss[i] for i in range(B)], xs, "
           "aggregation_method=CUSTOM, gradient_factors=f)"),
    System("custagg_grad_ys", "tf", ("custom",), False,
           "custagg.gradients(loss[B], xs, grad_ys=f) (drop-in, no CUSTOM)"),
    System("tf_grad_ys", "tf", ("custom",), False, "tf.compat.v1.gradients(loss, xs, grad_ys=f)"),
    System("tf_loop", "tf", _ABC, True,
           "stack of tf.compat.v1.gradients(loss[i], xs), one per example"),
    System("tf_vmap", "tf", _ABC_CLIP, False,
           "tf.vectorized_map over examples, each example's forward AND backward inside the map"),
    System("tf_jacobian", "tf", _ABC, True,
           "tensorflow.python.ops.parallel_for.gradients.jacobian(loss, xs)"),
    System("tfp_vectorized", "tf", ("dpsgd",), True,
           "TF Privacy VectorizedDPSGDOptimizer.compute_gradients (module loaded alone)"),
    System("jax_vmap", "jax", _ABC_CLIP, False, "JAX jit(vmap(grad)) on the same weights"),
    System("torch_func", "torch", _ABC_CLIP, False,
           "torch.func vmap(grad) with functional_call on the same weights"),
    System("opacus", "torch", _ABC_CLIP, False, 'Opacus GradSampleModule (grad_sample_mode='
           '"hooks"; functorch fallback for custom modules); clip, dpsgd via DPOptimizer'),
    # Issue 37: the DP peers in their fastest configurations (docs/benchmarks.md).
    System("opacus_ghost", "torch", _CD, False,
           'Opacus 1.6 ghost clipping (grad_sample_mode="ghost")'),
    System("jax_privacy", "jax", _CD, False, "JAX Privacy clipping.clipped_grad under jit"),
    System("tfp_fast", "keras", _CD, False, "TF Privacy 0.9 Keras fast gradient clipping, TF 2.15"),
])
