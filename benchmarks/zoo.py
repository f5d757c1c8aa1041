"""Graphs as users write them: `python -m benchmarks --zoo` and `--tf1-models`.

`--zoo`: each `benchmarks.zoo_models` model at full size (float32, dynamic
batch): per-example norms, the clipped sum and, for mnist_deep, a DP step
(`DPOptimizer` around Adam) against the tutorial's Adam step; results/zoo.*.
`--tf1-models` (issue 24): the clipped sum of each `benchmarks.tf1_models`
model at B=64 (a run-time failure gets a row with its error) and the plan's
forms; `--plans` prints the plans; results/tf1_models.*. `--zoo --profile
[--times]` (issue 26): the tensors live at each step's peak (and its kernel
time by op); no results file. How each figure is measured:
docs/benchmarks.md.
"""

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

HARNESS_MODELS = ("cnn", "mlp", "text")   # --profile builds these too


def builders():
    """name -> builder `(dtype, rng, full)`: the zoo, then the TF1 models
    (static shapes, then issue 34's dynamic ones)."""
    from benchmarks import tf1_models, zoo_models
    out = collections.OrderedDict(zoo_models.ZOO)
    for table in (tf1_models.MODELS, tf1_models.DYNAMIC_MODELS):
        for name, build_model in table.items():
            out.setdefault(name, build_model)
    return out


def build(name, full=True):
    """(loss `[B]`, xs, feed(batch) -> feed dict, coupled variable names) of
    model `name` (a builder's, or a harness model of HARNESS_MODELS) in
    float32 with a dynamic batch, in the default graph."""
    import tensorflow as tf
    if name in HARNESS_MODELS:
        from benchmarks import models
        x, y = models.tf_placeholders(name, None, dynamic=True)
        variables, xs = models.tf_variables(name)
        return (models.tf_loss(name, variables, x, y), xs,
                lambda batch: dict(zip((x, y), models.make_batch(name, batch))), ())
    tf.compat.v1.set_random_seed(3)
    model = builders()[name](tf.float32, np.random.default_rng(3), full=full)
    return (model.loss, model.xs,
            lambda batch: model.feed(np.random.default_rng(batch), batch), model.coupled)


def fetches(loss, xs, tasks=("norms", "clip"), dp_step=False):
    """{"floor": the aggregated gradient, "norms", "clip": the clipped sum
    (C = 1) of `tasks`} and, with `dp_step`, "step_orig" (Adam on the mean
    loss) and "step_dp" (DPOptimizer around Adam, C = 1, sigma = 1.1), each in
    a variable scope of its own (their Adam slots apart)."""
    import tensorflow as tf
    import custagg
    out = {"floor": tf.compat.v1.gradients(tf.reduce_sum(loss), xs)}
    if "norms" in tasks:
        out["norms"] = custagg.per_example_norms(loss, xs)
    if "clip" in tasks:
        out["clip"] = custagg.clipped_gradients(loss, xs, 1.0)
    if dp_step:
        with tf.compat.v1.variable_scope("orig"):
            out["step_orig"] = tf.compat.v1.train.AdamOptimizer(1e-4).minimize(
                tf.reduce_mean(loss), var_list=xs)
        with tf.compat.v1.variable_scope("dp"):
            out["step_dp"] = custagg.DPOptimizer(
                tf.compat.v1.train.AdamOptimizer(1e-4), l2_norm_clip=1.0,
                noise_multiplier=1.1).minimize(loss, var_list=xs)
    return out


