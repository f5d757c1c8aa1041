"""Models written the way their authors write them, each with a dynamic batch.

`ZOO`: graphs as users write them (`--zoo`, tests/test_zoo.py); `MODELS`:
issue 24's other people's TF1 models, re-typed in their authors' style;
`DYNAMIC_MODELS`: issue 34's, shapes known only at run time (`--tf1-models`,
tests/per_example/). Synthetic data; each docstring names the code it
comes from.

A builder takes `(dtype, rng, full=False)` (`full`: the benchmark's sizes),
makes its variables and `[None, ...]` placeholders in the default graph and
returns a `Model`: `loss` `[B]` (what the author averages), `xs`,
`feed(rng, batch)` (`dynamic_steps`: `feed(rng, batch, t)`, t a sequence
length) and `coupled`, the variables whose examples truly interact ("auto"
must not use rules for them, "rules" must refuse them). Run `initializer()`
before use.
"""

import collections
import contextlib
import math

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1


class Model(collections.namedtuple("Model", ["loss", "xs", "feed", "coupled", "dynamic_steps"])):

    def __new__(cls, loss, xs, feed, coupled=(), dynamic_steps=False):
        return super(Model, cls).__new__(cls, loss, list(xs), feed,
                                         frozenset(coupled), dynamic_steps)


def _one_hot(rng, batch, classes):
    return np.eye(classes)[rng.integers(0, classes, batch)]


def _classifier_inputs(dtype, shape, classes, vocab=None):
    """A `[None, *shape]` input placeholder (`vocab`: int32 ids), `[None]`
    int32 labels and their `feed(rng, batch)`: normal values (ids in [0,
    vocab)) and labels in [0, classes)."""
    x = tf1.placeholder(tf.int32 if vocab else dtype, [None] + list(shape))
    labels = tf1.placeholder(tf.int32, [None])

    def feed(rng, batch):
        data = (rng.integers(0, vocab, [batch] + list(shape)) if vocab
                else rng.normal(size=[batch] + list(shape)))
        return {x: data, labels: rng.integers(0, classes, batch)}
    return x, labels, feed


@contextlib.contextmanager
def _keras_floatx(dtype):
    """Keras' default float type is `dtype` within the block: Keras 2.12's
    MultiHeadAttention does not pass its `dtype=` on to the EinsumDense
    sublayers it builds at the first call (later releases do)."""
    keras = tf.keras  # Keras 2 (tf-keras) under TF_USE_LEGACY_KERAS=1
    saved = keras.backend.floatx()
    keras.backend.set_floatx(tf.as_dtype(dtype).name)
    try:
        yield
    finally:
        keras.backend.set_floatx(saved)


# TensorFlow's TF1 tutorials, as written


def mnist_softmax(dtype, rng, full=False):
    """tensorflow/examples/tutorials/mnist/mnist_softmax.py."""
    pixels = 784 if full else 64
    x = tf1.placeholder(dtype, [None, pixels])
    W = tf.Variable(0.1 * rng.normal(size=[pixels, 10]), dtype=dtype, name="W")
    b = tf.Variable(tf.zeros([10], dtype), name="b")
    y = tf.matmul(x, W) + b
    y_ = tf1.placeholder(dtype, [None, 10])
    # The tutorial averages this per-example loss.
    loss = tf.nn.softmax_cross_entropy_with_logits(labels=y_, logits=y)

    def feed(rng, batch):
        return {x: rng.normal(size=[batch, pixels]), y_: _one_hot(rng, batch, 10)}
    return Model(loss, [W, b], feed)


def mnist_deep(dtype, rng, full=False):
    """tensorflow/examples/tutorials/mnist/mnist_deep.py (8x8 images)."""
    def weight_variable(shape):
        initial = tf1.truncated_normal(shape, stddev=0.1, dtype=dtype,
                                       seed=int(rng.integers(1 << 30)))
        return tf.Variable(initial)

    def bias_variable(shape):
        return tf.Variable(tf.constant(0.1, dtype, shape=shape))

    def conv2d(x, W):
        return tf.nn.conv2d(x, W, strides=[1, 1, 1, 1], padding="SAME")

    def max_pool_2x2(x):
        return tf.nn.max_pool(x, ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding="SAME")

    side, k, c1, c2, fc = (28, 5, 32, 64, 1024) if full else (8, 3, 4, 8, 16)
    x = tf1.placeholder(dtype, [None, side * side])
    y_ = tf1.placeholder(dtype, [None, 10])
    x_image = tf.reshape(x, [-1, side, side, 1])
    W_conv1 = weight_variable([k, k, 1, c1])
    b_conv1 = bias_variable([c1])
    h_conv1 = tf.nn.relu(conv2d(x_image, W_conv1) + b_conv1)
    h_pool1 = max_pool_2x2(h_conv1)
    W_conv2 = weight_variable([k, k, c1, c2])
    b_conv2 = bias_variable([c2])
    h_conv2 = tf.nn.relu(conv2d(h_pool1, W_conv2) + b_conv2)
    h_pool2 = max_pool_2x2(h_conv2)
    quarter = side // 4
    W_fc1 = weight_variable([quarter * quarter * c2, fc])
    b_fc1 = bias_variable([fc])
    h_pool2_flat = tf.reshape(h_pool2, [-1, quarter * quarter * c2])
    h_fc1 = tf.nn.relu(tf.matmul(h_pool2_flat, W_fc1) + b_fc1)
    keep_prob = tf1.placeholder(dtype)
    h_fc1_drop = tf1.nn.dropout(h_fc1, keep_prob=keep_prob)
    W_fc2 = weight_variable([fc, 10])
    b_fc2 = bias_variable([10])
    y_conv = tf.matmul(h_fc1_drop, W_fc2) + b_fc2
    loss = tf.nn.softmax_cross_entropy_with_logits(labels=y_, logits=y_conv)

    def feed(rng, batch):
        return {x: rng.normal(size=[batch, side * side]),
                y_: _one_hot(rng, batch, 10), keep_prob: 0.5}
    return Model(loss, [W_conv1, b_conv1, W_conv2, b_conv2, W_fc1, b_fc1, W_fc2, b_fc2], feed)


# tf.compat.v1.layers


def _new_variables(fn):
    """Runs `fn`; returns (its result, the trainable variables it made)."""
    before = set(v.ref() for v in tf1.trainable_variables())
    out = fn()
    return out, [v for v in tf1.trainable_variables() if v.ref() not in before]


def _glorot(rng, dtype=tf.float32):
    """Glorot-uniform with a seed drawn from `rng`."""
    return tf1.glorot_uniform_initializer(seed=int(rng.integers(1 << 30)), dtype=dtype)


def layers_mlp(dtype, rng, full=False):
    width, hidden = (784, 256) if full else (12, 16)
    x, labels, feed = _classifier_inputs(dtype, [width], 5)
    init = _glorot(rng)

    def build():
        h = tf1.layers.dense(x, hidden, activation=tf.nn.relu,
                             kernel_initializer=init, name="dense1")
        return tf1.layers.dense(h, 5, kernel_initializer=init, name="dense2")
    logits, xs = _new_variables(build)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    return Model(loss, xs, feed)


