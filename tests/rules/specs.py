"""The per-example rule spec table: one small problem per rule and attribute set.

Each `Spec` names the op type whose rule it exercises and a `build(dtype,
rng)` that creates the variables in the default graph and returns a
`Problem`:

* `xs`: the variables whose per-example gradients are checked;
* `inputs`: what each placeholder holds, without the batch axis
  (`floats(...)`, `ids(vocab, ...)`);
* `loss(*placeholders)`: builds the `[B]` per-example loss from the
  placeholders. It is called several times on the same variables (static
  B=1, static B=3, dynamic B), which is how the loop reference gets a
  static-B copy of a dynamic-B graph with the same weights.

`expect` is the strategy "auto" must pick for every x: "rules", or "pfor"
for the rows that document a combination a rule does not take (auto then
falls back and still matches the loop), or "certified" where auto takes the
rule checked at run time (strategy "rules", form "certified"). `skip` (a reason) marks rows TF
cannot run on the CPU at all; (a dict: only for those float types) `limits` the strategies it cannot run there
(the dilated Conv2D filter gradient, pfor of an explicitly padded Conv2D's
filter gradient).
"""

import collections

import numpy as np
import tensorflow as tf

Input = collections.namedtuple("Input", ["tail", "kind", "vocab",
                                         "dynamic"])


class Problem(collections.namedtuple(
        "Problem", ["xs", "inputs", "loss", "reference"])):
    """What `Spec.build` returns; `reference` (optional) is the same function
    of the same variables written with ops TensorFlow can differentiate on
    the CPU, for the loop reference."""

    def __new__(cls, xs, inputs, loss, reference=None):
        return super(Problem, cls).__new__(cls, xs, inputs, loss, reference)


class Spec(collections.namedtuple(
        "Spec", ["name", "op_type", "build", "expect", "skip", "limits",
                 "rules_error"])):
    """One row of the table (see the module docstring).

    `limits` maps a strategy to the reason TensorFlow cannot run it for
    this row on the CPU (it is left out); `rules_error` is a regex the
    ValueError of strategy="rules" must match on fallback rows.
    """

    def __new__(cls, name, op_type, build, expect="rules", skip=None,
                limits=None, rules_error=None):
        return super(Spec, cls).__new__(cls, name, op_type, build, expect,
                                        skip, dict(limits or {}),
                                        rules_error or op_type)


def floats(*tail, dynamic=()):
    """Float input `[B, *tail]`; axes of `tail` in `dynamic` are None in
    the placeholder (data still has `tail`'s sizes)."""
    return Input(tuple(tail), "float", None, tuple(dynamic))


def ids(vocab, *tail):
    return Input(tuple(tail), "ids", vocab, ())


def sample(inp, batch, dtype, rng):
    """A numpy batch for one `Input`; ids repeat within each example."""
    shape = (batch,) + inp.tail
    if inp.kind == "float":
        return rng.normal(size=shape).astype(dtype.as_numpy_dtype)
    values = rng.integers(0, inp.vocab, size=shape).astype(np.int32)
    if len(inp.tail) >= 1 and inp.tail[-1] >= 2:
        values[..., 1] = values[..., 0]     # a repeated id in every example
    return values


def placeholder(inp, batch, dtype):
    kind_dtype = dtype if inp.kind == "float" else tf.int32
    tail = tuple(None if j in inp.dynamic else d
                 for j, d in enumerate(inp.tail))
    return tf.compat.v1.placeholder(kind_dtype, (batch,) + tail)


def var(rng, shape, dtype, resource=True, name=None):
    value = rng.normal(size=shape).astype(tf.as_dtype(dtype).as_numpy_dtype)
    return tf.compat.v1.Variable(value, use_resource=resource, name=name)


def head(z, batch_axis=0):
    """A per-example loss `[B]` from `z`: each entry's gradient differs."""
    rank = z.shape.rank
    terms = tf.sin(z) + 0.25 * tf.square(z)
    axes = [a for a in range(rank) if a != batch_axis]
    return tf.reduce_sum(terms, axis=axes) if axes else terms


# --------------------------------------------------------------------------
# MatMul and reads


