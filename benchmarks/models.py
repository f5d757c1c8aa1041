"""Benchmark models: one numpy parameter set and data set, three frameworks.

TensorFlow, JAX and PyTorch build the same models from the same seeded
numpy arrays (`init_params`, `make_batch`), so their numbers compare one to
one. Here: the framework-free part and the TF graphs; the JAX and PyTorch
forms live with their systems (benchmarks/systems/). Layout is TF's: dense
kernels [D_in, D_out], conv kernels [H, W, C_in, C_out], NHWC images. Each
model maps (x [B, ...], y [B] labels) to the per-example loss [B] (sparse
softmax cross-entropy, not averaged). TF is imported lazily (peer workers).
"""
import collections

import numpy as np

NUM_CLASSES = 10

# Text classifier (embedding + mean-pool).
TEXT_VOCAB, TEXT_DIM, TEXT_LEN = 5000, 64, 32
# LSTM over float features.
LSTM_STEPS, LSTM_IN, LSTM_HIDDEN = 16, 32, 64
# One transformer block.
TR_VOCAB, TR_LEN, TR_DIM, TR_HEADS, TR_FF = 1000, 16, 64, 4, 128
LN_EPS = 1e-5

# name -> (shape, init kind). Init kinds: "w" Glorot uniform, "b" small normal,
# "emb" normal(0, 0.1), "gamma" 1 + small normal, "beta" small normal.
ParamSpec = collections.namedtuple("ParamSpec", "name shape init")

_SPECS = {
    "softmax": [
        ParamSpec("w", (784, NUM_CLASSES), "w"),
        ParamSpec("b", (NUM_CLASSES,), "b"),
    ],
    "mlp": [
        ParamSpec("w1", (784, 256), "w"), ParamSpec("b1", (256,), "b"),
        ParamSpec("w2", (256, 256), "w"), ParamSpec("b2", (256,), "b"),
        ParamSpec("w3", (256, NUM_CLASSES), "w"),
        ParamSpec("b3", (NUM_CLASSES,), "b"),
    ],
    "cnn": [
        ParamSpec("conv1_w", (5, 5, 1, 16), "w"), ParamSpec("conv1_b", (16,), "b"),
        ParamSpec("conv2_w", (5, 5, 16, 32), "w"), ParamSpec("conv2_b", (32,), "b"),
        ParamSpec("dense_w", (7 * 7 * 32, NUM_CLASSES), "w"),
        ParamSpec("dense_b", (NUM_CLASSES,), "b"),
    ],
    "text": [
        ParamSpec("emb", (TEXT_VOCAB, TEXT_DIM), "emb"),
        ParamSpec("dense_w", (TEXT_DIM, NUM_CLASSES), "w"),
        ParamSpec("dense_b", (NUM_CLASSES,), "b"),
    ],
    "lstm": [
        ParamSpec("kernel", (LSTM_IN + LSTM_HIDDEN, 4 * LSTM_HIDDEN), "w"),
        ParamSpec("bias", (4 * LSTM_HIDDEN,), "b"),
        ParamSpec("dense_w", (LSTM_HIDDEN, NUM_CLASSES), "w"),
        ParamSpec("dense_b", (NUM_CLASSES,), "b"),
    ],
    "transformer": [
        ParamSpec("tok_emb", (TR_VOCAB, TR_DIM), "emb"),
        ParamSpec("pos_emb", (TR_LEN, TR_DIM), "emb"),
        ParamSpec("ln1_g", (TR_DIM,), "gamma"), ParamSpec("ln1_b", (TR_DIM,), "beta"),
        ParamSpec("wq", (TR_DIM, TR_DIM), "w"),
        ParamSpec("wk", (TR_DIM, TR_DIM), "w"),
        ParamSpec("wv", (TR_DIM, TR_DIM), "w"),
        ParamSpec("wo", (TR_DIM, TR_DIM), "w"), ParamSpec("bo", (TR_DIM,), "b"),
        ParamSpec("ln2_g", (TR_DIM,), "gamma"), ParamSpec("ln2_b", (TR_DIM,), "beta"),
        ParamSpec("w1", (TR_DIM, TR_FF), "w"), ParamSpec("b1", (TR_FF,), "b"),
        ParamSpec("w2", (TR_FF, TR_DIM), "w"), ParamSpec("b2", (TR_DIM,), "b"),
        ParamSpec("out_w", (TR_DIM, NUM_CLASSES), "w"),
        ParamSpec("out_b", (NUM_CLASSES,), "b"),
    ],
    # Last, so the seeds of the models above (from their index) stay put.
    "gru": [
        ParamSpec("kernel", (LSTM_IN, 3 * LSTM_HIDDEN), "w"),
        ParamSpec("recurrent", (LSTM_HIDDEN, 3 * LSTM_HIDDEN), "w"),
        ParamSpec("bias", (3 * LSTM_HIDDEN,), "b"),
        ParamSpec("dense_w", (LSTM_HIDDEN, NUM_CLASSES), "w"),
        ParamSpec("dense_b", (NUM_CLASSES,), "b"),
    ],
    # Every weight meets batch data inside the loop through an op custagg has
    # no per-example rule for (SquaredDifference, Pow): only pfor knows them.
    "norule_rnn": [
        ParamSpec("center", (LSTM_IN,), "b"),
        ParamSpec("power", (LSTM_IN,), "gamma"),
        ParamSpec("protos", (NUM_CLASSES, LSTM_IN), "emb"),
    ],
    # tf.keras LSTM / GRU layers (Keras 2, graph mode) on the same sizes as
    # lstm / gru, in Keras's weight layout; the dense head as above.
    "keras_lstm": [
        ParamSpec("kernel", (LSTM_IN, 4 * LSTM_HIDDEN), "w"),
        ParamSpec("recurrent_kernel", (LSTM_HIDDEN, 4 * LSTM_HIDDEN), "w"),
        ParamSpec("bias", (4 * LSTM_HIDDEN,), "b"),
        ParamSpec("dense_w", (LSTM_HIDDEN, NUM_CLASSES), "w"),
        ParamSpec("dense_b", (NUM_CLASSES,), "b"),
    ],
    "keras_gru": [
        ParamSpec("kernel", (LSTM_IN, 3 * LSTM_HIDDEN), "w"),
        ParamSpec("recurrent_kernel", (LSTM_HIDDEN, 3 * LSTM_HIDDEN), "w"),
        ParamSpec("bias", (2, 3 * LSTM_HIDDEN), "b"),     # reset_after: input, recurrent
        ParamSpec("dense_w", (LSTM_HIDDEN, NUM_CLASSES), "w"),
        ParamSpec("dense_b", (NUM_CLASSES,), "b"),
    ],
}

