"""TF Privacy's own tests and numbers against custagg.privacy (TF <= 2.15).

These run only where TensorFlow Privacy 0.9.0 is installed and importable
(it needs TF <= 2.15 and tensorflow-estimator); elsewhere they skip and say
why. Setup: see benchmarks/tf_privacy_compare.py.

* TF Privacy's `dp_optimizer_test.py`, read from the installed package and
  run with only its import lines changed to `custagg.privacy`: every test
  passes except `testWriteOutAndReloadAdam`, which wraps a Keras optimizer
  class (`tf.keras.optimizers.legacy.Adam`, an OptimizerV2): custagg's DP
  classes are TF1 (`tf.compat.v1.train`) optimizers.
* `compute_dp_sgd_privacy` equals TF Privacy's.
* The tutorial's model and optimizer call, noise off: custagg's weights equal
  TF Privacy's to 1e-6 after 5 steps.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Tests of dp_optimizer_test.py that cannot pass with custagg, and why.
EXPECTED_FAILURES = {
    "testWriteOutAndReloadAdam":
        "wraps tf.keras.optimizers.legacy.Adam (a Keras OptimizerV2 class); "
        "custagg's DP classes subclass tf.compat.v1.train optimizers only",
}


_IMPORTABLE = {}


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    # conftest sets this for TF >= 2.16; on TF 2.15 tf.keras is Keras 2 and
    # the switch would make TF (and so TF Privacy) look for tf-keras.
    if importlib.util.find_spec("tf_keras") is None:
        env.pop("TF_USE_LEGACY_KERAS", None)
    return env


def _tf_privacy_or_skip():
    """Skips unless TF Privacy imports (checked once, in a subprocess: this
    process has TF in graph mode and the test suite's Keras switch)."""
    if importlib.util.find_spec("tensorflow_privacy") is None:
        pytest.skip("TensorFlow Privacy is not installed (it needs TF <= 2.15; "
                    "see benchmarks/tf_privacy_compare.py for the setup)")
    if "error" not in _IMPORTABLE:
        proc = subprocess.run(
            [sys.executable, "-c",
             "from tensorflow_privacy.privacy.optimizers import dp_optimizer"],
            capture_output=True, text=True, env=_env(), timeout=300)
        _IMPORTABLE["error"] = (None if proc.returncode == 0 else
                                (proc.stderr.strip().splitlines() or ["?"])[-1])
    if _IMPORTABLE["error"]:
        pytest.skip("TensorFlow Privacy is installed but does not import here "
                    "(%s); it needs TF <= 2.15 and tensorflow-estimator"
                    % _IMPORTABLE["error"])


def _compare(part):
    """`python -m benchmarks.tf_privacy_compare --PART --json` -> its rows."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.tf_privacy_compare", "--" + part,
         "--json"], capture_output=True, text=True, env=_env(), cwd=REPO_ROOT,
        timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])[part]


def rewrite_imports(source):
    """TF Privacy's test file with its two import lines pointing at custagg."""
    new, n = re.subn(
        r"^from tensorflow_privacy\.privacy\.optimizers import dp_optimizer$",
        "from custagg.privacy import dp_optimizer", source, flags=re.M)
    assert n == 1, "the dp_optimizer import line was not found"
    new, n = re.subn(
        r"^from tensorflow_privacy\.privacy\.dp_query import gaussian_query$",
        "from custagg.privacy import gaussian_query", new, flags=re.M)
    assert n == 1, "the gaussian_query import line was not found"
    return new


def test_tf_privacy_dp_optimizer_test_file(tmp_path):
    _tf_privacy_or_skip()
    spec = importlib.util.find_spec("tensorflow_privacy")
    path = os.path.join(os.path.dirname(spec.origin), "privacy", "optimizers",
                        "dp_optimizer_test.py")
    with open(path) as f:
        source = f.read()
    target = tmp_path / "tfp_dp_optimizer_test_on_custagg.py"
    target.write_text(rewrite_imports(source))
    report = tmp_path / "report.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--junitxml", str(report), "-o", "addopts=", str(target)],
        capture_output=True, text=True, env=_env(), cwd=str(tmp_path),
        timeout=1200)
    xml = report.read_text()
    cases = re.findall(r'<testcase [^>]*name="([^"]+)"[^>]*?(/>|>(.*?)</testcase>)',
                       xml, flags=re.S)
    failed = sorted({name.split("(")[0] for name, _, body in cases
                     if "<failure" in body or "<error" in body})
    passed = [name for name, _, body in cases
              if not any(t in body for t in ("<failure", "<error", "<skipped"))]
    print("TF Privacy dp_optimizer_test.py on custagg: %d passed, %d failed "
          "(%s)" % (len(passed), len(failed), ", ".join(failed)))
    assert [n for n in failed if n not in EXPECTED_FAILURES] == [], \
        proc.stdout[-4000:]
    assert len(passed) >= 49, proc.stdout[-4000:]


def test_epsilon_equals_tf_privacy():
    """The tutorial's settings (n=60000, B=256, sigma=1.1, 60 epochs,
    delta=1e-5) and three others."""
    _tf_privacy_or_skip()
    rows = _compare("epsilon")
    assert len(rows) == 4
    for r in rows:
        assert r["rel_diff"] < 1e-3, r
        assert r["custagg_order"] == r["tf_privacy_order"], r


def test_tutorial_update_equals_tf_privacy():
    _tf_privacy_or_skip()
    rows = _compare("parity")
    assert len(rows) == 4
    for r in rows:
        assert r["max_abs_weight_diff"] < 1e-6, r
        assert r["max_weight_change"] > 1e-3, r        # the weights did move
        for std in r["noise_std"].values():
            assert abs(std / r["noise_std_expected"] - 1) < 0.15, r
