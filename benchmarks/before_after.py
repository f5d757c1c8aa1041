"""Before/after: two trees' per-example engines in ONE run, interleaved.

    python -m benchmarks.before_after BEFORE_DIR [--after DIR] [--rounds 3]
        [--models mlp,cnn,lstm] [--zoo-models all] [--write] [--note TEXT]

Issue 23's closing measurement (the engine v2 against the engine before it).
Two warm worker servers (`benchmarks/worker.py`), one per tree: each imports
`custagg` from its tree (BEFORE_DIR, and --after, default this repository)
and runs THIS tree's benchmark code, so the models, floors, timing and
checks are the same and only the engine differs. Every configuration runs in
a fresh forked child, which measures its ratio to its own floor in its own
process (`common.time_against_floor`: system and floor alternated) and one
traced step of each for peak memory (`benchmarks/memory.py`):

* harness: `tf_systems.run` (mlp, cnn at B=64, 256; lstm at B=32, 64;
  norms, clip, dpsgd; custagg_auto), its check against the loop reference;
* zoo: each `zoo_models` model at full size: norms and the clipped sum
  against the aggregated gradient, and for mnist_deep the DP step
  (`DPOptimizer` around Adam) against the tutorial's Adam step.

Round-major and interleaved: round r runs every configuration once per tree,
before then after (after then before in odd rounds), so load drifts hit both
trees alike and each cell's `--rounds` samples span the whole run. A cell is
"changed" when the two trees' medians differ by more than the larger of the
two trees' round-to-round ranges and by more than 5% (memory: 2%). Results go
to --out/before_after.json after every configuration; with --write also to
benchmarks/results/before_after.json and .md.
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


# --------------------------------------------------------------------------
# Worker side (in a forked child of a tree's server)


def execute(cfg):
    """One configuration in this process; `cfg["suite"]` is "harness" or "zoo"."""
    import custagg
    out = _harness(cfg) if cfg["suite"] == "harness" else _zoo(cfg)
    out["custagg_file"] = custagg.__file__
    return out


def _harness(cfg):
    from benchmarks import models
    from benchmarks.systems import tf_systems
    result = tf_systems.run(cfg)
    cells = {}
    if result.get("status", "ok") == "ok":
        cells[cfg["task"]] = {"ratio": result["ratio_to_floor"], "ms": result["median_ms"],
                              "base_ms": result["floor_ms"], "peak_ratio": result["peak_ratio"],
                              "peak_mb": result["peak_mb"], "repeats": result["repeats"],
                              "check": result["check"]}
    # The plan of this tree's engine for the model (what a regression comes from).
    import custagg
    tf = tf_systems._tf()
    with tf.Graph().as_default():
        variables, var_list = models.tf_variables(cfg["model"])
        x, y = models.tf_placeholders(cfg["model"], cfg["batch_size"], dynamic=tf_systems
                                      .dynamic_batch(cfg["model"], cfg["system"]))
        plan = custagg.plan_per_example(models.tf_loss(cfg["model"], variables, x, y), var_list)
    return dict(status=result.get("status", "ok"), note=result.get("note", ""), cells=cells,
                forms=dict(collections.Counter(plan.forms())), plan=str(plan),
                build_s=result.get("build_s"))


def _zoo(cfg):
    import numpy as np
    import tensorflow as tf
    import custagg
    from benchmarks import memory, zoo_models
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    tf.compat.v1.disable_eager_execution()
    name, batch = cfg["model"], cfg["batch_size"]
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(3)
        model = _builders()[name](tf.float32, np.random.default_rng(3), full=True)
        loss, xs = model.loss, model.xs
        t0 = time.perf_counter()
        plan = custagg.plan_per_example(loss, xs)
        fetch = {"floor": tf.compat.v1.gradients(tf.reduce_sum(loss), xs),
                 "norms": custagg.per_example_norms(loss, xs),
                 "clip": custagg.clipped_gradients(loss, xs, 1.0)}
        pairs = [("norms", "floor"), ("clip", "floor")]
        if name == "mnist_deep":
            with tf.compat.v1.variable_scope("orig"):
                fetch["step_orig"] = tf.compat.v1.train.AdamOptimizer(1e-4).minimize(
                    tf.reduce_mean(loss), var_list=xs)
            with tf.compat.v1.variable_scope("dp"):
                fetch["dp_step"] = custagg.DPOptimizer(
                    tf.compat.v1.train.AdamOptimizer(1e-4), l2_norm_clip=1.0,
                    noise_multiplier=1.1).minimize(loss, var_list=xs)
            pairs.append(("dp_step", "step_orig"))
        build_s = time.perf_counter() - t0
        init = tf.compat.v1.global_variables_initializer()
    feed = model.feed(np.random.default_rng(batch), batch)
    threads = cfg.get("threads", 1)
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=threads,
                                      inter_op_parallelism_threads=threads)
    cells = {}
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        sess.run(init)
        norms = sess.run(fetch["norms"], feed)      # also the engines' cross-check
        for key, base in pairs:
            sess.run(fetch[base], feed)
            first_ms = common.timed_ms(lambda: sess.run(fetch[key], feed))
            ms, base_ms, n = common.time_against_floor(
                lambda: sess.run(fetch[key], feed), lambda: sess.run(fetch[base], feed),
                cfg["repeats"], cfg["budget_s"], first_ms)
            base_peak = memory.step_peak_bytes(sess, fetch[base], feed)[0]
            peak = memory.step_peak_bytes(sess, fetch[key], feed)[0]
            cells[key] = {"ratio": ms / base_ms, "ms": ms, "base_ms": base_ms,
                          "peak_ratio": peak / float(base_peak) if base_peak else None,
                          "peak_mb": memory.mb(peak), "repeats": n}
    return dict(status="ok", note="", cells=cells, build_s=build_s,
                forms=dict(collections.Counter(plan.forms())), plan=str(plan),
                norms=[float(v) for v in np.asarray(norms).ravel()])


# --------------------------------------------------------------------------
# Orchestrator side


def serve(tree):
    """`python -m benchmarks.before_after serve TREE`: a worker server whose
    children use TREE's custagg and this repository's benchmark code."""
    tree = os.path.abspath(tree)
    sys.path.insert(0, tree)
    import custagg
    del sys.path[0]
    if not os.path.abspath(custagg.__file__).startswith(tree + os.sep):
        raise RuntimeError("custagg came from %s, not from %s" % (custagg.__file__, tree))
    for sub in ("custagg.rules.registry", "custagg.registry"):   # after, before
        try:
            __import__(sub)
            sys.modules[sub].default_registry()
            break
        except (ImportError, AttributeError):
            continue
    from benchmarks import worker
    return worker.serve("tf")


def _server(tree_dir, name, log_dir, threads):
    from benchmarks import run
    srv = run.ForkServer("tf", sys.executable, log_dir, threads, job=TREES.index(name))
    srv.argv = ["-m", "benchmarks.before_after", "serve", tree_dir]
    return srv


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
    """Cells from raw samples.

    Args:
      samples: list of `{"key", "tree", "round", "result"}`, `result` as
        `execute` returns it.

    Returns:
      list of cell dicts `{key, suite, model, batch_size, measure, before,
      after, ...}`, one per (configuration, measure): each tree's ratios,
      median, range, peak ratios; `after_over_before` and `changed` (None
      when a tree has fewer than two rounds: no spread to judge against).
    """
    by = collections.OrderedDict()
    for s in samples:
        res = s["result"]
        for measure, c in (res.get("cells") or {}).items():
            cell = by.setdefault((s["key"], measure), {"key": s["key"], "measure": measure,
                                                       "before": [], "after": [],
                                                       "forms": {}, "plan": {}, "checks": {}})
            cell[s["tree"]].append(c)
            cell["forms"][s["tree"]] = res.get("forms")
            cell["plan"][s["tree"]] = res.get("plan")
            if c.get("check"):
                cell["checks"].setdefault(s["tree"], set()).add(c["check"])
    out = []
    for cell in by.values():
        row = {"key": cell["key"], "measure": cell["measure"], "forms": cell["forms"],
               "plan": cell["plan"], "checks": {t: sorted(v) for t, v in cell["checks"].items()}}
        for tree in TREES:
            runs = cell[tree]
            ratios = [c["ratio"] for c in runs]
            peaks = [c["peak_ratio"] for c in runs if c.get("peak_ratio") is not None]
            row[tree] = {
                "ratios": ratios, "median": statistics.median(ratios) if ratios else None,
                "range": (min(ratios), max(ratios)) if ratios else None,
                "base_ms": statistics.median([c["base_ms"] for c in runs]) if runs else None,
                "peak_ratio": statistics.median(peaks) if peaks else None,
                "peak_range": (min(peaks), max(peaks)) if peaks else None,
                "peak_mb": statistics.median([c["peak_mb"] for c in runs]) if runs else None}
        b, a = row["before"], row["after"]
        row["after_over_before"] = (a["median"] / b["median"]
                                    if a["median"] and b["median"] else None)
        row["changed"] = _changed(b["ratios"], a["ratios"], TIME_TOLERANCE)
        bp = [c["peak_ratio"] for c in cell["before"] if c.get("peak_ratio") is not None]
        ap = [c["peak_ratio"] for c in cell["after"] if c.get("peak_ratio") is not None]
        row["peak_after_over_before"] = (a["peak_ratio"] / b["peak_ratio"]
                                         if a["peak_ratio"] and b["peak_ratio"] else None)
        row["peak_changed"] = _changed(bp, ap, MEMORY_TOLERANCE)
        out.append(row)
    return out


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
        "One run, both trees interleaved (`benchmarks/before_after.py`): every configuration "
        "ran in its own forked worker once per round and tree, before then after (after then "
        "before in odd rounds), %d round(s). Each ratio is measured in its own process against "
        "its own floor (the aggregated gradient; for `dp_step`, the tutorial's Adam step) and "
        "is a median of alternated runs; a cell's ratio is the median over rounds, the range "
        "after it is over rounds. \"changed\": the medians differ by more than the larger "
        "round-to-round range of the two trees and by more than %d%% (memory: %d%%). Memory: peak "
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


# Issue 34: every before/after also runs models unlike the ones the engine
# was tuned on: a deep conv net (the zoo's official_resnet_cifar), a bi-RNN
# with `sequence_length` (bilstm_crf) and dynamic image sizes (unet).
OTHERS_DEFAULT = ("bilstm_crf", "unet")


def _builders():
    """name -> model builder: the zoo, then the TF1 models (static and
    dynamic shapes); each builder takes (dtype, rng, full)."""
    from benchmarks import tf1_models, zoo_models
    out = collections.OrderedDict(zoo_models.ZOO)
    for table in (tf1_models.MODELS, tf1_models.DYNAMIC_MODELS):
        for name, build in table.items():
            out.setdefault(name, build)
    return out


def parse_args(argv=None):
    from benchmarks import zoo_models
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
    known = _builders()
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
    if argv is None and sys.argv[1:2] == ["serve"]:
        return serve(sys.argv[2])
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
    servers = {t: _server(meta[t]["dir"], t, dirs["logs"], args.threads) for t in TREES}
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
