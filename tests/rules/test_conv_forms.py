"""The convolution rules' ways to per-example filter gradients, each alone.

`Conv2DRule.per_example` takes the first form that applies: one grouped
backprop-filter call on the batch folded into the channels (float32 with
oneDNN kernels), one batched matmul per filter offset (static spatial
dims), or image patches; `DepthwiseConv2dRule` a folded depthwise call or
patches. The spec table exercises whichever form a row reaches; here every
form is forced on the same float32 problems and compared with the loop
reference, so a form the platform would not pick by default is still
checked, and a row cannot pass through a fallback while the fast form is
broken.
"""

import numpy as np
import pytest
import tensorflow as tf

from custagg import testing
from custagg.rules import registry
from custagg.rules import conv
from custagg.rules import conv2d
from custagg.rules import depthwise


def _onednn():
    from tensorflow.python.util import _pywrap_util_port
    return bool(_pywrap_util_port.IsMklEnabled())


# (batch, image HxW, Cin, Cout or multiplier, kernel, strides, padding,
#  dilations, static spatial dims)
CASES = [
    (1, 7, 2, 3, 3, [1, 1], "SAME", [1, 1], True),
    (4, 9, 3, 2, 3, [2, 2], "VALID", [1, 1], True),
    (3, 10, 2, 4, 4, [1, 2], "SAME", [1, 1], True),
    (3, 9, 2, 3, 3, [1, 1], "SAME", [2, 2], True),
    (2, 8, 1, 5, 5, [1, 1], [[0, 0], [1, 2], [2, 0], [0, 0]], [1, 1], True),
    (3, 9, 2, 3, 3, [2, 2], "SAME", [1, 1], False),
    # Batches at and off a multiple of pfor's chunk (32).
    (32, 6, 2, 2, 3, [1, 1], "SAME", [1, 1], True),
    (33, 6, 1, 2, 3, [2, 2], "VALID", [1, 1], False),
]
DTYPES = [tf.float32, tf.float64]


def _problem(case, rng, depthwise=False, dtype=tf.float32):
    batch, hw, cin, cout, k, strides, padding, dilations, static = case
    if max(dilations) > 1 and dtype == tf.float64:
        pytest.skip("no float64 CPU kernel for the dilated reference gradient")
    if max(dilations) > 1 and not _onednn():
        # The loop reference needs a dilated backprop-filter kernel: TF's
        # own CPU kernels have none (oneDNN's float32 ones do).
        pytest.skip("no CPU kernel for the dilated reference gradient")
    if depthwise and strides[0] != strides[1] and not _onednn():
        pytest.skip("TF's own CPU depthwise kernel needs equal strides")
    shape = [None, hw, hw, cin] if static else [None, None, None, cin]
    np_dtype = dtype.as_numpy_dtype
    x = tf.compat.v1.placeholder(dtype, shape)
    feed = {x: rng.randn(batch, hw, hw, cin).astype(np_dtype)}
    w = tf.Variable(rng.randn(k, k, cin, cout).astype(np_dtype))
    explicit = []
    if not isinstance(padding, str):
        explicit = [p for pair in padding for p in pair]
        padding = "EXPLICIT"
    conv_op = (tf.raw_ops.DepthwiseConv2dNative if depthwise
               else tf.raw_ops.Conv2D)
    z = conv_op(input=x, filter=w.read_value(), strides=[1] + strides + [1],
                padding=padding, explicit_paddings=explicit,
                dilations=[1] + dilations + [1], data_format="NHWC")
    def per_example_loss(z):
        return tf.reduce_sum(tf.sin(z) * tf.cos(1.0 + z), axis=[1, 2, 3])

    loss = per_example_loss(z)
    dz = tf.gradients(tf.reduce_sum(loss), z)[0]
    ctx = registry.RuleContext(z.op, 1, dz, tf.shape(x)[0])
    if depthwise and max(dilations) > 1:
        # TF's registered gradient of a dilated DepthwiseConv2dNative
        # ignores the dilations on the CPU (its forward is right): the
        # reference goes through tf.nn.depthwise_conv2d's space-to-batch
        # form of the same convolution instead.
        assert padding == "SAME" and strides == [1, 1]
        loss = per_example_loss(tf.nn.depthwise_conv2d(
            x, w, [1, 1, 1, 1], "SAME", dilations=dilations))
    return w, loss, ctx, feed


