"""Issue 24's benchmark: the clipped sum on other people's TF1 models.

`python -m benchmarks --tf1-models` (or `python -m benchmarks.tf1_bench`)
builds each model of `benchmarks.tf1_models` at full size (`full=True`) in
float32 with a dynamic batch (and sequence length), and measures at B=64,
in one process, alternating with the floor:

* floor: the aggregated gradient, `tf.compat.v1.gradients(reduce_sum(loss))`;
* clip: `custagg.clipped_gradients(loss, xs, 1.0)` (strategy "auto");

time (medians over `--repeats` runs, each run of the clipped sum next to a
run of its floor) and peak memory (one traced step each,
benchmarks/memory.py), as ratios to the floor. Every result is fetched (TF
prunes what is not). A model whose clipped sum fails at run time gets a row
with the error instead of figures. Each row also has the plan's forms
(how many variables on rules, on copies, on the O(B^2) whole pass);
`--plans` prints `str(plan)` for each model.

Results go to `benchmarks/results/tf1_models.json` and `tf1_models.md`.
The machine's load moves the ratios: the table records it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
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


def plan_forms(plan):
    """`{form: count}` of a plan, most common first ("rules": 5, ...)."""
    counts = collections.Counter(f or "unconnected" for f in plan.forms())
    return collections.OrderedDict(counts.most_common())


def bench_model(name, batch, repeats, threads, full=True, print_plan=False):
    """One row (a dict) for model `name` at batch size `batch`."""
    import tensorflow as tf
    import custagg
    from benchmarks import memory, tf1_models

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(3)
        rng = np.random.default_rng(3)
        model = tf1_models.MODELS[name](tf.float32, rng, full=full)
        loss, xs = model.loss, model.xs
        build = time.perf_counter()
        plan = custagg.plan_per_example(loss, xs)
        if print_plan:
            print(plan, flush=True)
        floor = tf.compat.v1.gradients(tf.reduce_sum(loss), xs)
        clip = custagg.clipped_gradients(loss, xs, 1.0)
        build = time.perf_counter() - build
        row = {"model": name, "batch_size": batch, "variables": len(xs),
               "forms": plan_forms(plan), "build_s": build,
               "coupled": len(model.coupled)}
        config = tf.compat.v1.ConfigProto(
            intra_op_parallelism_threads=threads,
            inter_op_parallelism_threads=threads)
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            sess.run(tf1_models.initializer())
            feed = model.feed(np.random.default_rng(batch), batch)
            sess.run(floor, feed)
            try:
                sess.run(clip, feed)            # warm-up; a failure shows here
            except tf.errors.OpError as e:
                row["error"] = "%s: %s" % (type(e).__name__,
                                           _first_line(e.message))
                return row
            times = {"floor": [], "clip": []}
            for _ in range(repeats):
                times["floor"].append(_time(sess, floor, feed))
                times["clip"].append(_time(sess, clip, feed))
            med = {k: statistics.median(v) for k, v in times.items()}
            peak = {"floor": memory.step_peak_bytes(sess, floor, feed)[0],
                    "clip": memory.step_peak_bytes(sess, clip, feed)[0]}
    row.update(floor_ms=1e3 * med["floor"], clip_ms=1e3 * med["clip"],
               clip_ratio=med["clip"] / med["floor"],
               floor_peak_mb=memory.mb(peak["floor"]),
               clip_peak_mb=memory.mb(peak["clip"]),
               clip_peak_ratio=(peak["clip"] / float(peak["floor"])
                                if peak["floor"] else None))
    return row


def _first_line(message):
    """The line of a TF error saying what failed (a graph execution error's
    first line is only "Graph execution error:")."""
    lines = [l.strip() for l in message.strip().split("\n") if l.strip()]
    for line in lines:
        if "assertion failed" in line or "custagg" in line:
            return line[:300]
    return lines[-1][:300] if lines else ""


def _forms_cell(forms):
    return ", ".join("%s %d" % kv for kv in forms.items())


def describe_row(row):
    """The one line printed per model."""
    if "error" in row:
        return "%-20s B=%-4d ERROR %s  [%s]" % (
            row["model"], row["batch_size"], row["error"],
            _forms_cell(row["forms"]))
    return ("%-20s B=%-4d floor %8.2f ms %8.2f MB  clip %6.2fx mem %5.2fx"
            "  [%s]" % (row["model"], row["batch_size"], row["floor_ms"],
                        row["floor_peak_mb"] or 0.0, row["clip_ratio"],
                        row["clip_peak_ratio"] or 0.0,
                        _forms_cell(row["forms"])))


def markdown(rows, meta):
    lines = [
        "# Other people's TF1 models (`python -m benchmarks --tf1-models`)",
        "",
        "Issue 24's yardstick: the models of benchmarks/tf1_models.py (%s "
        "size, float32, dynamic batch and sequence length). Clipped sum "
        "(`custagg.clipped_gradients`, strategy \"auto\") against the "
        "aggregated gradient of the same model (floor), same process; time: "
        "median of runs alternated with the floor; memory: the step's peak "
        "bytes of live tensors (one traced step each; benchmarks/memory.py). "
        "Forms: how many variables the plan puts on each form."
        % meta.get("size", "full"), "",
        "Machine: %s; TF %s; %d repeats; %d thread(s); load average (1 min) "
        "%s at the start, %s at the end: indicative only." % (
            meta["machine"], meta["tf"], meta["repeats"], meta["threads"],
            meta.get("load_start", "?"), meta.get("load_end", "?")),
        "",
        "| model | B | floor ms | clipped sum | floor peak MB | clipped sum "
        "memory | variables | forms |",
        "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append("| %s | %d | - | error: %s | - | - | %d | %s |" % (
                r["model"], r["batch_size"], r["error"].replace("|", "/"),
                r["variables"], _forms_cell(r["forms"])))
            continue
        lines.append("| %s | %d | %.2f | %.2fx (%.1f ms) | %s | %s | %d | %s |"
                     % (r["model"], r["batch_size"], r["floor_ms"],
                        r["clip_ratio"], r["clip_ms"],
                        "%.3g" % r["floor_peak_mb"]
                        if r["floor_peak_mb"] is not None else "-",
                        "%.2fx (%.3g MB)" % (r["clip_peak_ratio"],
                                             r["clip_peak_mb"])
                        if r["clip_peak_ratio"] is not None else "-",
                        r["variables"], _forms_cell(r["forms"])))
    return "\n".join(lines) + "\n"


def main(argv=None):
    from benchmarks import tf1_models
    p = argparse.ArgumentParser(
        prog="python -m benchmarks --tf1-models",
        description="The clipped sum on issue 24's TF1 models, as a ratio "
                    "to the aggregated gradient (time and peak memory).")
    p.add_argument("--models", default=",".join(tf1_models.MODELS),
                   help="comma list (default: all)")
    p.add_argument("--batch-size", type=int, default=64,
                   help="B (default 64)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed runs of each (default 5)")
    p.add_argument("--threads", type=int, default=1,
                   help="TF intra/inter-op threads (default 1)")
    p.add_argument("--plans", action="store_true",
                   help="print each model's per-example plan")
    p.add_argument("--small", action="store_true",
                   help="the tests' small sizes (a smoke run), not full size")
    p.add_argument("--out", default=RESULTS, help="output folder")
    args = p.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    unknown = sorted(set(names) - set(tf1_models.MODELS))
    if unknown:
        p.error("unknown model(s) %s; choose from %s"
                % (", ".join(unknown), ", ".join(tf1_models.MODELS)))
    if args.batch_size < 1 or args.repeats < 1:
        p.error("--batch-size and --repeats must be at least 1")
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    load_start = "%.2f" % os.getloadavg()[0]
    rows = []
    for name in names:
        row = bench_model(name, args.batch_size, args.repeats, args.threads,
                          full=not args.small, print_plan=args.plans)
        print(describe_row(row), flush=True)
        rows.append(row)
    meta = {"machine": "%s, %d cores" % (platform.processor() or
                                         platform.machine(), os.cpu_count()),
            "tf": tf.__version__, "repeats": args.repeats,
            "threads": args.threads, "load_start": load_start,
            "load_end": "%.2f" % os.getloadavg()[0],
            "size": "small" if args.small else "full"}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tf1_models.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "tf1_models.md"), "w") as f:
        f.write(markdown(rows, meta))
    print("wrote %s" % os.path.join(args.out, "tf1_models.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
