"""The zoo benchmark: per-example work on graphs written the way users write them.

`python -m benchmarks --zoo` (or `python -m benchmarks.zoo`) builds each
model of `benchmarks.zoo_models` at full size (`full=True`: MNIST's 28x28
images, the tutorials' layer sizes) in float32 with a dynamic batch, and
times, at each batch size, in one process and alternating with the floor:

* floor: the aggregated gradient, `tf.compat.v1.gradients(reduce_sum(loss))`;
* norms: `custagg.per_example_norms(loss, xs)` (strategy "auto");
* clip: `custagg.clipped_gradients(loss, xs, C)` ("auto");
* for mnist_deep, also one DP-SGD step (`custagg.DPOptimizer` around Adam,
  clip + noise + apply) against the tutorial's own step,
  `AdamOptimizer(1e-4).minimize(reduce_mean(loss))`.

Every result is fetched (TF prunes what is not). Ratios are medians over
`--repeats` runs, each run of a task next to a run of its floor. Results go
to `benchmarks/results/zoo.json` and `zoo.md`, with the plan's forms (the
variables not on rules) so a slow cell says why.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def _time(sess, fetch, feed):
    start = time.perf_counter()
    sess.run(fetch, feed)
    return time.perf_counter() - start


def _bench_model(name, batch_sizes, repeats, threads):
    import tensorflow as tf
    import custagg
    from benchmarks import common, memory, zoo_models

    rows = []
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(3)
        rng = np.random.default_rng(3)
        model = zoo_models.ZOO[name](tf.float32, rng, full=True)
        loss, xs = model.loss, model.xs
        plan = custagg.plan_per_example(loss, xs)
        tasks = {
            "floor": tf.compat.v1.gradients(tf.reduce_sum(loss), xs),
            "norms": custagg.per_example_norms(loss, xs),
            "clip": custagg.clipped_gradients(loss, xs, 1.0),
        }
        steps = {}
        if name == "mnist_deep":
            steps = common.adam_step_pair(loss, xs)
        config = tf.compat.v1.ConfigProto(
            intra_op_parallelism_threads=threads,
            inter_op_parallelism_threads=threads)
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for batch in batch_sizes:
                feed = model.feed(np.random.default_rng(batch), batch)
                times = {k: [] for k in list(tasks) + list(steps)}
                everything = dict(tasks, **steps)
                for key, fetch in everything.items():   # warm up
                    sess.run(fetch, feed)
                for _ in range(repeats):
                    for key in ("norms", "clip"):
                        times["floor"].append(_time(sess, tasks["floor"],
                                                    feed))
                        times[key].append(_time(sess, tasks[key], feed))
                    for key in steps:
                        times[key].append(_time(sess, steps[key], feed))
                med = {k: statistics.median(v) for k, v in times.items()}
                # Peak memory: one traced step per fetch, after the timed
                # runs (benchmarks/memory.py: TF's allocation records). The
                # traced training steps apply one more update each.
                peak = {k: memory.step_peak_bytes(sess, fetch, feed)[0]
                        for k, fetch in everything.items()}
                row = {"model": name, "batch_size": batch,
                       "floor_ms": 1e3 * med["floor"],
                       "norms_ms": 1e3 * med["norms"],
                       "clip_ms": 1e3 * med["clip"],
                       "norms_ratio": med["norms"] / med["floor"],
                       "clip_ratio": med["clip"] / med["floor"],
                       "floor_peak_mb": memory.mb(peak["floor"]),
                       "norms_peak_mb": memory.mb(peak["norms"]),
                       "clip_peak_mb": memory.mb(peak["clip"]),
                       "norms_peak_ratio": _ratio(peak["norms"], peak["floor"]),
                       "clip_peak_ratio": _ratio(peak["clip"], peak["floor"]),
                       "not_rules": ["%s: %s" % (a.name, a.form)
                                     for a in plan.assignments
                                     if a.form not in ("rules", None)]}
                if steps:
                    row.update(step_orig_ms=1e3 * med["step_orig"],
                               step_dp_ms=1e3 * med["step_dp"],
                               step_ratio=med["step_dp"] / med["step_orig"],
                               step_orig_peak_mb=memory.mb(peak["step_orig"]),
                               step_dp_peak_mb=memory.mb(peak["step_dp"]),
                               step_peak_ratio=_ratio(peak["step_dp"], peak["step_orig"]))
                rows.append(row)
                print("%-28s B=%-4d floor %8.2f ms %8.2f MB  norms %6.2fx mem %5.2fx"
                      "  clip %6.2fx mem %5.2fx%s"
                      % (name, batch, row["floor_ms"], row["floor_peak_mb"],
                         row["norms_ratio"], row["norms_peak_ratio"],
                         row["clip_ratio"], row["clip_peak_ratio"],
                         "  DP step %.2fx mem %.2fx" % (row["step_ratio"],
                                                        row["step_peak_ratio"])
                         if steps else ""), flush=True)
    return rows


def _ratio(a, b):
    return a / float(b) if b else None


def _mem_cell(ratio, peak_mb):
    if ratio is None:
        return "-"
    return "%.2fx (%s MB)" % (ratio, "%.3g" % peak_mb if peak_mb < 1000 else "%.0f" % peak_mb)


def _markdown(rows, meta):
    lines = [
        "# Zoo benchmark (`python -m benchmarks --zoo`)", "",
        "Models written the way users write them (benchmarks/zoo_models.py, "
        "full size, float32, dynamic batch). Each ratio is a median of "
        "runs alternated with the aggregated gradient (floor) in the same "
        "process; the floor column is that same measurement. Memory: the "
        "step's peak bytes of live tensors from TF's allocation records "
        "(one traced step each; benchmarks/memory.py), as a ratio to the "
        "floor's peak (the DP step: to the original step's peak), with the "
        "peak in MB; variables and fed arrays are not in it.", "",
        "Machine: %s; TF %s; %d repeats; %d thread(s); load average "
        "(1 min) %s at the start, %s at the end." % (
            meta["machine"], meta["tf"], meta["repeats"], meta["threads"],
            meta.get("load_start", "?"), meta.get("load_end", "?")),
        "",
        "| model | B | floor ms | floor peak MB | norms | norms memory "
        "| clipped sum | clipped sum memory | DP step / original step "
        "| DP step memory | not on rules |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| %s | %d | %.2f | %s | %.2fx | %s | %.2fx | %s | %s | %s | %s |" % (
            r["model"], r["batch_size"], r["floor_ms"],
            "%.3g" % r["floor_peak_mb"] if r.get("floor_peak_mb") is not None else "-",
            r["norms_ratio"], _mem_cell(r.get("norms_peak_ratio"), r.get("norms_peak_mb")),
            r["clip_ratio"], _mem_cell(r.get("clip_peak_ratio"), r.get("clip_peak_mb")),
            "%.2fx (%.1f / %.1f ms)" % (r["step_ratio"], r["step_dp_ms"],
                                        r["step_orig_ms"])
            if "step_ratio" in r else "",
            _mem_cell(r.get("step_peak_ratio"), r.get("step_dp_peak_mb"))
            if "step_ratio" in r else "",
            ", ".join(r["not_rules"]) or "-"))
    return "\n".join(lines) + "\n"


def main(argv=None):
    from benchmarks import zoo_models
    p = argparse.ArgumentParser(
        prog="python -m benchmarks --zoo",
        description="Per-example norms, clipped sums and a DP step on the "
                    "model zoo, as ratios to the aggregated gradient.")
    p.add_argument("--models", default=",".join(zoo_models.ZOO),
                   help="comma list of zoo models (default: all)")
    p.add_argument("--batch-sizes", default="64,256",
                   help="comma list (default 64,256)")
    p.add_argument("--repeats", type=int, default=15,
                   help="timed runs per task (default 15)")
    p.add_argument("--threads", type=int, default=1,
                   help="TF intra/inter-op threads (default 1)")
    p.add_argument("--out", default=RESULTS, help="output folder")
    args = p.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    unknown = sorted(set(names) - set(zoo_models.ZOO))
    if unknown:
        p.error("unknown zoo model(s) %s; choose from %s"
                % (", ".join(unknown), ", ".join(zoo_models.ZOO)))
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    import platform
    import tensorflow as tf
    # Other processes on the machine move the ratios; the load says how much.
    load_start = "%.2f" % os.getloadavg()[0]
    rows = []
    for name in names:
        rows.extend(_bench_model(name, batches, args.repeats, args.threads))
    meta = {"machine": "%s, %d cores" % (platform.processor() or
                                         platform.machine(), os.cpu_count()),
            "tf": tf.__version__, "repeats": args.repeats,
            "threads": args.threads, "load_start": load_start,
            "load_end": "%.2f" % os.getloadavg()[0]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "zoo.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "zoo.md"), "w") as f:
        f.write(_markdown(rows, meta))
    print("wrote %s" % os.path.join(args.out, "zoo.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
