"""TensorFlow without its start-up log lines, for the CLI and the notebooks.

On a CPU machine, `import tensorflow` and the first session print lines such
as `I0000 ... port.cc:153] oneDNN custom operations are on` and
`E0000 ... failed call to cuInit`. `TF_CPP_MIN_LOG_LEVEL` hides the ones
logged after absl's logging is set up, but the first few come before that
("WARNING: All log messages before absl::InitializeLog() is called are
written to STDERR") and ignore it. `hide_tf_log_lines` therefore points file
descriptor 2 at a temporary file while TensorFlow starts, then writes back
everything that is not a TensorFlow log line (Python warnings, anything
else), so nothing but those lines is lost.
"""

import contextlib
import os
import re
import sys
import tempfile

# Two formats: absl's (severity letter, MMDD, time, thread id, file:line]),
# e.g. `E0000 00:00:1796320888.431889    5780 cuda_platform.cc:52]`, and
# TensorFlow's own logger of 2.15-2.18 before absl is set up (date, time,
# severity, file:line]), e.g. `2026-12-03 23:06:05.390410: E
# external/local_xla/xla/stream_executor/cuda/cuda_dnn.cc:9261]` (the
# cuDNN/cuFFT/cuBLAS "Unable to register" and cuInit lines there are errors,
# so TF_CPP_MIN_LOG_LEVEL=2 does not hide them).
_LOG_LINE = re.compile(
    r"^(?:[IWE]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+"
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWE]) \S+:\d+\]")
_ABSL_PREAMBLE = "WARNING: All log messages before absl::InitializeLog()"


# Lines that continue a record's message (cpu_feature_guard's spans two).
_CONTINUATIONS = ("To enable the following instructions:",)


def drop_tf_log_lines(text):
    """`text` without TensorFlow's C++ log records; everything else is kept."""
    kept, in_record = [], False
    for line in text.splitlines(True):
        if _LOG_LINE.match(line) or line.startswith(_ABSL_PREAMBLE):
            in_record = True
        elif not (in_record and line.startswith(_CONTINUATIONS)):
            in_record = False
            kept.append(line)
    return "".join(kept)


@contextlib.contextmanager
def hide_tf_log_lines(enabled=True):
    """Within the block, TensorFlow's C++ log lines on stderr are dropped."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 (e.g. some embedded interpreters)
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            rest = drop_tf_log_lines(tmp.read().decode("utf-8", "replace"))
            if rest:
                sys.stderr.write(rest)
                sys.stderr.flush()


def set_log_level(verbose=False):
    """Sets TensorFlow's C++ log level before TensorFlow is imported.

    Quiet (the default): `TF_CPP_MIN_LOG_LEVEL=2` (errors only) unless the
    environment already sets it. Verbose: whatever the environment says
    (TensorFlow's default shows everything).
    """
    if not verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def import_tensorflow(verbose=False):
    """`import tensorflow`, quietly unless `verbose`; returns the module.

    Quiet also sets TensorFlow's Python logger and absl's (which
    dp-accounting's RDP accountant warns through) to errors only, and creates
    (and closes) one session so that the device set-up's lines (the CUDA
    `cuInit` error on a CPU machine) are dropped here too.
    """
    set_log_level(verbose)
    with hide_tf_log_lines(not verbose):
        import tensorflow as tf  # pylint: disable=g-import-not-at-top
        if not verbose:
            tf.get_logger().setLevel("ERROR")
            from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
            absl_logging.set_verbosity(absl_logging.ERROR)
            # One run, too: TF 2.18 logs "MLIR V1 optimization pass is not
            # enabled" at the first Session.run, before absl is set up.
            with tf.Graph().as_default():
                with tf.compat.v1.Session() as session:
                    session.run(tf.constant(0.0) + 1.0)
    return tf