MODELS = tuple(_SPECS)
# Issue 11's loop models beyond lstm/gru, run by `python -m benchmarks
# --control-flow` (or --models), not by the default full run.
CONTROL_FLOW_ONLY = ("norule_rnn", "keras_lstm", "keras_gru")
# The models whose TF graph comes from a tf.keras recurrent layer.
KERAS_RNN = {"keras_lstm": "LSTM", "keras_gru": "GRU"}


def param_specs(model):
    """The ordered parameter list of `model` (a list of ParamSpec)."""
    try:
        return _SPECS[model]
    except KeyError:
        raise ValueError("unknown model %r; choose from %s" % (model, ", ".join(MODELS)))


def init_params(model, seed=0):
    """Seeded numpy parameters, an OrderedDict name -> float32 array."""
    rng = np.random.RandomState(1000 + seed + MODELS.index(model))
    params = collections.OrderedDict()
    for spec in param_specs(model):
        shape = spec.shape
        if spec.init == "w":
            receptive = int(np.prod(shape[:-2])) if len(shape) > 2 else 1
            fan_in, fan_out = shape[-2] * receptive, shape[-1] * receptive
            limit = np.sqrt(6.0 / (fan_in + fan_out))
            value = rng.uniform(-limit, limit, size=shape)
        elif spec.init == "emb":
            value = rng.normal(0.0, 0.1, size=shape)
        elif spec.init == "gamma":
            value = 1.0 + rng.normal(0.0, 0.1, size=shape)
        else:  # "b", "beta": non-zero so bias gradients matter in the checks
            value = rng.normal(0.0, 0.1, size=shape)
        params[spec.name] = value.astype(np.float32)
    return params


