"""TensorFlow's own gradient tests, with custagg in place of tf.gradients.

TF's test files are not in this repository. They are read at test time from
the first of these that has them (and the tests skip, saying where they
looked and how to get them, when none does):

* `$CUSTAGG_TF_TESTS_DIR`,
* `~/.cache/custagg/tf_tests`,
* the installed `tensorflow` package's parent directory (wheels ship no
  test files today, but they ship some test bases: `TF_WHEEL_FILES`),

each holding TF's layout (`get_tf_tests.TF_TEST_FILES`:
`tensorflow/python/ops/gradients_test.py`,
`.../kernel_tests/control_flow/control_flow_ops_py_test.py`, ...). Fill the
cache from a TF source checkout of the installed release:

    python tests/get_tf_tests.py path/to/tensorflow --rev v2.21.0

Each file runs in a subprocess (tests/tf_suite_runner.py) per mode: TF 2
(`v2`), `disable_v2_behavior()` (`v1`), and that with control flow v2
(`v1_cfv2`); and per implementation: TF's own (the baseline), custagg as the
public `tf.gradients` (`custagg`), and custagg also as TF's internal helper
that cond_v2 / while_v2 / tf.function backward passes call with `src_graph=`
(`custagg_helper`). custagg must pass every test TF passes, in every mode.
The counts measured are in docs/traversal.md. The whole run takes hours on
two cores; one file at a time:

    python -m pytest -m slow tests/traversal/test_tf_gradients_suite.py -k cond_v2_test
"""

import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
RUNNER = os.path.join(REPO_ROOT, "tests", "tf_suite_runner.py")
sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))
from get_tf_tests import TF_TEST_FILES, TF_WHEEL_FILES  # noqa: E402

FILES = {os.path.basename(p)[:-3] if os.path.basename(p) != "gradients_test.py"
         else p.split("/")[-2] + "_gradients_test": p
         for p in TF_TEST_FILES + TF_WHEEL_FILES}
MODES = ("v2", "v1", "v1_cfv2")
IMPLS = ("custagg", "custagg_helper")


def _roots():
    roots = []
    if os.environ.get("CUSTAGG_TF_TESTS_DIR"):
        roots.append(os.environ["CUSTAGG_TF_TESTS_DIR"])
    roots.append(os.path.join(os.path.expanduser("~"), ".cache", "custagg",
                              "tf_tests"))
    try:
        import importlib.util
        spec = importlib.util.find_spec("tensorflow")
        if spec is not None and spec.origin:
            roots.append(os.path.dirname(os.path.dirname(spec.origin)))
    except (ImportError, ValueError):
        pass
    return roots


def _find(which):
    for root in _roots():
        path = os.path.join(root, *FILES[which].split("/"))
        if os.path.isfile(path):
            return path
    pytest.skip(
        "TF's %s not found under %s. Get TF's test files from a TF source "
        "checkout of the installed release: python tests/get_tf_tests.py "
        "path/to/tensorflow --rev v%s (or set CUSTAGG_TF_TESTS_DIR)."
        % (FILES[which], ", ".join(_roots()), _tf_version()))
    return None


def _tf_version():
    try:
        from importlib import metadata
        for dist in ("tensorflow", "tensorflow-cpu"):
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
    except ImportError:
        pass
    return "X.Y.Z"


_RESULTS = {}


def _run(path, mode, impl):
    key = (path, mode, impl)
    if key not in _RESULTS:
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run(
            [sys.executable, RUNNER, path, "--mode", mode, "--impl", impl],
            capture_output=True, text=True, env=env, cwd=REPO_ROOT,
            timeout=1800)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            _RESULTS[key] = {"error": proc.stderr[-3000:]}
        else:
            _RESULTS[key] = json.loads(lines[-1])
            _RESULTS[key]["log"] = proc.stderr[-6000:]
    return _RESULTS[key]


@pytest.mark.slow
@pytest.mark.parametrize("which", sorted(FILES))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
def test_tf_suite_with_custagg(which, mode, impl):
    path = _find(which)
    baseline = _run(path, mode, "tf")
    if "error" in baseline:
        pytest.skip("TF's own run of %s does not complete here (an older "
                    "copy?): %s" % (path, baseline["error"][-500:]))
    if baseline["run"] == 0:
        # E.g. tensor_array_ops_test's setUpClass starts a local cluster and
        # needs the `portpicker` package (pip install portpicker).
        pytest.skip("TF's own run of %s ran no test here: %s"
                    % (path, baseline["log"][-600:]))
    got = _run(path, mode, impl)
    assert "error" not in got, got.get("error")
    print("%s %s: TF %d/%d, %s %d/%d (skipped %d)" % (
        which, mode, baseline["passed"], baseline["passed"] +
        len(baseline["failed"]), impl, got["passed"],
        got["passed"] + len(got["failed"]), got["skipped"]))
    extra = sorted(set(got["failed"]) - set(baseline["failed"]))
    assert not extra, "fail with custagg, pass with TF: %s\n%s" % (
        extra, got["log"])
    assert got["run"] == baseline["run"]
    assert got["passed"] >= baseline["passed"]
