"""AggregationMethod.CUSTOM: sum_i gradient_factors[i] * d ys_i / d x.

Two references:

* a float64 numpy oracle written by hand for softmax regression: example i
  contributes outer(x_i, softmax(x_i W + b) - y_i) to dW and
  softmax(x_i W + b) - y_i to db;
* `tf.compat.v1.gradients` of the same per-example terms, each seeded with
  its factor (`grad_ys=[f[i] * ones]`), which is the definition of the
  weighted sum, computed by TF term by term.
"""

import importlib

import numpy as np
import pytest
import tensorflow as tf

import custagg

CUSTOM = custagg.AggregationMethod.CUSTOM


def _softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def oracle_softmax_regression(x, onehot, w, b, factors):
    """sum_i f_i * d xent_i / d(W, b), by hand, in float64."""
    residual = _softmax(x @ w + b) - onehot                    # [B, C]
    grad_w = np.einsum("i,id,ic->dc", factors, x, residual)    # [D, C]
    grad_b = factors @ residual                                # [C]
    return grad_w, grad_b


def softmax_regression(rng, batch, dim, classes=10, dtype=tf.float64,
                       static_batch=True):
    """Per-example cross-entropy [B] of a softmax regression, and its data."""
    b_dim = batch if static_batch else None
    x = tf.compat.v1.placeholder(dtype, [b_dim, dim], name="x")
    onehot = tf.compat.v1.placeholder(dtype, [b_dim, classes], name="y")
    w0 = rng.normal(scale=0.1, size=(dim, classes))
    b0 = rng.normal(scale=0.1, size=classes)
    w = tf.compat.v1.Variable(w0.astype(dtype.as_numpy_dtype), name="w")
    b = tf.compat.v1.Variable(b0.astype(dtype.as_numpy_dtype), name="b")
    loss = tf.nn.softmax_cross_entropy_with_logits(
        labels=onehot, logits=tf.matmul(x, w) + b)
    data = {x: rng.uniform(size=(batch, dim)),
            onehot: np.eye(classes)[rng.integers(0, classes, batch)]}
    return loss, [w, b], data, (w0, b0)


def reference(ys, xs, factors, grad_ys=None):
    """TF's own sum_i f_i * d ys_i / dx, one seed per term."""
    grad_ys = grad_ys or [None] * len(ys)
    seeds = []
    for i, (y, gy) in enumerate(zip(ys, grad_ys)):
        f_i = tf.cast(factors[i], y.dtype)
        seeds.append(f_i * (tf.ones_like(y) if gy is None
                            else tf.cast(gy, y.dtype)))
    return tf.compat.v1.gradients(ys, xs, grad_ys=seeds)


def _run(sess, tensors, feed):
    sess.run(tf.compat.v1.global_variables_initializer())
    return sess.run(tensors, feed)


def _assert_all_close(actual, expected, rtol=1e-6, atol=1e-9):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        if hasattr(e, "indices"):           # IndexedSlicesValue
            dense = np.zeros(e.dense_shape)
            np.add.at(dense, e.indices, e.values)
            e = dense
        if hasattr(a, "indices"):
            dense = np.zeros(a.dense_shape)
            np.add.at(dense, a.indices, a.values)
            a = dense
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------
# The numpy oracle.


