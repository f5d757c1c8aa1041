"""Other people's TF1 models, re-typed the way their authors write them.

Issue 24's yardstick (`MODELS`: a Transformer on `tf.compat.v1.layers`, a
bi-LSTM tagger, wide & deep on feature columns, word2vec's `nce_loss`, a PTB
language model, in-batch negatives (truly coupled) and the in-batch softmax
control, the bi-LSTM-CRF NER tagger) and issue 34's models whose shapes are
known only at run time (`DYNAMIC_MODELS`), each in its author's style, on
synthetic data and a dynamic batch (and sequence length where it has one).
Each function's docstring says where its style comes from.

A builder takes `(dtype, rng, full=False)`, makes its variables and
placeholders in the default graph and returns a `zoo_models.Model` (loss
`[B]`, xs, `feed(rng, batch, steps=None)`, `coupled` variable names,
`dynamic_steps`). `full=True`: the benchmark's sizes (`python -m benchmarks
--tf1-models`); the tests use the small default. `FLOAT32_ONLY`: models TF
cannot build in float64, and why. Run `initializer()` (variables and lookup
tables) before use.
"""

import collections
import math

import numpy as np
import tensorflow as tf

from benchmarks.zoo_models import Model, _glorot, _new_variables

tf1 = tf.compat.v1


def _lengths(rng, batch, steps):
    """Sequence lengths in [1, steps], the longest one equal to `steps`."""
    lengths = rng.integers(1, steps + 1, batch)
    lengths[rng.integers(batch)] = steps
    return lengths


# --------------------------------------------------------------------------
# Transformer encoder / classifier on tf.compat.v1.layers.dense


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
    """A one-block Transformer encoder classifying token sequences."""
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


# --------------------------------------------------------------------------
# Bidirectional LSTM tagger


def _tagger_logits(word_embeddings, sequence_lengths, hidden, tags, dtype, init, dropout=None):
    """The tagger's `add_logits_op`: a bi-LSTM with `sequence_length`, its
    outputs concatenated (dropout with keep probability `dropout`, if
    given), a `[-1, 2H]` reshape and matmul to the tags: `[B, T, tags]`."""
    with tf1.variable_scope("bi-lstm", initializer=init):
        cell_fw = tf1.nn.rnn_cell.LSTMCell(hidden)
        cell_bw = tf1.nn.rnn_cell.LSTMCell(hidden)
        (output_fw, output_bw), _ = tf1.nn.bidirectional_dynamic_rnn(
            cell_fw, cell_bw, word_embeddings,
            sequence_length=sequence_lengths, dtype=dtype)
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


# --------------------------------------------------------------------------
# Wide & deep on feature columns


_EDUCATION = ["Bachelors", "HS-grad", "Masters", "Doctorate", "Some-college", "Assoc-voc"]
_OCCUPATIONS = ["Tech-support", "Craft-repair", "Sales", "Exec-managerial",
                "Prof-specialty", "Farming-fishing", "Transport-moving"]
_INTERESTS = ["golf", "chess", "music", "hiking", "cooking", "film", "tennis"]


