"""Runs benchmark configurations, one process per configuration.

`python -m benchmarks.worker serve FRAMEWORK` is a "zygote" server: it
imports the framework once (TensorFlow takes ~10 s to import here) and then
forks one child per configuration it is sent. The child runs the
configuration and exits; the server kills it at the timeout and reports its
peak RSS from wait4(). Nothing in the server ever creates a session or a
thread pool, so the fork is safe; a configuration that hangs, crashes or
runs out of memory takes only its own process with it. FRAMEWORK is tf,
jax, torch or keras (TF 2.15 with TF Privacy), each from the interpreter
`--python FRAMEWORK=PATH` names (benchmarks/peers_env.sh makes the peers').

Protocol (serve): one JSON request per line on stdin
  {"cfg": {...}, "timeout": s, "result_path": p, "log_path": p}
and one JSON reply per line on the original stdout
  {"status": "done"|"timeout"|"crashed", "exit": code, "maxrss_mb": m, "wall_s": s}.
The first reply is {"ready": true, "versions": {...}} or {"ready": false, "error": "..."}.
The child writes its result dict (JSON) to result_path and its output to log_path.
"""
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
        import tensorflow as tf
        tf.compat.v1.disable_eager_execution()
        versions = {"tensorflow": tf.__version__}
        try:
            import custagg
            versions["custagg"] = getattr(custagg, "__version__", "?")
            # The rule registry loads on first use; pay that once here, not in
            # every configuration's graph-construction time (pure Python, no
            # TF session, so still safe to fork after).
            t0 = time.perf_counter()
            from custagg.rules import registry
            registry.default_registry()
            versions["custagg_rules_first_load_s"] = round(time.perf_counter() - t0, 2)
        except Exception as e:  # the lead may be mid-edit; children retry the import
            versions["custagg"] = "import failed: %s" % e
        from benchmarks.systems import tf_systems
        path, version = tf_systems.tfp_location()
        versions["tensorflow-privacy"] = version if path else "not installed"
        return versions
    if framework == "jax":
        import jax
        import jaxlib
        from benchmarks.systems import jax_systems  # noqa: F401
        return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}
    if framework == "keras":      # TF 2.15 with TF Privacy (benchmarks/peers_env.sh)
        import tensorflow as tf
        from tensorflow_privacy.privacy.fast_gradient_clipping import clip_grads  # noqa: F401
        from importlib import metadata
        return {"tensorflow": tf.__version__,
                "tensorflow-privacy": metadata.version("tensorflow-privacy")}
    if framework == "torch":
        import torch
        from benchmarks.systems import torch_systems  # noqa: F401
        versions = {"torch": torch.__version__}
        try:
            import opacus
            versions["opacus"] = opacus.__version__
        except Exception as e:
            versions["opacus"] = "not installed (%s)" % type(e).__name__
        return versions
    raise ValueError("unknown framework %r" % framework)


def execute(cfg):
    """Run one configuration in this process; returns the result dict."""
    import importlib
    if cfg.get("module"):
        # A benchmark module that runs its own configurations in the worker
        # (benchmarks.before_after): named, not imported here, so the worker
        # imports no benchmark that imports it back.
        result = importlib.import_module(cfg["module"]).execute(cfg)
    elif cfg.get("kind") == "reference":
        from benchmarks.systems import tf_systems
        result = tf_systems.run_reference(cfg)
    elif cfg["framework"] in ("tf", "jax", "torch", "keras"):
        result = importlib.import_module(
            "benchmarks.systems.%s_systems" % cfg["framework"]).run(cfg)
    else:
        raise ValueError("unknown framework %r" % cfg["framework"])
    from benchmarks import common
    result.setdefault("status", "ok")
    result["peak_rss_mb"] = common.peak_rss_mb()
    return result


def _failure(exc):
    lines = traceback.format_exception_only(type(exc), exc)
    msg = " ".join(l.strip() for l in lines).replace("\n", " ")
    return {"status": "failed", "note": msg[:400]}


def _run_and_write(request):
    try:
        result = execute(request["cfg"])
    except BaseException as e:  # noqa: B902 - report everything, the process ends anyway
        traceback.print_exc()
        result = _failure(e)
    with open(request["result_path"] + ".tmp", "w") as f:
        json.dump(result, f, default=str)
    os.replace(request["result_path"] + ".tmp", request["result_path"])


def _child(request):
    code = 1
    try:
        fd = os.open(request["log_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        _run_and_write(request)
        code = 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid, timeout):
    start = time.monotonic()
    delay = 0.005
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        orphaned = os.getppid() != _PARENT   # the orchestrator died: stop too
        if orphaned or time.monotonic() - start > timeout:
            os.kill(pid, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
            return {"status": "timeout", "exit": None, "maxrss_mb": usage.ru_maxrss / 1024.0,
                    "wall_s": time.monotonic() - start}
        time.sleep(delay)
        delay = min(delay * 1.5, 0.05)
    wall = time.monotonic() - start
    if os.WIFSIGNALED(status):
        return {"status": "crashed", "exit": -os.WTERMSIG(status),
                "maxrss_mb": usage.ru_maxrss / 1024.0, "wall_s": wall}
    code = os.WEXITSTATUS(status)
    return {"status": "done" if code == 0 else "crashed", "exit": code,
            "maxrss_mb": usage.ru_maxrss / 1024.0, "wall_s": wall}


_PARENT = None


def serve(framework):
    global _PARENT
    _PARENT = os.getppid()
    # Keep the protocol channel clean: anything printed by libraries goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        versions = import_framework(framework)
        proto.write(json.dumps({"ready": True, "versions": versions}) + "\n")
    except Exception as e:
        proto.write(json.dumps({"ready": False, "error": "%s: %s" % (type(e).__name__, e)}) + "\n")
        return 1
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        reply = _wait(pid, request["timeout"])
        if os.getppid() != _PARENT:
            return 1
        proto.write(json.dumps(reply) + "\n")
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "serve":
        return serve(argv[1])
    sys.stderr.write("usage: python -m benchmarks.worker serve FRAMEWORK\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
