"""Framework-free helpers shared by the orchestrator, the workers and the benchmarks.

Checks: every system is compared with TensorFlow's gradient of ONE example
looped over the batch, kept as a "signature": `norms` [B], `proj/<v>` [B]
(<g_i[v], r_v>, r_v a fixed random vector), `sum/<v>`, `wsum/<v>` (sum_i
f_i g_i[v], fixed factors f) and `csum/<v>` (sum_i min(1, C/||g_i||)
g_i[v], C the median norm: about half the examples clipped).
"""
import json
import os
import platform
import statistics
import subprocess
import time

import numpy as np

from benchmarks import memory

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TOLERANCE = 1e-3          # max |a - b| / max |b|, per array
NOISE_MULTIPLIER = 1.0    # DP-SGD noise stddev = NOISE_MULTIPLIER * C


def projection_vector(name, size):
    """The fixed random vector r_v used by the `proj/<v>` check."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(name)) % (2 ** 31)
    return np.random.RandomState(seed).normal(size=size).astype(np.float64)


def factors(batch_size):
    """Fixed gradient factors for task "custom" (some negative on purpose)."""
    return np.random.RandomState(7).uniform(-1.0, 2.0, size=batch_size).astype(np.float32)


class SignatureBuilder:
    """The reference signature from per-example gradients, in two passes:
    `add` each example's (norms, projections, sums), `finish_pass1` (picks
    C), then `add_clipped` each again."""

    def __init__(self, names, shapes, batch_size):
        self.names, self.shapes, self.batch_size = list(names), list(shapes), batch_size
        self.f = factors(batch_size).astype(np.float64)
        self.r = {n: projection_vector(n, int(np.prod(s))) for n, s in zip(names, shapes)}
        self.sig = {"norms": np.zeros(batch_size)}
        for n, s in zip(names, shapes):
            self.sig["proj/" + n] = np.zeros(batch_size)
            for k in ("sum/", "wsum/", "csum/"):
                self.sig[k + n] = np.zeros(s)

    def add(self, i, grads):
        sq = 0.0
        for n, g in zip(self.names, grads):
            g = np.asarray(g, np.float64)
            sq += float(np.sum(g * g))
            self.sig["proj/" + n][i] = float(g.ravel() @ self.r[n])
            self.sig["sum/" + n] += g
            self.sig["wsum/" + n] += self.f[i] * g
        self.sig["norms"][i] = np.sqrt(sq)

    def finish_pass1(self):
        self.clip = float(np.median(self.sig["norms"]))
        self.scale = np.minimum(1.0, self.clip / np.maximum(self.sig["norms"], 1e-30))

    def add_clipped(self, i, grads):
        for n, g in zip(self.names, grads):
            self.sig["csum/" + n] += self.scale[i] * np.asarray(g, np.float64)

    def save(self, path):
        out = dict(self.sig, factors=self.f.astype(np.float32), clip=np.array(self.clip))
        tmp = path + ".tmp.npz"
        np.savez(tmp, **out)
        os.replace(tmp, path)


def load_signature(path):
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def rel_err(value, ref):
    value, ref = np.asarray(value, np.float64), np.asarray(ref, np.float64)
    if value.shape != ref.shape:
        return float("inf")
    if ref.size == 0:
        return 0.0
    scale = max(float(np.max(np.abs(ref))), 1e-12)
    return float(np.max(np.abs(value - ref))) / scale


def compare(values, sig):
    """("pass" or "fail", worst relative error, its key) of {signature key:
    array} against the reference signature."""
    errs = {key: rel_err(value, sig[key]) for key, value in values.items()}
    errs = {k: e if np.isfinite(e) else float("inf") for k, e in errs.items()}
    worst_key = max(errs, key=errs.get, default=None)
    worst = errs.get(worst_key, 0.0)
    ok = worst_key is not None and worst <= TOLERANCE
    return ("pass" if ok else "fail"), worst, worst_key


def signature_of_per_example(names, per_example):
    """Signature entries (norms, proj/<v>) of materialized per-example grads."""
    out, sq = {}, None
    for n, g in zip(names, per_example):
        # float32 on purpose: at B=512 the text model's gradients are 650 MB.
        g = np.asarray(g, np.float32).reshape(g.shape[0], -1)
        r = projection_vector(n, g.shape[1]).astype(np.float32)
        out["proj/" + n] = (g @ r).astype(np.float64)
        s = np.einsum("ij,ij->i", g, g).astype(np.float64)
        sq = s if sq is None else sq + s
    out["norms"] = np.sqrt(sq)
    return out


def dense_value(value, shape):
    """A fetched gradient as a dense array (IndexedSlicesValue -> scatter-add)."""
    if hasattr(value, "indices") and hasattr(value, "values"):
        out = np.zeros(shape, np.float64)
        np.add.at(out, np.asarray(value.indices), np.asarray(value.values, np.float64))
        return out
    return np.asarray(value)


def timed_ms(fn):
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def time_against_floor(system_fn, floor_fn, repeats, budget_s, first_ms):
    """(median ms of system, of floor, timed pairs), run alternately so load
    drifts hit both, after one more warm-up run: `repeats` pairs, fewer once
    `budget_s` has gone (min(3, repeats)). `first_ms`: the system's first run;
    above `budget_s` it is the only warm-up and one pair is timed."""
    slow = first_ms / 1e3 > budget_s
    if not slow:
        system_fn()
    min_runs = 1 if slow else min(3, repeats)
    sys_ms, floor_ms = [], []
    start = time.perf_counter()
    for _ in range(max(1, repeats)):
        floor_ms.append(timed_ms(floor_fn))
        sys_ms.append(timed_ms(system_fn))
        if len(sys_ms) >= min_runs and time.perf_counter() - start > budget_s:
            break
    return statistics.median(sys_ms), statistics.median(floor_ms), len(sys_ms)


def interleaved(runs, data, peaks=None):
    """({key: median s}, {key: peak bytes}): `runs` {key: fn(*args)} each run
    once on `data[0]`, then timed in turn on each of `data[1:]` (so load
    falls on all alike); `peaks` {key: fn(*args) -> bytes} on `data[0]`."""
    for fn in runs.values():
        fn(*data[0])
    times = {k: [] for k in runs}
    for args in data[1:]:
        for k, fn in runs.items():
            t = time.perf_counter()
            fn(*args)
            times[k].append(time.perf_counter() - t)
    return ({k: float(np.median(v)) for k, v in times.items()},
            {k: fn(*data[0]) for k, fn in (peaks or {}).items()})


# New sessions whose peaks `tf_peaks` takes the median of.
PEAK_SESSIONS = 5


def tf_peaks(graph, init, feed, fetches, threads=1, sessions=PEAK_SESSIONS):
    """Each of `fetches` ({name: fetch}) its median peak bytes over
    `sessions` new sessions on `graph` (each runs `init`, then one traced
    step per fetch): {name: bytes, "range_mb": {name: [lowest, highest] MB},
    "sessions": sessions}. Why the median of new sessions (the executor's op
    order, which a plain gradient's peak follows, differs between sessions
    and holds within one): docs/benchmarks.md, "One figure from five sessions"."""
    samples = {name: [] for name in fetches}
    for _ in range(sessions):
        with session(graph, threads) as sess:
            sess.run(init)
            for name, fetch in fetches.items():
                samples[name].append(memory.step_peak_bytes(sess, fetch, feed)[0])
    out = {name: statistics.median(v) for name, v in samples.items()}
    out.update(range_mb={name: [memory.mb(min(v)), memory.mb(max(v))]
                         for name, v in samples.items()}, sessions=sessions)
    return out


def measured(sig, values, system_fn, floor_fn, cfg, first_run_ms, peaks, **extra):
    """A run's record: `values` checked against the reference signature
    `sig` (None: no check), `system_fn` timed against `floor_fn`
    (`time_against_floor`), then `peaks()` -> (floor's, system's) peak bytes
    (traced after the timed runs: tracing slows a step) or `tf_peaks`'s
    dict (its ranges kept as `peak_range_mb`); `extra` fields added."""
    check, check_err, check_key = compare(values, sig) if sig else ("n/a", None, None)
    median_ms, floor_ms, repeats = time_against_floor(
        system_fn, floor_fn, cfg["repeats"], cfg["budget_s"], first_run_ms)
    peaks = peaks()
    if isinstance(peaks, dict):         # tf_peaks': medians, and their ranges
        extra = dict(extra, peak_range_mb=peaks["range_mb"], peak_sessions=peaks["sessions"])
        peaks = peaks["floor"], peaks["system"]
    floor_peak, peak = peaks
    return dict(dict(
        status="ok", note="", n_ops=None, first_run_ms=first_run_ms, median_ms=median_ms,
        floor_ms=floor_ms, ratio_to_floor=median_ms / floor_ms, check=check,
        check_err=check_err, check_key=check_key, repeats=repeats,
        peak_mb=memory.mb(peak), floor_peak_mb=memory.mb(floor_peak),
        peak_ratio=peak / float(floor_peak) if peak is not None and floor_peak else None,
        peak_method="tf step_stats allocation records (benchmarks/memory.py)"), **extra)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(extra=None):
    return dict({
        "cpu": cpu_model(), "cores": os.cpu_count(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1),
        "platform": platform.platform(), "python": platform.python_version(),
        "loadavg_start": os.getloadavg()}, **(extra or {}))


def git(tree, *argv):
    """`git -C tree ARGV`'s output, stripped; "?" if git fails."""
    try:
        return subprocess.run(["git", "-C", tree] + list(argv), capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def dump_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=_json_default)
    os.replace(tmp, path)


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def legacy_keras():
    """Keras 2 layers in graph mode: TF_USE_LEGACY_KERAS=1 where tf-keras is
    installed (TF >= 2.16; on 2.12-2.15 tf.keras is Keras 2 and the variable
    would make TF look for tf-keras). Call before importing TF."""
    import importlib.util
    if importlib.util.find_spec("tf_keras") is not None:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")


