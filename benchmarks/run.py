"""The harness: `python -m benchmarks [MODE] [options]`, one run for every mode.

Each configuration (model, B, task, system) runs in a forked child of a warm
worker server (benchmarks/worker.py) that builds model, floor and system in
one graph, checks the system against the loop reference and times system and
floor alternately; one that hangs or crashes is recorded as "timeout" or
"failed". The modes are presets of one run (`PRESETS`); each writes its
records (<stem>.json), its page and logs/ to --out. docs/benchmarks.md
describes the tasks, systems and figures.
"""
import argparse
import collections
import datetime
import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

from benchmarks import common, models
from benchmarks.systems import SYSTEMS, TASK_ALIASES, TASKS

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

_JOBS = 2 if (os.cpu_count() or 1) >= 2 else 1
_RUN = dict(batch_sizes=[32, 128, 512], timeout=600.0, budget=2.0, slow_limit=30.0, jobs=_JOBS)
# One configuration at a time (the zoo's full-size models): no timeout to speak of.
_ZOO = dict(timeout=3600.0, budget=10.0, slow_limit=0.0, jobs=1, out=common.RESULTS)
PRESETS = {
    "full": dict(_RUN, models=[m for m in models.MODELS if m not in models.CONTROL_FLOW_ONLY],
                 repeats=10, timeout=120.0, out=common.RESULTS),
    "quick": dict(_RUN, models=["mlp", "text"], batch_sizes=[32], repeats=3, timeout=60.0,
                  budget=0.5, slow_limit=20.0, out=os.path.join(common.RESULTS, "quick")),
    # Issue 11: the loop models against tf.vectorized_map and the vmap peers.
    "control_flow": dict(_RUN, models=["lstm", "gru", "keras_lstm", "keras_gru", "norule_rnn"],
                         tasks=["norms", "clip", "dpsgd"],
                         systems=["custagg_auto", "tf_vmap", "jax_vmap", "torch_func"],
                         repeats=5, out=os.path.join(common.RESULTS, "control_flow")),
    # Issue 37: custagg beside the DP peers in their fastest configurations
    # (interpreters from benchmarks/peers_env.sh); writes peers.{json,md}.
    # 15 pairs or 3 s a cell: with 3 pairs and 1 s, the GRU's clipped sum at
    # B=512 read 2.17x and its DP step, the same sum plus noise, 1.40x.
    "peers": dict(_RUN, models=["mlp", "cnn", "text", "lstm", "gru", "transformer"],
                  tasks=["clip", "dpsgd"], budget=3.0,
                  systems=["custagg_auto", "opacus_ghost", "opacus", "jax_privacy", "tfp_fast"],
                  repeats=15, out=common.RESULTS, stem="peers"),
    "zoo": dict(_ZOO, batch_sizes=[64, 256], repeats=15, tasks=["norms", "clip"], stem="zoo"),
    # Issue 24's models; issue 34's by name (`--models unet,...`).
    "tf1_models": dict(_ZOO, batch_sizes=[64], repeats=5, tasks=["clip"], stem="tf1_models"),
}
# The titles and introductions of zoo.md and tf1_models.md.
ZOO_PAGES = {
    "zoo": ("Zoo benchmark (`python -m benchmarks --zoo`)",
            "Models written the way users write them (benchmarks/zoo_models.py, full size, "
            "float32, dynamic batch), custagg_auto with C = 1 and no loop reference; task step: "
            "mnist_deep's DP step (DPOptimizer around Adam) over the tutorial's Adam step, its "
            "floor."),
    "tf1_models": ("Other people's TF1 models (`python -m benchmarks --tf1-models`)",
                   "Issue 24's yardstick: the TF1 models of benchmarks/zoo_models.py (full size, "
                   "float32, dynamic batch and sequence length), custagg_auto with C = 1 and no "
                   "loop reference; Plans: variables per form of the plan.")}

# Relative wall time of each model's configurations in a full run (measured
# 2026-12-03), used to deal the costliest models out first with --jobs.
_MODEL_COST = {"lstm": 6, "gru": 6, "keras_lstm": 6, "keras_gru": 6, "norule_rnn": 4, "cnn": 5,
               "text": 4, "transformer": 4, "mlp": 3, "softmax": 1}

