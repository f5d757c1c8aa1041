"""`custagg.privacy.noise.NoiseStream`: noise that a checkpoint carries.

The scenario of issue 36: a graph-level seed set, k draws, a checkpoint, a
new session restoring it: no draw after the restore may equal one before
(TF's stateful ops replay draws 1, 2, ... there). Also: two runs from
scratch with the same graph seed are identical; `MonitoredTrainingSession`
stopped and re-created continues the stream; replicas and tensors of one
draw never share a key.
"""

import numpy as np
import pytest
import tensorflow as tf

from custagg.privacy import noise

import checkpoint_runs

SHAPES = [[3, 2], [4]]


def _build(graph_seed, seed=None, replica=None, name="s"):
    """(the draws [2 tensors], global step increment) in the default graph."""
    if graph_seed is not None:
        tf.compat.v1.set_random_seed(graph_seed)
    stream = noise.NoiseStream(name, seed=seed, replica=replica)
    draws = stream.normal(SHAPES, 1.0, dtype=tf.float64)
    return stream, draws


def _flat(values):
    return np.concatenate([np.ravel(v) for v in values])


def _run(graph_seed, steps, seed=None, restore=None, save=None):
    """Draws of `steps` steps in a fresh graph and session."""
    with tf.Graph().as_default():
        _, draws = _build(graph_seed, seed)
        return checkpoint_runs.session_steps(
            lambda sess: _flat(sess.run(draws)), steps, restore, save)


def _assert_all_distinct(before, after):
    for i, a in enumerate(after):
        for j, b in enumerate(before):
            assert not np.array_equal(a, b), (i, j)
        # Not even one coordinate repeats.
        assert not np.isin(a, np.concatenate(before)).any()


@pytest.mark.parametrize("seed", [None, 7])
def test_restore_continues_the_stream(tmp_path, seed):
    ckpt = str(tmp_path / "ckpt")
    before = _run(5, 3, seed=seed, save=ckpt)
    after = _run(5, 3, seed=seed, restore=ckpt)
    _assert_all_distinct(before, after)
    # The continued stream is exactly steps 4-6 of an uninterrupted run.
    whole = _run(5, 6, seed=seed)
    for a, w in zip(before + after, whole):
        np.testing.assert_array_equal(a, w)


