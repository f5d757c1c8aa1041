"""Rule for the scale and offset of `FusedBatchNormV3` in inference mode.

With `is_training=False` the op is a per-channel affine map of x by the
fed mean and variance, `y = scale * xhat + offset` with
`xhat = (x - mean) / sqrt(variance + epsilon)`, so example b's gradients are
`sum dy_b * xhat_b` (scale) and `sum dy_b` (offset), summed over every axis
but the channel one. Per-example results are `[B, C]`, as small as the
activations' channels, so the reductions are taken from them directly.

Training mode normalizes by statistics of the batch: examples interact, and
the rule declines (the planner falls back to an exact strategy).
"""

import tensorflow as tf

from custagg.rules import registry
from custagg.rules import _reduce


# V3 is what tf.nn / Keras build on every supported TF release.
@registry.register_rule("FusedBatchNormV3")
class FusedBatchNormRule(registry.Rule):
    """`y = FusedBatchNorm(x, scale, offset, mean, variance)`; returns `[B, C]`."""

    def unsupported(self, ctx):
        if ctx.op.get_attr("is_training"):
            return ("training mode normalizes with batch statistics, so "
                    "examples interact")
        if ctx.input_index not in (1, 2):
            return "the parameter is not the scale or the offset"
        if ctx.op.inputs[0].shape.rank is None:
            return "the input's rank is not static"
        return None

    def _channel_axis(self, ctx):
        rank = ctx.op.inputs[0].shape.rank
        fmt = ctx.op.get_attr("data_format").decode()
        return 1 if fmt.startswith("NC") else rank - 1

    def per_example(self, ctx):
        op, dy = ctx.op, ctx.grad
        rank = dy.shape.rank
        channel = self._channel_axis(ctx)
        if ctx.input_index == 1:
            shape = [1] * rank
            shape[channel] = -1
            # x - mean waits for dy: built from forward values alone, it
            # would run in the forward pass and be held, as large as the
            # activations, until the backward pass reaches this layer (the
            # clipped sum's peak: 1.6x the aggregated gradient's).
            with tf.control_dependencies([dy]):
                x = tf.cast(op.inputs[0], dy.dtype)
                mean = tf.reshape(tf.cast(op.inputs[3], dy.dtype), shape)
                dy = dy * (x - mean)
        out = _reduce.per_example_channel_sums(dy, channel)     # [B, C]
        if ctx.input_index == 1:
            # The per-channel 1/sqrt(var + eps) after the reduction: one
            # pass over the activations fewer.
            var = tf.cast(op.inputs[4], dy.dtype)
            eps = tf.cast(op.get_attr("epsilon"), dy.dtype)
            out = out * tf.math.rsqrt(var + eps)
        return tf.cast(out, ctx.param.dtype)
