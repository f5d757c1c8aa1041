"""A DP (or clipped) step against its plain step under one setting, one process.

    python -m benchmarks.dp_step MODE [--batch 256] [--repeats 9] [--models mlp,tutorial_cnn] [--write]

On the MLP 784-256-256-10 and TF Privacy's tutorial CNN (the models and
data of `benchmarks.tf_privacy_compare`), float32, one thread; the steps of
a configuration timed interleaved (`common.interleaved`), each over the
mode's base step, with (user_level_clipping, input_pipelines) each step's
peak memory over the base's. Modes: `microbatches` (M = B, B/4, 1; static
and dynamic batch), `adaptive_clipping` (fixed, quantile-adaptive and
per-layer queries), `user_level_clipping` (`group_ids` of 64 and 8 users
beside per-example clipping and the plain gradient), `input_pipelines`
(issue 23: the batch from a placeholder, `tf.data`, a `shuffle_batch` queue
or variables, the plan's forms too). What each measures and why:
docs/benchmarks.md. With --write: benchmarks/results/MODE.json and MODE.md.
"""

from __future__ import annotations

import argparse
import collections
import platform
import sys

from benchmarks import common
from benchmarks import memory
from benchmarks import tf_privacy_compare as tpc

import numpy as np  # noqa: E402  (tf_privacy_compare set the Keras switch)
import tensorflow as tf  # noqa: E402

import custagg  # noqa: E402
from custagg.privacy import dp_optimizer  # noqa: E402
from custagg.privacy.dp_query import gaussian_query  # noqa: E402
from custagg.privacy.dp_query import nested_query  # noqa: E402
from custagg.privacy.dp_query import quantile_adaptive_clip_sum_query as qa  # noqa: E402

MICROBATCH_CONFIGS = [("mlp", 512), ("tutorial_cnn", 512), ("tutorial_cnn", 256)]
QUERIES = ("fixed", "adaptive", "per_layer")
KINDS = ("aggregated", "per_example", "users_64", "users_8")
SOURCES = ("placeholder", "tf_data", "shuffle_batch_queue", "variables")


def _data():
    x, y, _, _ = tpc.digits28()
    return np.concatenate([x] * 2), np.concatenate([y] * 2)


def _step_times(steps, x, y, batch, repeats):
    """{key: median s} of `steps` {key: tf_privacy_compare.Step}, timed in
    turn on the same batches; closes them."""
    try:
        return common.interleaved({k: st.run for k, st in steps.items()},
                           tpc.batches(x, y, batch, repeats + 1, seed=3))[0]
    finally:
        for st in steps.values():
            st.close()


class Graph(object):
    """`build()` -> ({kind: fetch}, feed(kind, xb, yb), start or None) in a
    graph of its own; a one-thread session. `start(sess)` starts queue
    threads and returns their stop function."""

    def __init__(self, build, seed=0):
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf.compat.v1.set_random_seed(seed)
            self.fetches, self.feed, start = build()
            self.sess = common.session(self.graph)
            self.sess.run([tf.compat.v1.global_variables_initializer(),
                           tf.compat.v1.local_variables_initializer()])
            self.stop = start(self.sess) if start else None

    def runner(self, kind):
        return lambda xb, yb: self.sess.run(self.fetches[kind], self.feed(kind, xb, yb))

    def peak(self, kind):
        return lambda xb, yb: memory.step_peak_bytes(
            self.sess, self.fetches[kind], self.feed(kind, xb, yb))[0]

    def close(self):
        if self.stop:
            self.stop()
        self.sess.close()


def _loss(model, xb, yb):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=tpc.MODELS[model](xb))


# --------------------------------------------------------------------------
# The modes: each returns rows, one per step of each configuration.


