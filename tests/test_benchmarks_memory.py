"""The benchmarks' peak-memory figure (benchmarks/memory.py), checked on
graphs whose temporaries have known sizes.

Stated factor: on these graphs the measured peak is at least the known live
bytes and at most 1.25x of them plus 64 KiB (small tensors: scalars, shapes,
reduction outputs). Sizes are drawn at random so no figure is hard-coded.
"""
import numpy as np
import pytest
import tensorflow as tf

from benchmarks import memory

tf1 = tf.compat.v1
FACTOR, SLACK = 1.25, 64 * 1024


def _peak(build, feeds):
    graph = tf.Graph()
    with graph.as_default():
        fetch, placeholders = build()
        init = tf1.global_variables_initializer()
    config = tf1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
    with tf1.Session(graph=graph, config=config) as sess:
        sess.run(init)
        feed = {placeholders[k]: v for k, v in feeds.items()}
        value = sess.run(fetch, feed)   # the traced step must not change results
        peak, by_allocator = memory.step_peak_bytes(sess, fetch, feed)
        np.testing.assert_allclose(sess.run(fetch, feed), value, rtol=1e-6)
    return peak, by_allocator


def _within(peak, known):
    assert peak >= known, (peak, known)
    assert peak <= FACTOR * known + SLACK, (peak, known)


@pytest.mark.parametrize("seed", [0, 1])
def test_one_known_temporary(seed):
    # x [N, K] @ w [K, M]: one [N, M] float32 temporary, reduced to a scalar.
    rng = np.random.RandomState(seed)
    n, k, m = rng.randint(200, 700), 16, rng.randint(300, 900)

    def build():
        x = tf1.placeholder(tf.float32, [None, k])
        w = tf.Variable(rng.normal(size=[k, m]).astype(np.float32))
        return tf.reduce_sum(tf.square(tf.matmul(x, w))), {"x": x}

    peak, by_allocator = _peak(build, {"x": rng.normal(size=[n, k]).astype(np.float32)})
    assert by_allocator, "no allocation records: was the step traced?"
    _within(peak, n * m * 4)


def test_two_live_temporaries_add_and_a_dead_one_does_not():
    # a and b are both live when a * b runs; c is freed before d is made, so
    # the peak is |a| + |b| (+ the product, which may reuse a's buffer), not
    # |a| + |b| + |c| + |d|.
    n, m = 400, 500

    def build():
        x = tf1.placeholder(tf.float32, [None, 8])
        w = tf.Variable(np.ones([8, m], np.float32))
        a, b = tf.matmul(x, w), tf.matmul(x, w, name="b") * 0.5
        first = tf.reduce_sum(a * b)
        with tf.control_dependencies([first]):
            c = tf.matmul(x, w) + 1.0
        second = tf.reduce_sum(c)
        return first + second, {"x": x}

    peak, _ = _peak(build, {"x": np.ones([n, 8], np.float32)})
    one = n * m * 4
    assert peak >= 2 * one
    assert peak <= 3 * one + SLACK      # a, b and at most one more [N, M]


def test_temporaries_inside_a_while_loop_are_counted():
    # TF2 control flow (StatelessWhile): the body's kernels run in a nested
    # executor; their allocations must reach the step's records too.
    n, m = 300, 700

    def build():
        x = tf1.placeholder(tf.float32, [None, 8])
        w = tf.Variable(np.ones([8, m], np.float32))

        def body(i, acc):
            return i + 1, acc + tf.reduce_sum(tf.sin(tf.matmul(x, w)))

        _, total = tf.while_loop(lambda i, acc: i < 3, body, [0, 0.0])
        return total, {"x": x}

    peak, _ = _peak(build, {"x": np.ones([n, 8], np.float32)})
    one = n * m * 4
    assert peak >= one
    assert peak <= 2 * FACTOR * one + SLACK    # matmul output and sin's output


def test_peak_scales_with_the_batch():
    # The same graph fed 2x the rows: the [N, M] temporary doubles.
    m = 1000

    def build():
        x = tf1.placeholder(tf.float32, [None, 32])
        w = tf.Variable(np.ones([32, m], np.float32))
        return tf.reduce_sum(tf.exp(tf.matmul(x, w) * 1e-3)), {"x": x}

    small, _ = _peak(build, {"x": np.ones([256, 32], np.float32)})
    large, _ = _peak(build, {"x": np.ones([512, 32], np.float32)})
    _within(small, 256 * m * 4)
    _within(large, 512 * m * 4)
    assert 1.8 < large / float(small) < 2.2


