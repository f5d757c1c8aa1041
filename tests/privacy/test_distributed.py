"""custagg's DP optimizers on TF's distributed runtime (custagg.distributed).

Clusters run as subprocesses on 127.0.0.1, on ports picked free, through
`custagg.app.cluster.LocalCluster`: every wait is bounded and every process
is killed in a `finally` (the tests check that none is left). The tasks'
code is this file itself, run as a script (`python tests/privacy/test_distributed.py
sync ...`), so that the tasks and the in-process reference build the same
model with the same function.

Each cluster test starts 2-3 TensorFlow processes (about 25 s on 2 shared
cores): one of them runs by default, the others are `slow`
(`python -m pytest -m slow tests/privacy/test_distributed.py`).

References: one process, one device, plain `tf.compat.v1.Session`, the same
global batches (`_global_batch(t)`), the same DP optimizer without noise.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import custagg  # noqa: E402
from custagg import distributed  # noqa: E402
from custagg.app import cluster as cluster_lib  # noqa: E402
from custagg.privacy import dp_optimizer as tfp_dp  # noqa: E402

D, C = 100, 100          # W is [100, 100]: 10,100 coordinates with b
CLIP = 1.2
LR = 0.5
WAIT_S = 240             # bound on any cluster run (2 shared cores)
DTYPE = np.float64


# ------------------------------------------------------------------ model


def _global_batch(t, size):
    r = np.random.RandomState(1000 + t)
    x = (0.15 * r.randn(size, D)).astype(DTYPE)
    y = r.randint(0, C, size).astype(np.int64)
    return x, y


def _initial_values():
    r = np.random.RandomState(0)
    return (0.05 * r.randn(D, C)).astype(DTYPE), np.zeros(C, DTYPE)


def _model(x, y):
    w0, b0 = _initial_values()
    w = tf.compat.v1.get_variable("w", initializer=tf.constant(w0),
                                  dtype=tf.float64, use_resource=True)
    b = tf.compat.v1.get_variable("b", initializer=tf.constant(b0),
                                  dtype=tf.float64, use_resource=True)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.matmul(x, w) + b)
    return loss, [w, b]


def _dp_optimizer(kind, noise, lr=LR):
    """A DP optimizer of each family custagg offers."""
    if kind == "custagg":
        return custagg.DPOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(lr),
            l2_norm_clip=CLIP, noise_multiplier=noise)
    if kind == "custagg-momentum":
        return custagg.DPOptimizer(
            tf.compat.v1.train.MomentumOptimizer(lr, momentum=0.9),
            l2_norm_clip=CLIP, noise_multiplier=noise)
    if kind == "tfp":
        return tfp_dp.DPGradientDescentGaussianOptimizer(
            l2_norm_clip=CLIP, noise_multiplier=noise, num_microbatches=None,
            learning_rate=lr)
    raise ValueError(kind)


def _placeholders(batch):
    return (tf.compat.v1.placeholder(DTYPE, [batch, D], name="x"),
            tf.compat.v1.placeholder(tf.int64, [batch], name="y"))


def _reference(kind, steps, global_batch, lr=LR):
    """Variables after `steps` single-process clean DP steps."""
    with tf.Graph().as_default():
        x, y = _placeholders(global_batch)
        loss, variables = _model(x, y)
        step = tf.compat.v1.train.get_or_create_global_step()
        train = _dp_optimizer(kind, 0.0, lr).minimize(
            loss, global_step=step, var_list=variables)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for t in range(steps):
                xb, yb = _global_batch(t, global_batch)
                sess.run(train, {x: xb, y: yb})
            return sess.run(variables)


# ---------------------------------------------------------- cluster tasks


def _sync_task(a):
    """ps or worker of a SyncReplicasOptimizer cluster (between-graph)."""
    spec = json.loads(a.spec)
    cluster = tf.train.ClusterSpec(spec)
    server = tf.distribute.Server(cluster, job_name=a.job,
                                  task_index=a.task, start=True)
    if a.job == "ps":
        server.join()
        return
    workers = len(spec["worker"])
    local = a.global_batch // workers
    is_chief = a.task == 0
    with tf.Graph().as_default():
        with tf.compat.v1.device(tf.compat.v1.train.replica_device_setter(
                worker_device="/job:worker/task:%d" % a.task,
                cluster=cluster)):
            x, y = _placeholders(local)
            loss, variables = _model(x, y)
            step = tf.compat.v1.train.get_or_create_global_step()
            opt = distributed.sync_replicas_dp_optimizer(
                _dp_optimizer(a.kind, a.noise, a.lr), num_workers=workers)
            train = opt.minimize(loss, global_step=step, var_list=variables)
        hook = opt.make_session_run_hook(is_chief, num_tokens=0)
        config = distributed.worker_session_config(a.task)
        if not is_chief:
            distributed.wait_until_initialized(server.target, config, WAIT_S)
        with tf.compat.v1.train.MonitoredTrainingSession(
                master=server.target, is_chief=is_chief, hooks=[hook],
                config=config, stop_grace_period_secs=2,
                log_step_count_steps=None) as sess:
            for t in range(a.steps):
                xb, yb = _global_batch(t, a.global_batch)
                part = slice(a.task * local, (a.task + 1) * local)
                sess.run(train, {x: xb[part], y: yb[part]})
            if is_chief:
                w, b, s = sess.run(variables + [step])
                np.savez(a.out, w=w, b=b, step=s)
    print("task done", flush=True)


def _replicated_dp_step(strategy, kind, a, local):
    """One DP step under `strategy`, each replica on its own `local`
    examples: (train op, [(replica id, x, y)] per replica, {"vars": the
    model's variables})."""
    replicas, holder = [], {}
    with strategy.scope():
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = distributed.DistributedDPOptimizer(
            _dp_optimizer(kind, a.noise, a.lr))

        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            r = tf.get_static_value(ctx.replica_id_in_sync_group)
            x, y = _placeholders(local)
            replicas.append((r, x, y))
            loss, variables = _model(x, y)
            holder["vars"] = variables
            return opt.minimize(loss, global_step=step, var_list=variables)

        train = strategy.group(
            strategy.extended.call_for_each_replica(replica_fn))
    return train, replicas, holder


def _mwms_task(a):
    """One worker of MultiWorkerMirroredStrategy in graph mode (TF_CONFIG)."""
    tf.compat.v1.disable_eager_execution()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    cfg = json.loads(os.environ["TF_CONFIG"])
    workers = len(cfg["cluster"]["worker"])
    task = cfg["task"]["index"]
    server = tf.distribute.Server(
        tf.train.ClusterSpec(cfg["cluster"]), job_name="worker",
        task_index=task, protocol="grpc",
        config=strategy.update_config_proto(tf.compat.v1.ConfigProto()))
    local = a.global_batch // workers
    with tf.Graph().as_default() as g:
        train, replicas, holder = _replicated_dp_step(strategy, a.kind, a,
                                                      local)
        with strategy.scope():
            init = tf.compat.v1.global_variables_initializer()
        config = strategy.update_config_proto(tf.compat.v1.ConfigProto())
        with tf.compat.v1.Session(server.target, config=config,
                                  graph=g) as sess:
            sess.run(init)
            (_, x, y), = replicas
            for t in range(a.steps):
                xb, yb = _global_batch(t, a.global_batch)
                part = slice(task * local, (task + 1) * local)
                sess.run(train, {x: xb[part], y: yb[part]})
            w, b = sess.run(holder["vars"])
    np.savez(a.out + ".%d.npz" % task, w=w, b=b)
    print("task done", flush=True)


def _mirrored_main(a):
    """MirroredStrategy over 2 logical CPUs vs 1 device, graph mode."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    tf.compat.v1.disable_eager_execution()
    out = {}
    for kind in ("custagg", "custagg-momentum", "tfp"):
        for devices in (["/cpu:0"], ["/cpu:0", "/cpu:1"]):
            out["%s/%d" % (kind, len(devices))] = [
                v.tolist() for v in _mirrored_run(kind, devices, a)]
    # One noisy step (lr 1): the noise enters the all-reduced sum once.
    a.steps, a.lr, a.noise = 1, 1.0, 3.0
    out["noisy/2"] = [v.tolist() for v in _mirrored_run(
        "custagg", ["/cpu:0", "/cpu:1"], a)]
    with open(a.out, "w") as f:
        json.dump(out, f)


def _mirrored_run(kind, devices, a):
    with tf.Graph().as_default() as g:
        strategy = tf.distribute.MirroredStrategy(devices)
        local = a.global_batch // len(devices)
        train, xs, holder = _replicated_dp_step(strategy, kind, a, local)
        with tf.compat.v1.Session(graph=g) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for t in range(a.steps):
                xb, yb = _global_batch(t, a.global_batch)
                feed = {}
                for r, x, y in xs:
                    feed[x] = xb[r * local:(r + 1) * local]
                    feed[y] = yb[r * local:(r + 1) * local]
                sess.run(train, feed)
            return sess.run(holder["vars"])


def _task_parser():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("sync", "mwms", "mirrored"))
    p.add_argument("--job", default="worker")
    p.add_argument("--task", type=int, default=0)
    p.add_argument("--spec", default="{}")
    p.add_argument("--kind", default="custagg")
    p.add_argument("--noise", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--out", default="")
    return p


# ------------------------------------------------------------ test helpers


def _script(*args):
    return [sys.executable, os.path.abspath(__file__)] + [str(a) for a in
                                                          args]


def _env():
    return {"PYTHONPATH": REPO_ROOT + os.pathsep +
            os.environ.get("PYTHONPATH", ""),
            "TF_USE_LEGACY_KERAS": "1"}


def _run_sync_cluster(tmp, kind, noise, steps, global_batch, lr=LR,
                      workers=2):
    """ps + `workers` workers; returns the chief's saved variables."""
    ports = cluster_lib.free_ports(1 + workers)
    spec = json.dumps(distributed.local_cluster_spec(ports[1:], ports[:1]))
    out = os.path.join(tmp, "chief.npz")
    common = ["--spec", spec, "--kind", kind, "--noise", noise, "--steps",
              steps, "--global-batch", global_batch, "--lr", lr, "--out",
              out]
    lc = cluster_lib.LocalCluster(os.path.join(tmp, "logs"), env=_env())
    try:
        lc.start("ps 0", _script("sync", "--job", "ps", "--task", 0,
                                 *common), daemon=True)
        names = []
        for i in range(workers):
            names.append("worker %d" % i)
            lc.start(names[-1], _script("sync", "--job", "worker", "--task",
                                        i, *common))
        lc.wait(names, timeout=WAIT_S)
    finally:
        pids = lc.pids
        lc.shutdown()
        assert cluster_lib.pids_alive(pids) == []
    saved = np.load(out)
    assert int(saved["step"]) == steps
    return saved["w"], saved["b"]


# ------------------------------------------------------------------- tests


def test_free_ports_are_distinct_and_bindable():
    ports = cluster_lib.free_ports(4)
    assert len(set(ports)) == 4
    import socket
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_rejects_an_optimizer_whose_noise_cannot_move():
    with pytest.raises(TypeError, match="DPOptimizer"):
        distributed.DistributedDPOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.1))
    with pytest.raises(TypeError, match="DPOptimizer"):
        distributed.DistributedDPOptimizer(
            custagg.PerExampleOptimizer(
                tf.compat.v1.train.GradientDescentOptimizer(0.1)))


