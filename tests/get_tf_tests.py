"""Copies TensorFlow's own gradient test files into custagg's cache.

tests/traversal/test_tf_gradients_suite.py runs these files (unchanged) with
custagg in place of TF's gradient functions. They are TF's (Apache-2.0),
not custagg's, and are never committed here: this script copies them from a
TF source checkout into a cache outside the repository.

Usage:

    python tests/get_tf_tests.py SOURCE [--rev REV] [--dest DIR]

* SOURCE: a TensorFlow source tree (a work tree: the files are copied), or
  a git directory of TF's repository (`.git` or a bare clone: the files are
  read with `git show REV:path`). Use the release that is installed
  (`git -C tensorflow checkout v2.21.0`, or `--rev v2.21.0`).
* `--rev`: the commit or tag to read (default: HEAD); implies git.
* `--dest`: where to put them (default `$CUSTAGG_TF_TESTS_DIR`, else
  `~/.cache/custagg/tf_tests`), in TF's layout; `SOURCE.json` there records
  where they came from.

The test bases TF ships in its wheel (`TF_WHEEL_FILES`) need no copy: the
suite reads them from the installed `tensorflow` package.
"""

import argparse
import json
import os
import subprocess
import sys

# TF's gradient test files, in TF's layout (paths as in its repository).
TF_TEST_FILES = (
    "tensorflow/python/ops/gradients_test.py",
    "tensorflow/python/ops/parallel_for/gradients_test.py",
    "tensorflow/python/ops/v1_compat_tests/gradient_checker_test.py",
    "tensorflow/python/ops/gradient_checker_v2_test.py",
    "tensorflow/python/kernel_tests/control_flow/control_flow_ops_py_test.py",
    "tensorflow/python/kernel_tests/control_flow/cond_v2_test.py",
    "tensorflow/python/kernel_tests/control_flow/while_v2_test.py",
    "tensorflow/python/kernel_tests/control_flow/functional_ops_test.py",
    "tensorflow/python/kernel_tests/data_structures/"
    "tensor_array_ops_test.py",
    "tensorflow/python/kernel_tests/nn_ops/embedding_ops_test.py",
)

# Gradient test bases that the TF wheel itself ships (run from there).
TF_WHEEL_FILES = (
    "tensorflow/python/kernel_tests/nn_ops/xent_op_test_base.py",
    "tensorflow/python/kernel_tests/sparse_ops/sparse_xent_op_test_base.py",
    "tensorflow/python/ops/image_grad_test_base.py",
)


def default_dest():
    return os.environ.get("CUSTAGG_TF_TESTS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "custagg", "tf_tests")


def _git_dir(source):
    for cand in (os.path.join(source, ".git"), source):
        if os.path.isfile(os.path.join(cand, "HEAD")):
            return cand
    return None


def _read(source, path, rev):
    """The text of `path` in SOURCE (at `rev` when reading from git)."""
    if rev is None and os.path.isfile(os.path.join(source, path)):
        with open(os.path.join(source, path), encoding="utf-8") as f:
            return f.read()
    git_dir = _git_dir(source)
    if git_dir is None:
        raise SystemExit(
            "get_tf_tests: %s is neither a TF source tree holding %s nor a "
            "git directory; pass a checkout of TensorFlow's repository at "
            "the installed release." % (source, path))
    proc = subprocess.run(
        ["git", "--git-dir", git_dir, "show", "%s:%s" % (rev or "HEAD", path)],
        capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit("get_tf_tests: git show %s:%s failed in %s: %s"
                         % (rev or "HEAD", path, git_dir, proc.stderr.strip()))
    return proc.stdout


def _commit(source, rev):
    git_dir = _git_dir(source)
    if git_dir is None:
        return None
    proc = subprocess.run(["git", "--git-dir", git_dir, "rev-parse",
                           rev or "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source")
    parser.add_argument("--rev", default=None)
    parser.add_argument("--dest", default=None)
    args = parser.parse_args(argv)
    dest = args.dest or default_dest()
    for path in TF_TEST_FILES:
        text = _read(args.source, path, args.rev)
        out = os.path.join(dest, path)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
        print("%s (%d bytes)" % (out, len(text)))
    with open(os.path.join(dest, "SOURCE.json"), "w") as f:
        json.dump({"source": os.path.abspath(args.source),
                   "rev": args.rev, "commit": _commit(args.source, args.rev),
                   "files": list(TF_TEST_FILES)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
