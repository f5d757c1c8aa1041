"""`python -m custagg` / `custagg`: the main job.

Trains the TF1 MNIST tutorial model (softmax regression; `--model mlp` or
`--model cnn` for the others) in a `tf.compat.v1.Session` with per-example
gradients. Each epoch prints the loss, the accuracies and the distribution of
the per-example gradient norms. At the end, the per-example gradients of one
batch are checked against the loop reference
(`custagg.testing.loop_per_example`): max abs / rel error and PASS or FAIL;
the exit status is 1 on FAIL.

Aggregations (`--aggregation`):

* `sum`: TF's own aggregation, the gradient of the batch-mean loss (the
  tutorial's `GradientDescentOptimizer(0.5).minimize(reduce_mean(ce))`).
* `weighted`: `sum_i f_i g_i` with class-balanced factors fed each step
  (`f_i` proportional to 1 / frequency of example i's class in the
  training set, normalized to sum to 1 over the batch).
* `clip`: the mean of per-example gradients clipped to `--l2-norm-clip`.
* `dpsgd`: clip, add Gaussian noise of std `--noise-multiplier *
  --l2-norm-clip` to the sum, divide by the batch size (DP-SGD).

The data is MNIST when `--data-dir` (or Keras's cache) has it, else
scikit-learn's bundled 8x8 digits; the first line says which.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

# custagg.STRATEGIES, repeated so `--help` and flag errors need no TensorFlow.
STRATEGIES = ("auto", "rules", "pfor", "loop")
MODELS = ("softmax", "mlp", "cnn")
AGGREGATIONS = ("sum", "weighted", "clip", "dpsgd")
OPTIMIZERS = ("sgd", "momentum", "adam")

# Per model: learning rate for sgd (the tutorial's 0.5 for softmax).
DEFAULT_LEARNING_RATE = {"softmax": 0.5, "mlp": 0.1, "cnn": 0.1}
DEFAULT_EPOCHS = 10
DEFAULT_BATCH_SIZE = 64


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("expected a positive integer, got %r"
                                         % text)
    if value < 1:
        raise argparse.ArgumentTypeError("expected a positive integer, got %d"
                                         % value)
    return value


def _float(low, strict):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError("expected a number, got %r"
                                             % text)
        if not np.isfinite(value) or (value <= low if strict else value < low):
            raise argparse.ArgumentTypeError(
                "expected a number %s %g, got %s" % (">" if strict else ">=",
                                                     low, text))
        return value
    return parse


def build_parser():
    p = argparse.ArgumentParser(
        prog="custagg",
        description=(
            "Main job: train the TF1 MNIST tutorial model with per-example "
            "gradients (custagg), print per-epoch loss, accuracy and "
            "per-example gradient norms, then check one batch's per-example "
            "gradients against the loop reference (exit 1 on FAIL)."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="softmax",
                   help="softmax regression (the TF1 tutorial), a one-hidden-"
                        "layer MLP, or a small CNN")
    p.add_argument("--aggregation", choices=AGGREGATIONS, default="sum",
                   help="how per-example gradients are combined")
    p.add_argument("--strategy", choices=STRATEGIES, default="auto",
                   help="how per-example gradients are computed")
    p.add_argument("--batch-size", type=_positive_int,
                   default=DEFAULT_BATCH_SIZE)
    p.add_argument("--epochs", type=_positive_int, default=DEFAULT_EPOCHS)
    p.add_argument("--learning-rate", type=_float(0.0, True), default=None,
                   help="default: %s for sgd; 0.001 for adam; momentum "
                        "uses the sgd rate times 0.1" % ", ".join(
                            "%s %g" % kv for kv in
                            DEFAULT_LEARNING_RATE.items()))
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                   help="the TF1 optimizer that applies the gradients")
    p.add_argument("--l2-norm-clip", type=_float(0.0, True), default=1.0,
                   help="clip norm C for --aggregation clip / dpsgd")
    p.add_argument("--noise-multiplier", type=_float(0.0, False),
                   default=1.1,
                   help="noise std / C for --aggregation dpsgd")
    p.add_argument("--num-microbatches", type=_positive_int, default=None,
                   help="clip / dpsgd: microbatches per batch (must divide "
                        "the batch size); default: one example each")
    p.add_argument("--hidden", type=_positive_int, default=128,
                   help="hidden units of --model mlp")
    p.add_argument("--data-dir", default=None,
                   help="directory with MNIST (IDX files or mnist.npz); "
                        "default: Keras's cache if it has mnist.npz, else "
                        "scikit-learn's bundled 8x8 digits")
    p.add_argument("--download", action="store_true",
                   help="fetch mnist.npz into --data-dir (or Keras's cache) "
                        "when it is missing; needs internet access")
    p.add_argument("--dataset", choices=("auto", "mnist", "digits"),
                   default="auto", help="force one data set")
    p.add_argument("--train-limit", type=_positive_int, default=None,
                   help="use only the first N training images")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the data order, initialization and DP noise")
    p.add_argument("--check-batch-size", type=_positive_int, default=32,
                   help="examples in the final check against the loop "
                        "reference")
    p.add_argument("--check-rtol", type=_float(0.0, True), default=1e-4,
                   help="PASS when max|got - ref| <= rtol * max|ref| for "
                        "every variable")
    p.add_argument("--no-check", action="store_true",
                   help="skip the final check against the loop reference")
    p.add_argument("--version", action="version",
                   version="%(prog)s " + _version())
    return p


def _version():
    from custagg._version import __version__  # pylint: disable=g-import-not-at-top
    return __version__


def _check_args(parser, args):
    if args.num_microbatches is not None:
        if args.aggregation not in ("clip", "dpsgd"):
            parser.error("--num-microbatches applies to --aggregation clip "
                         "or dpsgd, not %s" % args.aggregation)
        if args.batch_size % args.num_microbatches:
            parser.error("--num-microbatches %d must divide --batch-size %d"
                         % (args.num_microbatches, args.batch_size))
    if args.dataset == "digits" and args.data_dir is not None:
        parser.error("--data-dir is for MNIST; it cannot be used with "
                     "--dataset digits")


# --------------------------------------------------------------------------
# Models: graph-mode TF1 code, variables from tf.compat.v1.get_variable.


def build_model(name, x, image_shape, num_classes, hidden=128, seed=0):
    """Logits `[N, num_classes]` for flattened images `x` `[N, D]`.

    Variables are created with `tf.compat.v1.get_variable` under
    `AUTO_REUSE`, so calling this again (e.g. for an evaluation placeholder
    of another batch size) shares them.

    Returns:
      `(logits, variables)`.
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    d = int(np.prod(image_shape))
    glorot = lambda i: tf.compat.v1.glorot_uniform_initializer(seed=seed + i)
    get = lambda *a, **k: tf.compat.v1.get_variable(*a, use_resource=True,
                                                    **k)
    with tf.compat.v1.variable_scope(name, reuse=tf.compat.v1.AUTO_REUSE):
        if name == "softmax":
            # The TF1 tutorial: W and b start at zero.
            w = get("W", [d, num_classes], initializer=tf.zeros_initializer())
            b = get("b", [num_classes], initializer=tf.zeros_initializer())
            return tf.matmul(x, w) + b, [w, b]
        if name == "mlp":
            w1 = get("W1", [d, hidden], initializer=glorot(1))
            b1 = get("b1", [hidden], initializer=tf.zeros_initializer())
            w2 = get("W2", [hidden, num_classes], initializer=glorot(2))
            b2 = get("b2", [num_classes], initializer=tf.zeros_initializer())
            h = tf.nn.relu(tf.matmul(x, w1) + b1)
            return tf.matmul(h, w2) + b2, [w1, b1, w2, b2]
        if name == "cnn":
            height, width, channels = image_shape
            k = 5 if min(height, width) >= 16 else 3
            c1 = get("conv1", [k, k, channels, 16], initializer=glorot(3))
            cb1 = get("conv1_b", [16], initializer=tf.zeros_initializer())
            c2 = get("conv2", [k, k, 16, 32], initializer=glorot(4))
            cb2 = get("conv2_b", [32], initializer=tf.zeros_initializer())
            img = tf.reshape(x, [-1, height, width, channels])
            h = tf.nn.relu(tf.nn.bias_add(
                tf.nn.conv2d(img, c1, 1, "SAME"), cb1))
            h = tf.nn.max_pool2d(h, 2, 2, "SAME")
            h = tf.nn.relu(tf.nn.bias_add(
                tf.nn.conv2d(h, c2, 1, "SAME"), cb2))
            h = tf.nn.max_pool2d(h, 2, 2, "SAME")
            flat_dim = ((height + 3) // 4) * ((width + 3) // 4) * 32
            w = get("W", [flat_dim, num_classes], initializer=glorot(5))
            b = get("b", [num_classes], initializer=tf.zeros_initializer())
            logits = tf.matmul(tf.reshape(h, [-1, flat_dim]), w) + b
            return logits, [c1, cb1, c2, cb2, w, b]
    raise ValueError("build_model: unknown model %r; expected one of %s."
                     % (name, ", ".join(MODELS)))


def class_balanced_factors(labels, class_weights):
    """`f_i` proportional to `class_weights[labels[i]]`, summing to 1."""
    f = class_weights[labels].astype(np.float32)
    return f / f.sum()


def _describe_norms(norms):
    q = np.quantile(norms, [0.0, 0.25, 0.5, 0.75, 1.0])
    return "min %.3g  q25 %.3g  median %.3g  q75 %.3g  max %.3g" % tuple(q)


def _make_optimizer(args, tf, opt_lib, lr):
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
        num_microbatches=args.num_microbatches, seed=args.seed,
        strategy=args.strategy)


