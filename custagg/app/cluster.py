"""Local TF1 clusters as subprocesses: ports, start, supervise, shut down.

`LocalCluster` starts each task (a parameter server or a worker) as its own
process in its own process group, on 127.0.0.1 ports picked by the OS, with
its output in a log file. `wait` returns when the named tasks have all
exited with status 0, and raises `TaskFailed` naming the first task that
exited otherwise (a worker killed mid-run, a parameter server that died) or
`TaskTimeout`; every wait is bounded. `shutdown` (also run on leaving the
`with` block, on any exception including KeyboardInterrupt) sends SIGTERM to
every process group, then SIGKILL after a grace period, and reaps them all.
On Linux each child also gets SIGKILL from the kernel if this process dies
first (PR_SET_PDEATHSIG), so even `kill -9` of the runner leaves no orphans.

The runner of `python -m custagg --distributed local --workers W` is
`run_local` (see `custagg.app.cluster_job` for the tasks' training code).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

__all__ = ["free_ports", "LocalCluster", "TaskFailed", "TaskTimeout",
           "pids_alive"]

_PR_SET_PDEATHSIG = 1


def free_ports(n):
    """`n` distinct TCP ports on 127.0.0.1 that were free a moment ago.

    The sockets are held open until all `n` are chosen, so the OS never
    returns the same port twice; a port may still be taken by another
    program between this call and the server's bind (the server then fails
    at start-up, which `LocalCluster.wait` reports).
    """
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def pids_alive(pids):
    """The pids among `pids` that still exist and are not zombies."""
    alive = []
    for pid in pids:
        try:
            with open("/proc/%d/stat" % pid) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            alive.append(pid)
    return alive


def _child_setup():
    """In the child, before exec: die with the parent (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class TaskFailed(RuntimeError):
    """A task exited with a non-zero status or was killed by a signal."""

    def __init__(self, task, returncode, log_tail):
        self.task = task
        self.returncode = returncode
        if returncode is not None and returncode < 0:
            try:
                how = "was killed by signal %s" % signal.Signals(
                    -returncode).name
            except ValueError:
                how = "was killed by signal %d" % -returncode
        else:
            how = "exited with status %s" % returncode
        msg = "%s %s" % (task, how)
        if log_tail:
            msg += "; last lines of its log:\n" + log_tail
        super().__init__(msg)


class TaskTimeout(RuntimeError):
    """A bounded wait ran out."""


class _Task(object):

    def __init__(self, name, proc, log_path, daemon):
        self.name = name
        self.proc = proc
        self.log_path = log_path
        self.daemon = daemon   # a server that never exits on its own (ps)

    def log_tail(self, lines=12):
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:]).rstrip()
        except OSError:
            return ""


