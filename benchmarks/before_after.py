"""Before/after: two trees' per-example engines in ONE run, interleaved.

    python -m benchmarks.before_after BEFORE_DIR [--after DIR] [--rounds 3]
        [--models mlp,cnn,lstm] [--zoo-models all] [--write] [--note TEXT]

One warm worker server per tree (`benchmarks/worker.py serve tf TREE`), each
importing its tree's custagg and running THIS tree's benchmark code, so only
the engine differs. Every configuration runs in a fresh forked child that
measures its ratios to its own floor: the harness's `tf_systems.run`
(custagg_auto on mlp, cnn, lstm; norms, clip, dpsgd; checked against the
loop reference) and the zoo's `zoo.bench_model` (each zoo model and
OTHERS_DEFAULT: norms, the clipped sum; mnist_deep's DP step). Round r runs
every configuration once per tree, the trees' order swapped in odd rounds.
A cell is "changed" when the medians differ by more than both trees'
round-to-round ranges and TIME_TOLERANCE (memory: MEMORY_TOLERANCE).
Writes --out/before_after.json (and, with --write, results/before_after.*).
"""

import argparse
import collections
import datetime
import os
import statistics
import subprocess
import sys
import time

from benchmarks import common

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TREES = ("before", "after")
HARNESS_BATCHES = {"mlp": (64, 256), "cnn": (64, 256), "lstm": (32, 64)}
HARNESS_TASKS = ("norms", "clip", "dpsgd")
ZOO_BATCHES = (64, 256)
# Whole-pass (O(B^2)) in both trees: ~20 s a run at B=256 on this machine.
ZOO_SKIP = {("keras_batch_norm_training", 256)}
# Below these relative differences a cell is never "changed": three rounds'
# range underestimates the spread of a loaded machine's timings.
TIME_TOLERANCE = 0.05
MEMORY_TOLERANCE = 0.02
# Issue 34: models unlike the ones the engine was tuned on (a bi-RNN with
# `sequence_length`, dynamic image sizes) run with the zoo by default.
OTHERS_DEFAULT = ("bilstm_crf", "unet")


def execute(cfg):
    """One configuration in this process (a worker's child): `cfg["suite"]`
    is "harness" or "zoo"; returns `{status, note, cells: {measure: {ratio,
    ms, base_ms, peak_ratio, peak_mb, repeats, check}}, forms, plan, ...}`."""
    import custagg
    if cfg["suite"] == "harness":
        from benchmarks.systems import tf_systems
        r = tf_systems.run(dict(cfg, plan=True))
        cells = {cfg["task"]: {"ratio": r["ratio_to_floor"], "ms": r["median_ms"],
                               "base_ms": r["floor_ms"], "peak_ratio": r["peak_ratio"],
                               "peak_mb": r["peak_mb"], "repeats": r["repeats"],
                               "check": r["check"]}} if r.get("status", "ok") == "ok" else {}
        out = dict(status=r.get("status", "ok"), note=r.get("note", ""), cells=cells,
                   forms=r.get("forms"), plan=r.get("plan"), build_s=r.get("build_s"))
    else:
        from benchmarks import zoo
        row = zoo.bench_model(cfg["model"], [cfg["batch_size"]], cfg["repeats"],
                              cfg.get("threads", 1), dp_step=cfg["model"] == "mnist_deep",
                              detail=True)[0]
        if "error" in row:
            return dict(status="failed", note=row["error"], custagg_file=custagg.__file__)
        cells = {k: {"ratio": row[k + "_ratio"], "ms": row[key + "_ms"],
                     "base_ms": row[base + "_ms"], "peak_ratio": row[k + "_peak_ratio"],
                     "peak_mb": row[key + "_peak_mb"], "repeats": cfg["repeats"]}
                 for k, key, base in (("norms", "norms", "floor"), ("clip", "clip", "floor"),
                                      ("step", "step_dp", "step_orig")) if k + "_ratio" in row}
        out = dict(status="ok", note="", cells=cells, build_s=row["build_s"],
                   forms=dict(row["forms"]), plan=row["plan"], norms=row["norms"])
    out["custagg_file"] = custagg.__file__
    return out


def plan(args):
    """The configurations: harness ones then zoo ones."""
    cfgs = []
    for model in args.models:
        for b in HARNESS_BATCHES[model]:
            for task in HARNESS_TASKS:
                cfgs.append(dict(suite="harness", model=model, batch_size=b, task=task,
                                 system="custagg_auto", framework="tf"))
    for model in args.zoo_models:
        for b in args.zoo_batches:
            if (model, b) not in ZOO_SKIP:
                cfgs.append(dict(suite="zoo", model=model, batch_size=b, framework="tf"))
    return cfgs