def matmul(side, transpose_a, transpose_b):
    """`z = matmul(.., .., transpose_a, transpose_b)`, parameter on `side`."""
    d, k = 4, 3

    def build(dtype, rng):
        if side == "right":       # z[B, K] = op(x) op(w)
            w = var(rng, [k, d] if transpose_b else [d, k], dtype)

            def loss(x):
                a = tf.transpose(x) if transpose_a else x
                return head(tf.matmul(a, w, transpose_a=transpose_a,
                                      transpose_b=transpose_b))
        else:                     # z[K, B] = op(w) op(x^T)
            w = var(rng, [d, k] if transpose_a else [k, d], dtype)

            def loss(x):
                b = x if transpose_b else tf.transpose(x)
                return head(tf.matmul(w, b, transpose_a=transpose_a,
                                      transpose_b=transpose_b), batch_axis=1)
        return Problem([w], [floats(d)], loss)

    return build


def _other_float(dtype):
    return tf.float32 if dtype == tf.float64 else tf.float64


def matmul_read(read):
    """A dense layer whose weight reaches MatMul through `read`."""

    def build(dtype, rng):
        if read == "cast":        # a variable of the other float type
            w = var(rng, [4, 3], _other_float(dtype))
        else:
            w = var(rng, [4, 3], dtype, resource=(read != "ref"))

        def loss(x):
            if read == "cast":
                v = tf.cast(w, dtype)
            elif read == "identity":
                v = tf.identity(tf.identity(w))
            else:
                v = w
            return head(tf.matmul(x, v))
        return Problem([w], [floats(4)], loss)

    return build


def tensordot_dense(depth_dynamic):
    """Two dense layers on `[B, T, D]` through tf.tensordot (what Keras Dense
    and tf.compat.v1.layers.dense build): a `[B*T, D]` MatMul between a fold
    and an unfold reshape. `depth_dynamic`: T unknown in the placeholder, so
    tensordot builds its reshapes from tf.shape (the symbolic shapes follow
    them: the unfold is x's own `B, T`, and the rules apply)."""

    def build(dtype, rng):
        w1, b1 = var(rng, [3, 5], dtype), var(rng, [5], dtype)
        w2 = var(rng, [5, 2], dtype)

        def loss(x):
            h = tf.tanh(tf.tensordot(x, w1, [[2], [0]]) + b1)
            return head(tf.tensordot(h, w2, [[2], [0]]))
        return Problem([w1, b1, w2], [floats(4, 3, dynamic=(
            (0,) if depth_dynamic else ()))], loss)

    return build


def folded_rows_not_a_fold(dtype, rng):
    """A reshape `[B, 4, 3] -> [B*2, 6]` before a MatMul: rows are not
    (example, t) pairs of the last axis, so the static proof does not
    claim it; rows 2b and 2b+1 are example b's, so the run-time certificate
    (a fold read example-major) takes the rule and must match the loop."""
    w = var(rng, [6, 2], dtype)
    return Problem([w], [floats(4, 3)],
                   lambda x: head(tf.reshape(
                       tf.matmul(tf.reshape(x, [-1, 6]), w), [-1, 2, 2])))


def dense_bias_add(dtype, rng):
    w, b = var(rng, [4, 3], dtype), var(rng, [3], dtype)
    return Problem([w, b], [floats(4)],
                   lambda x: head(tf.nn.bias_add(tf.matmul(x, w), b)))


# --------------------------------------------------------------------------
# BiasAdd and broadcast parameters


def bias_add(data_format, raw_v1=False, rank=4, dynamic=()):
    """`dynamic`: axes of the input's tail left None in the placeholder
    (the per-example sums then take the positions' count at run time)."""
    def build(dtype, rng):
        c = 2
        b = var(rng, [c], dtype)
        if rank == 3:             # a dense layer on a sequence [B, T, C]
            tail = (3, c)
        else:
            tail = (c, 3, 3) if data_format == "NCHW" else (3, 3, c)

        def loss(x):
            if raw_v1:
                return head(tf.raw_ops.BiasAddV1(value=x, bias=b))
            return head(tf.nn.bias_add(x, b, data_format=data_format))
        return Problem([b], [floats(*tail, dynamic=dynamic)], loss)

    return build


