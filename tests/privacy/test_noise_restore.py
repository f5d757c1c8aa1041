"""Issue 36's restore scenario over every DP optimizer class custagg exports,
default arguments: graph seed set, k steps, a checkpoint, a new session
restoring it: no noise draw after the restore equals any before; two runs
from scratch with the same graph seed are identical; a
`MonitoredTrainingSession` killed mid-run and recovered from its checkpoint
continues the stream (each class: one of each face in the default run, the
others with `-m slow`).

The model's per-example gradients are all zero (inputs of zeros, a linear
loss), so each step's gradient is the noise alone, divided by M.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import optimizers as custagg_optimizers
from custagg.privacy import dp_optimizer
from custagg.privacy import dp_optimizer_vectorized
from custagg.privacy.dp_query import gaussian_query
from custagg.privacy.dp_query import nested_query
from custagg.privacy.dp_query import tree_aggregation_query
from custagg.privacy import distributed
from custagg.privacy import noise
from custagg.privacy import wrappers

import checkpoint_runs

B, D = 4, 3
CLIP, Z = 1.0, 1.1


def _inner_kwargs(base):
    kw = {"learning_rate": 0.1}
    if issubclass(base, tf.compat.v1.train.MomentumOptimizer):
        kw["momentum"] = 0.9
    return kw


def _base(cls):
    for base in cls.__mro__[1:]:
        if base.__module__.startswith("tensorflow") and issubclass(
                base, tf.compat.v1.train.Optimizer) and \
                base is not tf.compat.v1.train.Optimizer:
            return base
    return None


def _exported():
    """{name: factory() -> optimizer} for every exported DP class."""
    out = {}
    for module, prefix in ((dp_optimizer, "dp_optimizer"),
                           (dp_optimizer_vectorized, "vectorized")):
        for name in module.__all__:
            if name.startswith("make_"):
                continue
            cls = getattr(module, name)
            out["%s.%s" % (prefix, name)] = cls
    # custagg's own wrappers (the `...GaussianOptimizer` names under
    # custagg and custagg.optimizers are earlier names of the `...Wrapper`s,
    # which warn on access).
    seen = set()
    for name in wrappers.__all__:
        cls = getattr(wrappers, name)
        if name.startswith("make_") or cls is wrappers.ClippedOptimizer or \
                cls in seen:
            continue
        seen.add(cls)
        out["custagg.optimizers." + name] = cls
        assert getattr(custagg_optimizers, name) is cls
        if hasattr(custagg, name):
            assert getattr(custagg, name) is cls
    for name in ("DPGradientDescentOptimizer", "DPAdagradOptimizer",
                 "DPAdamOptimizer", "DPMomentumOptimizer"):
        assert getattr(custagg_optimizers, name) is getattr(dp_optimizer,
                                                            name)
    assert custagg.DPOptimizer is custagg_optimizers.DPOptimizer
    return out


CLASSES = _exported()


def _make(name):
    cls = CLASSES[name]
    if cls is custagg_optimizers.DPOptimizer:
        return cls(tf.compat.v1.train.GradientDescentOptimizer(0.1), CLIP, Z)
    if name.startswith("custagg.optimizers."):
        return cls(CLIP, Z, **_inner_kwargs(tf.compat.v1.train.MomentumOptimizer
                                            if "Momentum" in name else
                                            tf.compat.v1.train.Optimizer))
    base_kw = _inner_kwargs(_base(cls))
    if "Gaussian" in name or name.startswith("vectorized."):
        return cls(CLIP, Z, **base_kw)
    return cls(gaussian_query.GaussianSumQuery(CLIP, CLIP * Z), **base_kw)


def _graph(graph_seed, make):
    tf.compat.v1.set_random_seed(graph_seed)
    step = tf.compat.v1.train.get_or_create_global_step()
    w = tf.compat.v1.get_variable("w", [D], tf.float32,
                                  initializer=tf.compat.v1.zeros_initializer())
    x = tf.zeros([B, D])
    loss = tf.reduce_sum(x * w, axis=1)           # [B], zero gradients
    opt = make()
    gv = opt.compute_gradients(loss, var_list=[w])
    grad = gv[0][0]
    train = opt.apply_gradients(gv, global_step=step)
    return grad, train


def _steps(make, graph_seed, k, save=None, restore=None):
    with tf.Graph().as_default():
        grad, train = _graph(graph_seed, make)
        return checkpoint_runs.session_steps(
            lambda sess: sess.run([grad, train])[0], k, restore, save)


def _distinct(before, after):
    flat = np.concatenate(before)
    for a in after:
        assert not np.isin(a, flat).any(), (a, before)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_restore_never_repeats_noise(tmp_path, name):
    make = lambda: _make(name)
    ckpt = str(tmp_path / "ckpt")
    before = _steps(make, 5, 3, save=ckpt)
    after = _steps(make, 5, 3, restore=ckpt)
    assert all(np.abs(b).max() > 0 for b in before)   # noise is there
    _distinct(before, after)
    again = _steps(make, 5, 3)
    for a, b in zip(before, again):
        np.testing.assert_array_equal(a, b)


# One class of each face: they share the stream code (`privacy/noise.py`).
FACES = ["custagg.optimizers.DPOptimizer",
         "custagg.optimizers.DPAdamGaussianWrapper",
         "dp_optimizer.DPAdamGaussianOptimizer",
         "dp_optimizer.DPGradientDescentOptimizer",
         "vectorized.VectorizedDPAdagrad"]


@pytest.mark.parametrize("name", FACES)
def test_initializer_run_before_the_step_is_built(name):
    """TF Privacy's own tests' order: `global_variables_initializer()` runs
    before `compute_gradients` creates the noise stream's variables; they
    take their initial values at the first draw, which is the draw of the
    usual order (initializer last), and the stream goes on from there."""
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(5)
        tf.compat.v1.train.get_or_create_global_step()
        w = tf.compat.v1.get_variable(
            "w", [D], tf.float32,
            initializer=tf.compat.v1.zeros_initializer())
        opt = _make(name)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            loss = tf.reduce_sum(tf.zeros([B, D]) * w, axis=1)
            grad = opt.compute_gradients(loss, var_list=[w])[0][0]
            draws = [sess.run(grad) for _ in range(3)]
    usual = _steps(lambda: _make(name), 5, 3)
    for a, b in zip(draws, usual):
        np.testing.assert_array_equal(a, b)


class _Killed(Exception):
    """Stands for the process dying mid-run."""


def _monitored(ckpt_dir, graph, k, kill=False):
    """k steps of `graph()` (-> (grad, train)) in a MonitoredTrainingSession
    saving every step; with `kill`, the run dies after its k steps (an
    exception inside the session: no hook's `end`, no final save).
    Returns `(global steps before each step, noise of each step)`."""
    with tf.Graph().as_default():
        grad, train = graph()
        step = tf.compat.v1.train.get_global_step()
        steps, draws = [], []
        try:
            with tf.compat.v1.train.MonitoredTrainingSession(
                    checkpoint_dir=ckpt_dir, save_checkpoint_steps=1,
                    save_summaries_steps=None,
                    log_step_count_steps=None) as sess:
                for _ in range(k):
                    steps.append(sess.run(step))
                    draws.append(sess.run([grad, train])[0])
                if kill:
                    raise _Killed()
        except _Killed:
            pass
    return steps, draws


# Every class; the default run keeps one of each face (`FACES`, ~2 s a
# class), `-m slow` runs the rest.
@pytest.mark.parametrize("name", [
    n if n in FACES else pytest.param(n, marks=pytest.mark.slow)
    for n in sorted(CLASSES)])
def test_monitored_session_killed_and_recovered(tmp_path, name):
    """A MonitoredTrainingSession dies after 3 steps; a new one recovers
    from its checkpoint (global step 3) and draws 3 more: none of them is
    a draw of the first run (TF's stateful random ops would repeat them:
    docs/privacy.md)."""
    ckpt_dir = str(tmp_path / "run")
    graph = lambda: _graph(5, lambda: _make(name))
    steps, before = _monitored(ckpt_dir, graph, 3, kill=True)
    assert steps == [0, 1, 2]
    assert all(np.abs(b).max() > 0 for b in before)   # noise is there
    steps, after = _monitored(ckpt_dir, graph, 3)
    assert steps == [3, 4, 5]                         # recovered, not fresh
    _distinct(before, after)


def test_seeded_dp_optimizer_keeps_its_stream(tmp_path):
    """`DPOptimizer(seed=7)`: the stream `(7, step)` as before, restored
    (float32: `stateless_gaussian`, tested in test_noise_sampler)."""
    make = lambda: custagg_optimizers.DPOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), CLIP, Z, seed=7)
    ckpt = str(tmp_path / "ckpt")
    before = _steps(make, 5, 2, save=ckpt)
    after = _steps(make, 99, 2, restore=ckpt)   # the graph seed is unused
    with tf.Graph().as_default():
        ref = [noise.stateless_gaussian([D], tf.constant([7, s], tf.int64),
                                        CLIP * Z) / B for s in (1, 2, 3, 4)]
        with tf.compat.v1.Session() as sess:
            want = sess.run(ref)
    for got, w in zip(before + after, want):
        np.testing.assert_allclose(got, w, rtol=1e-6)


def test_nested_query_leaves_restore(tmp_path):
    """Per-layer queries (each leaf a GaussianSumQuery with its own
    stream) through the fast path."""
    def make():
        g = gaussian_query.GaussianSumQuery
        return dp_optimizer.DPGradientDescentOptimizer(
            nested_query.NestedSumQuery([g(CLIP, Z)]), learning_rate=0.1)
    ckpt = str(tmp_path / "ckpt")
    before = _steps(make, 5, 3, save=ckpt)
    after = _steps(make, 5, 3, restore=ckpt)
    _distinct(before, after)


@pytest.mark.parametrize("query", ["TreeResidualSumQuery",
                                   "TreeCumulativeSumQuery"])
def test_tree_aggregation_query_restore(tmp_path, query):
    """The tree aggregation's Gaussian noise (its own (key, counter) state,
    rebuilt at every step of the TF1 optimizer): the key comes from a
    checkpointed stream, so a restore does not repeat the run's keys."""
    def make():
        q = getattr(tree_aggregation_query, query).build_l2_gaussian_query(
            CLIP, Z, [tf.TensorSpec([D])])
        return dp_optimizer.DPGradientDescentOptimizer(q, learning_rate=0.1)
    ckpt = str(tmp_path / "ckpt")
    before = _steps(make, 5, 3, save=ckpt)
    after = _steps(make, 5, 3, restore=ckpt)
    assert all(np.abs(b).max() > 0 for b in before)
    _distinct(before, after)
    for a, b in zip(before, _steps(make, 5, 3)):
        np.testing.assert_array_equal(a, b)


