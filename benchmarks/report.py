"""The harness's reports: results.md, the plots and the docs' tables from
results.json's records, peers.md, zoo.md and tf1_models.md from theirs."""
import collections
import statistics

from benchmarks import common
from benchmarks.systems import SYSTEMS, TASKS

_SHORT = {"ok": None, "skipped": "skip", "timeout": "timeout", "failed": "FAIL"}

# One colour and marker per system, the same in every panel and figure (the
# notebook uses these too). custagg's systems have strong colours far apart
# from each other and from the others, solid and thicker lines; the others are
# dashed and thin. A system not listed gets a style fixed by its name.
SYSTEM_STYLES = {
    "custagg_auto": ("#0b3fd6", "o", "-"),        # blue
    "custagg_rules": ("#00a6a6", "s", "-"),       # teal
    "custagg_pfor": ("#2ca02c", "^", "-"),        # green
    "custagg_loop": ("#8e24aa", "v", "-"),        # violet
    "custagg_custom_slices": ("#e6a000", "D", "-"),  # amber
    "custagg_custom_vector": ("#e4007c", "d", "-"),  # magenta
    "custagg_grad_ys": ("#6d4c41", "P", "-"),     # brown
    "tf_loop": ("#9e9e9e", "x", "--"),
    "tf_vmap": ("#d62728", "X", "--"),
    "tf_jacobian": ("#ff9896", "*", "--"),
    "tf_grad_ys": ("#bcbd22", "h", "--"),
    "tfp_vectorized": ("#f7b6d2", "p", "--"),
    "jax_vmap": ("#ff7f0e", "<", "--"),
    "torch_func": ("#000000", ">", "--"),
    "opacus": ("#c49c94", "8", "--"),
}
_SPARE = [("#393b79", "H"), ("#637939", "1"), ("#8c6d31", "2"),
          ("#843c39", "3"), ("#7b4173", "4"), ("#3182bd", "+")]

# Short task names for figure panels (the tables use TASKS' full text).
TASK_LABELS = {"grads": "(a) per-example grads", "norms": "(b) norms",
               "clip": "(b2) clipped sum", "dpsgd": "(c) DP-SGD step",
               "custom": "(d) weighted sum"}


def system_style(system):
    """matplotlib keywords (color, marker, linestyle, linewidth) of `system`,
    fixed by its name alone, so a system looks the same wherever it is drawn."""
    if system in SYSTEM_STYLES:
        color, marker, ls = SYSTEM_STYLES[system]
    else:
        import zlib  # pylint: disable=g-import-not-at-top
        color, marker = _SPARE[zlib.crc32(system.encode()) % len(_SPARE)]
        ls = "-" if system.startswith("custagg") else "--"
    return {"color": color, "marker": marker, "linestyle": ls,
            "linewidth": 2.0 if ls == "-" else 1.0}


NOISE_FACTOR = 1.5


def noisy_records(records):
    """ids of the records whose time ratio is less trustworthy: fewer than 3
    timed runs, or a floor time more than NOISE_FACTOR away from the median
    floor time of its (model, B, framework) in `records`. The floor is the
    same computation in every configuration of a (model, B, framework) (the
    zoo's task "step": the Adam step, apart), so a floor far from its median
    says the machine's load moved during that configuration. Memory figures
    are not affected by load."""
    def key(r):
        return r["model"], r["batch_size"], r.get("framework"), r["task"] == "step"
    groups = {}
    for r in records:
        if r.get("status") == "ok" and r.get("floor_ms"):
            groups.setdefault(key(r), []).append(r["floor_ms"])
    medians = {k: statistics.median(v) for k, v in groups.items()}
    noisy = set()
    for r in records:
        med = medians.get(key(r))
        few = r.get("repeats") is not None and r["repeats"] < 3
        moved = med and r.get("floor_ms") and not (
            med / NOISE_FACTOR <= r["floor_ms"] <= med * NOISE_FACTOR)
        if r.get("status") == "ok" and (few or moved):
            noisy.add(id(r))
    return noisy


