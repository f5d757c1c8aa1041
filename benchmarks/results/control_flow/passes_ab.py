"""A/B in one process, interleaved runs: custagg's norms or clipped sum built
with pfor_lib.chunked_pfor's growing passes ("32") and with every pass 32
examples ("32old": PASS_BYTES = 0, the behaviour before), against
tf.vectorized_map and the floor. From the repository root:

  PYTHONPATH=. python benchmarks/results/control_flow/passes_ab.py norule_rnn 512 norms 32old,32 7

(model, B, norms|clip, builds, repeats). Written for docs/control-flow.md."""
import os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
tf.compat.v1.disable_eager_execution()
import custagg
import ab_common  # this folder's
m, B, task = sys.argv[1], int(sys.argv[2]), sys.argv[3]
chunks = sys.argv[4].split(",")   # "32": default passes; "32old": PASS_BYTES=0 (every pass 32)
from custagg.graph import pfor as pfor_lib
reps = int(sys.argv[5]) if len(sys.argv) > 5 else 5
x, y, p, vl, loss, fetches = ab_common.model(m, B)
builds = {}
default_bytes = getattr(pfor_lib, "PASS_BYTES", None)
for spec in chunks:
    c = int(spec.replace("old", ""))
    if default_bytes is not None:
        pfor_lib.PASS_BYTES = 0 if spec.endswith("old") else default_bytes
    key = "custagg_c" + spec
    t0 = time.perf_counter()
    if task == "norms":
        fetches[key] = custagg.per_example_norms(loss, vl, pfor_chunk_size=c)
    else:
        fetches[key] = custagg.clipped_gradients(loss, vl, 1.0, pfor_chunk_size=c)
    builds[key] = time.perf_counter() - t0
fetches["tf_vmap"], builds["tf_vmap"] = ab_common.vmap_fetch(m, p, vl, x, y, task)
ab_common.time_interleaved(fetches, builds, m, B, task, x, y, reps)