@pytest.mark.parametrize("kind", ["custagg", "tfp"])
def test_one_replica_noise_total_and_normalisation(kind, sess):
    """One replica (no cluster): clean part equals the DP optimizer's, noise
    std on the update is sigma*C/B."""
    sigma, batch = 2.0, 8
    x, y = _placeholders(batch)
    loss, variables = _model(x, y)
    opt = distributed.DistributedDPOptimizer(_dp_optimizer(kind, sigma, 1.0))
    gv = opt.compute_gradients(loss, var_list=variables)
    noisy = opt.apply_gradients(gv)
    ref = _reference(kind, 1, batch, lr=1.0)
    sess.run(tf.compat.v1.global_variables_initializer())
    xb, yb = _global_batch(0, batch)
    sess.run(noisy, {x: xb, y: yb})
    got = sess.run(variables)
    diff = np.concatenate([(g - r).ravel() for g, r in zip(got, ref)])
    assert diff.size >= 10000
    expected = sigma * CLIP / batch
    assert sess.run(opt.noise_stddev_on_update) == pytest.approx(expected)
    assert np.std(diff) == pytest.approx(expected, rel=0.05)
    assert abs(np.mean(diff)) < 5 * expected / np.sqrt(diff.size)


def test_seeded_noise_repeats_and_depends_on_step_only():
    def run(seed):
        with tf.Graph().as_default():
            x, y = _placeholders(4)
            loss, variables = _model(x, y)
            step = tf.compat.v1.train.get_or_create_global_step()
            opt = distributed.DistributedDPOptimizer(
                _dp_optimizer("custagg", 1.0, 1.0), seed=seed)
            train = opt.minimize(loss, global_step=step, var_list=variables)
            with tf.compat.v1.Session() as s:
                s.run(tf.compat.v1.global_variables_initializer())
                xb, yb = _global_batch(0, 4)
                s.run(train, {x: xb, y: yb})
                return s.run(variables[0])
    a, b, c = run(3), run(3), run(4)
    np.testing.assert_array_equal(a, b)
    assert np.max(np.abs(a - c)) > 0


