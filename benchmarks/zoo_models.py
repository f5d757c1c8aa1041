"""Graphs written the way users write them, each with a dynamic batch.

Used by the tests (`tests/test_zoo.py`, small sizes) and `python -m
benchmarks --zoo` (`full=True`: the tutorials' sizes, MNIST's 28x28). A
builder takes `(dtype, rng, full=False)`, makes its variables and
`[None, ...]` placeholders in the default graph and returns a `Model`: `loss`
`[B]` (what the tutorial averages), `xs`, `feed(rng, batch)` and `coupled`,
the variables whose examples truly interact (batch statistics: "auto" must
not use rules for them, "rules" must refuse them; every other one gets
"rules"). The TF1 tutorials keep their code as written (dense one-hot labels,
an unshaped `keep_prob`, `tf.reshape(x, [-1, 28, 28, 1])`).
"""

import collections
import contextlib

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1


class Model(collections.namedtuple("Model", ["loss", "xs", "feed", "coupled", "dynamic_steps"])):
    """`dynamic_steps` (benchmarks.tf1_models): `feed(rng, batch, t)` takes
    a sequence length `t` too."""

    def __new__(cls, loss, xs, feed, coupled=(), dynamic_steps=False):
        return super(Model, cls).__new__(cls, loss, list(xs), feed,
                                         frozenset(coupled), dynamic_steps)


def _one_hot(rng, batch, classes):
    return np.eye(classes)[rng.integers(0, classes, batch)]


def _keras():
    # tf.keras is Keras 2 (tf-keras) under TF_USE_LEGACY_KERAS=1; graph-mode
    # layers on placeholders need it.
    return tf.keras


@contextlib.contextmanager
def _keras_floatx(dtype):
    """Keras' default float type is `dtype` within the block.

    Keras 2.12's MultiHeadAttention does not pass its `dtype=` on to the
    EinsumDense sublayers it builds at the first call, which take the default
    (float32): a float64 block then fails adding float32 to float64. Later
    Keras releases pass it on, so there this changes nothing.
    """
    keras = _keras()
    saved = keras.backend.floatx()
    keras.backend.set_floatx(tf.as_dtype(dtype).name)
    try:
        yield
    finally:
        keras.backend.set_floatx(saved)


# --------------------------------------------------------------------------
# TensorFlow's TF1 tutorials, as written


def mnist_softmax(dtype, rng, full=False):
    """tensorflow/examples/tutorials/mnist/mnist_softmax.py."""
    pixels = 784 if full else 64
    x = tf1.placeholder(dtype, [None, pixels])
    W = tf.Variable(0.1 * rng.normal(size=[pixels, 10]), dtype=dtype, name="W")
    b = tf.Variable(tf.zeros([10], dtype), name="b")
    y = tf.matmul(x, W) + b
    y_ = tf1.placeholder(dtype, [None, 10])
    # The tutorial: tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
    #     labels=y_, logits=y)); the per-example loss is what it averages.
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


# --------------------------------------------------------------------------
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
    x = tf1.placeholder(dtype, [None, width])
    labels = tf1.placeholder(tf.int32, [None])
    init = _glorot(rng)

    def build():
        h = tf1.layers.dense(x, hidden, activation=tf.nn.relu,
                             kernel_initializer=init, name="dense1")
        return tf1.layers.dense(h, 5, kernel_initializer=init, name="dense2")
    logits, xs = _new_variables(build)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)

    def feed(rng, batch):
        return {x: rng.normal(size=[batch, width]), labels: rng.integers(0, 5, batch)}
    return Model(loss, xs, feed)


def layers_text_cnn(dtype, rng, full=False):
    """Embedding lookup, tf.compat.v1.layers.conv1d, max over time, dense."""
    vocab, dim, steps, filters = (5000, 64, 32, 64) if full else (20, 6, 7, 5)
    ids = tf1.placeholder(tf.int32, [None, steps])
    labels = tf1.placeholder(tf.int32, [None])
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

    def feed(rng, batch):
        return {ids: rng.integers(0, vocab, [batch, steps]), labels: rng.integers(0, 3, batch)}
    return Model(loss, xs, feed)


# --------------------------------------------------------------------------
# tf.keras layers called on placeholders (graph mode)


def _keras_model(dtype, rng, input_shape, layers, labels_count, ids=False):
    """Applies `layers` (a list of Keras layers) to a `[None, *input_shape]`
    placeholder; sparse softmax cross-entropy on `labels_count` classes."""
    x = tf1.placeholder(tf.int32 if ids else dtype, [None] + list(input_shape))
    labels = tf1.placeholder(tf.int32, [None])
    h = x
    for layer in layers:
        h = layer(h)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=h)
    xs = [v for layer in layers for v in layer.trainable_weights]

    def feed(rng, batch):
        data = (rng.integers(0, 20, [batch] + list(input_shape)) if ids
                else rng.normal(size=[batch] + list(input_shape)))
        return {x: data, labels: rng.integers(0, labels_count, batch)}
    return loss, xs, feed