def _measure(sess, floor, tasks, feed, repeats, steps=None):
    """({name: median s}, {name: peak bytes}) of `tasks` (each run next to a
    run of `floor`) and `steps` (training steps, timed alone), "floor" among
    them; one warm-up run each first, one traced step each after (a traced
    training step applies one more update)."""
    from benchmarks import memory
    everything = dict(tasks, floor=floor, **(steps or {}))
    for fetch in everything.values():
        sess.run(fetch, feed)
    times = {k: [] for k in everything}

    def timed(key):
        start = time.perf_counter()
        sess.run(everything[key], feed)
        times[key].append(time.perf_counter() - start)

    for _ in range(repeats):
        for key in tasks:
            timed("floor")
            timed(key)
        for key in steps or {}:
            timed(key)
    return ({k: statistics.median(v) for k, v in times.items()},
            {k: memory.step_peak_bytes(sess, f, feed)[0] for k, f in everything.items()})


def bench_model(name, batch_sizes, repeats, threads=1, tasks=("norms", "clip"),
                dp_step=False, full=True, print_plan=False, detail=False):
    """Rows of model `name`, one per batch size: for each of `tasks`
    `<task>_ms`, `_ratio` (to the floor), `_peak_mb`, `_peak_ratio`; with
    `dp_step` the `step_*` fields (DP step over the plain step); the plan's
    `forms` and the variables `not_rules`. A run-time failure gives the row
    `error` instead of figures. `detail`: also `plan` (its text) and `norms`
    (the per-example norms), for benchmarks.before_after."""
    import tensorflow as tf
    import custagg
    from benchmarks import common, memory, tf1_models
    rows = []
    graph = tf.Graph()
    with graph.as_default():
        loss, xs, feed_of, coupled = build(name, full)
        t0 = time.perf_counter()
        plan = custagg.plan_per_example(loss, xs)
        if print_plan:
            print(plan, flush=True)
        timed = fetches(loss, xs, tasks, dp_step)
        build_s = time.perf_counter() - t0
        floor = timed.pop("floor")
        steps = {k: timed.pop(k) for k in ("step_orig", "step_dp") if k in timed}
        forms = collections.Counter(f or "unconnected" for f in plan.forms())
        with common.session(graph, threads) as sess:
            sess.run(tf1_models.initializer())
            for batch in batch_sizes:
                feed = feed_of(batch)
                row = {"model": name, "batch_size": batch, "variables": len(xs),
                       "forms": collections.OrderedDict(forms.most_common()),
                       "build_s": build_s, "coupled": len(coupled),
                       "not_rules": ["%s: %s" % (a.name, a.form) for a in plan.assignments
                                     if a.form not in ("rules", None)]}
                rows.append(row)
                try:
                    values = sess.run(timed, feed)            # a failure shows here
                except tf.errors.OpError as e:
                    row["error"] = "%s: %s" % (type(e).__name__, _first_line(e.message))
                    print(describe_row(row), flush=True)
                    continue
                med, peak = _measure(sess, floor, timed, feed, repeats, steps)
                row.update(floor_ms=1e3 * med["floor"], floor_peak_mb=memory.mb(peak["floor"]))
                pairs = [(k, k, "floor") for k in timed]
                pairs += [("step", "step_dp", "step_orig")] if steps else []
                for field, key, base in pairs:
                    row.update({field + "_ratio": med[key] / med[base],
                                field + "_peak_ratio": _ratio(peak[key], peak[base])})
                for key in list(timed) + list(steps):
                    row.update({key + "_ms": 1e3 * med[key], key + "_peak_mb": memory.mb(peak[key])})
                if detail:
                    row.update(plan=str(plan), norms=[float(v) for v in np.ravel(
                        values.get("norms", []))])
                print(describe_row(row), flush=True)
    return rows


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


def describe_row(row):
    """The one line printed per model and batch size."""
    head = "%-28s B=%-4d" % (row["model"], row["batch_size"])
    forms = "[%s]" % _forms_cell(row)
    if "error" in row:
        return "%s ERROR %s  %s" % (head, row["error"], forms)
    tasks = "  ".join("%s %.2fx mem %.2fx" % (k, row[k + "_ratio"], row[k + "_peak_ratio"] or 0)
                      for k in ("norms", "clip", "step") if k + "_ratio" in row)
    return "%s floor %8.2f ms %8.2f MB  %s  %s" % (
        head, row["floor_ms"], row["floor_peak_mb"] or 0.0, tasks, forms)


