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

Quiet by default: TensorFlow's log level is set before TensorFlow is
imported, and its start-up lines are dropped (`--verbose` keeps them).
`--help` and flag errors never import TensorFlow.

Adding a mode: declare its flags in `build_parser` (a group of their own),
check their combinations in `check_args`, and pick the job to run in
`select_job`; a job is a function `job(args, out) -> exit status`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

# Mirrors custagg.per_example.STRATEGIES (tests/test_cli.py checks they agree),
# so that `--help` and flag errors need no TensorFlow.
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
        if not math.isfinite(value) or (value <= low if strict
                                        else value < low):
            raise argparse.ArgumentTypeError(
                "expected a number %s %g, got %s" % (">" if strict else ">=",
                                                     low, text))
        return value
    return parse


def build_parser():
    """The argument parser; every flag has help text and states its default."""
    p = argparse.ArgumentParser(
        prog="custagg",
        description=(
            "Main job: train the TF1 MNIST tutorial model with per-example "
            "gradients (custagg), print per-epoch loss, accuracy and "
            "per-example gradient norms, then check one batch's per-example "
            "gradients against the loop reference (exit 1 on FAIL)."))
    training = p.add_argument_group("training")
    training.add_argument(
        "--model", choices=MODELS, default="softmax",
        help="softmax regression (the TF1 tutorial), a one-hidden-layer MLP, "
             "or a small CNN (default: %(default)s)")
    training.add_argument(
        "--aggregation", choices=AGGREGATIONS, default="sum",
        help="how per-example gradients are combined: sum (TF's own), "
             "weighted (class-balanced factors), clip, or dpsgd (clip + "
             "Gaussian noise) (default: %(default)s)")
    training.add_argument(
        "--strategy", choices=STRATEGIES, default="auto",
        help="how per-example gradients are computed (default: %(default)s)")
    training.add_argument(
        "--batch-size", type=_positive_int, default=DEFAULT_BATCH_SIZE,
        metavar="B", help="examples per training step (default: %(default)s)")
    training.add_argument(
        "--epochs", type=_positive_int, default=DEFAULT_EPOCHS, metavar="N",
        help="passes over the training set (default: %(default)s)")
    training.add_argument(
        "--optimizer", choices=OPTIMIZERS, default="sgd",
        help="the TF1 optimizer that applies the gradients "
             "(default: %(default)s)")
    training.add_argument(
        "--learning-rate", type=_float(0.0, True), default=None, metavar="LR",
        help="step size (default: for sgd %s; momentum uses the sgd rate "
             "times 0.1; adam 0.001)" % ", ".join(
                 "%g for %s" % (v, k) for k, v in
                 DEFAULT_LEARNING_RATE.items()))
    training.add_argument(
        "--hidden", type=_positive_int, default=128, metavar="H",
        help="hidden units of --model mlp (default: %(default)s)")
    training.add_argument(
        "--seed", type=int, default=0,
        help="seeds the data order, initialization and DP noise "
             "(default: %(default)s)")
    privacy = p.add_argument_group("clipping and DP-SGD")
    privacy.add_argument(
        "--l2-norm-clip", type=_float(0.0, True), default=1.0, metavar="C",
        help="clip norm C for --aggregation clip / dpsgd "
             "(default: %(default)s)")
    privacy.add_argument(
        "--noise-multiplier", type=_float(0.0, False), default=1.1,
        metavar="Z", help="noise std / C for --aggregation dpsgd "
                          "(default: %(default)s)")
    privacy.add_argument(
        "--num-microbatches", type=_positive_int, default=None, metavar="M",
        help="clip / dpsgd: microbatches per batch, must divide the batch "
             "size (default: one example each)")
    data = p.add_argument_group("data")
    data.add_argument(
        "--data-dir", default=None, metavar="DIR",
        help="directory with MNIST (the four IDX files, optionally .gz, or "
             "mnist.npz) (default: Keras's cache if it has mnist.npz, else "
             "scikit-learn's bundled 8x8 digits)")
    data.add_argument(
        "--download", action="store_true",
        help="fetch mnist.npz into --data-dir (or Keras's cache) when it is "
             "missing; needs internet access")
    data.add_argument(
        "--dataset", choices=("auto", "mnist", "digits"), default="auto",
        help="force one data set (default: %(default)s: MNIST if found, else "
             "digits)")
    data.add_argument(
        "--train-limit", type=_positive_int, default=None, metavar="N",
        help="use only the first N training images (default: all)")
    check = p.add_argument_group("final check")
    check.add_argument(
        "--check-batch-size", type=_positive_int, default=32, metavar="N",
        help="test images in the final check against the loop reference "
             "(default: %(default)s)")
    check.add_argument(
        "--check-rtol", type=_float(0.0, True), default=1e-4, metavar="RTOL",
        help="PASS when max|got - ref| <= RTOL * max|ref| for every variable "
             "(default: %(default)s)")
    check.add_argument(
        "--no-check", action="store_true",
        help="skip the final check against the loop reference")
    cluster = p.add_argument_group("distributed (TF1 parameter server)")
    cluster.add_argument(
        "--distributed", choices=("local",), default=None,
        help="local: train on a cluster of 1 ps and --workers workers, each "
             "a process on 127.0.0.1 (SyncReplicasOptimizer; DP noise added "
             "once per step); see docs/distributed.md (default: one process)")
    cluster.add_argument(
        "--workers", type=_positive_int, default=2, metavar="W",
        help="workers of --distributed local; each trains on --batch-size / "
             "W examples of every step (default: %(default)s)")
    cluster.add_argument(
        "--cluster-timeout", type=_float(0.0, True), default=3600,
        metavar="S", help="--distributed: stop the cluster after S seconds "
                          "(default: %(default)s)")
    output = p.add_argument_group("output")
    output.add_argument(
        "--verbose", action="store_true",
        help="keep TensorFlow's log lines (hidden by default)")
    output.add_argument(
        "--version", action="version", version="%(prog)s " + _version(),
        help="print the version and exit")
    return p