def broadcast(kind):
    """A parameter broadcast over the batch by an Add/AddV2/Sub/Mul."""

    def build(dtype, rng):
        shapes = {"add": [3], "add_raw": [3], "sub_right": [2, 3],
                  "sub_left": [3], "mul": [2, 3], "row": [1, 3],
                  "scalar": [], "keepdim": [1, 1, 3], "masked": [1, 1, 3],
                  "column": [2, 1]}
        p = var(rng, shapes[kind], dtype)

        def loss(x):              # x: [B, 2, 3]
            if kind == "add":
                z = x + p
            elif kind == "add_raw":
                z = tf.raw_ops.Add(x=x, y=p)
            elif kind == "sub_right":
                z = x - p
            elif kind == "sub_left":
                z = p - x
            elif kind in ("mul", "scalar"):
                z = x * p
            elif kind == "masked":
                # The op with the rule sees no batch (a [1, 1, 3] output);
                # the batch only arrives by broadcasting one op later.
                z = x * (p * tf.constant([[[1.0, 0.5, -2.0]]], p.dtype))
            elif kind == "column":    # [2, 1]: broadcast over B and axis 2
                z = p + tf.sin(x)
            else:                 # "row" [1, 3] and "keepdim" [1, 1, 3]
                z = tf.tanh(x) * p if kind == "row" else x + p
            return head(z)
        return Problem([p], [floats(2, 3)], loss)

    return build


def layer_norm(dtype, rng):
    """LayerNorm over the feature axis of `[B, T, D]`; gamma and beta `[D]`."""
    gamma, beta = var(rng, [4], dtype), var(rng, [4], dtype)

    def loss(x):
        mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
        normed = (x - mean) * tf.math.rsqrt(variance + 1e-3)
        return head(normed * gamma + beta)
    return Problem([gamma, beta], [floats(3, 4)], loss)


# --------------------------------------------------------------------------
# BatchMatMul and Einsum


def batch_matmul(op_type, adj_x=False, adj_y=False, side="right"):
    """`[B, T, D] x [D, K]` (sum over T per example), or the parameter left."""
    t, d, k = 3, 4, 2

    def build(dtype, rng):
        if side == "right":
            w = var(rng, [k, d] if adj_y else [d, k], dtype)
        else:                     # z[B, K, T] = w[K, D] x[B, D, T]
            w = var(rng, [d, k] if adj_x else [k, d], dtype)
        rank2 = op_type == "BatchMatMul"

        def loss(x):
            if side == "right":
                perm = [1, 0] if rank2 else [0, 2, 1]
                a = tf.transpose(x, perm) if adj_x and not rank2 else x
                args = dict(x=a, y=w, adj_x=adj_x and not rank2, adj_y=adj_y)
            else:
                args = dict(x=w, y=tf.transpose(x, [0, 2, 1]), adj_x=adj_x,
                            adj_y=False)
            if op_type == "BatchMatMulV3":
                z = tf.raw_ops.BatchMatMulV3(Tout=dtype, **args)
            else:
                z = getattr(tf.raw_ops, op_type)(**args)
            return head(z)
        tail = (d,) if rank2 else (t, d)
        return Problem([w], [floats(*tail)], loss)

    return build


def batch_matmul_rank4(dtype, rng):
    """`[B, H, T, D] x [D, K]` through tf.matmul (BatchMatMulV2)."""
    w = var(rng, [4, 2], dtype)
    return Problem([w], [floats(2, 3, 4)], lambda x: head(tf.matmul(x, w)))


def einsum(equation, act_shape, param_shape, transpose_act=None):
    """Two-operand einsum; the operand without "b" is the parameter.

    `transpose_act` permutes the `[B, ...]` placeholder before the einsum
    (for equations whose activation is not batch-leading).
    """
    ins, out = equation.split("->")
    left, right = ins.split(",")
    param_first = "b" not in left
    batch_axis = out.index("b")

    def build(dtype, rng):
        w = var(rng, list(param_shape), dtype)

        def loss(x):
            a = tf.transpose(x, transpose_act) if transpose_act else x
            z = tf.einsum(equation, *((w, a) if param_first else (a, w)))
            return head(z, batch_axis=batch_axis)
        return Problem([w], [floats(*act_shape)], loss)

    return build


# --------------------------------------------------------------------------
# Convolutions


def _zero_stuffed(f, dilations):
    """The filter of a dilated convolution as an undilated one: `f`'s taps
    at multiples of the dilation along the leading spatial axes, zeros
    between (differentiable in `f`: a scatter)."""
    spatial = len(dilations)
    taps = f.shape.as_list()[:spatial]
    grid = np.stack(np.meshgrid(*[np.arange(k) * d for k, d in
                                  zip(taps, dilations)], indexing="ij"),
                    axis=-1)
    size = [(k - 1) * d + 1 for k, d in zip(taps, dilations)]
    return tf.scatter_nd(grid.astype(np.int32), tf.convert_to_tensor(f),
                         size + f.shape.as_list()[spatial:])


