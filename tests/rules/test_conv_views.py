"""Transposed, space-to-batch (dilated) and 3-D convolutions on rules
(issue 34): `rules/conv_views.py` and `rules/conv3d.py`.

Each case is a layer written as TF1 code writes it (`tf.compat.v1.layers`,
`tf.nn.atrous_conv2d`, `tf.nn.convolution`, `tf.compat.v1.nn.conv2d_transpose`,
Keras' causal dilated Conv1D) on a `[None, 9, 9, 3]` placeholder (a dynamic
batch), a per-example head, and the loop reference (`custagg.testing`) on
the same graph at B in {1, 3, 7} (`-m slow`: 32, 33). Checked: the plan puts
every variable on rules, and per-example gradients, norms and clipped sums
(at a clip norm that clips some examples) agree, float64 to 1e-9 and
float32 to 1e-4. NCHW cases run where this CPU's kernels take NCHW
convolutions (oneDNN). A last test forces the conv rules' chunks to 2
examples, so the clipped sums' joint chunk loop slices the views.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import testing
from custagg.rules import conv
from custagg.rules import conv2d
from custagg.rules import conv_views

tf1 = tf.compat.v1
SIDE, CHANNELS = 9, 3


def _var(name, shape):
    return tf1.get_variable(name, shape)


def _nchw(fn):
    """`fn` on the NCHW image, its output back to NHWC."""
    return lambda x: tf.transpose(fn(tf.transpose(x, [0, 3, 1, 2])),
                                  [0, 2, 3, 1])


CASES = {
    # Transposed convolutions: Conv2DBackpropInput with the filter a weight.
    "transpose_stride2_same": lambda x: tf1.layers.conv2d_transpose(
        x, 4, 3, strides=2, padding="same"),
    "transpose_valid": lambda x: tf1.layers.conv2d_transpose(
        x, 2, (3, 2), padding="valid"),
    "transpose_stride_2x3_valid": lambda x: tf1.layers.conv2d_transpose(
        x, 5, 4, strides=(2, 3), padding="valid", use_bias=False),
    "nn_conv2d_transpose": lambda x: tf1.nn.conv2d_transpose(
        x, _var("w", [5, 5, 6, CHANNELS]),
        tf.stack([tf.shape(x)[0], 2 * SIDE, 2 * SIDE, 6]), [1, 2, 2, 1],
        "SAME"),
    "transpose_nchw": _nchw(lambda x: tf1.layers.conv2d_transpose(
        x, 4, 3, strides=2, padding="same", data_format="channels_first")),
    # Dilated convolutions through SpaceToBatchND / BatchToSpaceND.
    "atrous_same": lambda x: tf.nn.atrous_conv2d(
        x, _var("w", [3, 3, CHANNELS, 4]), 2, "SAME"),
    "atrous_valid": lambda x: tf.nn.atrous_conv2d(
        x, _var("w", [2, 3, CHANNELS, 4]), 3, "VALID"),
    "layers_conv2d_dilated": lambda x: tf1.layers.conv2d(
        x, 4, 3, dilation_rate=2, padding="same"),
    "layers_conv2d_dilation_3x2": lambda x: tf1.layers.conv2d(
        x, 4, (3, 2), dilation_rate=(3, 2)),
    "nn_convolution_dilated": lambda x: tf.nn.convolution(
        x, _var("w", [3, 3, CHANNELS, 2]), padding="SAME", dilations=2),
    "nn_convolution_dilated_nchw": _nchw(lambda x: tf.nn.convolution(
        x, _var("w", [3, 3, CHANNELS, 2]), padding="SAME", dilations=2,
        data_format="NCHW")),
    "conv1d_dilated": lambda x: tf1.layers.conv1d(
        tf.reshape(x, [-1, SIDE, SIDE * CHANNELS]), 4, 3, dilation_rate=2),
    "separable_dilated": lambda x: tf1.layers.separable_conv2d(
        x, 4, 3, dilation_rate=2),
    # 3-D convolutions.
    "conv3d_same": lambda x: tf1.layers.conv3d(
        tf.reshape(x, [-1, SIDE, SIDE, CHANNELS, 1]), 4, (3, 2, 2),
        padding="same"),
    "conv3d_strided": lambda x: tf1.layers.conv3d(
        tf.reshape(x, [-1, SIDE, SIDE, CHANNELS, 1]), 2, (3, 3, 1),
        strides=(2, 1, 1)),
}


def _causal(x, dtype):
    """Keras' dilated causal Conv1D (WaveNet / TCN code)."""
    layer = tf.keras.layers.Conv1D(4, 3, dilation_rate=2, padding="causal",
                                   dtype=dtype)
    return layer(tf.reshape(x, [-1, SIDE, SIDE * CHANNELS]))


def _model(name, dtype):
    """(x placeholder, [B] loss, xs) of case `name` in the default graph."""
    x = tf1.placeholder(dtype, [None, SIDE, SIDE, CHANNELS])
    with tf1.variable_scope("m", dtype=dtype,
                            initializer=tf1.glorot_uniform_initializer(
                                seed=sum(map(ord, name)))):
        z = _causal(x, dtype) if name == "keras_causal_dilated" else \
            CASES[name](x)
        flat = tf1.layers.flatten(z)
        loss = tf.reduce_sum(tf.sin(flat) * tf.cos(0.5 + flat), axis=1)
    return x, loss, tf1.trainable_variables()


