"""AggregationMethod.CUSTOM: list-of-slices form vs vector form.

    python -m benchmarks.custom_forms [--batches 32,64,...] [--repeats N]

For each model (softmax regression 784-10, MLP 784-256-256-10) and batch
size B, the per-example loss `loss` [B] is differentiated with
`custagg.gradients(..., aggregation_method=CUSTOM, gradient_factors=f)` in
two forms:

* vector: `ys = loss`;
* list:   `ys = [loss[i] for i in range(B)]`.

Measured, all in this one process:

* construction seconds of the gradients call (median of `--build-repeats`
  fresh graphs), and for the list form also with the building of the B
  slices included (the slicing is the caller's code, the call is ours);
* op count added to the graph (by the call; and with the slices);
* run time: median over `--repeats` runs of fetching the gradients (the two
  forms' runs are interleaved, so drifting machine load hits both alike).

Ratios are list / vector. Acceptance (issue #2): at B=512 the list form's
gradients call builds in at most 2x the vector form's time and runs within
1.3x. Results go to benchmarks/results/custom_forms.json and .md.
"""

import argparse
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
ACCEPT_B = 512
ACCEPT_BUILD, ACCEPT_RUN = 2.0, 1.3


def build_model(layers, batch, seed=0):
    """Per-example cross-entropy [B] of a dense ReLU net, and its params."""
    rng = np.random.RandomState(seed)
    x = tf.compat.v1.placeholder(tf.float32, [batch, 784], name="x")
    labels = tf.compat.v1.placeholder(tf.int64, [batch], name="labels")
    h, params, n_in = x, [], 784
    for k, n_out in enumerate(layers):
        w = tf.compat.v1.Variable(
            (rng.normal(size=(n_in, n_out)) / np.sqrt(n_in)).astype(
                np.float32), name="w%d" % k)
        b = tf.compat.v1.Variable(np.zeros(n_out, np.float32), name="b%d" % k)
        h = tf.matmul(h, w) + b
        if k + 1 < len(layers):
            h = tf.nn.relu(h)
        params += [w, b]
        n_in = n_out
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                          logits=h)
    return x, labels, loss, params


def build(layers, batch, form):
    """Builds one graph; returns timings, op counts and what to run.

    Times: `call_s` the gradients call alone, `with_slices_s` the call and
    the slicing before it, `graph_s` the whole graph (model, slicing
    excluded, and call); `call_cpu_s` is the call's process CPU time, which
    other processes' load disturbs less than the wall clock.
    """
    graph = tf.Graph()
    with graph.as_default():
        tm0 = time.perf_counter()
        x, labels, loss, params = build_model(layers, batch)
        f = tf.compat.v1.placeholder(tf.float32, [batch], name="factors")
        model_s = time.perf_counter() - tm0
        n0 = len(graph.get_operations())
        t0 = time.perf_counter()
        ys = {"vector": lambda: loss,
              "list": lambda: [loss[i] for i in range(batch)],
              "unstack": lambda: tf.unstack(loss)}[form]()
        slicing_s = time.perf_counter() - t0
        n1 = len(graph.get_operations())
        # The slicing's garbage is collected here, untimed: otherwise the
        # collector pause it causes can land in the call (it did at B=512).
        gc.collect()
        t1 = time.perf_counter()
        c1 = time.process_time()
        grads = custagg.gradients(
            ys, params, aggregation_method=custagg.AggregationMethod.CUSTOM,
            gradient_factors=f)
        t2 = time.perf_counter()
        c2 = time.process_time()
        n2 = len(graph.get_operations())
        init = tf.compat.v1.global_variables_initializer()
    return {"graph": graph, "grads": grads, "init": init,
            "feeds": (x, labels, f), "call_s": t2 - t1,
            "call_cpu_s": c2 - c1, "with_slices_s": slicing_s + (t2 - t1),
            "graph_s": model_s + (t2 - t1), "call_ops": n2 - n1,
            "with_slices_ops": n2 - n0}