# TF's CPU kernel for the filter gradient of a dilated Conv2D fails
# ("Current CPU implementations do not yet support dilation rates larger
# than 1"), so the loop and pfor strategies cannot run; the reference is
# the same convolution with a zero-stuffed filter.
NO_CPU_DILATED_GRAD = ("TensorFlow has no CPU filter gradient for a dilated "
                       "Conv2D")
# TF's pfor converter for Conv2DBackpropFilter drops explicit_paddings
# ("explicit_paddings attribute must contain 8 values, but got: 0").
PFOR_EXPLICIT = "TF's pfor of Conv2DBackpropFilter loses explicit_paddings"
# The boundary form's per-example copy of a transposed convolution keeps
# the batch's output size `[B, H, W, C]` (its input_sizes): a graph-time
# shape error (a gap of the copies, not of the rule).
PFOR_TRANSPOSED_SIZES = {"pfor": "the boundary form's copy of "
                                 "Conv2DBackpropInput keeps the batch's "
                                 "input_sizes"}


def conv2d(strides=1, padding="SAME", dilations=1, kernel=(3, 3),
           dynamic=()):
    def build(dtype, rng):
        f = var(rng, list(kernel) + [2, 3], dtype)

        def loss(x):
            return head(tf.nn.conv2d(x, f, strides=strides, padding=padding,
                                     dilations=dilations))

        def reference(x):
            stuffed = _zero_stuffed(f, [dilations] * 2)
            return head(tf.nn.conv2d(x, stuffed, strides=strides,
                                     padding=padding))
        return Problem([f], [floats(7, 6, 2, dynamic=dynamic)], loss,
                       reference if dilations != 1 else None)

    return build


def depthwise(strides=1, padding="SAME", dilations=None, multiplier=2):
    def build(dtype, rng):
        f = var(rng, [3, 2, 2, multiplier], dtype)

        def loss(x):
            return head(tf.nn.depthwise_conv2d(
                x, f, strides=[1, strides, strides, 1], padding=padding,
                dilations=dilations))
        return Problem([f], [floats(7, 6, 2)], loss)

    return build


def conv1d(stride=1, padding="SAME", dilation=1):
    def build(dtype, rng):
        f = var(rng, [3, 2, 3], dtype)

        def loss(x):
            return head(tf.nn.conv1d(x, f, stride=stride, padding=padding,
                                     dilations=dilation))

        def reference(x):
            return head(tf.nn.conv1d(x, _zero_stuffed(f, [dilation]),
                                     stride=stride, padding=padding))
        return Problem([f], [floats(8, 2)], loss,
                       reference if dilation != 1 else None)

    return build


def conv2d_nchw(dtype, rng):
    f = var(rng, [3, 3, 2, 3], dtype)
    return Problem([f], [floats(2, 5, 5)], lambda x: head(
        tf.nn.conv2d(x, f, 1, "SAME", data_format="NCHW")))


def depthwise_nchw(dtype, rng):
    f = var(rng, [3, 3, 2, 2], dtype)
    return Problem([f], [floats(2, 5, 5)], lambda x: head(
        tf.nn.depthwise_conv2d(x, f, [1, 1, 1, 1], "SAME",
                               data_format="NCHW")))


def atrous_conv2d(dtype, rng):
    f = var(rng, [3, 2, 2, 3], dtype)
    return Problem([f], [floats(7, 6, 2)], lambda x: head(
        tf.nn.atrous_conv2d(x, f, 2, "SAME")))


def conv2d_transpose(dtype, rng):
    f = var(rng, [3, 3, 3, 2], dtype)
    return Problem([f], [floats(4, 3, 2)], lambda x: head(
        tf.nn.conv2d_transpose(x, f, tf.stack([tf.shape(x)[0], 8, 6, 3]),
                               2, "SAME")))


def conv3d(dtype, rng):
    f = var(rng, [2, 3, 2, 2, 3], dtype)
    return Problem([f], [floats(4, 5, 3, 2)], lambda x: head(
        tf.nn.conv3d(x, f, [1, 1, 2, 1, 1], "SAME")))


# --------------------------------------------------------------------------
# Embedding lookups