@pytest.mark.parametrize("form", ["list", "vector"])
def test_softmax_regression_matches_numpy_oracle(form, sess, rng):
    batch = 16
    loss, xs, data, (w0, b0) = softmax_regression(rng, batch, 784)
    f = tf.compat.v1.placeholder(tf.float64, [batch], name="factors")
    ys = [loss[i] for i in range(batch)] if form == "list" else loss
    grads = custagg.gradients(ys, xs, aggregation_method=CUSTOM,
                              gradient_factors=f)
    sess.run(tf.compat.v1.global_variables_initializer())
    x_val, onehot = data.values()
    # The same graph, run with two different factor vectors.
    for factors in (rng.normal(size=batch), rng.uniform(size=batch) *
                    (rng.uniform(size=batch) > 0.3)):
        got_w, got_b = sess.run(grads, {**data, f: factors})
        want_w, want_b = oracle_softmax_regression(x_val, onehot, w0, b0,
                                                   factors)
        np.testing.assert_allclose(got_w, want_w, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(got_b, want_b, rtol=1e-9, atol=1e-12)


def test_oracle_is_the_per_example_gradient(sess, rng):
    """Self-check of the oracle: factors one-hot at i give example i alone."""
    loss, xs, data, (w0, b0) = softmax_regression(rng, 3, 4)
    g_w, g_b = tf.compat.v1.gradients(loss[1], xs)
    got_w, got_b = _run(sess, [g_w, g_b], data)
    want_w, want_b = oracle_softmax_regression(*data.values(), w0, b0,
                                               np.array([0.0, 1.0, 0.0]))
    np.testing.assert_allclose(got_w, want_w, rtol=1e-12)
    np.testing.assert_allclose(got_b, want_b, rtol=1e-12)


# --------------------------------------------------------------------------
# Forms of ys, against TF term by term.


def _factors(rng, n):
    return rng.normal(size=n)


def test_list_and_vector_forms_agree_and_grad_ys_multiplies_in(sess, rng):
    batch = 6
    loss, xs, data, _ = softmax_regression(rng, batch, 5)
    f = tf.compat.v1.placeholder(tf.float64, [batch])
    g = tf.compat.v1.placeholder(tf.float64, [batch])
    slices = [loss[i] for i in range(batch)]
    vector = custagg.gradients(loss, xs, grad_ys=g, aggregation_method=CUSTOM,
                               gradient_factors=f)
    listed = custagg.gradients(slices, xs, grad_ys=[g[i] for i in range(
        batch)], aggregation_method=CUSTOM, gradient_factors=f)
    plain_vector = custagg.gradients(loss, xs, aggregation_method=CUSTOM,
                                     gradient_factors=f)
    plain_list = custagg.gradients(slices, xs, aggregation_method=CUSTOM,
                                   gradient_factors=f)
    want = tf.compat.v1.gradients(loss, xs, grad_ys=f * g)
    want_plain = tf.compat.v1.gradients(loss, xs, grad_ys=f)
    feed = {**data, f: _factors(rng, batch), g: _factors(rng, batch)}
    got = _run(sess, [vector, listed, want, plain_vector, plain_list,
                      want_plain], feed)
    _assert_all_close(got[0], got[2], rtol=1e-12)
    _assert_all_close(got[1], got[2], rtol=1e-12)
    _assert_all_close(got[3], got[5], rtol=1e-12)
    _assert_all_close(got[4], got[5], rtol=1e-12)


@pytest.mark.parametrize("pick", [
    "reversed", "shuffled", "subset", "repeats", "negative", "unstack",
    "gather", "gather_int64", "two_tensors", "not_slices", "mixed"])
def test_slice_forms_against_tf(pick, sess, rng):
    batch = 5
    loss, xs, data, _ = softmax_regression(rng, batch, 4)
    other = tf.reduce_sum(tf.square(xs[0])) * tf.range(
        1.0, batch + 1.0, dtype=tf.float64)        # a second [B] tensor
    perm = [3, 0, 4, 1, 2]
    ys = {
        "reversed": lambda: [loss[i] for i in reversed(range(batch))],
        "shuffled": lambda: [loss[i] for i in perm],
        "subset": lambda: [loss[3], loss[0]],
        "repeats": lambda: [loss[1], loss[1], loss[2], loss[1]],
        "negative": lambda: [loss[-1], loss[0], loss[-3]],
        "unstack": lambda: tf.unstack(loss),
        "gather": lambda: [tf.gather(loss, i) for i in perm],
        "gather_int64": lambda: [tf.gather(loss, tf.constant(i, tf.int64))
                                 for i in range(batch)],
        "two_tensors": lambda: [loss[0], other[1], loss[2], other[3],
                                other[0]],
        "not_slices": lambda: [2.0 * loss[0], tf.reduce_sum(loss),
                               tf.square(loss[1])],
        "mixed": lambda: [loss[2], 2.0 * loss[0], tf.unstack(other)[4],
                          loss[0]],
    }[pick]()
    f = tf.compat.v1.placeholder(tf.float64, [len(ys)])
    got = custagg.gradients(ys, xs, aggregation_method=CUSTOM,
                            gradient_factors=f)
    want = reference(ys, xs, f)
    for factors in (_factors(rng, len(ys)), np.ones(len(ys))):
        a, e = _run(sess, [got, want], {**data, f: factors})
        _assert_all_close(a, e, rtol=1e-12)


_SLICE_EXPRESSIONS = [
    # (id, expression of loss [B] / out [B, 3] / i (an int32 placeholder),
    #  recognized as one example of its source)
    ("loss[2]", lambda loss, out, i: loss[2], True),
    ("loss[-1]", lambda loss, out, i: loss[-1], True),
    ("out[1]", lambda loss, out, i: out[1], True),
    ("out[1,:]", lambda loss, out, i: out[1, :], True),
    ("out[1,...]", lambda loss, out, i: out[1, ...], True),
    ("loss[1,...]", lambda loss, out, i: loss[1, ...], True),
    ("gather(loss,2)", lambda loss, out, i: tf.gather(loss, 2), True),
    ("gather(out,1)", lambda loss, out, i: tf.gather(out, 1), True),
    ("gather(loss,-1)", lambda loss, out, i: tf.gather(loss, -1), False),
    ("unstack(out)[2]", lambda loss, out, i: tf.unstack(out)[2], True),
    ("unstack(loss,-1)", lambda loss, out, i: tf.unstack(loss, axis=-1)[3],
     True),
    ("out[:,1]", lambda loss, out, i: out[:, 1], False),
    ("out[1,1:]", lambda loss, out, i: out[1, 1:], False),
    ("out[1,::2]", lambda loss, out, i: out[1, ::2], False),
    ("out[1:2]", lambda loss, out, i: out[1:2], False),
    ("loss[1:2]", lambda loss, out, i: loss[1:2], False),
    ("out[...,1]", lambda loss, out, i: out[..., 1], False),
    ("out[1,0]", lambda loss, out, i: out[1, 0], False),
    ("out[newaxis,1]", lambda loss, out, i: out[tf.newaxis, 1], False),
    ("loss[i]", lambda loss, out, i: loss[i], False),
    ("gather(out,1,axis=1)", lambda loss, out, i: tf.gather(out, 1, axis=1),
     False),
    ("gather(loss,[1])", lambda loss, out, i: tf.gather(loss, [1]), False),
    ("unstack(out,axis=1)", lambda loss, out, i: tf.unstack(out, axis=1)[0],
     False),
]


@pytest.mark.parametrize("expr,recognized",
                         [(e, r) for _, e, r in _SLICE_EXPRESSIONS],
                         ids=[n for n, _, _ in _SLICE_EXPRESSIONS])
def test_slice_recognition_and_its_result(expr, recognized, sess, rng):
    """What is taken for one example, and the result either way (vs TF)."""
    from custagg.traversal import slice_recognizer
    batch = 4
    x = tf.compat.v1.placeholder(tf.float64, [batch, 2])
    w = tf.compat.v1.Variable(rng.normal(size=(2, 3)))
    out = tf.sin(tf.matmul(x, w))                           # [B, 3]
    loss = tf.reduce_sum(tf.square(out), axis=1)           # [B]
    i = tf.compat.v1.placeholder(tf.int32, [])
    term = expr(loss, out, i)
    assert (slice_recognizer.slice_of(term) is not None) == recognized
    ys = [term, loss[0]]
    f = tf.compat.v1.placeholder(tf.float64, [2])
    got = custagg.gradients(ys, [w], aggregation_method=CUSTOM,
                            gradient_factors=f)
    want = reference(ys, [w], f)
    a, e = _run(sess, [got, want], {x: rng.normal(size=(batch, 2)),
                                    f: [0.7, -1.3], i: 2})
    _assert_all_close(a, e, rtol=1e-12)


def test_list_of_slices_is_one_backward_pass():
    """The list form builds the vector form's ops, not a pass per example."""
    def new_op_types(form, batch):
        graph = tf.Graph()         # fresh: TF caches some shapes per graph
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [batch, 3])
            w = tf.compat.v1.get_variable("w", [3, 2])
            loss = tf.reduce_sum(tf.tanh(tf.matmul(x, w)), axis=1)
            f = tf.compat.v1.placeholder(tf.float32, [batch])
            ys = {"vector": lambda: loss,
                  "list": lambda: [loss[i] for i in range(batch)],
                  "unstack": lambda: tf.unstack(loss),
                  "shuffled": lambda: [loss[i] for i in reversed(range(
                      batch))]}[form]()
            before = set(graph.get_operations())
            custagg.gradients(ys, [w], aggregation_method=CUSTOM,
                              gradient_factors=f)
            return sorted(op.type for op in graph.get_operations()
                          if op not in before)

    for batch in (1, 8, 64):
        vector = new_op_types("vector", batch)
        # MatMul's gradient function builds both input gradients.
        assert vector.count("MatMul") == 2 and vector.count("TanhGrad") == 1
        assert new_op_types("list", batch) == vector
        assert new_op_types("unstack", batch) == vector
    # Out of order: one Gather (and its index and axis Consts) picks the
    # factors.
    assert new_op_types("shuffled", 64) == sorted(
        vector + ["Const", "Const", "GatherV2"])