def cfg_key(cfg):
    return "%s/%s/B%d%s" % (cfg["suite"], cfg["model"], cfg["batch_size"],
                           "/" + cfg["task"] if cfg["suite"] == "harness" else "")


def _git(tree, *argv):
    try:
        return subprocess.run(["git", "-C", tree] + list(argv), capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def summarise(samples):
    """Cells from raw samples `{"key", "tree", "round", "result"}` (`result`
    as `execute` returns it): one per (configuration, measure), with each
    tree's ratios, median, range and peak ratios, `after_over_before` and
    `changed` (None below two rounds a tree: no spread to judge against)."""
    by = collections.OrderedDict()
    for s in samples:
        res = s["result"]
        for measure, c in (res.get("cells") or {}).items():
            cell = by.setdefault((s["key"], measure), {"key": s["key"], "measure": measure,
                                                       "before": [], "after": [], "forms": {},
                                                       "plan": {}, "checks": {}})
            cell[s["tree"]].append(c)
            cell["forms"][s["tree"]] = res.get("forms")
            cell["plan"][s["tree"]] = res.get("plan")
            if c.get("check"):
                cell["checks"].setdefault(s["tree"], set()).add(c["check"])
    out = []
    for cell in by.values():
        row = dict(cell, checks={t: sorted(v) for t, v in cell["checks"].items()})
        ratios, peaks = {}, {}
        for tree in TREES:
            runs = cell[tree]
            ratios[tree] = [c["ratio"] for c in runs]
            peaks[tree] = [c["peak_ratio"] for c in runs if c.get("peak_ratio") is not None]
            row[tree] = {
                "ratios": ratios[tree], "median": _median(ratios[tree]),
                "range": (min(ratios[tree]), max(ratios[tree])) if runs else None,
                "base_ms": _median([c["base_ms"] for c in runs]),
                "peak_ratio": _median(peaks[tree]),
                "peak_range": (min(peaks[tree]), max(peaks[tree])) if peaks[tree] else None,
                "peak_mb": _median([c["peak_mb"] for c in runs])}
        b, a = row["before"], row["after"]
        for prefix, key, values, tol in (("", "median", ratios, TIME_TOLERANCE),
                                         ("peak_", "peak_ratio", peaks, MEMORY_TOLERANCE)):
            row[prefix + "after_over_before"] = a[key] / b[key] if a[key] and b[key] else None
            row[prefix + "changed"] = _changed(values["before"], values["after"], tol)
        out.append(row)
    return out


def _median(values):
    return statistics.median(values) if values else None


def _changed(before, after, rel_floor):
    """Whether the medians differ by more than the larger round-to-round
    range (and than `rel_floor` of before's median); None below 2 rounds."""
    if len(before) < 2 or len(after) < 2:
        return None
    mb, ma = statistics.median(before), statistics.median(after)
    noise = max(max(before) - min(before), max(after) - min(after), rel_floor * abs(mb))
    return abs(ma - mb) > noise


def markdown(cells, meta):
    lines = [
        "# Before/after: the per-example engine v2 against the engine before it (issue 23)", "",
        "Both trees interleaved in one run (`benchmarks/before_after.py`), %d round(s); each "
        "ratio from its own process over its own floor (the aggregated gradient; `step`: the "
        "tutorial's Adam step); a cell: the median over rounds (their range). \"changed\": the "
        "medians differ by more than both trees' ranges and %d%% (memory: %d%%). Memory: peak "
        "bytes of one traced step (benchmarks/memory.py) over the floor's." % (
            meta["rounds"], int(100 * TIME_TOLERANCE), int(100 * MEMORY_TOLERANCE)), "",
        "- before: `%s` at %s; after: `%s` at %s (same benchmark code: this tree's)" % tuple(
            x for t in TREES for x in (meta[t]["dir"], _commit(meta[t]))),
        "- command: `%s`" % meta["command"],
        "- machine: %s, %d cores, TF %s; load average (1, 5, 15 min) %s at the start, %s at "
        "the end; %s wall" % (meta["cpu"], meta["cores"], meta.get("tf", "?"),
                              _load(meta["loadavg_start"]), _load(meta.get("loadavg_end")),
                              "%.0f s" % meta["wall_s"] if meta.get("wall_s") else "?"),
        "", "| suite | model | B | measure | before | after | after/before | floor ms (before "
        "/ after) | memory before | memory after | memory after/before | forms (before → "
        "after) |",
        "|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---|"]
    for c in cells:
        suite, model, b = c["key"].split("/")[:3]
        bf, af = c["before"], c["after"]
        forms = [", ".join("%s %d" % kv for kv in sorted((c["forms"].get(t) or {}).items()))
                 for t in TREES]
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            suite, model, b[1:], c["measure"], _ratio_cell(bf), _ratio_cell(af),
            _verdict(c["after_over_before"], c["changed"]),
            "%.3g / %.3g" % (bf["base_ms"], af["base_ms"]) if bf["base_ms"] and af["base_ms"]
            else "-",
            _num(bf["peak_ratio"]), _num(af["peak_ratio"]),
            _verdict(c["peak_after_over_before"], c["peak_changed"]),
            forms[0] if forms[0] == forms[1] else "%s → %s" % tuple(forms)))
    checks = [c for c in cells if any(v != ["pass"] for v in c["checks"].values())]
    if checks:
        lines += ["", "Check not passed against the loop reference: " + "; ".join(
            "%s %s %s" % (c["key"], c["measure"], c["checks"]) for c in checks)]
    if meta.get("note"):
        lines += ["", meta["note"]]
    return "\n".join(lines) + "\n"