def _init(rng):
    return tf.keras.initializers.GlorotUniform(seed=int(rng.integers(1 << 30)))


def keras_cnn(dtype, rng, full=False):
    side, filters = (28, 32) if full else (8, 4)
    k = _keras().layers
    layers = [k.Conv2D(filters, 3, activation="relu", dtype=dtype,
                       kernel_initializer=_init(rng)),
              k.MaxPooling2D(2, dtype=dtype), k.Flatten(dtype=dtype),
              k.Dense(6, dtype=dtype, kernel_initializer=_init(rng))]
    return Model(*_keras_model(dtype, rng, [side, side, 1], layers, 6))


def keras_embedding_mean(dtype, rng, full=False):
    vocab, dim, steps = (5000, 64, 32) if full else (20, 6, 5)
    k = _keras().layers
    layers = [k.Embedding(vocab, dim, dtype=dtype,
                          embeddings_initializer=_init(rng)),
              k.GlobalAveragePooling1D(dtype=dtype),
              k.Dense(4, dtype=dtype, kernel_initializer=_init(rng))]
    return Model(*_keras_model(dtype, rng, [steps], layers, 4, ids=True))


def keras_separable(dtype, rng, full=False):
    side, filters = (28, 32) if full else (6, 4)
    k = _keras().layers
    layers = [k.SeparableConv2D(filters, 3, padding="same", activation="relu",
                                dtype=dtype,
                                depthwise_initializer=_init(rng),
                                pointwise_initializer=_init(rng)),
              k.DepthwiseConv2D(3, depth_multiplier=2, dtype=dtype,
                                depthwise_initializer=_init(rng)),
              k.Flatten(dtype=dtype),
              k.Dense(3, dtype=dtype, kernel_initializer=_init(rng))]
    return Model(*_keras_model(dtype, rng, [side, side, 2], layers, 3))


def _batch_norm_model(dtype, rng, training, full):
    side, filters = (28, 32) if full else (6, 4)
    k = _keras().layers
    conv = k.Conv2D(filters, 3, dtype=dtype, kernel_initializer=_init(rng))
    bn = k.BatchNormalization(dtype=dtype, beta_initializer=_init(rng),
                              gamma_initializer=_init(rng))
    rest = [k.Flatten(dtype=dtype), k.Dense(3, dtype=dtype, kernel_initializer=_init(rng))]
    x = tf1.placeholder(dtype, [None, side, side, 2])
    labels = tf1.placeholder(tf.int32, [None])
    h = bn(tf.nn.relu(conv(x)), training=training)
    for layer in rest:
        h = layer(h)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=h)
    xs = conv.trainable_weights + bn.trainable_weights + [
        v for layer in rest for v in layer.trainable_weights]

    def feed(rng, batch):
        return {x: rng.normal(size=[batch, side, side, 2]), labels: rng.integers(0, 3, batch)}
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
    k = _keras().layers
    x = tf1.placeholder(dtype, [None, steps, dim])
    labels = tf1.placeholder(tf.int32, [None])
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

    def feed(rng, batch):
        return {x: rng.normal(size=[batch, steps, dim]), labels: rng.integers(0, 3, batch)}
    return Model(loss, xs, feed)


# --------------------------------------------------------------------------
# Hand-written graphs users write


def residual_mlp_shared_weight(dtype, rng, full=False):
    """A residual MLP whose hidden weight is used twice."""
    width, hidden = (784, 256) if full else (6, 5)
    x = tf1.placeholder(dtype, [None, width])
    labels = tf1.placeholder(tf.int32, [None])
    w_in = tf.Variable(0.4 * rng.normal(size=[width, hidden]), dtype=dtype)
    w = tf.Variable(0.4 * rng.normal(size=[hidden, hidden]), dtype=dtype)
    c = tf.Variable(0.1 * rng.normal(size=[hidden]), dtype=dtype)
    w_out = tf.Variable(0.4 * rng.normal(size=[hidden, 3]), dtype=dtype)
    h = tf.tanh(tf.matmul(x, w_in))
    h = h + tf.nn.relu(tf.matmul(h, w) + c)
    h = h + tf.nn.relu(tf.matmul(h, w) + c)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=tf.matmul(h, w_out))

    def feed(rng, batch):
        return {x: rng.normal(size=[batch, width]), labels: rng.integers(0, 3, batch)}
    return Model(loss, [w_in, w, c, w_out], feed)


def weight_decay_loss(dtype, rng, full=False):
    """Cross-entropy plus an `l2_loss` weight-decay term on each example."""
    width, hidden = (784, 256) if full else (6, 5)
    x = tf1.placeholder(dtype, [None, width])
    labels = tf1.placeholder(tf.int32, [None])
    w1 = tf.Variable(0.4 * rng.normal(size=[width, hidden]), dtype=dtype)
    b1 = tf.Variable(tf.zeros([hidden], dtype))
    w2 = tf.Variable(0.4 * rng.normal(size=[hidden, 3]), dtype=dtype)
    logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2)
    loss = (tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                           logits=logits)
            + 1e-2 * (tf.nn.l2_loss(w1) + tf.nn.l2_loss(w2)))

    def feed(rng, batch):
        return {x: rng.normal(size=[batch, width]), labels: rng.integers(0, 3, batch)}
    return Model(loss, [w1, b1, w2], feed)


