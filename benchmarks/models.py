"""Benchmark models: one description, one numpy parameter set and data set, every framework.

TensorFlow, JAX and PyTorch build the same models from the same seeded
numpy arrays (`init_params`, `make_batch`), so their numbers compare one to
one. `forward` writes each model once, on a framework's `Ops` (`TfOps`
here, `jax_systems.Ops`, `torch_systems.Ops`, `keras_systems.Layers` on Keras
layers), which hold the parameters and take them by name. Layout
is TF's: dense kernels [D_in, D_out], conv kernels [H, W, C_in, C_out], NHWC
images. Each model maps (x [B, ...], y [B] labels) to the per-example loss
[B] (sparse softmax cross-entropy, not averaged). TF is imported lazily
(peer workers).
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


def _layer(w, b, shape):
    """A weight of `shape` (Glorot) and its bias (the last dimension)."""
    return [ParamSpec(w, shape, "w"), ParamSpec(b, shape[-1:], "b")]


def _weights(names, shape, init="w"):
    """Weights of one shape and init kind, their names space-separated."""
    return [ParamSpec(name, shape, init) for name in names.split()]


_H, _C, _D = LSTM_HIDDEN, NUM_CLASSES, TR_DIM
_HEAD = _layer("dense_w", "dense_b", (_H, _C))          # the recurrent models' readout
_SPECS = {
    "softmax": _layer("w", "b", (784, _C)),
    "mlp": _layer("w1", "b1", (784, 256)) + _layer("w2", "b2", (256, 256))
    + _layer("w3", "b3", (256, _C)),
    "cnn": _layer("conv1_w", "conv1_b", (5, 5, 1, 16))
    + _layer("conv2_w", "conv2_b", (5, 5, 16, 32)) + _layer("dense_w", "dense_b", (1568, _C)),
    "text": _weights("emb", (TEXT_VOCAB, TEXT_DIM), "emb")
    + _layer("dense_w", "dense_b", (TEXT_DIM, _C)),
    "lstm": _layer("kernel", "bias", (LSTM_IN + _H, 4 * _H)) + _HEAD,
    "transformer": _weights("tok_emb", (TR_VOCAB, _D), "emb")
    + _weights("pos_emb", (TR_LEN, _D), "emb")
    + _weights("ln1_g", (_D,), "gamma") + _weights("ln1_b", (_D,), "beta")
    + _weights("wq wk wv", (_D, _D)) + _layer("wo", "bo", (_D, _D))
    + _weights("ln2_g", (_D,), "gamma") + _weights("ln2_b", (_D,), "beta")
    + _layer("w1", "b1", (_D, TR_FF)) + _layer("w2", "b2", (TR_FF, _D))
    + _layer("out_w", "out_b", (_D, _C)),
    # Last, so the seeds of the models above (from their index) stay put.
    "gru": _weights("kernel", (LSTM_IN, 3 * _H)) + _weights("recurrent", (_H, 3 * _H))
    + _weights("bias", (3 * _H,), "b") + _HEAD,
    # Every weight meets batch data inside the loop through an op custagg has
    # no per-example rule for (SquaredDifference, Pow): only pfor knows them.
    "norule_rnn": _weights("center", (LSTM_IN,), "b") + _weights("power", (LSTM_IN,), "gamma")
    + _weights("protos", (_C, LSTM_IN), "emb"),
    # tf.keras LSTM / GRU layers (Keras 2, graph mode) on the same sizes as
    # lstm / gru, in Keras's weight layout (GRU's reset_after bias: input,
    # recurrent); the dense head as above.
    "keras_lstm": _weights("kernel", (LSTM_IN, 4 * _H))
    + _weights("recurrent_kernel", (_H, 4 * _H)) + _weights("bias", (4 * _H,), "b") + _HEAD,
    "keras_gru": _weights("kernel", (LSTM_IN, 3 * _H))
    + _weights("recurrent_kernel", (_H, 3 * _H)) + _weights("bias", (2, 3 * _H), "b") + _HEAD,
}

MODELS = tuple(_SPECS)
# Issue 11's loop models beyond lstm/gru, run by `python -m benchmarks
# --control-flow` (or --models), not by the default full run.
CONTROL_FLOW_ONLY = ("norule_rnn", "keras_lstm", "keras_gru")
# The models whose TF graph comes from a tf.keras recurrent layer.
KERAS_RNN = {"keras_lstm": "LSTM", "keras_gru": "GRU"}
# The recurrent models' state: the widths of what `step` carries; its
# output, `scan`'s, is the first (norule_rnn: the second, its scores).
STATE = {"lstm": (LSTM_HIDDEN, LSTM_HIDDEN), "keras_lstm": (LSTM_HIDDEN, LSTM_HIDDEN),
         "gru": (LSTM_HIDDEN,), "keras_gru": (LSTM_HIDDEN,), "norule_rnn": (LSTM_IN, NUM_CLASSES)}


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
        elif spec.init == "gamma":
            value = 1.0 + rng.normal(0.0, 0.1, size=shape)
        else:  # "emb", "b", "beta": biases non-zero so their gradients matter in the checks
            value = rng.normal(0.0, 0.1, size=shape)
        params[spec.name] = value.astype(np.float32)
    return params


def input_spec(model):
    """(per-example x shape, dtype name) of `model`'s input."""
    if model in STATE:
        return (LSTM_STEPS, LSTM_IN), "float32"
    return {"softmax": ((784,), "float32"), "mlp": ((784,), "float32"),
            "cnn": ((28, 28, 1), "float32"), "text": ((TEXT_LEN,), "int32"),
            "transformer": ((TR_LEN,), "int32")}[model]


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


