"""TF Privacy's Keras fast gradient clipping (TF Privacy 0.9, TF 2.15).

Runs in a TF 2.15 interpreter of its own (benchmarks/peers_env.sh; `--python
keras=PATH`), on the harness's models rebuilt as functional Keras 2 models
with the same weights. The clipped sum as TF Privacy's `DPModel.train_step`
computes it (`clip_grads.compute_clipped_gradients_and_outputs`, with the
registry functions it ships added, `_registry`); the DP step adds
`add_aggregate_noise`. A layer outside the registry (Conv2D, LSTM, GRU)
makes TF Privacy raise; the record keeps its error. The floor:
tf.compat.v1.gradients of the same model's summed loss, in one Session.
"""
import time
from importlib import metadata

import numpy as np

from benchmarks import common, models


def _build(tf, model):
    """(keras model, {TF name: variable}, inputs) of `models.forward` on
    Keras 2 layers (`Layers`)."""
    shape, dtype = models.input_spec(model)
    ops = Layers(tf, models.init_params(model), tf.keras.Input(shape, dtype=dtype, name="x"))
    net = tf.keras.Model(ops.inputs, models.forward(ops, model, ops.inputs[0]))
    net.compile(loss=_loss(tf, "sum"))
    return net, ops.variables, ops.inputs


class Layers(models.Ops):
    """`models.forward` on Keras tensors: a Keras layer per weight (the
    transformer's q, k, v bias-free Dense layers, its positions an Embedding
    of a position-ids input), TF ops between them; `variables`: {TF name:
    variable}."""

    def __init__(self, tf, p, x):
        super().__init__(p)
        self.tf, self.keras, self.inputs, self.variables = tf, tf.keras, [x], {}
        self.relu, self.sigmoid, self.tanh, self.einsum = (tf.nn.relu, tf.sigmoid, tf.tanh,
                                                           tf.einsum)
        self.softmax, self.reshape, self.images = tf.nn.softmax, tf.reshape, lambda x: x
        self.mean = lambda h, axis, keepdims=False: tf.reduce_mean(h, axis, keepdims=keepdims)
        self.max_pool = lambda h: tf.keras.layers.MaxPool2D(2)(h)
        self.flatten = lambda h: tf.keras.layers.Flatten()(h)

    def _const(self, name):
        return self.keras.initializers.Constant(self.p[name])

    def _apply(self, layer, h, names):
        out = layer(h)
        self.variables.update(zip(names, layer.trainable_variables))
        return out

    def dense(self, h, w, b=None):
        return self._apply(self.keras.layers.Dense(
            self.p[w].shape[1], use_bias=b is not None, kernel_initializer=self._const(w),
            bias_initializer=self._const(b) if b else "zeros"), h, (w, b))

    def conv(self, h, w, b):
        return self._apply(self.keras.layers.Conv2D(
            self.p[w].shape[3], self.p[w].shape[0], padding="same",
            kernel_initializer=self._const(w), bias_initializer=self._const(b)), h, (w, b))

    def embed(self, ids, table):
        return self._apply(self.keras.layers.Embedding(
            *self.p[table].shape, embeddings_initializer=self._const(table)), ids, (table,))

    def layer_norm(self, h, g, b):
        return self._apply(self.keras.layers.LayerNormalization(
            epsilon=models.LN_EPS, gamma_initializer=self._const(g),
            beta_initializer=self._const(b)), h, (g, b))

    def add_param(self, h, name):
        positions = self.keras.Input(self.p[name].shape[:1], dtype="int32", name="positions")
        self.inputs.append(positions)
        return self.keras.layers.Add()([h, self.embed(positions, name)])

    def scan(self, model, x):
        layers, p, d = self.keras.layers, self.p, models.LSTM_IN
        if model == "lstm":         # [x, h] @ kernel == x @ kernel[:D] + h @ kernel[D:]
            rnn = layers.LSTM(models.LSTM_HIDDEN, unit_forget_bias=False,
                              kernel_initializer=self.keras.initializers.Constant(p["kernel"][:d]),
                              recurrent_initializer=self.keras.initializers.Constant(
                                  p["kernel"][d:]), bias_initializer=self._const("bias"))
        elif model == "gru":        # reset_after: the recurrent bias is zero
            bias = np.stack([p["bias"], np.zeros_like(p["bias"])])
            rnn = layers.GRU(models.LSTM_HIDDEN, kernel_initializer=self._const("kernel"),
                             recurrent_initializer=self._const("recurrent"),
                             bias_initializer=self.keras.initializers.Constant(bias))
        else:
            raise ValueError("tfp_fast has no Keras form of %r" % model)
        return rnn(x)               # TF Privacy refuses the layer before any number


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
    with common.session(graph, cfg.get("threads", 0)) as sess:
        sess.run(init)
        sess.run(floor, feed)
        first_run_ms = common.timed_ms(lambda: sess.run(fetch, feed))
        return common.measured(
            sig, sess.run(check, {**feed, noise: 0.0}), lambda: sess.run(fetch, feed),
            lambda: sess.run(floor, feed), cfg, first_run_ms,
            lambda: common.tf_peaks(graph, init, feed, {"floor": floor, "system": fetch},
                                    cfg.get("threads", 0)), build_s=build_s,
            floor_system="tf.compat.v1.gradients(sum(loss)) of the Keras model",
            framework_version="tensorflow %s, tensorflow-privacy %s" % (
                tf.__version__, metadata.version("tensorflow-privacy")))