def measure(layers, batch, build_repeats, repeats, warmup=3):
    # Builds alternate between the forms, each after a garbage collection,
    # so that machine load and collector pauses fall on both alike.
    builds = {"vector": [], "list": [], "unstack": []}
    for _ in range(build_repeats):
        for form in builds:
            gc.collect()
            builds[form].append(build(layers, batch, form))
    rng = np.random.RandomState(1)
    data = (rng.uniform(size=(batch, 784)).astype(np.float32),
            rng.randint(0, 10, size=batch),
            rng.uniform(size=batch).astype(np.float32))
    sessions, runs = {}, {}
    for form, bs in builds.items():
        b = bs[0]
        sess = tf.compat.v1.Session(graph=b["graph"])
        sess.run(b["init"])
        feed = dict(zip(b["feeds"], data))
        sessions[form] = (sess, b["grads"], feed)
        runs[form] = []
    values = {}
    for r in range(warmup + repeats):
        for form, (sess, grads, feed) in sessions.items():
            t0 = time.perf_counter()
            out = sess.run(grads, feed)
            if r >= warmup:
                runs[form].append(time.perf_counter() - t0)
            values[form] = out
    for sess, _, _ in sessions.values():
        sess.close()
    max_diff = max(float(np.max(np.abs(a - b)))
                   for form in ("list", "unstack")
                   for a, b in zip(values["vector"], values[form]))
    row = {"batch": batch, "max_abs_diff": max_diff}
    for form, bs in builds.items():
        row[form] = {
            "call_s": statistics.median(b["call_s"] for b in bs),
            "call_cpu_s": statistics.median(b["call_cpu_s"] for b in bs),
            "graph_s": statistics.median(b["graph_s"] for b in bs),
            "with_slices_s": statistics.median(b["with_slices_s"]
                                               for b in bs),
            "call_ops": bs[0]["call_ops"],
            "with_slices_ops": bs[0]["with_slices_ops"],
            "run_s": statistics.median(runs[form]),
        }
    v, l = row["vector"], row["list"]
    row["ratio"] = {
        "build_call": l["call_s"] / v["call_s"],
        "build_call_cpu": l["call_cpu_s"] / v["call_cpu_s"],
        "build_graph": l["graph_s"] / v["graph_s"],
        "build_with_slices": l["with_slices_s"] / v["call_s"],
        "ops_call": l["call_ops"] / v["call_ops"],
        "ops_with_slices": l["with_slices_ops"] / v["call_ops"],
        "run": l["run_s"] / v["run_s"],
    }
    u = row["unstack"]
    row["ratio_unstack"] = {
        "build_call": u["call_s"] / v["call_s"],
        "build_with_slices": u["with_slices_s"] / v["call_s"],
        "run": u["run_s"] / v["run_s"],
    }
    return row


