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
                raise TaskTimeout("still running after %.0f s: %s" % (
                    timeout, ", ".join(running)))
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