@pytest.mark.parametrize("kind", [
    "custagg-momentum", pytest.param("tfp", marks=pytest.mark.slow)])
def test_sync_replicas_noise_off_equals_one_process(kind, tmp_path):
    """ps + 2 workers, K=3 synchronous steps, no noise: the variables equal
    one process's on the same global batches (1e-6)."""
    steps, global_batch = 3, 16
    w, b = _run_sync_cluster(str(tmp_path), kind, 0.0, steps, global_batch)
    w_ref, b_ref = _reference(kind, steps, global_batch)
    assert np.max(np.abs(w - _initial_values()[0])) > 1e-3   # it trained
    np.testing.assert_allclose(w, w_ref, rtol=0, atol=1e-6)
    np.testing.assert_allclose(b, b_ref, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_sync_replicas_noise_total_std(tmp_path):
    """ps + 2 workers, one noisy step: std of (noisy - clean) update over
    10,100 coordinates is sigma*C/B_global (not sqrt(2) times it, not 0)."""
    sigma, global_batch = 3.0, 16
    w, b = _run_sync_cluster(str(tmp_path), "custagg", sigma, 1,
                             global_batch, lr=1.0)
    w_ref, b_ref = _reference("custagg", 1, global_batch, lr=1.0)
    diff = np.concatenate([(w - w_ref).ravel(), (b - b_ref).ravel()])
    assert diff.size >= 10000
    expected = sigma * CLIP / global_batch
    assert np.std(diff) == pytest.approx(expected, rel=0.05)


@pytest.mark.slow
def test_mirrored_strategy_two_logical_devices_equals_one(tmp_path):
    """MirroredStrategy, graph mode, 2 logical CPUs: 2 steps equal one
    device's and one process's; one noisy step has std sigma*C/B_global."""
    out = str(tmp_path / "mirrored.json")
    lc = cluster_lib.LocalCluster(str(tmp_path / "logs"), env=_env())
    try:
        lc.start("mirrored", _script("mirrored", "--steps", 2,
                                     "--global-batch", 16, "--out", out))
        lc.wait(["mirrored"], timeout=WAIT_S)
    finally:
        lc.shutdown()
    got = json.load(open(out))
    for kind in ("custagg", "custagg-momentum", "tfp"):
        one = [np.array(v) for v in got[kind + "/1"]]
        two = [np.array(v) for v in got[kind + "/2"]]
        ref = _reference(kind, 2, 16)
        for a, b, r in zip(one, two, ref):
            np.testing.assert_allclose(a, r, rtol=0, atol=1e-9)
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    noisy = [np.array(v) for v in got["noisy/2"]]
    clean = _reference("custagg", 1, 16, lr=1.0)
    diff = np.concatenate([(n - c).ravel() for n, c in zip(noisy, clean)])
    assert np.std(diff) == pytest.approx(3.0 * CLIP / 16, rel=0.05)


@pytest.mark.slow
def test_multi_worker_mirrored_strategy_two_processes(tmp_path):
    """MultiWorkerMirroredStrategy, graph mode, 2 worker processes on
    127.0.0.1 (TF_CONFIG): both hold one process's variables after 2 steps."""
    ports = cluster_lib.free_ports(2)
    spec = distributed.local_cluster_spec(ports)
    out = str(tmp_path / "mwms")
    lc = cluster_lib.LocalCluster(str(tmp_path / "logs"), env=_env())
    try:
        for i in range(2):
            tf_config = json.dumps({"cluster": spec,
                                    "task": {"type": "worker", "index": i}})
            lc.start("worker %d" % i,
                     _script("mwms", "--steps", 2, "--global-batch", 16,
                             "--kind", "custagg", "--out", out),
                     env={"TF_CONFIG": tf_config})
        lc.wait(["worker 0", "worker 1"], timeout=WAIT_S)
    finally:
        pids = lc.pids
        lc.shutdown()
        assert cluster_lib.pids_alive(pids) == []
    w_ref, b_ref = _reference("custagg", 2, 16)
    for i in range(2):
        saved = np.load(out + ".%d.npz" % i)
        assert np.max(np.abs(saved["w"] - _initial_values()[0])) > 1e-3
        np.testing.assert_allclose(saved["w"], w_ref, rtol=0, atol=1e-6)
        np.testing.assert_allclose(saved["b"], b_ref, rtol=0, atol=1e-6)



@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "63"], "must be a multiple of --workers 2"),
    (["--aggregation", "dpsgd", "--num-microbatches", "1"],
     "--num-microbatches 1 must be a multiple of --workers 2"),
    (["--download"], "--download cannot be used with --distributed"),
])
def test_cli_flag_errors(flags, message, capsys):
    from custagg.app import cli
    parser = cli.build_parser()
    args = parser.parse_args(["--distributed", "local", "--workers", "2"] +
                             flags)
    with pytest.raises(SystemExit) as e:
        cli.check_args(parser, args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_selects_the_cluster_runner():
    from custagg.app import cli
    args = cli.build_parser().parse_args(["--distributed", "local"])
    cli.check_args(cli.build_parser(), args)
    assert args.workers == 2
    assert cli.select_job(args) is cluster_lib.run_local


# ------------------------------------------- python -m custagg --distributed


class _Runner(object):
    """`python -m custagg ...` in its own process group; stdout collected
    line by line by a thread."""

    def __init__(self, *flags):
        import subprocess
        import threading
        env = dict(os.environ)
        env.update(_env())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "custagg"] + [str(f) for f in flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=env, cwd=REPO_ROOT, start_new_session=True)
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError("no %r in the runner's output within %d s:\n%s"
                             % (text, timeout, self.output))

    @property
    def output(self):
        return "\n".join(self.lines)

    def task_pids(self):
        """{task name: pid} from the 'started worker 1 (pid 123)' lines."""
        import re
        pids = {}
        for line in self.lines:
            m = re.match(r"started (\w+ \d+) \(pid (\d+)\)", line)
            if m:
                pids[m.group(1)] = int(m.group(2))
        return pids

    def wait(self, timeout):
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return rc

    def kill(self):
        import signal
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)