def test_b_equals_one(sess, rng):
    loss, xs, data, (w0, b0) = softmax_regression(rng, 1, 4)
    f = tf.compat.v1.placeholder(tf.float64, [1])
    listed = custagg.gradients([loss[0]], xs, aggregation_method=CUSTOM,
                               gradient_factors=f)
    vector = custagg.gradients(loss, xs, aggregation_method=CUSTOM,
                               gradient_factors=f)
    got = _run(sess, [listed, vector], {**data, f: [0.25]})
    want = oracle_softmax_regression(*data.values(), w0, b0, np.array([0.25]))
    _assert_all_close(got[0], want, rtol=1e-12)
    _assert_all_close(got[1], want, rtol=1e-12)


def test_dynamic_batch(sess, rng):
    """[None] batch: vector form, and a list of slices of a [None] tensor."""
    loss, xs, data, (w0, b0) = softmax_regression(rng, 4, 6,
                                                  static_batch=False)
    x, onehot = list(data)
    f = tf.compat.v1.placeholder(tf.float64, [None])
    vector = custagg.gradients(loss, xs, aggregation_method=CUSTOM,
                               gradient_factors=f)
    f3 = tf.compat.v1.placeholder(tf.float64, [3])
    listed = custagg.gradients([loss[2], loss[0], loss[1]], xs,
                               aggregation_method=CUSTOM, gradient_factors=f3)
    sess.run(tf.compat.v1.global_variables_initializer())
    for batch in (3, 7):
        x_val = rng.uniform(size=(batch, 6))
        y_val = np.eye(10)[rng.integers(0, 10, batch)]
        factors = _factors(rng, batch)
        got = sess.run(vector, {x: x_val, onehot: y_val, f: factors})
        _assert_all_close(got, oracle_softmax_regression(
            x_val, y_val, w0, b0, factors), rtol=1e-12)
        factors3 = _factors(rng, 3)
        got = sess.run(listed, {x: x_val, onehot: y_val, f3: factors3})
        picked = np.zeros(batch)
        picked[[2, 0, 1]] = factors3
        _assert_all_close(got, oracle_softmax_regression(
            x_val, y_val, w0, b0, picked), rtol=1e-12)