# The models, once: `o` is a framework's Ops (parameters by name).

def forward(o, model, x):
    """The logits [B, NUM_CLASSES] of `model` on x [B, ...]."""
    if model == "softmax":
        return o.dense(x, "w", "b")
    if model == "mlp":
        h = o.relu(o.dense(x, "w1", "b1"))
        h = o.relu(o.dense(h, "w2", "b2"))
        return o.dense(h, "w3", "b3")
    if model == "cnn":
        h = o.images(x)
        for i in (1, 2):
            h = o.max_pool(o.relu(o.conv(h, "conv%d_w" % i, "conv%d_b" % i)))
        return o.dense(o.flatten(h), "dense_w", "dense_b")
    if model == "text":
        return o.dense(o.mean(o.embed(x, "emb"), 1), "dense_w", "dense_b")
    if model == "transformer":
        dh = TR_DIM // TR_HEADS
        h = o.add_param(o.embed(x, "tok_emb"), "pos_emb")           # [B, T, D]
        a = o.layer_norm(h, "ln1_g", "ln1_b")
        q, k, v = (o.reshape(o.dense(a, w), [-1, TR_LEN, TR_HEADS, dh]) for w in ("wq", "wk",
                                                                                  "wv"))
        w = o.softmax(o.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / np.sqrt(dh)))
        h = h + o.dense(o.reshape(o.einsum("bhqk,bkhd->bqhd", w, v), [-1, TR_LEN, TR_DIM]),
                        "wo", "bo")
        m = o.relu(o.dense(o.layer_norm(h, "ln2_g", "ln2_b"), "w1", "b1"))
        h = h + o.dense(m, "w2", "b2")
        return o.dense(o.mean(h, 1), "out_w", "out_b")
    # The recurrent models: x [B, T, D] scanned over T, `step` by step.
    if model == "norule_rnn":
        return o.scan(model, x) * (1.0 / LSTM_STEPS)
    return o.dense(o.scan(model, x), "dense_w", "dense_b")


def step(o, model, state, xt):
    """A recurrent model's next state (a tuple, widths STATE) from x_t [B, D]."""
    if model in ("lstm", "keras_lstm"):
        h, c = state
        z = (o.dense(o.concat([xt, h]), "kernel", "bias") if model == "lstm" else
             o.dense(xt, "kernel", "bias") + o.dense(h, "recurrent_kernel"))
        i, f, g, out = o.split(z, 4)
        c = o.sigmoid(f) * c + o.sigmoid(i) * o.tanh(g)
        return o.sigmoid(out) * o.tanh(c), c
    if model == "gru":
        (h,), xb, hb = state, o.dense(xt, "kernel", "bias"), o.dense(state[0], "recurrent")
    elif model == "keras_gru":      # reset_after: its bias [input, recurrent]
        (h,), bias = state, o.param("bias")
        xb, hb = o.dense(xt, "kernel") + bias[0], o.dense(h, "recurrent_kernel") + bias[1]
    else:
        # norule_rnn: Pow(batch, weight) and SquaredDifference(batch, weight):
        # no rule.
        h, acc = state
        k = o.pow(o.reciprocal(1.0 + o.sqdiff(xt, "center")), "power")
        h = 0.5 * h + 0.5 * o.tanh(k - 0.5)
        return h, acc - o.sum(o.sqdiff(h[:, None, :], "protos"), 2)
    (xz, xr, xn), (hz, hr, hn) = o.split(xb, 3), o.split(hb, 3)
    z, r = o.sigmoid(xz + hz), o.sigmoid(xr + hr)
    return ((1.0 - z) * o.tanh(xn + r * hn) + z * h,)


class Ops:
    """What every framework's ops share: parameters by name, layer norm."""

    def __init__(self, p):
        self.p = p

    def param(self, name):
        return self.p[name]

    def add_param(self, h, name):
        return h + self.p[name]

    def layer_norm(self, h, g, b):
        # Written with Mul/Add (no fused op) so per-example rules can see through it.
        d = h - self.mean(h, -1, keepdims=True)
        return d * self.rsqrt(self.mean(d * d, -1, keepdims=True) + LN_EPS) * self.p[g] + self.p[b]