def layers_text_cnn(dtype, rng, full=False):
    """Embedding lookup, tf.compat.v1.layers.conv1d, max over time, dense."""
    vocab, dim, steps, filters = (5000, 64, 32, 64) if full else (20, 6, 7, 5)
    ids, labels, feed = _classifier_inputs(dtype, [steps], 3, vocab=vocab)
    init = _glorot(rng)

    def build():
        table = tf1.get_variable("table", [vocab, dim], dtype, initializer=init)
        emb = tf.nn.embedding_lookup(table, ids)
        h = tf1.layers.conv1d(emb, filters, 3, activation=tf.nn.relu,
                              kernel_initializer=init, name="conv")
        pooled = tf.reduce_max(h, axis=1)
        return tf1.layers.dense(pooled, 3, kernel_initializer=init, name="out")
    logits, xs = _new_variables(build)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    return Model(loss, xs, feed)


# tf.keras layers called on placeholders (graph mode)


def _keras_model(dtype, rng, input_shape, layers, labels_count, ids=False):
    """Applies `layers` (a list of Keras layers) to a `[None, *input_shape]`
    placeholder (`ids`: int32 ids below 20); sparse softmax cross-entropy on
    `labels_count` classes."""
    x, labels, feed = _classifier_inputs(dtype, input_shape, labels_count, 20 if ids else None)
    h = x
    for layer in layers:
        h = layer(h)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=h)
    xs = [v for layer in layers for v in layer.trainable_weights]
    return loss, xs, feed


def _init(rng):
    return tf.keras.initializers.GlorotUniform(seed=int(rng.integers(1 << 30)))


def keras_cnn(dtype, rng, full=False):
    side, filters = (28, 32) if full else (8, 4)
    k = tf.keras.layers
    layers = [k.Conv2D(filters, 3, activation="relu", dtype=dtype, kernel_initializer=_init(rng)),
              k.MaxPooling2D(2, dtype=dtype), k.Flatten(dtype=dtype),
              k.Dense(6, dtype=dtype, kernel_initializer=_init(rng))]
    return Model(*_keras_model(dtype, rng, [side, side, 1], layers, 6))


def keras_embedding_mean(dtype, rng, full=False):
    vocab, dim, steps = (5000, 64, 32) if full else (20, 6, 5)
    k = tf.keras.layers
    layers = [k.Embedding(vocab, dim, dtype=dtype, embeddings_initializer=_init(rng)),
              k.GlobalAveragePooling1D(dtype=dtype),
              k.Dense(4, dtype=dtype, kernel_initializer=_init(rng))]
    return Model(*_keras_model(dtype, rng, [steps], layers, 4, ids=True))


def keras_separable(dtype, rng, full=False):
    side, filters = (28, 32) if full else (6, 4)
    k = tf.keras.layers
    layers = [k.SeparableConv2D(filters, 3, padding="same", activation="relu", dtype=dtype,
                                depthwise_initializer=_init(rng),
                                pointwise_initializer=_init(rng)),
              k.DepthwiseConv2D(3, depth_multiplier=2, dtype=dtype,
                                depthwise_initializer=_init(rng)),
              k.Flatten(dtype=dtype), k.Dense(3, dtype=dtype, kernel_initializer=_init(rng))]
    return Model(*_keras_model(dtype, rng, [side, side, 2], layers, 3))


def _batch_norm_model(dtype, rng, training, full):
    side, filters = (28, 32) if full else (6, 4)
    k = tf.keras.layers
    conv = k.Conv2D(filters, 3, dtype=dtype, kernel_initializer=_init(rng))
    bn = k.BatchNormalization(dtype=dtype, beta_initializer=_init(rng),
                              gamma_initializer=_init(rng))
    rest = [k.Flatten(dtype=dtype), k.Dense(3, dtype=dtype, kernel_initializer=_init(rng))]
    x, labels, feed = _classifier_inputs(dtype, [side, side, 2], 3)
    h = bn(tf.nn.relu(conv(x)), training=training)
    for layer in rest:
        h = layer(h)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=h)
    xs = conv.trainable_weights + bn.trainable_weights + [
        v for layer in rest for v in layer.trainable_weights]
    coupled = ([v.name for v in conv.trainable_weights + bn.trainable_weights] if training else [])
    return Model(loss, xs, feed, coupled)


def keras_batch_norm_inference(dtype, rng, full=False):
    return _batch_norm_model(dtype, rng, False, full)


def keras_batch_norm_training(dtype, rng, full=False):
    """Batch statistics: the conv and the normalization couple examples."""
    return _batch_norm_model(dtype, rng, True, full)


def keras_transformer(dtype, rng, full=False):
    """LayerNormalization + MultiHeadAttention block on `[None, steps, dim]`."""
    steps, dim, heads, ff = (16, 64, 4, 128) if full else (4, 8, 2, 16)
    k = tf.keras.layers
    x, labels, feed = _classifier_inputs(dtype, [steps, dim], 3)
    attention = k.MultiHeadAttention(num_heads=heads, key_dim=dim // heads, dtype=dtype,
                                     kernel_initializer=_init(rng))
    norm1 = k.LayerNormalization(dtype=dtype, gamma_initializer=_init(rng),
                                 beta_initializer=_init(rng))
    ff1 = k.Dense(ff, activation="relu", dtype=dtype, kernel_initializer=_init(rng))
    ff2 = k.Dense(dim, dtype=dtype, kernel_initializer=_init(rng))
    norm2 = k.LayerNormalization(dtype=dtype, gamma_initializer=_init(rng),
                                 beta_initializer=_init(rng))
    head = k.Dense(3, dtype=dtype, kernel_initializer=_init(rng))
    with _keras_floatx(dtype):  # builds the sublayers (Keras 2.12)
        attended = attention(x, x)
    h = norm1(x + attended)
    h = norm2(h + ff2(ff1(h)))
    logits = head(tf.reduce_mean(h, axis=1))
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    layers = [attention, norm1, ff1, ff2, norm2, head]
    xs = [v for layer in layers for v in layer.trainable_weights]
    return Model(loss, xs, feed)


# Hand-written graphs users write


def residual_mlp_shared_weight(dtype, rng, full=False):
    """A residual MLP whose hidden weight is used twice."""
    width, hidden = (784, 256) if full else (6, 5)
    x, labels, feed = _classifier_inputs(dtype, [width], 3)
    w_in = tf.Variable(0.4 * rng.normal(size=[width, hidden]), dtype=dtype)
    w = tf.Variable(0.4 * rng.normal(size=[hidden, hidden]), dtype=dtype)
    c = tf.Variable(0.1 * rng.normal(size=[hidden]), dtype=dtype)
    w_out = tf.Variable(0.4 * rng.normal(size=[hidden, 3]), dtype=dtype)
    h = tf.tanh(tf.matmul(x, w_in))
    h = h + tf.nn.relu(tf.matmul(h, w) + c)
    h = h + tf.nn.relu(tf.matmul(h, w) + c)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=tf.matmul(h, w_out))
    return Model(loss, [w_in, w, c, w_out], feed)


def weight_decay_loss(dtype, rng, full=False):
    """Cross-entropy plus an `l2_loss` weight-decay term on each example."""
    width, hidden = (784, 256) if full else (6, 5)
    x, labels, feed = _classifier_inputs(dtype, [width], 3)
    w1 = tf.Variable(0.4 * rng.normal(size=[width, hidden]), dtype=dtype)
    b1 = tf.Variable(tf.zeros([hidden], dtype))
    w2 = tf.Variable(0.4 * rng.normal(size=[hidden, 3]), dtype=dtype)
    logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2)
    loss = (tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
            + 1e-2 * (tf.nn.l2_loss(w1) + tf.nn.l2_loss(w2)))
    return Model(loss, [w1, b1, w2], feed)


