"""Errors of custagg.gradients: each names the argument and what was expected.

Eager mode is checked in a subprocess (conftest turns eager off for this
whole process).
"""

import json
import re

import numpy as np
import pytest
import tensorflow as tf

import custagg

CUSTOM = custagg.AggregationMethod.CUSTOM


@pytest.fixture
def model(rng):
    """Per-example loss [4] of a tiny linear model, and its weight."""
    x = tf.compat.v1.placeholder(tf.float32, [4, 3], name="x")
    w = tf.compat.v1.Variable(rng.normal(size=(3, 1)).astype(np.float32),
                              name="w")
    loss = tf.reshape(tf.square(tf.matmul(x, w)), [4])
    return x, w, loss


def _feed(x, rng):
    return {x: rng.normal(size=(4, 3))}


# --------------------------------------------------------------------------
# aggregation_method and gradient_factors together.


def test_custom_without_gradient_factors(model):
    _, w, loss = model
    with pytest.raises(ValueError, match=r"CUSTOM needs gradient_factors, "
                       r"a \[B\] tensor"):
        custagg.gradients(loss, [w], aggregation_method=CUSTOM)


@pytest.mark.parametrize("method", [
    None, custagg.AggregationMethod.ADD_N,
    custagg.AggregationMethod.EXPERIMENTAL_TREE,
    tf.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N])
def test_gradient_factors_with_another_method(method, model):
    _, w, loss = model
    with pytest.raises(ValueError, match=r"gradient_factors is only used with "
                       r"aggregation_method=custagg.AggregationMethod.CUSTOM; "
                       r"got aggregation_method=%r" % (method,)):
        custagg.gradients(loss, [w], aggregation_method=method,
                          gradient_factors=tf.ones([4]))


@pytest.mark.parametrize("method", ["sum", 3, -1, 1.5, True, "custom "])
def test_unknown_aggregation_method(method, model):
    _, w, loss = model
    with pytest.raises(ValueError, match=r"unknown aggregation_method .*"
                       r"Expected one of custagg.AggregationMethod.ADD_N"):
        custagg.gradients(loss, [w], aggregation_method=method)


# --------------------------------------------------------------------------
# gradient_factors: rank, dtype, length.


@pytest.mark.parametrize("form", ["list", "vector"])
@pytest.mark.parametrize("shape", [[], [4, 1], [1, 4]])
def test_gradient_factors_of_wrong_rank(shape, form, model):
    _, w, loss = model
    ys = tf.unstack(loss) if form == "list" else loss
    f = tf.compat.v1.placeholder(tf.float32, shape)
    with pytest.raises(ValueError, match=r"gradient_factors must have rank 1, "
                       r"shape \[B\] .*got shape"):
        custagg.gradients(ys, [w], aggregation_method=CUSTOM,
                          gradient_factors=f)


@pytest.mark.parametrize("dtype", [tf.bool, tf.string, tf.complex64])
def test_gradient_factors_of_non_numeric_dtype(dtype, model):
    _, w, loss = model
    f = tf.compat.v1.placeholder(dtype, [4])
    with pytest.raises(TypeError, match=r"gradient_factors must have a "
                       r"numeric dtype .*got %s" % dtype.name):
        custagg.gradients(loss, [w], aggregation_method=CUSTOM,
                          gradient_factors=f)


def test_gradient_factors_that_are_not_a_tensor(model):
    _, w, loss = model
    with pytest.raises(TypeError, match=r"gradient_factors must be a numeric "
                       r"tensor of shape \[B\]"):
        custagg.gradients(loss, [w], aggregation_method=CUSTOM,
                          gradient_factors=[object()] * 4)
    with pytest.raises(TypeError, match=r"gradient_factors must have a "
                       r"numeric dtype"):
        custagg.gradients(loss, [w], aggregation_method=CUSTOM,
                          gradient_factors=["a", "b", "c", "d"])


@pytest.mark.parametrize("form,n_factors", [
    ("list", 3), ("list", 5), ("vector", 3), ("vector", 8), ("subset", 4)])
def test_static_length_differs_from_the_number_of_terms(form, n_factors,
                                                        model):
    _, w, loss = model
    ys = {"list": lambda: tf.unstack(loss), "vector": lambda: loss,
          "subset": lambda: [loss[0], loss[2]]}[form]()
    n_terms = 2 if form == "subset" else 4
    f = tf.compat.v1.placeholder(tf.float32, [n_factors])
    with pytest.raises(ValueError, match=r"gradient_factors has length %d but "
                       r"ys holds %d per-example terms; expected shape \[%d\]"
                       % (n_factors, n_terms, n_terms)):
        custagg.gradients(ys, [w], aggregation_method=CUSTOM,
                          gradient_factors=f)


