"""What a TF1 user meets first: Keras 2 layers on TF >= 2.16, imports, setup.py.

Each check that depends on the environment at import time runs in a fresh
Python without `TF_USE_LEGACY_KERAS` (this test process has it set by
conftest), as a user's program starts.
"""

import importlib.util
import os
import runpy
import subprocess
import sys
import textwrap

import pytest
import setuptools
import tensorflow as tf

from conftest import REPO_ROOT

TF_VERSION = tuple(int(p) for p in tf.__version__.split(".")[:2])
HAS_TF_KERAS = importlib.util.find_spec("tf_keras") is not None


def _fresh_python(code, env_update=None, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    env["PYTHONPATH"] = REPO_ROOT
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.update(env_update or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO_ROOT)


# A TF1 program as users write it: tf.compat.v1.layers, TensorFlow imported
# first, custagg second (the README's order), DP-SGD from custagg.
_LAYERS_PROGRAM = """
import os
import numpy as np
import tensorflow as tf
import custagg

print("switch", os.environ.get("TF_USE_LEGACY_KERAS"))
tf.compat.v1.disable_eager_execution()
tf.compat.v1.set_random_seed(0)
x = tf.compat.v1.placeholder(tf.float32, [None, 8])
y = tf.compat.v1.placeholder(tf.int64, [None])
h = tf.compat.v1.layers.dense(x, 16, activation=tf.nn.relu)
logits = tf.compat.v1.layers.dense(h, 3)
loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
opt = custagg.DPOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5),
                          l2_norm_clip=1.0, noise_multiplier=0.0, seed=0)
train = opt.minimize(loss)
rng = np.random.RandomState(0)
xs = rng.normal(size=(64, 8)).astype(np.float32)
ys = (xs[:, 0] > 0).astype(np.int64) + (xs[:, 1] > 0)
with tf.compat.v1.Session() as sess:
    sess.run(tf.compat.v1.global_variables_initializer())
    first = sess.run(tf.reduce_mean(loss), {x: xs, y: ys})
    for _ in range(60):
        sess.run(train, {x: xs, y: ys})
    last = sess.run(tf.reduce_mean(loss), {x: xs, y: ys})
print("loss %.4f -> %.4f" % (first, last))
assert last < 0.8 * first, (first, last)
eps, _ = custagg.privacy.compute_dp_sgd_privacy(60000, 256, 1.1, 60, 1e-5)
print("epsilon %.3f" % eps)
"""


@pytest.mark.skipif(TF_VERSION >= (2, 16) and not HAS_TF_KERAS,
                    reason="TF >= 2.16 without tf-keras: tf.compat.v1.layers "
                           "needs it (pip install -e . installs it)")
def test_tf1_layers_program_trains_after_import_custagg():
    """TF imported before custagg, no switch set by the user: the layers
    resolve to Keras 2 and DP-SGD trains; custagg.privacy works."""
    r = _fresh_python(_LAYERS_PROGRAM)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("switch 1" if HAS_TF_KERAS else "switch None") in r.stdout
    assert "loss" in r.stdout and "epsilon" in r.stdout


@pytest.mark.skipif(not HAS_TF_KERAS, reason="tf-keras is not installed "
                    "(TF 2.12-2.13, or the test-base extra)")
def test_user_setting_of_the_switch_is_kept_and_keras3_error_says_the_fix():
    """TF_USE_LEGACY_KERAS=0 from the user is kept; on TF >= 2.16 that means
    Keras 3, whose refusal custagg's hint turns into the fix."""
    r = _fresh_python("""
        import os
        import tensorflow as tf
        import custagg
        from custagg import errors
        print("switch", os.environ.get("TF_USE_LEGACY_KERAS"))
        tf.compat.v1.disable_eager_execution()
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        try:
            tf.compat.v1.layers.dense(x, 2)
            print("dense ok")
        except AttributeError as e:
            assert errors.is_keras3_error(e), e
            print(errors.keras3_hint(e))
        """, {"TF_USE_LEGACY_KERAS": "0"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "switch 0" in r.stdout
    if TF_VERSION >= (2, 16):
        assert "not available with Keras 3" in r.stdout
        assert "pip install tf-keras" in r.stdout
        assert "TF_USE_LEGACY_KERAS=1" in r.stdout
    else:
        assert "dense ok" in r.stdout


def test_privacy_is_an_attribute_after_import_custagg():
    r = _fresh_python("""
        import sys
        import custagg
        assert "tensorflow" not in sys.modules  # import custagg stays cheap
        assert "privacy" in dir(custagg)
        from custagg.privacy import dp_optimizer
        print(custagg.privacy.compute_dp_sgd_privacy(1000, 100, 1.0, 1, 1e-3))
        print(custagg.privacy.dp_optimizer is dp_optimizer)
        """)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "True"


def _setup_namespace(monkeypatch):
    """setup.py's globals, with `setuptools.setup` recording its arguments."""
    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    ns = runpy.run_path(os.path.join(REPO_ROOT, "setup.py"))
    return ns, seen


def test_setup_requires_tf_keras_where_tensorflow_needs_it(monkeypatch):
    ns, seen = _setup_namespace(monkeypatch)
    req = ns["tf_keras_requirements"]
    # A fresh environment (or a TensorFlow pip will replace): the newest pair.
    assert req(None, False) == ["tf-keras>=2.14.1,<2.22"]
    assert req((2, 22), False) == ["tf-keras>=2.14.1,<2.22"]
    assert req((2, 11), True) == ["tf-keras>=2.14.1,<2.22"]
    # Keras 3 releases: the same minor, so pip keeps the TensorFlow.
    assert req((2, 16), False) == ["tf-keras>=2.16,<2.17"]
    assert req((2, 21), False) == ["tf-keras>=2.21,<2.22"]
    # Keras 2 built in: nothing to install, the tests use the same minor.
    assert req((2, 15), False) == []
    assert req((2, 15), True) == ["tf-keras>=2.15,<2.16"]
    assert req((2, 14), True) == ["tf-keras>=2.14,<2.15"]
    # No tf-keras exists.
    assert req((2, 12), False) == req((2, 13), True) == []
    # setup.py reads this interpreter's TensorFlow (as pip's build would).
    assert ns["_installed_tensorflow"]() == TF_VERSION
    keras = [r for r in seen["install_requires"] if r.startswith("tf-keras")]
    assert keras == req(TF_VERSION, False)
    assert "tf-keras" not in " ".join(seen["extras_require"]["test-base"])
