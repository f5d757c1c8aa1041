"""TF Privacy's own tests and numbers against custagg.privacy (TF <= 2.15).

These run only where TensorFlow Privacy 0.9.0 is installed and importable
(it needs TF <= 2.15 and tensorflow-estimator); elsewhere they skip and say
why. Setup: see benchmarks/dp_step.py (mode tf_privacy_compare).

* TF Privacy's optimizer, vectorized-optimizer and DP-query test files
  (`TEST_FILES`), read from the installed package and run with only their
  import lines changed to `custagg.privacy`: every test passes except
  `testWriteOutAndReloadAdam`, which wraps a Keras optimizer class
  (`tf.keras.optimizers.legacy.Adam`, an OptimizerV2): custagg's DP
  classes are TF1 (`tf.compat.v1.train`) optimizers; and one statistical
  check whose tolerance the seeded noise stream misses by chance
  (`CHANCE_FAILURES`).
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

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

# Tests of TF Privacy's files that cannot pass with custagg, and why.
EXPECTED_FAILURES = {
    "testWriteOutAndReloadAdam":
        "wraps tf.keras.optimizers.legacy.Adam (a Keras OptimizerV2 class); "
        "custagg's DP classes subclass tf.compat.v1.train optimizers only",
}
# Tests of one file that fail by chance: a statistical check whose tolerance
# a correct draw misses, for the one (seeded, deterministic) stream the test
# gets. custagg's noise is a checkpointed stream keyed by the graph seed and
# the optimizer's name (issue 36), not TF's stateful random op whose draws
# the test was tuned on.
CHANCE_FAILURES = {
    ("optimizers/dp_optimizer_vectorized_test.py",
     "testNoiseMultiplierDPAdagrad"):
        "std of 5000 draws of N(0, 32^2) within 32 +/- 0.5, i.e. 1.56 "
        "standard errors (about 1 run in 8 misses it): under TF's test seed "
        "the Adagrad stream gives 32.585; under graph seeds 1-7, 31.72-32.25",
}


def _expected_failure(name, rel_path=None):
    return name in EXPECTED_FAILURES or (rel_path, name) in CHANCE_FAILURES


# TF Privacy's test files (under tensorflow_privacy/privacy/), and how many
# of their tests pass with custagg at least (TF Privacy 0.9.0 on TF 2.15.1:
# all of each file pass for TF Privacy itself; 290 in all; custagg 288).
TEST_FILES = {
    "optimizers/dp_optimizer_test.py": 49,
    "optimizers/dp_optimizer_eager_test.py": 15,
    "optimizers/dp_optimizer_vectorized_test.py": 22,
    "dp_query/dp_query_test.py": 1,
    "dp_query/gaussian_query_test.py": 8,
    "dp_query/no_privacy_query_test.py": 6,
    "dp_query/normalized_query_test.py": 1,
    "dp_query/nested_query_test.py": 8,
    "dp_query/quantile_estimator_query_test.py": 38,
    "dp_query/quantile_adaptive_clip_sum_query_test.py": 15,
    "dp_query/tree_aggregation_test.py": 78,
    "dp_query/tree_aggregation_query_test.py": 47,
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
                    "see benchmarks/dp_step.py for the setup)")
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
    """`python -m benchmarks.dp_step tf_privacy_compare --PART --json` -> its
    rows."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.dp_step", "tf_privacy_compare",
         "--" + part, "--json"], capture_output=True, text=True, env=_env(),
        cwd=REPO_ROOT, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])[part]


def rewrite_imports(source):
    """A TF Privacy test file with its imports of the optimizer and query
    modules pointing at custagg (`test_utils` stays TF Privacy's)."""
    new, n_opt = re.subn(
        r"^from tensorflow_privacy\.privacy\.optimizers import "
        r"(dp_optimizer\w*)$", r"from custagg.privacy import \1", source,
        flags=re.M)
    new, n_cls = re.subn(
        r"^from tensorflow_privacy\.privacy\.optimizers\.(dp_optimizer\w*) "
        r"import", r"from custagg.privacy.\1 import", new, flags=re.M)
    new, n_q = re.subn(
        r"^from tensorflow_privacy\.privacy\.dp_query import "
        r"(?!test_utils$)(\w+)$", r"from custagg.privacy.dp_query import \1",
        new, flags=re.M)
    assert n_opt + n_cls + n_q > 0, "no TF Privacy import line was found"
    assert "tensorflow_privacy.privacy.optimizers" not in new
    return new


