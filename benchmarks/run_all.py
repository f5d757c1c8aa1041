"""Every benchmark, one after another, in one sitting: `python -m benchmarks.run_all`.

    python -m benchmarks.run_all [--peers PREFIX] [--tfp PYTHON] [--jobs 2]
                                 [--only NAME,...] [--dry-run] [--merge]

Runs each benchmark with the command its docs quote (`benchmarks()`) and
records in benchmarks/results/run_all.{md,json} each run's command, times,
load, exit code and the results files it wrote, with the tree's commit:
every figure the docs quote traces to one run. The runs that use both cores
themselves run alone, the others `--jobs` at a time. `--peers PREFIX`: the
venvs of `benchmarks/peers_env.sh PREFIX`; `--tfp PYTHON`: the TF 2.15
interpreter of tf_privacy_compare (default PREFIX-tf215's, else skipped).
"""

import argparse
import concurrent.futures
import datetime
import json
import os
import subprocess
import sys
import time

from benchmarks import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def benchmarks(peers=None, tfp=None):
    """[(name, argv, alone: uses both cores itself, outputs: the results
    files under benchmarks/results it rewrites)], argv run from the root."""
    py, harness = sys.executable, [sys.executable, "-m", "benchmarks"]
    peer_args = ["--python", "jax=%s-jax/bin/python" % peers,
                 "--python", "torch=%s-torch/bin/python" % peers] if peers else []
    tfp = tfp or (peers and "%s-tf215/bin/python" % peers)

    def files(stem, *more):
        return [stem + ".md", stem + ".json"] + list(more)
    out = [("harness", harness + ["--readme", "docs/benchmarks.md"] + peer_args, True,
            files("results", "results.png", "results_memory.png", "machine.json")),
           ("control_flow", harness + ["--control-flow"] + peer_args, True,
            files("control_flow/results", "control_flow/results.png",
                  "control_flow/results_memory.png", "control_flow/machine.json"))]
    if peers:
        out.append(("peers", harness + ["--peers"] + peer_args + ["--python", "keras=" + tfp],
                    True, files("peers", "peers_machine.json")))
    out += [("zoo", harness + ["--zoo", "--batch-sizes", "64,256"], False, files("zoo")),
            ("tf1_models", harness + ["--tf1-models"], False, files("tf1_models"))]
    out += [(mode, [py, "-m", "benchmarks.dp_step", mode] + extra + ["--write"], False,
             files(mode)) for mode, extra in (
                 ("input_pipelines", []), ("microbatches", []),
                 ("adaptive_clipping", ["--batch", "256"]),
                 ("user_level_clipping", ["--batch", "256"]))]
    if tfp:
        out.append(("tf_privacy_compare", [
            tfp, "-m", "benchmarks.dp_step", "tf_privacy_compare", "--parity", "--epsilon",
            "--timing", "--slow-limit", "20", "--write"], False, files("tf_privacy_compare")))
    return out


def _load():
    return "/".join("%.1f" % v for v in os.getloadavg())


def _run_one(name, argv, outputs, logdir):
    """Runs one benchmark; its stdout and stderr go to logdir/name.log."""
    start = time.time()
    record = dict(name=name, command=" ".join(
        os.path.relpath(a, ROOT) if a.startswith(ROOT) else a for a in argv),
        started=datetime.datetime.now().isoformat(timespec="seconds"), load_start=_load())
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(os.path.join(logdir, name + ".log"), "w") as log:
        rc = subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL).returncode
    paths = {o: os.path.join(RESULTS, o) for o in outputs}
    record.update(seconds=round(time.time() - start, 1), load_end=_load(), exit=rc, outputs=[
        o for o, path in paths.items() if os.path.exists(path) and os.path.getmtime(path) >= start])
    print("%-20s exit %d in %6.0f s (load %s -> %s)" % (
        name, rc, record["seconds"], record["load_start"], record["load_end"]), flush=True)
    return record


