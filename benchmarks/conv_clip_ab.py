"""Clipped sums on the convolution models before and after issue 26's
chunk-kernel form, in one graph and one session (issue 26).

`python -m benchmarks.conv_clip_ab [--models cnn,mnist_deep]
[--batch-sizes 128,256] [--repeats 21]` builds each model (float32, dynamic
batch; `benchmarks.conv_memory`'s models) with three fetches: the
aggregated gradient (the floor), the clipped sum as it was (the norms' chunk
loop, then one weighted backprop-filter call per convolution: built with
`custagg.per_example.api._clipped_from_chunks` switched off) and as it is
(the convolutions' sums from their norms' chunk kernels), and times them
interleaved on one thread. Prints min and median ms and the ratios to the
floor's. On a shared machine the minimum is the steadier figure; the
ratios of one run are comparable, the absolute times are not.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402


def compare(name, batch, repeats):
    """{fetch: [seconds]} for "floor", "before" and "after"."""
    import tensorflow as tf
    import custagg
    from custagg.per_example import api
    from benchmarks import conv_memory
    graph = tf.Graph()
    with graph.as_default():
        loss, xs, feed = conv_memory._build(name)
        fetches = {"floor": tf.compat.v1.gradients(tf.reduce_sum(loss), xs)}
        keep = api._clipped_from_chunks
        try:
            api._clipped_from_chunks = lambda *args: None
            fetches["before"] = custagg.clipped_gradients(
                loss, xs, 1.0, name="clip_before")
        finally:
            api._clipped_from_chunks = keep
        fetches["after"] = custagg.clipped_gradients(loss, xs, 1.0,
                                                     name="clip_after")
        config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                          inter_op_parallelism_threads=1)
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            fd = feed(batch)
            for fetch in fetches.values():
                sess.run(fetch, fd)                          # warm up
            times = {key: [] for key in fetches}
            for _ in range(repeats):
                for key, fetch in fetches.items():
                    start = time.perf_counter()
                    sess.run(fetch, fd)
                    times[key].append(time.perf_counter() - start)
    return times


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.conv_clip_ab",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="cnn,mnist_deep")
    p.add_argument("--batch-sizes", default="128,256")
    p.add_argument("--repeats", type=int, default=21)
    args = p.parse_args(argv)
    from benchmarks import conv_memory
    known = conv_memory.ZOO_MODELS + conv_memory.HARNESS_MODELS
    names = [m for m in args.models.split(",") if m]
    unknown = sorted(set(names) - set(known))
    if unknown:
        p.error("unknown model(s) %s; choose from %s" % (
            ", ".join(unknown), ", ".join(known)))
    for name in names:
        for batch in [int(b) for b in args.batch_sizes.split(",") if b]:
            times = compare(name, batch, args.repeats)
            low = {k: 1e3 * min(v) for k, v in times.items()}
            mid = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
            print("%s B=%d ms min/median: floor %.1f/%.1f, before %.1f/%.1f "
                  "(%.2fx/%.2fx), after %.1f/%.1f (%.2fx/%.2fx)" % (
                      name, batch, low["floor"], mid["floor"],
                      low["before"], mid["before"],
                      low["before"] / low["floor"],
                      mid["before"] / mid["floor"],
                      low["after"], mid["after"],
                      low["after"] / low["floor"],
                      mid["after"] / mid["floor"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
