"""Convolutions whose filter gradient is another convolution's, seen through
a view: registers the rules of `Conv2D`, `DepthwiseConv2dNative` and
`Conv2DBackpropInput`.

A view (`conv.ConvView`) is a convolution op as the `conv` forms read it:
an image, a filter, attributes. Every quantity of the rule (per-example
gradients, norms, chunked clipped sums, outer products) is the plain rule's
on the view, so nothing here repeats the forms.

* **Transposed convolutions** (`tf.compat.v1.nn.conv2d_transpose`,
  `tf.compat.v1.layers.conv2d_transpose`: `Conv2DBackpropInput` with the
  filter as a weight). `z = conv2d_transpose(x, W)` is the input gradient
  of `y = conv2d(z, W)` at output gradient x, so `dL/dW` is Conv2D's filter
  gradient with the roles swapped: image `dz` (the gradient at z), output
  gradient x (TF's own gradient of the op is exactly that call). The view
  is the Conv2D on image `dz` with the op's strides, padding and
  dilations, whose "output gradient" is x: example b's filter gradient
  reads only row b of both.

* **Space-to-batch convolutions** (dilated convolutions as TF lowers
  them: `tf.nn.atrous_conv2d`, `tf.compat.v1.layers.conv2d` /
  `conv1d` / `separable_conv2d` with `dilation_rate`, `tf.nn.convolution`
  with dilations, Keras' causal dilated Conv1D: `SpaceToBatchND`, the
  convolution, `BatchToSpaceND`). The convolution sees `n*B` images (n =
  the block's size), row `k*B + b` of example b (`BatchToSpaceND`'s
  block-major order), so its output rows are not the batch's examples and
  examples stay apart only from the `BatchToSpaceND`'s output on (the
  rule's coupling start). Example b's gradient sums its n rows': the view
  lays example b's n (padded) images side by side along W, one `[B, H,
  n*W, C]` image, and its n output gradients the same way, each padded
  with zeros over the `(kw-1)*dw` positions whose windows straddle two
  images. A VALID, stride-1 convolution of the side-by-side image then has
  example b's n convolutions at its other positions, so its filter
  gradient is the sum of the n, and the straddling positions add nothing
  (their output gradient is zero). The view keeps the op's dilations; the
  op's own padding is applied to each image first. Convolutions with
  strides are not viewed this way (TF's lowering never strides the inner
  convolution).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from custagg import _tf_compat
from custagg import op_kinds
from custagg._tf_compat import tensor_util
from custagg.rules import conv
from custagg.rules import conv2d
from custagg.rules import depthwise
from custagg.rules import outer as _outer
from custagg.rules import registry


def batch_to_space(op):
    """`(BatchToSpaceND op, block size n)` when `op`'s output reaches the
    loss only through a `BatchToSpaceND` with a static block (through
    row-keeping ops, `op_kinds.CONV_ROW_VIEWS`, each its input's one
    consumer besides ops that read only its shape), else None."""
    t = op.outputs[0]
    while True:
        consumers = _tf_compat.value_consumers(t)
        if len(consumers) != 1:
            return None
        nxt = consumers[0]
        if nxt.type == "BatchToSpaceND" and nxt.inputs[0] is t:
            block = tensor_util.constant_value(nxt.inputs[1])
            if block is None:
                return None
            return nxt, int(np.prod(block))
        if nxt.type not in op_kinds.CONV_ROW_VIEWS:
            return None
        if nxt.type == "Squeeze" and 0 in list(nxt.get_attr("squeeze_dims")):
            return None
        t = nxt.outputs[0]


def _nhwc_pads(op, image, grad, kernel):
    """`[[top, bottom], [left, right]]` of the op's padding, the op's image
    and output NHWC; None where SAME needs sizes that are not static."""
    fmt = op.get_attr("data_format").decode()
    padding = op.get_attr("padding").decode()
    if padding == "VALID":
        return [[0, 0], [0, 0]]
    if padding == "EXPLICIT":
        pads = list(op.get_attr("explicit_paddings"))
        return conv.hw([pads[i:i + 2] for i in range(0, 8, 2)], fmt)
    dilations = conv.hw(op.get_attr("dilations"), fmt)
    pads = []
    for n_in, n_out, k, d in zip(image.shape[1:3], grad.shape[1:3], kernel,
                                 dilations):
        n_in, n_out = tf.compat.dimension_value(n_in), \
            tf.compat.dimension_value(n_out)
        if n_in is None or n_out is None:
            return None
        total = max(n_out - 1 + (k - 1) * d + 1 - n_in, 0)
        pads.append([total // 2, total - total // 2])
    return pads


class _ViewedRule(registry.Rule):
    """`inner`'s answers on `view(ctx)`; subclasses say when and how."""

    def __init__(self, inner):
        self._inner = inner

    def _view(self, ctx):
        """The view's context (or `ctx` itself where none is needed); built
        once per context (`ctx.cache`), so a chunk loop's body slices the
        view built before it instead of rebuilding it each iteration."""
        if not self._needs_view(ctx):
            return ctx
        return registry.cached(ctx, "conv_view", lambda: self._build_view(ctx))

    def _needs_view(self, ctx):
        raise NotImplementedError

    def _build_view(self, ctx):
        raise NotImplementedError

    def unsupported(self, ctx):
        return self._inner.unsupported(ctx)


def _through_view(name):
    """`_ViewedRule.<name>(ctx, *args)`: the inner rule's method on the
    view's context."""
    def method(self, ctx, *args):
        return getattr(self._inner, name)(self._view(ctx), *args)
    method.__name__ = name
    method.__qualname__ = "_ViewedRule." + name
    method.__doc__ = "The inner rule's `" + name + "` on the view's context."
    return method


