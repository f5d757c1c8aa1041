"""Where the peak memory of per-example norms, clipped sums and a DP step
comes from, on the convolution models (issue 26).

`python -m benchmarks.conv_memory [--models mnist_deep,cnn] [--batch-sizes 64,256]`
builds each model (zoo models at full size: `mnist_deep`, `keras_separable`,
`layers_text_cnn`; the harness's `cnn`, `mlp` and `text`), in float32 with a dynamic
batch, and for the floor (aggregated gradient), the norms, the clipped sum
and (mnist_deep, cnn, mlp) a DP step (`custagg.DPOptimizer` around Adam)
next to the plain step (Adam on the mean loss), runs one traced
step (benchmarks/memory.py: TF's allocation records) and prints its peak,
its ratio to the floor's, and the tensors live at the peak, largest first,
by op. Memory figures do not depend on the machine's load; no timing here.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402

ZOO_MODELS = ("mnist_deep", "keras_separable", "layers_text_cnn")
HARNESS_MODELS = ("cnn", "mlp", "text")


def _build(name):
    """(loss, xs, feed(batch), has_dp_step) in the default graph."""
    import tensorflow as tf
    if name in HARNESS_MODELS:
        from benchmarks import models
        x, y = models.tf_placeholders(name, None, dynamic=True)
        variables, xs = models.tf_variables(name)
        loss = models.tf_loss(name, variables, x, y)

        def feed(batch):
            xv, yv = models.make_batch(name, batch)
            return {x: xv, y: yv}
        return loss, xs, feed
    from benchmarks import zoo_models
    tf.compat.v1.set_random_seed(3)
    model = zoo_models.ZOO[name](tf.float32, np.random.default_rng(3),
                                 full=True)
    return (model.loss, model.xs,
            lambda batch: model.feed(np.random.default_rng(batch), batch))


def op_times(step_stats):
    """Milliseconds per op (by name, with its type) of a traced step: each
    kernel's own time (`op_end_rel_micros`), a Counter of (name, type)."""
    import collections
    times = collections.Counter()
    for dev in step_stats.dev_stats:
        for node in dev.node_stats:
            op_type = node.timeline_label.split(" = ")[-1].split("(")[0]
            times[(node.node_name, op_type)] += node.op_end_rel_micros / 1e3
    return times


def _print_times(name, batch, key, times, top):
    by_type = {}
    for (_, op_type), ms in times.items():
        by_type[op_type] = by_type.get(op_type, 0.0) + ms
    print("%s B=%d %-9s kernel time %.1f ms (traced, mean of 3): by type %s"
          % (name, batch, key, sum(times.values()), ", ".join(
              "%s %.1f" % kv for kv in sorted(by_type.items(),
                                               key=lambda kv: -kv[1])[:top])))
    for (node, op_type), ms in times.most_common(top):
        print("    %8.2f ms  %-16s %s" % (ms, op_type, node))


def profile(name, batch_sizes, top=8, dp_step=True, times=False):
    """Prints, per batch size and fetch, the traced step's peak and the
    tensors live at it (with `times`, also where its kernel time goes: a
    profile for ratios inside one process, not a benchmark). Returns
    {(batch, fetch name): peak bytes}."""
    import tensorflow as tf
    import custagg
    from benchmarks import common, memory
    found = {}
    graph = tf.Graph()
    with graph.as_default():
        loss, xs, feed = _build(name)
        fetches = {
            "floor": tf.compat.v1.gradients(tf.reduce_sum(loss), xs),
            "norms": custagg.per_example_norms(loss, xs),
            "clip": custagg.clipped_gradients(loss, xs, 1.0),
        }
        if dp_step and name in ("mnist_deep", "cnn", "mlp"):
            fetches.update(common.adam_step_pair(loss, xs))
        config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                          inter_op_parallelism_threads=1)
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for batch in batch_sizes:
                fd = feed(batch)
                for key, fetch in fetches.items():
                    sess.run(fetch, fd)                      # warm up
                    stats = memory.traced_step_stats(sess, fetch, fd)
                    peak, _ = memory.peak_from_step_stats(stats)
                    found[(batch, key)] = peak
                    base = "floor" if not key.startswith("step") else "step_orig"
                    ratio = peak / float(found[(batch, base)])
                    print("%s B=%d %-9s peak %8.2f MB  %.2fx %s" % (
                        name, batch, key, peak / 1e6, ratio, base), flush=True)
                    for nbytes, node, op_type in memory.live_at_peak(
                            stats)[:top]:
                        print("    %8.2f MB  %-16s %s" % (nbytes / 1e6, op_type,
                                                         node))
                    if times:
                        total = op_times(stats)
                        for _ in range(2):
                            total.update(op_times(memory.traced_step_stats(
                                sess, fetch, fd)))
                        _print_times(name, batch, key, collections.Counter(
                            {k: v / 3 for k, v in total.items()}), top)
    return found


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.conv_memory",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mnist_deep,cnn")
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--times", action="store_true",
                   help="also the traced steps' kernel time by op")
    args = p.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    unknown = sorted(set(names) - set(ZOO_MODELS + HARNESS_MODELS))
    if unknown:
        p.error("unknown model(s) %s; choose from %s" % (
            ", ".join(unknown), ", ".join(ZOO_MODELS + HARNESS_MODELS)))
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    for name in names:
        profile(name, batches, args.top, times=args.times)
    return 0


if __name__ == "__main__":
    sys.exit(main())