def _rtol(w):
    return 1e-9 if w.dtype.base_dtype == tf.float64 else 1e-4


def _check(per, loss, w, feed):
    batch = next(iter(feed.values())).shape[0]
    # The loop reference needs a static B: the fed batch's.
    ref, = testing.loop_per_example(tf.reshape(loss, [batch]), [w])
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got, want = sess.run([per, ref], feed)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=_rtol(w),
                               atol=_rtol(w) * np.abs(want).max())


def _with(rule, name, value):
    setattr(rule, name, value)
    return rule


def _windows_anywhere(rule):
    return _with(_with(rule, "_WINDOWS_STRIDED", True),
                 "_WINDOWS_MAX_OFFSETS", 10 ** 6)


CONV2D_FORMS = {
    # The windows form forced on strided and large filters too (the rule
    # leaves them to the grouped form by default).
    "windows": lambda rule, ctx: _windows_anywhere(rule)._windows_per_example(
        ctx),
    # The same form with the NHWC concat of windows (many input channels).
    "windows_nhwc": lambda rule, ctx: _with(
        _windows_anywhere(rule), "_WINDOWS_CHANNELS_FIRST_MAX",
        0)._windows_per_example(ctx),
    "grouped": lambda rule, ctx: rule._grouped_per_example(ctx),
    "offsets": lambda rule, ctx: rule._offsets_per_example(ctx),
    "patches": lambda rule, ctx: rule._outer(ctx).per_example(),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("form", sorted(CONV2D_FORMS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_conv2d_form_matches_loop(graph, form, case, dtype):
    rng = np.random.RandomState(7)
    w, loss, ctx, feed = _problem(case, rng, dtype=dtype)
    per = CONV2D_FORMS[form](conv2d.Conv2DRule(), ctx)
    if per is None:
        if form == "grouped" and dtype == tf.float64:
            # TF's float64 CPU kernels have no grouped convolution.
            pytest.skip("no float64 grouped convolution kernel")
        if form in ("offsets", "windows", "windows_nhwc"):
            assert not case[-1], form + " form refused static spatial dims"
            pytest.skip("the %s form needs static spatial dims" % form)
        assert form == "grouped" and not conv.folded_kernels_available()
        pytest.skip("no grouped convolution kernels here (oneDNN off)")
    _check(per, loss, w, feed)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_depthwise_forms_match_loop(graph, case, monkeypatch):
    """Each depthwise form alone: folded (no dilations), offsets (static H
    and W), patches (neither available)."""
    rng = np.random.RandomState(11)
    w, loss, ctx, feed = _problem(case, rng, depthwise=True)
    rule = depthwise.DepthwiseConv2dRule()
    forms = {}
    if max(case[7]) == 1:
        forms["folded"] = rule._folded_per_example(ctx)
    offsets = rule._offsets_per_example(ctx)
    if offsets is None:
        assert not case[-1], "offsets form refused static spatial dims"
    else:
        forms["offsets"] = offsets
        # The same form one offset at a time (large images).
        monkeypatch.setattr(rule, "_STACKED_MAX_ELEMENTS", 0)
        forms["offsets_one_by_one"] = rule._offsets_per_example(ctx)
    monkeypatch.setattr(conv, "folded_kernels_available", lambda: False)
    monkeypatch.setattr(rule, "_offsets_per_example", lambda ctx: None)
    forms["patches"] = rule.per_example(ctx)
    for per in forms.values():
        _check(per, loss, w, feed)


def test_without_folded_kernels_conv2d_uses_offsets(graph, monkeypatch):
    monkeypatch.setattr(conv, "folded_kernels_available", lambda: False)
    rng = np.random.RandomState(3)
    w, loss, ctx, feed = _problem(CASES[2], rng)
    rule = conv2d.Conv2DRule()
    assert rule._grouped_per_example(ctx) is None
    monkeypatch.setattr(rule, "_windows_per_example", lambda ctx: None)
    per = rule.per_example(ctx)
    types = {op.type for op in graph.get_operations()}
    assert "ExtractImagePatches" not in types and "BatchMatMulV2" in types
    _check(per, loss, w, feed)


def test_folded_form_switch(monkeypatch):
    monkeypatch.setenv("CUSTAGG_FOLDED_CONV", "0")
    assert not conv.folded_kernels_available()
    monkeypatch.setenv("CUSTAGG_FOLDED_CONV", "1")
    assert conv.folded_kernels_available()
    monkeypatch.setenv("CUSTAGG_FOLDED_CONV", "yes")
    with pytest.raises(ValueError, match="CUSTAGG_FOLDED_CONV is 'yes'.*'0'"):
        conv.folded_kernels_available()
    monkeypatch.delenv("CUSTAGG_FOLDED_CONV")
    assert conv.folded_kernels_available() == _onednn()


def test_grouped_form_skips_float64(graph):
    x = tf.zeros([2, 5, 5, 1], tf.float64)
    w = tf.zeros([3, 3, 1, 2], tf.float64)
    z = tf.nn.conv2d(x, w, 1, "SAME")
    ctx = registry.RuleContext(z.op, 1, tf.ones_like(z), tf.shape(x)[0])
    # TF's float64 CPU kernels have no grouped convolution.
    assert conv2d.Conv2DRule()._grouped_per_example(ctx) is None


@pytest.mark.parametrize("channels_first", [True, False])
@pytest.mark.parametrize("case", [c for c in CASES if c[-1]],
                         ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_conv2d_gram_norms_and_window_sum_match_loop(graph, case,
                                                     channels_first, dtype,
                                                     monkeypatch):
    """The Gram norms over positions and the weighted sum from the window
    patches (one matmul over B*P rows), forced on every static case."""
    rng = np.random.RandomState(5)
    w, loss, ctx, feed = _problem(case, rng, dtype=dtype)
    rule = conv2d.Conv2DRule()
    monkeypatch.setattr(rule, "_GRAM_FACTOR", 0)
    monkeypatch.setattr(rule, "_WINDOWS_CHANNELS_FIRST_MAX",
                        99 if channels_first else 0)
    ctx = ctx._replace(cache={})
    norms = rule.squared_norms(ctx)
    assert not rule.has_per_example(ctx), "the Gram form was not taken"
    batch = next(iter(feed.values())).shape[0]
    weights = tf.constant(rng.randn(batch).astype(dtype.as_numpy_dtype))
    total = rule.weighted_sum(ctx, weights)
    ref, = testing.loop_per_example(tf.reshape(loss, [batch]), [w])
    want_norms = tf.reduce_sum(tf.square(ref), axis=[1, 2, 3, 4])
    want_total = tf.tensordot(weights, ref, axes=1)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got = sess.run([norms, total, want_norms, want_total], feed)
    for g, want in ((got[0], got[2]), (got[1], got[3])):
        np.testing.assert_allclose(g, want, rtol=_rtol(w),
                                   atol=_rtol(w) * np.abs(want).max())


def test_windows_form_left_to_grouped_for_strided_or_large_filters(graph):
    """By default the windows form (one slice per offset) declines strided
    and large filters, where the slices cost more than the kernel."""
    rule = conv2d.Conv2DRule()
    for strides, k, taken in (([1, 1], 3, True), ([2, 2], 3, False),
                              ([1, 1], 6, False)):
        x = tf.compat.v1.placeholder(tf.float32, [None, 12, 12, 2])
        w = tf.Variable(tf.ones([k, k, 2, 3]))
        z = tf.nn.conv2d(x, w, [1] + strides + [1], "SAME")
        ctx = registry.RuleContext(z.op, 1, tf.ones_like(z), tf.shape(x)[0])
        assert (rule._windows_per_example(ctx) is not None) == taken
