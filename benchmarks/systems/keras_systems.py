"""TF Privacy's Keras fast gradient clipping (TF Privacy 0.9, TF 2.15).

Runs in a TF 2.15 interpreter of its own (benchmarks/peers_env.sh; pass it
as `--python keras=PATH`). The harness's models are rebuilt as functional
Keras 2 models on the same weights (`models.init_params`, TF layout), and
`clip_grads.compute_clipped_gradients_and_outputs` computes the clipped sum
as TF Privacy's `DPModel.train_step` does: per-example norms from its layer
registry (Gram / "ghost" norms for Dense, Embedding; the per-example forms
it ships for LayerNormalization, EinsumDense and MultiHeadAttention added
here), then one backward pass of the clip-weighted loss. The DP step adds
`gradient_clipping_utils.add_aggregate_noise`. A layer outside the registry
(Conv2D, LSTM, GRU) makes TF Privacy raise; the record keeps its error.

The graph is a tf.compat.v1 graph run in a Session (what a tf.function
traces, minus the function call), so the step's peak memory comes from
TF's allocation records, as for the TF systems (benchmarks/memory.py).
The floor: tf.compat.v1.gradients of the summed loss of the same model.

The transformer block's attention projections are Dense layers (the
model's q, k, v have no bias, which Keras's MultiHeadAttention would
add), its positional embedding an Embedding of a position-ids input.
"""
import time

import numpy as np

from benchmarks import common, memory, models


def _build(tf, model):
    """(keras model, {TF name: variable}, inputs, extra feed) for `model`."""
    keras, layers = tf.keras, tf.keras.layers
    p = models.init_params(model)

    def const(name):
        return keras.initializers.Constant(p[name])

    def dense(units, w, b=None, act=None):
        return layers.Dense(units, activation=act, use_bias=b is not None,
                            kernel_initializer=const(w),
                            bias_initializer=const(b) if b else "zeros")

    shape, dtype = models.input_spec(model)
    x = keras.Input(shape, dtype=dtype, name="x")
    inputs = [x]
    if model == "mlp":
        h = dense(256, "w1", "b1", "relu")(x)
        h = dense(256, "w2", "b2", "relu")(h)
        out = dense(10, "w3", "b3")(h)
        named = ("w1", "b1", "w2", "b2", "w3", "b3")
    elif model == "cnn":
        h = x
        for i, filters in ((1, 16), (2, 32)):
            h = layers.Conv2D(filters, 5, padding="same", activation="relu",
                              kernel_initializer=const("conv%d_w" % i),
                              bias_initializer=const("conv%d_b" % i))(h)
            h = layers.MaxPool2D(2)(h)
        out = dense(10, "dense_w", "dense_b")(layers.Flatten()(h))
        named = ("conv1_w", "conv1_b", "conv2_w", "conv2_b", "dense_w", "dense_b")
    elif model == "text":
        e = layers.Embedding(models.TEXT_VOCAB, models.TEXT_DIM,
                             embeddings_initializer=const("emb"))(x)
        out = dense(10, "dense_w", "dense_b")(layers.GlobalAveragePooling1D()(e))
        named = ("emb", "dense_w", "dense_b")
    elif model in ("lstm", "gru"):
        hid, d = models.LSTM_HIDDEN, models.LSTM_IN
        if model == "lstm":         # [x, h] @ kernel == x @ kernel[:D] + h @ kernel[D:]
            rnn = layers.LSTM(hid, unit_forget_bias=False,
                              kernel_initializer=keras.initializers.Constant(p["kernel"][:d]),
                              recurrent_initializer=keras.initializers.Constant(
                                  p["kernel"][d:]), bias_initializer=const("bias"))
        else:                       # reset_after: the recurrent bias is zero
            bias = np.stack([p["bias"], np.zeros_like(p["bias"])])
            rnn = layers.GRU(hid, kernel_initializer=const("kernel"),
                             recurrent_initializer=const("recurrent"),
                             bias_initializer=keras.initializers.Constant(bias))
        out = dense(10, "dense_w", "dense_b")(rnn(x))
        named = None                # TF Privacy refuses the layer before any number
    elif model == "transformer":
        pos = keras.Input((models.TR_LEN,), dtype="int32", name="positions")
        inputs.append(pos)
        d, nh, t = models.TR_DIM, models.TR_HEADS, models.TR_LEN
        dh = d // nh
        h = layers.Add()([
            layers.Embedding(models.TR_VOCAB, d, embeddings_initializer=const("tok_emb"))(x),
            layers.Embedding(t, d, embeddings_initializer=const("pos_emb"))(pos)])

        def norm(g, b):
            return layers.LayerNormalization(epsilon=models.LN_EPS, gamma_initializer=const(g),
                                             beta_initializer=const(b))

        a = norm("ln1_g", "ln1_b")(h)
        q, k, v = (layers.Reshape((t, nh, dh))(dense(d, w)(a)) for w in ("wq", "wk", "wv"))

        def attend(qkv):
            q, k, v = qkv
            s = tf.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / np.sqrt(dh))
            return tf.reshape(tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(s, -1), v), [-1, t, d])

        h = layers.Add()([h, dense(d, "wo", "bo")(layers.Lambda(attend)([q, k, v]))])
        m = dense(models.TR_FF, "w1", "b1", "relu")(norm("ln2_g", "ln2_b")(h))
        h = layers.Add()([h, dense(d, "w2", "b2")(m)])
        out = dense(10, "out_w", "out_b")(layers.GlobalAveragePooling1D()(h))
        named = ("tok_emb", "pos_emb", "ln1_g", "ln1_b", "wq", "wk", "wv", "wo", "bo",
                 "ln2_g", "ln2_b", "w1", "b1", "w2", "b2", "out_w", "out_b")
    else:
        raise ValueError("tfp_fast has no Keras form of %r" % model)
    net = keras.Model(inputs, out)
    net.compile(loss=_loss(tf, "sum"))
    variables = dict(zip(named, net.trainable_variables)) if named else {}
    return net, variables, inputs


