"""The main job's models: graph-mode TF1 code, variables from
`tf.compat.v1.get_variable`."""

import numpy as np
import tensorflow as tf

MODELS = ("softmax", "mlp", "cnn")


def build_model(name, x, image_shape, num_classes, hidden=128, seed=0):
    """Logits `[N, num_classes]` for flattened images `x` `[N, D]`.

    Variables are created with `tf.compat.v1.get_variable` under
    `AUTO_REUSE`, so calling this again (e.g. for an evaluation placeholder
    of another batch size) shares them.

    Returns:
      `(logits, variables)`.
    """
    d = int(np.prod(image_shape))
    glorot = lambda i: tf.compat.v1.glorot_uniform_initializer(seed=seed + i)
    zeros = tf.zeros_initializer()

    def get(var_name, shape, initializer=zeros):
        return tf.compat.v1.get_variable(var_name, shape, use_resource=True,
                                         initializer=initializer)

    with tf.compat.v1.variable_scope(name, reuse=tf.compat.v1.AUTO_REUSE):
        if name == "softmax":
            # The TF1 tutorial: W and b start at zero.
            w, b = get("W", [d, num_classes]), get("b", [num_classes])
            return tf.matmul(x, w) + b, [w, b]
        if name == "mlp":
            w1, b1 = get("W1", [d, hidden], glorot(1)), get("b1", [hidden])
            w2 = get("W2", [hidden, num_classes], glorot(2))
            b2 = get("b2", [num_classes])
            h = tf.nn.relu(tf.matmul(x, w1) + b1)
            return tf.matmul(h, w2) + b2, [w1, b1, w2, b2]
        if name == "cnn":
            height, width, channels = image_shape
            k = 5 if min(height, width) >= 16 else 3
            c1 = get("conv1", [k, k, channels, 16], glorot(3))
            cb1 = get("conv1_b", [16])
            c2 = get("conv2", [k, k, 16, 32], glorot(4))
            cb2 = get("conv2_b", [32])
            h = tf.reshape(x, [-1, height, width, channels])
            for kernel, bias in ((c1, cb1), (c2, cb2)):
                h = tf.nn.relu(tf.nn.bias_add(
                    tf.nn.conv2d(h, kernel, 1, "SAME"), bias))
                h = tf.nn.max_pool2d(h, 2, 2, "SAME")
            flat_dim = ((height + 3) // 4) * ((width + 3) // 4) * 32
            w = get("W", [flat_dim, num_classes], glorot(5))
            b = get("b", [num_classes])
            logits = tf.matmul(tf.reshape(h, [-1, flat_dim]), w) + b
            return logits, [c1, cb1, c2, cb2, w, b]
    raise ValueError("build_model: unknown model %r; expected one of %s."
                     % (name, ", ".join(MODELS)))


def class_balanced_factors(labels, class_weights):
    """`f_i` proportional to `class_weights[labels[i]]`, summing to 1."""
    f = class_weights[labels].astype(np.float32)
    return f / f.sum()


def per_example_loss(args, data, batch_size):
    """The main job's graph inputs and loss for batches of `batch_size`.

    Returns:
      `(x, y, logits, variables, loss)`: placeholders x `[batch_size, D]`
      and y `[batch_size]`, the model of `args.model` on x, its variables,
      and the per-example cross-entropy `[batch_size]`.
    """
    x = tf.compat.v1.placeholder(tf.float32, [batch_size, data.num_features],
                                 name="x")
    y = tf.compat.v1.placeholder(tf.int64, [batch_size], name="y")
    logits, variables = build_model(args.model, x, data.image_shape,
                                    data.num_classes, args.hidden, args.seed)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=logits, name="per_example_loss")
    return x, y, logits, variables, loss