def wide_deep(dtype, rng, full=False):
    """The census wide & deep model: a linear model on sparse and crossed
    columns plus a DNN on embeddings and numbers, one logit."""
    fc = tf1.feature_column
    hidden = (100, 50) if full else (6, 4)
    emb = 8 if full else 3
    features = {
        "age": tf1.placeholder(dtype, [None, 1], name="age"),
        "hours_per_week": tf1.placeholder(dtype, [None, 1], name="hours"),
        "education": tf1.placeholder(tf.string, [None, 1], name="education"),
        "occupation": tf1.placeholder(tf.string, [None, 1],
                                      name="occupation"),
        # Several interests per person, or none: a sparse input.
        "interests": tf1.sparse_placeholder(tf.string, [None, None],
                                            name="interests"),
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
                net = tf1.layers.dense(net, units, activation=tf.nn.relu,
                                       kernel_initializer=init,
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
                features["occupation"]: pick(_OCCUPATIONS),
                features["interests"]: sparse,
                label: rng.integers(0, 2, [batch, 1]).astype(float)}
    return Model(loss, xs, feed)


# --------------------------------------------------------------------------
# word2vec (skip-gram, NCE)


def word2vec(dtype, rng, full=False):
    """word2vec_basic.py's graph: embeddings, NCE weights and biases."""
    vocabulary_size, embedding_size, num_sampled = ((5000, 128, 64) if full else (40, 6, 5))
    train_inputs = tf1.placeholder(tf.int32, [None], name="train_inputs")
    train_labels = tf1.placeholder(tf.int64, [None, 1], name="train_labels")
    embeddings = tf.Variable(tf1.random_uniform(
        [vocabulary_size, embedding_size], -1.0, 1.0, dtype=dtype,
        seed=int(rng.integers(1 << 30))), name="embeddings")
    embed = tf.nn.embedding_lookup(embeddings, train_inputs)
    nce_weights = tf.Variable(tf1.truncated_normal(
        [vocabulary_size, embedding_size],
        stddev=1.0 / math.sqrt(embedding_size), dtype=dtype,
        seed=int(rng.integers(1 << 30))), name="nce_weights")
    nce_biases = tf.Variable(0.1 * rng.normal(size=[vocabulary_size]),
                             dtype=dtype, name="nce_biases")
    # The tutorial averages this [B] vector.
    loss = tf1.nn.nce_loss(weights=nce_weights, biases=nce_biases,
                           labels=train_labels, inputs=embed,
                           num_sampled=num_sampled,
                           num_classes=vocabulary_size)

    def feed(rng, batch, t=None):
        del t
        return {train_inputs: rng.integers(0, vocabulary_size, batch),
                train_labels: rng.integers(0, vocabulary_size, [batch, 1])}
    return Model(loss, [embeddings, nce_weights, nce_biases], feed)


# --------------------------------------------------------------------------
# PTB-style LSTM language model


def _sequence_loss(logits, targets, weights):
    """`[B]`: the weighted per-token cross-entropy summed over time (what
    `tf.contrib.seq2seq.sequence_loss` gives with both averages off, summed
    over the time axis)."""
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


# --------------------------------------------------------------------------
# In-batch negatives (two towers, the next example's document as negative)


def _two_towers(dtype, rng, full):
    """A query and a document tower (dense tanh, dense, l2-normalised) on
    their own placeholders: `(q [B, K], d [B, K], variables, feed)`, `feed(rng,
    batch, t=None)` the model's feed dict."""
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
                    tf1.layers.dense(h, out, kernel_initializer=init,
                                     name="out"), axis=-1)
        return tower(query, "query_tower"), tower(doc, "doc_tower")
    (q, d), xs = _new_variables(build)

    def feed(rng, batch, t=None):
        del t
        return {query: rng.normal(size=[batch, q_dim]), doc: rng.normal(size=[batch, d_dim])}
    return q, d, xs, feed


def in_batch_negatives(dtype, rng, full=False):
    """Query and document towers; example i's negative is document i-1.

    `tf.roll(doc, shift=1, axis=0)` pairs each query with another example's
    document, so loss_i depends on example i-1's document: the document
    tower's variables are coupled, and only an exact form (one backward pass
    per example, or a check that falls back to one) is right for them.
    """
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
    """The same towers with the full in-batch softmax: query i's logits are
    its scores against every document of the batch (`q @ d^T`, `[B, B]`),
    its label is i. Every document is a negative for every query: the
    document tower's variables are coupled (a control for the `tf.roll`
    model: the coupling is a MatMul the batch-axis table knows)."""
    q, d, xs, feed = _two_towers(dtype, rng, full)
    logits = 5.0 * tf.matmul(q, d, transpose_b=True)             # [B, B]
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=tf.range(tf.shape(q)[0]), logits=logits)
    return Model(loss, xs, feed, coupled=[v.name for v in xs if "doc_tower" in v.name])


# --------------------------------------------------------------------------
# Issue 34: shapes known only at run time (images of any size, sequences of
# any length, a squeeze to unknown rank, a per-example CTC loss op)


def _weight(shape, dtype, rng, stddev=0.1):
    """`tf.Variable(tf.truncated_normal(shape, stddev))`, as these authors
    write their variables (seeded here)."""
    return tf.Variable(tf1.truncated_normal(
        shape, stddev=stddev, dtype=dtype, seed=int(rng.integers(1 << 30))))