# tensorflow/models official/r1/resnet/resnet_model.py's CIFAR-10 ResNet


def official_resnet_cifar(dtype, rng, full=False):
    """resnet_model.py's `Model` as `cifar10_main.Cifar10Model` builds it
    (resnet_size 8, 32 variables), `training=False`, channels_last."""
    side, num_filters = (32, 16) if full else (8, 4)
    resnet_size, data_format = 8, "channels_last"
    num_blocks = (resnet_size - 2) // 6
    training = False
    init_seed = int(rng.integers(1 << 30))

    def batch_norm(inputs, training, data_format):
        return tf1.layers.batch_normalization(
            inputs=inputs, axis=3, momentum=0.997, epsilon=1e-5, center=True, scale=True,
            training=training, fused=True)

    def fixed_padding(inputs, kernel_size, data_format):
        pad_total = kernel_size - 1
        pad_beg = pad_total // 2
        pad_end = pad_total - pad_beg
        return tf.pad(inputs, [[0, 0], [pad_beg, pad_end], [pad_beg, pad_end], [0, 0]])

    def conv2d_fixed_padding(inputs, filters, kernel_size, strides, data_format):
        if strides > 1:
            inputs = fixed_padding(inputs, kernel_size, data_format)
        return tf1.layers.conv2d(
            inputs=inputs, filters=filters, kernel_size=kernel_size,
            strides=strides, padding=("SAME" if strides == 1 else "VALID"), use_bias=False,
            kernel_initializer=tf1.variance_scaling_initializer(seed=init_seed),
            data_format=data_format)

    def building_block_v1(inputs, filters, training, projection_shortcut, strides, data_format):
        shortcut = inputs
        if projection_shortcut is not None:
            shortcut = projection_shortcut(inputs)
            shortcut = batch_norm(shortcut, training, data_format)
        inputs = conv2d_fixed_padding(inputs, filters, 3, strides, data_format)
        inputs = batch_norm(inputs, training, data_format)
        inputs = tf.nn.relu(inputs)
        inputs = conv2d_fixed_padding(inputs, filters, 3, 1, data_format)
        inputs = batch_norm(inputs, training, data_format)
        inputs += shortcut
        return tf.nn.relu(inputs)

    def block_layer(inputs, filters, blocks, strides, training, name, data_format):
        def projection_shortcut(inputs):
            return conv2d_fixed_padding(inputs, filters, 1, strides, data_format)
        inputs = building_block_v1(inputs, filters, training,
                                   projection_shortcut, strides, data_format)
        for _ in range(1, blocks):
            inputs = building_block_v1(inputs, filters, training, None, 1, data_format)
        return tf.identity(inputs, name)

    images = tf1.placeholder(dtype, [None, side, side, 3])
    labels = tf1.placeholder(tf.int32, [None])

    def build():
        with tf1.variable_scope("resnet_model"):
            inputs = conv2d_fixed_padding(images, num_filters, 3, 1, data_format)
            inputs = tf.identity(inputs, "initial_conv")
            inputs = batch_norm(inputs, training, data_format)
            inputs = tf.nn.relu(inputs)
            for i, strides in enumerate([1, 2, 2]):
                inputs = block_layer(inputs, num_filters * (2 ** i), num_blocks, strides, training,
                                     "block_layer%d" % (i + 1), data_format)
            axes = [1, 2]
            inputs = tf.reduce_mean(inputs, axes, keepdims=True)
            inputs = tf.identity(inputs, "final_reduce_mean")
            inputs = tf.squeeze(inputs, axes)
            return tf1.layers.dense(inputs, 10)
    logits, xs = _new_variables(build)
    loss = tf1.losses.sparse_softmax_cross_entropy(
        labels, logits, reduction=tf1.losses.Reduction.NONE)

    def feed(rng, batch):
        return {images: rng.normal(size=[batch, side, side, 3]),
                labels: rng.integers(0, 10, batch)}
    return Model(loss, xs, feed)


def dcgan_generator(dtype, rng, full=False):
    """TF's DCGAN tutorial's make_generator_model in tf.compat.v1.layers
    (conv2d_transpose), the squared error to a target image per example."""
    noise_dim, side, widths = (100, 7, (256, 128, 64)) if full else (6, 2, (8, 6, 4))
    noise = tf1.placeholder(dtype, [None, noise_dim])
    target = tf1.placeholder(dtype, [None, 4 * side, 4 * side, 1])
    init = _glorot(rng)

    def batch_norm(x):
        # Keras' default: fused for the images, unfused for the dense rows.
        return tf1.layers.batch_normalization(x, training=False)

    def build():
        x = tf1.layers.dense(noise, side * side * widths[0], use_bias=False,
                             kernel_initializer=init)
        x = tf.nn.leaky_relu(batch_norm(x))
        x = tf.reshape(x, [-1, side, side, widths[0]])
        for width, strides in zip(widths[1:], (1, 2)):
            x = tf1.layers.conv2d_transpose(
                x, width, 5, strides=strides, padding="same", use_bias=False,
                kernel_initializer=init)
            x = tf.nn.leaky_relu(batch_norm(x))
        return tf1.layers.conv2d_transpose(
            x, 1, 5, strides=2, padding="same", use_bias=False,
            activation=tf.tanh, kernel_initializer=init)
    image, xs = _new_variables(build)
    loss = tf.reduce_sum(tf.square(image - target), axis=[1, 2, 3])

    def feed(rng, batch):
        return {noise: rng.normal(size=[batch, noise_dim]),
                target: rng.uniform(-1, 1, [batch, 4 * side, 4 * side, 1])}
    return Model(loss, xs, feed)


# Other people's TF1 models (issue 24) and issue 34's dynamic-shape ones


def _lengths(rng, batch, steps):
    """Sequence lengths in [1, steps], the longest one equal to `steps`."""
    lengths = rng.integers(1, steps + 1, batch)
    lengths[rng.integers(batch)] = steps
    return lengths


def _layer_norm(inputs, dtype, scope, epsilon=1e-8):
    """Layer norm as the TF1 Transformer repositories write it by hand."""
    with tf1.variable_scope(scope):
        mean, variance = tf.nn.moments(inputs, [-1], keepdims=True)
        size = inputs.get_shape()[-1:]
        beta = tf1.get_variable("beta", size, dtype, initializer=tf1.zeros_initializer())
        gamma = tf1.get_variable("gamma", size, dtype, initializer=tf1.ones_initializer())
        return gamma * (inputs - mean) / ((variance + epsilon) ** .5) + beta