def test_fed_length_differs_is_a_run_time_assertion(model, sess, rng):
    x, w, loss = model
    f = tf.compat.v1.placeholder(tf.float32, [None])
    f_any = tf.compat.v1.placeholder(tf.float32)            # unknown rank
    cases = [
        custagg.gradients(tf.unstack(loss), [w], aggregation_method=CUSTOM,
                          gradient_factors=f),
        custagg.gradients(loss, [w], aggregation_method=CUSTOM,
                          gradient_factors=f),
        custagg.gradients([loss[1], loss[3]], [w], aggregation_method=CUSTOM,
                          gradient_factors=f),
    ]
    sess.run(tf.compat.v1.global_variables_initializer())
    feed = _feed(x, rng)
    sess.run(cases[0], {**feed, f: np.ones(4)})             # right length
    for grads, bad in zip(cases, (3, 5, 4)):
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"the fed gradient_factors must have one "
                           r"factor per example"):
            sess.run(grads, {**feed, f: np.ones(bad)})
    by_rank = custagg.gradients(loss, [w], aggregation_method=CUSTOM,
                                gradient_factors=f_any)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"gradient_factors must have rank 1"):
        sess.run(by_rank, {**feed, f_any: np.ones((4, 1))})
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"gradient_factors must have rank 1"):
        sess.run(by_rank, {**feed, f_any: 1.0})


def test_fed_length_differs_with_dynamic_batch(sess, rng):
    x = tf.compat.v1.placeholder(tf.float32, [None, 3])
    w = tf.compat.v1.Variable(np.ones((3, 1), np.float32))
    loss = tf.reshape(tf.matmul(x, w), [-1])                 # [None]
    f = tf.compat.v1.placeholder(tf.float32, [4])
    grads = custagg.gradients(loss, [w], aggregation_method=CUSTOM,
                              gradient_factors=f)
    sess.run(tf.compat.v1.global_variables_initializer())
    sess.run(grads, {x: np.ones((4, 3)), f: np.ones(4)})
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"the fed gradient_factors must have one factor "
                       r"per example"):
        sess.run(grads, {x: np.ones((6, 3)), f: np.ones(4)})


def test_vector_form_needs_a_known_rank(model):
    _, w, _ = model
    y = tf.compat.v1.placeholder(tf.float32)                # unknown rank
    with pytest.raises(ValueError, match=r"ys given as one tensor needs a "
                       r"known rank"):
        custagg.gradients(y, [w], aggregation_method=CUSTOM,
                          gradient_factors=tf.ones([4]))


def test_custom_with_ragged_ys(model):
    _, w, loss = model
    ragged = tf.RaggedTensor.from_row_lengths(loss, [1, 3])
    with pytest.raises(TypeError, match=r"with AggregationMethod.CUSTOM, ys "
                       r"must be Tensors .*RaggedTensor"):
        custagg.gradients(ragged, [w], aggregation_method=CUSTOM,
                          gradient_factors=tf.ones([4]))


# --------------------------------------------------------------------------
# Graphs, and the other arguments.


def test_xs_from_another_graph(model):
    _, _, loss = model
    other = tf.Graph()
    with other.as_default():
        x_other = tf.compat.v1.placeholder(tf.float32, [3])
        v_other = tf.compat.v1.Variable(1.0)
        f_other = tf.compat.v1.placeholder(tf.float32, [4])
    with pytest.raises(ValueError, match=r"xs\[1\] .* is from another graph "
                       r"than ys\[0\]"):
        custagg.gradients(loss, [loss, x_other])
    with pytest.raises(ValueError, match=r"xs\[0\] .* is from another graph"):
        custagg.gradients(loss, [v_other])
    with pytest.raises(ValueError, match=r"ys\[1\] .* is from another graph"):
        custagg.gradients([loss, x_other], [loss])
    with pytest.raises(ValueError, match=r"gradient_factors .* is from "
                       r"another graph"):
        custagg.gradients(loss, [loss], aggregation_method=CUSTOM,
                          gradient_factors=f_other)


def _tf_wording_first(exc_type, call_tf, call_custagg, sentences=None):
    """custagg's message starts with TF's own (all of it, or its first
    `sentences`), then adds custagg's guidance; both raise `exc_type`."""
    with pytest.raises(exc_type) as tf_err:
        call_tf()
    with pytest.raises(exc_type) as ca_err:
        call_custagg()
    tf_msg = str(tf_err.value).rstrip(".")
    if sentences:
        tf_msg = ". ".join(tf_msg.split(". ")[:sentences])
    ca_msg = str(ca_err.value)
    assert ca_msg.startswith(tf_msg), (ca_msg, tf_msg)
    assert "custagg.gradients:" in ca_msg[len(tf_msg):], ca_msg
    return ca_msg


