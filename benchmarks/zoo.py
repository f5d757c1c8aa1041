"""Graphs as users write them: the zoo and other people's TF1 models.

`python -m benchmarks --zoo` builds each model of `benchmarks.zoo_models`
at full size (`full=True`: MNIST's 28x28 images, the tutorials' layer
sizes) in float32 with a dynamic batch and measures, at each batch size:
norms (`custagg.per_example_norms`), the clipped sum
(`custagg.clipped_gradients(loss, xs, 1.0)`) and, for mnist_deep, one
DP-SGD step (`custagg.DPOptimizer` around Adam) against the tutorial's own
Adam step. Results: benchmarks/results/zoo.json and zoo.md.

`python -m benchmarks --tf1-models` (issue 24) does the same for the
clipped sum of each model of `benchmarks.tf1_models` at B=64 (a model whose
clipped sum fails at run time gets a row with its error); each row has the
plan's forms, `--plans` prints the plans. Results:
benchmarks/results/tf1_models.json and tf1_models.md.

`python -m benchmarks --zoo --profile [--models mnist_deep,cnn]
[--batch-sizes 64,256] [--times]` (issue 26) profiles where the peak memory
of norms, clipped sums and a DP step comes from (zoo models, or the
harness's `cnn`, `mlp`, `text`): one traced step of each fetch, its peak, its
ratio to the floor's and the tensors live at the peak, largest first; with
`--times` also each traced step's kernel time by op (mean of 3). Memory
figures do not depend on the machine's load; it writes no results file.

All: one process, every run of a task next to a run of its floor (the
aggregated gradient, `tf.compat.v1.gradients(reduce_sum(loss))`), medians
over `--repeats`; peak memory from one traced step each
(benchmarks/memory.py). Every result is fetched (TF prunes what is not).
The machine's load moves the ratios: the tables record it.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402



def _measure(sess, floor, fetches, feed, repeats, steps=None):
    """({name: median s}, {name: peak bytes}) of `fetches` (each run next
    to a run of `floor`) and `steps` (training steps, timed alone), with
    "floor" among them; one warm-up run each first, one traced step each
    after (the traced training steps apply one more update)."""
    from benchmarks import memory
    steps = steps or {}
    everything = dict(fetches, floor=floor, **steps)
    for fetch in everything.values():
        sess.run(fetch, feed)
    times = {k: [] for k in everything}

    def timed(key):
        start = time.perf_counter()
        sess.run(everything[key], feed)
        times[key].append(time.perf_counter() - start)

    for _ in range(repeats):
        for key in fetches:
            timed("floor")
            timed(key)
        for key in steps:
            timed(key)
    med = {k: statistics.median(v) for k, v in times.items()}
    peak = {k: memory.step_peak_bytes(sess, f, feed)[0] for k, f in everything.items()}
    return med, peak


HARNESS_MODELS = ("cnn", "mlp", "text")   # --profile builds these too


def build(name):
    """(loss, xs, feed(batch)) of zoo model `name` at full size (or, for
    --profile, a harness model) in float32 with a dynamic batch, in the
    default graph."""
    import tensorflow as tf
    if name in HARNESS_MODELS:
        from benchmarks import models
        x, y = models.tf_placeholders(name, None, dynamic=True)
        variables, xs = models.tf_variables(name)

        def feed(batch):
            return dict(zip((x, y), models.make_batch(name, batch)))
        return models.tf_loss(name, variables, x, y), xs, feed
    from benchmarks import zoo_models
    tf.compat.v1.set_random_seed(3)
    model = zoo_models.ZOO[name](tf.float32, np.random.default_rng(3), full=True)
    return model.loss, model.xs, lambda batch: model.feed(np.random.default_rng(batch), batch)


def fetches(loss, xs, dp_step):
    """The floor (the aggregated gradient), norms, clipped sum and, with
    `dp_step`, common.adam_step_pair's plain and DP steps."""
    import tensorflow as tf
    import custagg
    from benchmarks import common
    out = {"floor": tf.compat.v1.gradients(tf.reduce_sum(loss), xs),
           "norms": custagg.per_example_norms(loss, xs),
           "clip": custagg.clipped_gradients(loss, xs, 1.0)}
    return dict(out, **(common.adam_step_pair(loss, xs) if dp_step else {}))