def _markdown(meta, records):
    rows = [["%s" % r["name"], "`%s`%s" % (r["command"], " (re-run: `%s`)" % r["rerun"]
                                           if r.get("rerun") else ""),
             r["started"], "%.0f" % r["seconds"], "%s -> %s" % (r["load_start"], r["load_end"]),
             "%d" % r["exit"], ", ".join(r["outputs"]) or "none"] for r in records]
    rows += [[s["name"], "not run: " + s["why"], "", "", "", "", "kept from an earlier run"]
             for s in meta.get("skipped", [])]
    lines = ["# One run of every benchmark", "", "- Command: `%s`" % meta["command"],
             "- Tree: %s%s" % (meta["commit"], "" if meta["clean"] else " (with local changes)"),
             "- Started %s, took %.0f s; %s" % (meta["started"], meta["seconds"],
                                               meta["machine"]), "",
             "Each results file below was written by the run on its row.", "", common.md_table(
                 ["benchmark", "command", "started", "seconds", "load (1/5/15 min) start -> end",
                  "exit", "results files"], rows, ["---"] * 3 + ["---:", "---", "---:", "---"])]
    lines += ["Re-run: `%s` on %s, started %s.\n" % (r["command"], r["commit"], r["started"])
              for r in meta.get("reruns", [])]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.run_all",
                                description=__doc__.split("\n")[0])
    p.add_argument("--peers", metavar="PREFIX",
                   help="the peers' venvs made by benchmarks/peers_env.sh PREFIX")
    p.add_argument("--tfp", metavar="PYTHON", help="TF 2.15 interpreter with tensorflow-privacy")
    p.add_argument("--jobs", type=int, default=2 if (os.cpu_count() or 1) >= 2 else 1,
                   help="single-threaded benchmarks run at once (default 2 on 2+ cores)")
    p.add_argument("--only", help="comma list of benchmark names")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--merge", action="store_true", help="keep run_all.json's records of the "
                   "benchmarks not run this time (a re-run of one that failed)")
    args = p.parse_args(argv)
    todo = benchmarks(args.peers, args.tfp)
    names = [t[0] for t in todo]
    if args.only:
        chosen = args.only.split(",")
        bad = [n for n in chosen if n not in names]
        if bad:
            p.error("--only: unknown benchmark %s; choose from %s"
                    % (", ".join(bad), ", ".join(names)))
        todo = [t for t in todo if t[0] in chosen]
    if args.dry_run:
        for name, argv_, alone, _ in todo:
            print("%-20s %s%s" % (name, " ".join(argv_), "  (alone)" if alone else ""))
        return 0
    logdir = os.path.join(RESULTS, "run_all_logs")
    os.makedirs(logdir, exist_ok=True)
    start = time.time()
    meta = dict(
        command="python -m benchmarks.run_all " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        commit=common.git(ROOT, "rev-parse", "--short", "HEAD"),
        clean=common.git(ROOT, "status", "--porcelain", "--untracked-files=no") == "",
        started=datetime.datetime.now().isoformat(timespec="seconds"),
        machine="%d cores; python %s" % (os.cpu_count() or 1, sys.version.split()[0]))
    if not (args.tfp or args.peers) and (not args.only or "tf_privacy_compare" in args.only):
        meta["skipped"] = [dict(name="tf_privacy_compare", why="no --tfp interpreter given")]
    records = [_run_one(name, argv_, outputs, logdir) for name, argv_, alone, outputs in todo
               if alone]
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = [pool.submit(_run_one, name, argv_, outputs, logdir)
                   for name, argv_, alone, outputs in todo if not alone]
        records += [f.result() for f in futures]
    meta["seconds"] = time.time() - start
    path = os.path.join(RESULTS, "run_all.json")
    if args.merge and os.path.exists(path):
        # The sitting's description stays; this run's records replace
        # theirs by name and are listed as re-runs.
        with open(path) as f:
            old = json.load(f)
        again = {r["name"] for r in records}
        records = [r for r in old["runs"] if r["name"] not in again] + [
            dict(r, rerun=meta["command"]) for r in records]
        old["meta"].setdefault("reruns", []).append(
            {k: meta[k] for k in ("command", "commit", "started")})
        meta = old["meta"]
    common.write_outputs("run_all", dict(meta=meta, runs=records), _markdown(meta, records),
                         RESULTS)
    print("wrote benchmarks/results/run_all.md")
    return 0 if all(r["exit"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