def _distributed_graph(graph_seed):
    """`DistributedDPOptimizer` around a default `DPOptimizer`: its noise is
    added after the aggregation, in `apply_gradients`, so a step's noise is
    the update itself (`-lr * noise / B`), fetched with the step."""
    tf.compat.v1.set_random_seed(graph_seed)
    step = tf.compat.v1.train.get_or_create_global_step()
    w = tf.compat.v1.get_variable(
        "w", [D], initializer=tf.compat.v1.zeros_initializer())
    loss = tf.reduce_sum(tf.zeros([B, D]) * w, axis=1)
    opt = distributed.DistributedDPOptimizer(custagg_optimizers.DPOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), CLIP, Z))
    w0 = tf.identity(w.read_value())
    with tf.control_dependencies([w0]):
        train = opt.minimize(loss, global_step=step, var_list=[w])
    with tf.control_dependencies([train]):
        update = w.read_value() - w0
    return update, train


def test_distributed_wrapper_restore(tmp_path):
    def steps(k, save=None, restore=None):
        with tf.Graph().as_default():
            update, train = _distributed_graph(5)
            return checkpoint_runs.session_steps(
                lambda sess: sess.run([update, train])[0], k, restore, save)

    ckpt = str(tmp_path / "ckpt")
    before = steps(3, save=ckpt)
    after = steps(3, restore=ckpt)
    assert all(np.abs(b).max() > 0 for b in before)
    _distinct(before, after)
    for a, b in zip(before, steps(3)):
        np.testing.assert_array_equal(a, b)
    ckpt_dir = str(tmp_path / "run")
    _, before = _monitored(ckpt_dir, lambda: _distributed_graph(5), 3,
                           kill=True)
    steps_after, after = _monitored(ckpt_dir, lambda: _distributed_graph(5),
                                    3)
    assert steps_after == [3, 4, 5]
    _distinct(before, after)


