"""The main job (`python -m custagg`): tiny runs in-process, flag errors."""

import os
import subprocess
import sys

import numpy as np
import pytest

from custagg import cli

TINY = ["--epochs", "1", "--train-limit", "128", "--batch-size", "32",
        "--check-batch-size", "4"]


@pytest.fixture(autouse=True)
def no_keras_cache(tmp_path, monkeypatch):
    """The digits are used unless a test says otherwise (no ~/.keras)."""
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def run_main(capsys, *args):
    status = cli.main(TINY + list(args))
    return status, capsys.readouterr().out


@pytest.mark.parametrize("aggregation", ["sum", "weighted", "clip", "dpsgd"])
def test_happy_path(capsys, aggregation):
    status, out = run_main(capsys, "--aggregation", aggregation)
    assert status == 0, out
    assert "data: scikit-learn digits" in out
    assert "[subset: 128 train / 359 test]" in out
    assert "aggregation: " + aggregation in out
    assert "per-example plan" in out
    assert "epoch  1  loss " in out and "test acc" in out
    assert "per-example grad norms: min" in out and "median" in out
    assert "check: max abs err" in out and ": PASS" in out
    assert "softmax/W" in out


@pytest.mark.parametrize("flags", [
    ["--model", "mlp", "--hidden", "8", "--optimizer", "momentum"],
    ["--model", "cnn", "--aggregation", "dpsgd", "--num-microbatches", "8",
     "--optimizer", "adam"],
], ids=["mlp", "cnn"])
def test_other_models(capsys, flags):
    status, out = run_main(capsys, *flags)
    assert status == 0, out
    assert ": PASS" in out


def test_dpsgd_prints_noise(capsys):
    status, out = run_main(capsys, "--aggregation", "dpsgd",
                           "--l2-norm-clip", "0.5", "--noise-multiplier", "2",
                           "--no-check")
    assert status == 0
    assert "l2_norm_clip=0.5, noise_multiplier=2" in out
    assert "noise std on the clipped sum: 1" in out
    assert "check:" not in out
    # epsilon at delta = 1/n after each epoch and at the end (n = 128 here).
    assert out.count("at delta 1/128 (RDP order") == 2
    assert "privacy after 1 epochs: epsilon " in out and "PLD accountant" in out


def test_failed_check_exits_1(capsys, monkeypatch):
    from custagg import testing
    real = testing.loop_per_example
    monkeypatch.setattr(testing, "loop_per_example",
                        lambda loss, xs: [1.01 * g for g in real(loss, xs)])
    status, out = run_main(capsys)
    assert status == 1
    assert "<- FAIL" in out and ": FAIL" in out


def test_mnist_from_data_dir(capsys, tmp_path):
    rng = np.random.RandomState(0)
    np.savez(str(tmp_path / "mnist.npz"),
             x_train=rng.randint(0, 256, (64, 28, 28)).astype(np.uint8),
             y_train=rng.randint(0, 10, 64).astype(np.uint8),
             x_test=rng.randint(0, 256, (16, 28, 28)).astype(np.uint8),
             y_test=rng.randint(0, 10, 16).astype(np.uint8))
    status, out = run_main(capsys, "--data-dir", str(tmp_path))
    assert status == 0, out
    assert "data: MNIST (%s" % (tmp_path / "mnist.npz") in out
    assert "28x28x1" in out and "7850 parameters" in out


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "0"], "--batch-size: expected a positive integer"),
    (["--epochs", "two"], "--epochs: expected a positive integer"),
    (["--aggregation", "mean"], "--aggregation: invalid choice"),
    (["--strategy", "fast"], "--strategy: invalid choice"),
    (["--model", "resnet"], "--model: invalid choice"),
    (["--l2-norm-clip", "-1"], "--l2-norm-clip: expected a number > 0"),
    (["--noise-multiplier", "-0.5"], "--noise-multiplier: expected a number"),
    (["--learning-rate", "nan"], "--learning-rate: expected a number > 0"),
    (["--aggregation", "dpsgd", "--num-microbatches", "5"],
     "--num-microbatches 5 must divide --batch-size 32"),
    (["--num-microbatches", "2"], "--num-microbatches applies to"),
    (["--dataset", "digits", "--data-dir", "/tmp"], "--data-dir is for MNIST"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_flags(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        cli.main(TINY + args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: custagg")
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("what", ["missing_dir", "corrupt", "batch"])
def test_data_errors_are_usage_errors(capsys, tmp_path, what):
    args = list(TINY)
    if what == "missing_dir":
        args += ["--data-dir", str(tmp_path / "nowhere")]
        message = "No MNIST found in"
    elif what == "corrupt":
        (tmp_path / "mnist.npz").write_bytes(b"PK\x03\x04 not really")
        args += ["--data-dir", str(tmp_path)]
        message = "not a readable .npz archive"
    else:
        args += ["--batch-size", "200", "--train-limit", "100"]
        message = "--batch-size 200 is larger than the 100 training images"
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_help_and_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--strategy", "--aggregation", "--batch-size", "--epochs",
                 "--data-dir", "--seed", "--l2-norm-clip",
                 "--noise-multiplier", "--learning-rate", "--model"):
        assert flag in out
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("custagg 0.")


def test_python_dash_m(tmp_path):
    """The real entry point, in a fresh process (pays TF's import once)."""
    from custagg import __main__ as entry
    assert entry.main is cli.main
    env = dict(os.environ, KERAS_HOME=str(tmp_path), HOME=str(tmp_path),
               TF_CPP_MIN_LOG_LEVEL="2")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "custagg", "--aggregation", "clip"] + TINY,
        capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "data: scikit-learn digits" in proc.stdout
    assert ": PASS" in proc.stdout
    assert "Traceback" not in proc.stderr