@pytest.mark.parametrize("form", ["list", "vector"])
@pytest.mark.parametrize("factor_dtype", [tf.int32, tf.int64, tf.float32])
def test_factor_dtypes_are_cast(form, factor_dtype, sess, rng):
    batch = 4
    loss, xs, data, (w0, b0) = softmax_regression(rng, batch, 3)
    f = tf.compat.v1.placeholder(factor_dtype, [batch])
    ys = [loss[i] for i in range(batch)] if form == "list" else loss
    got = custagg.gradients(ys, xs, aggregation_method=CUSTOM,
                            gradient_factors=f)
    factors = np.array([3, 0, -1, 2])
    values = _run(sess, got, {**data, f: factors})
    want = oracle_softmax_regression(*data.values(), w0, b0,
                                     factors.astype(np.float64))
    _assert_all_close(values, want, rtol=1e-12)


def test_constant_factors(sess, rng):
    """Factors given as a Python list / numpy array, not a placeholder."""
    loss, xs, data, (w0, b0) = softmax_regression(rng, 3, 4)
    factors = np.array([0.5, -1.0, 2.0])
    got_list = custagg.gradients(tf.unstack(loss), xs,
                                 aggregation_method=CUSTOM,
                                 gradient_factors=list(factors))
    got_vec = custagg.gradients(loss, xs, aggregation_method=CUSTOM,
                                gradient_factors=factors)
    want = oracle_softmax_regression(*data.values(), w0, b0, factors)
    values = _run(sess, [got_list, got_vec], data)
    _assert_all_close(values[0], want, rtol=1e-12)
    _assert_all_close(values[1], want, rtol=1e-12)