def _multihead_attention(queries, keys, key_mask, heads, dtype, scope):
    """Self-attention with the heads stacked on axis 0: `[h*B, T, D/h]`."""
    units = queries.get_shape().as_list()[-1]
    with tf1.variable_scope(scope):
        q = tf1.layers.dense(queries, units, name="q")     # [B, T, D]
        k = tf1.layers.dense(keys, units, name="k")
        v = tf1.layers.dense(keys, units, name="v")
        q_ = tf.concat(tf.split(q, heads, axis=2), axis=0)  # [h*B, T, D/h]
        k_ = tf.concat(tf.split(k, heads, axis=2), axis=0)
        v_ = tf.concat(tf.split(v, heads, axis=2), axis=0)
        scores = tf.matmul(q_, tf.transpose(k_, [0, 2, 1]))  # [h*B, T, T]
        scores /= math.sqrt(units // heads)
        # Padded keys get a large negative score (key_mask: [B, T] of 0/1).
        masks = tf.tile(key_mask, [heads, 1])                # [h*B, T]
        masks = tf.tile(tf.expand_dims(masks, 1), [1, tf.shape(queries)[1], 1])
        paddings = tf.ones_like(scores) * (-2.0 ** 32 + 1)
        scores = tf.where(tf.equal(masks, 0), paddings, scores)
        weights = tf.nn.softmax(scores)
        out = tf.matmul(weights, v_)                         # [h*B, T, D/h]
        out = tf.concat(tf.split(out, heads, axis=0), axis=2)  # [B, T, D]
        out = tf1.layers.dense(out, units, name="out")
        return _layer_norm(out + queries, dtype, "ln")


def transformer(dtype, rng, full=False):
    """A one-block Transformer encoder classifier on tf.compat.v1.layers."""
    vocab, dim, heads, ff, classes, steps = (
        (1000, 64, 4, 128, 5, 32) if full else (17, 8, 2, 12, 3, 5))
    ids = tf1.placeholder(tf.int32, [None, None], name="ids")  # 0 = padding
    labels = tf1.placeholder(tf.int32, [None], name="labels")

    def build():
        with tf1.variable_scope("transformer", initializer=_glorot(rng, dtype)):
            table = tf1.get_variable("lookup_table", [vocab, dim], dtype)
            enc = tf.nn.embedding_lookup(table, ids) * math.sqrt(dim)
            # Learned positions, looked up from a [B, T] tile of range(T).
            positions = tf.tile(tf.expand_dims(tf.range(tf.shape(ids)[1]), 0),
                                [tf.shape(ids)[0], 1])
            pos_table = tf1.get_variable("pos_table", [steps, dim], dtype)
            enc += tf.nn.embedding_lookup(pos_table, positions)
            key_mask = tf.cast(tf.not_equal(ids, 0), dtype)   # [B, T]
            enc = _multihead_attention(enc, enc, key_mask, heads, dtype, "attention")
            hidden = tf1.layers.dense(enc, ff, activation=tf.nn.relu, name="ff1")
            enc = _layer_norm(enc + tf1.layers.dense(hidden, dim, name="ff2"), dtype, "ln_ff")
            # Mean over the real tokens.
            pooled = (tf.reduce_sum(enc * tf.expand_dims(key_mask, -1), 1) /
                      tf.reduce_sum(key_mask, 1, keepdims=True))
            return tf1.layers.dense(pooled, classes, name="logits")
    logits, xs = _new_variables(build)
    loss = tf1.losses.softmax_cross_entropy(
        tf.one_hot(labels, classes, dtype=dtype), logits,
        label_smoothing=0.1, reduction=tf1.losses.Reduction.NONE)

    def feed(rng, batch, t=None):
        t = t or steps
        lengths = _lengths(rng, batch, t)
        data = rng.integers(1, vocab, [batch, t])
        data[np.arange(t)[None, :] >= lengths[:, None]] = 0
        return {ids: data, labels: rng.integers(0, classes, batch)}
    return Model(loss, xs, feed, dynamic_steps=True)


def _tagger_logits(word_embeddings, sequence_lengths, hidden, tags, dtype, init, dropout=None):
    """The tagger's `add_logits_op` (bi-LSTM, dropout, projection): `[B, T, tags]`."""
    with tf1.variable_scope("bi-lstm", initializer=init):
        cell_fw = tf1.nn.rnn_cell.LSTMCell(hidden)
        cell_bw = tf1.nn.rnn_cell.LSTMCell(hidden)
        (output_fw, output_bw), _ = tf1.nn.bidirectional_dynamic_rnn(
            cell_fw, cell_bw, word_embeddings, sequence_length=sequence_lengths, dtype=dtype)
        output = tf.concat([output_fw, output_bw], axis=-1)
        if dropout is not None:
            output = tf1.nn.dropout(output, dropout)
    with tf1.variable_scope("proj"):
        W = tf1.get_variable("W", [2 * hidden, tags], dtype, initializer=init)
        b = tf1.get_variable("b", [tags], dtype, initializer=tf1.zeros_initializer())
        nsteps = tf.shape(output)[1]
        output = tf.reshape(output, [-1, 2 * hidden])
        pred = tf.matmul(output, W) + b
        return tf.reshape(pred, [-1, nsteps, tags])


def bilstm_tagger(dtype, rng, full=False):
    """Word embeddings, a bi-LSTM and a per-token softmax (a NER tagger)."""
    vocab, dim, hidden, tags, steps = ((1000, 32, 64, 9, 24) if full else (15, 4, 5, 3, 4))
    word_ids = tf1.placeholder(tf.int32, [None, None], name="word_ids")
    sequence_lengths = tf1.placeholder(tf.int32, [None], name="sequence_lengths")
    labels = tf1.placeholder(tf.int32, [None, None], name="labels")

    def build():
        init = _glorot(rng, dtype)
        with tf1.variable_scope("words"):
            embeddings = tf1.get_variable("_word_embeddings", [vocab, dim],
                                          dtype, initializer=init)
            word_embeddings = tf.nn.embedding_lookup(embeddings, word_ids)
        return _tagger_logits(word_embeddings, sequence_lengths, hidden, tags, dtype, init)
    logits, xs = _new_variables(build)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
        logits=logits, labels=labels)                       # [B, T]
    mask = tf.sequence_mask(sequence_lengths, tf.shape(word_ids)[1], dtype=dtype)
    loss = tf.reduce_sum(losses * mask, axis=1)             # [B]

    def feed(rng, batch, t=None):
        t = t or steps
        return {word_ids: rng.integers(0, vocab, [batch, t]),
                sequence_lengths: _lengths(rng, batch, t),
                labels: rng.integers(0, tags, [batch, t])}
    return Model(loss, xs, feed, dynamic_steps=True)


_EDUCATION = ["Bachelors", "HS-grad", "Masters", "Doctorate", "Some-college", "Assoc-voc"]
_OCCUPATIONS = ["Tech-support", "Craft-repair", "Sales", "Exec-managerial",
                "Prof-specialty", "Farming-fishing", "Transport-moving"]
_INTERESTS = ["golf", "chess", "music", "hiking", "cooking", "film", "tennis"]