def input_spec(model):
    """(per-example x shape, dtype name) of `model`'s input."""
    return {
        "softmax": ((784,), "float32"),
        "mlp": ((784,), "float32"),
        "cnn": ((28, 28, 1), "float32"),
        "text": ((TEXT_LEN,), "int32"),
        "lstm": ((LSTM_STEPS, LSTM_IN), "float32"),
        "gru": ((LSTM_STEPS, LSTM_IN), "float32"),
        "norule_rnn": ((LSTM_STEPS, LSTM_IN), "float32"),
        "keras_lstm": ((LSTM_STEPS, LSTM_IN), "float32"),
        "keras_gru": ((LSTM_STEPS, LSTM_IN), "float32"),
        "transformer": ((TR_LEN,), "int32"),
    }[model]


def make_batch(model, batch_size, seed=0):
    """Seeded data (x [B, ...], y [B] int32). Same seed -> same arrays."""
    rng = np.random.RandomState(2000 + seed + MODELS.index(model))
    shape, dtype = input_spec(model)
    if dtype == "int32":
        vocab = TEXT_VOCAB if model == "text" else TR_VOCAB
        x = rng.randint(0, vocab, size=(batch_size,) + shape).astype(np.int32)
    else:
        x = rng.normal(0.0, 1.0, size=(batch_size,) + shape).astype(np.float32)
    y = rng.randint(0, NUM_CLASSES, size=(batch_size,)).astype(np.int32)
    return x, y


# --------------------------------------------------------------------------
# TensorFlow graph builders. `p` maps parameter names to tf.Variables or
# tensors; x, y are tensors of any batch size (1 inside vectorized_map).
# --------------------------------------------------------------------------

def tf_loss(model, p, x, y):
    """Per-example loss vector [B] of `model` in the current TF graph."""
    import tensorflow as tf
    logits = _TF_FORWARD[model](tf, p, x)
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)


def _tf_dense(tf, h, w, b):
    return tf.nn.bias_add(tf.matmul(h, w), b)


def _tf_softmax(tf, p, x):
    return _tf_dense(tf, x, p["w"], p["b"])


def _tf_mlp(tf, p, x):
    h = tf.nn.relu(_tf_dense(tf, x, p["w1"], p["b1"]))
    h = tf.nn.relu(_tf_dense(tf, h, p["w2"], p["b2"]))
    return _tf_dense(tf, h, p["w3"], p["b3"])


def _tf_cnn(tf, p, x):
    h = tf.nn.conv2d(x, p["conv1_w"], strides=1, padding="SAME")
    h = tf.nn.relu(tf.nn.bias_add(h, p["conv1_b"]))
    h = tf.nn.max_pool2d(h, ksize=2, strides=2, padding="VALID")
    h = tf.nn.conv2d(h, p["conv2_w"], strides=1, padding="SAME")
    h = tf.nn.relu(tf.nn.bias_add(h, p["conv2_b"]))
    h = tf.nn.max_pool2d(h, ksize=2, strides=2, padding="VALID")
    h = tf.reshape(h, [-1, 7 * 7 * 32])
    return _tf_dense(tf, h, p["dense_w"], p["dense_b"])


def _tf_text(tf, p, x):
    e = tf.gather(p["emb"], x)                      # [B, L, D]; sparse gradient
    return _tf_dense(tf, tf.reduce_mean(e, axis=1), p["dense_w"], p["dense_b"])


def _tf_lstm(tf, p, x):
    x_tm = tf.transpose(x, [1, 0, 2])               # [T, B, D]
    batch = tf.shape(x)[0]
    h0 = tf.zeros(tf.stack([batch, LSTM_HIDDEN]))
    kernel, bias = p["kernel"], p["bias"]

    def body(t, h, c):
        z = tf.nn.bias_add(tf.matmul(tf.concat([tf.gather(x_tm, t), h], axis=1), kernel), bias)
        i, f, g, o = tf.split(z, 4, axis=1)
        c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
        h = tf.sigmoid(o) * tf.tanh(c)
        return t + 1, h, c

    _, h, _ = tf.compat.v1.while_loop(lambda t, h, c: t < LSTM_STEPS, body,
                                      (tf.constant(0), h0, h0))
    return _tf_dense(tf, h, p["dense_w"], p["dense_b"])