def unet(dtype, rng, full=False):
    """jakeret/tf_unet's `create_conv_net`: images of any size
    (`[None, None, None, C]`), VALID 3x3 convolutions with `bias_add` and
    dropout, max pooling, `conv2d_transpose` up (its output shape stacked
    from `tf.shape`), `crop_and_concat` (a `tf.slice` at run-time offsets
    and sizes), a 1x1 convolution, and the pixel-wise softmax
    cross-entropy on the `[-1, n_class]` reshape, averaged per image."""
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

    def build():
        features = root
        w1 = _weight([3, 3, channels, features], dtype, rng)
        w2 = _weight([3, 3, features, features], dtype, rng)
        b1 = tf.Variable(tf.constant(0.1, dtype, [features]))
        b2 = tf.Variable(tf.constant(0.1, dtype, [features]))
        down = tf.nn.relu(conv2d(tf.nn.relu(conv2d(x, w1, b1)), w2, b2))
        pool = tf.nn.max_pool2d(down, [1, 2, 2, 1], [1, 2, 2, 1], "VALID")
        w3 = _weight([3, 3, features, 2 * features], dtype, rng)
        w4 = _weight([3, 3, 2 * features, 2 * features], dtype, rng)
        b3 = tf.Variable(tf.constant(0.1, dtype, [2 * features]))
        b4 = tf.Variable(tf.constant(0.1, dtype, [2 * features]))
        bottom = tf.nn.relu(conv2d(tf.nn.relu(conv2d(pool, w3, b3)), w4, b4))
        wd = _weight([2, 2, features, 2 * features], dtype, rng)
        bd = tf.Variable(tf.constant(0.1, dtype, [features]))
        up = tf.nn.relu(deconv2d(bottom, wd, 2) + bd)
        concat = crop_and_concat(down, up)
        w5 = _weight([3, 3, 2 * features, features], dtype, rng)
        w6 = _weight([3, 3, features, features], dtype, rng)
        b5 = tf.Variable(tf.constant(0.1, dtype, [features]))
        b6 = tf.Variable(tf.constant(0.1, dtype, [features]))
        h = tf.nn.relu(conv2d(tf.nn.relu(conv2d(concat, w5, b5)), w6, b6))
        weight = _weight([1, 1, features, n_class], dtype, rng)
        bias = tf.Variable(tf.constant(0.1, dtype, [n_class]))
        return conv2d(h, weight, bias)
    logits, xs = _new_variables(build)
    # The cropped labels, as the author's `crop_to_shape`.
    offset = (tf.shape(y)[1] - tf.shape(logits)[1]) // 2
    labels = y[:, offset:offset + tf.shape(logits)[1], offset:offset + tf.shape(logits)[2], :]
    flat = tf.nn.softmax_cross_entropy_with_logits(
        logits=tf.reshape(logits, [-1, n_class]),
        labels=tf.reshape(labels, [-1, n_class]))
    # The author averages `flat`; per image, its pixels' mean.
    loss = tf.reduce_mean(tf.reshape(flat, [tf.shape(x)[0], -1]), axis=1)

    def feed(rng, batch, t=None):
        side = t or size
        classes = rng.integers(0, n_class, [batch, side, side])
        return {x: rng.normal(size=[batch, side, side, channels]),
                y: np.eye(n_class)[classes], keep_prob: 1.0}
    return Model(loss, xs, feed, dynamic_steps=True)