def _runner_flags(epochs):
    return ["--distributed", "local", "--workers", 2, "--aggregation",
            "dpsgd", "--epochs", epochs, "--cluster-timeout", WAIT_S]


def _assert_all_gone(pids):
    """Every task process ends (bounded wait: the kernel reaps them)."""
    deadline = time.monotonic() + 30
    while cluster_lib.pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster_lib.pids_alive(pids) == []


def test_a_timed_out_wait_shows_where_each_task_stopped(tmp_path):
    """A task still running when the wait runs out: TaskTimeout names it
    and shows its log's last lines (the one clue to a hung collective)."""
    lc = cluster_lib.LocalCluster(str(tmp_path / "logs"))
    try:
        lc.start("sleeper", [sys.executable, "-c",
                             "import time; print('reached the init', "
                             "flush=True); time.sleep(60)"])
        deadline = time.monotonic() + 30
        while "reached" not in lc.tasks["sleeper"].log_tail():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with pytest.raises(cluster_lib.TaskTimeout,
                           match=r"(?s)still running after 0 s: sleeper\n"
                                 r"--- sleeper .*reached the init"):
            lc.wait(["sleeper"], timeout=0.1)
    finally:
        pids = lc.pids
        lc.shutdown()
    assert cluster_lib.pids_alive(pids) == []