def _bench_model(name, batch_sizes, repeats, threads):
    """Zoo rows of model `name`, one per batch size."""
    import tensorflow as tf
    import custagg
    from benchmarks import common, memory

    rows = []
    graph = tf.Graph()
    with graph.as_default():
        loss, xs, model_feed = build(name)
        plan = custagg.plan_per_example(loss, xs)
        tasks = fetches(loss, xs, name == "mnist_deep")
        floor = tasks.pop("floor")
        steps = {k: tasks.pop(k) for k in ("step_orig", "step_dp") if k in tasks}
        with common.session(graph, threads) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for batch in batch_sizes:
                feed = model_feed(batch)
                med, peak = _measure(sess, floor, tasks, feed, repeats, steps)
                row = {"model": name, "batch_size": batch, "floor_ms": 1e3 * med["floor"],
                       "floor_peak_mb": memory.mb(peak["floor"]),
                       "not_rules": ["%s: %s" % (a.name, a.form) for a in plan.assignments
                                     if a.form not in ("rules", None)]}
                for key in tasks:
                    row.update({key + "_ms": 1e3 * med[key],
                                key + "_ratio": med[key] / med["floor"],
                                key + "_peak_mb": memory.mb(peak[key]),
                                key + "_peak_ratio": _ratio(peak[key], peak["floor"])})
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


def plan_forms(plan):
    """`{form: count}` of a plan, most common first ("rules": 5, ...)."""
    counts = collections.Counter(f or "unconnected" for f in plan.forms())
    return collections.OrderedDict(counts.most_common())


def bench_model(name, batch, repeats, threads, full=True, print_plan=False):
    """One TF1-models row (a dict) for model `name` at batch size `batch`."""
    import tensorflow as tf
    import custagg
    from benchmarks import common, memory, tf1_models

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(3)
        build_model = tf1_models.MODELS.get(name) or tf1_models.DYNAMIC_MODELS[name]
        model = build_model(tf.float32, np.random.default_rng(3), full=full)
        loss, xs = model.loss, model.xs
        build = time.perf_counter()
        plan = custagg.plan_per_example(loss, xs)
        if print_plan:
            print(plan, flush=True)
        floor = tf.compat.v1.gradients(tf.reduce_sum(loss), xs)
        clip = custagg.clipped_gradients(loss, xs, 1.0)
        row = {"model": name, "batch_size": batch, "variables": len(xs),
               "forms": plan_forms(plan), "build_s": time.perf_counter() - build,
               "coupled": len(model.coupled)}
        with common.session(graph, threads) as sess:
            sess.run(tf1_models.initializer())
            feed = model.feed(np.random.default_rng(batch), batch)
            try:
                sess.run(clip, feed)            # a failure shows here
            except tf.errors.OpError as e:
                row["error"] = "%s: %s" % (type(e).__name__, _first_line(e.message))
                return row
            med, peak = _measure(sess, floor, {"clip": clip}, feed, repeats)
    row.update(floor_ms=1e3 * med["floor"], clip_ms=1e3 * med["clip"],
               clip_ratio=med["clip"] / med["floor"],
               floor_peak_mb=memory.mb(peak["floor"]), clip_peak_mb=memory.mb(peak["clip"]),
               clip_peak_ratio=_ratio(peak["clip"], peak["floor"]))
    return row


def _first_line(message):
    """The line of a TF error saying what failed (a graph execution error's
    first line is only "Graph execution error:")."""
    lines = [l.strip() for l in message.strip().split("\n") if l.strip()]
    for line in lines:
        if "assertion failed" in line or "custagg" in line:
            return line[:300]
    return lines[-1][:300] if lines else ""


def _ratio(a, b):
    return a / float(b) if b else None


def _mem_cell(ratio, peak_mb):
    if ratio is None:
        return "-"
    return "%.2fx (%s MB)" % (ratio, "%.3g" % peak_mb if peak_mb < 1000 else "%.0f" % peak_mb)


def _forms_cell(forms):
    return ", ".join("%s %d" % kv for kv in forms.items())


def describe_row(row):
    """The one line printed per TF1 model."""
    if "error" in row:
        return "%-20s B=%-4d ERROR %s  [%s]" % (row["model"], row["batch_size"], row["error"],
                                                _forms_cell(row["forms"]))
    return ("%-20s B=%-4d floor %8.2f ms %8.2f MB  clip %6.2fx mem %5.2fx  [%s]"
            % (row["model"], row["batch_size"], row["floor_ms"], row["floor_peak_mb"] or 0.0,
               row["clip_ratio"], row["clip_peak_ratio"] or 0.0, _forms_cell(row["forms"])))


