"""custagg against tf.vectorized_map in ONE process, runs interleaved, one
thread, the same floor (the aggregated gradient) for both; also the nodes
each run executes (a FULL_TRACE step). From the repository root:

  PYTHONPATH=. python benchmarks/results/control_flow/norule_ab.py norule_rnn 512 norms auto 21

(model, B, norms|clip, variants, repeats). Variant "auto" is custagg as it
is; "nocheck" builds the copies with their run-time check forced off (to
measure what the check costs). Written for docs/control-flow.md."""
import os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np, tensorflow as tf
tf.compat.v1.disable_eager_execution()
import custagg
from custagg import recompute
from benchmarks import models
m, B, task = sys.argv[1], int(sys.argv[2]), sys.argv[3]
variants = sys.argv[4].split(",")
reps = int(sys.argv[5]) if len(sys.argv) > 5 else 5
x, y = models.tf_placeholders(m, B, dynamic=True)
p, vl = models.tf_variables(m)
loss = models.tf_loss(m, p, x, y)
fetches = {"floor": tf.compat.v1.gradients(tf.reduce_sum(loss), vl)}
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
    vals, firsts, nodes = {}, {}, {}
    for k, t in fetches.items():
        t0 = time.perf_counter(); vals[k] = s.run(t, fd); firsts[k] = time.perf_counter() - t0
        md = tf.compat.v1.RunMetadata()
        s.run(t, fd, options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE), run_metadata=md)
        nodes[k] = sum(len(d.node_stats) for d in md.step_stats.dev_stats)
    ts = {k: [] for k in fetches}
    for _ in range(reps):
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
        print("%s B=%d %s %-8s build %5.1fs first %5.2fs nodes %6d median %8.1f ms  %5.2fx%s"
              % (m, B, task, k, builds.get(k, 0), firsts[k], nodes[k], 1e3 * med, med / fl, err), flush=True)
print(os.getloadavg())