@pytest.mark.parametrize("dtype", [tf.float16, tf.float32, tf.float64])
@pytest.mark.parametrize("form", ["list", "vector"])
def test_model_dtypes(dtype, form, sess, rng):
    batch = 4
    loss, xs, data, (w0, b0) = softmax_regression(rng, batch, 3, dtype=dtype)
    f = tf.compat.v1.placeholder(tf.float32, [batch])
    ys = [loss[i] for i in range(batch)] if form == "list" else loss
    got = custagg.gradients(ys, xs, aggregation_method=CUSTOM,
                            gradient_factors=f)
    assert [g.dtype for g in got] == [dtype, dtype]
    factors = np.array([0.5, 1.0, -2.0, 0.25], np.float32)
    values = _run(sess, got, {**data, f: factors})
    want = oracle_softmax_regression(
        *(v.astype(dtype.as_numpy_dtype).astype(np.float64)
          for v in data.values()),
        w0.astype(dtype.as_numpy_dtype), b0.astype(dtype.as_numpy_dtype),
        factors.astype(np.float64))
    tol = {tf.float16: 2e-2, tf.float32: 1e-5, tf.float64: 1e-12}[dtype]
    _assert_all_close(values, want, rtol=tol, atol=tol)


def test_per_example_terms_that_are_not_scalars(sess, rng):
    """ys [B, 3]: vector form over rows, list of rows, rows with grad_ys."""
    batch = 4
    x = tf.compat.v1.placeholder(tf.float64, [batch, 2])
    w = tf.compat.v1.Variable(rng.normal(size=(2, 3)))
    out = tf.sin(tf.matmul(x, w))                          # [B, 3]
    f = tf.compat.v1.placeholder(tf.float64, [batch])
    seeds = [tf.constant(rng.normal(size=3)) for _ in range(batch)]
    rows = [out[i] for i in range(batch)]
    got = [
        custagg.gradients(out, [w], aggregation_method=CUSTOM,
                          gradient_factors=f),
        custagg.gradients(rows, [w], aggregation_method=CUSTOM,
                          gradient_factors=f),
        custagg.gradients(rows, [w], grad_ys=seeds, aggregation_method=CUSTOM,
                          gradient_factors=f),
        custagg.gradients(out, [w], grad_ys=tf.stack(seeds),
                          aggregation_method=CUSTOM, gradient_factors=f),
        custagg.gradients(rows[::-1], [w], grad_ys=seeds[::-1],
                          aggregation_method=CUSTOM, gradient_factors=f),
    ]
    want = [reference(rows, [w], f), reference(rows, [w], f, seeds),
            reference(rows[::-1], [w], f, seeds[::-1])]
    feed = {x: rng.normal(size=(batch, 2)), f: _factors(rng, batch)}
    a = _run(sess, [got, want], feed)
    _assert_all_close(a[0][0], a[1][0], rtol=1e-12)
    _assert_all_close(a[0][1], a[1][0], rtol=1e-12)
    _assert_all_close(a[0][2], a[1][1], rtol=1e-12)
    _assert_all_close(a[0][3], a[1][1], rtol=1e-12)
    _assert_all_close(a[0][4], a[1][2], rtol=1e-12)