def microbatches(repeats=7, configs=MICROBATCH_CONFIGS, log=print, **_):
    x, y = _data()
    rows = []
    for model, batch in configs:
        for dynamic in (False, True):
            mbs = [batch, batch // 4, 1]
            steps = {m: tpc.Step(dp_optimizer, model, None if dynamic else batch,
                                 m, noise=1.1) for m in mbs}
            med = _step_times(steps, x, y, batch, repeats)
            for m in mbs:
                rows.append(dict(model=model, batch=batch, dynamic=dynamic,
                                 microbatches=m, seconds_per_step=med[m],
                                 ratio_to_m_eq_b=med[m] / med[batch]))
                log("%-12s B=%d %-7s M=%-3d %.4f s/step  %.2fx the M=B step"
                    % (model, batch, "dynamic" if dynamic else "static", m,
                       med[m], med[m] / med[batch]))
    return rows


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


def adaptive_clipping(batch=256, repeats=9, models=("mlp", "tutorial_cnn"), log=print, **_):
    x, y = _data()
    rows = []
    for model in models:
        steps = {k: tpc.Step(None, model, batch, None, None, optimizer=(
            lambda xs, k=k: dp_optimizer.DPGradientDescentOptimizer(
                make_query(k, len(xs), batch), learning_rate=0.15)))
                 for k in QUERIES}
        med = _step_times(steps, x, y, batch, repeats)
        for k in QUERIES:
            rows.append(dict(model=model, batch=batch, query=k,
                             seconds_per_step=med[k],
                             ratio_to_fixed=med[k] / med["fixed"]))
            log("%-12s B=%d %-9s %.4f s/step  %.2fx the fixed-clip step"
                % (model, batch, k, med[k], med[k] / med["fixed"]))
    return rows


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


def _users_graph(model, batch):
    ids = {"users_64": user_ids(batch, 64, 1), "users_8": user_ids(batch, 8, 2)}

    def build():
        x = tf.compat.v1.placeholder(tf.float32, [batch, 28, 28, 1])
        y = tf.compat.v1.placeholder(tf.int32, [batch])
        g = tf.compat.v1.placeholder(tf.int64, [batch])
        loss = _loss(model, x, y)
        xs = tf.compat.v1.trainable_variables()
        dense = lambda gs: [tf.convert_to_tensor(t) for t in gs]
        users = dense(custagg.clipped_gradients(loss, xs, 1.0, group_ids=g))
        fetches = {"aggregated": dense(tf.gradients(tf.reduce_sum(loss), xs)),
                   "per_example": dense(custagg.clipped_gradients(loss, xs, 1.0)),
                   "users_64": users, "users_8": users}

        def feed(kind, xb, yb):
            out = {x: xb, y: yb}
            if kind in ids:
                out[g] = ids[kind]
            return out
        return fetches, feed, None
    return Graph(build)


def user_level_clipping(batch=256, repeats=9, models=("mlp", "tutorial_cnn"), log=print, **_):
    x, y = _data()
    rows = []
    for model in models:
        f = _users_graph(model, batch)
        med, peaks = common.interleaved({k: f.runner(k) for k in KINDS},
                                 tpc.batches(x, y, batch, repeats + 1, seed=3),
                                 {k: f.peak(k) for k in KINDS})
        f.close()
        for k in KINDS:
            rows.append(dict(model=model, batch=batch, kind=k, seconds=med[k],
                             time_ratio=med[k] / med["aggregated"],
                             peak_mb=memory.mb(peaks[k]),
                             memory_ratio=peaks[k] / peaks["aggregated"]))
            log("%-12s B=%d %-11s %.4f s (%.2fx)  peak %.1f MB (%.2fx)"
                % (model, batch, k, med[k], rows[-1]["time_ratio"],
                   peaks[k] / 1e6, rows[-1]["memory_ratio"]))
    return rows


def _source(kind, x, y, batch):
    """`(images [batch, 28, 28, 1], labels [batch], feed, start)`: `feed()`
    a run's feed dict (placeholder only), `start` as in `Graph`."""
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
        xs, ys = tf.compat.v1.train.slice_input_producer([tf.constant(x), tf.constant(y)], seed=3)
        xb, yb = tf.compat.v1.train.shuffle_batch(
            [xs, ys], batch_size=batch, capacity=4 * batch,
            min_after_dequeue=2 * batch, num_threads=1, seed=3)

        def start(sess):
            coord = tf.train.Coordinator()
            threads = tf.compat.v1.train.start_queue_runners(sess, coord)
            return lambda: (coord.request_stop(), coord.join(threads, stop_grace_period_secs=10))
        return xb, yb, dict, start
    if kind == "variables":
        # A batch held in non-trainable variables (benchmarks, small-data
        # notebooks): the same batch every run.
        xv = tf.compat.v1.Variable(x[:batch], trainable=False)
        yv = tf.compat.v1.Variable(y[:batch], trainable=False)
        return tf.identity(xv), tf.identity(yv), dict, None
    raise ValueError("source must be one of %s, got %r" % (SOURCES, kind))


def _pipeline_graph(model, source, x, y, batch):
    forms = {}

    def build():
        xb, yb, feed, start = _source(source, x, y, batch)
        loss = _loss(model, xb, yb)
        xs = tf.compat.v1.trainable_variables()
        forms.update(collections.Counter(custagg.plan_per_example(loss, xs).forms()))
        return {"plain": tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
                    tf.reduce_mean(loss), var_list=xs),
                "dp": dp_optimizer.DPGradientDescentGaussianOptimizer(
                    l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=None,
                    learning_rate=0.1).minimize(loss, var_list=xs)
                }, lambda kind, xb_, yb_: feed(), start
    return Graph(build), forms


