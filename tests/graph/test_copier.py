"""The `Copier` (custagg.graph.copier): what a copy job knows lives on its
object, so one job cannot change what another builds."""

import numpy as np
import pytest
import tensorflow as tf

from custagg.graph import copier


def _reserve(graph):
    """A TensorListReserve for rows of an unknown leading axis ([-1, 3])."""
    with graph.as_default():
        n = tf.compat.v1.placeholder(tf.int32, [])
        made = tf.raw_ops.TensorListReserve(
            element_shape=tf.constant([-1, 3]), num_elements=n,
            element_dtype=tf.float32)
    return made.op


def _element_shape(copied):
    return tf.get_static_value(copied[0].op.inputs[0]).tolist()


def test_one_row_is_the_copiers_own():
    graph = tf.Graph()
    op = _reserve(graph)
    with graph.as_default():
        one = copier.Copier(one_row=True)
        whole = copier.Copier(one_row=False, hooks={op: object()})
        # Interleaved jobs: each builds what its own object says.
        assert _element_shape(one.copy_op(op, {})) == [1, 3]
        assert _element_shape(whole.copy_op(op, {})) == [-1, 3]
        assert _element_shape(one.copy_op(op, {})) == [1, 3]
        # A fresh copier is a one-example copy, whatever came before.
        assert _element_shape(copier.Copier().copy_op(op, {})) == [1, 3]
    assert one.hooks == {} and list(whole.hooks) == [op]


def test_hooks_are_copied_not_shared():
    hooks = {"loop": object()}
    job = copier.Copier(one_row=False, hooks=hooks)
    hooks["other"] = object()
    assert list(job.hooks) == ["loop"]


def test_copy_op_maps_inputs_and_keeps_the_rest():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float64, [None, 2])
        w = tf.constant([[1.0], [2.0]], tf.float64)
        z = tf.matmul(x, w)
        row = tf.constant([[3.0, 4.0]], tf.float64)
        out, = copier.Copier().copy_op(z.op, {x.ref(): row})
        with tf.compat.v1.Session() as sess:
            np.testing.assert_allclose(sess.run(out), [[11.0]])


def test_a_v1_cond_frame_is_refused_with_the_op():
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.disable_control_flow_v2()
        try:
            x = tf.compat.v1.placeholder(tf.float32, [None])
            y = tf.compat.v1.cond(tf.reduce_sum(x) > 0, lambda: x * 2.0,
                                  lambda: x)
        finally:
            tf.compat.v1.enable_control_flow_v2()
        inside = [op for op in graph.get_operations()
                  if op.type == "Mul"]
        with pytest.raises(copier.CannotCopy, match="v1 control-flow") as e:
            copier.Copier().copy_ops(inside, {})
        assert e.value.op is inside[0]
        del y


@pytest.mark.parametrize("layer", ["conv2d", "depthwise"])
@pytest.mark.parametrize("batch", [1, 5])
def test_explicit_padding_is_copied_as_a_pad(layer, batch):
    """A convolution with EXPLICIT padding, in a graph whose examples
    interact after it (a roll along the batch), under strategy='pfor': the
    copies of the forward pass (then their run-time check fails and the
    exact form runs) used to raise at run time: pfor's while-loop fallback
    for Conv2DBackpropFilter drops `explicit_paddings`. The copier now
    writes the padding as a tf.pad before a VALID convolution. Found by
    the randomized per-example models (seed 140266)."""
    import per_example_reference as ref
    rng = np.random.RandomState(batch)
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float64, [None, 4, 4, 2])
        f = tf.Variable(rng.normal(size=(2, 2, 2, 2)))
        pads = [[0, 0], [1, 0], [0, 2], [0, 0]]
        if layer == "conv2d":
            z = tf.nn.conv2d(x, f, 1, pads)
        else:
            z = tf.raw_ops.DepthwiseConv2dNative(
                input=x, filter=f, strides=[1, 1, 1, 1], padding="EXPLICIT",
                explicit_paddings=sum(pads, []))
        h = tf.reshape(z, [-1, int(np.prod(z.shape.as_list()[1:]))])
        h = h + 0.5 * tf.roll(h, 1, axis=0)
        loss = tf.reduce_sum(tf.square(h), 1)
        built, weights = ref.build_functions(
            loss, [f], "pfor", ("per_example_norms", "clipped_gradients"))
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            why = ref.check(sess, loss, [f], {x: rng.normal(
                size=(batch, 4, 4, 2))}, built, weights, rtol=1e-9)
    assert why is None, why
