"""The rule for `Conv3D` filters (`tf.compat.v1.layers.conv3d`,
`tf.nn.conv3d`).

A 3-D convolution is a matmul of volume patches with the flattened filter:
`z[b, p, :] = patches[b, p, :] @ W.reshape(kd*kh*kw*Cin, Cout)` over the P
output positions, so example b's filter gradient is `sum_p patches[b, p]
(x) dz[b, p]`: the outer-product family (`outer.Outer`, T = P). Its norms
take the Gram form or the materialized `[B, K, Cout]`, whichever costs less
(`Outer.squared_norms`); the weighted sum `sum_b c_b G_b` is ONE call of
TF's own filter-gradient kernel on the factor-scaled output gradient
(exact: example b's term is bilinear in its image and its dz), nothing
per-example kept. The patches come from `tf.extract_volume_patches`, whose
patch order (kd, kh, kw, Cin) is the filter's; it has no dilations, so a
dilated Conv3D (which TF's CPU kernels do not run either) is not handled.
"""

from __future__ import annotations

import tensorflow as tf

from custagg.rules import conv
from custagg.rules import outer as _outer
from custagg.rules import registry


def _ndhwc(t, data_format):
    return tf.transpose(t, [0, 2, 3, 4, 1]) if data_format == "NCDHW" else t


def _spatial(values, data_format):
    values = list(values)
    return values[2:5] if data_format == "NCDHW" else values[1:4]


@registry.register_rule("Conv3D")
class Conv3DRule(registry.Rule):
    """`Conv3D` filter `[kd, kh, kw, Cin, Cout]`; per-example
    `[B, kd, kh, kw, Cin, Cout]`."""

    def unsupported(self, ctx):
        why = conv.filter_unsupported(ctx, ("NDHWC", "NCDHW"))
        if why:
            return why
        fmt = ctx.op.get_attr("data_format").decode()
        if max(_spatial(ctx.op.get_attr("dilations"), fmt)) > 1:
            return "dilations (no volume patches with dilations)"
        return None

    def _outer(self, ctx):
        """`outer.Outer` of the volume patches `[B, P, kd*kh*kw*Cin]` and
        the output gradient `[B, P, Cout]`."""
        op = ctx.op
        fmt = op.get_attr("data_format").decode()
        kd, kh, kw, cin, cout = _outer.static_dims(ctx.param)
        x = _ndhwc(op.inputs[0], fmt)
        patches = tf.compat.v1.extract_volume_patches(
            x, ksizes=[1, kd, kh, kw, 1],
            strides=[1] + _spatial(op.get_attr("strides"), fmt) + [1],
            padding=op.get_attr("padding").decode())
        g = _ndhwc(ctx.grad, fmt)
        # P static where the output's D, H, W are: the Outer's choice
        # between the Gram and the materialized norms reads it.
        # Without them, B from the output gradient and P as the rest (one
        # -1 per shape: B and P both unknown are two).
        positions = g.shape[1:4].num_elements()
        if positions is None:
            batch = tf.shape(g)[0]
            patches = tf.reshape(patches, tf.stack(
                [batch, -1, kd * kh * kw * cin]))
            g = tf.reshape(g, tf.stack([batch, -1, cout]))
        else:
            patches = tf.reshape(patches, [-1, positions, kd * kh * kw * cin])
            g = tf.reshape(g, [-1, positions, cout])
        return _outer.Outer(patches, g,
                            _outer.layout([kd, kh, kw, cin], [cout], None))

    def outer(self, ctx):
        return self._outer(ctx)

    def per_example(self, ctx):
        return self._outer(ctx).per_example()

    def squared_norms(self, ctx):
        if self.has_per_example(ctx):
            return super().squared_norms(ctx)
        return self._outer(ctx).squared_norms()

    def group_squared_norms(self, ctx, num_groups):
        return self._outer(ctx).grouped(num_groups).squared_norms()

    def segment_squared_norms(self, ctx, segments):
        return self._outer(ctx).grouped(segments).squared_norms()

    def squared_sum(self, ctx):
        return self._outer(ctx).squared_sum()

    def weighted_sum(self, ctx, weights):
        """`sum_b c_b G_b`: TF's filter-gradient kernel on `c_b dz_b`."""
        op = ctx.op
        g = ctx.grad
        c = tf.cast(weights, g.dtype)
        rows = tf.reshape(g, tf.stack([tf.shape(g)[0], -1]))
        scaled = tf.reshape(rows * c[:, None], tf.shape(g))
        return tf.raw_ops.Conv3DBackpropFilterV2(
            input=op.inputs[0], filter_sizes=tf.shape(op.inputs[1]),
            out_backprop=scaled, strides=op.get_attr("strides"),
            padding=op.get_attr("padding"),
            data_format=op.get_attr("data_format"),
            dilations=op.get_attr("dilations"))