class LocalCluster(object):
    """Processes of one local cluster; a context manager that kills them all.

    Args:
      log_dir: where each task's output goes (`<name>.log`).
      env: extra environment variables for every task.
    """

    def __init__(self, log_dir, env=None):
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self._env = dict(os.environ)
        self._env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        self._env.update(env or {})
        self.tasks = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False

    @property
    def pids(self):
        return [t.proc.pid for t in self.tasks.values()]

    def start(self, name, argv, daemon=False, env=None):
        """Starts `argv` as task `name` in a new process group.

        Args:
          name: e.g. "ps 0", "worker 1" (used in messages and the log name).
          argv: the command; usually `[sys.executable, "-m", ...]`.
          daemon: True for servers that only end when killed (a ps): their
            exit during `wait` is a failure, their running is not awaited.
          env: extra environment for this task only.
        """
        log_path = os.path.join(self.log_dir,
                                name.replace(" ", "_") + ".log")
        task_env = dict(self._env)
        task_env.update(env or {})
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=task_env,
                start_new_session=True, preexec_fn=_child_setup)
        self.tasks[name] = _Task(name, proc, log_path, daemon)
        return proc

    def poll_failure(self):
        """The first task that ended badly (or a daemon that ended), or
        None."""
        for t in self.tasks.values():
            rc = t.proc.poll()
            if rc is not None and (rc != 0 or t.daemon):
                return t
        return None

    def wait(self, names, timeout, poll_s=0.2, on_poll=None):
        """Waits until every task in `names` has exited with status 0.

        Args:
          names: the tasks to wait for (e.g. the workers).
          timeout: seconds; `TaskTimeout` after that.
          poll_s: seconds between checks.
          on_poll: optional callable run at every check (e.g. progress).

        Raises:
          TaskFailed: naming the first task (awaited or not) that exited
            with a non-zero status or was killed, or a daemon that exited.
          TaskTimeout: `timeout` passed.
        """
        deadline = time.monotonic() + timeout
        while True:
            bad = self.poll_failure()
            if bad is not None:
                raise TaskFailed(bad.name, bad.proc.returncode,
                                 bad.log_tail())
            if all(self.tasks[n].proc.poll() == 0 for n in names):
                return
            if time.monotonic() > deadline:
                running = [n for n in names
                           if self.tasks[n].proc.poll() is None]
                # Each task's last lines: where a hung task stopped.
                tails = "".join("\n--- %s (%s):\n%s" % (
                    n, self.tasks[n].log_path, self.tasks[n].log_tail(6))
                    for n in running)
                raise TaskTimeout("still running after %.0f s: %s%s" % (
                    timeout, ", ".join(running), tails))
            if on_poll is not None:
                on_poll()
            time.sleep(poll_s)

    def shutdown(self, grace_s=5.0):
        """SIGTERM to every task's process group, SIGKILL after `grace_s`;
        reaps every process. Safe to call more than once."""
        live = [t for t in self.tasks.values() if t.proc.poll() is None]
        for t in live:
            _signal_group(t.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for t in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                t.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for t in self.tasks.values():
            # Also the group of a task that exited: a child it left behind.
            _signal_group(t.proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                t.proc.wait(timeout=grace_s)


def _signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def python_argv(module, *args):
    """`[sys.executable, "-m", module, *args]`."""
    return [sys.executable, "-m", module] + [str(a) for a in args]


# --------------------------------------------------------------------------
# `python -m custagg --distributed local --workers W`


DEFAULT_TIMEOUT_S = 3600
_JOB_MODULE = "custagg.app.cluster_job"


class _Interrupted(Exception):
    """SIGINT or SIGTERM arrived."""


def _raise_interrupted(signum, frame):
    del frame
    raise _Interrupted(signal.Signals(signum).name)


class _LogFollower(object):
    """Echoes the new lines of a task's log."""

    def __init__(self, path, say, prefix=""):
        self._path, self._say, self._prefix = path, say, prefix
        self._pos = 0

    def __call__(self):
        try:
            with open(self._path, errors="replace") as f:
                f.seek(self._pos)
                chunk = f.read()
        except OSError:
            return
        # Only whole lines; the rest waits for the next call.
        end = chunk.rfind("\n") + 1
        self._pos += len(chunk[:end].encode("utf-8", "replace"))
        for line in chunk[:end].splitlines():
            if line.startswith(("epoch", "worker")):
                self._say(self._prefix + line)


def run_local(args, out=None):
    """Runs the main job on a local cluster: 1 ps and `args.workers` workers.

    Every task is a subprocess on 127.0.0.1 (ports picked here), in its own
    process group; all of them are shut down on success, on failure (a task
    that dies is named) and on Ctrl-C / SIGTERM.

    Returns:
      0 on success, 1 when a task failed or the run timed out, 130 on
      Ctrl-C (143 on SIGTERM).
    """
    import json  # pylint: disable=g-import-not-at-top
    import tempfile  # pylint: disable=g-import-not-at-top
    out = out or sys.stdout
    say = lambda *a: print(*a, file=out, flush=True)
    workers = args.workers
    timeout = getattr(args, "cluster_timeout", None) or DEFAULT_TIMEOUT_S
    run_dir = tempfile.mkdtemp(prefix="custagg-cluster-")
    job_args = json.dumps({k: v for k, v in vars(args).items()})
    old = {s: signal.signal(s, _raise_interrupted)
           for s in (signal.SIGINT, signal.SIGTERM)}
    lc = LocalCluster(os.path.join(run_dir, "logs"))
    t0 = time.time()
    try:
        ports = free_ports(1 + workers)
        spec = {"ps": ["127.0.0.1:%d" % ports[0]],
                "worker": ["127.0.0.1:%d" % p for p in ports[1:]]}
        say("custagg local cluster: 1 ps + %d workers on 127.0.0.1, logs "
            "in %s" % (workers, lc.log_dir))
        common = ["--spec", json.dumps(spec), "--args", job_args, "--out",
                  run_dir]
        names = []
        for job, n in (("ps", 1), ("worker", workers)):
            for i in range(n):
                name = "%s %d" % (job, i)
                proc = lc.start(name, python_argv(
                    _JOB_MODULE, "--job", job, "--task", i, *common),
                    daemon=job == "ps")
                say("started %s (pid %d) on %s" % (name, proc.pid,
                                                    spec[job][i]))
                if job == "worker":
                    names.append(name)
        follow = _LogFollower(lc.tasks["worker 0"].log_path, say)
        try:
            lc.wait(names, timeout=timeout, on_poll=follow)
        finally:
            follow()
        results = []
        for i in range(workers):
            with open(os.path.join(run_dir, "worker_%d.json" % i)) as f:
                results.append(json.load(f))
        _report(say, results, time.time() - t0)
        if args.aggregation == "dpsgd":
            from custagg.app import train  # pylint: disable=g-import-not-at-top
            say("privacy after %d epochs: %s" % (
                args.epochs, train.describe_epsilon(
                    args, results[0]["train_size"], args.batch_size,
                    args.epochs, pld=True)))
        return 0
    except TaskFailed as e:
        say("custagg: %s. Stopping the cluster." % e)
        return 1
    except TaskTimeout as e:
        say("custagg: the cluster run timed out (%s). Stopping the "
            "cluster." % e)
        return 1
    except (_Interrupted, KeyboardInterrupt) as e:
        sig = str(e) or "SIGINT"
        say("custagg: %s received; stopping the cluster." % sig)
        return 143 if sig == "SIGTERM" else 130
    finally:
        # A second Ctrl-C must not cut the shutdown short.
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        lc.shutdown()
        for s, h in old.items():
            signal.signal(s, h)
        say("cluster stopped: %d processes shut down" % len(lc.tasks))


def _report(say, results, wall):
    total = sum(r["examples"] for r in results)
    seconds = max(r["seconds"] for r in results)
    for r in results:
        say("worker %d: %d steps, %d examples in %.1f s: %.0f examples/s" % (
            r["task"], r["steps"], r["examples"], r["seconds"],
            r["examples_per_s"]))
    say("all workers: %.0f examples/s (%d examples in %.1f s of training, "
        "%.1f s with start-up)" % (total / max(seconds, 1e-9), total, seconds,
                                   wall))
    chief = results[0]
    say("final test accuracy: %.4f (%s)" % (chief["test_acc"],
                                            chief["data"]))
