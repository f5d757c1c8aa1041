"""Before/after check of a change to DP: fixed-seed DP steps with each
optimizer class, every fetched number written to an .npz (and each graph's
op-type counts to OUT.npz.ops.json), so two trees compare bit for bit.

Not a test (pytest does not collect it): run it on each tree, then compare:

  PYTHONPATH=/path/to/before python tests/privacy/dp_before_after.py a.npz
  PYTHONPATH=/path/to/after python tests/privacy/dp_before_after.py b.npz
  python tests/privacy/dp_before_after.py --compare a.npz b.npz

Cases: custagg's wrappers (clipped, DP seeded and unseeded under a graph
seed, microbatches, per-layer, users, float32), TF Privacy's Gaussian,
query (Gaussian, nested, normalized, adaptive, no-privacy; noise on and
off) and vectorized classes, and DistributedDPOptimizer (one replica). Three
steps each: the gradients of every step and the variables after.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np

if sys.argv[1] == "--compare":
    a, b = np.load(sys.argv[2]), np.load(sys.argv[3])
    keys = sorted(set(a) | set(b))
    bad = 0
    for k in keys:
        if k not in a or k not in b:
            print("MISSING", k, k in a, k in b); bad += 1; continue
        same = a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and \
            a[k].tobytes() == b[k].tobytes()
        if not same:
            bad += 1
            print("DIFF", k, np.max(np.abs(a[k] - b[k])))
    print("%d arrays, %d bit-identical, %d differ" % (len(keys), len(keys) - bad, bad))
    import json, os
    if os.path.exists(sys.argv[2] + ".ops.json") and os.path.exists(sys.argv[3] + ".ops.json"):
        oa, ob = json.load(open(sys.argv[2] + ".ops.json")), json.load(open(sys.argv[3] + ".ops.json"))
        same = [k for k in oa if oa[k] == ob.get(k)]
        print("graphs with the same op multiset: %d of %d" % (len(same), len(oa)))
        for k in sorted(oa):
            if oa[k] != ob.get(k):
                a, b = oa[k], ob.get(k, {})
                d = {t: (a.get(t, 0), b.get(t, 0)) for t in set(a) | set(b) if a.get(t, 0) != b.get(t, 0)}
                print("  ops differ", k, "total %d -> %d" % (sum(a.values()), sum(b.values())), d)
    sys.exit(1 if bad else 0)

import tensorflow as tf
tf.compat.v1.disable_eager_execution()
import custagg
from custagg import optimizers as opt_lib
from custagg import distributed
from custagg.privacy import dp_optimizer, dp_optimizer_vectorized
from custagg.privacy.dp_query import (gaussian_query, nested_query,
                                      no_privacy_query, normalized_query,
                                      quantile_adaptive_clip_sum_query)

B, D, K = 8, 5, 3
rng = np.random.RandomState(0)
X = [rng.randn(B, D) for _ in range(3)]
Y = [rng.randint(0, K, B) for _ in range(3)]
USERS = np.array([3, 3, 9, 1, 9, 9, 4, 1])


def run(name, make, dtype=tf.float64, users=False, global_step=False):
    out = {}
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(1234)
        x = tf.compat.v1.placeholder(dtype, [None, D])
        y = tf.compat.v1.placeholder(tf.int32, [None])
        u = tf.compat.v1.placeholder(tf.int64, [None]) if users else None
        w = tf.compat.v1.get_variable(
            "w", initializer=tf.constant(np.random.RandomState(1).randn(D, K) * 0.5, dtype))
        b = tf.compat.v1.get_variable("b", initializer=tf.zeros([K], dtype))
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=tf.matmul(x, w) + b)
        opt = make(u)
        step = tf.compat.v1.train.get_or_create_global_step() if global_step else None
        gv = opt.compute_gradients(loss, var_list=[w, b])
        train = opt.apply_gradients(gv, global_step=step)
        import collections
        ops = collections.Counter(op.type for op in
                                  tf.compat.v1.get_default_graph().get_operations())
        OPS[name] = ops
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for t in range(3):
                feed = {x: X[t], y: Y[t]}
                if users:
                    feed[u] = USERS
                g = sess.run([g for g, _ in gv if g is not None], feed)
                for i, gi in enumerate(g):
                    out["%s/grad%d_%d" % (name, t, i)] = gi
                sess.run(train, feed)
            for v in (w, b):
                out["%s/%s" % (name, v.op.name)] = sess.run(v)
    return out


gd = lambda: tf.compat.v1.train.GradientDescentOptimizer(0.3)
GQ = gaussian_query.GaussianSumQuery


def tfp(query, *args, **kwargs):
    return dp_optimizer.DPGradientDescentOptimizer(query, *args,
                                                   learning_rate=0.3, **kwargs)


def adaptive(noise_multiplier, count_stddev, records, **kwargs):
    return tfp(quantile_adaptive_clip_sum_query.QuantileAdaptiveClipSumQuery(
        initial_l2_norm_clip=0.5, noise_multiplier=noise_multiplier,
        target_unclipped_quantile=0.5, learning_rate=0.2,
        clipped_count_stddev=count_stddev, expected_num_records=records),
        **kwargs)

cases = {
    "PerExample": lambda u: opt_lib.PerExampleOptimizer(gd()),
    "Clipped": lambda u: opt_lib.ClippedOptimizer(gd(), 1.0),
    "Clipped_mb2": lambda u: opt_lib.ClippedOptimizer(gd(), 0.5, num_microbatches=2),
    "DP_unseeded": lambda u: opt_lib.DPOptimizer(gd(), 1.0, 1.1),
    "DP_seeded": lambda u: opt_lib.DPOptimizer(gd(), 1.0, 1.1, seed=7),
    "DP_seeded_mb4": lambda u: opt_lib.DPOptimizer(gd(), 1.0, 1.1, num_microbatches=4, seed=7),
    "DP_perlayer": lambda u: opt_lib.DPOptimizer(gd(), [0.5, 0.2], 1.1, seed=3),
    "DP_users": lambda u: opt_lib.DPOptimizer(gd(), 1.0, 1.1, seed=3, group_ids=u),
    "DP_f32": lambda u: opt_lib.DPOptimizer(gd(), 1.0, 1.1),
    "wrapperAdamGaussian": lambda u: opt_lib.DPAdamGaussianOptimizer(
        1.0, 0.7, None, 0.05, seed=5),
    "wrapperGDGaussian_unseeded": lambda u: opt_lib.DPGradientDescentGaussianOptimizer(
        1.0, 0.7, 2, 0.05),
    "tfpGDGaussian": lambda u: dp_optimizer.DPGradientDescentGaussianOptimizer(
        1.0, 1.1, None, learning_rate=0.3),
    "tfpAdamGaussian_mb4": lambda u: dp_optimizer.DPAdamGaussianOptimizer(
        1.0, 1.1, 4, learning_rate=0.1),
    "tfpGaussian_users": lambda u: dp_optimizer.DPGradientDescentGaussianOptimizer(
        1.0, 1.1, learning_rate=0.3, group_ids=u),
    "tfpGaussian_f32": lambda u: dp_optimizer.DPGradientDescentGaussianOptimizer(
        1.0, 1.1, None, learning_rate=0.3),
    "tfpQueryGaussian": lambda u: tfp(GQ(1.0, 1.1)),
    "tfpNested": lambda u: tfp(nested_query.NestedSumQuery([GQ(0.5, 0.6), GQ(0.2, 0.3)])),
    "tfpNestedOneLeaf": lambda u: tfp(nested_query.NestedSumQuery(GQ(0.5, 0.6))),
    "tfpNormalized": lambda u: tfp(normalized_query.NormalizedQuery(GQ(1.0, 1.1), denominator=4.0)),
    "tfpAdaptive": lambda u: adaptive(1.1, 0.5, 8),
    "tfpAdaptive_users": lambda u: adaptive(1.1, 0.5, 4, group_ids=u),
    "tfpNested_nonoise": lambda u: tfp(nested_query.NestedSumQuery([GQ(0.5, 0.0), GQ(0.2, 0.0)])),
    "tfpNormalized_nonoise": lambda u: tfp(normalized_query.NormalizedQuery(GQ(1.0, 0.0), denominator=4.0)),
    "tfpAdaptive_nonoise": lambda u: adaptive(0.0, 0.0, 8),
    "tfpAdaptive_users_nonoise": lambda u: adaptive(0.0, 0.0, 4, group_ids=u),
    "tfpNoPrivacy": lambda u: tfp(no_privacy_query.NoPrivacyAverageQuery()),
    "tfpNoPrivacy_unrolled_mb4": lambda u: tfp(no_privacy_query.NoPrivacySumQuery(), 4, True),
    "tfpNoPrivacy_users": lambda u: tfp(no_privacy_query.NoPrivacySumQuery(), group_ids=u),
    "vectorizedSGD": lambda u: dp_optimizer_vectorized.VectorizedDPSGD(
        1.0, 1.1, 4, learning_rate=0.3),
    "vectorizedAdam": lambda u: dp_optimizer_vectorized.VectorizedDPAdam(
        1.0, 1.1, learning_rate=0.1),
    "dist_DP_seeded": lambda u: distributed.DistributedDPOptimizer(
        opt_lib.DPOptimizer(gd(), 1.0, 1.1), seed=11),
    "dist_DP_unseeded": lambda u: distributed.DistributedDPOptimizer(
        opt_lib.DPOptimizer(gd(), 1.0, 1.1, num_microbatches=4)),
    "dist_tfp_seeded": lambda u: distributed.DistributedDPOptimizer(
        dp_optimizer.DPGradientDescentGaussianOptimizer(1.0, 1.1, learning_rate=0.3),
        seed=11),
    "dist_clipped_seeded": lambda u: distributed.DistributedDPOptimizer(
        opt_lib.ClippedOptimizer(gd(), 1.0), seed=2),
}
OPS = {}
out = {}
for name, make in sorted(cases.items()):
    kw = {}
    if name.endswith("users") or name.endswith("users_nonoise"):
        kw["users"] = True
    if name.endswith("f32"):
        kw["dtype"] = tf.float32
    if name.startswith("dist"):
        kw["global_step"] = True
    if name == "Weighted":
        continue
    out.update(run(name, make, **kw))
np.savez(sys.argv[1], **out)
import json
json.dump(OPS, open(sys.argv[1] + ".ops.json", "w"), indent=0, sort_keys=True)
print("wrote", len(out), "arrays from", len(cases), "cases;", custagg.__file__)
