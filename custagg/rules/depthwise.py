"""The rule for depthwise convolution filters (`DepthwiseConv2dNative`):
`tf.nn.depthwise_conv2d`, the depthwise half of `separable_conv2d`.

The forms (folded kernel call, per-offset batched matmuls, image patches),
the chunked norms and the one-call weighted sum are `conv.ConvBase`'s; the
rule is registered through `conv_views` (which also takes the
space-to-batch rows of a dilated one).
"""

from __future__ import annotations

import tensorflow as tf

from custagg.rules import conv
from custagg.rules import outer as _outer


class DepthwiseConv2dRule(conv.ConvBase):
    """Depthwise filter `[kh, kw, Cin, M]`; output channel `c * M + m`.

    Example b's gradient: `sum_p patches[b, p, k, c] * dz[b, p, c, m]`,
    per-example `[B, kh, kw, Cin, M]`.
    """

    # Below this many channels (Cin * M) the folded kernel call is the
    # fastest form; above it, one batched matmul per offset (measured on a
    # 2-core x86 CPU, B=256, 28x28: Cin*M = 2: folded 0.7 ms vs 5.5 ms;
    # Cin*M = 64: 223 ms vs 89 ms).
    _FOLDED_MAX_CHANNELS = 8

    def chunk_clip_ready(self, ctx):
        # Not in the clipped sums' joint chunk loop: the loop's chunk is
        # the smallest of its convolutions', and a depthwise filter's (the
        # windows of its many channels) drags the others' down while its
        # own summed gradient is one cheap call. keras_separable B=64,
        # 1 thread, clipped sum / aggregated gradient: 2.6x with neither
        # in the loop, 2.6x with either alone, 3.2x with both.
        del ctx
        return False

    def per_example(self, ctx):
        _, _, dilations, _ = self._attrs(ctx)
        kh, kw, cin, m = _outer.static_dims(ctx.param)
        # TF's CPU depthwise backprop-filter kernels reject dilations.
        folded_ok = max(dilations) == 1 and conv.folded_kernels_available()
        if folded_ok and cin * m <= self._FOLDED_MAX_CHANNELS:
            return self._folded_per_example(ctx)
        per = self._offsets_per_example(ctx)
        if per is not None:
            return per
        if folded_ok:
            return self._folded_per_example(ctx)
        patches, g = self._patches(ctx)
        batch = tf.shape(patches)[0]
        patches = tf.reshape(patches, [batch, -1, kh * kw, cin])
        g = tf.reshape(g, [batch, -1, cin, m])
        per = tf.einsum("bpkc,bpcm->bkcm", patches, g)
        return tf.reshape(per, [batch, kh, kw, cin, m])

    # Per example, the stacked windows `[kh*kw, Cin, P]` up to this many
    # elements are contracted in one batched matmul; beyond it offset by
    # offset (the stack holds kh*kw copies of the image). B=256, 28x28,
    # Cin=32, M=2, 1 thread: stacked 344 ms, per offset 407 ms, per offset
    # with each window transposed 519 ms (the summed kernel: 122 ms).
    _STACKED_MAX_ELEMENTS = 1 << 18

    def _offsets_per_example(self, ctx):
        """`[B, kh, kw, Cin, M]`: channel by channel, batched matmuls
        `[B*Cin, kh*kw, P] x [B*Cin, P, M]` (all offsets at once when the
        stack is small, else one offset at a time); image and dz are
        transposed to channels-first once."""
        kh, kw, cin, m = _outer.static_dims(ctx.param)
        found = self._offset_windows(ctx, channels_first=True)
        if found is None:
            return None
        windows, g, batch, positions = found                 # [B, Cin, P]
        g = tf.transpose(tf.reshape(g, [batch, positions, cin, m]),
                         [0, 2, 1, 3])                        # [B, Cin, P, M]
        if kh * kw * cin * positions <= self._STACKED_MAX_ELEMENTS:
            per = tf.matmul(tf.stack(windows, axis=2), g)     # [B, Cin, K, M]
        else:
            per = tf.stack([tf.matmul(w[:, :, None, :], g)[:, :, 0, :]
                            for w in windows], axis=2)       # [B, Cin, K, M]
        per = tf.transpose(per, [0, 2, 1, 3])                 # [B, K, Cin, M]
        return tf.reshape(per, [batch, kh, kw, cin, m])

    def _folded_per_example(self, ctx):
        """`[B, kh, kw, Cin, M]` from one depthwise backprop-filter call.

        A depthwise convolution never mixes channels, so B images folded
        into one `[1, H, W, B*Cin]` image (channel b*Cin + c) convolved with
        a `[kh, kw, B*Cin, M]` filter are B independent convolutions; the
        filter gradient of the folded call is the per-example gradients
        side by side. Output channel (b*Cin + c)*M + m is exactly the
        folded `[1, H', W', B*Cin*M]` output gradient.
        """
        fmt, strides, dilations, padding = self._attrs(ctx)
        kh, kw, cin, m = _outer.static_dims(ctx.param)
        x = ctx.op.inputs[0]
        batch = tf.shape(x)[0]
        x = conv.fold_batch(x, fmt, cin, batch)
        g = conv.fold_batch(ctx.grad, fmt, cin * m, batch)
        explicit = []
        if padding == "EXPLICIT":
            explicit = [0, 0] + sum(conv.explicit_hw_pads(ctx.op, fmt), []) + [0, 0]
        folded = tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
            input=x, filter_sizes=tf.stack([kh, kw, batch * cin, m]),
            out_backprop=g, strides=[1] + strides + [1], padding=padding,
            explicit_paddings=explicit, data_format="NHWC",
            dilations=[1] + dilations + [1])
        folded = tf.reshape(folded, tf.stack([kh, kw, batch, cin, m]))
        return tf.transpose(folded, [2, 0, 1, 3, 4])

    def _backprop_filter(self, ctx, g, x=None):
        fmt, _, _, padding = self._attrs(ctx)
        op = ctx.op
        return tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
            input=op.inputs[0] if x is None else x, filter_sizes=tf.shape(op.inputs[1]),
            out_backprop=g, strides=op.get_attr("strides"), padding=padding,
            explicit_paddings=op.get_attr("explicit_paddings"),
            data_format=fmt, dilations=op.get_attr("dilations"))