def ctc_lstm(dtype, rng, full=False):
    """igormq/ctc_tensorflow_example: an LSTM over features of any length
    (`dynamic_rnn` with `seq_len`), the `[-1, num_hidden]` reshape, `W`,
    `b`, the reshape back to `[batch_s, -1, num_classes]` (B read from the
    inputs), time-major logits and `tf.compat.v1.nn.ctc_loss` on a sparse
    placeholder of labels: the `[B]` CTC loss (the author averages it)."""
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
        indices, values = [], []
        for n, length in enumerate(lengths):
            # Labels no longer than half the frames: CTC can always align.
            for k in range(int(rng.integers(1, max(length // 2, 1) + 1))):
                indices.append([n, k])
                values.append(int(rng.integers(0, num_classes - 1)))
        width = max(i[1] for i in indices) + 1
        return {inputs: rng.normal(size=[batch, t, num_features]),
                seq_len: lengths,
                targets: tf1.SparseTensorValue(
                    np.array(indices, np.int64), np.array(values, np.int32),
                    np.array([batch, width], np.int64))}
    return Model(loss, xs, feed, dynamic_steps=True)


def neurobind(dtype, rng, full=False):
    """kyubyong/neurobind's regressor: an embedding, a pre-net (two dense
    layers with dropout), a 1-D convolution with a residual, a highway
    layer, the `(-1, T*E)` reshape and `tf.squeeze(tf.layers.dense(enc,
    1))`, whose rank is unknown (a batch of one squeezes to a scalar), and
    the L1 loss `tf.abs(logits - y)` per example (the author averages it):
    a loss of unknown static rank."""
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
                                    padding="same", activation=tf.nn.relu,
                                    name="conv1d_1")
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
    """R-Net-style attention pooling over a dynamic-length encoder
    (public TF1 reading-comprehension code: `dense` as `tf.einsum('aij,
    jk->aik', value, weight)`, `attention_pooling`'s `tf.squeeze(dense(sj,
    1), [-1])` and its masked softmax `exp(value) * mask` normalized by
    hand, `summary` with dropout), then a classifier on the pooled vector."""
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
        return {ids: rng.integers(0, vocab, [batch, t]),
                lengths: _lengths(rng, batch, t),
                labels: rng.integers(0, classes, batch)}
    return Model(loss, xs, feed, dynamic_steps=True)


# --------------------------------------------------------------------------
# Bidirectional LSTM CRF tagger with character embeddings


def _crf_log_likelihood(inputs, tag_indices, sequence_lengths, dtype):
    """The linear-chain CRF log-likelihood `[B]` of tf.contrib.crf (TF 1.4,
    the version the tagger was written against), re-typed with
    tf.compat.v1 ops: the unary scores gathered from the flattened
    `[B*T*N]` potentials, the binary scores from the flattened transition
    matrix, and the log partition function from the forward algorithm as a
    `dynamic_rnn` over a cell of its own (`sequence_length - 1` steps).
    `dtype` where contrib wrote float32 (its masks and the RNN's state), so
    the model builds in float64 too."""
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
        tf.gather(flattened_inputs, flattened_tag_indices),
        [batch_size, max_seq_len])

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
        sequence_length=sequence_lengths - 1, initial_state=first_input,
        dtype=dtype)
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
    """The classic NER tagger (guillaumegenthial/sequence_tagging,
    `model/ner_model.py`, its defaults `use_chars` and `use_crf`): word
    embeddings next to a character-level bi-LSTM's final states (run on the
    `[B*T, L, dc]` characters of every word, `sequence_length` the word
    lengths), dropout (a keep probability fed), a word-level bi-LSTM with
    `sequence_length`, a projection to the tags and the CRF log-likelihood;
    the loss is `-log_likelihood` (the author averages it). Placeholders as
    written, `[None, None]`; `static_steps` gives the words a static T."""
    vocab, nchars, dim, dim_char, hidden_char, hidden, tags, steps, chars = (
        (1000, 60, 50, 25, 25, 64, 9, 24, 8) if full else
        (15, 11, 4, 3, 2, 5, 3, 4, 3))
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
                cell_fw, cell_bw, char_embeddings,
                sequence_length=word_lengths_flat, dtype=dtype)
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


MODELS = collections.OrderedDict(
    (fn.__name__, fn) for fn in [transformer, bilstm_tagger, wide_deep,
                                 word2vec, ptb_lm, in_batch_negatives,
                                 in_batch_softmax, bilstm_crf])

# Issue 34's models (shapes known only at run time): apart from `MODELS`,
# whose tests and plans are issue 24's; tests/per_example/
# test_tf1_dynamic_models.py checks these, `--tf1-models --models unet,...`
# benchmarks them.
DYNAMIC_MODELS = collections.OrderedDict(
    (fn.__name__, fn) for fn in [unet, ctc_lstm, neurobind,
                                 attention_pooling])

# Models TF cannot build in float64, and why.
FLOAT32_ONLY = {
    "wide_deep": "feature columns make float32 variables (embedding and "
                 "linear-model weights take no dtype)",
    "word2vec": "nce_loss's candidate sampler returns float32 expected "
                "counts, which it subtracts from the logits",
}


def initializer():
    """The op that initializes a model's variables and lookup tables
    (`wide_deep`'s vocabulary list is a hash table)."""
    return tf.group(tf1.global_variables_initializer(), tf1.tables_initializer())


def has_tf1_layers():
    """Whether `tf.compat.v1.layers` and the v1 RNN cells are usable here
    (TF 2.16+ needs the tf-keras package and TF_USE_LEGACY_KERAS=1)."""
    try:
        return (callable(tf1.layers.dense) and callable(tf1.nn.rnn_cell.LSTMCell))
    except (ImportError, AttributeError):
        return False