def test_same_graph_seed_same_run_and_other_seeds_differ():
    a, b = _run(5, 3), _run(5, 3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(_run(6, 1)[0], a[0])
    for i in range(1, 3):
        assert not np.array_equal(a[i], a[0])


def test_without_graph_seed_each_run_differs_and_key_is_no_constant():
    a, b = _run(None, 1), _run(None, 1)
    assert not np.array_equal(a[0], b[0])
    with tf.Graph().as_default() as g:
        stream, _ = _build(None)
        key = [v for v in stream.variables() if "key" in v.name][0]
        # The key's initial value comes from a random op, not a constant
        # that a saved GraphDef would show.
        init = key.initializer.inputs[1].op
        types = set()
        stack = [init]
        while stack:
            op = stack.pop()
            types.add(op.type)
            stack.extend(t.op for t in op.inputs)
        assert "RandomUniformInt" in types, types


def test_int_seed_is_the_old_dp_optimizer_stream():
    """seed=int, joint=True: `stateless_normal([P], seed=(seed, step))`
    split, step counting from 1 (custagg's DPOptimizer(seed=...) stream)."""
    with tf.Graph().as_default():
        stream = noise.NoiseStream("s", seed=11)
        draws = stream.normal(SHAPES, 0.5, dtype=tf.float64, joint=True)
        ref = [tf.random.stateless_normal([10], seed=[11, s], stddev=0.5,
                                          dtype=tf.float64) for s in (1, 2)]
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            got = [_flat(sess.run(draws)) for _ in range(2)]
            want = sess.run(ref)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_replicas_and_tensors_never_share_a_draw():
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(1)
        a = noise.NoiseStream("s", replica=0).normal([[50], [50]], 1.0,
                                                     dtype=tf.float64)
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(1)
        b = noise.NoiseStream("s", replica=1).normal([[50], [50]], 1.0,
                                                     dtype=tf.float64)
    values = []
    for draws in (a, b):
        with tf.compat.v1.Session(graph=draws[0].graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            values.extend(sess.run(draws))
    flat = np.concatenate(values)
    assert len(np.unique(flat)) == flat.size


def test_two_streams_in_one_graph_differ():
    tf.compat.v1.set_random_seed(3)
    a = noise.NoiseStream("same").normal([[20]], 1.0, dtype=tf.float64)[0]
    b = noise.NoiseStream("same").normal([[20]], 1.0, dtype=tf.float64)[0]
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        va, vb = sess.run([a, b])
    assert not np.isin(va, vb).any()


def test_monitored_session_recovers_and_continues(tmp_path):
    ckpt_dir = str(tmp_path / "run")

    def session_draws(steps):
        with tf.Graph().as_default():
            tf.compat.v1.set_random_seed(9)
            step = tf.compat.v1.train.get_or_create_global_step()
            _, draws = _build(None)
            inc = tf.compat.v1.assign_add(step, 1)
            out = []
            with tf.compat.v1.train.MonitoredTrainingSession(
                    checkpoint_dir=ckpt_dir, save_checkpoint_steps=1,
                    save_summaries_steps=None, log_step_count_steps=None) \
                    as sess:
                for _ in range(steps):
                    d, _ = sess.run([draws, inc])
                    out.append(_flat(d))
            return out

    before = session_draws(3)
    assert tf.train.latest_checkpoint(ckpt_dir) is not None
    after = session_draws(3)
    _assert_all_distinct(before, after)


def test_statistics_and_stddev():
    tf.compat.v1.set_random_seed(2)
    d = noise.NoiseStream("s").normal([[20000]], 2.5, dtype=tf.float64)[0]
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        x = sess.run(d)
    n = x.size
    assert abs(x.mean()) < 5 * 2.5 / np.sqrt(n)
    assert abs(x.std() - 2.5) < 5 * 2.5 / np.sqrt(2 * n)


def test_variables_are_non_trainable_and_collected():
    tf.compat.v1.set_random_seed(2)
    stream = noise.NoiseStream("s")
    stream.normal([tf.zeros([2])], 1.0)
    vs = stream.variables()
    assert len(vs) == 2
    assert not any(v in tf.compat.v1.trainable_variables() for v in vs)
    assert set(noise.noise_state_variables()) == set(vs)
    assert all(v in tf.compat.v1.global_variables() for v in vs)


def test_prepare_makes_the_variables_a_draw_uses_and_draws_nothing():
    """What a replica that adds no noise calls (DistributedDPOptimizer):
    the same variables as a drawing replica's, and no random op."""
    tf.compat.v1.set_random_seed(2)
    stream = noise.NoiseStream("s")
    stream.prepare()
    vs = stream.variables()
    assert len(vs) == 2
    graph = tf.compat.v1.get_default_graph()
    assert not [op for op in graph.get_operations()
                if op.type.startswith("StatelessRandom")]
    out = stream.normal([tf.zeros([3])], 1.0)
    assert stream.variables() == vs
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        counter, = [v for v in vs if v.name.startswith("s_step")]
        assert sess.run(counter) == 0
        assert sess.run(out)[0].shape == (3,)


def test_none_entries_and_no_draw():
    stream = noise.NoiseStream("s")
    assert stream.normal([None, None], 1.0) == [None, None]
    assert stream.variables() == []
    out = stream.normal([None, tf.zeros([2, 3], tf.float32)], 1.0)
    assert out[0] is None and out[1].dtype == tf.float32


@pytest.mark.parametrize("kwargs,arg,error", [
    (dict(name=""), "name", TypeError),
    (dict(name="s", seed=1.5), "seed", TypeError),
    (dict(name="s", seed=True), "seed", TypeError),
    (dict(name="s", replica=-1), "replica", ValueError),
])
def test_bad_arguments(kwargs, arg, error):
    with pytest.raises(error, match="`%s`" % arg):
        noise.NoiseStream(**kwargs)


def test_shape_entries_need_a_dtype():
    with pytest.raises(TypeError, match="`dtype`"):
        noise.NoiseStream("s").normal([[2]], 1.0)


def test_graph_seed_key_does_not_need_the_initializer_order():
    """The key from the graph seed depends on the stream's (unique) name,
    not on how many ops came before: two graphs differing only in extra ops
    built first draw the same noise."""
    def draw(extra):
        with tf.Graph().as_default():
            tf.compat.v1.set_random_seed(4)
            for _ in range(extra):
                tf.constant(1.0)
            d = noise.NoiseStream("s").normal([[5]], 1.0, dtype=tf.float64)
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                return sess.run(d)[0]
    np.testing.assert_array_equal(draw(0), draw(3))



def test_every_trace_of_a_tf_function_continues_one_stream(run_python):
    """TF2, eager variables: a stream drawn in a tf.function keeps one key
    and counter across traces (the variables live in the eager context);
    a retrace draws the next counter value, not its own first one (with
    the seed of the stream's second draw site)."""
    proc = run_python("""
        import numpy as np
        import tensorflow as tf
        from custagg.privacy import noise
        tf.random.set_seed(3)
        stream = noise.NoiseStream("n")

        @tf.function
        def draw(x):
            return stream.normal([x], 1.0)[0]

        a = draw(tf.zeros([4])).numpy()
        b = draw(tf.zeros([5])).numpy()       # a second trace
        key, counter = stream.variables()
        assert int(counter.numpy()) == 2, counter.numpy()
        # Counter value 2, not 1. Each trace is a draw site of its own
        # (sites keep two draws of one run apart), numbered as TF traces
        # (it may trace a function more than once): look among the first.
        def drawn(counter, site):
            return noise.stateless_gaussian([5], tf.stack([
                key.read_value() + noise._offset(0, 0, site),
                tf.constant(counter, tf.int64)])).numpy()
        sites = [s for s in range(8) if np.array_equal(b, drawn(2, s))]
        assert len(sites) == 1, sites
        assert not any(np.array_equal(b, drawn(1, s)) for s in range(8))
        assert not np.isin(b, a).any()
        print("OK")
    """)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_eager_streams_with_one_name_never_share_a_key(run_python):
    """TF2, eager (also what a tf.function's variables see): with
    `tf.random.set_seed`, two unseeded streams of one name -- the leaves of
    a nested query, two tree-noise generators -- draw different noise, as
    two random ops do (the key takes TF's op seed, which a `set_seed`
    restarts: a rerun from scratch repeats). Shared noise would let anyone
    subtract two released parts and read their difference without noise.
    TF Privacy's own `tree_aggregation_test::test_seed_state_nondeterministic`
    checks the generators' case."""
    proc = run_python("""
        import numpy as np
        import tensorflow as tf
        from custagg.privacy.dp_query import gaussian_query
        from custagg.privacy.dp_query import nested_query
        from custagg.privacy.dp_query import tree_aggregation

        def run():
            tf.random.set_seed(1)
            g = [tree_aggregation.GaussianNoiseGenerator(
                0.1, tf.TensorSpec([])) for _ in range(2)]
            seeds = [x.initialize().seeds.numpy() for x in g]
            q = nested_query.NestedSumQuery(
                [gaussian_query.GaussianSumQuery(1.0, 1.0),
                 gaussian_query.GaussianSumQuery(1.0, 1.0)])
            zeros = [tf.zeros([6]), tf.zeros([6])]
            out = q.get_noised_result(q.initial_sample_state(zeros),
                                      q.initial_global_state())[0]
            return seeds, [o.numpy() for o in out]

        seeds, leaves = run()
        assert not np.array_equal(seeds[0], seeds[1]), seeds
        assert not np.isin(leaves[0], leaves[1]).any(), leaves
        seeds2, leaves2 = run()                 # from scratch: the same
        np.testing.assert_array_equal(np.stack(seeds), np.stack(seeds2))
        np.testing.assert_array_equal(np.stack(leaves), np.stack(leaves2))
        print("OK")
    """)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_two_draw_sites_of_one_stream_in_one_run_never_share_a_draw():
    """Two draws of one stream run by one `session.run` (each increments
    the counter, then reads it) may read the same counter value: their draw
    sites keep their seeds apart. Before the sites, 404 of 500 runs of the
    nested query below gave both variables the same noise."""
    with tf.Graph().as_default():
        stream = noise.NoiseStream("s")
        a = stream.normal(SHAPES, 1.0, dtype=tf.float64)
        b = stream.normal(SHAPES, 1.0, dtype=tf.float64)
        key = stream.fresh_key()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            seen = []
            for _ in range(200):
                da, db, _ = sess.run([a, b, key])
                seen += [_flat(da), _flat(db)]
    values = np.stack(seen)
    assert len(np.unique(values[:, 0])) == len(values)


def test_a_per_layer_query_sharing_one_gaussian_query_draws_apart():
    """`NestedSumQuery([q, q])`, one `GaussianSumQuery` for two variables
    (one stream, two draws per step), zero gradients: each variable's
    update is its noise, never the other's."""
    from custagg.privacy import dp_optimizer
    from custagg.privacy.dp_query import gaussian_query, nested_query
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 1])
        w1 = tf.compat.v1.get_variable("w1", [8])
        w2 = tf.compat.v1.get_variable("w2", [8])
        loss = tf.reduce_sum(0.0 * x * (w1 + w2), 1)
        q = gaussian_query.GaussianSumQuery(l2_norm_clip=1.0, stddev=1.0)
        opt = dp_optimizer.DPGradientDescentOptimizer(
            nested_query.NestedSumQuery([q, q]), learning_rate=0.1)
        (g1, _), (g2, _) = opt.compute_gradients(loss, var_list=[w1, w2])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            pairs = [sess.run([g1, g2], {x: np.ones([1, 1])})
                     for _ in range(200)]
    assert not any(np.array_equal(u, v) for u, v in pairs)
    assert len({float(u[0]) for u, _ in pairs}) == len(pairs)


def test_offsets_of_sites_replicas_and_indices_are_distinct():
    """`_offset` is injective on its documented ranges (checked at their
    corners and on random triples), and site 0 keeps the offsets every
    stream drew with before sites existed."""
    corners = [0, 1, 2]
    bounds = (1 << 30, 1 << 20, noise._MAX_SITES)
    values = [[0, 1, b - 2, b - 1] for b in bounds]
    rng = np.random.default_rng(0)
    triples = {(r, i, s) for r in values[0] for i in values[1] for s in values[2]}
    triples |= {(int(rng.integers(bounds[0])), int(rng.integers(bounds[1])),
                 int(rng.integers(bounds[2]))) for _ in range(2000)}
    triples |= {(r, i, s) for r in corners for i in corners for s in corners}
    offsets = {noise._offset(r, i, s) for r, i, s in triples}
    assert len(offsets) == len(triples)
    assert all(0 <= d < (1 << 62) for d in offsets)
    for r, i in [(0, 0), (3, 5), ((1 << 30) - 1, (1 << 20) - 1)]:
        assert noise._offset(r, i) == (((r << 20) + i) * noise._MIX) % (1 << 62)