def _fmt(value, big=100):
    """A time (ms) or size (MB) for a table: 3 significant digits below `big`."""
    if value is None:
        return "-"
    return "%.3g" % value if value < big else "%.0f" % value


def _cell(rec, noisy=(), metric="time"):
    """A table cell of `rec`: its status unless ok; time: `ratio (median /
    floor ms)`, both from the record's own process, `~` before a noisy one
    (`noisy_records`), ✗ after one whose check failed; memory: `ratio (peak
    MB / floor peak MB)` of one traced step each (benchmarks/memory.py)."""
    if rec is None:
        return ""
    if rec["status"] != "ok":
        return _SHORT.get(rec["status"], rec["status"])
    if metric == "memory":
        ratio = rec.get("peak_ratio")
        if ratio is None:
            return "-"
        return ("%.2fx" if ratio < 10 else "%.0fx") % ratio + " (%s / %s)" % (
            _fmt(rec.get("peak_mb"), 1000), _fmt(rec.get("floor_peak_mb"), 1000))
    ratio = rec["ratio_to_floor"]
    text = ("~" if id(rec) in noisy else "") + ("%.1fx" if ratio < 10 else "%.0fx") % ratio
    text += (" (%s / %s)" % (_fmt(rec["median_ms"]), _fmt(rec["floor_ms"])) if rec.get("floor_ms")
             else " (%s ms)" % _fmt(rec["median_ms"]))
    return text + (" ✗" if rec.get("check") == "fail" else "")


def _ordered(values, order):
    values = set(values)
    return [v for v in order if v in values] + sorted(values - set(order))


def task_tables(records, tasks=None, heading="##", cell=None, title=None):
    """Markdown lines: one table per task, a row per (model, B), a column per system.

    `cell(record) -> str` fills a cell (default: time ratio to the floor);
    `title(task) -> str` heads each table (default: the task's description).
    """
    if cell is None:
        noisy = noisy_records(records)
        cell = lambda r: _cell(r, noisy)  # noqa: E731
    title = title or (lambda task: TASKS.get(task, task))
    models = _ordered((r["model"] for r in records),
                      ["softmax", "mlp", "cnn", "text", "lstm", "transformer"])
    sizes = sorted({r["batch_size"] for r in records})
    idx = {(r["model"], r["batch_size"], r["task"], r["system"]): r for r in records}
    lines = []
    for task in _ordered((r["task"] for r in records), list(TASKS)):
        if tasks is not None and task not in tasks:
            continue
        systems = _ordered((r["system"] for r in records if r["task"] == task), list(SYSTEMS))
        lines += ["%s %s" % (heading, title(task)), ""]
        lines.append("| model | B | " + " | ".join(systems) + " |")
        lines.append("|---|---:|" + "---:|" * len(systems))
        for model in models:
            for b in sizes:
                row = [idx.get((model, b, task, s)) for s in systems]
                if not any(row):
                    continue
                lines.append("| %s | %d | %s |" % (model, b, " | ".join(cell(r) for r in row)))
        lines.append("")
    return lines


def memory_tables(records, tasks=None, heading="##"):
    """Markdown lines: the peak-memory ratios, one table per task that has
    any memory figure (records from before the memory column have none)."""
    measured = [r for r in records if r.get("peak_ratio") is not None]
    if not measured:
        return []
    keep = {(r["model"], r["task"], r["system"]) for r in measured}
    rows = [r for r in records if (r["model"], r["task"], r["system"]) in keep]
    return task_tables(rows, tasks=tasks, heading=heading,
                       cell=lambda r: _cell(r, metric="memory"),
                       title=lambda task: "Peak memory, %s" % TASKS.get(task, task))


README_START = ("<!-- benchmark-tables:start (python -m benchmarks --report-only "
                "--readme docs/benchmarks.md) -->")
README_END = "<!-- benchmark-tables:end -->"


