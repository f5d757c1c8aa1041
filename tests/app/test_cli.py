"""The main job (`python -m custagg`): tiny runs in-process, flag errors,
no TensorFlow for `--help`, no TensorFlow log lines."""

import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from custagg.app import cli
from custagg.app import quiet

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
TF_LOG_LINE = re.compile(
    r"^[IWEF]\d{4} |^\d{4}-\d\d-\d\d [\d:.]+: [IWEF] |absl::InitializeLog|cuInit",
    re.M)

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
    # 1 epoch of the 128 images: the training steps' throughput.
    assert re.search(r"^training: \d+ examples/s \(128 examples in [\d.]+ s\)$",
                     out, re.M), out
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
    # epsilon at delta = 1/n after each epoch and at the end (n = 128 here):
    # first the figure for this job's fixed-size shuffled batches, then the
    # Poisson figures it would have with Poisson-sampled batches.
    assert out.count("at delta 1/128 for these batches (fixed size, "
                     "shuffled") == 2
    assert out.count("had they been Poisson-sampled at q = B/n") == 2
    final = re.search(r"privacy after 1 epochs: epsilon ([\d.]+) at delta "
                      r"1/128 .*Poisson-sampled at q = B/n: ([\d.]+) \(RDP "
                      r"order .*PLD accountant", out)
    assert final and float(final.group(1)) > 0 and float(final.group(2)) > 0
    # The noise comes from fresh entropy, not from --seed.
    assert "noise from fresh entropy" in out
    # TF Privacy's privacy statement (compute_dp_sgd_privacy_statement).
    assert "Epsilon assuming Poisson sampling (*):" in out
    assert "Epsilon with each example occurring once per epoch:" in out


def test_target_epsilon_prints_sigma_and_epsilon_reached(capsys):
    status, out = run_main(capsys, "--aggregation", "dpsgd",
                           "--target-epsilon", "5", "--delta", "1e-4",
                           "--no-check")
    assert status == 0, out
    sigma = float(re.search(r"noise multiplier chosen for --target-epsilon 5 "
                            r"at delta 0.0001: ([\d.]+) ", out).group(1))
    eps = float(re.search(r"epsilon reached: ([\d.]+) at delta 0.0001 "
                          r"\(target 5,", out).group(1))
    assert 0.99 * 5 <= eps <= 5
    assert "noise_multiplier=%g" % sigma in out
    assert "at delta 0.0001 for these batches" in out
    shuffled = float(re.search(r"for this job's shuffled batches: ([\d.]+)",
                               out).group(1))
    assert shuffled > 0


