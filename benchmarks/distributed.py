"""Throughput of the DP-SGD main job on 1 vs 2 local workers (1 ps).

    python benchmarks/distributed.py [--epochs 20] [--repeats 2]

`python -m custagg --distributed local --workers W --aggregation dpsgd` (the
digits main job) for W=1 and W=2 at a global batch of 64 (strong scaling),
W=2 at 128 (weak scaling), and the same job in one process without a
cluster; the median over `--repeats` of the runners' own examples/s (the
training loop only) and the final test accuracy. Every process shares the
same CPUs, so the ratio measures overhead, not scaling. Writes
benchmarks/results/distributed.{md,json}.
"""

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not __package__:     # `python benchmarks/distributed.py`: this checkout's packages
    sys.path.insert(0, ROOT)
from benchmarks import common  # noqa: E402
TIMEOUT_S = 900


def _run(argv):
    """(stdout, wall seconds) of `python ARGV` from the repository root."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="2")
    t0 = time.time()
    proc = subprocess.run([sys.executable] + argv, capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError("%s failed (%d):\n%s" % (" ".join(argv), proc.returncode,
                                                    proc.stdout[-3000:] + proc.stderr[-3000:]))
    return proc.stdout, time.time() - t0


def _cluster(workers, batch, epochs):
    out, wall = _run(["-m", "custagg", "--distributed", "local", "--workers", str(workers),
                      "--aggregation", "dpsgd", "--batch-size", str(batch), "--epochs",
                      str(epochs)])
    per_worker = [float(m) for m in re.findall(
        r"^worker \d+: .* in [\d.]+ s: (\d+) examples/s$", out, re.M)]
    total = float(re.search(r"^all workers: (\d+) examples/s", out, re.M).group(1))
    acc = float(re.search(r"final test accuracy: ([\d.]+)", out).group(1))
    return {"per_worker": per_worker, "total": total, "accuracy": acc, "wall_s": wall}


def _single(batch, epochs):
    """The same job in one process (no ps): timed in a subprocess that
    builds the main job's graph and times its training loop."""
    out, wall = _run([os.path.abspath(__file__), "--single-process", str(batch), str(epochs)])
    return dict(json.loads(out.strip().splitlines()[-1]), wall_s=wall)


def _single_process(batch, epochs):
    """The main job's DP-SGD graph (custagg.app.train) in one Session."""
    import tensorflow as tf
    from custagg.app import cli, datasets, train
    from custagg.app.models import build_model
    tf.compat.v1.disable_eager_execution()
    args = cli.build_parser().parse_args(["--aggregation", "dpsgd", "--batch-size", str(batch)])
    data = datasets.load_dataset(args.dataset, seed=args.seed)
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(args.seed)
        x = tf.compat.v1.placeholder(tf.float32, [batch, data.num_features])
        y = tf.compat.v1.placeholder(tf.int64, [batch])
        logits, variables = build_model(args.model, x, data.image_shape, data.num_classes,
                                        args.hidden, args.seed)
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = train.make_optimizer(args, train.learning_rate(args))
        train_op = opt.minimize(loss, global_step=step, var_list=variables)
        x_eval = tf.compat.v1.placeholder(tf.float32, [None, data.num_features])
        y_eval = tf.compat.v1.placeholder(tf.int64, [None])
        eval_logits, _ = build_model(args.model, x_eval, data.image_shape, data.num_classes,
                                     args.hidden, args.seed)
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(eval_logits, 1), y_eval), tf.float32))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            secs, examples = 0.0, 0
            for epoch in range(1, epochs + 1):
                t0 = time.perf_counter()
                for xb, yb in datasets.minibatches(data.x_train, data.y_train, batch,
                                                   seed=args.seed, epoch=epoch):
                    sess.run(train_op, {x: xb, y: yb})
                    examples += batch
                secs += time.perf_counter() - t0
            acc = sess.run(correct, {x_eval: data.x_test, y_eval: data.y_test}) / len(data.y_test)
    rate = examples / secs
    print(json.dumps({"per_worker": [rate], "total": rate, "accuracy": float(acc)}))


