"""One task of `python -m custagg --distributed local`: a ps or a worker.

Run by `custagg.app.cluster.run_local` as
`python -m custagg.app.cluster_job --job worker --task i --spec JSON
--args JSON --out DIR`; not meant to be started by hand.

A worker trains the main job (`custagg.app.train`'s model, data and DP
optimizer) with between-graph replication: `replica_device_setter` puts the
variables on the ps, `custagg.distributed.sync_replicas_dp_optimizer` (or a
plain `SyncReplicasOptimizer` for `--aggregation sum / weighted`) averages
the W workers' gradients each global step, `MonitoredTrainingSession` runs
it. Each global batch is the single-process job's batch (same seed, same
order); worker i trains on its i-th slice of `--batch-size / W` examples,
so W workers take the same steps on the same examples as one process.

The chief (worker 0) evaluates the test accuracy after each epoch and
prints what the single-process job prints; every worker writes
`worker_<i>.json` (steps, examples, seconds, examples/s) into `--out`.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

from custagg.app import datasets
from custagg.app import train
from custagg.app.models import build_model
from custagg.app.models import class_balanced_factors
from custagg.app.models import per_example_loss
from custagg import distributed
from custagg import optimizers as opt_lib

# Bound on a non-chief's wait for the chief's initialization.
READY_TIMEOUT_S = 600


def _optimizer(args, lr, workers):
    """`(replicated optimizer, the custagg optimizer inside it)`; DP ones
    get their noise once per step, from the chief."""
    inner = train.make_optimizer(args, lr)
    if isinstance(inner, opt_lib.DPOptimizer):   # clip and dpsgd
        seed = train.noise_seed(args) if args.aggregation == "dpsgd" \
            else None
        return distributed.sync_replicas_dp_optimizer(inner, workers,
                                                      seed=seed), inner
    # sum / weighted: each worker's gradient is normalised on its own slice;
    # the accumulator's mean over the workers is the global one.
    return tf.compat.v1.train.SyncReplicasOptimizer(
        inner, replicas_to_aggregate=workers,
        total_num_replicas=workers), inner


def _worker(a, args, spec, server):
    say = lambda *m: print(*m, flush=True)
    workers = len(spec["worker"])
    is_chief = a.task == 0
    data = datasets.load_dataset(args.dataset, data_dir=args.data_dir,
                                 download=False, seed=args.seed)
    if args.train_limit is not None:
        data = data.subset(args.train_limit, None)
    bsz = args.batch_size
    local = bsz // workers
    if args.num_microbatches is not None:
        # The flag counts microbatches per global batch; each worker clips
        # its share of them.
        args.num_microbatches //= workers
    lr = train.learning_rate(args)
    counts = np.bincount(data.y_train, minlength=data.num_classes)
    class_weights = 1.0 / np.maximum(counts, 1)
    steps_per_epoch = len(data.x_train) // bsz
    cluster = tf.train.ClusterSpec(spec)
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(args.seed)
        with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
                worker_device="/job:worker/task:%d" % a.task,
                cluster=cluster)):
            d = data.num_features
            x, y, logits, variables, loss = per_example_loss(args, data,
                                                             local)
            step = tf.compat.v1.train.get_or_create_global_step()
            train.unseed_the_noise(args)
            opt, inner = _optimizer(args, lr, workers)
            grad_loss = (tf.fill([local], 1.0 / local)
                         if args.aggregation == "sum" else None)
            kwargs = {} if grad_loss is None else {"grad_loss": grad_loss}
            train_op = opt.minimize(loss, global_step=step,
                                    var_list=variables, **kwargs)
            factors = None
            if args.aggregation == "weighted":
                factors = inner.gradient_factors
            x_eval = tf.compat.v1.placeholder(tf.float32, [None, d])
            y_eval = tf.compat.v1.placeholder(tf.int64, [None])
            eval_logits, _ = build_model(args.model, x_eval,
                                         data.image_shape, data.num_classes,
                                         args.hidden, args.seed)
            eval_correct = tf.reduce_sum(tf.cast(tf.equal(
                tf.argmax(eval_logits, 1), y_eval), tf.float32))
            mean_loss = tf.reduce_mean(loss)
        hook = opt.make_session_run_hook(is_chief, num_tokens=0)
        config = distributed.worker_session_config(a.task)
        if not is_chief:
            distributed.wait_until_initialized(server.target, config,
                                               READY_TIMEOUT_S)
        say("worker %d: %d examples per step (global batch %d over %d "
            "workers), %d steps per epoch" % (a.task, local, bsz, workers,
                                              steps_per_epoch))
        seconds, examples, steps, test_acc = 0.0, 0, 0, None
        with tf.compat.v1.train.MonitoredTrainingSession(
                master=server.target, is_chief=is_chief, hooks=[hook],
                config=config, stop_grace_period_secs=2,
                log_step_count_steps=None, save_summaries_steps=None,
                save_summaries_secs=None) as sess:
            for epoch in range(1, args.epochs + 1):
                t0, losses = time.time(), []
                part = slice(a.task * local, (a.task + 1) * local)
                for xb, yb in datasets.minibatches(
                        data.x_train, data.y_train, bsz, seed=args.seed,
                        epoch=epoch):
                    feed = {x: xb[part], y: yb[part]}
                    if factors is not None:
                        feed[factors] = class_balanced_factors(
                            yb[part], class_weights)
                    _, l = sess.run([train_op, mean_loss], feed)
                    losses.append(l)
                    steps += 1
                    examples += local
                dt = time.time() - t0
                seconds += dt
                line = "epoch %2d  worker %d  loss %.4f  %.1fs  %.0f ex/s" % (
                    epoch, a.task, float(np.mean(losses)), dt,
                    local * len(losses) / max(dt, 1e-9))
                if is_chief:
                    test_acc = train.evaluate(
                        sess, eval_correct, x_eval, y_eval, data.x_test,
                        data.y_test)
                    line += "  test acc %.4f" % test_acc
                say(line)
    result = {"task": a.task, "steps": steps, "examples": examples,
              "seconds": seconds,
              "examples_per_s": examples / max(seconds, 1e-9)}
    if is_chief:
        result["test_acc"] = float(test_acc)
        result["train_size"] = len(data.x_train)
        result["data"] = data.describe()
    path = os.path.join(a.out, "worker_%d.json" % a.task)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    say("worker %d: done" % a.task)


def main(argv=None):
    p = argparse.ArgumentParser(prog="custagg.app.cluster_job")
    p.add_argument("--job", choices=("ps", "worker"), required=True)
    p.add_argument("--task", type=int, required=True)
    p.add_argument("--spec", required=True, help="cluster spec, JSON")
    p.add_argument("--args", required=True,
                   help="the main job's parsed flags, JSON")
    p.add_argument("--out", required=True, help="directory for results")
    a = p.parse_args(argv)
    spec = json.loads(a.spec)
    tf.compat.v1.disable_eager_execution()
    server = tf.distribute.Server(tf.train.ClusterSpec(spec),
                                  job_name=a.job, task_index=a.task)
    print("%s %d: server on %s" % (a.job, a.task, server.target), flush=True)
    if a.job == "ps":
        server.join()
        return 0
    _worker(a, argparse.Namespace(**json.loads(a.args)), spec, server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