def _mem_cell(r, key, peak_key):
    ratio, peak_mb = r.get(key), r.get(peak_key)
    if ratio is None:
        return "-"
    return "%.2fx (%s MB)" % (ratio, "%.3g" % peak_mb if peak_mb < 1000 else "%.0f" % peak_mb)


def _forms_cell(r):
    return ", ".join("%s %d" % kv for kv in r["forms"].items())


def _table(title, intro, meta, columns, rows):
    """A results page: `title`, `intro`, the machine line, then a table of
    `columns` [(header, fn(row) -> cell)] with a row per `rows`."""
    return "\n".join([
        "# " + title, "", intro, "",
        "Machine: %s; TF %s; %d repeats; %d thread(s); load average (1 min) %s at the start, "
        "%s at the end." % (meta["machine"], meta["tf"], meta["repeats"], meta["threads"],
                            meta.get("load_start", "?"), meta.get("load_end", "?")), "",
        "| %s |" % " | ".join(h for h, _ in columns), "|%s|" % "|".join(["---"] * len(columns))]
        + ["| %s |" % " | ".join(fn(r) for _, fn in columns) for r in rows]) + "\n"


def _peak_mb(r):
    return "%.3g" % r["floor_peak_mb"] if r.get("floor_peak_mb") is not None else "-"


def _markdown(rows, meta):
    """zoo.md."""
    def step(fn):
        return lambda r: fn(r) if "step_ratio" in r else ""
    return _table(
        "Zoo benchmark (`python -m benchmarks --zoo`)",
        "Models written the way users write them (benchmarks/zoo_models.py, full size, "
        "float32, dynamic batch). Each ratio is a median of runs alternated with the "
        "aggregated gradient (floor) in the same process. Memory: the step's peak bytes of "
        "live tensors (TF's allocation records of one traced step, benchmarks/memory.py) over "
        "the floor's (the DP step: over the original step's), then the peak in MB.", meta,
        [("model", lambda r: r["model"]), ("B", lambda r: "%d" % r["batch_size"]),
         ("floor ms", lambda r: "%.2f" % r["floor_ms"]), ("floor peak MB", _peak_mb),
         ("norms", lambda r: "%.2fx" % r["norms_ratio"]),
         ("norms memory", lambda r: _mem_cell(r, "norms_peak_ratio", "norms_peak_mb")),
         ("clipped sum", lambda r: "%.2fx" % r["clip_ratio"]),
         ("clipped sum memory", lambda r: _mem_cell(r, "clip_peak_ratio", "clip_peak_mb")),
         ("DP step / original step", step(lambda r: "%.2fx (%.1f / %.1f ms)" % (
             r["step_ratio"], r["step_dp_ms"], r["step_orig_ms"]))),
         ("DP step memory", step(lambda r: _mem_cell(r, "step_peak_ratio", "step_dp_peak_mb"))),
         ("not on rules", lambda r: ", ".join(r["not_rules"]) or "-")], rows)


