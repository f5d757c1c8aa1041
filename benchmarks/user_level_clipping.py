"""User-level (group) clipping against per-example clipping: time and memory.

    python -m benchmarks.user_level_clipping [--batch 256] [--repeats 9] [--write]

On the MLP 784-256-256-10 and TF Privacy's tutorial CNN
(`benchmarks.tf_privacy_compare`'s models), float32, static batch B, one
graph per model with four fetches over the same batch:

* aggregated: `tf.gradients` of the summed loss (no per-example work);
* per-example: `custagg.clipped_gradients(loss, vars, 1.0)` (fixed clip,
  each example clipped);
* users U=64 and U=8: `custagg.clipped_gradients(loss, vars, 1.0,
  group_ids=g)` with B examples spread over U users of unequal sizes
  (sizes drawn from a Zipf-like law; ids large int64 values).

The fetches of a model are timed interleaved (one run of each in turn), so
load on the machine falls on all alike; reported: the median seconds and
the ratio to the aggregated gradient, and each fetch's peak memory (TF's
allocator records of one traced run, `benchmarks.memory`) and its ratio to
the aggregated gradient's. With --write: benchmarks/results/
user_level_clipping.json and .md.
"""

from __future__ import annotations

import time

from benchmarks import common
from benchmarks import memory
from benchmarks import tf_privacy_compare as tpc

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import custagg  # noqa: E402

KINDS = ("aggregated", "per_example", "users_64", "users_8")


def user_ids(batch, users, seed=0):
    """`[batch]` int64 ids of `users` users, unequal sizes (every user at
    least one example), shuffled; ids are large values, not 0..U-1."""
    rng = np.random.RandomState(seed)
    users = min(users, batch)
    weights = 1.0 / np.arange(1, users + 1)
    extra = rng.choice(users, batch - users, p=weights / weights.sum())
    ids = np.concatenate([np.arange(users), extra])
    rng.shuffle(ids)
    return (ids * 7919 + 2 ** 40).astype(np.int64)


class Fetches(object):
    """One model, its four fetches, a one-thread session."""

    def __init__(self, model, batch, seed=0):
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf.compat.v1.set_random_seed(seed)
            self.x = tf.compat.v1.placeholder(tf.float32, [batch, 28, 28, 1])
            self.y = tf.compat.v1.placeholder(tf.int32, [batch])
            self.g = tf.compat.v1.placeholder(tf.int64, [batch])
            loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=self.y, logits=tpc.MODELS[model](self.x))
            xs = tf.compat.v1.trainable_variables()
            dense = lambda gs: [tf.convert_to_tensor(t) for t in gs]
            users = dense(custagg.clipped_gradients(loss, xs, 1.0,
                                                    group_ids=self.g))
            self.fetches = {
                "aggregated": dense(tf.gradients(tf.reduce_sum(loss), xs)),
                "per_example": dense(custagg.clipped_gradients(loss, xs,
                                                               1.0)),
                "users_64": users, "users_8": users}
            self.sess = tf.compat.v1.Session(config=tf.compat.v1.ConfigProto(
                intra_op_parallelism_threads=1,
                inter_op_parallelism_threads=1))
            self.sess.run(tf.compat.v1.global_variables_initializer())
        self.ids = {"users_64": user_ids(batch, 64, 1),
                    "users_8": user_ids(batch, 8, 2)}

    def feed(self, kind, xb, yb):
        feed = {self.x: xb, self.y: yb}
        if kind in self.ids:
            feed[self.g] = self.ids[kind]
        return feed

    def run(self, kind, xb, yb):
        self.sess.run(self.fetches[kind], self.feed(kind, xb, yb))

    def peak(self, kind, xb, yb):
        return memory.step_peak_bytes(self.sess, self.fetches[kind],
                                      self.feed(kind, xb, yb))[0]


def run(batch=256, repeats=9, models=("mlp", "tutorial_cnn"), log=print):
    x, y, _, _ = tpc.digits28()
    x = np.concatenate([x] * 2)
    y = np.concatenate([y] * 2)
    rows = []
    for model in models:
        f = Fetches(model, batch)
        data = tpc.batches(x, y, batch, repeats + 1, seed=3)
        for k in KINDS:
            f.run(k, *data[0])
        peaks = {k: f.peak(k, *data[0]) for k in KINDS}
        times = {k: [] for k in KINDS}
        for xb, yb in data[1:]:
            for k in KINDS:
                t = time.perf_counter()
                f.run(k, xb, yb)
                times[k].append(time.perf_counter() - t)
        f.sess.close()
        base_t = float(np.median(times["aggregated"]))
        for k in KINDS:
            sec = float(np.median(times[k]))
            rows.append(dict(model=model, batch=batch, kind=k, seconds=sec,
                             time_ratio=sec / base_t,
                             peak_mb=memory.mb(peaks[k]),
                             memory_ratio=peaks[k] / peaks["aggregated"]))
            log("%-12s B=%d %-11s %.4f s (%.2fx)  peak %.1f MB (%.2fx)"
                % (model, batch, k, sec, sec / base_t, peaks[k] / 1e6,
                   peaks[k] / peaks["aggregated"]))
    return rows


def _markdown(rows):
    lines = ["| model | B | gradient | s | time ratio | peak MB | memory "
             "ratio |", "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append("| %s | %d | %s | %.4f | %.2fx | %.1f | %.2fx |" % (
            r["model"], r["batch"], r["kind"], r["seconds"], r["time_ratio"],
            r["peak_mb"], r["memory_ratio"]))
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = common.batch_parser(__doc__)
    args = p.parse_args(argv)
    rows = run(args.batch, args.repeats, tuple(args.models.split(",")))
    if args.write:
        common.write_results(
            "user_level_clipping", rows, args, tf.__version__, _markdown(rows),
            "median of %d interleaved runs, one thread; peak from one traced "
            "run" % args.repeats)


if __name__ == "__main__":
    main()