@pytest.mark.parametrize("placeholder", [False, True])
def test_one_per_example_term_that_is_not_a_scalar(sess, rng, placeholder):
    """B = 1, list form, ys = [out[0]] of shape [3]: one term, one factor
    (a review found it taken for the vector form, whose batch axis of 3
    then did not match the one factor). A `[1, 3]` y stays the vector
    form (the same result either way)."""
    x = tf.compat.v1.placeholder(tf.float64, [1, 2])
    w = tf.compat.v1.Variable(rng.normal(size=(2, 3)))
    out = tf.sin(tf.matmul(x, w))                          # [1, 3]
    f = (tf.compat.v1.placeholder(tf.float64, [1]) if placeholder
         else np.array([2.5]))
    got = [custagg.gradients([out[0]], [w], aggregation_method=CUSTOM,
                             gradient_factors=f),
           custagg.gradients([out], [w], aggregation_method=CUSTOM,
                             gradient_factors=f)]
    want = reference([out[0]], [w], f)
    feed = {x: rng.normal(size=(1, 2))}
    if placeholder:
        feed[f] = [2.5]
    a = _run(sess, [got, want], feed)
    _assert_all_close(a[0][0], a[1], rtol=1e-12)
    _assert_all_close(a[0][1], a[1], rtol=1e-12)


def test_partial_grad_ys_in_list_form(sess, rng):
    batch = 4
    loss, xs, data, _ = softmax_regression(rng, batch, 3)
    f = tf.compat.v1.placeholder(tf.float64, [batch])
    ys = [loss[i] for i in range(batch)]
    grad_ys = [None, 2.0, None, tf.constant(-1.5, tf.float64)]
    got = custagg.gradients(ys, xs, grad_ys=grad_ys,
                            aggregation_method=CUSTOM, gradient_factors=f)
    want = reference(ys, xs, f, grad_ys)
    a, e = _run(sess, [got, want], {**data, f: _factors(rng, batch)})
    _assert_all_close(a, e, rtol=1e-12)