def _learning_rate(args):
    if args.learning_rate is not None:
        return args.learning_rate
    if args.optimizer == "adam":
        return 0.001
    lr = DEFAULT_LEARNING_RATE[args.model]
    return lr * 0.1 if args.optimizer == "momentum" else lr


def _evaluate(sess, acc_sum, x_eval, y_eval, x, y, chunk=1000):
    correct = 0.0
    for start in range(0, len(x), chunk):
        correct += sess.run(acc_sum, {x_eval: x[start:start + chunk],
                                      y_eval: y[start:start + chunk]})
    return correct / max(len(x), 1)


def run(args, out=None):
    """The main job for parsed `args`; returns the exit status."""
    out = out or sys.stdout
    say = lambda *a: print(*a, file=out, flush=True)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    import custagg  # pylint: disable=g-import-not-at-top
    from custagg import datasets  # pylint: disable=g-import-not-at-top
    from custagg import optimizers as opt_lib  # pylint: disable=g-import-not-at-top
    from custagg import testing  # pylint: disable=g-import-not-at-top

    data = datasets.load_dataset(args.dataset, data_dir=args.data_dir,
                                 download=args.download, seed=args.seed)
    if args.train_limit is not None:
        data = data.subset(args.train_limit, None)
    bsz = args.batch_size
    say("custagg %s main job" % custagg.__version__)
    say("data: %s" % data.describe())
    if len(data.x_train) < bsz:
        raise _UsageError("--batch-size %d is larger than the %d training "
                          "images" % (bsz, len(data.x_train)))
    lr = _learning_rate(args)
    counts = np.bincount(data.y_train, minlength=data.num_classes)
    class_weights = 1.0 / np.maximum(counts, 1)

    t_start = time.time()
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(args.seed)
        d = data.num_features
        x = tf.compat.v1.placeholder(tf.float32, [bsz, d], name="x")
        y = tf.compat.v1.placeholder(tf.int64, [bsz], name="y")
        logits, variables = build_model(args.model, x, data.image_shape,
                                        data.num_classes, args.hidden,
                                        args.seed)
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits, name="per_example_loss")
        global_step = tf.compat.v1.train.get_or_create_global_step()
        opt = _make_optimizer(args, tf, opt_lib, lr)
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
            for epoch in range(1, args.epochs + 1):
                t0 = time.time()
                losses, correct, seen, all_norms = [], 0.0, 0, []
                for xb, yb in datasets.minibatches(
                        data.x_train, data.y_train, bsz, seed=args.seed,
                        epoch=epoch):
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
                test_acc = _evaluate(sess, eval_correct, x_eval, y_eval,
                                     data.x_test, data.y_test)
                say("epoch %2d  loss %.4f  train acc %.4f  test acc %.4f  "
                    "%.1fs  |  per-example grad norms: %s" % (
                        epoch, float(np.mean(losses)), correct / seen,
                        test_acc, time.time() - t0,
                        _describe_norms(np.concatenate(all_norms))))
                if args.aggregation == "dpsgd":
                    say("          " + _describe_epsilon(
                        args, len(data.x_train), bsz, epoch))
            if args.aggregation == "dpsgd":
                say("privacy after %d epochs: %s" % (
                    args.epochs, _describe_epsilon(
                        args, len(data.x_train), bsz, args.epochs, pld=True)))
            status = 0
            if not args.no_check:
                status = _check(args, say, sess, tf, custagg, testing, data,
                                variables)
    say("total %.1f s" % (time.time() - t_start))
    return status