def embedding(resource, id_tail, how="embedding_lookup"):
    """A `[V, D]` table looked up by ids `[B, *id_tail]` (ids repeat).

    `how`: "embedding_lookup", "gather", or "cast" (a table of the other
    float type, cast, then gathered: GatherV2 on the Cast).
    """
    vocab = 5

    def build(dtype, rng):
        table_dtype = _other_float(dtype) if how == "cast" else dtype
        table = var(rng, [vocab, 3], table_dtype, resource=resource)

        def loss(i):
            if how == "embedding_lookup":
                e = tf.nn.embedding_lookup(table, i)
            elif how == "cast":
                e = tf.gather(tf.cast(table, dtype), i)
            else:
                e = tf.gather(table, i)
            return head(tf.tanh(e))
        return Problem([table], [ids(vocab, *id_tail)], loss)

    return build


def embedding_pooled(pooling, lookups, resource=True):
    """A `[V, D]` table looked up by ids `[B, T]`, then mean or sum pooled
    over T: the lookups' output gradient is one row per example broadcast
    along T, which GatherRule's pooled norm form reads (ids repeat; counted
    by comparison for small T, by a sort for T above
    4 * `gather._MASKED_GRAM_MAX_LOOKUPS`)."""
    vocab = 5
    pool = {"mean": tf.reduce_mean, "sum": tf.reduce_sum}[pooling]

    def build(dtype, rng):
        table = var(rng, [vocab, 3], dtype, resource=resource)

        def loss(i):
            return head(pool(tf.nn.embedding_lookup(table, i), axis=1))
        return Problem([table], [ids(vocab, lookups)], loss)

    return build


# pfor of embedding_lookup_sparse's backward pass falls back to a while
# loop that stacks the table's resource handle in a TensorList, which has
# no CPU kernel for DT_RESOURCE (TensorListConcatV2).
PFOR_RESOURCE_LIST = {"pfor": "pfor's fallback loop stacks a resource "
                              "handle (no CPU TensorListConcatV2 kernel)"}
# The per-example copies that pfor vectorizes give a sparse segment
# reduction segment ids and indices of different sizes (run-time error).
PFOR_SEGMENT_COPIES = {"pfor": "pfor's copies of a sparse segment "
                               "reduction fail at run time"}


def sparse_segments(combiner, lookups=3):
    """A `[V, D]` table through `tf.nn.embedding_lookup_sparse` (feature
    columns' sparse path: the batch's unique ids gathered, then
    SparseSegmentSum / Mean / SqrtN by example) on a sparse tensor with
    `lookups` entries per example (ids repeat within an example and
    across examples). A dense feature multiplies the pooled rows: the
    segment ids carry the batch in their values, not on an axis, so the
    batch sources are found from the dense inputs (as in wide & deep)."""
    vocab = 5

    def build(dtype, rng):
        table = var(rng, [vocab, 3], dtype)

        def loss(i, x):
            where = tf.where(tf.ones_like(i, tf.bool))          # [B*L, 2]
            sp = tf.SparseTensor(where, tf.gather_nd(i, where),
                                 tf.shape(i, out_type=tf.int64))
            pooled = tf.nn.embedding_lookup_sparse(table, sp, None,
                                                   combiner=combiner)
            # To the batch's shape, as feature columns do (a static B
            # stays static for the loop reference).
            return head(x * tf.tanh(tf.reshape(pooled, tf.shape(x))))
        return Problem([table], [ids(vocab, lookups), floats(3)], loss)

    return build


def segments_of_table(dtype, rng, lookups=3):
    """`tf.sparse.segment_mean` straight on a `[V, D]` table (no gather in
    between): example b's `lookups` ids are its entries, segment b."""
    vocab = 5
    table = var(rng, [vocab, 3], dtype)

    def loss(i, x):
        batch = tf.shape(x)[0]
        segment = tf.reshape(tf.tile(tf.range(batch)[:, None],
                                     [1, lookups]), [-1])
        pooled = tf.sparse.segment_mean(table, tf.reshape(i, [-1]), segment)
        return head(x * tf.tanh(tf.reshape(pooled, tf.shape(x))))
    return Problem([table], [ids(vocab, lookups), floats(3)], loss)


