"""A DP-SGD step by input pipeline: the batch from a placeholder, `tf.data`,
a TF1 queue (`shuffle_batch`) or variables (issue 23).

    python -m benchmarks.input_pipelines [--batch 256] [--repeats 9] [--write]

custagg reads which tensors carry examples backward from the `[B]` loss
(custagg/batch_axis/sources.py), so where the batch comes from should not
change the plan or the cost. Per model (the MLP 784-256-256-10 and TF
Privacy's tutorial CNN, `benchmarks.tf_privacy_compare`'s, float32) and per
source, one graph with two train ops on the same model:

* plain: `GradientDescentOptimizer.minimize` of the mean loss (the
  aggregated gradient, no per-example work);
* DP: custagg's `DPGradientDescentGaussianOptimizer` (clip 1.0, noise 1.1,
  one microbatch per example), TF Privacy's tutorial call.

The two ops run interleaved (one of each in turn), each run drawing its own
batch from the source; reported: median seconds, the DP/plain ratio, the
plan's forms for the DP step, and each op's peak memory (one traced run,
`benchmarks.memory`) over the plain op's. With --write:
benchmarks/results/input_pipelines.json and .md.
"""

from __future__ import annotations

import collections
import time

from benchmarks import common
from benchmarks import memory
from benchmarks import tf_privacy_compare as tpc

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import custagg  # noqa: E402
from custagg.privacy import dp_optimizer  # noqa: E402

SOURCES = ("placeholder", "tf_data", "shuffle_batch_queue", "variables")


def _source(kind, x, y, batch):
    """`(images [batch, 28, 28, 1], labels [batch], feed, start)`: `feed`
    gives a run's feed dict (placeholder only), `start(sess)` starts queue
    threads and returns a stop function."""
    if kind == "placeholder":
        xp = tf.compat.v1.placeholder(tf.float32, [None, 28, 28, 1])
        yp = tf.compat.v1.placeholder(tf.int32, [None])
        rng = np.random.RandomState(3)

        def feed():
            idx = rng.choice(len(x), batch, replace=False)
            return {xp: x[idx], yp: y[idx]}
        return xp, yp, feed, None
    if kind == "tf_data":
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
            len(x), seed=3).repeat().batch(batch)
        xb, yb = tf.compat.v1.data.make_one_shot_iterator(ds).get_next()
        return xb, yb, dict, None
    if kind == "shuffle_batch_queue":
        # The TF1 tutorials' pipeline: slice_input_producer + shuffle_batch.
        xs, ys = tf.compat.v1.train.slice_input_producer(
            [tf.constant(x), tf.constant(y)], seed=3)
        xb, yb = tf.compat.v1.train.shuffle_batch(
            [xs, ys], batch_size=batch, capacity=4 * batch,
            min_after_dequeue=2 * batch, num_threads=1, seed=3)

        def start(sess):
            coord = tf.train.Coordinator()
            threads = tf.compat.v1.train.start_queue_runners(sess, coord)

            def stop():
                coord.request_stop()
                coord.join(threads, stop_grace_period_secs=10)
            return stop
        return xb, yb, dict, start
    if kind == "variables":
        # A batch held in non-trainable variables (benchmarks, small-data
        # notebooks): the same batch every run.
        xv = tf.compat.v1.Variable(x[:batch], trainable=False)
        yv = tf.compat.v1.Variable(y[:batch], trainable=False)
        return tf.identity(xv), tf.identity(yv), dict, None
    raise ValueError("source must be one of %s, got %r" % (SOURCES, kind))


class Steps(object):
    """One model fed from one source, its plain and DP train ops."""

    def __init__(self, model, source, x, y, batch, seed=0):
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf.compat.v1.set_random_seed(seed)
            xb, yb, self.feed, start = _source(source, x, y, batch)
            loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=yb, logits=tpc.MODELS[model](xb))
            xs = tf.compat.v1.trainable_variables()
            self.forms = dict(collections.Counter(
                custagg.plan_per_example(loss, xs).forms()))
            self.ops = {
                "plain": tf.compat.v1.train.GradientDescentOptimizer(
                    0.1).minimize(tf.reduce_mean(loss), var_list=xs),
                "dp": dp_optimizer.DPGradientDescentGaussianOptimizer(
                    l2_norm_clip=1.0, noise_multiplier=1.1,
                    num_microbatches=None, learning_rate=0.1).minimize(
                        loss, var_list=xs)}
            self.sess = tf.compat.v1.Session(config=tf.compat.v1.ConfigProto(
                intra_op_parallelism_threads=1,
                inter_op_parallelism_threads=1))
            self.sess.run([tf.compat.v1.global_variables_initializer(),
                           tf.compat.v1.local_variables_initializer()])
            self.stop = start(self.sess) if start else None

    def run(self, kind):
        self.sess.run(self.ops[kind], self.feed())

    def peak(self, kind):
        return memory.step_peak_bytes(self.sess, self.ops[kind],
                                      self.feed())[0]

    def close(self):
        if self.stop:
            self.stop()
        self.sess.close()


def run(batch=256, repeats=9, models=("mlp", "tutorial_cnn"),
        sources=SOURCES, log=print):
    """Rows of `{model, source, batch, plain_s, dp_s, ratio, forms,
    memory_ratio}`."""
    x, y, _, _ = tpc.digits28()
    rows = []
    for model in models:
        for source in sources:
            s = Steps(model, source, x, y, batch)
            try:
                for kind in ("plain", "dp"):
                    s.run(kind)
                peaks = {k: s.peak(k) for k in ("plain", "dp")}
                times = {"plain": [], "dp": []}
                for _ in range(repeats):
                    for kind in ("plain", "dp"):
                        t = time.perf_counter()
                        s.run(kind)
                        times[kind].append(time.perf_counter() - t)
            finally:
                s.close()
            plain = float(np.median(times["plain"]))
            dp = float(np.median(times["dp"]))
            rows.append(dict(model=model, source=source, batch=batch,
                             plain_s=plain, dp_s=dp, ratio=dp / plain,
                             forms=s.forms, plain_peak_mb=memory.mb(
                                 peaks["plain"]),
                             memory_ratio=peaks["dp"] / peaks["plain"]))
            log("%-12s %-20s B=%d plain %.4f s, DP %.4f s (%.2fx), peak "
                "%.2fx, forms %s" % (model, source, batch, plain, dp,
                                     dp / plain, peaks["dp"] / peaks["plain"],
                                     s.forms))
    return rows


def markdown(rows):
    lines = ["| model | source | B | plain s | DP step s | DP / plain | "
             "peak DP / plain | forms |", "|---|---|---:|---:|---:|---:|---:|"
             "---|"]
    for r in rows:
        lines.append("| %s | %s | %d | %.4f | %.4f | %.2fx | %.2fx | %s |" % (
            r["model"], r["source"], r["batch"], r["plain_s"], r["dp_s"],
            r["ratio"], r["memory_ratio"], ", ".join(
                "%s %d" % kv for kv in sorted(r["forms"].items()))))
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = common.batch_parser(__doc__)
    p.add_argument("--sources", default=",".join(SOURCES))
    args = p.parse_args(argv)
    rows = run(args.batch, args.repeats, tuple(args.models.split(",")),
               tuple(args.sources.split(",")))
    if args.write:
        common.write_results(
            "input_pipelines", rows, args, tf.__version__, markdown(rows),
            "median of %d interleaved runs, one thread; peak from one traced "
            "run" % args.repeats)


if __name__ == "__main__":
    main()