class TfOps(Ops):
    """`forward` in a TF graph: `p` maps parameter names to tf.Variables or
    tensors; x, y are tensors of any batch size (1 inside vectorized_map)."""

    def __init__(self, tf, p):
        super().__init__(p)
        self.tf, nn, math = tf, tf.nn, tf.math
        self.relu, self.sigmoid, self.tanh, self.softmax = nn.relu, tf.sigmoid, tf.tanh, nn.softmax
        self.einsum, self.reshape, self.rsqrt = tf.einsum, tf.reshape, math.rsqrt
        self.reciprocal, self.images = math.reciprocal, lambda x: x
        self.mean = lambda h, axis, keepdims=False: tf.reduce_mean(h, axis, keepdims=keepdims)
        self.sum = lambda h, axis: tf.reduce_sum(h, axis=axis)
        self.concat = lambda hs: tf.concat(hs, axis=1)
        self.split = lambda h, n: tf.split(h, n, axis=1)
        self.embed = lambda ids, table: tf.gather(p[table], ids)      # a sparse gradient
        self.sqdiff = lambda h, name: math.squared_difference(h, p[name])
        self.pow = lambda h, name: math.pow(h, p[name])
        self.max_pool = lambda h: nn.max_pool2d(h, ksize=2, strides=2, padding="VALID")
        self.flatten = lambda h: tf.reshape(h, [-1, int(np.prod(h.shape[1:]))])
        self.conv = lambda h, w, b: nn.bias_add(nn.conv2d(h, p[w], strides=1, padding="SAME"),
                                                p[b])

    def dense(self, h, w, b=None):
        tf = self.tf
        if h.shape.ndims == 3:
            out = tf.einsum("btd,de->bte", h, self.p[w])
            return out if b is None else out + self.p[b]
        out = tf.matmul(h, self.p[w])
        return out if b is None else tf.nn.bias_add(out, self.p[b])

    def scan(self, model, x):
        """The output (STATE) after the last step: a `tf.compat.v1.while_loop`
        over time (a KERAS_RNN model: its layer's output)."""
        tf = self.tf
        if model in KERAS_RNN:
            # The layer of `tf_variables` (its variables are p's), called again
            # on every x: inside tf.vectorized_map too.
            return self.p.keras_layer(x)
        x_tm = tf.transpose(x, [1, 0, 2])                     # [T, B, D]
        zeros = {n: tf.zeros(tf.stack([tf.shape(x)[0], n])) for n in sorted(set(STATE[model]))}
        return tf.compat.v1.while_loop(
            lambda t, *state: t < LSTM_STEPS,
            lambda t, *state: (t + 1,) + tuple(step(self, model, state, tf.gather(x_tm, t))),
            (tf.constant(0),) + tuple(zeros[n] for n in STATE[model]))[1 + (model == "norule_rnn")]


def tf_loss(model, p, x, y):
    """Per-example loss vector [B] of `model` in the current TF graph."""
    import tensorflow as tf
    logits = forward(TfOps(tf, p), model, x)
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)


# Models whose TensorFlow graphs are built on `[None, ...]` placeholders (see
# `tf_placeholders`): loop models, as users feed them. custagg's per-example
# copy of the forward pass ("recompute", the O(B) form for variables inside a
# while loop) refuses a static batch > 1, whose size TF folds into constants.
DYNAMIC_BATCH_MODELS = ("lstm", "gru", "norule_rnn", "keras_lstm", "keras_gru")


def tf_placeholders(model, batch_size, dynamic=False):
    """Placeholders (x [B, ...], y [B]) with the static leading dimension
    `batch_size` (per-example loops over `loss[i]` need it), or None if
    `dynamic`."""
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
        try:    # Keras 2: tf_keras where tf.keras is Keras 3 (TF >= 2.16, no graph mode)
            import tf_keras as keras
        except ImportError:
            keras = tf.keras
        cls = getattr(keras.layers, KERAS_RNN[model])
        extra = {"unit_forget_bias": False} if cls is keras.layers.LSTM else {}
        layer = cls(LSTM_HIDDEN, name=model,
                    kernel_initializer=keras.initializers.Constant(params["kernel"]),
                    recurrent_initializer=keras.initializers.Constant(params["recurrent_kernel"]),
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


# The other model sets (benchmarks/zoo_models.py): graphs as users write them
# (`--zoo`) and other people's TF1 models (`--tf1-models`), each a builder
# `(dtype, rng, full)`.

HARNESS_ZOO = ("cnn", "mlp", "text")   # the harness's models `build` builds too (--profile)


def builders():
    """name -> builder `(dtype, rng, full)`: the zoo, then the TF1 models
    (static shapes, then issue 34's dynamic ones). Imports TensorFlow."""
    import os
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from benchmarks import common
    common.legacy_keras()                               # their Keras 2 layers
    from benchmarks import zoo_models
    out = collections.OrderedDict(zoo_models.ZOO)
    for table in (zoo_models.MODELS, zoo_models.DYNAMIC_MODELS):
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
