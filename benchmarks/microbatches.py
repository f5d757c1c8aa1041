"""The cost of microbatches: a DP-SGD step with M < B against M = B, one process.

    python -m benchmarks.microbatches --write      # TF Privacy not needed

custagg.privacy's `DPGradientDescentGaussianOptimizer` (noise on, the
tutorial's clip 1.0 and sigma 1.1) on the MLP 784-256-256-10 and TF
Privacy's tutorial CNN (`benchmarks.tf_privacy_compare`'s models and step),
B = 512 (and 256 for the CNN), M = B, B/4 and 1; a static batch
(`[B, 28, 28, 1]` placeholder) and a dynamic one (`[None, 28, 28, 1]`, M
known, B only at run time). The steps of one configuration are timed
interleaved (one step of each in turn, `--repeats` rounds) so that load on
the machine falls on all of them alike; reported: median seconds per step
and the ratio to the M = B step. Results: benchmarks/results/microbatches.json
and .md (with --write).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from benchmarks import tf_privacy_compare as tpc

import numpy as np  # noqa: E402  (tf_privacy_compare set the Keras switch)
import tensorflow as tf  # noqa: E402

import custagg  # noqa: E402
from custagg.privacy import dp_optimizer  # noqa: E402

CONFIGS = [("mlp", 512), ("tutorial_cnn", 512), ("tutorial_cnn", 256)]


def run(repeats=7, configs=CONFIGS, log=print):
    x, y, _, _ = tpc.digits28()
    x = np.concatenate([x] * 2)
    y = np.concatenate([y] * 2)
    rows = []
    for model, batch in configs:
        for dynamic in (False, True):
            mbs = [batch, batch // 4, 1]
            steps = {m: tpc.Step(dp_optimizer, model,
                                 None if dynamic else batch, m, noise=1.1)
                     for m in mbs}
            data = tpc.batches(x, y, batch, repeats + 1, seed=3)
            for s in steps.values():
                s.run(*data[0])
            times = {m: [] for m in mbs}
            for xb, yb in data[1:]:
                for m, s in steps.items():
                    t = time.perf_counter()
                    s.run(xb, yb)
                    times[m].append(time.perf_counter() - t)
            for s in steps.values():
                s.close()
            base = float(np.median(times[batch]))
            for m in mbs:
                sec = float(np.median(times[m]))
                rows.append(dict(model=model, batch=batch, dynamic=dynamic,
                                 microbatches=m, seconds_per_step=sec,
                                 ratio_to_m_eq_b=sec / base))
                log("%-12s B=%d %-7s M=%-3d %.4f s/step  %.2fx the M=B step"
                    % (model, batch, "dynamic" if dynamic else "static", m,
                       sec, sec / base))
    return rows


def _markdown(result):
    lines = ["# DP-SGD step with microbatches: M < B against M = B", "",
             "`%s`; %s. Median of %d interleaved steps, 1 thread, noise on."
             % (result["command"], result["machine"], result["repeats"]), "",
             "| model | B | batch dim | M | s/step | / (M = B) |",
             "|---|---:|---|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append("| %s | %d | %s | %d | %.4f | %.2fx |" % (
            r["model"], r["batch"], "dynamic" if r["dynamic"] else "static",
            r["microbatches"], r["seconds_per_step"], r["ratio_to_m_eq_b"]))
    lines.append("")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--write", action="store_true")
    args = p.parse_args(argv)
    tf.compat.v1.disable_eager_execution()
    result = dict(
        command="python -m benchmarks.microbatches " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        machine="%s, %d cores (shared); python %s; tensorflow %s; custagg %s"
        % (platform.processor() or platform.machine(), os.cpu_count(),
           platform.python_version(), tf.__version__, custagg.__version__),
        repeats=args.repeats)
    result["rows"] = run(repeats=args.repeats)
    if args.write:
        os.makedirs(tpc.RESULTS, exist_ok=True)
        with open(os.path.join(tpc.RESULTS, "microbatches.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(tpc.RESULTS, "microbatches.md"), "w") as f:
            f.write(_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