def wide_deep(dtype, rng, full=False):
    """The census wide & deep model on feature columns: a linear model on
    sparse and crossed columns plus a DNN on embeddings and numbers."""
    fc = tf1.feature_column
    hidden = (100, 50) if full else (6, 4)
    emb = 8 if full else 3
    features = {
        "age": tf1.placeholder(dtype, [None, 1], name="age"),
        "hours_per_week": tf1.placeholder(dtype, [None, 1], name="hours"),
        "education": tf1.placeholder(tf.string, [None, 1], name="education"),
        "occupation": tf1.placeholder(tf.string, [None, 1], name="occupation"),
        # Several interests per person, or none: a sparse input.
        "interests": tf1.sparse_placeholder(tf.string, [None, None], name="interests"),
    }
    label = tf1.placeholder(dtype, [None, 1], name="label")
    # Standardized as the input pipelines of these models do (raw ages
    # saturate the sigmoid at initialization: gradients of 1e-20).
    age = fc.numeric_column("age", dtype=dtype, normalizer_fn=lambda v: (v - 45.0) / 15.0)
    hours = fc.numeric_column("hours_per_week", dtype=dtype,
                              normalizer_fn=lambda v: (v - 40.0) / 12.0)
    # Everything below is float32 whatever `dtype` is (FLOAT32_ONLY).
    education = fc.categorical_column_with_vocabulary_list("education", _EDUCATION)
    occupation = fc.categorical_column_with_hash_bucket(
        "occupation", hash_bucket_size=50 if full else 11)
    interests = fc.categorical_column_with_hash_bucket(
        "interests", hash_bucket_size=50 if full else 9)
    age_buckets = fc.bucketized_column(age, [-1.0, -0.5, 0.0, 0.5, 1.0])
    wide_columns = [education, occupation, age_buckets, fc.crossed_column(
        ["education", "occupation"], hash_bucket_size=100 if full else 13)]
    deep_columns = [age, hours, fc.embedding_column(education, emb),
                    fc.embedding_column(occupation, emb),
                    fc.embedding_column(interests, emb, combiner="mean")]

    def build():
        with tf1.variable_scope("wide"):
            wide_logits = fc.linear_model(features, wide_columns)   # [B, 1]
        with tf1.variable_scope("deep"):
            net = fc.input_layer(features, deep_columns)
            init = _glorot(rng)
            for i, units in enumerate(hidden):
                net = tf1.layers.dense(net, units, activation=tf.nn.relu, kernel_initializer=init,
                                       name="hiddenlayer_%d" % i)
            deep_logits = tf1.layers.dense(net, 1, kernel_initializer=init, name="logits")
        return wide_logits + deep_logits
    logits, xs = _new_variables(build)
    loss = tf.reshape(tf.nn.sigmoid_cross_entropy_with_logits(
        labels=label, logits=logits), [-1])                 # [B]

    def feed(rng, batch, t=None):
        del t
        rows, cols, values = [], [], []
        width = 1
        for r in range(batch):
            for c in range(int(rng.integers(0, 4))):
                rows.append(r)
                cols.append(c)
                values.append(_INTERESTS[rng.integers(len(_INTERESTS))])
                width = max(width, c + 1)
        sparse = tf1.SparseTensorValue(
            np.array([rows, cols], np.int64).T.reshape(-1, 2),
            np.array(values, object), np.array([batch, width], np.int64))
        pick = lambda words: np.array(  # noqa: E731
            [[words[i]] for i in rng.integers(0, len(words), batch)], object)
        return {features["age"]: rng.uniform(17, 80, [batch, 1]),
                features["hours_per_week"]: rng.uniform(10, 60, [batch, 1]),
                # "Preschool" is out of the vocabulary: the -1 id path.
                features["education"]: pick(_EDUCATION + ["Preschool"]),
                features["occupation"]: pick(_OCCUPATIONS), features["interests"]: sparse,
                label: rng.integers(0, 2, [batch, 1]).astype(float)}
    return Model(loss, xs, feed)


def word2vec(dtype, rng, full=False):
    """word2vec_basic.py's skip-gram graph: embeddings, NCE weights and biases."""
    vocabulary_size, embedding_size, num_sampled = ((5000, 128, 64) if full else (40, 6, 5))
    train_inputs = tf1.placeholder(tf.int32, [None], name="train_inputs")
    train_labels = tf1.placeholder(tf.int64, [None, 1], name="train_labels")
    embeddings = tf.Variable(tf1.random_uniform(
        [vocabulary_size, embedding_size], -1.0, 1.0, dtype=dtype,
        seed=int(rng.integers(1 << 30))), name="embeddings")
    embed = tf.nn.embedding_lookup(embeddings, train_inputs)
    nce_weights = tf.Variable(tf1.truncated_normal(
        [vocabulary_size, embedding_size], stddev=1.0 / math.sqrt(embedding_size), dtype=dtype,
        seed=int(rng.integers(1 << 30))), name="nce_weights")
    nce_biases = tf.Variable(0.1 * rng.normal(size=[vocabulary_size]),
                             dtype=dtype, name="nce_biases")
    # The tutorial averages this [B] vector.
    loss = tf1.nn.nce_loss(weights=nce_weights, biases=nce_biases,
                           labels=train_labels, inputs=embed, num_sampled=num_sampled,
                           num_classes=vocabulary_size)

    def feed(rng, batch, t=None):
        del t
        return {train_inputs: rng.integers(0, vocabulary_size, batch),
                train_labels: rng.integers(0, vocabulary_size, [batch, 1])}
    return Model(loss, [embeddings, nce_weights, nce_biases], feed)


def _sequence_loss(logits, targets, weights):
    """`[B]`: `tf.contrib.seq2seq.sequence_loss` without its averages, summed over time."""
    crossent = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=targets, logits=logits)                      # [B, T]
    return tf.reduce_sum(crossent * weights, axis=1)


def ptb_lm(dtype, rng, full=False):
    """ptb_word_lm.py's PTBModel (two LSTM layers, tied nothing)."""
    vocab_size, size, steps = (1000, 200, 20) if full else (13, 5, 4)
    input_data = tf1.placeholder(tf.int32, [None, None], name="input_data")
    targets = tf1.placeholder(tf.int32, [None, None], name="targets")

    def build():
        init = tf1.random_uniform_initializer(
            -0.1, 0.1, seed=int(rng.integers(1 << 30)), dtype=dtype)
        with tf1.variable_scope("Model", initializer=init):
            embedding = tf1.get_variable("embedding", [vocab_size, size], dtype)
            inputs = tf.nn.embedding_lookup(embedding, input_data)
            cell = tf1.nn.rnn_cell.MultiRNNCell(
                [tf1.nn.rnn_cell.LSTMCell(size, forget_bias=0.0)
                 for _ in range(2)], state_is_tuple=True)
            batch_size = tf.shape(input_data)[0]
            initial_state = cell.zero_state(batch_size, dtype)
            outputs, _ = tf1.nn.dynamic_rnn(cell, inputs, initial_state=initial_state)
            output = tf.reshape(outputs, [-1, size])
            softmax_w = tf1.get_variable("softmax_w", [size, vocab_size], dtype)
            softmax_b = tf1.get_variable("softmax_b", [vocab_size], dtype)
            logits = tf1.nn.xw_plus_b(output, softmax_w, softmax_b)
            return tf.reshape(logits, [batch_size, -1, vocab_size])
    logits, xs = _new_variables(build)
    loss = _sequence_loss(logits, targets, tf.ones_like(targets, dtype=dtype))

    def feed(rng, batch, t=None):
        t = t or steps
        text = rng.integers(0, vocab_size, [batch, t + 1])
        return {input_data: text[:, :-1], targets: text[:, 1:]}
    return Model(loss, xs, feed, dynamic_steps=True)


def _two_towers(dtype, rng, full):
    """Query and document towers (dense tanh, dense, l2-normalised):
    `(q [B, K], d [B, K], variables, feed)`."""
    q_dim, d_dim, hidden, out = (64, 96, 128, 32) if full else (5, 6, 7, 4)
    query = tf1.placeholder(dtype, [None, q_dim], name="query")
    doc = tf1.placeholder(dtype, [None, d_dim], name="doc")

    def build():
        init = _glorot(rng, dtype)

        def tower(x, scope):
            with tf1.variable_scope(scope):
                h = tf1.layers.dense(x, hidden, activation=tf.nn.tanh,
                                     kernel_initializer=init, name="h")
                return tf.nn.l2_normalize(
                    tf1.layers.dense(h, out, kernel_initializer=init, name="out"), axis=-1)
        return tower(query, "query_tower"), tower(doc, "doc_tower")
    (q, d), xs = _new_variables(build)

    def feed(rng, batch, t=None):
        del t
        return {query: rng.normal(size=[batch, q_dim]), doc: rng.normal(size=[batch, d_dim])}
    return q, d, xs, feed