RECORD_KEYS = ("model", "batch_size", "task", "system", "status", "note", "build_s", "n_ops",
               "first_run_ms", "median_ms", "peak_rss_mb", "floor_ms", "ratio_to_floor",
               "peak_mb", "floor_peak_mb", "peak_ratio", "check")
# Systems whose tasks all go through the same materialized per-example
# gradients: a timeout in one task predicts the others at the same B.
MATERIALIZING = {"tf_loop", "tf_vmap", "tf_jacobian", "jax_vmap", "torch_func", "opacus"}


def _csv(text, allowed=None, aliases=None, kind="value"):
    items = [aliases.get(t, t) if aliases else t for t in
             (t.strip() for t in text.split(",")) if t]
    bad = [t for t in items if allowed is not None and t not in allowed]
    if bad:
        raise argparse.ArgumentTypeError("unknown %s %s; choose from %s"
                                         % (kind, ", ".join(bad), ", ".join(allowed)))
    return items


def _sizes(text):
    sizes = [int(b) for b in _csv(text)]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("comma-separated integers >= 1, e.g. 64,256")
    return sizes


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Per-example gradient benchmark: custagg vs TF baselines vs peers.")
    presets = p.add_mutually_exclusive_group()
    for flag, text in (
            ("quick", "MLP and text at B=32, 3 repeats (< 3 min)"),
            ("control-flow", "issue 11's table: the loop models, tf_vmap and the vmap peers"),
            ("peers", "issue 37's table: custagg beside the DP peers (pass --python torch=, jax=, "
             "keras=)"),
            ("zoo", "the model zoo (benchmarks/zoo_models.py) at full size"),
            ("tf1-models", "issue 24's TF1 models (issue 34's by --models): the clipped sum")):
        presets.add_argument("--" + flag, dest="mode", action="store_const",
                             const=flag.replace("-", "_"), default="full", help=text + " (PRESETS)")
    p.add_argument("--models", type=_csv, help="comma list (default: the mode's; --models "
                   "without a mode: of %s)" % ",".join(models.MODELS))
    p.add_argument("--batch-sizes", type=_sizes, help="comma list (default: the mode's)")
    p.add_argument("--tasks", type=lambda s: _csv(s, list(TASKS), TASK_ALIASES, "task"),
                   help="comma list of %s (or a,b,b2,c,d)" % ",".join(TASKS))
    p.add_argument("--systems", type=lambda s: _csv(s, list(SYSTEMS), kind="system"),
                   help="comma list of %s" % ",".join(SYSTEMS))
    p.add_argument("--repeats", type=int, help="timed runs per configuration (default: the mode's)")
    p.add_argument("--budget", type=float,
                   help="stop repeating after this many seconds of timing (min 3 runs)")
    p.add_argument("--timeout", type=float, help="seconds per configuration (default: the mode's)")
    p.add_argument("--slow-limit", type=float,
                   help="skip a B^2 system when its cost estimated from a smaller B exceeds this")
    p.add_argument("--out", help="output folder")
    p.add_argument("--merge", action="store_true",
                   help="keep records of --out/results.json that this run does not redo")
    p.add_argument("--python", action="append", default=[], metavar="FRAMEWORK=PATH",
                   help="interpreter for a framework's workers, e.g. torch=/opt/peers/bin/python")
    p.add_argument("--jobs", type=int, help="configurations at once (default: the mode's)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--readme", metavar="PATH",
                   help="also rewrite the benchmark tables in PATH from --out's results")
    p.add_argument("--report-only", action="store_true",
                   help="only rewrite the mode's page from --out's JSON files")
    p.add_argument("--profile", action="store_true",
                   help="--zoo: print where each step's peak memory comes from; writes nothing")
    p.add_argument("--plans", action="store_true", help="--tf1-models: print each model's plan")
    args = p.parse_args(argv)
    for flag, mode in (("profile", "zoo"), ("plans", "tf1_models")):
        if getattr(args, flag) and args.mode != mode:
            p.error("--%s goes with --%s" % (flag, mode.replace("_", "-")))
    if args.merge and args.mode in ZOO_PAGES:
        p.error("--merge merges into results.json's records; --zoo and --tf1-models write "
                "their own files whole")
    defaults = dict(PRESETS[args.mode])
    args.stem = defaults.pop("stem", "results")
    known = list(models.MODELS)
    if args.mode in ZOO_PAGES:
        models.builders()                   # Keras 2 set up, then TensorFlow imported
        from benchmarks import zoo_models
        if args.mode == "zoo":
            known = list(zoo_models.ZOO) + list(models.HARNESS_ZOO)
            defaults["models"] = ["mnist_deep", "cnn"] if args.profile else list(zoo_models.ZOO)
        else:
            known = list(zoo_models.MODELS) + list(zoo_models.DYNAMIC_MODELS)
            defaults["models"] = list(zoo_models.MODELS)
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, list(value) if isinstance(value, list) else value)
    bad = [m for m in args.models if m not in known]
    if bad:
        p.error("unknown model(s) %s; choose from %s" % (", ".join(bad), ", ".join(known)))
    args.tasks = args.tasks or list(TASKS)
    if args.jobs < 1 or args.repeats < 1:
        p.error("--jobs and --repeats must be at least 1")
    if args.systems is None:
        args.systems = list(SYSTEMS)
    args.pythons = dict(item.partition("=")[::2] for item in args.python)
    return args


