"""A/B in one process, interleaved runs: custagg's norms or clipped sum built
with vectorized.chunked_pfor's growing passes ("32") and with every pass 32
examples ("32old": PASS_BYTES = 0, the behaviour before), against
tf.vectorized_map and the floor. From the repository root:

  PYTHONPATH=. python benchmarks/results/control_flow/passes_ab.py norule_rnn 512 norms 32old,32 7

(model, B, norms|clip, builds, repeats). Written for docs/control-flow.md."""
import os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf
tf.compat.v1.disable_eager_execution()
import custagg
from benchmarks import models
m, B, task = sys.argv[1], int(sys.argv[2]), sys.argv[3]
chunks = sys.argv[4].split(",")   # "32": default passes; "32old": PASS_BYTES=0 (every pass 32)
from custagg import vectorized
reps = int(sys.argv[5]) if len(sys.argv) > 5 else 5
x, y = models.tf_placeholders(m, B, dynamic=True)
p, vl = models.tf_variables(m)
loss = models.tf_loss(m, p, x, y)
fetches = {"floor": tf.compat.v1.gradients(tf.reduce_sum(loss), vl)}
builds = {}
default_bytes = getattr(vectorized, "PASS_BYTES", None)
for spec in chunks:
    c = int(spec.replace("old", ""))
    if default_bytes is not None:
        vectorized.PASS_BYTES = 0 if spec.endswith("old") else default_bytes
    key = "custagg_c" + spec
    t0 = time.perf_counter()
    if task == "norms":
        fetches[key] = custagg.per_example_norms(loss, vl, pfor_chunk_size=c)
    else:
        fetches[key] = custagg.clipped_gradients(loss, vl, 1.0, pfor_chunk_size=c)
    builds[key] = time.perf_counter() - t0
def one(args):
    xi, yi = args
    li = models.tf_loss(m, p, xi[None], yi[None])
    return [tf.convert_to_tensor(g) for g in tf.compat.v1.gradients(tf.reduce_sum(li), vl)]
t0 = time.perf_counter()
pe = tf.vectorized_map(one, (x, y))
nr = tf.sqrt(tf.add_n([tf.reduce_sum(tf.reshape(tf.square(g), [tf.shape(g)[0], -1]), 1) for g in pe]))
if task == "norms":
    fetches["tf_vmap"] = nr
else:
    sc = 1.0 / tf.maximum(nr, 1.0)
    fetches["tf_vmap"] = [tf.tensordot(sc, g, axes=1) for g in pe]
builds["tf_vmap"] = time.perf_counter() - t0
xv, yv = models.make_batch(m, B)
cfg = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
with tf.compat.v1.Session(config=cfg) as s:
    s.run(tf.compat.v1.global_variables_initializer())
    fd = {x: xv, y: yv}
    vals = {}
    firsts = {}
    for k, t in fetches.items():
        t0 = time.perf_counter(); vals[k] = s.run(t, fd); firsts[k] = time.perf_counter() - t0
    ts = {k: [] for k in fetches}
    for _ in range(reps):          # interleaved, so load drifts hit all alike
        for k, t in fetches.items():
            t0 = time.perf_counter(); s.run(t, fd); ts[k].append(time.perf_counter() - t0)
    fl = np.median(ts["floor"])
    ref = vals["tf_vmap"]
    for k in fetches:
        med = np.median(ts[k])
        err = ""
        if k != "floor":
            a = np.concatenate([np.ravel(v) for v in (vals[k] if isinstance(vals[k], list) else [vals[k]])])
            b = np.concatenate([np.ravel(v) for v in (ref if isinstance(ref, list) else [ref])])
            err = " maxrel %.1e" % (np.max(np.abs(a - b)) / np.max(np.abs(b)))
        print("%s B=%d %s %-12s build %5.1fs first %5.2fs median %8.1f ms  %5.2fx%s"
              % (m, B, task, k, builds.get(k, 0), firsts[k], 1e3 * med, med / fl, err), flush=True)
print(os.getloadavg())
