"""The main job's training loop and its final check (see `custagg.app.cli`).

Imports TensorFlow: `custagg.app.cli` imports this module only after it has
parsed the flags and set TensorFlow's log level.
"""

import contextlib
import logging
import sys
import time

import numpy as np
import tensorflow as tf
import tqdm

import custagg
from custagg import testing
from custagg.app import datasets
from custagg.app.cli import DEFAULT_LEARNING_RATE
from custagg.app.models import build_model
from custagg.app.models import class_balanced_factors
from custagg.app.models import per_example_loss
from custagg import optimizers as opt_lib



class UsageError(Exception):
    """A flag value that only turns out wrong once the data is known."""


class _DropChosenCostWarning(logging.Filter):
    """Drops custagg's O(B^2) warning: with `--strategy loop` the user chose
    that cost, and the printed plan says it."""

    def filter(self, record):
        return "cost O(B^2)" not in record.getMessage()


@contextlib.contextmanager
def _chosen_cost_is_not_warned(args):
    if args.strategy != "loop":
        yield
        return
    log, drop = logging.getLogger("custagg"), _DropChosenCostWarning()
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def _describe_weights(class_weights, counts, batch_size):
    """What `--aggregation weighted` feeds, and how far it is from `sum`.

    The factors are `f_i = w[y_i] / sum_j w[y_j]` with `w[c] = 1 / (training
    images of class c)`; `sum` is `f_i = 1/B`. They differ only as much as
    the class counts do.
    """
    present = counts > 0
    lo, hi = int(counts[present].min()), int(counts[present].max())
    w = class_weights[present]
    # In a batch, f_i * B lies between min(w)/max(w) and max(w)/min(w).
    spread = float(w.max() / w.min())
    text = ("weights: f_i = w[y_i] / sum_j w[y_j] over the batch, w[c] = 1 / "
            "(training images of class c); class counts %d-%d, so each f_i "
            "is within a factor %.3g of the plain mean's 1/%d" % (
                lo, hi, spread, batch_size))
    if spread < 1.25:
        text += (": the classes are nearly balanced, so the weighted "
                 "gradient stays close to --aggregation sum (it would differ "
                 "on unbalanced classes)")
    else:
        text += (": rare classes weigh up to %.3gx more than common ones, "
                 "so the weighted gradient differs from --aggregation sum"
                 % spread)
    return text


def _describe_norms(norms):
    q = np.quantile(norms, [0.0, 0.25, 0.5, 0.75, 1.0])
    return "min %.3g  q25 %.3g  median %.3g  q75 %.3g  max %.3g" % tuple(q)


def make_optimizer(args, lr):
    if args.optimizer == "sgd":
        inner = tf.compat.v1.train.GradientDescentOptimizer(lr)
    elif args.optimizer == "momentum":
        inner = tf.compat.v1.train.MomentumOptimizer(lr, momentum=0.9)
    else:
        inner = tf.compat.v1.train.AdamOptimizer(lr)
    if args.aggregation == "sum":
        return opt_lib.PerExampleOptimizer(inner, strategy=args.strategy)
    if args.aggregation == "weighted":
        return opt_lib.WeightedOptimizer(inner, strategy=args.strategy)
    if args.aggregation == "clip":
        return opt_lib.ClippedOptimizer(
            inner, args.l2_norm_clip, num_microbatches=args.num_microbatches,
            strategy=args.strategy)
    return opt_lib.DPOptimizer(
        inner, args.l2_norm_clip, args.noise_multiplier,
        num_microbatches=args.num_microbatches, seed=noise_seed(args),
        strategy=args.strategy)


def noise_seed(args):
    """--noise-seed: None (fresh entropy) unless given."""
    return getattr(args, "noise_seed", None)


def unseed_the_noise(args):
    """Call after the model is built, before the DP optimizer: without
    --noise-seed the graph seed (set from --seed for the initialization)
    is taken off the graph, else the noise's key would be a function of
    --seed, known to whoever knows the command (docs/privacy.md, section
    7)."""
    if args.aggregation == "dpsgd" and noise_seed(args) is None:
        tf.compat.v1.set_random_seed(None)


def learning_rate(args):
    if args.learning_rate is not None:
        return args.learning_rate
    if args.optimizer == "adam":
        return 0.001
    lr = DEFAULT_LEARNING_RATE[args.model]
    return lr * 0.1 if args.optimizer == "momentum" else lr