def test_tf1_behaviour_initializer_before_or_after(run_python):
    """`tf.compat.v1.disable_v2_behavior()` (ref variables, v1 control
    flow): the stream's variables are an optimizer's non-slot `RefVariable`s
    there; with the initializer run before `compute_gradients` they take
    their initial values at the first draw, the draws of the usual order."""
    proc = run_python("""
        import numpy as np
        import tensorflow as tf
        tf.compat.v1.disable_v2_behavior()
        import custagg
        from custagg.privacy import dp_optimizer

        def draws(make, initializer_first):
            with tf.Graph().as_default():
                tf.compat.v1.set_random_seed(3)
                w = tf.compat.v1.get_variable(
                    "w", [3], initializer=tf.compat.v1.zeros_initializer())
                opt = make()
                with tf.compat.v1.Session() as sess:
                    if initializer_first:
                        sess.run(tf.compat.v1.global_variables_initializer())
                    loss = tf.reduce_sum(tf.zeros([4, 3]) * w, axis=1)
                    g = opt.compute_gradients(loss, var_list=[w])[0][0]
                    if not initializer_first:
                        sess.run(tf.compat.v1.global_variables_initializer())
                    return np.stack([sess.run(g) for _ in range(3)])

        gd = tf.compat.v1.train.GradientDescentOptimizer
        for make in (lambda: custagg.DPOptimizer(gd(0.1), 1.0, 1.1),
                     lambda: dp_optimizer.DPAdamGaussianOptimizer(
                         1.0, 1.1, learning_rate=0.1)):
            first = draws(make, True)
            np.testing.assert_array_equal(first, draws(make, False))
            assert len({row.tobytes() for row in first}) == 3
            assert np.abs(first).min() > 0
        print("OK")
    """)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