def _worker_env():
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_WAIT_POLICY="PASSIVE")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # One thread for every framework (TF sessions and torch also set it in
    # code). PASSIVE: OpenMP threads sleep instead of spinning, which
    # otherwise costs PyTorch 10-100x on a machine shared with other jobs.
    env.update(dict.fromkeys(("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"), "1"))
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                        "intra_op_parallelism_threads=1").strip()
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class ForkServer:
    """A warm `benchmarks.worker serve FRAMEWORK` process, restarted if it dies."""

    START_TIMEOUT = 300.0

    def __init__(self, key, python, log_dir, job=0):
        self.key, self.python, self.log_dir, self.job = key, python, log_dir, job
        self.proc, self.versions, self.error = None, None, None

    def ensure(self):
        if self.proc is not None and self.proc.poll() is None:
            return True
        log = open(os.path.join(self.log_dir, "server_%s_job%d.log" % (self.key, self.job)), "a")
        self.proc = subprocess.Popen(
            [self.python, "-m", "benchmarks.worker", "serve", self.key],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=REPO,
            env=_worker_env(), text=True, bufsize=1)
        log.close()
        reply = self._read(self.START_TIMEOUT)
        if reply is None or not reply.get("ready"):
            self.error = (reply or {}).get("error", "worker server did not start")
            self.close()
            return False
        self.versions, self.error = reply["versions"], None
        return True

    def _read(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line.strip() else None

    def run(self, request, timeout):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self._read(timeout + 60.0)  # the server itself enforces `timeout`
        if reply is None:
            self.close()
            return {"status": "timeout", "exit": None, "maxrss_mb": None, "wall_s": timeout}
        return reply

    def close(self):
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def plan(args):
    """The configurations, B ascending within each model (estimates need that).
    --zoo, --tf1-models: custagg_auto on a builder's models (`models.build`)
    with the plan's forms; mnist_deep also the DP step over its Adam step."""
    if args.mode in ZOO_PAGES:
        return [dict(model=m, batch_size=b, task=t, system="custagg_auto", framework="tf",
                     plan=True, builder=True)
                for m in args.models for b in sorted(args.batch_sizes)
                for t in list(args.tasks) + ["step"] * (m == "mnist_deep")]
    return [dict(model=m, batch_size=b, task=t, system=s, framework=SYSTEMS[s].framework)
            for m in args.models for b in sorted(args.batch_sizes) for t in args.tasks
            for s in args.systems if t in SYSTEMS[s].tasks]


def _same_family(rec, cfg):
    if rec["model"] != cfg["model"] or rec["system"] != cfg["system"]:
        return False
    return rec["task"] == cfg["task"] or cfg["system"] in MATERIALIZING


def predict_skip(cfg, done, args):
    """A 'skipped (...)' note when earlier results say this config cannot fit."""
    family = [r for r in done if _same_family(r, cfg) and r["batch_size"] <= cfg["batch_size"]]
    for r in family:
        if r["status"] == "timeout":
            where = "B=%d" % r["batch_size"]
            if r["task"] != cfg["task"]:
                where += " (task %s, same per-example computation)" % r["task"]
            return "skipped (timed out at %s)" % where
    ok = [r for r in family if r["status"] == "ok" and r["batch_size"] < cfg["batch_size"]
          and r["task"] == cfg["task"] and r.get("median_ms") is not None]
    if not ok:
        return None
    r = max(ok, key=lambda r: r["batch_size"])
    scale = cfg["batch_size"] / float(r["batch_size"])
    # Runs: the first, ~3 timed ones and the (slower) traced one of the peak.
    build_s, runs_s = r["build_s"] or 0.0, (r["first_run_ms"] + 5 * r["median_ms"]) / 1e3
    if SYSTEMS[cfg["system"]].quadratic:
        # Per-example loops: the graph grows ~B^1.6 (MLP: 6.1 s -> 51 s for B
        # 128 -> 512), each run ~B^2.
        est, limit = build_s * scale ** 1.6 + runs_s * scale ** 2 + 3.0, args.slow_limit
        what = "limit"
    else:
        # O(B) systems: the build and the first run's one-off setup do not grow
        # with B (pfor converts one example's ops whatever B: the while-loop
        # LSTM builds in 4.6 s at B=32 and 512); only the runs do.
        setup_s = build_s + max(0.0, r["first_run_ms"] - r["median_ms"]) / 1e3
        est = setup_s + 5 * r["median_ms"] / 1e3 * scale + 3.0
        limit, what = args.timeout, "timeout"
    if est > limit:
        return ("skipped (too slow: est %.0f s at B=%d from %.1f s build + %.0f ms/run at B=%d; "
                "%s %.0f s)" % (est, cfg["batch_size"], build_s, r["median_ms"],
                                r["batch_size"], what, limit))
    return None


def _code_hash():
    h = hashlib.sha1()
    for name in ("models.py", "common.py", os.path.join("systems", "tf_systems.py")):
        with open(os.path.join(HERE, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:10]


def execute(worker, cfg, dirs, tag):
    """Run one request through `worker`; returns (result dict, reply)."""
    result_path = os.path.join(dirs["tmp"], tag + ".json")
    log_path = os.path.join(dirs["logs"], tag + ".log")
    if os.path.exists(result_path):
        os.remove(result_path)
    request = {"cfg": cfg, "timeout": cfg["timeout"], "result_path": result_path,
               "log_path": log_path}
    reply = worker.run(request, cfg["timeout"])
    result = None
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
        os.remove(result_path)
    if reply["status"] == "timeout":
        result = {"status": "timeout", "note": "killed after the %.0f s timeout" % cfg["timeout"]}
    elif result is None:
        try:
            with open(log_path, errors="replace") as f:
                tail = " | ".join([l.strip() for l in f if l.strip()][-3:])[-400:]
        except OSError:
            tail = ""
        result = {"status": "failed", "note": "worker died (exit %s); log %s: %s" % (
            reply.get("exit"), os.path.relpath(log_path, REPO), tail)}
    return result, reply


def _progress(i, n, rec, wall):
    head = "[%3d/%d] %-11s B=%-4d %-6s %-22s" % (
        i, n, rec["model"], rec["batch_size"], rec["task"], rec["system"])
    if rec["status"] == "ok":
        body = "ok      %9.2f ms  x%-7.2f %s build %6.2fs  check %s" % (
            rec["median_ms"], rec["ratio_to_floor"],
            "mem %8.2f MB x%-6.2f" % (rec["peak_mb"], rec["peak_ratio"])
            if rec.get("peak_ratio") is not None else "mem -" + " " * 18,
            rec["build_s"] or 0.0, rec["check"])
    else:
        body = "%-7s %s" % (rec["status"], (rec["note"] or "")[:160])
    print("%s %s  (%.1fs)" % (head, body, wall), flush=True)


def _terminate(signum, frame):
    raise KeyboardInterrupt("signal %d" % signum)   # so `finally` stops the workers


def main(argv=None):
    args = parse_args(argv)
    if args.report_only:
        return report_only(args)
    if args.profile:
        from benchmarks.systems import tf_systems
        for name in args.models:
            tf_systems.profile(name, args.batch_sizes)
        return 0
    signal.signal(signal.SIGTERM, _terminate)
    dirs = {"logs": os.path.join(args.out, "logs"), "tmp": os.path.join(args.out, "logs", "tmp"),
            "cache": os.path.join(args.out, ".cache")}
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
    configs = plan(args)
    keys = sorted({c["framework"] for c in configs} | {"tf"})
    n_jobs = max(1, min(args.jobs, len({c["model"] for c in configs}) or 1))
    job_workers = [{k: ForkServer(k, args.pythons.get(k, sys.executable), dirs["logs"], job)
                    for k in keys} for job in range(n_jobs)]

    started = time.time()
    machine = common.machine_info({"command": "python -m benchmarks " + " ".join(
        sys.argv[1:] if argv is None else argv), "started": datetime.datetime.now().isoformat(
        timespec="seconds"), "threads": 1, "jobs": n_jobs, "settings": {
            k: getattr(args, k) for k in ("repeats", "budget", "timeout", "slow_limit", "jobs",
                                          "batch_sizes", "models", "tasks", "systems")}})
    print("benchmarks: %d configurations in %d job%s; %s, %d cores; out %s"
          % (len(configs), n_jobs, "" if n_jobs == 1 else "s", machine["cpu"], machine["cores"],
             os.path.relpath(args.out, REPO)), flush=True)

    old = []
    results_path = os.path.join(args.out, args.stem + ".json")
    if args.merge and os.path.exists(results_path):
        with open(results_path) as f:
            old = json.load(f)

    versions, references, done = {}, {}, []
    machine_info = {"short": None}
    code_hash = _code_hash()
    unavailable = {}
    lock = threading.Lock()      # guards versions, unavailable, done, outputs

    def start(workers, key):
        with lock:
            if key in unavailable:
                return
        t0 = time.monotonic()
        if workers[key].ensure():
            with lock:
                if key not in versions:
                    versions[key] = workers[key].versions or {}
                    print("  %s worker ready in %.1fs: %s" % (
                        key, time.monotonic() - t0, ", ".join(
                            "%s %s" % kv for kv in versions[key].items())), flush=True)
        else:
            with lock:
                unavailable[key] = workers[key].error
                print("  %s unavailable: %s" % (key, workers[key].error), flush=True)

    def run_config(cfg, workers):
        key, tf_key = cfg["framework"], "tf"
        start(workers, tf_key)      # the reference and the machine line need TensorFlow
        start(workers, key)
        with lock:
            if machine_info["short"] is None:
                tfv = versions.get(tf_key, {}).get("tensorflow", "?")
                machine_info["short"] = "%s, %d cores, TF %s" % (machine["cpu"], machine["cores"],
                                                                 tfv)
            missing = dict(unavailable)
            family = list(done)
        rec = dict({k: None for k in RECORD_KEYS}, status="failed", note="", check="n/a",
                   machine=machine_info["short"], **cfg)
        rec["loadavg_1m"] = os.getloadavg()[0]
        t0 = time.monotonic()
        # The harness's models are checked against the loop reference of
        # (model, B); only the job that owns a model computes its references.
        ref_key = None if cfg.get("builder") else (cfg["model"], cfg["batch_size"])
        ref_path = ref_key and os.path.join(dirs["cache"], "ref_%s_B%d_%s.npz" % (
            ref_key + (code_hash,)))
        if key in missing:
            rec.update(status="skipped", note="%s not available (%s); see "
                       "benchmarks/requirements-peers.txt" % (cfg["framework"], missing[key]))
        elif tf_key in missing:
            rec.update(status="skipped", note="reference needs TensorFlow: %s" % missing[tf_key])
        else:
            if ref_key and ref_key not in references:
                references[ref_key] = _reference(workers[tf_key], cfg, ref_path, args, dirs)
            skip = predict_skip(cfg, family, args)
            if ref_key and not references[ref_key]["ok"]:
                rec.update(status="skipped", note="no reference: " + references[ref_key]["note"])
            elif skip:
                rec.update(status="skipped", note=skip)
            else:
                tag = "_".join(str(cfg[k]) for k in ("model", "batch_size", "task", "system"))
                result, reply = execute(workers[key], dict(
                    cfg, repeats=args.repeats, budget_s=args.budget, timeout=args.timeout,
                    threads=1, ref_path=ref_path), dirs, tag)
                rec.update(result)
                if rec.get("peak_rss_mb") is None and reply.get("maxrss_mb"):
                    rec["peak_rss_mb"] = reply["maxrss_mb"]
                rec["wall_s"] = reply.get("wall_s")
        rec["note"] = rec.get("note") or ""
        plan_text = rec.pop("plan", None)
        with lock:
            done.append(rec)
            _progress(len(done), len(configs), rec, time.monotonic() - t0)
            if plan_text and args.plans:
                print(plan_text, flush=True)
            _write_outputs(args, _merged(args, old, done), machine, versions, references,
                           started, final=False)

    # Whole models are dealt to the jobs, costliest first (each job runs a
    # model's configurations in plan order: B ascending, so the skip
    # estimates of a larger B see the smaller ones).
    by_model = {}
    for cfg in configs:
        by_model.setdefault(cfg["model"], []).append(cfg)
    queue = sorted(by_model, key=lambda m: -_MODEL_COST.get(m, 1))
    failures = []

    def job(workers):
        try:
            while True:
                with lock:
                    if not queue or failures:
                        return
                    model = queue.pop(0)
                for cfg in by_model[model]:
                    run_config(cfg, workers)
        except BaseException as e:  # reported by the main thread
            failures.append(e)
        finally:
            for worker in workers.values():
                worker.close()

    threads = [threading.Thread(target=job, args=(w,), daemon=True) for w in job_workers]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.5)
    except BaseException:
        failures.append(KeyboardInterrupt())
        for workers in job_workers:
            for worker in workers.values():
                worker.close()
        raise
    if failures:
        raise failures[0]
    machine["loadavg_end"] = os.getloadavg()
    _write_outputs(args, _merged(args, old, done), machine, versions, references, started,
                   final=True)
    counts = collections.Counter(r["status"] for r in done)
    fails = sum(1 for r in done if r["check"] == "fail")
    print("done in %.0f s: %s; check failures: %d; results in %s" % (
        time.time() - started, ", ".join("%d %s" % (v, k) for k, v in sorted(counts.items())),
        fails, os.path.relpath(args.out, REPO)), flush=True)
    return 0


def _reference(worker, cfg, ref_path, args, dirs):
    """Writes the loop reference of (model, B) to `ref_path` unless cached:
    {"ok", "note"}."""
    if os.path.exists(ref_path):
        return {"ok": True, "note": "cached " + os.path.basename(ref_path)}
    t0 = time.monotonic()
    ref_cfg = {"kind": "reference", "framework": "tf", "model": cfg["model"],
               "batch_size": cfg["batch_size"], "ref_path": ref_path,
               "timeout": max(args.timeout, 300.0)}
    tag = "reference_%s_B%d" % (cfg["model"], cfg["batch_size"])
    result, _ = execute(worker, ref_cfg, dirs, tag)
    ok = result.get("status", "ok") == "ok" and os.path.exists(ref_path)
    note = result.get("note", "")
    print("  reference %s B=%d: %s (%.1fs)" % (cfg["model"], cfg["batch_size"], note if ok else
                                              "FAILED: " + note, time.monotonic() - t0),
          flush=True)
    return {"ok": ok, "note": note}


def _merged(args, old, done):
    """The records of this run, and --merge's old ones it did not redo, in
    the tables' order (--zoo and --tf1-models: as run)."""
    if args.stem not in ("results", "peers"):
        return list(done)

    def key(r):
        return (r["model"], r["batch_size"], r["task"], r["system"])

    def pos(seq, v):
        seq = list(seq)
        return seq.index(v) if v in seq else len(seq)
    keys = {key(r) for r in done}
    return sorted([r for r in old if key(r) not in keys] + done, key=lambda r: (
        pos(models.MODELS, r["model"]), r["batch_size"], pos(TASKS, r["task"]),
        pos(SYSTEMS, r["system"]), r["system"]))


def _meta_file(args):
    """The file of the run's description beside <stem>.json's list of records
    (--zoo, --tf1-models: None, their <stem>.json is {"meta", "records"})."""
    if args.mode in ZOO_PAGES:
        return None
    return "peers_machine.json" if args.stem == "peers" else "machine.json"


def report_only(args):
    """--report-only: the mode's page again from --out's JSON files."""
    meta_file = _meta_file(args)
    path = os.path.join(args.out, args.stem + ".json")
    if not os.path.exists(path):
        raise SystemExit("--report-only: no %s; run the mode first" % path)
    with open(path) as f:
        saved = json.load(f)
    if meta_file:
        meta_path = os.path.join(args.out, meta_file)
        meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
        records = saved
    elif "records" in saved:
        records, meta = saved["records"], saved["meta"]
    else:
        raise SystemExit("--report-only: %s.json was written by the harness before its "
                         "zoo and TF1 models became its modes; run the mode again" % args.stem)
    _page(args, records, meta)
    return 0


def _write_outputs(args, records, machine, versions, references, started, final):
    """--out/<stem>.json after every configuration; at the end (`final`) the
    run's description (machine.json, --merge: the first run's with this one
    under "merged_runs"; --peers: peers_machine.json) and the mode's page."""
    meta_file = _meta_file(args)
    meta = dict(machine, versions=versions, wall_s=time.time() - started)
    common.dump_json(os.path.join(args.out, args.stem + ".json"),
                     records if meta_file else {"meta": meta, "records": records})
    if not final:
        return
    meta_path = meta_file and os.path.join(args.out, meta_file)
    if meta_file == "machine.json":
        meta.update(references={"%s B=%d" % k: v["note"] for k, v in references.items()},
                    tolerance=common.TOLERANCE)
        if args.merge and os.path.exists(meta_path):
            with open(meta_path) as f:
                base = json.load(f)
            base.setdefault("merged_runs", []).append(
                {k: meta[k] for k in ("command", "started", "wall_s", "loadavg_start",
                                      "loadavg_end") if k in meta})
            for fw, v in versions.items():
                base.setdefault("versions", {}).setdefault(fw, {}).update(v)
            meta = base
    if meta_file:
        common.dump_json(meta_path, meta)
    _page(args, records, meta)


def _page(args, records, meta):
    """The mode's page: <stem>.md (--zoo, --tf1-models), peers.md, or
    results.md, the plots (unless --no-plot) and --readme's tables."""
    from benchmarks import report
    if args.mode in ZOO_PAGES:
        return report.write_markdown(os.path.join(args.out, args.stem + ".md"), records, meta,
                                     *ZOO_PAGES[args.mode])
    if args.stem == "peers":
        return report.write_peers(os.path.join(args.out, "peers.md"), records, meta)
    report.write_markdown(os.path.join(args.out, "results.md"), records, meta)
    wrote = "results.md"
    if not args.no_plot:
        try:
            for name, metric in (("results.png", "time"), ("results_memory.png", "memory")):
                report.write_plot(os.path.join(args.out, name), records, metric=metric)
            wrote += ", results.png and results_memory.png"
        except Exception as e:  # a plot must never lose the numbers
            print("  plot failed: %s" % e, flush=True)
    print("wrote %s in %s" % (wrote, os.path.relpath(args.out, REPO)), flush=True)
    if args.readme:
        report.update_readme(args.readme, records, meta, results_md=os.path.relpath(
            os.path.join(args.out, "results.md"), os.path.dirname(os.path.abspath(args.readme))))
        print("updated the benchmark tables in %s" % args.readme, flush=True)


if __name__ == "__main__":
    sys.exit(main())
