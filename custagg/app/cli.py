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

Adding a mode: declare its flags in `FLAGS` (a group of their own),
check their combinations in `check_args`, and pick the job to run in
`select_job`; a job is a function `job(args, out) -> exit status`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

# Mirrors custagg.per_example.STRATEGIES (tests/app/test_cli.py checks they agree),
# so that `--help` and flag errors need no TensorFlow.
STRATEGIES = ("auto", "rules", "pfor", "loop")
MODELS = ("softmax", "mlp", "cnn")
AGGREGATIONS = ("sum", "weighted", "clip", "dpsgd")
OPTIMIZERS = ("sgd", "momentum", "adam")

# Per model: learning rate for sgd (the tutorial's 0.5 for softmax).
DEFAULT_LEARNING_RATE = {"softmax": 0.5, "mlp": 0.1, "cnn": 0.1}
DEFAULT_EPOCHS = 10
DEFAULT_BATCH_SIZE = 64


def _number(convert, what, ok):
    """An argparse type: `convert(text)`, rejected unless `ok(value)`."""
    def parse(text):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError("expected %s, got %r"
                                             % (what, text))
        if not ok(value):
            raise argparse.ArgumentTypeError("expected %s, got %s"
                                             % (what, text))
        return value
    return parse


_positive_int = _number(int, "a positive integer", lambda v: v >= 1)


def _float(low, strict):
    """A finite float `> low` (`strict`) or `>= low`."""
    return _number(float, "a number %s %g" % (">" if strict else ">=", low),
                   lambda v: math.isfinite(v) and (v > low if strict
                                                   else v >= low))


