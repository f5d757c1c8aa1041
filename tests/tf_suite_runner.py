"""Runs one of TensorFlow's own test files with custagg in place of tf.gradients.

Usage (one mode and implementation per process: TF's v1/v2 switches are
process-wide):

    python tests/tf_suite_runner.py FILE --mode v2|v1|v1_cfv2 \
        --impl tf|custagg|custagg_helper [--json] [--only A,B]

* `--mode v2`: TF 2 behaviour (the test file's own default);
  `v1`: `tf.compat.v1.disable_v2_behavior()` first; `v1_cfv2`: that, then
  `tf.compat.v1.enable_control_flow_v2()`.
* `--impl tf`: TF's own functions (the baseline); `custagg`: custagg replaces
  `tf.gradients` and TF's public gradient functions
  (`custagg.use_as_tf_gradients(internal=False)`); `custagg_helper`: also
  TF's internal helper, which cond_v2 / while_v2 / tf.function backward
  passes call with `src_graph=` (`use_as_tf_gradients()`).

TF's test files are not part of custagg (Apache-2.0, kept with their license
header where they are stored); this script reads one from wherever it is
(see tests/traversal/test_tf_gradients_suite.py for where it looks) and changes
nothing in it. For copies older than the installed TF, names TF has since
moved are set back as aliases before the file is loaded, in every
implementation alike (`_old_names`): `ops.Tensor` (now `tensor.Tensor`),
`variables.VariableV1` and `variable_scope.variable` (now
`variable_v1.VariableV1`), `variables.RefVariable` (now
`ref_variable.RefVariable`), `control_flow_ops.cond` (now `cond.cond`),
`array_ops.stack` (now `array_ops_stack.stack`).

The last line of output is JSON: counts and the ids of failed tests.
"""

import argparse
import importlib.util
import json
import os
import sys
import unittest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _load(path):
    spec = importlib.util.spec_from_file_location("tf_suite_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _old_names(tf):
    """Aliases for names an older copy of a TF test file uses (see above)."""
    # pylint: disable=g-import-not-at-top
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_ops
    from tensorflow.python.ops import variable_scope
    from tensorflow.python.ops import variables
    if not hasattr(ops, "Tensor"):
        ops.Tensor = tf.Tensor
    try:
        from tensorflow.python.ops import variable_v1
        if not hasattr(variables, "VariableV1"):
            variables.VariableV1 = variable_v1.VariableV1
        if not hasattr(variable_scope, "variable"):
            variable_scope.variable = variable_v1.VariableV1
        from tensorflow.python.ops import ref_variable
        if not hasattr(variables, "RefVariable"):
            variables.RefVariable = ref_variable.RefVariable
    except ImportError:
        pass
    if not hasattr(control_flow_ops, "cond"):
        from tensorflow.python.ops import cond
        control_flow_ops.cond = cond.cond
    from tensorflow.python.ops import array_ops
    if not hasattr(array_ops, "stack"):
        from tensorflow.python.ops import array_ops_stack
        array_ops.stack = array_ops_stack.stack


def _flatten(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from _flatten(t)
        else:
            yield t


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--mode", choices=["v2", "v1", "v1_cfv2"],
                        default="v2")
    parser.add_argument("--impl", choices=["tf", "custagg", "custagg_helper"],
                        default="custagg")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", default=None,
                        help="run only tests whose id contains one of these "
                        "comma-separated substrings")
    args = parser.parse_args(argv)

    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    if args.mode in ("v1", "v1_cfv2"):
        tf.compat.v1.disable_v2_behavior()
    if args.mode == "v1_cfv2":
        tf.compat.v1.enable_control_flow_v2()
    _old_names(tf)
    # custagg from this checkout (the script's directory is tests/).
    sys.path.insert(0, os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    import custagg  # pylint: disable=g-import-not-at-top

    module = _load(os.path.abspath(args.file))
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    if args.only:
        wanted = args.only.split(",")
        suite = unittest.TestSuite(
            t for t in _flatten(suite) if any(w in t.id() for w in wanted))
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=1)
    if args.impl == "tf":
        result = runner.run(suite)
    else:
        with custagg.use_as_tf_gradients(
                internal=args.impl == "custagg_helper"):
            result = runner.run(suite)
    failed = sorted(t.id().split(".", 1)[1]
                    for t, _ in result.failures + result.errors)
    out = {"mode": args.mode, "impl": args.impl, "run": result.testsRun,
           "skipped": len(result.skipped), "failed": failed,
           "passed": result.testsRun - len(failed) - len(result.skipped)}
    for t, trace in result.failures + result.errors:
        sys.stderr.write("FAILED %s\n%s\n" % (t.id(), trace[-1500:]))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