def _nchw_runs(dtype):
    """Whether this CPU's kernels run an NCHW Conv2D and its filter gradient
    in `dtype` (oneDNN's float32 ones do; TF's own take NHWC only)."""
    try:
        with tf.Graph().as_default():
            x = tf.zeros([1, 2, 4, 4], dtype)
            f = tf.zeros([1, 1, 2, 2], dtype)
            z = tf.nn.conv2d(x, f, 1, "SAME", data_format="NCHW")
            with tf1.Session() as sess:
                sess.run(tf.gradients(tf.reduce_sum(z), [f]))
        return True
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError):
        return False


def _check(name, dtype, batches):
    if name.endswith("nchw") and not _nchw_runs(dtype):
        pytest.skip("this CPU's %s Conv2D kernels take no NCHW" % dtype.name)
    graph = tf.Graph()
    with graph.as_default():
        x, loss, xs = _model(name, dtype)
        plan = custagg.plan_per_example(loss, xs)
        assert all(a.form == "rules" for a in plan.assignments), str(plan)
        clip = tf1.placeholder(dtype, [])
        per_example = custagg.per_example_gradients(loss, xs)
        norms = custagg.per_example_norms(loss, xs)
        clipped = custagg.clipped_gradients(loss, xs, clip)
        refs = {b: testing.loop_per_example(loss, xs, batch=b)
                for b in batches}
        rtol = 1e-9 if dtype == tf.float64 else 1e-4
        rng = np.random.RandomState(len(name))
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            for batch, ref in refs.items():
                feed = {x: rng.randn(batch, SIDE, SIDE, CHANNELS)}
                want = sess.run(ref, feed)
                want_norms = testing.numpy_norms(want)
                feed[clip] = 0.7 * float(np.median(want_norms))
                want_clipped = testing.numpy_clipped(want, feed[clip])[0]
                got, got_norms, got_clipped = sess.run(
                    [per_example, norms, clipped], feed)
                label = "%s B=%d" % (name, batch)
                testing.assert_close(got_norms, want_norms, rtol,
                                     label + " norms")
                for j in range(len(xs)):
                    testing.assert_close(got[j], want[j], rtol,
                                         "%s per-example x%d" % (label, j))
                    testing.assert_close(got_clipped[j], want_clipped[j],
                                         rtol, "%s clipped x%d" % (label, j))


NAMES = sorted(CASES) + ["keras_causal_dilated"]


@pytest.mark.parametrize("dtype", [tf.float64, tf.float32],
                         ids=lambda d: d.name)
@pytest.mark.parametrize("name", NAMES)
def test_view_rules_match_loop(name, dtype):
    _check(name, dtype, (1, 3, 7))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_view_rules_match_loop_large(name):
    _check(name, tf.float64, (32, 33))


@pytest.mark.parametrize("dtype", [tf.float64, tf.float32],
                         ids=lambda d: d.name)
@pytest.mark.parametrize("name", ["transpose_stride2_same", "atrous_same",
                                  "conv1d_dilated"])
def test_views_in_small_chunks(name, dtype, monkeypatch):
    """Chunks of 2 examples: the norms' loops and the clipped sums' joint
    loop (every convolution in it) slice the views, built once before the
    loops."""
    monkeypatch.setattr(conv2d.Conv2DRule, "_chunk_size",
                        lambda self, ctx: 2)
    monkeypatch.setattr(conv2d.Conv2DRule, "_CHUNK_CLIP_MIN_POSITIONS", 0)
    _check(name, dtype, (1, 5))


def test_space_to_batch_rows_found_through_conv1d_squeeze(graph):
    """conv1d's Squeeze between the Conv2D and the BatchToSpaceND keeps the
    rows; another consumer of the Conv2D's output (a second use of its
    rows) makes it not a space-to-batch convolution."""
    x = tf1.placeholder(tf.float32, [None, 10, 3])
    z = tf1.layers.conv1d(x, 2, 3, dilation_rate=2)
    op = [o for o in graph.get_operations() if o.type == "Conv2D"][0]
    found = conv_views.batch_to_space(op)
    assert found is not None and found[1] == 2
    assert found[0].outputs[0] is not z
    tf.reduce_sum(op.outputs[0])
    assert conv_views.batch_to_space(op) is None


@pytest.mark.parametrize("name", ["transpose_stride2_same", "atrous_same"])
def test_views_join_the_clipped_sums_chunk_loop(name, monkeypatch):
    """With the positions bound off, a view's share of the clipped sum comes
    from the joint chunk loop (its static shapes let the rule decide)."""
    monkeypatch.setattr(conv2d.Conv2DRule, "_CHUNK_CLIP_MIN_POSITIONS", 0)
    graph = tf.Graph()
    with graph.as_default():
        _, loss, xs = _model(name, tf.float32)
        custagg.clipped_gradients(loss, xs, 1.0)
        assert any("clipped_chunks" in op.name
                   for op in graph.get_operations())


def test_space_to_batch_rows_skip_readers_of_the_shape_only(graph):
    """A reader of the Conv2D's output that reads only its shape (a
    `zeros_like`, as backward passes add for outputs without a gradient, or
    a `tf.shape`) is no second use of its rows (`op_kinds.SHAPE_ONLY`, the
    one set `_tf_compat.value_consumers` reads: conv_views' own set lacked
    `ZerosLike` and `OnesLike`, so the view was refused there)."""
    x = tf1.placeholder(tf.float32, [None, 10, 3])
    tf1.layers.conv1d(x, 2, 3, dilation_rate=2)
    op = [o for o in graph.get_operations() if o.type == "Conv2D"][0]
    tf.shape(op.outputs[0])
    tf.zeros_like(op.outputs[0])
    tf.ones_like(op.outputs[0])
    found = conv_views.batch_to_space(op)
    assert found is not None and found[1] == 2