def test_unreachable_target_epsilon_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(TINY + ["--aggregation", "dpsgd", "--target-epsilon", "0.01",
                         "--delta", "1e-12", "--no-check"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--target-epsilon 0.01" in err and "`target_epsilon`" in err


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
    (["--target-epsilon", "3"], "--target-epsilon applies to --aggregation"),
    (["--aggregation", "dpsgd", "--delta", "1.5"],
     "--delta: expected a number in (0, 1)"),
    (["--aggregation", "dpsgd", "--target-epsilon", "0"],
     "--target-epsilon: expected a number > 0"),
])
def test_bad_flags(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        cli.main(TINY + args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: custagg")
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("what", ["missing_dir", "empty_dir", "corrupt",
                                  "random", "no_mnist_in_cache", "batch"])
def test_data_errors_are_usage_errors(capsys, tmp_path, what):
    args = list(TINY)
    if what == "missing_dir":
        args += ["--data-dir", str(tmp_path / "nowhere")]
        messages = ["--data-dir %s: the directory does not exist"
                    % (tmp_path / "nowhere")]
    elif what == "empty_dir":
        args += ["--data-dir", str(tmp_path)]
        messages = ["--data-dir %s holds no MNIST files (looked for "
                    "train-images-idx3-ubyte[.gz], " % tmp_path,
                    "t10k-labels-idx1-ubyte[.gz], mnist.npz)", "--download",
                    "bundled digits"]
    elif what in ("corrupt", "random"):
        (tmp_path / "mnist.npz").write_bytes(
            b"PK\x03\x04 not really" if what == "corrupt"
            else np.random.RandomState(1).bytes(1000))
        args += ["--data-dir", str(tmp_path)]
        messages = ["%s is not a valid MNIST npz" % (tmp_path / "mnist.npz")]
    elif what == "no_mnist_in_cache":
        args += ["--dataset", "mnist"]
        messages = ["--dataset mnist: no MNIST in Keras's cache", "--data-dir"]
    else:
        args += ["--batch-size", "200", "--train-limit", "100"]
        messages = ["--batch-size 200 is larger than the 100 training images"]
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for message in messages:
        assert message in err
    assert "allow_pickle" not in err and "data_dir unset" not in err


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


def test_every_flag_has_help():
    parser = cli.build_parser()
    for action in parser._actions:  # pylint: disable=protected-access
        assert action.help, action.option_strings
    text = parser.format_help()
    assert "(default: None)" not in text and "default: ... (default" not in text
    assert "--batch-size B examples per training step (default: 64)" in (
        " ".join(text.split()))


def test_strategies_match_the_library():
    import custagg
    assert tuple(cli.STRATEGIES) == tuple(custagg.STRATEGIES)


def _without_tensorflow(code):
    """Runs `code` in a fresh interpreter; returns its stdout, stderr."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, proc.stderr


@pytest.mark.parametrize("argv", [["--help"], ["--version"],
                                  ["--epochs", "0"], ["--bogus"],
                                  ["--data-dir", "/no/such/dir"]])
def test_help_and_flag_errors_do_not_import_tensorflow(argv):
    out, err = _without_tensorflow(
        "import runpy, sys\n"
        "sys.argv = ['custagg'] + %r\n"
        "try:\n"
        "    runpy.run_module('custagg', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code)\n"
        "print('tensorflow loaded:', 'tensorflow' in sys.modules)\n" % argv)
    assert "tensorflow loaded: False" in out
    assert ("exit 0" if argv[0] in ("--help", "--version") else "exit 2") in out


def test_importing_custagg_does_not_import_tensorflow():
    out, _ = _without_tensorflow(
        "import sys, custagg, custagg.app, custagg.app.cli\n"
        "print('before:', 'tensorflow' in sys.modules)\n"
        "custagg.per_example_gradients\n"
        "print('after:', 'tensorflow' in sys.modules)\n")
    assert "before: False" in out and "after: True" in out


def test_drop_tf_log_lines():
    text = (
        "WARNING: All log messages before absl::InitializeLog() is called are"
        " written to STDERR\n"
        "I0000 00:00:1796320874.053532    5739 port.cc:153] oneDNN custom "
        "operations are on.\n"
        "I0000 00:00:1796320874.116012    5739 cpu_feature_guard.cc:227] This "
        "TensorFlow binary is optimized\n"
        "To enable the following instructions: AVX2 FMA, in other operations\n"
        "/x/y.py:3: UserWarning: keep me\n"
        "  warnings.warn('keep me')\n"
        "E0000 00:00:1796320888.431889    5780 cuda_platform.cc:52] failed "
        "call to cuInit: INTERNAL\n"
        # TF 2.15-2.18's format before absl is set up (errors, so
        # TF_CPP_MIN_LOG_LEVEL=2 does not hide them).
        "2026-12-03 23:06:05.390410: E external/local_xla/xla/stream_executor"
        "/cuda/cuda_dnn.cc:9261] Unable to register cuDNN factory\n"
        "2026-12-03 23:06:20.060188: E external/local_xla/xla/stream_executor"
        "/cuda/cuda_driver.cc:152] failed call to cuInit: INTERNAL\n"
        "something else\n")
    assert quiet.drop_tf_log_lines(text) == "/x/y.py:3: UserWarning: keep me" \
        "\n  warnings.warn('keep me')\nsomething else\n"
    assert quiet.drop_tf_log_lines("plain\nlines\n") == "plain\nlines\n"


def test_hide_tf_log_lines_keeps_other_stderr(capfd):
    with quiet.hide_tf_log_lines():
        os.write(2, b"I0000 00:00:1.5    12 port.cc:153] hidden\n")
        os.write(2, b"kept line\n")
    with quiet.hide_tf_log_lines(enabled=False):
        os.write(2, b"I0000 00:00:1.5    12 port.cc:153] shown\n")
    err = capfd.readouterr().err
    assert "hidden" not in err and "kept line" in err and "shown" in err


def test_progress_bar_only_on_a_terminal(monkeypatch):
    from custagg.app import train

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert list(train._progress(iter([1, 2]), 2, 1, 3)) == [1, 2]
    assert sys.stderr.getvalue() == ""
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert list(train._progress(iter([1, 2]), 2, 1, 3)) == [1, 2]
    assert "epoch 1/3" in terminal.getvalue()


def test_python_dash_m(tmp_path):
    """The real entry point, in a fresh process (pays TF's import once):
    trains, passes its check, and prints no TensorFlow log line."""
    from custagg import __main__ as entry
    assert entry.main is cli.main
    env = dict(os.environ, KERAS_HOME=str(tmp_path), HOME=str(tmp_path))
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "custagg", "--aggregation", "clip"] + TINY,
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "data: scikit-learn digits" in proc.stdout
    assert ": PASS" in proc.stdout
    assert proc.stderr == "", proc.stderr
    assert not TF_LOG_LINE.search(proc.stdout)


def test_chosen_loop_strategy_is_not_warned_but_the_plan_says_the_cost(
        capsys, caplog):
    """`--strategy loop`: the user chose O(B^2), the plan line says so, no
    warning; the library still warns its own callers afterwards."""
    import logging
    import tensorflow as tf
    import custagg
    with caplog.at_level(logging.WARNING, logger="custagg"):
        status, out = run_main(capsys, "--strategy", "loop")
        assert status == 0, out
        assert "loop: one backward pass per example, O(B^2)" in out
        assert not [r for r in caplog.records
                    if "O(B^2)" in r.getMessage()], caplog.text
        with tf.Graph().as_default():
            x = tf.compat.v1.placeholder(tf.float32, [4, 3])
            w = tf.Variable(tf.ones([3, 2]))
            custagg.per_example_norms(tf.reduce_sum(tf.matmul(x, w), 1),
                                      [w], strategy="loop")
        assert [r for r in caplog.records
                if "cost O(B^2)" in r.getMessage()], caplog.text


def test_weighted_says_which_weights_and_how_far_from_sum(capsys):
    status, out = run_main(capsys, "--aggregation", "weighted", "--no-check")
    assert status == 0, out
    assert "weights: f_i = w[y_i] / sum_j w[y_j]" in out
    assert "w[c] = 1 / (training images of class c)" in out
    assert "of the plain mean's 1/32" in out
    from custagg.app import train
    counts = np.array([180, 175, 182, 178])
    text = train._describe_weights(1.0 / counts, counts, 64)
    assert "class counts 175-182" in text and "nearly balanced" in text
    assert "stays close to --aggregation sum" in text
    counts = np.array([500, 50, 0, 100])
    text = train._describe_weights(1.0 / np.maximum(counts, 1), counts, 64)
    assert "class counts 50-500" in text and "within a factor 10 " in text
    assert "differs from --aggregation sum" in text


def test_total_counts_the_tensorflow_import(capsys):
    status, out = run_main(capsys, "--no-check")
    assert status == 0, out
    m = re.search(r"total ([\d.]+) s \(TensorFlow import and data ([\d.]+) s;"
                  r" graph, training and check ([\d.]+) s\)", out)
    assert m, out
    total, before, after = (float(v) for v in m.groups())
    assert abs(total - before - after) <= 0.11


def test_dpsgd_noise_is_fresh_unless_noise_seed(capsys):
    """--seed seeds the data and the initialization, not the DP noise: two
    runs of one command train the same model on the same batches with other
    noise; --noise-seed makes them identical (it used to be --seed, which
    made the noise a function of the command line)."""
    def epoch_line(*flags):
        status, out = run_main(capsys, "--aggregation", "dpsgd",
                               "--no-check", *flags)
        assert status == 0, out
        return re.search(r"epoch  1  loss ([\d.]+)", out).group(1)
    assert epoch_line() != epoch_line()
    assert epoch_line("--noise-seed", "5") == epoch_line("--noise-seed", "5")
    status, out = run_main(capsys, "--aggregation", "dpsgd", "--no-check",
                           "--noise-seed", "5")
    assert "noise seed 5" in out


def test_noise_seed_applies_to_dpsgd_only(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(TINY + ["--aggregation", "clip", "--noise-seed", "1"])
    assert e.value.code == 2
    assert "--noise-seed applies to --aggregation dpsgd" in \
        capsys.readouterr().err
