"""Microbatch norms and clipped sums (num_microbatches M < B) against
the obvious reference: one `tf.compat.v1.gradients` of each microbatch's
summed loss.

Microbatch m is examples `m*B/M ... (m+1)*B/M - 1` (TF Privacy's
`tf.reshape(loss, [M, -1])`). Every rule's group form is reached through
the model zoo (dense layers on `[None, D]` and `[None, T, D]`, conv1d,
Conv2D, depthwise, embeddings with ids repeated across a microbatch's
examples, BiasAdd, LayerNorm's broadcast Mul/Add, Einsum/BatchMatMul in
attention, FusedBatchNorm inference, a shared weight and weight decay (cross
terms), batch statistics (pfor fallback)), each graph with a dynamic batch,
at B = 1, 4, 12 and every M dividing B (M = 1 and M = B included), float64
(float32 for FusedBatchNorm). The DP optimizers' M < B step is checked
against TF Privacy's formula in tests/privacy/test_privacy.py and here on the zoo.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import testing
from custagg.privacy import dp_optimizer

from benchmarks import zoo_models as zoo

BATCHES = (1, 4, 12)
MICROBATCHES = (1, 2, 4, 12)
RTOL = {tf.float64: 1e-9, tf.float32: 1e-4}


# The default run: a dense, a convolutional, an embedding and a coupled
# (batch statistics) model; `-m slow` every zoo model.
DEFAULT_ZOO = frozenset(["layers_mlp", "keras_cnn", "keras_embedding_mean",
                         "keras_batch_norm_training"])


def _cases():
    out = []
    for name in zoo.ZOO:
        dtype = tf.float32 if name in zoo.FLOAT32_ONLY else tf.float64
        out.append(pytest.param(name, dtype, id=name, marks=(
            () if name in DEFAULT_ZOO else pytest.mark.slow)))
    return out


def _scale(arrays):
    return max(float(np.max(np.abs(a))) if a.size else 0.0 for a in arrays)


@pytest.mark.skipif(not zoo.has_keras_layers(),
                    reason="tf.compat.v1.layers / Keras 2 layers need the "
                           "tf-keras package on this TensorFlow")
@pytest.mark.parametrize("name, dtype", _cases())
def test_zoo_microbatches_match_per_microbatch_gradients(name, dtype):
    rng = np.random.default_rng(sum(map(ord, name)) + 5)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(3)
        model = zoo.ZOO[name](dtype, rng)
        loss, xs = model.loss, model.xs
        assert loss.shape.as_list() == [None]
        clip = tf.compat.v1.placeholder(loss.dtype, [])
        got = {m: {"norms": custagg.per_example_norms(
                       loss, xs, num_microbatches=m),
                   "clipped": custagg.clipped_gradients(
                       loss, xs, clip, return_norms=True,
                       num_microbatches=m)}
               for m in MICROBATCHES}
        refs = {(b, m): testing.loop_per_example(loss, xs, b, m)
                for b in BATCHES for m in MICROBATCHES if b % m == 0}
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for (b, m), ref in sorted(refs.items()):
                feed = model.feed(rng, b)
                feed[clip] = 1.0
                values = sess.run({"ref": ref, "got": got[m]}, feed)
                per_unit = values["ref"]
                norms = testing.numpy_norms(per_unit)
                label = "%s B=%d M=%d" % (name, b, m)
                testing.assert_close(values["got"]["norms"], norms,
                                     RTOL[dtype], label + " norms")
                # Clip about half the microbatches: the median norm.
                feed[clip] = float(np.median(norms))
                values = sess.run({"ref": ref, "got": got[m]}, feed)
                per_unit = values["ref"]
                sums, norms = testing.numpy_clipped(per_unit, feed[clip])
                clipped, clip_norms = values["got"]["clipped"]
                testing.assert_close(clip_norms, norms, RTOL[dtype],
                                     label + " clip norms")
                for j, s in enumerate(sums):
                    testing.assert_close(clipped[j], s, RTOL[dtype],
                                         "%s clipped[%d]" % (label, j),
                                         _scale(sums))


def _mlp(batch, d, k, dtype=tf.float64, seed=0):
    rng = np.random.default_rng(seed)
    x = tf.compat.v1.placeholder(dtype, [batch, d])
    y = tf.compat.v1.placeholder(tf.int32, [batch])
    w1 = tf.Variable(rng.normal(size=[d, k]) / np.sqrt(d), dtype=dtype)
    b1 = tf.Variable(rng.normal(size=[k]) * 0.1, dtype=dtype)
    w2 = tf.Variable(rng.normal(size=[k, 3]) / np.sqrt(k), dtype=dtype)
    h = tf.nn.relu(tf.matmul(x, w1) + b1)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.matmul(h, w2))

    def feed(b):
        return {x: rng.normal(size=[b, d]), y: rng.integers(0, 3, b)}
    return loss, [w1, b1, w2], feed


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("strategy", ["auto", "rules", "pfor", "loop"])
def test_dense_group_forms_every_strategy_and_both_gram_choices(
        static, strategy, sess):
    """D = K = 16 at B = 12: M = 4 (3 examples a microbatch) takes the Gram
    form, M = 1 (12) the materialized [M, D, K]; with a dynamic batch the
    choice is made at run time (tf.cond), with a static one in the graph.
    Per-variable clip norms too."""
    batch = 12
    loss, xs, feed_fn = _mlp(batch if static else None, 16, 16)
    clips = [0.3, 0.2, 0.5]
    fetch, refs = {}, {}
    for m in (1, 2, 4, 12):
        fetch[m] = (custagg.per_example_norms(loss, xs, strategy,
                                              num_microbatches=m),
                    custagg.clipped_gradients(loss, xs, clips, strategy,
                                              return_norms=True,
                                              num_microbatches=m))
        refs[m] = testing.loop_per_example(loss, xs, batch, m)
    sess.run(tf.compat.v1.global_variables_initializer())
    values = sess.run({"got": fetch, "ref": refs}, feed_fn(batch))
    for m in fetch:
        per_unit = values["ref"][m]
        norms, (clipped, per_x_norms) = values["got"][m]
        testing.assert_close(norms, testing.numpy_norms(per_unit), 1e-9,
                             "M=%d norms" % m)
        sums, ref_norms = testing.numpy_clipped(per_unit, clips, per_x=True)
        for j in range(3):
            testing.assert_close(per_x_norms[j], ref_norms[j], 1e-9,
                                 "M=%d norms[%d]" % (m, j))
            testing.assert_close(clipped[j], sums[j], 1e-9,
                                 "M=%d clipped[%d]" % (m, j))


def test_dense_group_norms_do_not_materialize(graph):
    """A [None, 784] x [784, 512] layer with M = 128: no [M, 784, 512] (or
    [B, 784, 512]) tensor outside the run-time branch that wins only for
    large microbatches."""
    loss, xs, _ = _mlp(None, 784, 512)
    custagg.clipped_gradients(loss, xs, 1.0, num_microbatches=128)
    for op in graph.get_operations():
        if "cond" in op.name:
            continue
        for t in op.outputs:
            shape = t.shape
            if shape.rank == 3 and shape.as_list()[1:] == [784, 512]:
                raise AssertionError("materialized: %s %s" % (op.name, shape))


def test_microbatches_must_divide_the_batch(sess):
    loss, xs, feed_fn = _mlp(None, 4, 4)
    with pytest.raises(ValueError, match="positive Python int"):
        custagg.per_example_norms(loss, xs, num_microbatches=0)
    norms = custagg.per_example_norms(loss, xs, num_microbatches=4)
    sess.run(tf.compat.v1.global_variables_initializer())
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="must divide the batch size"):
        sess.run(norms, feed_fn(6))
    static_loss, static_xs, _ = _mlp(6, 4, 4)
    with pytest.raises(ValueError, match="does not divide"):
        custagg.clipped_gradients(static_loss, static_xs, 1.0,
                                  num_microbatches=4)


@pytest.mark.parametrize("m", [1, 3, 4, 12])
def test_dp_optimizer_microbatch_step_is_tf_privacy_s(m, sess):
    """noise 0: the update is -lr/M sum_m clip(g_m), g_m the gradient of
    microbatch m's mean loss; checked on the embedding + conv zoo model with
    a dynamic batch."""
    rng = np.random.default_rng(m)
    model = zoo.ZOO["layers_text_cnn"](tf.float64, rng)
    loss, xs = model.loss, model.xs
    # 1/16: exact in float32 (the query keeps the clip as given).
    batch, lr, clip = 12, 0.5, 0.5
    opt = dp_optimizer.DPGradientDescentGaussianOptimizer(
        l2_norm_clip=clip, noise_multiplier=0.0, num_microbatches=m,
        learning_rate=lr)
    grads_and_vars = opt.compute_gradients(loss, var_list=xs)
    k = batch // m
    # TF Privacy's microbatch loss is the mean over the microbatch.
    ref = testing.loop_per_example(loss / k, xs, batch, m)
    sess.run(tf.compat.v1.global_variables_initializer())
    feed = model.feed(rng, batch)
    got, ref_v = sess.run([[tf.convert_to_tensor(g)
                            for g, _ in grads_and_vars], ref], feed)
    per_unit = ref_v
    sums, norms = testing.numpy_clipped(per_unit, clip)
    assert (norms > clip).any()          # some microbatch is clipped
    for j, s in enumerate(sums):
        testing.assert_close(got[j], s / m, 1e-9, "grad[%d]" % j)


@pytest.mark.parametrize("static", [True, False])
def test_batch_matmul_einsum_and_broadcast_group_forms(static, sess):
    """Rules the zoo reaches only in passing, strategy="rules" (no
    fallback): BatchMatMulV2 `[B, T, D] x [D, K]`, a two-operand Einsum with
    the parameter on the left, a broadcast Mul and Sub; B = 12 and M = 1, 3,
    4, 12 (T = 5: (B/M) T is 60, 20, 15, 5 terms a microbatch, both sides
    of the Gram/materialize choice for D = 6, K = 7)."""
    rng = np.random.default_rng(11)
    batch, t, d, k = 12, 5, 6, 7
    x = tf.compat.v1.placeholder(tf.float64, [batch if static else None, t, d])
    w = tf.Variable(rng.normal(size=[d, k]), dtype=tf.float64)
    v = tf.Variable(rng.normal(size=[k, k]), dtype=tf.float64)
    scale = tf.Variable(rng.normal(size=[k]), dtype=tf.float64)
    shift = tf.Variable(rng.normal(size=[1, 1, k]), dtype=tf.float64)
    h = tf.tanh(tf.matmul(x, w))                          # BatchMatMulV2
    h = tf.einsum("jk,btk->btj", v, h)                    # Einsum, param left
    h = h * scale - shift                                 # Mul, Sub
    loss = tf.reduce_sum(tf.sin(h), axis=[1, 2])
    xs = [w, v, scale, shift]
    types = {op.type for op in tf.compat.v1.get_default_graph().get_operations()}
    assert {"BatchMatMulV2", "Einsum", "Mul", "Sub"} <= types
    fetch, refs = {}, {}
    clip = tf.compat.v1.placeholder(tf.float64, [])
    for m in (1, 3, 4, 12):
        fetch[m] = custagg.clipped_gradients(loss, xs, clip, "rules",
                                             return_norms=True,
                                             num_microbatches=m)
        refs[m] = testing.loop_per_example(loss, xs, batch, m)
    sess.run(tf.compat.v1.global_variables_initializer())
    feed = {x: rng.normal(size=[batch, t, d]), clip: 1.0}
    ref_v = sess.run(refs, feed)
    for m in fetch:
        per_unit = ref_v[m]
        feed[clip] = float(np.median(testing.numpy_norms(per_unit)))
        clipped, norms = sess.run(fetch[m], feed)
        sums, ref_norms = testing.numpy_clipped(per_unit, feed[clip])
        testing.assert_close(norms, ref_norms, 1e-9, "M=%d norms" % m)
        for j, s in enumerate(sums):
            testing.assert_close(clipped[j], s, 1e-9, "M=%d clipped[%d]"
                                 % (m, j))


def test_rnn_in_a_while_loop_falls_back_and_matches(sess):
    """A tf.compat.v1.nn.dynamic_rnn LSTM (weights inside a while loop: the
    materializing fallback) next to a dense head (rules): microbatch norms
    and clipped sums at B = 6, M = 1, 2, 3, 6."""
    rng = np.random.default_rng(2)
    x = tf.compat.v1.placeholder(tf.float64, [None, 4, 3])
    y = tf.compat.v1.placeholder(tf.int32, [None])
    cell = tf.compat.v1.nn.rnn_cell.LSTMCell(5, dtype=tf.float64)
    _, state = tf.compat.v1.nn.dynamic_rnn(cell, x, dtype=tf.float64)
    w = tf.Variable(rng.normal(size=[5, 2]), dtype=tf.float64)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.matmul(state.h, w))
    xs = cell.trainable_weights + [w]
    fetch = {m: custagg.clipped_gradients(loss, xs, 0.2, return_norms=True,
                                          num_microbatches=m)
             for m in (1, 2, 3, 6)}
    refs = {m: testing.loop_per_example(loss, xs, 6, m) for m in fetch}
    sess.run(tf.compat.v1.global_variables_initializer())
    values = sess.run({"got": fetch, "ref": refs},
                      {x: rng.normal(size=[6, 4, 3]),
                       y: rng.integers(0, 2, 6)})
    for m in fetch:
        per_unit = values["ref"][m]
        sums, norms = testing.numpy_clipped(per_unit, 0.2)
        clipped, got_norms = values["got"][m]
        testing.assert_close(got_norms, norms, 1e-9, "M=%d norms" % m)
        for j, s in enumerate(sums):
            testing.assert_close(clipped[j], s, 1e-9, "M=%d clipped[%d]"
                                 % (m, j))