def fused_batch_norm(training, data_format="NHWC"):
    """`tf.compat.v1.nn.fused_batch_norm` on a conv output, scale and offset
    as the parameters (inference mode: fixed mean and variance)."""
    def build(dtype, rng):
        f = var(rng, [2, 2, 2, 3], dtype)
        scale, offset = var(rng, [3], dtype), var(rng, [3], dtype)
        mean = tf.constant(rng.normal(size=[3]), dtype)
        variance = tf.constant(rng.uniform(0.5, 2.0, size=[3]), dtype)

        def loss(x):
            h = tf.nn.conv2d(x, f, 1, "SAME")
            if data_format == "NCHW":
                h = tf.transpose(h, [0, 3, 1, 2])
            y, _, _ = tf.compat.v1.nn.fused_batch_norm(
                h, scale, offset, mean=None if training else mean,
                variance=None if training else variance, epsilon=1e-3,
                data_format=data_format, is_training=training)
            return head(y)
        return Problem([scale, offset], [floats(4, 3, 2)], loss)

    return build


# --------------------------------------------------------------------------
# The table

NO_GRAD = {"pfor": NO_CPU_DILATED_GRAD, "loop": NO_CPU_DILATED_GRAD}
NCHW_CONV_SKIP = ("TensorFlow's CPU kernels run Conv2D only in NHWC (the "
                  "op itself fails: 'The Conv2D op currently only supports "
                  "the NHWC tensor format on CPU')")
BN_FLOAT64_SKIP = {tf.float64: "TensorFlow's FusedBatchNorm kernels take "
                                "float16, bfloat16 and float32 only"}
NCHW_DEPTHWISE_SKIP = ("TensorFlow's CPU kernel runs DepthwiseConv2dNative "
                       "only in NHWC ('Depthwise convolution on CPU is only "
                       "supported for NHWC format')")

# --------------------------------------------------------------------------
# Loops


def while_rnn(bias):
    """A tanh RNN over `[B, 3, 2]` in a `tf.compat.v1.while_loop`, hidden 3:
    `h = tanh([x_t, h] w + b)`, the bias added with `+` ("add") or, as the
    Keras GRU does, `tf.nn.bias_add` of the rows of a `[2, 3]` table that
    the body unstacks ("unstack", the second row on `h w`'s second half)."""
    def build(dtype, rng):
        w = var(rng, [5, 3], dtype)
        b = var(rng, [3] if bias == "add" else [2, 3], dtype)

        def loss(x):
            h0 = tf.zeros(tf.stack([tf.shape(x)[0], 3]), dtype)

            def body(t, h):
                z = tf.matmul(tf.concat([x[:, t, :], h], axis=1), w)
                if bias == "add":
                    return t + 1, tf.tanh(z + b)
                first, second = tf.unstack(b)
                return t + 1, tf.tanh(tf.nn.bias_add(z, first) +
                                      tf.nn.bias_add(0.5 * z, second))
            _, h = tf.compat.v1.while_loop(lambda t, h: t < 3, body, [0, h0])
            return head(h)
        return Problem([w, b], [floats(3, 2)], loss)
    return build