def _tf_gru(tf, p, x):
    x_tm = tf.transpose(x, [1, 0, 2])               # [T, B, D]
    h0 = tf.zeros(tf.stack([tf.shape(x)[0], LSTM_HIDDEN]))

    def body(t, h):
        xz, xr, xn = tf.split(tf.nn.bias_add(tf.matmul(tf.gather(x_tm, t), p["kernel"]),
                                             p["bias"]), 3, axis=1)
        hz, hr, hn = tf.split(tf.matmul(h, p["recurrent"]), 3, axis=1)
        z = tf.sigmoid(xz + hz)
        r = tf.sigmoid(xr + hr)
        n = tf.tanh(xn + r * hn)
        return t + 1, (1.0 - z) * n + z * h

    _, h = tf.compat.v1.while_loop(lambda t, h: t < LSTM_STEPS, body, (tf.constant(0), h0))
    return _tf_dense(tf, h, p["dense_w"], p["dense_b"])


def _tf_norule_rnn(tf, p, x):
    x_tm = tf.transpose(x, [1, 0, 2])               # [T, B, D]
    h0 = tf.zeros(tf.stack([tf.shape(x)[0], LSTM_IN]))
    acc0 = tf.zeros(tf.stack([tf.shape(x)[0], NUM_CLASSES]))

    def body(t, h, acc):
        # Pow(batch, weight) and SquaredDifference(batch, weight): no rule.
        k = tf.math.pow(tf.math.reciprocal(
            1.0 + tf.math.squared_difference(tf.gather(x_tm, t), p["center"])), p["power"])
        h = 0.5 * h + 0.5 * tf.tanh(k - 0.5)
        score = -tf.reduce_sum(tf.math.squared_difference(h[:, None, :], p["protos"]), axis=2)
        return t + 1, h, acc + score

    _, _, acc = tf.compat.v1.while_loop(lambda t, h, acc: t < LSTM_STEPS, body,
                                        (tf.constant(0), h0, acc0))
    return acc * (1.0 / LSTM_STEPS)


def _tf_keras_rnn(tf, p, x):
    # The layer of `tf_variables` (its variables are p's), called again on
    # every x: inside tf.vectorized_map too.
    return _tf_dense(tf, p.keras_layer(x), p["dense_w"], p["dense_b"])


def _keras(tf):
    """Keras 2: tf_keras where TF's own tf.keras is Keras 3 (TF >= 2.16),
    which has no graph mode."""
    try:
        import tf_keras
        return tf_keras
    except ImportError:
        return tf.keras


def _tf_layer_norm(tf, h, gamma, beta):
    # Written with Mul/Add (no fused op) so per-example rules can see through it.
    mu = tf.reduce_mean(h, axis=-1, keepdims=True)
    d = h - mu
    var = tf.reduce_mean(d * d, axis=-1, keepdims=True)
    return d * tf.math.rsqrt(var + LN_EPS) * gamma + beta


def _tf_transformer(tf, p, x):
    dh = TR_DIM // TR_HEADS
    h = tf.gather(p["tok_emb"], x) + p["pos_emb"]   # [B, T, D]
    a = _tf_layer_norm(tf, h, p["ln1_g"], p["ln1_b"])

    def heads(w):
        return tf.reshape(tf.einsum("btd,de->bte", a, w), [-1, TR_LEN, TR_HEADS, dh])

    q, k, v = heads(p["wq"]), heads(p["wk"]), heads(p["wv"])
    scores = tf.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / np.sqrt(dh))
    att = tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(scores, axis=-1), v)
    att = tf.reshape(att, [-1, TR_LEN, TR_DIM])
    h = h + tf.einsum("btd,de->bte", att, p["wo"]) + p["bo"]
    m = _tf_layer_norm(tf, h, p["ln2_g"], p["ln2_b"])
    m = tf.nn.relu(tf.einsum("btd,df->btf", m, p["w1"]) + p["b1"])
    h = h + tf.einsum("btf,fd->btd", m, p["w2"]) + p["b2"]
    return _tf_dense(tf, tf.reduce_mean(h, axis=1), p["out_w"], p["out_b"])


_TF_FORWARD = {
    "softmax": _tf_softmax, "mlp": _tf_mlp, "cnn": _tf_cnn, "text": _tf_text,
    "lstm": _tf_lstm, "gru": _tf_gru, "transformer": _tf_transformer,
    "norule_rnn": _tf_norule_rnn,
    "keras_lstm": _tf_keras_rnn, "keras_gru": _tf_keras_rnn,
}