# --------------------------------------------------------------------------
# The official models' CIFAR-10 ResNet (tensorflow/models,
# official/r1/resnet/resnet_model.py), v1 building blocks, inference-mode
# fused batch norm


def official_resnet_cifar(dtype, rng, full=False):
    """resnet_model.py's `Model` as `cifar10_main.Cifar10Model` builds it
    (resnet_size 8: one v1 building block per block layer, 32 variables),
    with `training=False` (fused batch norm on the moving statistics)."""
    side, num_filters = (32, 16) if full else (8, 4)
    resnet_size, data_format = 8, "channels_last"
    num_blocks = (resnet_size - 2) // 6
    training = False
    init_seed = int(rng.integers(1 << 30))

    def batch_norm(inputs, training, data_format):
        return tf1.layers.batch_normalization(
            inputs=inputs, axis=1 if data_format == "channels_first" else 3,
            momentum=0.997, epsilon=1e-5, center=True, scale=True,
            training=training, fused=True)

    def fixed_padding(inputs, kernel_size, data_format):
        pad_total = kernel_size - 1
        pad_beg = pad_total // 2
        pad_end = pad_total - pad_beg
        if data_format == "channels_first":
            return tf.pad(inputs, [[0, 0], [0, 0], [pad_beg, pad_end], [pad_beg, pad_end]])
        return tf.pad(inputs, [[0, 0], [pad_beg, pad_end], [pad_beg, pad_end], [0, 0]])

    def conv2d_fixed_padding(inputs, filters, kernel_size, strides, data_format):
        if strides > 1:
            inputs = fixed_padding(inputs, kernel_size, data_format)
        return tf1.layers.conv2d(
            inputs=inputs, filters=filters, kernel_size=kernel_size,
            strides=strides, padding=("SAME" if strides == 1 else "VALID"),
            use_bias=False,
            kernel_initializer=tf1.variance_scaling_initializer(
                seed=init_seed),
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
            inputs = images
            if data_format == "channels_first":
                inputs = tf.transpose(inputs, [0, 3, 1, 2])
            inputs = conv2d_fixed_padding(inputs, num_filters, 3, 1, data_format)
            inputs = tf.identity(inputs, "initial_conv")
            inputs = batch_norm(inputs, training, data_format)
            inputs = tf.nn.relu(inputs)
            for i, strides in enumerate([1, 2, 2]):
                inputs = block_layer(inputs, num_filters * (2 ** i),
                                     num_blocks, strides, training,
                                     "block_layer%d" % (i + 1), data_format)
            axes = [2, 3] if data_format == "channels_first" else [1, 2]
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


# --------------------------------------------------------------------------
# A DCGAN generator (TF's DCGAN tutorial's make_generator_model, in
# tf.compat.v1.layers): transposed convolutions


def dcgan_generator(dtype, rng, full=False):
    """Dense -> [7, 7, 256] -> conv2d_transpose 5x5 (strides 1, 2, 2) to a
    28x28 image, inference-mode batch norm and leaky ReLUs between; the
    per-example loss is the squared error to a target image (a decoder
    trained to reconstruct)."""
    noise_dim, side, widths = (100, 7, (256, 128, 64)) if full else \
        (6, 2, (8, 6, 4))
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


ZOO = collections.OrderedDict(
    (fn.__name__, fn) for fn in [
        mnist_softmax, mnist_deep, layers_mlp, layers_text_cnn, keras_cnn,
        keras_embedding_mean, keras_separable, keras_batch_norm_inference,
        keras_batch_norm_training, keras_transformer,
        residual_mlp_shared_weight, weight_decay_loss,
        official_resnet_cifar, dcgan_generator])

# Models TF cannot build in float64 on the CPU.
FLOAT32_ONLY = {
    "keras_batch_norm_inference": "TF's FusedBatchNorm kernels take float32 "
                                  "(not float64)",
    "keras_batch_norm_training": "TF's FusedBatchNorm kernels take float32 "
                                 "(not float64)",
    "official_resnet_cifar": "TF's FusedBatchNorm kernels take float32 "
                             "(not float64)",
    "dcgan_generator": "TF's FusedBatchNorm kernels take float32 (not "
                       "float64)",
}


def has_keras_layers():
    """Whether this TF has the Keras 2 layers the zoo uses (tf-keras, or TF's
    own Keras 2 up to 2.15) and `tf.compat.v1.layers`."""
    try:
        return hasattr(tf.keras.layers, "MultiHeadAttention") and callable(
            tf.compat.v1.layers.dense)
    except (ImportError, AttributeError):
        return False