# Every quantity a viewed rule gives is its inner rule's on the view.
for _name in ("per_example",
              "cached_per_example",
              "has_per_example",
              "squared_norms",
              "weighted_sum",
              "squared_sum",
              "group_squared_norms",
              "segment_squared_norms",
              "outer",
              "chunk_clip_ready",
              "chunk_size",
              "chunk_clip_parts"):
    setattr(_ViewedRule, _name, _through_view(_name))
del _name


class _SpaceToBatchRule(_ViewedRule):
    """A Conv2D or depthwise rule that also takes the op where its output
    rows are a `BatchToSpaceND`'s blocks (module docstring)."""

    def _needs_view(self, ctx):
        return batch_to_space(ctx.op) is not None

    def unsupported(self, ctx):
        why = self._inner.unsupported(ctx)
        if why or batch_to_space(ctx.op) is None:
            return why
        fmt = ctx.op.get_attr("data_format").decode()
        if max(conv.hw(ctx.op.get_attr("strides"), fmt)) > 1:
            return ("a strided convolution whose rows go to a "
                    "BatchToSpaceND (the rule views only stride 1, as TF's "
                    "dilated convolutions lower)")
        padding = ctx.op.get_attr("padding").decode()
        if padding == "SAME" and None in [
                tf.compat.dimension_value(d) for d in
                conv.hw(ctx.op.inputs[0].shape, fmt) +
                conv.hw(ctx.op.outputs[0].shape, fmt)]:
            return ("SAME padding of images whose H or W is not static, "
                    "under a BatchToSpaceND")
        return None

    def coupling_start(self, ctx):
        found = batch_to_space(ctx.op)
        if found is None:
            return self._inner.coupling_start(ctx)
        return found[0].outputs[0], 0

    def output_batch_axis(self, ctx):
        return 0

    def _build_view(self, ctx):
        op = ctx.op
        _, blocks = batch_to_space(op)
        fmt = op.get_attr("data_format").decode()
        kh, kw = _outer.static_dims(ctx.param)[:2]
        image, grad = conv.nhwc(op.inputs[0], fmt), conv.nhwc(ctx.grad, fmt)
        pads = _nhwc_pads(op, image, grad, (kh, kw))
        image = tf.pad(image, [[0, 0]] + pads + [[0, 0]])
        dilation_w = conv.hw(op.get_attr("dilations"), fmt)[1]
        straddle = (kw - 1) * dilation_w
        grad = tf.pad(grad, [[0, 0], [0, 0], [0, straddle], [0, 0]])
        image = _side_by_side(image, blocks)
        grad = _side_by_side(grad, blocks)
        width = tf.compat.dimension_value(grad.shape[2])
        grad = grad[:, :, :(tf.shape(grad)[2] if width is None else width)
                    - straddle, :]
        attrs = {"data_format": b"NHWC", "padding": b"VALID",
                 "strides": [1, 1, 1, 1], "explicit_paddings": [],
                 "dilations": [1] + conv.hw(op.get_attr("dilations"), fmt)
                 + [1]}
        view = conv.ConvView(op, image, None, attrs=attrs)
        return registry.RuleContext(view, 1, grad, ctx.batch_size,
                                    ctx.cache)


def _side_by_side(t, blocks):
    """`[n*B, H, W, C]` (row k*B + b) -> `[B, H, n*W, C]`: each example's n
    images side by side along W."""
    static = t.shape[1:].as_list()
    shape = tf.shape(t)
    t = tf.reshape(t, tf.concat([[blocks, -1], shape[1:]], 0))
    t = tf.transpose(t, [1, 2, 0, 3, 4])
    t = tf.reshape(t, tf.stack([shape[0] // blocks, shape[1],
                                blocks * shape[2], shape[3]]))
    if None not in static:
        # The forms read static H, W (windows, output positions).
        t.set_shape([None, static[0], blocks * static[1], static[2]])
    return t


class _TransposedRule(_ViewedRule):
    """`Conv2DBackpropInput` with the filter (input 1) as the weight: the
    Conv2D whose input gradient it is, on image dz with output gradient x
    (module docstring)."""

    def _needs_view(self, ctx):
        return True

    def coupling_start(self, ctx):
        return ctx.op.outputs[0], 0

    def output_batch_axis(self, ctx):
        return 0

    def _build_view(self, ctx):
        op = ctx.op
        view = conv.ConvView(op, ctx.grad, None, op_type="Conv2D")
        return registry.RuleContext(view, 1, op.inputs[2], ctx.batch_size,
                                    ctx.cache)


@registry.register_rule("Conv2D")
class Conv2DViewRule(_SpaceToBatchRule):
    """`Conv2D` filters (`conv2d.Conv2DRule`), space-to-batch rows included."""

    def __init__(self):
        super().__init__(conv2d.Conv2DRule())


@registry.register_rule("DepthwiseConv2dNative")
class DepthwiseViewRule(_SpaceToBatchRule):
    """Depthwise filters (`depthwise.DepthwiseConv2dRule`), space-to-batch rows
    included (a dilated `separable_conv2d`)."""

    def __init__(self):
        super().__init__(depthwise.DepthwiseConv2dRule())


@registry.register_rule("Conv2DBackpropInput")
class Conv2DTransposeRule(_TransposedRule):
    """Transposed convolutions' filters."""

    def __init__(self):
        super().__init__(conv2d.Conv2DRule())