def test_killed_worker_stops_the_run_and_names_it():
    """SIGKILL to worker 1 mid-run: the runner exits within 60 s, says
    which task died, and leaves no process behind."""
    import signal
    runner = _Runner(*_runner_flags(100000))
    pids = {}
    try:
        runner.wait_for("epoch  2", timeout=WAIT_S)
        pids = runner.task_pids()
        assert set(pids) == {"ps 0", "worker 0", "worker 1"}
        os.kill(pids["worker 1"], signal.SIGKILL)
        t0 = time.monotonic()
        rc = runner.wait(timeout=60)
        elapsed = time.monotonic() - t0
        print("run stopped %.1f s after the kill" % elapsed)
        assert elapsed < 60
        assert rc == 1
        assert "worker 1 was killed by signal SIGKILL" in runner.output
        assert "Stopping the cluster" in runner.output
    finally:
        runner.kill()
        _assert_all_gone(list(pids.values()) + [runner.proc.pid])


@pytest.mark.slow
def test_ctrl_c_stops_every_process():
    import signal
    runner = _Runner(*_runner_flags(100000))
    pids = {}
    try:
        runner.wait_for("epoch  2", timeout=WAIT_S)
        pids = runner.task_pids()
        runner.proc.send_signal(signal.SIGINT)
        assert runner.wait(timeout=60) == 130
        assert "SIGINT received; stopping the cluster" in runner.output
    finally:
        runner.kill()
        _assert_all_gone(list(pids.values()))


@pytest.mark.slow
def test_local_cluster_run_reports_throughput_and_accuracy():
    runner = _Runner(*_runner_flags(3))
    pids = {}
    try:
        rc = runner.wait(timeout=WAIT_S)
        pids = runner.task_pids()
        assert rc == 0, runner.output
    finally:
        runner.kill()
        _assert_all_gone(list(pids.values()))
    out = runner.output
    for i in range(2):
        assert "worker %d: 66 steps, 2112 examples" % i in out
    assert "examples/s" in out and "final test accuracy" in out
    assert "privacy after 3 epochs: epsilon" in out
    acc = float(out.split("final test accuracy: ")[1].split()[0])
    assert acc > 0.8

if __name__ == "__main__":
    _args = _task_parser().parse_args()
    tf.compat.v1.disable_eager_execution() if _args.mode == "sync" else None
    {"sync": _sync_task, "mwms": _mwms_task,
     "mirrored": _mirrored_main}[_args.mode](_args)