def update_readme(path, records, meta, tasks=("grads", "norms", "clip", "dpsgd"),
                  results_md="benchmarks/results/results.md"):
    """Replaces the block between README_START and README_END in `path` with
    the machine line and the tables of `tasks` from `records`."""
    with open(path) as f:
        text = f.read()
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError("%s has no benchmark block (%s, then %s)"
                         % (path, README_START, README_END))
    head, tail = text[:start], text[end + len(README_END):]
    versions = "; ".join("%s %s" % kv for v in meta.get("versions", {}).values()
                         for kv in v.items() if not kv[0].endswith("_s"))
    runs = "`%s`, %s, %.0f s in all (load average at start %s)" % (
        meta.get("command", "?"), (meta.get("started") or "?")[:10], meta.get("wall_s", 0.0),
        _load(meta.get("loadavg_start")))
    for merged in meta.get("merged_runs", []):
        runs += "; merged: `%s`, %.0f s" % (merged.get("command", "?"), merged.get("wall_s", 0.0))
    block = [README_START, "",
             "Measured on %s, %s cores, %s GB RAM; %s; %s. Cells: ratio to the floor (median "
             "ms / the floor's median ms, both measured in the same process; the floor is the "
             "aggregated gradient of the summed loss in the system's own framework); ~: noisy "
             "(fewer than 3 runs, or the floor's time %gx or more off its median for that model "
             "and B: the machine's load moved). skip: "
             "estimated too slow (B² systems) or not supported by the strategy; notes, the "
             "other figures and task (d) are in [`%s`](%s)." % (
                 meta.get("cpu", "?"), meta.get("cores", "?"), meta.get("memory_gb", "?"),
                 versions or "versions not recorded", runs, NOISE_FACTOR, results_md, results_md),
             ""]
    block += task_tables(records, tasks=tasks, heading="####")
    mem = memory_tables(records, tasks=tasks, heading="####")
    block += ([_MEMORY_NOTE, ""] + mem) if mem else []
    block.append(README_END)
    with open(path, "w") as f:
        f.write(head + "\n".join(block) + tail)


_MEMORY_NOTE = ("Peak memory: the step's peak bytes of live tensors over the floor's, then "
                "(peak MB / floor peak MB), one traced step each after the timed runs (TF: "
                "allocation records, benchmarks/memory.py, the median over new sessions where "
                "a record has `peak_sessions`; JAX: XLA's buffer assignment; "
                "PyTorch: the profiler's memory events); variables and fed inputs are not in "
                "it, nor does the machine's load move it.")


