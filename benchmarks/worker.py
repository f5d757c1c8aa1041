"""A warm worker server: `python -m benchmarks.worker serve FRAMEWORK`.

It imports FRAMEWORK once (tf, jax, torch, or keras: TF 2.15 with TF
Privacy), then forks one child per configuration it is sent; the child runs
it and exits, the server kills it at the timeout and reports its peak RSS
from wait4(). The server makes no session or thread pool, so forking is
safe, and a configuration that hangs or crashes takes only its own process.

Protocol: one JSON request a line on stdin, `{"cfg", "timeout",
"result_path", "log_path"}`; one JSON reply a line on stdout, `{"status":
"done"|"timeout"|"crashed", "exit", "maxrss_mb", "wall_s"}`, the first
being `{"ready": true, "versions"}` or `{"ready": false, "error"}`. The child
writes its result dict to result_path and its output to log_path.
"""
import importlib
import json
import os
import signal
import sys
import time
import traceback


def import_framework(framework):
    """Import what `framework`'s children need; returns {package: version}."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if framework == "tf":
        from benchmarks import common
        common.legacy_keras()                               # the zoo's Keras 2 layers
        import tensorflow as tf
        tf.compat.v1.disable_eager_execution()
        versions = {"tensorflow": tf.__version__}
        try:
            import custagg
            from custagg.rules import registry
            versions["custagg"] = custagg.__version__
            # The rule registry loads on first use: pay that here, not in every
            # configuration's build time (pure Python: still safe to fork).
            t0 = time.perf_counter()
            registry.default_registry()
            versions["custagg_rules_first_load_s"] = round(time.perf_counter() - t0, 2)
        except Exception as e:  # mid-edit: the children retry the import
            versions["custagg"] = "import failed: %s" % e
        from benchmarks.systems import tf_systems
        path, version = tf_systems.tfp_location()
        versions["tensorflow-privacy"] = version if path else "not installed"
        return versions
    if framework == "jax":
        import jax
        import jaxlib
        importlib.import_module("benchmarks.systems.jax_systems")
        return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}
    if framework == "keras":      # TF 2.15 with TF Privacy (benchmarks/peers_env.sh)
        import tensorflow as tf
        importlib.import_module("tensorflow_privacy.privacy.fast_gradient_clipping.clip_grads")
        from importlib import metadata
        return {"tensorflow": tf.__version__,
                "tensorflow-privacy": metadata.version("tensorflow-privacy")}
    if framework == "torch":
        import torch
        importlib.import_module("benchmarks.systems.torch_systems")
        versions = {"torch": torch.__version__}
        try:
            import opacus
            versions["opacus"] = opacus.__version__
        except ImportError as e:
            versions["opacus"] = "not installed (%s)" % type(e).__name__
        return versions
    raise ValueError("unknown framework %r; choose from tf, jax, torch, keras" % framework)


def execute(cfg):
    """Run one configuration in this process; returns the result dict."""
    module = importlib.import_module("benchmarks.systems.%s_systems" % cfg["framework"])
    result = (module.run_reference if cfg.get("kind") == "reference" else module.run)(cfg)
    import resource
    result.setdefault("status", "ok")
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return result


def _child(request):
    """The forked child: output to the log, the result (or the error) to
    result_path; never returns."""
    code = 1
    try:
        fd = os.open(request["log_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            result = execute(request["cfg"])
        except BaseException as e:  # noqa: B902 - report everything, the process ends anyway
            traceback.print_exc()
            msg = " ".join(l.strip() for l in traceback.format_exception_only(type(e), e))
            result = {"status": "failed", "note": msg.replace("\n", " ")[:400]}
        with open(request["result_path"] + ".tmp", "w") as f:
            json.dump(result, f, default=str)
        os.replace(request["result_path"] + ".tmp", request["result_path"])
        code = 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid, timeout, parent):
    """The reply for child `pid`, killed after `timeout` s or once `parent` died."""
    start, delay = time.monotonic(), 0.005
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if os.getppid() != parent or time.monotonic() - start > timeout:
            os.kill(pid, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
            return {"status": "timeout", "exit": None, "maxrss_mb": usage.ru_maxrss / 1024.0,
                    "wall_s": time.monotonic() - start}
        time.sleep(delay)
        delay = min(delay * 1.5, 0.05)
    if os.WIFSIGNALED(status):
        code, state = -os.WTERMSIG(status), "crashed"
    else:
        code = os.WEXITSTATUS(status)
        state = "done" if code == 0 else "crashed"
    return {"status": state, "exit": code, "maxrss_mb": usage.ru_maxrss / 1024.0,
            "wall_s": time.monotonic() - start}


def serve(framework):
    parent = os.getppid()
    # The protocol keeps the original stdout; whatever libraries print goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        versions = import_framework(framework)
    except Exception as e:  # reported to the orchestrator, which records it
        proto.write(json.dumps({"ready": False, "error": "%s: %s" % (type(e).__name__, e)}) + "\n")
        return 1
    proto.write(json.dumps({"ready": True, "versions": versions}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        reply = _wait(pid, request["timeout"], parent)
        if os.getppid() != parent:
            return 1
        proto.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"] or len(sys.argv) != 3:
        sys.exit("usage: python -m benchmarks.worker serve FRAMEWORK")
    sys.exit(serve(sys.argv[2]))