def test_embedding_model_keeps_indexed_slices(sess, rng):
    batch = 5
    ids = tf.compat.v1.placeholder(tf.int32, [batch, 3])
    emb = tf.compat.v1.get_variable("emb", [20, 4], dtype=tf.float64)
    w = tf.compat.v1.get_variable("w", [4, 1], dtype=tf.float64)
    unused = tf.compat.v1.get_variable("unused", [2], dtype=tf.float64)
    h = tf.reduce_mean(tf.nn.embedding_lookup(emb, ids), axis=1)
    loss = tf.reshape(tf.square(tf.matmul(h, w)), [batch])
    f = tf.compat.v1.placeholder(tf.float64, [batch])
    for unconnected in ("none", "zero"):
        got = custagg.gradients([loss[i] for i in range(batch)],
                                [emb, w, unused], aggregation_method=CUSTOM,
                                gradient_factors=f,
                                unconnected_gradients=unconnected)
        want = tf.compat.v1.gradients(loss, [emb, w, unused], grad_ys=f,
                                      unconnected_gradients=unconnected)
        assert [type(g) for g in got] == [type(g) for g in want]
        assert isinstance(got[0], tf.IndexedSlices)
        live = [i for i, g in enumerate(want) if g is not None]
        a, e = _run(sess, [[got[i] for i in live], [want[i] for i in live]],
                    {ids: rng.integers(0, 20, size=(batch, 3)),
                     f: _factors(rng, batch)})
        _assert_all_close(a, e, rtol=1e-12)


def test_mlp_per_example_gradients_one_hot_factors(sess, rng):
    """Factors e_k give exactly example k's own gradient (checked vs TF)."""
    batch = 6
    x = tf.compat.v1.placeholder(tf.float32, [batch, 7])
    w1 = tf.compat.v1.get_variable("w1", [7, 5])
    w2 = tf.compat.v1.get_variable("w2", [5, 3])
    loss = tf.reduce_sum(tf.square(tf.matmul(tf.nn.relu(tf.matmul(x, w1)),
                                             w2)), axis=1)
    f = tf.compat.v1.placeholder(tf.float32, [batch])
    got = custagg.gradients([loss[i] for i in range(batch)], [w1, w2],
                            aggregation_method=CUSTOM, gradient_factors=f)
    own = [tf.compat.v1.gradients(loss[k], [w1, w2]) for k in range(batch)]
    x_val = rng.normal(size=(batch, 7))
    sess.run(tf.compat.v1.global_variables_initializer())
    per_example = sess.run(own, {x: x_val})
    for k in (0, 4):
        values = sess.run(got, {x: x_val, f: np.eye(batch)[k]})
        _assert_all_close(values, per_example[k], rtol=1e-5, atol=1e-6)


def test_custom_and_other_arguments(sess, rng):
    """name, stop_gradients and gate_gradients still apply with CUSTOM."""
    batch = 3
    loss, xs, data, _ = softmax_regression(rng, batch, 4)
    f = tf.compat.v1.placeholder(tf.float64, [batch])
    got = custagg.gradients([loss[i] for i in range(batch)], xs,
                            aggregation_method=CUSTOM, gradient_factors=f,
                            name="weighted", gate_gradients=True)
    assert all(g.name.startswith("weighted/") for g in got)
    want = tf.compat.v1.gradients(loss, xs, grad_ys=f)
    stopped = custagg.gradients(loss, xs, aggregation_method=CUSTOM,
                                gradient_factors=f, stop_gradients=[loss])
    assert stopped == [None, None]
    a, e = _run(sess, [got, want], {**data, f: _factors(rng, batch)})
    _assert_all_close(a, e, rtol=1e-12)