def write_markdown(path, records, meta, title="custagg comparison benchmark", intro=None):
    """results.md (zoo.md, tf1_models.md: `title`, `intro`): the machine, a
    time table and a memory table per task, the check failures, the plans'
    forms, what did not run, the systems and every record."""
    versions = ["%s %s" % kv for v in meta.get("versions", {}).values() for kv in v.items()]
    lines = [
        "# " + title, ""] + ([intro, ""] if intro else []) + [
        "- Machine: %s, %s cores, %s GB RAM; %s; Python %s" % (
            meta.get("cpu"), meta.get("cores"), meta.get("memory_gb"), meta.get("platform"),
            meta.get("python")),
        "- Versions: %s" % ("; ".join(versions) or "-"),
        "- Command: `%s`, started %s, took %.0f s; load average (1/5/15 min) at start %s, end %s"
        % (meta.get("command"), meta.get("started"), meta.get("wall_s", 0.0),
           _load(meta.get("loadavg_start")), _load(meta.get("loadavg_end"))), "",
        "Each cell: the ratio to the floor, then (median ms of the task's result / median ms "
        "of the floor), both from the same process. The floor: the aggregated gradient of the "
        "summed loss in the system's framework (TF: `tf.compat.v1.gradients`; JAX: "
        "`jit(grad)`; PyTorch: `loss.sum().backward()`). ~: noisy (fewer than 3 timed runs, "
        "or the floor's time %gx or more off its median for that model, B and framework). ✗: "
        "disagrees with the reference (tolerance %g, max abs error over max abs value). "
        "skip/timeout/FAIL: see the notes below." % (NOISE_FACTOR, meta.get("tolerance", 1e-3)),
        ""] + task_tables(records, heading="##")
    mem = memory_tables(records, heading="##")
    lines += ([_MEMORY_NOTE, ""] + mem) if mem else []
    key = ["model", "B", "task", "system"]

    def head(r):
        return [r["model"], r["batch_size"], r["task"], r["system"]]
    bad = [r for r in records if r.get("check") == "fail"]
    lines += ["## Check failures", "", common.md_table(key + ["worst error", "on"], [
        head(r) + ["%.3g" % (r.get("check_err") or 0), r.get("check_key")] for r in bad])
        if bad else "None: every system that ran agrees with the reference.", ""] * any(
            r.get("check") in ("pass", "fail") for r in records)
    plans = collections.OrderedDict((r["model"], r) for r in records if r.get("forms"))
    lines += ["## Plans", "", common.md_table(["model", "forms", "not on rules"], [
        [m, ", ".join("%s %d" % kv for kv in sorted(r["forms"].items())),
         ", ".join(r.get("not_rules") or []) or "-"] for m, r in plans.items()]), ""] * bool(plans)
    notrun = [r for r in records if r["status"] != "ok"]
    lines += ["## Not run or not finished", "", common.md_table(key + ["status", "note"], [
        head(r) + [r["status"], (r.get("note") or "").replace("|", "/")[:300]] for r in notrun])
        if notrun else "None.", "", "## Systems", ""]
    lines += ["- `%s` (%s): %s" % (n, SYSTEMS[n].framework, SYSTEMS[n].description)
              for n in _ordered((r["system"] for r in records), list(SYSTEMS)) if n in SYSTEMS]
    lines += ["", "## All records", "", common.md_table(key + [
        "status", "median ms", "x floor", "floor ms", "first run ms", "build s", "ops",
        "peak MB", "x floor peak", "floor peak MB", "peak RSS MB", "check"], [head(r) + [
            r["status"], _fmt(r.get("median_ms")), _num(r.get("ratio_to_floor"), "%.2f"),
            _fmt(r.get("floor_ms")), _fmt(r.get("first_run_ms")), _num(r.get("build_s"), "%.2f"),
            _num(r.get("n_ops"), "%d"), _fmt(r.get("peak_mb"), 1000),
            _num(r.get("peak_ratio"), "%.2f"), _fmt(r.get("floor_peak_mb"), 1000),
            _num(r.get("peak_rss_mb"), "%.0f"), r.get("check") or ""] for r in records])]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def _num(v, fmt):
    return "-" if v is None else fmt % v


def _load(v):
    return "-" if not v else "/".join("%.1f" % x for x in v)


PLOT_METRICS = {
    # metric: (record key, axis label, the figure's title)
    "time": ("ratio_to_floor", "time / floor",
             "Time relative to the floor (the aggregated gradient, same process; "
             "dotted line = 1; lower is better; ringed point = noisy measurement)"),
    "memory": ("peak_ratio", "peak memory / floor's",
               "Peak memory of one step relative to the floor's (TF's allocator "
               "records of one traced step; JAX: XLA's buffer assignment; PyTorch: "
               "its profiler; dotted line = 1; lower is better)"),
}