SPECS = (
    [Spec("matmul_%s_ta%d_tb%d" % (side, ta, tb), "MatMul",
          matmul(side, bool(ta), bool(tb)))
     for side in ("right", "left") for ta in (0, 1) for tb in (0, 1)] +
    [Spec("matmul_read_" + r, "MatMul", matmul_read(r))
     for r in ("identity", "cast", "ref")] +
    [Spec("matmul_tensordot_folded_rows", "MatMul", tensordot_dense(False)),
     Spec("matmul_tensordot_dynamic_T", "MatMul", tensordot_dense(True)),
     Spec("matmul_reshape_not_a_fold", "MatMul", folded_rows_not_a_fold,
          expect="certified", rules_error="mixes examples")] +
    [Spec("dense_bias_add", "BiasAdd", dense_bias_add),
     Spec("bias_add_nhwc", "BiasAdd", bias_add("NHWC")),
     Spec("bias_add_nchw", "BiasAdd", bias_add("NCHW")),
     Spec("bias_add_nhwc_dynamic_hw", "BiasAdd",
          bias_add("NHWC", dynamic=(0, 1))),
     Spec("bias_add_nchw_dynamic_hw", "BiasAdd",
          bias_add("NCHW", dynamic=(1, 2))),
     Spec("bias_add_v1", "BiasAddV1", bias_add("NHWC", raw_v1=True)),
     Spec("bias_add_rank3", "BiasAdd", bias_add("NHWC", rank=3)),
     Spec("broadcast_add", "AddV2", broadcast("add")),
     Spec("broadcast_add_raw", "Add", broadcast("add_raw")),
     Spec("broadcast_sub_param_right", "Sub", broadcast("sub_right")),
     Spec("broadcast_sub_param_left", "Sub", broadcast("sub_left")),
     Spec("broadcast_mul", "Mul", broadcast("mul")),
     Spec("broadcast_mul_1xD", "Mul", broadcast("row")),
     Spec("broadcast_mul_scalar", "Mul", broadcast("scalar")),
     Spec("broadcast_add_1x1xD", "AddV2", broadcast("keepdim")),
     Spec("broadcast_add_Tx1", "AddV2", broadcast("column")),
     # p * mask sees no batch data: a chain through it, then the rule.
     Spec("broadcast_mul_param_times_constant", "Mul",
          broadcast("masked")),
     Spec("layer_norm_scale_shift", "Mul", layer_norm)] +
    [Spec("bmm_v2_adjx%d_adjy%d" % (ax, ay), "BatchMatMulV2",
          batch_matmul("BatchMatMulV2", bool(ax), bool(ay)))
     for ax in (0, 1) for ay in (0, 1)] +
    [Spec("bmm_v2_param_left", "BatchMatMulV2",
          batch_matmul("BatchMatMulV2", side="left")),
     Spec("bmm_v2_param_left_adjx", "BatchMatMulV2",
          batch_matmul("BatchMatMulV2", adj_x=True, side="left")),
     Spec("bmm_v2_rank4_activation", "BatchMatMulV2", batch_matmul_rank4),
     Spec("bmm_v3_adjy", "BatchMatMulV3",
          batch_matmul("BatchMatMulV3", adj_y=True)),
     Spec("bmm_v1_rank2_adjy", "BatchMatMul",
          batch_matmul("BatchMatMul", adj_y=True)),
     Spec("einsum_btd_dk_btk", "Einsum", einsum("btd,dk->btk", (3, 4), (4, 2))),
     Spec("einsum_btd_kd_kbt", "Einsum", einsum("btd,kd->kbt", (3, 4), (2, 4))),
     Spec("einsum_param_first", "Einsum", einsum("dk,btd->bkt", (3, 4), (4, 2))),
     Spec("einsum_bd_dk_bk", "Einsum", einsum("bd,dk->bk", (4,), (4, 2))),
     Spec("einsum_two_contracted", "Einsum",
          einsum("bthd,hdk->btk", (3, 2, 4), (2, 4, 3))),
     Spec("einsum_split_heads", "Einsum",
          einsum("btd,dhk->bthk", (3, 4), (4, 2, 3))),
     Spec("einsum_sum_t_inside", "Einsum", einsum("btd,dk->bk", (3, 4), (4, 2))),
     Spec("einsum_param_kept_in_output", "Einsum",
          einsum("bd,dk->bdk", (4,), (4, 2))),
     Spec("einsum_param_shares_t", "Einsum",
          einsum("btd,td->bt", (3, 4), (3, 4))),
     Spec("einsum_vector_param", "Einsum", einsum("bd,d->b", (4,), (4,))),
     # The batch is not the activation's first letter: the rule cannot tell,
     # the coupling check sees its guess reduced away; auto takes the rule
     # certified at run time, whose check fails (its rows are not the
     # examples), so the exact form runs and still matches the loop.
     Spec("einsum_batch_not_first", "Einsum",
          einsum("tbd,dk->tbk", (3, 4), (4, 2), transpose_act=[1, 0, 2]),
          expect="certified", rules_error="mixes examples"),
     Spec("conv2d_valid", "Conv2D", conv2d(padding="VALID")),
     Spec("conv2d_same_stride2", "Conv2D", conv2d(strides=2)),
     Spec("conv2d_same_dilation2", "Conv2D", conv2d(dilations=2),
          limits=NO_GRAD),
     Spec("conv2d_valid_stride2_dilation2", "Conv2D",
          conv2d(strides=2, padding="VALID", dilations=2), limits=NO_GRAD),
     Spec("conv2d_same_stride2_dilation2_dynamic_hw", "Conv2D",
          conv2d(strides=2, dilations=2, dynamic=(0, 1)), limits=NO_GRAD),
     Spec("conv2d_same_stride2_dynamic_hw", "Conv2D",
          conv2d(strides=2, kernel=(2, 3), dynamic=(0, 1))),
     Spec("conv2d_same_even_kernel_stride_1x2", "Conv2D",
          conv2d(strides=[1, 2], kernel=(2, 4))),
     Spec("conv2d_explicit_padding", "Conv2D",
          conv2d(padding=[[0, 0], [1, 2], [0, 1], [0, 0]]),
          limits={"pfor": PFOR_EXPLICIT}),
     Spec("conv2d_nchw", "Conv2D", conv2d_nchw, skip=NCHW_CONV_SKIP),
     Spec("depthwise_same_multiplier2", "DepthwiseConv2dNative", depthwise()),
     Spec("depthwise_nchw", "DepthwiseConv2dNative", depthwise_nchw,
          skip=NCHW_DEPTHWISE_SKIP),
     Spec("depthwise_valid_stride2", "DepthwiseConv2dNative",
          depthwise(strides=2, padding="VALID", multiplier=1)),
     Spec("depthwise_explicit_padding", "DepthwiseConv2dNative",
          depthwise(padding=[[0, 0], [1, 2], [0, 1], [0, 0]])),
     # tf.nn.depthwise_conv2d builds dilations as SpaceToBatchND around a
     # non-dilated DepthwiseConv2dNative (the CPU kernel has no dilations);
     # SpaceToBatchND stacks image blocks on the batch axis (row k*B + b of
     # example b) and the rule reads them back per example after the
     # BatchToSpaceND (rules/conv_views.py).
     Spec("depthwise_dilation2_space_to_batch", "DepthwiseConv2dNative",
          depthwise(dilations=[2, 2])),
     Spec("atrous_conv2d_space_to_batch", "Conv2D", atrous_conv2d),
     Spec("conv2d_transpose_stride2", "Conv2DBackpropInput",
          conv2d_transpose, limits=PFOR_TRANSPOSED_SIZES),
     Spec("conv3d_same", "Conv3D", conv3d),
     Spec("conv1d_same_stride2", "Conv2D", conv1d(stride=2)),
     Spec("conv1d_valid_dilation2", "Conv2D",
          conv1d(padding="VALID", dilation=2), limits=NO_GRAD),
     Spec("embedding_resource_ids_BT", "ResourceGather",
          embedding(True, (4,))),
     Spec("embedding_resource_ids_B", "ResourceGather", embedding(True, ())),
     Spec("embedding_resource_ids_BTU", "ResourceGather",
          embedding(True, (2, 3), how="gather")),
     Spec("embedding_ref_gatherv2_ids_BT", "GatherV2", embedding(False, (4,))),
     Spec("embedding_cast_table_gatherv2", "GatherV2",
          embedding(True, (4,), how="cast")),
     Spec("embedding_ref_gatherv2_ids_B", "GatherV2",
          embedding(False, (), how="gather")),
     Spec("embedding_resource_mean_pooled", "ResourceGather",
          embedding_pooled("mean", 4)),
     Spec("embedding_ref_gatherv2_sum_pooled", "GatherV2",
          embedding_pooled("sum", 4, resource=False)),
     Spec("embedding_resource_mean_pooled_counts_by_sort", "ResourceGather",
          embedding_pooled("mean", 130)),
     Spec("sparse_segment_sum", "SparseSegmentSum", sparse_segments("sum"),
          limits=PFOR_RESOURCE_LIST),
     Spec("sparse_segment_mean", "SparseSegmentMean",
          sparse_segments("mean"), limits=PFOR_RESOURCE_LIST),
     Spec("sparse_segment_sqrtn", "SparseSegmentSqrtN",
          sparse_segments("sqrtn"), limits=PFOR_RESOURCE_LIST),
     Spec("segment_mean_of_table", "SparseSegmentMean", segments_of_table,
          limits=PFOR_SEGMENT_COPIES),
     Spec("fused_batch_norm_inference", "FusedBatchNormV3",
          fused_batch_norm(False), skip=BN_FLOAT64_SKIP),
     Spec("fused_batch_norm_inference_nchw", "FusedBatchNormV3",
          fused_batch_norm(False, "NCHW"), skip=BN_FLOAT64_SKIP),
     Spec("fused_batch_norm_training", "FusedBatchNormV3",
          fused_batch_norm(True), expect="pfor", skip=BN_FLOAT64_SKIP,
          rules_error="training mode")] +
    # The loop rules (custagg/per_example/forms/loop_rules.py): the cell's MatMul and bias
    # inside a while-loop body, summed over the iterations.
    [Spec("while_rnn_add_bias", "While", while_rnn("add")),
     Spec("while_rnn_bias_add_unstacked", "While", while_rnn("unstack"))])