def _loss(tf, reduction):
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def _registry():
    """TF Privacy's default registry (Dense, Embedding) and the registry
    functions it ships for LayerNormalization, EinsumDense, MultiHeadAttention."""
    import tensorflow as tf
    from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry
    from tensorflow_privacy.privacy.fast_gradient_clipping.registry_functions import (
        einsum_dense, layer_normalization, multi_head_attention)
    registry = layer_registry.make_default_layer_registry()
    registry.insert(tf.keras.layers.LayerNormalization,
                    layer_normalization.layer_normalization_computation)
    registry.insert(tf.keras.layers.EinsumDense, einsum_dense.einsum_layer_computation)
    registry.insert(tf.keras.layers.MultiHeadAttention,
                    multi_head_attention.multi_head_attention_layer_computation)
    return registry


def run(cfg):
    import tensorflow as tf
    from tensorflow_privacy.privacy.fast_gradient_clipping import (clip_grads,
                                                                   gradient_clipping_utils)
    tf.compat.v1.disable_eager_execution()
    model, batch_size, task = cfg["model"], cfg["batch_size"], cfg["task"]
    if task not in ("clip", "dpsgd"):
        return {"status": "skipped", "note": "tfp_fast runs clip and dpsgd only"}
    sig = common.load_signature(cfg["ref_path"])
    clip = float(sig["clip"])
    x_np, y_np = models.make_batch(model, batch_size)
    graph = tf.Graph()
    with graph.as_default():
        net, variables, inputs = _build(tf, model)
        y = tf.compat.v1.placeholder(tf.int32, [None])
        feeds = list(inputs) if len(inputs) > 1 else inputs[0]
        floor = tf.compat.v1.gradients(_loss(tf, "sum")(y, net(feeds)), net.trainable_variables)
        noise = tf.compat.v1.placeholder_with_default(
            tf.constant(common.NOISE_MULTIPLIER, tf.float32), [])
        t0 = time.perf_counter()
        # The peer's own call; a layer outside its registry raises here.
        grads, _, _ = clip_grads.compute_clipped_gradients_and_outputs(
            net, clip, _registry(), feeds, y, clipping_loss=_loss(tf, "sum"))
        if task == "dpsgd":
            grads = gradient_clipping_utils.add_aggregate_noise(
                grads, batch_size, clip, noise, loss_reduction="sum")
        build_s = time.perf_counter() - t0
        fetch = [tf.convert_to_tensor(g) for g in grads]
        check = {"csum/" + n: fetch[net.trainable_variables.index(v)]
                 for n, v in variables.items()}
        init = tf.compat.v1.global_variables_initializer()
    feed = {inputs[0]: x_np, y: y_np}
    if len(inputs) > 1:
        feed[inputs[1]] = np.tile(np.arange(models.TR_LEN, dtype=np.int32), (batch_size, 1))
    from importlib import metadata
    with common.session(graph, cfg.get("threads", 0)) as sess:
        sess.run(init)
        sess.run(floor, feed)
        first_run_ms = common.timed_ms(lambda: sess.run(fetch, feed))
        return common.measured(
            sig, sess.run(check, {**feed, noise: 0.0}), lambda: sess.run(fetch, feed),
            lambda: sess.run(floor, feed), cfg, first_run_ms,
            lambda: (memory.step_peak_bytes(sess, floor, feed)[0],
                     memory.step_peak_bytes(sess, fetch, feed)[0]), build_s=build_s,
            floor_system="tf.compat.v1.gradients(sum(loss)) of the Keras model",
            framework_version="tensorflow %s, tensorflow-privacy %s" % (
                tf.__version__, metadata.version("tensorflow-privacy")))
