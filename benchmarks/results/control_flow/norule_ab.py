"""custagg against tf.vectorized_map in ONE process, runs interleaved, one
thread, the same floor (the aggregated gradient) for both; also the nodes
each run executes (a FULL_TRACE step). From the repository root:

  PYTHONPATH=. python benchmarks/results/control_flow/norule_ab.py norule_rnn 512 norms auto 21

(model, B, norms|clip, variants, repeats). Variant "auto" is custagg as it
is; "nocheck" builds the copies with their run-time check forced off (to
measure what the check costs). Written for docs/control-flow.md."""
import os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
tf.compat.v1.disable_eager_execution()
import custagg
from custagg.per_example.forms import copies as recompute
import ab_common  # this folder's
m, B, task = sys.argv[1], int(sys.argv[2]), sys.argv[3]
variants = sys.argv[4].split(",")
reps = int(sys.argv[5]) if len(sys.argv) > 5 else 5
x, y, p, vl, loss, fetches = ab_common.model(m, B)
builds = {}
orig = recompute._checked
for v in variants:
    recompute._checked = (lambda r, l, lo: r) if v == "nocheck" else orig
    t0 = time.perf_counter()
    if task == "norms":
        fetches[v] = custagg.per_example_norms(loss, vl)
    else:
        fetches[v] = custagg.clipped_gradients(loss, vl, 1.0)
    builds[v] = time.perf_counter() - t0
recompute._checked = orig
fetches["tf_vmap"], builds["tf_vmap"] = ab_common.vmap_fetch(m, p, vl, x, y, task)
ab_common.time_interleaved(fetches, builds, m, B, task, x, y, reps, nodes=True, width=8)