@pytest.mark.parametrize("control_flow", ["v2", "v1"])
def test_rnn_in_a_while_loop(control_flow, request, sess, rng):
    """Per-example losses of an RNN built with tf.compat.v1.while_loop."""
    if control_flow == "v1":
        request.getfixturevalue("control_flow_v1")
    batch, steps, n_in, n_hidden = 4, 3, 2, 5
    x = tf.compat.v1.placeholder(tf.float64, [batch, steps, n_in])
    w_x = tf.compat.v1.Variable(rng.normal(size=(n_in, n_hidden)))
    w_h = tf.compat.v1.Variable(rng.normal(size=(n_hidden, n_hidden)) * 0.3)
    inputs = tf.TensorArray(tf.float64, size=steps).unstack(
        tf.transpose(x, [1, 0, 2]))

    def body(t, h):
        return t + 1, tf.tanh(tf.matmul(inputs.read(t), w_x) +
                              tf.matmul(h, w_h))
    _, h = tf.compat.v1.while_loop(
        lambda t, h: t < steps, body,
        [tf.constant(0), tf.zeros([batch, n_hidden], tf.float64)])
    loss = tf.reduce_sum(tf.square(h), axis=1)             # [B]
    assert any(op.type == ("Exit" if control_flow == "v1" else "While")
               for op in loss.graph.get_operations())
    f = tf.compat.v1.placeholder(tf.float64, [batch])
    listed = custagg.gradients([loss[i] for i in range(batch)], [w_x, w_h],
                               aggregation_method=CUSTOM, gradient_factors=f)
    vector = custagg.gradients(loss, [w_x, w_h], aggregation_method=CUSTOM,
                               gradient_factors=f)
    want = tf.compat.v1.gradients(loss, [w_x, w_h], grad_ys=f)
    a = _run(sess, [listed, vector, want],
             {x: rng.normal(size=(batch, steps, n_in)),
              f: _factors(rng, batch)})
    _assert_all_close(a[0], a[2], rtol=1e-12)
    _assert_all_close(a[1], a[2], rtol=1e-12)


# --------------------------------------------------------------------------
# What the list form costs per slice: the shortcuts taken for B slices.


def test_the_walk_does_not_visit_the_slices(monkeypatch):
    """The B slices consume the tensor custom_seeds starts from; the walk
    from xs stops at that tensor instead of visiting each slice."""
    gradients_module = importlib.import_module("custagg.traversal.gradients")
    visited = []
    consumers = gradients_module._Backprop._consumers

    def counting(self, t):
        visited.append(t)
        return consumers(self, t)
    monkeypatch.setattr(gradients_module._Backprop, "_consumers", counting)

    def walked(batch):
        graph = tf.Graph()
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [batch, 3])
            w = tf.compat.v1.get_variable("w", [3, 2])
            loss = tf.reduce_sum(tf.tanh(tf.matmul(x, w)), axis=1)
            f = tf.compat.v1.placeholder(tf.float32, [batch])
            del visited[:]
            custagg.gradients([loss[i] for i in range(batch)], [w],
                              aggregation_method=CUSTOM, gradient_factors=f)
            return len(visited)

    assert walked(4) == walked(64)


def test_one_y_with_consumers_that_lead_to_xs(sess, rng):
    """With one y, what lies downstream of it is not walked; xs there (and
    the y itself as an x) get what tf.gradients gives."""
    loss, xs, data, _ = softmax_regression(rng, 4, 3)
    after = tf.square(loss)                   # downstream of ys
    ys = [loss[i] for i in range(4)]
    f = tf.compat.v1.placeholder(tf.float64, [4])
    got = custagg.gradients(ys, xs + [after, loss], aggregation_method=CUSTOM,
                            gradient_factors=f)
    want = tf.compat.v1.gradients(loss, xs + [after, loss], grad_ys=f)
    assert got[2] is None and want[2] is None
    a, e = _run(sess, [[got[i] for i in (0, 1, 3)],
                       [want[i] for i in (0, 1, 3)]],
                {**data, f: _factors(rng, 4)})
    _assert_all_close(a, e, rtol=1e-12)


def test_one_per_class_checks_each_class_once():
    gradients_module = importlib.import_module("custagg.traversal.gradients")

    class Proxy(object):
        """Claims another class, as wrapt-style proxies do."""
        def __init__(self, wrapped):
            self._wrapped = wrapped

        @property
        def __class__(self):
            return type(self._wrapped)

    t = tf.constant(1.0)
    v = tf.compat.v1.Variable(1.0)
    kinds = gradients_module._one_per_class([t] * 50 + [1.0, Proxy(v), t])
    assert len(kinds) == 3
    assert any(isinstance(k, tf.Variable) for k in kinds)
    assert gradients_module._one_per_class([]) == []