def write_plot(path, records, metric="time"):
    """One panel per (task, model): `metric` ("time": time / floor, or
    "memory": the step's peak / the floor's peak, `PLOT_METRICS`) against B
    for each system measured there (skipped ones are absent), styled by
    `system_style`, with one legend for the figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, ylabel, title = PLOT_METRICS[metric]
    ok = [r for r in records if r["status"] == "ok" and r.get(key)]
    if not ok:
        return
    # A peak is exact to the byte whatever the load: only times are noisy.
    noisy = noisy_records(records) if metric == "time" else set()
    tasks = _ordered((r["task"] for r in ok), list(TASKS))
    models = _ordered((r["model"] for r in ok), ["softmax", "mlp", "cnn", "text", "lstm",
                                                  "transformer"])
    systems = _ordered((r["system"] for r in ok), list(SYSTEMS))
    fig, axes = plt.subplots(len(tasks), len(models), squeeze=False,
                             figsize=(3.2 * len(models), 2.8 * len(tasks)))
    handles = {}
    for ti, task in enumerate(tasks):
        for mi, model in enumerate(models):
            ax = axes[ti][mi]
            rows = [r for r in ok if r["task"] == task and r["model"] == model]
            if not rows:
                ax.axis("off")
                continue
            ax.axhline(1.0, color="k", lw=0.8, ls=":")
            for s in systems:
                pts = sorted((r["batch_size"], r[key], id(r) in noisy)
                             for r in rows if r["system"] == s)
                if pts:
                    style = system_style(s)
                    line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], ms=4,
                                    label=s, **style)
                    handles.setdefault(s, line)
                    # Noisy points: a hollow ring around the marker.
                    bad = [p for p in pts if p[2]]
                    if bad:
                        ax.plot([p[0] for p in bad], [p[1] for p in bad], ls="none",
                                marker="o", ms=9, mfc="none", mec=style["color"], mew=1.0)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title("%s: %s" % (model, TASK_LABELS.get(task, task)), fontsize=9)
            ax.tick_params(labelsize=7)
            if mi == 0:
                ax.set_ylabel("%s\n%s" % (TASK_LABELS.get(task, task), ylabel), fontsize=8)
            if ti == len(tasks) - 1:
                ax.set_xlabel("batch size", fontsize=8)
    labels = [s for s in systems if s in handles]
    width, height = fig.get_size_inches()
    ncol = max(1, min(len(labels), int(width / 2.2)))
    legend_rows = -(-len(labels) // ncol)
    fig.legend([handles[s] for s in labels], labels, loc="lower center",
               ncol=ncol, fontsize=8, frameon=False)
    fig.suptitle(title + ". Tasks: "
                 "(a) per-example gradients materialized, (b) per-example norms, (b2) clipped "
                 "sum, (c) DP-SGD step, (d) weighted sum", fontsize=10)
    fig.tight_layout(rect=(0, min(0.4, (0.2 * legend_rows + 0.1) / height), 1, 0.98))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _peer_cell(rec):
    """`time x / memory x` over the system's own framework's floor."""
    if rec is None:
        return ""
    if rec["status"] != "ok":
        return "fails" if rec["status"] == "failed" else _SHORT.get(rec["status"], rec["status"])
    mem = rec.get("peak_ratio")
    text = "%.2fx / %s" % (rec["ratio_to_floor"], "-" if mem is None else "%.2fx" % mem)
    return text + (" ✗" if rec.get("check") == "fail" else "")


def write_peers(path, records, meta):
    """peers.md: per task a row per (model, B), a column per system, each
    cell `time / memory` over that framework's own non-private gradient step,
    measured in the record's own process; then every failure with its error."""
    systems = _ordered({r["system"] for r in records}, list(SYSTEMS))
    lines = ["# custagg beside the DP peers (issue 37)", "",
             "`%s`, %s, %s cores, load %s at the start, %s at the end; %s s." % (
                 meta.get("command", "?"), meta.get("cpu", "?"), meta.get("cores", "?"),
                 _load(meta.get("loadavg_start")), _load(meta.get("loadavg_end")),
                 "%.0f" % meta["wall_s"] if meta.get("wall_s") else "?"),
             "", "Versions: " + "; ".join(
                 "%s: %s" % (fw, ", ".join("%s %s" % kv for kv in v.items()))
                 for fw, v in sorted(meta.get("versions", {}).items())), "",
             "Cells: time / peak memory, each over the same framework's plain gradient of "
             "the summed loss (the floor) in the same process; ✗: the check against the "
             "per-example loop reference failed. How each peer is wired: docs/benchmarks.md, "
             "\"The DP peers\".", ""]
    for s in systems:
        lines.append("- `%s`: %s" % (s, SYSTEMS[s].description if s in SYSTEMS else s))
    lines += [""] + task_tables(records, tasks=("clip", "dpsgd"), cell=_peer_cell)
    where = {}
    for r in records:
        if r["status"] in ("failed", "timeout"):
            where.setdefault((r["system"], r["note"] or r["status"]), []).append(
                "%s B=%d %s" % (r["model"], r["batch_size"], r["task"]))
    if where:
        lines += ["## Failures (the peer's own error)", ""] + [
            "- `%s` on %s: %s" % (system, ", ".join(w), note)
            for (system, note), w in where.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