def _describe_epsilon(args, n, batch_size, epochs, pld=False):
    """ε at δ = 1/n, TF Privacy's accounting (RDP, Poisson sampling with
    q = B/n, ceil(epochs * n / B) steps, epochs counted as its tutorial
    does); with `pld`, dp-accounting's PLD figure too."""
    from custagg.privacy import accounting  # pylint: disable=g-import-not-at-top
    delta = 1.0 / n
    eps, order = accounting.compute_dp_sgd_privacy(
        n, batch_size, args.noise_multiplier, epochs, delta)
    text = "epsilon %.3f at delta 1/%d (RDP order %s" % (eps, n, order)
    if pld:
        text += "; PLD accountant: %.3f" % accounting.compute_dp_sgd_privacy(
            n, batch_size, args.noise_multiplier, epochs, delta,
            accountant="pld")[0]
    return text + "; custagg.privacy.compute_dp_sgd_privacy)"


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
                 "seed %d)" % (args.l2_norm_clip, args.noise_multiplier, mb,
                               args.seed),
    }[args.aggregation]


def _check(args, say, sess, tf, custagg, testing, data, variables):
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


class _UsageError(Exception):
    """A flag value that only turns out wrong once the data is known."""


def main(argv=None):
    """Entry point of `python -m custagg` and the `custagg` console script.

    Args:
      argv: the arguments (default `sys.argv[1:]`).

    Returns:
      0 on success, 1 when the final check fails; flag errors exit with 2
      (argparse's usage message).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from custagg import datasets  # pylint: disable=g-import-not-at-top
    try:
        return run(args)
    except (FileNotFoundError, datasets.DataFormatError, _UsageError,
            datasets.DownloadError) as e:
        parser.error(str(e))