_POSITIVE = dict(type=_positive_int)
# (group, flag, help, argparse keywords). A flag with a value states its
# default in the help ("(default: ...)" is added from `default`, or given in
# the help when it is not one value).
FLAGS = [
    ("training", "--model",
     "softmax regression (the TF1 tutorial), a one-hidden-layer MLP, or a "
     "small CNN", dict(choices=MODELS, default="softmax")),
    ("training", "--aggregation",
     "how per-example gradients are combined: sum (TF's own), weighted "
     "(class-balanced factors), clip, or dpsgd (clip + Gaussian noise)",
     dict(choices=AGGREGATIONS, default="sum")),
    ("training", "--strategy", "how per-example gradients are computed",
     dict(choices=STRATEGIES, default="auto")),
    ("training", "--batch-size", "examples per training step",
     dict(_POSITIVE, default=DEFAULT_BATCH_SIZE, metavar="B")),
    ("training", "--epochs", "passes over the training set",
     dict(_POSITIVE, default=DEFAULT_EPOCHS, metavar="N")),
    ("training", "--optimizer", "the TF1 optimizer that applies the gradients",
     dict(choices=OPTIMIZERS, default="sgd")),
    ("training", "--learning-rate",
     "step size (default: for sgd %s; momentum uses the sgd rate times 0.1; "
     "adam 0.001)" % ", ".join("%g for %s" % (v, k) for k, v in
                               DEFAULT_LEARNING_RATE.items()),
     dict(type=_float(0.0, True), metavar="LR")),
    ("training", "--hidden", "hidden units of --model mlp",
     dict(_POSITIVE, default=128, metavar="H")),
    ("training", "--seed", "seeds the data order and initialization (not "
     "the DP noise: --noise-seed)", dict(type=int, default=0)),
    ("clipping and DP-SGD", "--l2-norm-clip",
     "clip norm C for --aggregation clip / dpsgd",
     dict(type=_float(0.0, True), default=1.0, metavar="C")),
    ("clipping and DP-SGD", "--noise-multiplier",
     "noise std / C for --aggregation dpsgd",
     dict(type=_float(0.0, False), default=1.1, metavar="Z")),
    ("clipping and DP-SGD", "--target-epsilon",
     "dpsgd: choose the noise multiplier whose epsilon at --delta after "
     "--epochs is at most this (RDP, Poisson sampling at q = B/n; replaces "
     "--noise-multiplier)", dict(type=_float(0.0, True), metavar="EPS")),
    ("clipping and DP-SGD", "--delta",
     "dpsgd: the delta of the printed epsilon and of --target-epsilon "
     "(default: 1/n, n the training images)",
     dict(type=_number(float, "a number in (0, 1)", lambda v: 0 < v < 1),
          metavar="DELTA")),
    ("clipping and DP-SGD", "--noise-seed",
     "dpsgd: seeds the DP noise, for reproductions only (whoever knows the "
     "seed can subtract the noise; default: fresh entropy, and no graph seed "
     "on the noise)", dict(type=int, metavar="S")),
    ("clipping and DP-SGD", "--num-microbatches",
     "clip / dpsgd: microbatches per batch, must divide the batch size "
     "(default: one example each)", dict(_POSITIVE, metavar="M")),
    ("data", "--data-dir",
     "directory with MNIST (the four IDX files, optionally .gz, or "
     "mnist.npz) (default: Keras's cache if it has mnist.npz, else "
     "scikit-learn's bundled 8x8 digits)", dict(metavar="DIR")),
    ("data", "--download",
     "fetch mnist.npz into --data-dir (or Keras's cache) when it is missing; "
     "needs internet access", dict(action="store_true")),
    ("data", "--dataset", "force one data set (auto: MNIST if found, else "
     "digits)", dict(choices=("auto", "mnist", "digits"), default="auto")),
    ("data", "--train-limit",
     "use only the first N training images (default: all)",
     dict(_POSITIVE, metavar="N")),
    ("final check", "--check-batch-size",
     "test images in the final check against the loop reference",
     dict(_POSITIVE, default=32, metavar="N")),
    ("final check", "--check-rtol",
     "PASS when max|got - ref| <= RTOL * max|ref| for every variable",
     dict(type=_float(0.0, True), default=1e-4, metavar="RTOL")),
    ("final check", "--no-check",
     "skip the final check against the loop reference",
     dict(action="store_true")),
    ("distributed (TF1 parameter server)", "--distributed",
     "local: train on a cluster of 1 ps and --workers workers, each a process "
     "on 127.0.0.1 (SyncReplicasOptimizer; DP noise added once per step); see "
     "docs/distributed.md (default: one process)",
     dict(choices=("local",), default=None)),
    ("distributed (TF1 parameter server)", "--workers",
     "workers of --distributed local; each trains on --batch-size / W "
     "examples of every step", dict(_POSITIVE, default=2, metavar="W")),
    ("distributed (TF1 parameter server)", "--cluster-timeout",
     "--distributed: stop the cluster after S seconds",
     dict(type=_float(0.0, True), default=3600, metavar="S")),
    ("output", "--verbose", "keep TensorFlow's log lines (hidden by default)",
     dict(action="store_true")),
]


def build_parser():
    """The argument parser: `FLAGS`, grouped, plus --help and --version."""
    p = argparse.ArgumentParser(
        prog="custagg",
        description=(
            "Main job: train the TF1 MNIST tutorial model with per-example "
            "gradients (custagg), print per-epoch loss, accuracy and "
            "per-example gradient norms, then check one batch's per-example "
            "gradients against the loop reference (exit 1 on FAIL)."))
    groups = {}
    for group, flag, text, kwargs in FLAGS:
        if group not in groups:
            groups[group] = p.add_argument_group(group)
        if kwargs.get("default") is not None:
            text += " (default: %(default)s)"
        groups[group].add_argument(flag, help=text, **kwargs)
    groups["output"].add_argument(
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
    for flag in ("target_epsilon", "delta", "noise_seed"):
        if getattr(args, flag) is not None and args.aggregation != "dpsgd":
            parser.error("--%s applies to --aggregation dpsgd, not %s"
                         % (flag.replace("_", "-"), args.aggregation))
    if args.target_epsilon is not None and args.distributed is not None:
        parser.error("--target-epsilon is for one process; with "
                     "--distributed pass --noise-multiplier")
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
    started = time.time()
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    # The main job's closing "total" counts from here (TensorFlow's import
    # included).
    args.started = started
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