def evaluate(sess, acc_sum, x_eval, y_eval, x, y, chunk=1000):
    correct = 0.0
    for start in range(0, len(x), chunk):
        correct += sess.run(acc_sum, {x_eval: x[start:start + chunk],
                                      y_eval: y[start:start + chunk]})
    return correct / max(len(x), 1)


def run(args, out=None):
    """The main job for parsed `args`; returns the exit status."""
    with _chosen_cost_is_not_warned(args):
        return _run(args, out)


def _run(args, out):
    out = out or sys.stdout
    say = lambda *a: print(*a, file=out, flush=True)

    data = datasets.load_dataset(args.dataset, data_dir=args.data_dir,
                                 download=args.download, seed=args.seed)
    if args.train_limit is not None:
        data = data.subset(args.train_limit, None)
    bsz = args.batch_size
    say("custagg %s main job" % custagg.__version__)
    say("data: %s" % data.describe())
    if len(data.x_train) < bsz:
        raise UsageError("--batch-size %d is larger than the %d training "
                          "images" % (bsz, len(data.x_train)))
    lr = learning_rate(args)
    if getattr(args, "target_epsilon", None) is not None:
        args.noise_multiplier = _calibrate(args, len(data.x_train), bsz, say)
    counts = np.bincount(data.y_train, minlength=data.num_classes)
    class_weights = 1.0 / np.maximum(counts, 1)

    t_start = time.time()
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(args.seed)
        d = data.num_features
        x, y, logits, variables, loss = per_example_loss(args, data, bsz)
        global_step = tf.compat.v1.train.get_or_create_global_step()
        unseed_the_noise(args)
        opt = make_optimizer(args, lr)
        # sum: the gradient of the mean loss, as in the tutorial; the norms
        # stay those of each example's own loss.
        grad_loss = (tf.fill([bsz], 1.0 / bsz) if args.aggregation == "sum"
                     else None)
        train_op = opt.minimize(loss, global_step=global_step,
                                var_list=variables, grad_loss=grad_loss)
        norms = opt.per_example_norms
        batch_correct = tf.reduce_sum(tf.cast(tf.equal(
            tf.argmax(logits, 1), y), tf.float32))
        mean_loss = tf.reduce_mean(loss)

        x_eval = tf.compat.v1.placeholder(tf.float32, [None, d])
        y_eval = tf.compat.v1.placeholder(tf.int64, [None])
        eval_logits, _ = build_model(args.model, x_eval, data.image_shape,
                                     data.num_classes, args.hidden, args.seed)
        eval_correct = tf.reduce_sum(tf.cast(tf.equal(
            tf.argmax(eval_logits, 1), y_eval), tf.float32))
        plan = custagg.plan_per_example(loss, variables,
                                        strategy=args.strategy)

        say("model: %s, %d parameters in %d variables; optimizer: %s "
            "(learning rate %g)" % (
                args.model, sum(int(np.prod(v.shape)) for v in variables),
                len(variables), args.optimizer, lr))
        say("aggregation: %s" % _describe_aggregation(args))
        if args.aggregation == "weighted":
            say("  " + _describe_weights(class_weights, counts, bsz))
        say("batch size %d, %d steps per epoch, %d epochs, seed %d" % (
            bsz, len(data.x_train) // bsz, args.epochs, args.seed))
        say(str(plan))
        dp_std = getattr(opt, "noise_stddev", None) \
            if args.aggregation == "dpsgd" else None

        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            say("graph built in %.1f s" % (time.time() - t_start))
            if dp_std is not None:
                say("noise std on the clipped sum: %.4g" % sess.run(dp_std))
            train_s, trained = 0.0, 0
            for epoch in range(1, args.epochs + 1):
                t0 = time.time()
                losses, correct, seen, all_norms = [], 0.0, 0, []
                batches = datasets.minibatches(
                    data.x_train, data.y_train, bsz, seed=args.seed,
                    epoch=epoch)
                for xb, yb in _progress(batches, len(data.x_train) // bsz,
                                        epoch, args.epochs):
                    feed = {x: xb, y: yb}
                    if args.aggregation == "weighted":
                        feed[opt.gradient_factors] = class_balanced_factors(
                            yb, class_weights)
                    _, l, c, n = sess.run(
                        [train_op, mean_loss, batch_correct, norms], feed)
                    losses.append(l)
                    correct += c
                    seen += len(yb)
                    all_norms.append(n)
                train_s, trained = train_s + time.time() - t0, trained + seen
                test_acc = evaluate(sess, eval_correct, x_eval, y_eval,
                                     data.x_test, data.y_test)
                say("epoch %2d  loss %.4f  train acc %.4f  test acc %.4f  "
                    "%.1fs  |  per-example grad norms: %s" % (
                        epoch, float(np.mean(losses)), correct / seen,
                        test_acc, time.time() - t0,
                        _describe_norms(np.concatenate(all_norms))))
                if args.aggregation == "dpsgd":
                    say("          " + describe_epsilon(
                        args, len(data.x_train), bsz, epoch))
            # As a cluster's workers report theirs: the training steps
            # alone, the evaluation after each epoch left out.
            say("training: %.0f examples/s (%d examples in %.1f s)" % (
                trained / max(train_s, 1e-9), trained, train_s))
            if args.aggregation == "dpsgd":
                say("privacy after %d epochs: %s" % (
                    args.epochs, describe_epsilon(
                        args, len(data.x_train), bsz, args.epochs, pld=True)))
                say(_privacy_statement(args, len(data.x_train), bsz))
                if getattr(args, "target_epsilon", None) is not None:
                    say(_reached(args, len(data.x_train), bsz))
            status = 0
            if not args.no_check:
                status = _check(args, say, sess, data,
                                variables)
    # From the start of `python -m custagg` when the CLI recorded it: the
    # TensorFlow import is most of a short run's time.
    started = getattr(args, "started", None)
    if started is None:
        say("total %.1f s (graph, training and check)"
            % (time.time() - t_start))
    else:
        say("total %.1f s (TensorFlow import and data %.1f s; graph, "
            "training and check %.1f s)" % (
                time.time() - started, t_start - started,
                time.time() - t_start))
    return status


def describe_epsilon(args, n, batch_size, epochs, pld=False):
    """ε at δ = 1/n, TF Privacy's accounting (RDP, Poisson sampling with
    q = B/n, ceil(epochs * n / B) steps, epochs counted as its tutorial
    does); with `pld`, dp-accounting's PLD figure too."""
    from custagg.privacy import accounting  # pylint: disable=g-import-not-at-top
    delta = _delta(args, n)
    eps, order = accounting.compute_dp_sgd_privacy(
        n, batch_size, args.noise_multiplier, epochs, delta)
    figures = accounting.dp_sgd_epsilons(
        n, batch_size, epochs, args.noise_multiplier, delta,
        used_microbatching=_used_microbatching(args, batch_size))
    # This job's batches are fixed-size batches of a shuffled order: the
    # figure that holds for them leads (each example once per epoch, no
    # amplification by sampling); the Poisson figures are what the same
    # run would have with Poisson-sampled batches, which it does not take.
    text = ("epsilon %.3f at delta %s for these batches (fixed size, "
            "shuffled: each example once per epoch); had they been "
            "Poisson-sampled at q = B/n: %.3f (RDP order %s" % (
                figures["example_epsilon"],
                "1/%d" % n if getattr(args, "delta", None) is None else
                "%g" % delta, eps, order))
    if pld:
        text += "; PLD accountant: %.3f" % accounting.compute_dp_sgd_privacy(
            n, batch_size, args.noise_multiplier, epochs, delta,
            accountant="pld")[0]
    return text + ")"


def _delta(args, n):
    """--delta, else 1/n."""
    delta = getattr(args, "delta", None)
    return 1.0 / n if delta is None else delta


def _calibrate(args, n, batch_size, say):
    """The noise multiplier for --target-epsilon (RDP, Poisson sampling at
    q = B/n, `ceil(epochs n / B)` steps: `compute_dp_sgd_privacy`'s
    count), printed."""
    from custagg.privacy import budget  # pylint: disable=g-import-not-at-top
    delta = _delta(args, n)
    try:
        sigma = budget.noise_multiplier_for(
            args.target_epsilon, delta, batch_size / n, epochs=args.epochs)
    except ValueError as e:
        raise UsageError("--target-epsilon %g: %s" % (args.target_epsilon,
                                                       e)) from None
    say("noise multiplier chosen for --target-epsilon %g at delta %g: %.6g "
        "(RDP, for Poisson sampling at q = %d/%d, %d epochs; the figure for "
        "this job's shuffled batches is printed after each epoch)" % (
            args.target_epsilon, delta, sigma, batch_size, n, args.epochs))
    return sigma


def _reached(args, n, batch_size):
    from custagg.privacy import accounting  # pylint: disable=g-import-not-at-top
    eps, _ = accounting.compute_dp_sgd_privacy(
        n, batch_size, args.noise_multiplier, args.epochs, _delta(args, n))
    shuffled = accounting.dp_sgd_epsilons(
        n, batch_size, args.epochs, args.noise_multiplier, _delta(args, n),
        used_microbatching=_used_microbatching(args, batch_size))
    return ("epsilon reached: %.6g at delta %g (target %g, noise multiplier "
            "%.6g) had the batches been Poisson-sampled; for this job's "
            "shuffled batches: %.6g" % (
                eps, _delta(args, n), args.target_epsilon,
                args.noise_multiplier, shuffled["example_epsilon"]))


def _used_microbatching(args, batch_size):
    """Microbatches of more than one example double the sensitivity."""
    m = getattr(args, "num_microbatches", None)
    return m is not None and m < batch_size


def _privacy_statement(args, n, batch_size):
    """TF Privacy's privacy statement for the run, at delta = 1/n."""
    from custagg.privacy import accounting  # pylint: disable=g-import-not-at-top
    return accounting.compute_dp_sgd_privacy_statement(
        n, batch_size, args.epochs, args.noise_multiplier, _delta(args, n),
        used_microbatching=_used_microbatching(args, batch_size)).rstrip()


def _describe_aggregation(args):
    mb = ("" if args.num_microbatches is None else
          ", %d microbatches" % args.num_microbatches)
    return {
        "sum": "sum (gradient of the batch-mean loss, TF's own aggregation)",
        "weighted": "weighted (class-balanced gradient_factors fed each step, "
                    "AggregationMethod.CUSTOM)",
        "clip": "clip (mean of per-example gradients clipped to "
                "l2_norm_clip=%g%s)" % (args.l2_norm_clip, mb),
        "dpsgd": "dpsgd (l2_norm_clip=%g, noise_multiplier=%g%s, noise "
                 "%s)" % (args.l2_norm_clip, args.noise_multiplier, mb,
                          "from fresh entropy" if noise_seed(args) is None
                          else "seed %d" % noise_seed(args)),
    }[args.aggregation]


def _check(args, say, sess, data, variables):
    """Per-example gradients of one batch vs the loop reference."""
    n = min(args.check_batch_size, len(data.x_test))
    xc = tf.compat.v1.placeholder(tf.float32, [n, data.num_features])
    yc = tf.compat.v1.placeholder(tf.int64, [n])
    logits, _ = build_model(args.model, xc, data.image_shape,
                            data.num_classes, args.hidden, args.seed)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yc,
                                                          logits=logits)
    t0 = time.time()
    got = custagg.per_example_gradients(loss, variables,
                                        strategy=args.strategy)
    ref = testing.loop_per_example(loss, variables)
    feed = {xc: data.x_test[:n], yc: data.y_test[:n]}
    got_v, ref_v = sess.run([[tf.convert_to_tensor(g) for g in got], ref],
                            feed)
    say("check: per-example gradients of %d test images (strategy %s) vs "
        "custagg.testing.loop_per_example:" % (n, args.strategy))
    worst_abs, worst_rel, ok = 0.0, 0.0, True
    for v, g, r in zip(variables, got_v, ref_v):
        abs_err = float(np.max(np.abs(g - r))) if g.size else 0.0
        scale = float(np.max(np.abs(r))) if r.size else 0.0
        rel_err = abs_err / scale if scale > 0 else abs_err
        passed = g.shape == r.shape and rel_err <= args.check_rtol
        ok = ok and passed
        worst_abs, worst_rel = max(worst_abs, abs_err), max(worst_rel, rel_err)
        say("  %-22s %-18s max abs err %.3g  max rel err %.3g%s" % (
            v.op.name, list(g.shape), abs_err, rel_err,
            "" if passed else "  <- FAIL"))
    say("check: max abs err %.3g, max rel err %.3g (tolerance %g): %s "
        "(%.1f s)" % (worst_abs, worst_rel, args.check_rtol,
                      "PASS" if ok else "FAIL", time.time() - t0))
    return 0 if ok else 1


def _progress(batches, steps, epoch, epochs):
    """A progress bar over one epoch's batches on stderr; none when stderr
    is not a terminal (tqdm's `disable=None`), so logs and pipes stay clean."""
    return tqdm.tqdm(batches, total=steps, desc="epoch %d/%d" % (epoch, epochs),
                     unit="batch", leave=False, disable=None, file=sys.stderr)