def _machine_line(meta, tail=""):
    return ("Machine: %s; TF %s; %d repeats; %d thread(s); load average (1 min) %s at the "
            "start, %s at the end%s." % (meta["machine"], meta["tf"], meta["repeats"],
                                         meta["threads"], meta.get("load_start", "?"),
                                         meta.get("load_end", "?"), tail))


def _markdown(rows, meta):
    """zoo.md."""
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
        _machine_line(meta), "",
        "| model | B | floor ms | floor peak MB | norms | norms memory "
        "| clipped sum | clipped sum memory | DP step / original step "
        "| DP step memory | not on rules |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        step = "step_ratio" in r
        lines.append("| %s | %d | %.2f | %s | %.2fx | %s | %.2fx | %s | %s | %s | %s |" % (
            r["model"], r["batch_size"], r["floor_ms"],
            "%.3g" % r["floor_peak_mb"] if r.get("floor_peak_mb") is not None else "-",
            r["norms_ratio"], _mem_cell(r.get("norms_peak_ratio"), r.get("norms_peak_mb")),
            r["clip_ratio"], _mem_cell(r.get("clip_peak_ratio"), r.get("clip_peak_mb")),
            "%.2fx (%.1f / %.1f ms)" % (r["step_ratio"], r["step_dp_ms"], r["step_orig_ms"])
            if step else "",
            _mem_cell(r.get("step_peak_ratio"), r.get("step_dp_peak_mb")) if step else "",
            ", ".join(r["not_rules"]) or "-"))
    return "\n".join(lines) + "\n"


def markdown(rows, meta):
    """tf1_models.md."""
    lines = [
        "# Other people's TF1 models (`python -m benchmarks --tf1-models`)", "",
        "Issue 24's yardstick: the models of benchmarks/tf1_models.py (%s "
        "size, float32, dynamic batch and sequence length). Clipped sum "
        "(`custagg.clipped_gradients`, strategy \"auto\") against the "
        "aggregated gradient of the same model (floor), same process; time: "
        "median of runs alternated with the floor; memory: the step's peak "
        "bytes of live tensors (one traced step each; benchmarks/memory.py). "
        "Forms: how many variables the plan puts on each form."
        % meta.get("size", "full"), "", _machine_line(meta, ": indicative only"), "",
        "| model | B | floor ms | clipped sum | floor peak MB | clipped sum "
        "memory | variables | forms |",
        "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append("| %s | %d | - | error: %s | - | - | %d | %s |" % (
                r["model"], r["batch_size"], r["error"].replace("|", "/"),
                r["variables"], _forms_cell(r["forms"])))
            continue
        lines.append("| %s | %d | %.2f | %.2fx (%.1f ms) | %s | %s | %d | %s |" % (
            r["model"], r["batch_size"], r["floor_ms"], r["clip_ratio"], r["clip_ms"],
            "%.3g" % r["floor_peak_mb"] if r["floor_peak_mb"] is not None else "-",
            _mem_cell(r["clip_peak_ratio"], r["clip_peak_mb"])
            if r["clip_peak_ratio"] is not None else "-",
            r["variables"], _forms_cell(r["forms"])))
    return "\n".join(lines) + "\n"


def op_times(step_stats):
    """Milliseconds per op of a traced step: each kernel's own time
    (`op_end_rel_micros`), a Counter of (name, type)."""
    times = collections.Counter()
    for dev in step_stats.dev_stats:
        for node in dev.node_stats:
            op_type = node.timeline_label.split(" = ")[-1].split("(")[0]
            times[(node.node_name, op_type)] += node.op_end_rel_micros / 1e3
    return times