def test_unknown_unconnected_gradients(model):
    _, w, loss = model
    msg = _tf_wording_first(
        ValueError,
        lambda: tf.compat.v1.gradients(loss, [w],
                                       unconnected_gradients="zeros"),
        lambda: custagg.gradients(loss, [w], unconnected_gradients="zeros"))
    assert re.match(r"Unknown value for unconnected_gradients: 'zeros'\. "
                    r"custagg.gradients: expected tf.UnconnectedGradients."
                    r"NONE or ZERO", msg), msg


def test_grad_ys_of_another_length(model):
    _, w, loss = model
    msg = _tf_wording_first(
        ValueError,
        lambda: tf.compat.v1.gradients([loss], [w], grad_ys=[None, None]),
        lambda: custagg.gradients([loss], [w], grad_ys=[None, None]))
    assert "pass one seed (or None) per y" in msg


def test_grad_ys_dtypes_like_tf(model):
    _, w, loss = model
    bad = tf.cast(tf.ones([4]), tf.bool)
    msg = _tf_wording_first(
        TypeError, lambda: tf.compat.v1.gradients(loss, [w], grad_ys=bad),
        lambda: custagg.gradients(loss, [w], grad_ys=bad))
    assert re.search(r"grad_ys\[0\] has dtype bool but ys\[0\] .* is "
                     r"float32; expected a real or integer", msg), msg
    flag = tf.cast(loss, tf.bool)
    seed = tf.ones([4], tf.bool)
    msg = _tf_wording_first(
        TypeError, lambda: tf.compat.v1.gradients(flag, [w], grad_ys=seed),
        lambda: custagg.gradients(flag, [w], grad_ys=seed))
    assert re.search(r"ys\[0\] .* has no gradient; ys must be numeric", msg)
    c = tf.complex(loss, loss)
    msg = _tf_wording_first(
        TypeError, lambda: tf.compat.v1.gradients(c, [w]),
        lambda: custagg.gradients(c, [w]))
    # The regex of TF's own testRealOnly.
    assert re.search(r"Gradients of complex tensors .* must set grad_ys "
                     r"\(y\.dtype = complex64\)", msg), msg
    assert "pass grad_ys for ys[0]" in msg


def test_missing_gradient_function_wording(graph):
    x = tf.constant(1.0)
    y = tf.raw_ops.Bitcast(input=x, type=tf.float32)  # no gradient registered
    loss = y * 2.0
    msg = _tf_wording_first(
        LookupError, lambda: tf.compat.v1.gradients(loss, [x]),
        lambda: custagg.gradients(loss, [x]), sentences=1)
    assert msg.startswith("No gradient defined for operation")
    assert "@tf.RegisterGradient('Bitcast')" in msg


def test_eager_mode_in_subprocess(run_python):
    """A call in eager mode, and eager tensors given in graph mode."""
    proc = run_python("""
        import json, os
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        import tensorflow as tf
        import custagg
        out = {"eager": tf.executing_eagerly()}
        x = tf.constant([1.0, 2.0])

        def error(fn):
            try:
                fn()
                return "no error"
            except Exception as e:          # the type is checked below
                return "%s: %s" % (type(e).__name__, e)

        out["call"] = error(lambda: custagg.gradients(x * x, [x]))
        out["call_custom"] = error(lambda: custagg.gradients(
            x * x, [x], aggregation_method=custagg.AggregationMethod.CUSTOM,
            gradient_factors=tf.ones([2])))
        with tf.Graph().as_default():
            y = tf.compat.v1.placeholder(tf.float32, [2])
            out["eager_xs"] = error(lambda: custagg.gradients(y * 2.0, [y, x]))
            out["eager_ys"] = error(lambda: custagg.gradients([y, x], [y]))
            out["eager_factors"] = error(lambda: custagg.gradients(
                y * 2.0, [y],
                aggregation_method=custagg.AggregationMethod.CUSTOM,
                gradient_factors=x))
            out["graph_ok"] = error(lambda: custagg.gradients(y * 2.0, [y]))
        print("RESULT" + json.dumps(out))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
    out = json.loads(line[len("RESULT"):])
    assert out["eager"] is True
    for key in ("call", "call_custom"):
        assert out[key].startswith("RuntimeError: custagg.gradients builds "
                                   "graph-mode gradients and needs graph "
                                   "mode"), out[key]
        assert "tf.compat.v1.disable_eager_execution()" in out[key]
    assert out["eager_xs"].startswith(
        "TypeError: custagg.gradients: xs[1] holds an eager tensor"), out
    assert out["eager_ys"].startswith(
        "TypeError: custagg.gradients: ys[1] holds an eager tensor"), out
    assert out["eager_factors"].startswith(
        "TypeError: custagg.gradients: gradient_factors holds an eager "
        "tensor"), out
    assert out["graph_ok"] == "no error"
