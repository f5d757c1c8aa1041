"""AggregationMethod.CUSTOM: list-of-slices form vs vector form.

    python -m benchmarks.custom_forms [--batches 32,64,...] [--repeats N]

`custagg.gradients(ys, params, aggregation_method=CUSTOM, gradient_factors=f)`
on a dense net's per-example loss `[B]`, `ys` the loss (vector), its slices
(list) or `tf.unstack(loss)`: the call's build time and ops, the run time.
Issue 2's acceptance at B=512: the list form builds in at most 2x the vector
form's time and runs within 1.3x. Results: benchmarks/results/custom_forms.*.
"""

import argparse
import functools
import gc
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import custagg  # noqa: E402
from benchmarks import common  # noqa: E402

tf.compat.v1.disable_eager_execution()

MODELS = {"softmax_784_10": [10], "mlp_784_256_256_10": [256, 256, 10]}
FORMS = {"vector": lambda loss, batch: loss,
         "list": lambda loss, batch: [loss[i] for i in range(batch)],
         "unstack": lambda loss, batch: tf.unstack(loss)}
# A ratio: (the form's figure, the vector form's figure it is over).
RATIOS = {"build_call": ("call_s", "call_s"), "build_call_cpu": ("call_cpu_s", "call_cpu_s"),
          "build_graph": ("graph_s", "graph_s"), "build_with_slices": ("with_slices_s", "call_s"),
          "ops_call": ("call_ops", "call_ops"), "ops_with_slices": ("with_slices_ops", "call_ops"),
          "run": ("run_s", "run_s")}
ACCEPT_B = 512
ACCEPT_BUILD, ACCEPT_RUN = 2.0, 1.3


def build(layers, batch, form, seed=0):
    """One graph of a dense ReLU net's per-example cross-entropy `[B]` and
    the CUSTOM gradients of `form`: timings (`call_s` the call alone, its
    process CPU time `call_cpu_s`, `with_slices_s` with the caller's slicing,
    `graph_s` model and call), op counts and what to run."""
    rng = np.random.RandomState(seed)
    graph = tf.Graph()
    with graph.as_default():
        t0 = time.perf_counter()
        x = tf.compat.v1.placeholder(tf.float32, [batch, 784], name="x")
        labels = tf.compat.v1.placeholder(tf.int64, [batch], name="labels")
        h, params, n_in = x, [], 784
        for k, n_out in enumerate(layers):
            w = tf.compat.v1.Variable((rng.normal(size=(n_in, n_out)) / np.sqrt(n_in)).astype(
                np.float32), name="w%d" % k)
            b = tf.compat.v1.Variable(np.zeros(n_out, np.float32), name="b%d" % k)
            h = tf.matmul(h, w) + b
            h, params, n_in = (tf.nn.relu(h) if k + 1 < len(layers) else h), params + [w, b], n_out
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=h)
        f = tf.compat.v1.placeholder(tf.float32, [batch], name="factors")
        model_s = time.perf_counter() - t0
        n0 = len(graph.get_operations())
        t0 = time.perf_counter()
        ys = FORMS[form](loss, batch)
        slicing_s = time.perf_counter() - t0
        n1 = len(graph.get_operations())
        # The slicing's garbage is collected here, untimed: a collector
        # pause it causes can otherwise land in the call (it did at B=512).
        gc.collect()
        t1, c1 = time.perf_counter(), time.process_time()
        grads = custagg.gradients(ys, params, aggregation_method=custagg.AggregationMethod.CUSTOM,
                                  gradient_factors=f)
        call_s, call_cpu_s = time.perf_counter() - t1, time.process_time() - c1
        n2 = len(graph.get_operations())
        init = tf.compat.v1.global_variables_initializer()
    return {"graph": graph, "grads": grads, "init": init, "feeds": (x, labels, f),
            "call_s": call_s, "call_cpu_s": call_cpu_s, "with_slices_s": slicing_s + call_s,
            "graph_s": model_s + call_s, "call_ops": n2 - n1, "with_slices_ops": n2 - n0}


def measure(layers, batch, build_repeats, repeats, warmup=3):
    """A row: each form's median timings and op counts, the list and unstack
    forms' ratios to the vector form, and the forms' largest difference."""
    builds = {form: [] for form in FORMS}
    for _ in range(build_repeats):
        for form in builds:   # alternating, each after a collection: load hits all alike
            gc.collect()
            builds[form].append(build(layers, batch, form))
    rng = np.random.RandomState(1)
    data = (rng.uniform(size=(batch, 784)).astype(np.float32), rng.randint(0, 10, size=batch),
            rng.uniform(size=batch).astype(np.float32))
    sessions, runs = {}, {}
    for form, bs in builds.items():
        sessions[form] = sess = common.session(bs[0]["graph"], 0)
        sess.run(bs[0]["init"])
        runs[form] = functools.partial(sess.run, bs[0]["grads"], dict(zip(bs[0]["feeds"], data)))
    for _ in range(warmup - 1):
        for fn in runs.values():
            fn()
    # One more warm-up run each, then `repeats` timed runs, the forms in turn.
    run_s = common.interleaved(runs, [()] * (repeats + 1))[0]
    values = {form: fn() for form, fn in runs.items()}
    for sess in sessions.values():
        sess.close()
    row = {"batch": batch, "max_abs_diff": max(
        float(np.max(np.abs(a - b))) for form in ("list", "unstack")
        for a, b in zip(values["vector"], values[form]))}
    for form, bs in builds.items():
        row[form] = {k: statistics.median(b[k] for b in bs)
                     for k in ("call_s", "call_cpu_s", "graph_s", "with_slices_s")}
        row[form].update(call_ops=bs[0]["call_ops"], with_slices_ops=bs[0]["with_slices_ops"],
                         run_s=run_s[form])
    for key, form, names in (("ratio", "list", RATIOS),
                             ("ratio_unstack", "unstack", ("build_call", "build_with_slices", "run"))):
        row[key] = {k: row[form][RATIOS[k][0]] / row["vector"][RATIOS[k][1]] for k in names}
    return row