def input_pipelines(batch=256, repeats=9, models=("mlp", "tutorial_cnn"),
                    sources=SOURCES, log=print, **_):
    """Rows of `{model, source, batch, plain_s, dp_s, ratio, forms,
    plain_peak_mb, memory_ratio}`; each run draws its own batch."""
    x, y = _data()
    rows = []
    for model in models:
        for source in sources:
            s, forms = _pipeline_graph(model, source, x, y, batch)
            try:
                med, peaks = common.interleaved(
                    {k: s.runner(k) for k in ("plain", "dp")},
                    [(None, None)] * (repeats + 1),
                    {k: s.peak(k) for k in ("plain", "dp")})
            finally:
                s.close()
            rows.append(dict(model=model, source=source, batch=batch,
                             plain_s=med["plain"], dp_s=med["dp"],
                             ratio=med["dp"] / med["plain"], forms=dict(forms),
                             plain_peak_mb=memory.mb(peaks["plain"]),
                             memory_ratio=peaks["dp"] / peaks["plain"]))
            log("%-12s %-20s B=%d plain %.4f s, DP %.4f s (%.2fx), peak %.2fx, "
                "forms %s" % (model, source, batch, med["plain"], med["dp"],
                              rows[-1]["ratio"], rows[-1]["memory_ratio"], forms))
    return rows


# --------------------------------------------------------------------------
# Tables: (header, key or fn(row), format) per column.

_COLUMNS = {
    "microbatches": [
        ("model", "model", "%s"), ("B", "batch", "%d"),
        ("batch dim", lambda r: "dynamic" if r["dynamic"] else "static", "%s"),
        ("M", "microbatches", "%d"), ("s/step", "seconds_per_step", "%.4f"),
        ("/ (M = B)", "ratio_to_m_eq_b", "%.2fx")],
    "adaptive_clipping": [
        ("model", "model", "%s"), ("B", "batch", "%d"), ("query", "query", "%s"),
        ("s/step", "seconds_per_step", "%.4f"),
        ("ratio to fixed", "ratio_to_fixed", "%.2fx")],
    "user_level_clipping": [
        ("model", "model", "%s"), ("B", "batch", "%d"), ("gradient", "kind", "%s"),
        ("s", "seconds", "%.4f"), ("time ratio", "time_ratio", "%.2fx"),
        ("peak MB", "peak_mb", "%.1f"), ("memory ratio", "memory_ratio", "%.2fx")],
    "input_pipelines": [
        ("model", "model", "%s"), ("source", "source", "%s"), ("B", "batch", "%d"),
        ("plain s", "plain_s", "%.4f"), ("DP step s", "dp_s", "%.4f"),
        ("DP / plain", "ratio", "%.2fx"), ("peak DP / plain", "memory_ratio", "%.2fx"),
        ("forms", lambda r: ", ".join("%s %d" % kv for kv in sorted(r["forms"].items())),
         "%s")],
}
MODES = collections.OrderedDict((m, globals()[m]) for m in _COLUMNS)


def markdown(mode, rows):
    return common.table(_COLUMNS[mode], rows)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.dp_step",
                                description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=list(MODES))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, help="default 9 (microbatches: 7)")
    p.add_argument("--models", default="mlp,tutorial_cnn")
    p.add_argument("--sources", default=",".join(SOURCES), help="input_pipelines: comma list")
    p.add_argument("--write", action="store_true", help="write benchmarks/results/MODE.*")
    p.add_argument("--note", default="", help="a line for the results file")
    args = p.parse_args(argv)
    args.repeats = args.repeats or (7 if args.mode == "microbatches" else 9)
    tf.compat.v1.disable_eager_execution()
    rows = MODES[args.mode](batch=args.batch, repeats=args.repeats,
                            models=tuple(args.models.split(",")),
                            sources=tuple(args.sources.split(",")))
    if args.write:
        meta = dict(tf=tf.__version__, python=platform.python_version(),
                    repeats=args.repeats, note=args.note)
        common.write_outputs(args.mode, dict(meta=meta, rows=rows), "%s\n\nTF %s, %s. %s\n" % (
            markdown(args.mode, rows).rstrip("\n"), tf.__version__,
            "median of %d interleaved runs, one thread%s" % (
                args.repeats, "; peak from one traced run" if "memory_ratio" in rows[0] else ""),
            args.note))
    return 0


if __name__ == "__main__":
    sys.exit(main())
