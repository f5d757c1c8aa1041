"""The Conv2D rule's three ways to per-example filter gradients, each alone.

`Conv2DRule.per_example` takes the first form that applies: one grouped
backprop-filter call (float32 with oneDNN kernels), one batched matmul per
filter offset (static spatial dims), or image patches. The spec table
exercises whichever form a row reaches; here every form is forced on the
same float32 problems and compared with the loop reference, so a form the
platform would not pick by default is still checked, and a row cannot pass
through a fallback while the fast form is broken.
"""

import numpy as np
import pytest
import tensorflow as tf

from custagg import registry, testing
from custagg.rules import conv

# (batch, image HxW, Cin, Cout, kernel, strides, padding, dilations, format)
CASES = [
    (1, 7, 2, 3, 3, [1, 1], "SAME", [1, 1], "NHWC"),
    (4, 9, 3, 2, 3, [2, 2], "VALID", [1, 1], "NHWC"),
    (3, 10, 2, 4, 4, [1, 2], "SAME", [1, 1], "NHWC"),
    (3, 9, 2, 3, 3, [1, 1], "SAME", [2, 2], "NHWC"),
    (2, 8, 1, 5, 5, [1, 1], [[0, 0], [1, 2], [2, 0], [0, 0]], [1, 1], "NHWC"),
]


def _problem(case, rng):
    batch, hw, cin, cout, k, strides, padding, dilations, fmt = case
    x = tf.constant(rng.randn(batch, hw, hw, cin).astype(np.float32))
    w = tf.Variable(rng.randn(k, k, cin, cout).astype(np.float32))
    explicit = []
    if not isinstance(padding, str):
        explicit = [p for pair in padding for p in pair]
        padding = "EXPLICIT"
    z = tf.raw_ops.Conv2D(input=x, filter=w.read_value(),
                          strides=[1] + strides + [1], padding=padding,
                          explicit_paddings=explicit,
                          dilations=[1] + dilations + [1], data_format=fmt)
    loss = tf.reduce_sum(tf.sin(z) * tf.cos(1.0 + z), axis=[1, 2, 3])
    dz = tf.gradients(tf.reduce_sum(loss), z)[0]
    ctx = registry.RuleContext(z.op, 1, dz, tf.shape(x)[0])
    return w, loss, ctx


FORMS = {
    "grouped": lambda rule, ctx: rule._grouped_per_example(ctx),
    "offsets": lambda rule, ctx: rule._offsets_per_example(ctx),
    "patches": lambda rule, ctx: rule._outer(ctx).per_example(),
}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_form_matches_loop(graph, form, case):
    rng = np.random.RandomState(7)
    w, loss, ctx = _problem(case, rng)
    per = FORMS[form](conv.Conv2DRule(), ctx)
    if per is None:
        assert form == "grouped" and not conv._grouped_kernels_available()
        pytest.skip("no grouped convolution kernels here (oneDNN off)")
    ref = testing.loop_per_example(loss, [w])[0]
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got, want = sess.run([per, ref])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())


def test_without_grouped_kernels_the_rule_uses_offsets(graph, monkeypatch):
    monkeypatch.setattr(conv, "_grouped_kernels_available", lambda: False)
    rng = np.random.RandomState(3)
    w, loss, ctx = _problem(CASES[2], rng)
    rule = conv.Conv2DRule()
    assert rule._grouped_per_example(ctx) is None
    per = rule.per_example(ctx)
    ref = testing.loop_per_example(loss, [w])[0]
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got, want = sess.run([per, ref])
    np.testing.assert_allclose(got, want, rtol=1e-4,
                               atol=1e-4 * np.abs(want).max())


def test_grouped_form_skips_float64(graph):
    x = tf.zeros([2, 5, 5, 1], tf.float64)
    w = tf.zeros([3, 3, 1, 2], tf.float64)
    z = tf.nn.conv2d(x, w, 1, "SAME")
    ctx = registry.RuleContext(z.op, 1, tf.ones_like(z), tf.shape(x)[0])
    # TF's float64 CPU kernels have no grouped convolution.
    assert conv.Conv2DRule()._grouped_per_example(ctx) is None