def profile(name, batch_sizes, top=8, times=False):
    """--profile: prints, per batch size and fetch, the traced step's peak
    and the tensors live at it (with `times`, also where its kernel time
    goes: a profile for ratios inside one process, not a benchmark).
    Returns {(batch, fetch name): peak bytes}."""
    import tensorflow as tf
    from benchmarks import common, memory
    found = {}
    graph = tf.Graph()
    with graph.as_default():
        loss, xs, feed = build(name)
        fetch_of = fetches(loss, xs, name in ("mnist_deep", "cnn", "mlp"))
        with common.session(graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for batch in batch_sizes:
                fd = feed(batch)
                for key, fetch in fetch_of.items():
                    sess.run(fetch, fd)                      # warm up
                    stats = memory.traced_step_stats(sess, fetch, fd)
                    found[(batch, key)] = peak = memory.peak_from_step_stats(stats)[0]
                    base = "floor" if not key.startswith("step") else "step_orig"
                    print("%s B=%d %-9s peak %8.2f MB  %.2fx %s" % (
                        name, batch, key, peak / 1e6, peak / float(found[(batch, base)]),
                        base), flush=True)
                    for nbytes, node, op_type in memory.live_at_peak(stats)[:top]:
                        print("    %8.2f MB  %-16s %s" % (nbytes / 1e6, op_type, node))
                    if not times:
                        continue
                    total = op_times(stats)
                    for _ in range(2):
                        total.update(op_times(memory.traced_step_stats(sess, fetch, fd)))
                    by_type = collections.Counter()
                    for (_, op_type), ms in total.items():
                        by_type[op_type] += ms / 3
                    print("%s B=%d %-9s kernel time %.1f ms (traced, mean of 3): by type %s"
                          % (name, batch, key, sum(by_type.values()), ", ".join(
                              "%s %.1f" % kv for kv in by_type.most_common(top))))
                    for (node, op_type), ms in total.most_common(top):
                        print("    %8.2f ms  %-16s %s" % (ms / 3, op_type, node))
    return found


def main(argv=None, suite="zoo"):
    """`suite`: "zoo" (`--zoo`) or "tf1_models" (`--tf1-models`)."""
    from benchmarks import tf1_models, zoo_models
    zoo = suite == "zoo"
    registry = zoo_models.ZOO if zoo else tf1_models.MODELS
    p = argparse.ArgumentParser(
        prog="python -m benchmarks " + ("--zoo" if zoo else "--tf1-models"),
        description="Per-example norms, clipped sums and a DP step on the model zoo"
        if zoo else "The clipped sum on issue 24's TF1 models, as a ratio to the "
        "aggregated gradient (time and peak memory).")
    p.add_argument("--models", default=",".join(registry), help="comma list (default: all)")
    if zoo:
        p.add_argument("--batch-sizes", default="64,256", help="comma list (default 64,256)")
        p.add_argument("--profile", action="store_true", help="where each step's peak memory "
                       "comes from (default models mnist_deep,cnn; also %s)"
                       % ",".join(HARNESS_MODELS))
        p.add_argument("--times", action="store_true",
                       help="--profile: also the traced steps' kernel time by op")
    else:
        p.add_argument("--batch-size", type=int, default=64, help="B (default 64)")
        p.add_argument("--plans", action="store_true", help="print each model's plan")
    p.add_argument("--repeats", type=int, default=15 if zoo else 5,
                   help="timed runs per task (default %d)" % (15 if zoo else 5))
    p.add_argument("--threads", type=int, default=1, help="TF intra/inter-op threads (1)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"),
                   help="output folder")
    args = p.parse_args(argv)
    if zoo and args.profile:
        registry = list(registry) + list(HARNESS_MODELS)
        if args.models == ",".join(zoo_models.ZOO):
            args.models = "mnist_deep,cnn"
    names = [m for m in args.models.split(",") if m]
    # The default is `registry`; issue 34's dynamic-shape models are asked
    # for by name (`--models unet,ctc_lstm,...`).
    known = list(registry) if zoo else list(registry) + list(tf1_models.DYNAMIC_MODELS)
    unknown = sorted(set(names) - set(known))
    if unknown:
        p.error("unknown model(s) %s; choose from %s" % (", ".join(unknown), ", ".join(known)))
    if args.repeats < 1 or (not zoo and args.batch_size < 1):
        p.error("--batch-size and --repeats must be at least 1")
    import tensorflow as tf
    if not zoo:
        tf.compat.v1.disable_eager_execution()
    elif args.profile:
        for name in names:
            profile(name, [int(b) for b in args.batch_sizes.split(",") if b], times=args.times)
        return 0
    load_start = "%.2f" % os.getloadavg()[0]
    rows = []
    for name in names:
        if zoo:
            rows.extend(_bench_model(name, [int(b) for b in args.batch_sizes.split(",") if b],
                                     args.repeats, args.threads))
        else:
            rows.append(bench_model(name, args.batch_size, args.repeats, args.threads,
                                    print_plan=args.plans))
            print(describe_row(rows[-1]), flush=True)
    meta = {"machine": "%s, %d cores" % (platform.processor() or platform.machine(),
                                         os.cpu_count()),
            "tf": tf.__version__, "repeats": args.repeats, "threads": args.threads,
            "load_start": load_start, "load_end": "%.2f" % os.getloadavg()[0]}
    from benchmarks import common
    common.write_outputs(suite, {"meta": meta, "rows": rows},
                         (_markdown if zoo else markdown)(rows, meta), args.out)
    print("wrote %s" % os.path.join(args.out, suite + ".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