def markdown(rows, meta):
    """tf1_models.md."""
    def ok(fn):
        return lambda r: "-" if "error" in r else fn(r)
    return _table(
        "Other people's TF1 models (`python -m benchmarks --tf1-models`)",
        "Issue 24's yardstick: the models of benchmarks/tf1_models.py (%s size, float32, "
        "dynamic batch and sequence length). The clipped sum (`custagg.clipped_gradients`, "
        "strategy \"auto\") against the aggregated gradient (floor), same process: time, a "
        "median of runs alternated with the floor; memory, the step's peak bytes of live "
        "tensors (benchmarks/memory.py). Forms: variables per form of the plan; indicative "
        "only." % meta.get("size", "full"), meta,
        [("model", lambda r: r["model"]), ("B", lambda r: "%d" % r["batch_size"]),
         ("floor ms", ok(lambda r: "%.2f" % r["floor_ms"])),
         ("clipped sum", lambda r: "error: " + r["error"].replace("|", "/") if "error" in r
          else "%.2fx (%.1f ms)" % (r["clip_ratio"], r["clip_ms"])),
         ("floor peak MB", ok(_peak_mb)),
         ("clipped sum memory", ok(lambda r: _mem_cell(r, "clip_peak_ratio", "clip_peak_mb"))),
         ("variables", lambda r: "%d" % r["variables"]), ("forms", _forms_cell)], rows)


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
        loss, xs, feed, _ = build(name)
        fetch_of = fetches(loss, xs, dp_step=name in ("mnist_deep", "cnn", "mlp"))
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
    from benchmarks import common, tf1_models, zoo_models
    zoo = suite == "zoo"
    registry = list(zoo_models.ZOO if zoo else tf1_models.MODELS)
    p = argparse.ArgumentParser(
        prog="python -m benchmarks " + ("--zoo" if zoo else "--tf1-models"),
        description="Per-example norms, clipped sums and a DP step on the model zoo" if zoo
        else "The clipped sum on issue 24's TF1 models over the aggregated gradient.")
    p.add_argument("--models", default=",".join(registry), help="comma list (default: all)")
    p.add_argument("--batch-sizes", default="64,256" if zoo else "64",
                   help="comma list (default %s)" % ("64,256" if zoo else "64"))
    if zoo:
        p.add_argument("--profile", action="store_true", help="where each step's peak memory "
                       "comes from (default models mnist_deep,cnn; also %s)"
                       % ",".join(HARNESS_MODELS))
        p.add_argument("--times", action="store_true",
                       help="--profile: also the traced steps' kernel time by op")
    else:
        p.add_argument("--plans", action="store_true", help="print each model's plan")
    p.add_argument("--repeats", type=int, default=15 if zoo else 5,
                   help="timed runs per task (default %d)" % (15 if zoo else 5))
    p.add_argument("--threads", type=int, default=1, help="TF intra/inter-op threads (1)")
    p.add_argument("--out", default=common.RESULTS, help="output folder")
    args = p.parse_args(argv)
    if zoo and args.profile:
        registry += list(HARNESS_MODELS)
        if args.models == ",".join(zoo_models.ZOO):
            args.models = "mnist_deep,cnn"
    names = [m for m in args.models.split(",") if m]
    # Issue 34's dynamic-shape TF1 models are run by name (`--models unet,...`).
    known = registry + ([] if zoo else list(tf1_models.DYNAMIC_MODELS))
    unknown = sorted(set(names) - set(known))
    if unknown:
        p.error("unknown model(s) %s; choose from %s" % (", ".join(unknown), ", ".join(known)))
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    except ValueError:
        batch_sizes = []
    if args.repeats < 1 or not batch_sizes or min(batch_sizes) < 1:
        p.error("--batch-sizes takes comma-separated integers >= 1, --repeats one >= 1")
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    if zoo and args.profile:
        for name in names:
            profile(name, batch_sizes, times=args.times)
        return 0
    load_start = "%.2f" % os.getloadavg()[0]
    rows = []
    for name in names:
        rows += bench_model(name, batch_sizes, args.repeats, args.threads,
                            ("norms", "clip") if zoo else ("clip",),
                            dp_step=zoo and name == "mnist_deep",
                            print_plan=not zoo and args.plans)
    meta = {"machine": "%s, %d cores" % (platform.processor() or platform.machine(),
                                         os.cpu_count()),
            "tf": tf.__version__, "repeats": args.repeats, "threads": args.threads,
            "load_start": load_start, "load_end": "%.2f" % os.getloadavg()[0]}
    common.write_outputs(suite, {"meta": meta, "rows": rows},
                         (_markdown if zoo else markdown)(rows, meta), args.out)
    print("wrote %s" % os.path.join(args.out, suite + ".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