def test_tf_peaks_takes_the_median_over_new_sessions_and_the_record_keeps_it():
    """common.tf_peaks: each fetch's peak over new sessions (each
    initialized), their median in the record and their range beside it."""
    from benchmarks import common
    rng = np.random.RandomState(2)
    n, m = rng.randint(200, 500), rng.randint(300, 700)
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 8])
        w = tf.Variable(np.ones([8, m], np.float32))
        small = tf.reduce_sum(tf.matmul(x, w))                              # one [N, M]
        large = tf.reduce_sum(tf.matmul(x, w) * tf.matmul(x, w, name="b"))  # two at once
        init = tf1.global_variables_initializer()
    feed = {x: np.ones([n, 8], np.float32)}
    peaks = common.tf_peaks(graph, init, feed, {"floor": small, "system": large}, sessions=3)
    one = n * m * 4
    _within(peaks["floor"], one)
    _within(peaks["system"], 2 * one)
    assert peaks["sessions"] == 3
    for name in ("floor", "system"):
        low, high = peaks["range_mb"][name]
        assert low <= memory.mb(peaks[name]) <= high
    record = common.measured(None, {}, lambda: None, lambda: None,
                             {"repeats": 1, "budget_s": 0.0}, 1.0, lambda: peaks)
    assert record["peak_ratio"] == peaks["system"] / float(peaks["floor"])
    assert record["peak_range_mb"] == peaks["range_mb"] and record["peak_sessions"] == 3


def test_peak_from_step_stats_orders_by_time():
    # A hand-written StepStats: 100 bytes then 50 alive together (150), then
    # both freed and 120 allocated: peak 150, not the 270 of all allocations
    # and not the last value.
    from tensorflow.core.framework import step_stats_pb2
    stats = step_stats_pb2.StepStats()
    node = stats.dev_stats.add().node_stats.add()
    mem = node.memory.add(allocator_name="cpu")
    for micros, nbytes in [(1, 100), (2, 50), (3, -100), (3, -50), (4, 120)]:
        mem.allocation_records.add(alloc_micros=micros, alloc_bytes=nbytes)
    assert memory.peak_from_step_stats(stats) == (150, {"cpu": 150})


def test_zoo_page_shows_memory_beside_time(tmp_path):
    """zoo.md: the harness's page of the zoo's records (no loop reference):
    a time and a memory table per task, the DP step's over its Adam step,
    and the plans' forms."""
    from benchmarks import report
    rec = dict(model="mnist_deep", batch_size=64, system="custagg_auto", status="ok", note="",
               check="n/a", framework="tf", floor_ms=10.0, floor_peak_mb=30.0,
               forms={"rules": 8}, not_rules=[])
    records = [dict(rec, task="norms", median_ms=12.0, ratio_to_floor=1.2, peak_mb=90.0,
                    peak_ratio=3.0),
               dict(rec, task="clip", median_ms=11.0, ratio_to_floor=1.1, peak_mb=33.0,
                    peak_ratio=1.1),
               dict(rec, task="step", floor_ms=20.0, median_ms=30.0, ratio_to_floor=1.5,
                    floor_peak_mb=40.0, peak_mb=60.0, peak_ratio=1.5)]
    path = str(tmp_path / "zoo.md")
    report.write_markdown(path, records, {"cpu": "x", "cores": 2}, "Zoo", "The zoo.")
    text = open(path).read()
    assert text.startswith("# Zoo\n\nThe zoo.\n")
    memory = text.split("## Peak memory, (b) per-example global L2 norms")[1]
    assert "| mnist_deep | 64 | 3.00x (90 / 30) |" in memory
    assert "| mnist_deep | 64 | 1.5x (30 / 20) |" in text.split("## (e)")[1]
    assert "| mnist_deep | rules 8 | - |" in text.split("## Plans")[1]
    assert "## Check failures" not in text        # nothing was checked