# Models whose TensorFlow graphs are built on `[None, ...]` placeholders (see
# `tf_placeholders`): loop models, as users feed them. custagg's per-example
# copy of the forward pass ("recompute", the O(B) form for variables inside a
# while loop) refuses a static batch > 1, whose size TF folds into constants.
DYNAMIC_BATCH_MODELS = ("lstm", "gru", "norule_rnn", "keras_lstm", "keras_gru")


def tf_placeholders(model, batch_size, dynamic=False):
    """Placeholders (x [B, ...], y [B]).

    Args:
      batch_size: the static leading dimension, or with `dynamic=True` only
        the size that will be fed (the placeholders' leading dimension is
        None). Per-example loops over `loss[i]` need the static form.
    """
    import tensorflow as tf
    shape, dtype = input_spec(model)
    lead = None if dynamic else batch_size
    x = tf.compat.v1.placeholder(getattr(tf, dtype), (lead,) + shape, name="x")
    y = tf.compat.v1.placeholder(tf.int32, (lead,), name="y")
    return x, y


class Variables(collections.OrderedDict):
    """name -> tf.Variable; `keras_layer`: the Keras layer that owns some of
    them (KERAS_RNN models), else None."""
    keras_layer = None


def tf_variables(model, seed=0):
    """Resource variables initialised from `init_params` (Variables, list)."""
    import tensorflow as tf
    params = init_params(model, seed)
    variables = Variables()
    if model in KERAS_RNN:
        keras = _keras(tf)
        cls = getattr(keras.layers, KERAS_RNN[model])
        extra = {"unit_forget_bias": False} if cls is keras.layers.LSTM else {}
        layer = cls(LSTM_HIDDEN, name=model,
                    kernel_initializer=keras.initializers.Constant(params["kernel"]),
                    recurrent_initializer=keras.initializers.Constant(
                        params["recurrent_kernel"]),
                    bias_initializer=keras.initializers.Constant(params["bias"]), **extra)
        layer.build((None, LSTM_STEPS, LSTM_IN))
        cell = layer.cell
        variables.update(kernel=cell.kernel, recurrent_kernel=cell.recurrent_kernel,
                         bias=cell.bias)
        variables.keras_layer = layer
    for name, value in params.items():
        if name not in variables:
            variables[name] = tf.Variable(value, name=name)
    return variables, list(variables.values())


# --------------------------------------------------------------------------
# The other model sets: graphs as users write them (`--zoo`,
# benchmarks/zoo_models.py) and other people's TF1 models (`--tf1-models`,
# benchmarks/tf1_models.py), each a builder `(dtype, rng, full)`.
# --------------------------------------------------------------------------

HARNESS_ZOO = ("cnn", "mlp", "text")   # the harness's models `build` builds too (--profile)


def builders():
    """name -> builder `(dtype, rng, full)`: the zoo, then the TF1 models
    (static shapes, then issue 34's dynamic ones). Imports TensorFlow."""
    import os
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")   # their Keras 2 layers
    from benchmarks import tf1_models, zoo_models
    out = collections.OrderedDict(zoo_models.ZOO)
    for table in (tf1_models.MODELS, tf1_models.DYNAMIC_MODELS):
        for name, build_model in table.items():
            out.setdefault(name, build_model)
    return out


def build(name, full=True):
    """(loss `[B]`, xs, feed(batch) -> feed dict, coupled variable names) of
    model `name` (a builder's, or one of HARNESS_ZOO) in float32 with a
    dynamic batch, in the default graph."""
    import tensorflow as tf
    if name in HARNESS_ZOO:
        x, y = tf_placeholders(name, None, dynamic=True)
        variables, xs = tf_variables(name)
        return (tf_loss(name, variables, x, y), xs,
                lambda batch: dict(zip((x, y), make_batch(name, batch))), ())
    tf.compat.v1.set_random_seed(3)
    model = builders()[name](tf.float32, np.random.default_rng(3), full=full)
    return (model.loss, model.xs,
            lambda batch: model.feed(np.random.default_rng(batch), batch), model.coupled)