def in_batch_negatives(dtype, rng, full=False):
    """Two towers; example i's negative is document i-1 (`tf.roll`): the
    document tower's variables are coupled, only an exact form is right."""
    q, d, xs, feed = _two_towers(dtype, rng, full)
    positive = tf.reduce_sum(q * d, axis=-1)                        # [B]
    negative = tf.reduce_sum(q * tf.roll(d, shift=1, axis=0), axis=-1)
    scale = 5.0
    loss = tf.nn.softplus(-scale * positive) + tf.nn.softplus(scale * negative)
    # Query i meets documents i and i-1, but the query tower sees only
    # query i: its variables keep the examples apart, the document tower's
    # do not.
    return Model(loss, xs, feed, coupled=[v.name for v in xs if "doc_tower" in v.name])


def in_batch_softmax(dtype, rng, full=False):
    """The towers with the in-batch softmax (`q @ d^T`, label i): coupled
    through a MatMul the batch-axis table knows (the `tf.roll` model's control)."""
    q, d, xs, feed = _two_towers(dtype, rng, full)
    logits = 5.0 * tf.matmul(q, d, transpose_b=True)             # [B, B]
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.range(tf.shape(q)[0]), logits=logits)
    return Model(loss, xs, feed, coupled=[v.name for v in xs if "doc_tower" in v.name])


# Issue 34: shapes known only at run time.


def _weight(shape, dtype, rng, stddev=0.1):
    """`tf.Variable(tf.truncated_normal(shape, stddev))`, seeded."""
    return tf.Variable(tf1.truncated_normal(
        shape, stddev=stddev, dtype=dtype, seed=int(rng.integers(1 << 30))))


