"""The certified form refuses at plan time when a rule's rows provably are
not the batch's examples (per_example/forms/rows.py `non_example_rows`).

Found by the randomized per-example models (tests/test_randomized.py, seeds
40140 and 40212): with a static batch of 1 and the input x [1, 3] in xs,
the MatMul rule takes x as the parameter of `x @ W` and reads its examples
from W's 3 columns. The certified form accepted it; its values, shaped
[3, 1, 3], could not be added to another path's [1, 1, 3] and building the
graph raised. Now that case goes to an exact form, and every value is
checked against one `tf.compat.v1.gradients(loss[i])` per example
(float64), with the batch static and dynamic, at B=1 and B=7 (slow: 32 and
33).
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
import per_example_reference as ref

BATCHES = [pytest.param((1, 7), id="B1,7"),
           pytest.param((32, 33), id="B32,33", marks=pytest.mark.slow)]


def _model(batch, dynamic, center):
    """x [B, 3] -> dense (+ a batch-mean subtraction when `center`) ->
    per-example squared norm; xs = the weights and x itself."""
    rng = np.random.RandomState(batch)
    x = tf.compat.v1.placeholder(tf.float64, [None if dynamic else batch, 3])
    w = tf.Variable(rng.normal(size=(3, 3)), dtype=tf.float64)
    b = tf.Variable(rng.normal(size=(3,)), dtype=tf.float64)
    h = tf.matmul(x, w) + b
    if center:
        h = h - 0.5 * tf.reduce_mean(h, axis=0, keepdims=True)
    loss = tf.reduce_sum(tf.square(h), 1)
    return loss, [w, b, x], {x: rng.normal(size=(batch, 3))}


@pytest.mark.parametrize("center", [False, True], ids=["apart", "centered"])
@pytest.mark.parametrize("dynamic", [
    pytest.param(False, id="static"),
    # A dynamic batch never met the bug (the rule refuses x there); it
    # checks the same values at a higher cost (x takes the O(B^2) pfor).
    pytest.param(True, id="dynamic", marks=pytest.mark.slow)])
@pytest.mark.parametrize("batches", BATCHES)
def test_input_in_xs_matches_the_loop(batches, dynamic, center):
    for batch in batches:
        with tf.Graph().as_default() as graph:
            loss, xs, feed = _model(batch, dynamic, center)
            # Every public function in the slow set; the two that met the
            # bug (the per-example values and a sum over them) by default.
            functions = (ref.FUNCTIONS if batch > 7 or dynamic else
                         ("per_example_gradients", "clipped_gradients"))
            built, weights = ref.build_functions(loss, xs, "auto", functions)
            plan = custagg.plan_per_example(loss, xs)
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                why = ref.check(sess, loss, xs, feed, built, weights,
                                rtol=1e-9, label="B=%d" % batch)
        assert why is None, why
        x_line = [l for l in str(plan).splitlines()
                  if l.strip().startswith(xs[2].name)][0]
        form = x_line.split(None, 1)[1].split("[")[0]
        if batch == 1 and not dynamic:
            # W's 3 columns are not the one example: no certificate.
            assert not form.startswith("rules"), x_line


def test_the_refusal_names_the_rows():
    with tf.Graph().as_default():
        loss, xs, _ = _model(1, dynamic=False, center=False)
        text = str(custagg.plan_per_example(loss, xs))
    assert "are not the batch's 1 examples" in text, text