def _run_test_file(path, tmp_path):
    """pytest on one file -> (passed names, failed names, stdout tail)."""
    report = tmp_path / (os.path.basename(path) + ".xml")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--junitxml", str(report), "-o", "addopts=", str(path)],
        capture_output=True, text=True, env=_env(), cwd=str(tmp_path),
        timeout=1800)
    xml = report.read_text()
    cases = re.findall(
        r'<testcase [^>]*name="([^"]+)"[^>]*?(/>|>(.*?)</testcase>)', xml,
        flags=re.S)
    failed = sorted({name.split("(")[0] for name, _, body in cases
                     if "<failure" in body or "<error" in body})
    passed = [name for name, _, body in cases
              if not any(t in body for t in ("<failure", "<error",
                                             "<skipped"))]
    return passed, failed, proc.stdout[-4000:]


@pytest.mark.parametrize("rel_path", sorted(TEST_FILES))
def test_tf_privacy_test_file_on_custagg(rel_path, tmp_path):
    _tf_privacy_or_skip()
    spec = importlib.util.find_spec("tensorflow_privacy")
    path = os.path.join(os.path.dirname(spec.origin), "privacy", rel_path)
    with open(path) as f:
        source = f.read()
    target = tmp_path / ("custagg_" + os.path.basename(rel_path))
    target.write_text(rewrite_imports(source))
    passed, failed, out = _run_test_file(target, tmp_path)
    print("TF Privacy %s on custagg: %d passed, %d failed (%s)"
          % (rel_path, len(passed), len(failed), ", ".join(failed)))
    assert [n for n in failed if not _expected_failure(n, rel_path)] == [], \
        out
    assert len(passed) >= TEST_FILES[rel_path], out


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


STATEMENT_CHECK = r"""
from tensorflow_privacy.privacy.analysis import compute_dp_sgd_privacy_lib as T
from custagg.privacy import compute_dp_sgd_privacy_lib as C
cases = [(60000, 256, 60, 1.1, 1e-5, False, None, "RDP"),
         (60000, 256, 60, 1.1, 1e-5, True, None, "PLD"),
         (60000, 256, 5, 4.0, 1e-5, False, 2, "RDP"),
         (60000, 256, 3, 8.0, 1e-5, True, 5, "RDP"),
         (10**6, 1000, 10, 3.0, 1e-7, False, 3, "RDP"),
         (60000, 256, 15, 1.1, 1e-5, True, 4, "RDP"),
         (50000, 512, 2, 2.0, 1e-5, False, 1, "PLD")]
same = 0
for n, b, e, s, d, mb, k, a in cases:
    x = T.compute_dp_sgd_privacy_statement(
        n, b, e, s, d, used_microbatching=mb, max_examples_per_user=k,
        accountant_type=T.AccountantType[a])
    y = C.compute_dp_sgd_privacy_statement(
        n, b, e, s, d, used_microbatching=mb, max_examples_per_user=k,
        accountant_type=T.AccountantType[a])
    assert x == y, (x, y)
    same += 1
print("STATEMENTS EQUAL", same)
"""


def test_privacy_statement_equals_tf_privacy():
    """The same text, figures included, for 7 settings (user-level finite
    and infinite, RDP and PLD, with and without microbatching)."""
    _tf_privacy_or_skip()
    proc = subprocess.run([sys.executable, "-c", STATEMENT_CHECK],
                          capture_output=True, text=True, env=_env(),
                          cwd=REPO_ROOT, timeout=900)
    assert "STATEMENTS EQUAL 7" in proc.stdout, proc.stderr[-4000:]