def _version():
    from custagg._version import __version__  # pylint: disable=g-import-not-at-top
    return __version__


def check_args(parser, args):
    """Flag combinations argparse cannot check; exits 2 on a bad one."""
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
    if args.distributed is not None:
        if args.batch_size % args.workers:
            parser.error("--batch-size %d must be a multiple of --workers %d"
                         % (args.batch_size, args.workers))
        if args.num_microbatches is not None and (
                args.num_microbatches % args.workers):
            parser.error("--distributed: --num-microbatches %d must be a "
                         "multiple of --workers %d (each worker clips its "
                         "share)" % (args.num_microbatches, args.workers))
        if args.download:
            parser.error("--download cannot be used with --distributed; "
                         "download once without it")
    if args.data_dir is not None and not args.download:
        path = os.path.expanduser(args.data_dir)
        if not os.path.exists(path):
            parser.error("--data-dir %s: the directory does not exist"
                         % args.data_dir)


def _data_error(args, e):
    """A data-loading error in the CLI's terms."""
    from custagg.app import datasets  # pylint: disable=g-import-not-at-top
    if isinstance(e, datasets.MnistNotFoundError):
        looked = ", ".join(e.looked_for)
        if args.data_dir is not None:
            return ("--data-dir %s holds no MNIST files (looked for %s). Put "
                    "them there, add --download to fetch mnist.npz, or leave "
                    "out --data-dir to train on the bundled digits"
                    % (args.data_dir, looked))
        return ("--dataset mnist: no MNIST in %s (looked for mnist.npz). "
                "Pass --data-dir DIR with the files (%s), or add --download"
                % (e.where, looked))
    return str(e)


def select_job(args):
    """The function that runs the job the flags ask for."""
    if args.distributed == "local":
        from custagg.app import cluster  # pylint: disable=g-import-not-at-top
        return cluster.run_local
    from custagg.app import train  # pylint: disable=g-import-not-at-top
    return train.run


def main(argv=None):
    """Entry point of `python -m custagg` and the `custagg` console script.

    Args:
      argv: the arguments (default `sys.argv[1:]`).

    Returns:
      0 on success, 1 when the final check fails; flag and data errors exit
      with 2 (argparse's usage message).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    # Before anything imports TensorFlow.
    from custagg.app import quiet  # pylint: disable=g-import-not-at-top
    quiet.import_tensorflow(verbose=args.verbose)
    from custagg.app import datasets  # pylint: disable=g-import-not-at-top
    from custagg.app import train  # pylint: disable=g-import-not-at-top
    job = select_job(args)
    try:
        return job(args, sys.stdout)
    except (FileNotFoundError, datasets.DataFormatError, train.UsageError,
            datasets.DownloadError) as e:
        parser.error(_data_error(args, e))
