"""What the one-process A/B scripts of this folder share (passes_ab.py,
norule_ab.py): `tf.vectorized_map`'s fetch for the task, and the interleaved
timing of several fetches against one floor, each checked against
`tf.vectorized_map`'s numbers."""
import os
import time

import numpy as np
import tensorflow as tf

from benchmarks import models


def model(m, B):
    """(x, y, params, variables, per-example loss, {"floor": the aggregated
    gradient}) of benchmark model `m`, on `[None, ...]` placeholders."""
    x, y = models.tf_placeholders(m, B, dynamic=True)
    p, vl = models.tf_variables(m)
    loss = models.tf_loss(m, p, x, y)
    return x, y, p, vl, loss, {
        "floor": tf.compat.v1.gradients(tf.reduce_sum(loss), vl)}


def vmap_fetch(m, p, vl, x, y, task):
    """(fetch, build seconds): norms, or the clipped sum (clip norm 1)."""
    def one(args):
        xi, yi = args
        li = models.tf_loss(m, p, xi[None], yi[None])
        return [tf.convert_to_tensor(g)
                for g in tf.compat.v1.gradients(tf.reduce_sum(li), vl)]
    t0 = time.perf_counter()
    pe = tf.vectorized_map(one, (x, y))
    nr = tf.sqrt(tf.add_n([tf.reduce_sum(tf.reshape(tf.square(g), [tf.shape(g)[0], -1]), 1)
                           for g in pe]))
    if task == "norms":
        fetch = nr
    else:
        sc = 1.0 / tf.maximum(nr, 1.0)
        fetch = [tf.tensordot(sc, g, axes=1) for g in pe]
    return fetch, time.perf_counter() - t0


def time_interleaved(fetches, builds, m, B, task, x, y, reps, nodes=False,
                     width=12):
    """Runs every fetch `reps` times, interleaved (so load drifts hit all
    alike), one thread; prints each one's median against `fetches["floor"]`,
    its largest difference to `fetches["tf_vmap"]`, and with `nodes` the
    node executions of one traced step."""
    xv, yv = models.make_batch(m, B)
    cfg = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                   inter_op_parallelism_threads=1)
    with tf.compat.v1.Session(config=cfg) as s:
        s.run(tf.compat.v1.global_variables_initializer())
        fd = {x: xv, y: yv}
        vals, firsts, counts = {}, {}, {}
        for k, t in fetches.items():
            t0 = time.perf_counter(); vals[k] = s.run(t, fd); firsts[k] = time.perf_counter() - t0
            if nodes:
                md = tf.compat.v1.RunMetadata()
                s.run(t, fd, options=tf.compat.v1.RunOptions(
                    trace_level=tf.compat.v1.RunOptions.FULL_TRACE), run_metadata=md)
                counts[k] = sum(len(d.node_stats) for d in md.step_stats.dev_stats)
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
            count = " nodes %6d" % counts[k] if nodes else ""
            print("%s B=%d %s %-*s build %5.1fs first %5.2fs%s median %8.1f ms  %5.2fx%s"
                  % (m, B, task, width, k, builds.get(k, 0), firsts[k], count,
                     1e3 * med, med / fl, err), flush=True)
    print(os.getloadavg())