def session(graph=None, threads=1):
    """A TF1 session on `graph` with `threads` intra- and inter-op threads."""
    import tensorflow as tf
    return tf.compat.v1.Session(graph=graph, config=tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=threads, inter_op_parallelism_threads=threads))


def md_table(headers, rows, align=None):
    """A markdown table: `rows` of cell strings; `align` per column
    ("---", "---:"; default left)."""
    lines = ["| %s |" % " | ".join(headers), "|%s|" % "|".join(align or ["---"] * len(headers))]
    return "\n".join(lines + ["| %s |" % " | ".join(map(str, r)) for r in rows]) + "\n"


def table(columns, rows):
    """A markdown table of `rows` (dicts): `columns` [(header, key or fn(row),
    format)]; a column whose format is not "%s" is right-aligned."""
    return md_table([c[0] for c in columns],
                    [[fmt % (key(r) if callable(key) else r[key]) for _, key, fmt in columns]
                     for r in rows], ["---" if c[2] == "%s" else "---:" for c in columns])


def write_outputs(name, obj, md, out=RESULTS):
    """`out`/<name>.json (`obj`) and <name>.md (`md`); returns `md`."""
    os.makedirs(out, exist_ok=True)
    dump_json(os.path.join(out, name + ".json"), obj)
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write(md)
    return md
