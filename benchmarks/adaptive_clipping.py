"""Adaptive and per-layer clipping against fixed clipping: one DP-SGD step.

    python -m benchmarks.adaptive_clipping [--batch 256] [--repeats 9] [--write]

custagg.privacy's `DPGradientDescentOptimizer` on the MLP 784-256-256-10 and
TF Privacy's tutorial CNN (`benchmarks.tf_privacy_compare`'s models), static
batch B, M = B, noise on (sigma 1.1), three queries:

* fixed: `GaussianSumQuery(1.0, 1.1)` (the tutorial's step);
* adaptive: `QuantileAdaptiveClipSumQuery` (Andrew et al.: target 0.5,
  learning rate 0.2, count noise B/20), state in variables;
* per-layer: `NestedSumQuery` of one `GaussianSumQuery` per variable
  (clip 1/sqrt(#variables) each).

The three steps of a model are timed interleaved (one step of each in turn)
so that load on the machine falls on all alike; reported: median seconds
per step and the ratio to the fixed step. With --write:
benchmarks/results/adaptive_clipping.json and .md.
"""

from __future__ import annotations

import time

from benchmarks import common
from benchmarks import tf_privacy_compare as tpc

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from custagg.privacy import dp_optimizer  # noqa: E402
from custagg.privacy.dp_query import gaussian_query  # noqa: E402
from custagg.privacy.dp_query import nested_query  # noqa: E402
from custagg.privacy.dp_query import quantile_adaptive_clip_sum_query as qa  # noqa: E402

QUERIES = ("fixed", "adaptive", "per_layer")


def make_query(kind, num_vars, batch, sigma=1.1):
    if kind == "fixed":
        return gaussian_query.GaussianSumQuery(1.0, sigma)
    if kind == "adaptive":
        return qa.QuantileAdaptiveClipSumQuery(
            initial_l2_norm_clip=1.0, noise_multiplier=sigma,
            target_unclipped_quantile=0.5, learning_rate=0.2,
            clipped_count_stddev=batch / 20.0, expected_num_records=batch)
    clip = 1.0 / np.sqrt(num_vars)
    return nested_query.NestedSumQuery(
        [gaussian_query.GaussianSumQuery(clip, clip * sigma)
         for _ in range(num_vars)])


class QueryStep(object):
    """One model + DP optimizer with a given query, own graph and session."""

    def __init__(self, model, batch, kind, lr=0.15, seed=0):
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf.compat.v1.set_random_seed(seed)
            self.x = tf.compat.v1.placeholder(tf.float32, [batch, 28, 28, 1])
            self.y = tf.compat.v1.placeholder(tf.int32, [batch])
            loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=self.y, logits=tpc.MODELS[model](self.x))
            variables = tf.compat.v1.trainable_variables()
            opt = dp_optimizer.DPGradientDescentOptimizer(
                make_query(kind, len(variables), batch), learning_rate=lr)
            self.train_op = opt.minimize(loss, var_list=variables)
            self.sess = tf.compat.v1.Session(config=tf.compat.v1.ConfigProto(
                intra_op_parallelism_threads=1,
                inter_op_parallelism_threads=1))
            self.sess.run(tf.compat.v1.global_variables_initializer())

    def run(self, xb, yb):
        self.sess.run(self.train_op, {self.x: xb, self.y: yb})

    def close(self):
        self.sess.close()


def run(batch=256, repeats=9, models=("mlp", "tutorial_cnn"), log=print):
    x, y, _, _ = tpc.digits28()
    x = np.concatenate([x] * 2)
    y = np.concatenate([y] * 2)
    rows = []
    for model in models:
        steps = {k: QueryStep(model, batch, k) for k in QUERIES}
        data = tpc.batches(x, y, batch, repeats + 1, seed=3)
        for s in steps.values():
            s.run(*data[0])
        times = {k: [] for k in QUERIES}
        for xb, yb in data[1:]:
            for k, s in steps.items():
                t = time.perf_counter()
                s.run(xb, yb)
                times[k].append(time.perf_counter() - t)
        for s in steps.values():
            s.close()
        base = float(np.median(times["fixed"]))
        for k in QUERIES:
            sec = float(np.median(times[k]))
            rows.append(dict(model=model, batch=batch, query=k,
                             seconds_per_step=sec, ratio_to_fixed=sec / base))
            log("%-12s B=%d %-9s %.4f s/step  %.2fx the fixed-clip step"
                % (model, batch, k, sec, sec / base))
    return rows


def _markdown(rows):
    lines = ["| model | B | query | s/step | ratio to fixed |",
             "|---|---:|---|---:|---:|"]
    for r in rows:
        lines.append("| %s | %d | %s | %.4f | %.2fx |" % (
            r["model"], r["batch"], r["query"], r["seconds_per_step"],
            r["ratio_to_fixed"]))
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = common.batch_parser(__doc__)
    args = p.parse_args(argv)
    rows = run(args.batch, args.repeats, tuple(args.models.split(",")))
    if args.write:
        common.write_results(
            "adaptive_clipping", rows, args, tf.__version__, _markdown(rows),
            "median of %d interleaved steps, one thread" % args.repeats)


if __name__ == "__main__":
    main()