def _commit(tree_meta):
    """"HEAD abc (custagg/ last changed in def)"."""
    out = "%s" % tree_meta.get("commit", "?")
    if tree_meta.get("custagg_commit"):
        out += " (custagg/ last changed in %s%s)" % (
            tree_meta["custagg_commit"], ", uncommitted edits" if tree_meta.get("dirty") else "")
    return out


def _load(l):
    return "?" if not l else ", ".join("%.2f" % v for v in l)


def _num(v):
    return "-" if v is None else "%.2fx" % v


def _ratio_cell(t):
    if t["median"] is None:
        return "-"
    lo, hi = t["range"]
    return "%.2fx (%.2f-%.2f)" % (t["median"], lo, hi)


def _verdict(r, changed):
    if r is None:
        return "-"
    return "%.2f%s" % (r, " **changed**" if changed else "")


def parse_args(argv=None):
    from benchmarks import zoo, zoo_models
    p = argparse.ArgumentParser(prog="python -m benchmarks.before_after",
                                description=__doc__.splitlines()[0])
    p.add_argument("before", help="the before tree (a checkout holding custagg/)")
    p.add_argument("--after", default=REPO, help="the after tree (default: this repository)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", default="mlp,cnn,lstm",
                   help="harness models (of %s; '' for none)" % ",".join(HARNESS_BATCHES))
    p.add_argument("--zoo-models", default="all",
                   help="zoo or TF1 models (benchmarks.zoo_models, benchmarks.tf1_models); "
                   "'all': the zoo and %s; '' for none" % ",".join(OTHERS_DEFAULT))
    p.add_argument("--zoo-batches", default=",".join(map(str, ZOO_BATCHES)),
                   help="batch sizes of the zoo/TF1 models (default %s)"
                   % ",".join(map(str, ZOO_BATCHES)))
    p.add_argument("--repeats", type=int, default=10, help="timed pairs per process (max)")
    p.add_argument("--budget", type=float, default=2.0, help="seconds of timing per ratio")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="/tmp/before_after", help="working folder (logs, json)")
    p.add_argument("--write", action="store_true",
                   help="also write benchmarks/results/before_after.json and .md")
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    try:
        args.zoo_batches = [int(b) for b in args.zoo_batches.split(",") if b]
    except ValueError:
        p.error("--zoo-batches takes comma-separated integers, e.g. 64,256")
    if not args.zoo_batches or min(args.zoo_batches) < 1:
        p.error("--zoo-batches needs batch sizes of at least 1")
    known = zoo.builders()
    args.zoo_models = (list(zoo_models.ZOO) + [m for m in OTHERS_DEFAULT if m in known]
                       if args.zoo_models == "all"
                       else [m for m in args.zoo_models.split(",") if m])
    bad = [m for m in args.models if m not in HARNESS_BATCHES] + [
        m for m in args.zoo_models if m not in known]
    if bad:
        p.error("unknown model(s) %s" % ", ".join(bad))
    for tree in (args.before, args.after):
        if not os.path.isfile(os.path.join(tree, "custagg", "__init__.py")):
            p.error("%s holds no custagg/__init__.py: pass a checkout of the project" % tree)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    from benchmarks import run
    dirs = {"logs": os.path.join(args.out, "logs"), "tmp": os.path.join(args.out, "logs", "tmp"),
            "cache": os.path.join(args.out, ".cache")}
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
    started = time.time()
    meta = common.machine_info({
        "command": "python -m benchmarks.before_after " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "rounds": args.rounds, "repeats": args.repeats, "budget_s": args.budget,
        "threads": args.threads, "note": args.note})
    for name, tree in zip(TREES, (args.before, args.after)):
        meta[name] = {"dir": os.path.abspath(tree), "commit": _git(tree, "rev-parse", "--short",
                                                                   "HEAD"),
                      "custagg_commit": _git(tree, "log", "-1", "--format=%h", "--", "custagg"),
                      "dirty": bool(_git(tree, "status", "--porcelain", "custagg"))}
    servers = {t: run.ForkServer("tf", sys.executable, dirs["logs"], args.threads, job=i,
                                 tree=meta[t]["dir"]) for i, t in enumerate(TREES)}
    configs = plan(args)
    samples, refs = [], {}
    print("before/after: %d configurations x %d trees x %d rounds" % (
        len(configs), len(TREES), args.rounds), flush=True)
    try:
        for t in TREES:
            if not servers[t].ensure():
                raise RuntimeError("%s server did not start: %s" % (t, servers[t].error))
            meta.setdefault("tf", servers[t].versions.get("tensorflow"))
        for rnd in range(args.rounds):
            for cfg in configs:
                key = cfg_key(cfg)
                cfg = dict(cfg, repeats=args.repeats, budget_s=args.budget,
                           timeout=args.timeout, threads=args.threads)
                if cfg["suite"] == "harness":
                    ref_key = (cfg["model"], cfg["batch_size"])
                    cfg["ref_path"] = os.path.join(dirs["cache"], "ref_%s_B%d.npz" % ref_key)
                    if ref_key not in refs:
                        refs[ref_key] = run._reference({"tf": servers["after"]}, cfg, cfg["ref_path"],
                                                       args, dirs)
                    if not refs[ref_key]["ok"]:
                        continue
                order = TREES if rnd % 2 == 0 else TREES[::-1]
                for t in order:
                    tag = "%s_r%d_%s" % (key.replace("/", "_"), rnd, t)
                    t0 = time.monotonic()
                    result, reply = run.execute(servers[t], dict(cfg, module="benchmarks.before_after"),
                                                args, dirs, tag)
                    result["maxrss_mb"] = reply.get("maxrss_mb")
                    samples.append({"key": key, "tree": t, "round": rnd, "result": result,
                                    "loadavg_1m": os.getloadavg()[0]})
                    print("r%d %-6s %-40s %s %s (%.0f s)" % (
                        rnd, t, key, result.get("status"), " ".join(
                            "%s %.2fx mem %s" % (m, c["ratio"], _num(c.get("peak_ratio")))
                            for m, c in (result.get("cells") or {}).items())
                        or (result.get("note") or "")[:200], time.monotonic() - t0), flush=True)
                common.dump_json(os.path.join(args.out, "before_after.json"),
                                 {"meta": meta, "samples": samples})
    finally:
        for s in servers.values():
            s.close()
    meta["loadavg_end"] = os.getloadavg()
    meta["wall_s"] = time.time() - started
    meta["references"] = {"%s B=%d" % k: v["note"] for k, v in refs.items()}
    write(args.out, meta, samples)
    if args.write:
        write(os.path.join(HERE, "results"), meta, samples)
    return 0