def to_markdown(result):
    load = result.get("load_average", {})
    lines = [
        "# CUSTOM aggregation: list-of-slices form vs vector form", "",
        "`%s` on %s (%d CPUs), TensorFlow %s, Python %s%s." % (
            result["command"], result["machine"], result["cpus"], result["tensorflow"],
            result["python"], "; 1-minute load average %s at the start, %s at the end (this "
            "run adds about 1)" % (load.get("start"), load.get("end")) if load else ""), "",
        "- call: wall-clock ms of the `custagg.gradients` call (median of %d fresh graphs per "
        "form, the forms alternating, garbage collected before each call); cpu: its process "
        "CPU time;" % result["build_repeats"],
        "- graph: the whole graph (model + call), the slicing excluded;",
        "- +slices: the call plus building `[loss[i] for i in range(B)]` (the caller's code);",
        "- unstack: the list built with `tf.unstack(loss)` (one op for all B slices);",
        "- ops: ops the call adds (with the slices in brackets);",
        "- run: median of %d runs fetching the gradients (interleaved)." % result["repeats"],
        "", "Ratios are list / vector.", ""]
    for model, rows in result["models"].items():
        lines += ["## %s" % model, "", common.md_table(
            ["B", "call ms: vector / list (ratio)", "cpu ratio", "graph ratio",
             "+slices ms (ratio)", "ops: vector / list (+slices)", "run ms: vector / list (ratio)",
             "unstack: call ms (ratio), +unstack ms (ratio), run ratio"],
            [["%d" % row["batch"],
              "%.1f / %.1f (%.2fx)" % (1e3 * row["vector"]["call_s"], 1e3 * row["list"]["call_s"],
                                       row["ratio"]["build_call"]),
              "%.2fx" % row["ratio"]["build_call_cpu"], "%.2fx" % row["ratio"]["build_graph"],
              "%.0f (%.1fx)" % (1e3 * row["list"]["with_slices_s"],
                                row["ratio"]["build_with_slices"]),
              "%d / %d (%d)" % (row["vector"]["call_ops"], row["list"]["call_ops"],
                                row["list"]["with_slices_ops"]),
              "%.2f / %.2f (%.2fx)" % (1e3 * row["vector"]["run_s"], 1e3 * row["list"]["run_s"],
                                       row["ratio"]["run"]),
              "%.1f (%.2fx), %.1f (%.2fx), %.2fx" % (
                  1e3 * row["unstack"]["call_s"], row["ratio_unstack"]["build_call"],
                  1e3 * row["unstack"]["with_slices_s"],
                  row["ratio_unstack"]["build_with_slices"], row["ratio_unstack"]["run"])]
             for row in rows])]
    lines += ["## Acceptance at B=%d" % ACCEPT_B, ""] + [
        "- %s: %s" % (c["what"], "PASS" if c["pass"] else "FAIL") for c in result["acceptance"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="32,64,128,256,512,1024")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    result = {
        "command": ("python -m benchmarks.custom_forms " + " ".join(
            argv if argv is not None else sys.argv[1:])).rstrip(),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "tensorflow": tf.__version__, "python": platform.python_version(),
        "repeats": args.repeats, "build_repeats": 5, "models": {}, "acceptance": [],
        # Other processes' load disturbs the wall clock (cpu less so).
        "load_average": {"start": round(os.getloadavg()[0], 2)}}
    for model in args.models.split(","):
        result["models"][model] = []
        for batch in [int(b) for b in args.batches.split(",")]:
            row = measure(MODELS[model], batch, result["build_repeats"], args.repeats)
            result["models"][model].append(row)
            q = row["ratio"]
            print("%-20s B=%-5d build %.2fx (+slices %.2fx) ops %.2fx run %.2fx  unstack build "
                  "%.2fx  diff %.1e" % (model, batch, q["build_call"], q["build_with_slices"],
                                        q["ops_call"], q["run"],
                                        row["ratio_unstack"]["build_call"], row["max_abs_diff"]),
                  flush=True)
            if batch == ACCEPT_B:
                result["acceptance"] += [
                    {"what": "%s: list call builds <= %.1fx vector (wall %.2fx, cpu %.2fx; whole "
                     "graph %.2fx)" % (model, ACCEPT_BUILD, q["build_call"], q["build_call_cpu"],
                                       q["build_graph"]), "pass": q["build_call"] <= ACCEPT_BUILD},
                    {"what": "%s: list run <= %.1fx vector (%.2fx)" % (model, ACCEPT_RUN, q["run"]),
                     "pass": q["run"] <= ACCEPT_RUN}]
    result["load_average"]["end"] = round(os.getloadavg()[0], 2)
    print(common.write_outputs("custom_forms", result, to_markdown(result)))
    return 0 if all(c["pass"] for c in result["acceptance"]) else 1


if __name__ == "__main__":
    sys.exit(main())