def unet(dtype, rng, full=False):
    """jakeret/tf_unet's `create_conv_net` on images of any size: run-time
    `conv2d_transpose` shapes and `crop_and_concat` slices; per image, the
    pixels' mean softmax cross-entropy."""
    channels, n_class, root, size = (3, 2, 16, 64) if full else (2, 2, 3, 20)
    x = tf1.placeholder(dtype, [None, None, None, channels], name="x")
    y = tf1.placeholder(dtype, [None, None, None, n_class], name="y")
    keep_prob = tf1.placeholder(dtype, [], name="dropout_probability")

    def conv2d(x, W, b):
        conv = tf.nn.bias_add(tf.nn.conv2d(x, W, [1, 1, 1, 1], "VALID"), b)
        return tf.nn.dropout(conv, rate=1 - keep_prob)

    def deconv2d(x, W, stride):
        s = tf.shape(x)
        output_shape = tf.stack([s[0], s[1] * 2, s[2] * 2, s[3] // 2])
        return tf.nn.conv2d_transpose(x, W, output_shape, [1, stride, stride, 1], "VALID")

    def crop_and_concat(x1, x2):
        s1, s2 = tf.shape(x1), tf.shape(x2)
        offsets = [0, (s1[1] - s2[1]) // 2, (s1[2] - s2[2]) // 2, 0]
        return tf.concat([tf.slice(x1, offsets, [-1, s2[1], s2[2], -1]), x2], 3)

    def bias_variable(width):
        return tf.Variable(tf.constant(0.1, dtype, [width]))

    def two_convs(h, c_in, c_out):
        """The author's layer: two 3x3 VALID convolutions, each with its ReLU."""
        w1 = _weight([3, 3, c_in, c_out], dtype, rng)
        w2 = _weight([3, 3, c_out, c_out], dtype, rng)
        b1, b2 = bias_variable(c_out), bias_variable(c_out)
        return tf.nn.relu(conv2d(tf.nn.relu(conv2d(h, w1, b1)), w2, b2))

    def build():
        features = root
        down = two_convs(x, channels, features)
        pool = tf.nn.max_pool2d(down, [1, 2, 2, 1], [1, 2, 2, 1], "VALID")
        bottom = two_convs(pool, features, 2 * features)
        wd, bd = _weight([2, 2, features, 2 * features], dtype, rng), bias_variable(features)
        up = tf.nn.relu(deconv2d(bottom, wd, 2) + bd)
        h = two_convs(crop_and_concat(down, up), 2 * features, features)
        weight = _weight([1, 1, features, n_class], dtype, rng)
        return conv2d(h, weight, bias_variable(n_class))
    logits, xs = _new_variables(build)
    # The cropped labels, as the author's `crop_to_shape`.
    offset = (tf.shape(y)[1] - tf.shape(logits)[1]) // 2
    labels = y[:, offset:offset + tf.shape(logits)[1], offset:offset + tf.shape(logits)[2], :]
    flat = tf.nn.softmax_cross_entropy_with_logits(
        logits=tf.reshape(logits, [-1, n_class]), labels=tf.reshape(labels, [-1, n_class]))
    # The author averages `flat`; per image, its pixels' mean.
    loss = tf.reduce_mean(tf.reshape(flat, [tf.shape(x)[0], -1]), axis=1)

    def feed(rng, batch, t=None):
        side = t or size
        classes = rng.integers(0, n_class, [batch, side, side])
        return {x: rng.normal(size=[batch, side, side, channels]),
                y: np.eye(n_class)[classes], keep_prob: 1.0}
    return Model(loss, xs, feed, dynamic_steps=True)


def ctc_lstm(dtype, rng, full=False):
    """igormq/ctc_tensorflow_example: an LSTM over features of any length,
    time-major logits and `tf.compat.v1.nn.ctc_loss` on sparse labels."""
    num_features, num_hidden, num_classes, steps = ((13, 50, 28, 40) if full else (4, 5, 6, 6))
    inputs = tf1.placeholder(dtype, [None, None, num_features], name="inputs")
    targets = tf1.sparse_placeholder(tf.int32, name="targets")
    seq_len = tf1.placeholder(tf.int32, [None], name="seq_len")

    def build():
        with tf1.variable_scope("ctc", initializer=_glorot(rng, dtype)):
            cell = tf1.nn.rnn_cell.LSTMCell(num_hidden, state_is_tuple=True)
            stack = tf1.nn.rnn_cell.MultiRNNCell([cell], state_is_tuple=True)
            outputs, _ = tf1.nn.dynamic_rnn(stack, inputs, seq_len, dtype=dtype)
        shape = tf.shape(inputs)
        batch_s = shape[0]
        outputs = tf.reshape(outputs, [-1, num_hidden])
        W = _weight([num_hidden, num_classes], dtype, rng)
        b = tf.Variable(tf.constant(0., dtype, [num_classes]))
        logits = tf.matmul(outputs, W) + b
        logits = tf.reshape(logits, [batch_s, -1, num_classes])
        return tf.transpose(logits, (1, 0, 2))
    logits, xs = _new_variables(build)
    loss = tf1.nn.ctc_loss(targets, logits, seq_len)

    def feed(rng, batch, t=None):
        t = t or steps
        lengths = _lengths(rng, batch, t)
        return {inputs: rng.normal(size=[batch, t, num_features]), seq_len: lengths,
                targets: ctc_labels(rng, lengths, num_classes)}
    return Model(loss, xs, feed, dynamic_steps=True)


def ctc_labels(rng, lengths, num_classes):
    """A `SparseTensorValue` of CTC labels (classes 0 .. num_classes - 2,
    the last is the blank) for sequences of `lengths` frames: at most half
    the frames each, so CTC can always align them."""
    indices, values = [], []
    for n, length in enumerate(lengths):
        for k in range(int(rng.integers(1, max(length // 2, 1) + 1))):
            indices.append([n, k])
            values.append(int(rng.integers(0, num_classes - 1)))
    width = max(i[1] for i in indices) + 1
    return tf1.SparseTensorValue(np.array(indices, np.int64), np.array(values, np.int32),
                                 np.array([len(lengths), width], np.int64))


def neurobind(dtype, rng, full=False):
    """kyubyong/neurobind's regressor: `tf.squeeze(tf.layers.dense(enc, 1))`
    and `tf.abs(logits - y)`, a loss of unknown static rank."""
    vocab, units, steps = (5, 64, 60) if full else (5, 6, 7)
    x = tf1.placeholder(tf.int32, [None, steps], name="x")
    y = tf1.placeholder(dtype, [None], name="y")

    def build():
        init = _glorot(rng, dtype)
        with tf1.variable_scope("net", initializer=init):
            table = tf1.get_variable("lookup_table", [vocab, units], dtype)
            enc = tf.nn.embedding_lookup(table, x)
            with tf1.variable_scope("prenet"):
                out = tf1.layers.dense(enc, units, tf.nn.relu, name="dense1")
                out = tf1.layers.dropout(out, 0.2, training=True)
                out = tf1.layers.dense(out, units // 2, tf.nn.relu, name="dense2")
                prenet_out = tf1.layers.dropout(out, 0.2, training=True)
            enc = tf1.layers.conv1d(prenet_out, units // 2, 3,
                                    padding="same", activation=tf.nn.relu, name="conv1d_1")
            enc += prenet_out
            with tf1.variable_scope("highwaynet_0"):
                H = tf1.layers.dense(enc, units // 2, tf.nn.relu, name="H")
                T = tf1.layers.dense(enc, units // 2, tf.nn.sigmoid, name="T")
                enc = H * T + enc * (1. - T)
            _, t, e = enc.get_shape().as_list()
            enc = tf.reshape(enc, (-1, t * e))
            return tf.squeeze(tf1.layers.dense(enc, 1))
    logits, xs = _new_variables(build)
    loss = tf.abs(logits - y)

    def feed(rng, batch, t=None):
        del t
        return {x: rng.integers(0, vocab, [batch, steps]), y: rng.normal(size=[batch])}
    return Model(loss, xs, feed)


def attention_pooling(dtype, rng, full=False):
    """R-Net-style attention pooling as public TF1 reading-comprehension code
    writes it (einsum `dense`, masked softmax by hand), then a classifier."""
    vocab, dim, hidden, classes, steps = ((1000, 64, 64, 5, 40) if full else (17, 6, 5, 3, 6))
    ids = tf1.placeholder(tf.int32, [None, None], name="ids")
    lengths = tf1.placeholder(tf.int32, [None], name="lengths")
    labels = tf1.placeholder(tf.int32, [None], name="labels")

    def dense(value, last_dim, use_bias=True, scope="dense"):
        with tf1.variable_scope(scope):
            weight = tf1.get_variable("weight", [value.get_shape()[-1], last_dim], dtype)
            out = tf.einsum("aij,jk->aik", value, weight)
            if use_bias:
                out += tf1.get_variable("bias", [last_dim], dtype)
            return tf.identity(out, "dense")

    def softmax(value, mask):
        exp = tf.exp(value) * mask
        return exp / tf.expand_dims(tf.reduce_sum(exp, -1), -1)

    def build():
        with tf1.variable_scope("reader", initializer=_glorot(rng, dtype)):
            table = tf1.get_variable("word_mat", [vocab, dim], dtype)
            mask = tf.sequence_mask(lengths, tf.shape(ids)[1], dtype=dtype)
            value = tf.nn.tanh(dense(tf.nn.embedding_lookup(table, ids), hidden, scope="encoder"))
            with tf1.variable_scope("summary"):
                value = tf.nn.dropout(value, rate=0.1)
                sj = tf.nn.tanh(dense(value, hidden, scope="summary_sj"))
                uj = tf.squeeze(dense(sj, 1, use_bias=False, scope="summary_uj"), [-1])
                alpha = softmax(uj, mask)
                pooled = tf.reduce_sum(tf.expand_dims(alpha, -1) * value, 1)
            return tf1.layers.dense(pooled, classes, name="logits")
    logits, xs = _new_variables(build)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)

    def feed(rng, batch, t=None):
        t = t or steps
        return {ids: rng.integers(0, vocab, [batch, t]), lengths: _lengths(rng, batch, t),
                labels: rng.integers(0, classes, batch)}
    return Model(loss, xs, feed, dynamic_steps=True)


def _crf_log_likelihood(inputs, tag_indices, sequence_lengths, dtype):
    """tf.contrib.crf's (TF 1.4) linear-chain CRF log-likelihood `[B]` in
    tf.compat.v1 ops; `dtype` where contrib wrote float32, for float64."""
    num_tags = inputs.get_shape()[2]
    transition_params = tf1.get_variable("transitions", [num_tags, num_tags], dtype)
    # crf_unary_score
    batch_size = tf.shape(inputs)[0]
    max_seq_len = tf.shape(inputs)[1]
    n = tf.shape(inputs)[2]
    flattened_inputs = tf.reshape(inputs, [-1])
    offsets = tf.expand_dims(tf.range(batch_size) * max_seq_len * n, 1)
    offsets += tf.expand_dims(tf.range(max_seq_len) * n, 0)
    flattened_tag_indices = tf.reshape(offsets + tag_indices, [-1])
    unary_scores = tf.reshape(
        tf.gather(flattened_inputs, flattened_tag_indices), [batch_size, max_seq_len])

    def lengths_to_masks(lengths, max_length):
        tiled_ranges = tf.tile(tf.expand_dims(tf.range(max_length), 0), [tf.shape(lengths)[0], 1])
        return tf.cast(tiled_ranges < tf.expand_dims(lengths, 1), dtype)
    masks = lengths_to_masks(sequence_lengths, tf.shape(tag_indices)[1])
    unary_scores = tf.reduce_sum(unary_scores * masks, 1)
    # crf_binary_score
    num_transitions = tf.shape(tag_indices)[1] - 1
    start_tag_indices = tf.slice(tag_indices, [0, 0], [-1, num_transitions])
    end_tag_indices = tf.slice(tag_indices, [0, 1], [-1, num_transitions])
    flattened_transition_indices = (start_tag_indices * num_tags + end_tag_indices)
    binary_scores = tf.gather(tf.reshape(transition_params, [-1]), flattened_transition_indices)
    truncated_masks = tf.slice(masks, [0, 1], [-1, -1])
    binary_scores = tf.reduce_sum(binary_scores * truncated_masks, 1)
    # crf_log_norm
    first_input = tf.squeeze(tf.slice(inputs, [0, 0, 0], [-1, 1, -1]), [1])
    rest_of_input = tf.slice(inputs, [0, 1, 0], [-1, -1, -1])
    _, alphas = tf1.nn.dynamic_rnn(
        cell=_crf_forward_cell(transition_params), inputs=rest_of_input,
        sequence_length=sequence_lengths - 1, initial_state=first_input, dtype=dtype)
    log_norm = tf.reduce_logsumexp(alphas, [1])
    return unary_scores + binary_scores - log_norm


def _crf_forward_cell(transition_params):
    """contrib's `CrfForwardRnnCell` (the class is made here: the v1 cells
    need tf-keras on this TensorFlow, `has_tf1_layers`)."""

    class CrfForwardRnnCell(tf1.nn.rnn_cell.RNNCell):
        """The alpha values of the forward algorithm, one step per call."""

        def __init__(self, transition_params):
            super(CrfForwardRnnCell, self).__init__()
            self._transition_params = tf.expand_dims(transition_params, 0)
            self._num_tags = transition_params.get_shape()[0]

        @property
        def state_size(self):
            return self._num_tags

        @property
        def output_size(self):
            return self._num_tags

        def __call__(self, inputs, state, scope=None):
            state = tf.expand_dims(state, 2)
            transition_scores = state + self._transition_params
            new_alphas = inputs + tf.reduce_logsumexp(transition_scores, [1])
            return new_alphas, new_alphas
    return CrfForwardRnnCell(transition_params)


def bilstm_crf(dtype, rng, full=False, static_steps=False):
    """guillaumegenthial/sequence_tagging's NER tagger (model/ner_model.py,
    chars and CRF): `-log_likelihood`; `static_steps`: a static T."""
    vocab, nchars, dim, dim_char, hidden_char, hidden, tags, steps, chars = (
        (1000, 60, 50, 25, 25, 64, 9, 24, 8) if full else (15, 11, 4, 3, 2, 5, 3, 4, 3))
    t = steps if static_steps else None
    word_ids = tf1.placeholder(tf.int32, [None, t], name="word_ids")
    sequence_lengths = tf1.placeholder(tf.int32, [None], name="sequence_lengths")
    char_ids = tf1.placeholder(tf.int32, [None, t, None], name="char_ids")
    word_lengths = tf1.placeholder(tf.int32, [None, t], name="word_lengths")
    labels = tf1.placeholder(tf.int32, [None, t], name="labels")
    dropout = tf1.placeholder(dtype, [], name="dropout")

    def build():
        init = _glorot(rng, dtype)
        with tf1.variable_scope("words"):
            _word_embeddings = tf1.get_variable(
                "_word_embeddings", [vocab, dim], dtype, initializer=init)
            word_embeddings = tf.nn.embedding_lookup(
                _word_embeddings, word_ids, name="word_embeddings")
        with tf1.variable_scope("chars", initializer=init):
            _char_embeddings = tf1.get_variable("_char_embeddings", [nchars, dim_char], dtype)
            char_embeddings = tf.nn.embedding_lookup(
                _char_embeddings, char_ids, name="char_embeddings")
            s = tf.shape(char_embeddings)
            char_embeddings = tf.reshape(char_embeddings, shape=[s[0] * s[1], s[-2], dim_char])
            word_lengths_flat = tf.reshape(word_lengths, shape=[s[0] * s[1]])
            cell_fw = tf1.nn.rnn_cell.LSTMCell(hidden_char, state_is_tuple=True)
            cell_bw = tf1.nn.rnn_cell.LSTMCell(hidden_char, state_is_tuple=True)
            _output = tf1.nn.bidirectional_dynamic_rnn(
                cell_fw, cell_bw, char_embeddings, sequence_length=word_lengths_flat, dtype=dtype)
            _, ((_, output_fw), (_, output_bw)) = _output
            output = tf.concat([output_fw, output_bw], axis=-1)
            output = tf.reshape(output, shape=[s[0], s[1], 2 * hidden_char])
            word_embeddings = tf.concat([word_embeddings, output], axis=-1)
        word_embeddings = tf1.nn.dropout(word_embeddings, dropout)
        logits = _tagger_logits(word_embeddings, sequence_lengths, hidden,
                                tags, dtype, init, dropout)
        with tf1.variable_scope("crf", initializer=init):
            return _crf_log_likelihood(logits, labels, sequence_lengths, dtype)
    log_likelihood, xs = _new_variables(build)
    loss = -log_likelihood                                     # [B]

    def feed(rng, batch, t=None):
        t = steps if static_steps else (t or steps)
        lengths = _lengths(rng, batch, t)
        ids = rng.integers(1, vocab, [batch, t])
        ids[np.arange(t)[None, :] >= lengths[:, None]] = 0
        return {word_ids: ids, sequence_lengths: lengths,
                char_ids: rng.integers(0, nchars, [batch, t, chars]),
                word_lengths: rng.integers(1, chars + 1, [batch, t]),
                labels: rng.integers(0, tags, [batch, t]), dropout: 0.5}
    return Model(loss, xs, feed, dynamic_steps=not static_steps)


ZOO = collections.OrderedDict(
    (fn.__name__, fn) for fn in [
        mnist_softmax, mnist_deep, layers_mlp, layers_text_cnn, keras_cnn,
        keras_embedding_mean, keras_separable, keras_batch_norm_inference,
        keras_batch_norm_training, keras_transformer,
        residual_mlp_shared_weight, weight_decay_loss, official_resnet_cifar, dcgan_generator])
MODELS = collections.OrderedDict(
    (fn.__name__, fn) for fn in [transformer, bilstm_tagger, wide_deep, word2vec, ptb_lm,
                                 in_batch_negatives, in_batch_softmax, bilstm_crf])
# Issue 34's models (shapes known only at run time), apart from issue 24's
# `MODELS`: tests/per_example/test_tf1_dynamic_models.py checks them.
DYNAMIC_MODELS = collections.OrderedDict(
    (fn.__name__, fn) for fn in [unet, ctc_lstm, neurobind, attention_pooling])

# Models TF cannot build in float64 (on the CPU), and why.
FLOAT32_ONLY = dict(dict.fromkeys(
    ["keras_batch_norm_inference", "keras_batch_norm_training", "official_resnet_cifar",
     "dcgan_generator"], "TF's FusedBatchNorm kernels take float32 (not float64)"),
    wide_deep="feature columns make float32 variables (embedding and linear-model weights "
              "take no dtype)",
    word2vec="nce_loss's candidate sampler returns float32 expected counts, which it "
             "subtracts from the logits")


def initializer():
    """The op that initializes a model's variables and lookup tables
    (`wide_deep`'s vocabulary list is a hash table)."""
    return tf.group(tf1.global_variables_initializer(), tf1.tables_initializer())


def has_keras_layers():
    """Whether this TF has the Keras 2 layers the zoo uses (tf-keras, or TF's
    own Keras 2 up to 2.15) and `tf.compat.v1.layers`."""
    try:
        return hasattr(tf.keras.layers, "MultiHeadAttention") and callable(tf1.layers.dense)
    except (ImportError, AttributeError):
        return False


def has_tf1_layers():
    """Whether `tf.compat.v1.layers` and the v1 RNN cells are usable here
    (TF 2.16+ needs the tf-keras package and TF_USE_LEGACY_KERAS=1)."""
    try:
        return callable(tf1.layers.dense) and callable(tf1.nn.rnn_cell.LSTMCell)
    except (ImportError, AttributeError):
        return False