def main(argv=None):
    if argv is None and sys.argv[1:2] == ["--single-process"]:
        _single_process(int(sys.argv[2]), int(sys.argv[3]))
        return 0
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args(argv)
    rows = []
    for label, workers, batch in [("one process, no cluster", None, 64),
                                  ("1 ps + 1 worker", 1, 64),
                                  ("1 ps + 2 workers (same global batch)", 2, 64),
                                  ("1 ps + 2 workers (same batch per worker)", 2, 128)]:
        runs = []
        for _ in range(a.repeats):
            runs.append(_single(batch, a.epochs) if workers is None else
                        _cluster(workers, batch, a.epochs))
            print(label, runs[-1], flush=True)
        rows.append({
            "config": label, "workers": workers or 0, "global_batch": batch,
            "per_worker_batch": batch // (workers or 1),
            "total_examples_per_s": statistics.median([r["total"] for r in runs]),
            "per_worker_examples_per_s": [
                statistics.median([r["per_worker"][i] for r in runs])
                for i in range(len(runs[0]["per_worker"]))],
            "accuracy": statistics.median([r["accuracy"] for r in runs]),
            "wall_s": statistics.median([r["wall_s"] for r in runs]), "runs": runs})
    base = rows[1]["total_examples_per_s"]
    for r in rows:
        r["vs_one_worker"] = r["total_examples_per_s"] / base
    result = {"command": "python benchmarks/distributed.py --epochs %d --repeats %d"
                         % (a.epochs, a.repeats), "cpus": os.cpu_count(),
              "machine": platform.machine(), "python": platform.python_version(),
              "epochs": a.epochs, "rows": rows}
    try:
        import tensorflow as tf
        result["tensorflow"] = tf.__version__
    except ImportError:
        pass
    print(common.write_outputs("distributed", result, _markdown(result)))
    return 0


def _markdown(r):
    return "\n".join([
        "# DP-SGD main job on a local TF1 cluster: 1 vs 2 workers", "",
        "`%s` (TensorFlow %s, %d CPUs shared with other work, Python %s)."
        % (r["command"], r.get("tensorflow", "?"), r["cpus"], r["python"]), "",
        "Digits (8x8, 1,438 training images), softmax regression, DP-SGD (C=1, noise "
        "multiplier 1.1, noise added once per step by the chief), %d epochs. Examples/s over "
        "the training loop only (start-up excluded), median of the runs; `wall` includes "
        "starting the processes." % r["epochs"], "", common.table([
            ("configuration", "config", "%s"), ("global batch", "global_batch", "%d"),
            ("per worker", "per_worker_batch", "%d"),
            ("examples/s, total", "total_examples_per_s", "%.0f"),
            ("per worker", lambda row: ", ".join(
                "%.0f" % v for v in row["per_worker_examples_per_s"]), "%s"),
            ("vs 1 worker", "vs_one_worker", "%.2fx"), ("test acc", "accuracy", "%.4f"),
            ("wall", "wall_s", "%.0f s"),
            ("each run, total", lambda row: ", ".join("%.0f" % run["total"] for run in
                                                      row["runs"]), "%s")], r["rows"]),
        "`vs 1 worker`: total examples/s over the `1 ps + 1 worker` row. Test accuracy is the "
        "chief's after the last epoch.", "",
        "Every process (ps, workers, the runner) shares the same CPUs, so a second worker adds "
        "a process and gRPC round trips but no compute. The model is tiny (650 parameters): a "
        "step is dominated by the synchronous round trips (gradients to the ps accumulators, "
        "the chief's update, the token queue), not by the per-example gradients. Do not read "
        "these figures as scaling.", ""])


if __name__ == "__main__":
    sys.exit(main())