def write(folder, meta, samples):
    """before_after.json (meta, cells, raw samples) and before_after.md in `folder`."""
    cells = summarise(samples)
    _cross_check(samples, meta)
    # The samples without what the cells and the cross-check already hold
    # (plans, norms): a few hundred kB instead of MBs.
    slim = [dict(s, result={k: v for k, v in s["result"].items() if k not in ("plan", "norms")})
            for s in samples]
    common.dump_json(os.path.join(folder, "before_after.json"),
                     {"meta": meta, "cells": cells, "samples": slim})
    with open(os.path.join(folder, "before_after.md"), "w") as f:
        f.write(markdown(cells, meta))
    print("wrote %s" % os.path.join(folder, "before_after.md"), flush=True)


def _cross_check(samples, meta):
    """The zoo's per-example norms of the two trees on the same feed agree."""
    import numpy as np
    worst = {}
    for key in {s["key"] for s in samples}:
        norms = {s["tree"]: s["result"].get("norms") for s in samples
                 if s["key"] == key and s["result"].get("norms")}
        if len(norms) == 2:
            worst[key] = common.rel_err(np.array(norms["after"]), np.array(norms["before"]))
    meta["zoo_norms_rel_err_after_vs_before"] = worst


if __name__ == "__main__":
    sys.exit(main())