def to_markdown(result):
    load = result.get("load_average", {})
    lines = [
        "# CUSTOM aggregation: list-of-slices form vs vector form",
        "",
        "`%s` on %s (%d CPUs), TensorFlow %s, Python %s%s." % (
            result["command"], result["machine"], result["cpus"],
            result["tensorflow"], result["python"],
            "; 1-minute load average %s at the start, %s at the end (this "
            "run adds about 1)" % (load.get("start"), load.get("end"))
            if load else ""),
        "",
        "- call: wall-clock ms of the `custagg.gradients` call (median of %d "
        "fresh graphs per form, the forms alternating, garbage collected "
        "before each call); cpu: its process CPU time (less disturbed by "
        "other load on the machine);"
        % result["build_repeats"],
        "- graph: the whole graph (model + call), the slicing excluded;",
        "- +slices: the call plus building `[loss[i] for i in range(B)]` "
        "(the caller's code);",
        "- unstack: the list form built with `tf.unstack(loss)` (one op "
        "for all B slices) instead;",
        "- ops: ops the call adds (with the slices in brackets);",
        "- run: median of %d runs fetching the gradients (interleaved)."
        % result["repeats"],
        "",
        "Ratios are list / vector.",
        "",
    ]
    for model, rows in result["models"].items():
        lines += [
            "## %s" % model, "",
            "| B | call ms: vector / list (ratio) | cpu ratio | graph ratio "
            "| +slices ms (ratio) | ops: vector / list (+slices) | run ms: "
            "vector / list (ratio) | unstack: call ms (ratio), +unstack ms "
            "(ratio), run ratio |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            v, l, q = row["vector"], row["list"], row["ratio"]
            u, qu = row["unstack"], row["ratio_unstack"]
            lines.append(
                "| %d | %.1f / %.1f (%.2fx) | %.2fx | %.2fx | %.0f (%.1fx) | "
                "%d / %d (%d) | %.2f / %.2f (%.2fx) | %.1f (%.2fx), %.1f "
                "(%.2fx), %.2fx |" % (
                    row["batch"], 1e3 * v["call_s"], 1e3 * l["call_s"],
                    q["build_call"], q["build_call_cpu"], q["build_graph"],
                    1e3 * l["with_slices_s"], q["build_with_slices"],
                    v["call_ops"], l["call_ops"], l["with_slices_ops"],
                    1e3 * v["run_s"], 1e3 * l["run_s"], q["run"],
                    1e3 * u["call_s"], qu["build_call"],
                    1e3 * u["with_slices_s"], qu["build_with_slices"],
                    qu["run"]))
        lines.append("")
    lines += ["## Acceptance at B=%d" % ACCEPT_B, ""]
    for check in result["acceptance"]:
        lines.append("- %s: %s" % (check["what"],
                                   "PASS" if check["pass"] else "FAIL"))
    lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="32,64,128,256,512,1024")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    args.build_repeats = 5
    batches = [int(b) for b in args.batches.split(",")]
    result = {
        "command": "python -m benchmarks.custom_forms" + (
            " " + " ".join(argv if argv is not None else sys.argv[1:])
        ).rstrip(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "tensorflow": tf.__version__,
        "python": platform.python_version(), "repeats": args.repeats,
        "build_repeats": args.build_repeats, "models": {}, "acceptance": [],
        # Other processes' load disturbs the wall clock (cpu less so).
        "load_average": {"start": round(os.getloadavg()[0], 2)},
    }
    for model in args.models.split(","):
        rows = []
        for batch in batches:
            row = measure(MODELS[model], batch, args.build_repeats,
                          args.repeats)
            rows.append(row)
            q = row["ratio"]
            print("%-20s B=%-5d build %.2fx (+slices %.2fx) ops %.2fx "
                  "run %.2fx  unstack build %.2fx  diff %.1e" % (
                      model, batch, q["build_call"], q["build_with_slices"],
                      q["ops_call"], q["run"],
                      row["ratio_unstack"]["build_call"],
                      row["max_abs_diff"]),
                  flush=True)
            if batch == ACCEPT_B:
                result["acceptance"] += [
                    {"what": "%s: list call builds <= %.1fx vector (wall "
                     "%.2fx, cpu %.2fx; whole graph %.2fx)" % (
                         model, ACCEPT_BUILD, q["build_call"],
                         q["build_call_cpu"], q["build_graph"]),
                     "pass": q["build_call"] <= ACCEPT_BUILD},
                    {"what": "%s: list run <= %.1fx vector (%.2fx)" % (
                        model, ACCEPT_RUN, q["run"]),
                     "pass": q["run"] <= ACCEPT_RUN},
                ]
        result["models"][model] = rows
    result["load_average"]["end"] = round(os.getloadavg()[0], 2)
    print(common.write_outputs("custom_forms", result, to_markdown(result)))
    return 0 if all(c["pass"] for c in result["acceptance"]) else 1


if __name__ == "__main__":
    sys.exit(main())
