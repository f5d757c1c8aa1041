"""Rules for parameters broadcast over the batch: biases, scales, shifts.

`BiasAdd` (NHWC/NC... and NCHW), and `AddV2`/`Add`/`Sub`/`Mul` where the
parameter has no batch axis (LayerNorm's gamma and beta, a learned scale).
With `u = dz` (Add), `-dz` (parameter subtracted) or `dz * other` (Mul),
example b's gradient is `u[b]` summed over the axes the parameter was
broadcast along. Per-example gradients are `[B, *p.shape]`, small next to
the activations, so the reductions are taken from them directly.
"""

import tensorflow as tf

from custagg.rules import registry
from custagg.rules import outer as _outer
from custagg.rules import _reduce


def _sum_to_param(u, p_dims):
    """Sums `u` `[B, *out]` to `[B, *p_dims]` (p right-aligned in out)."""
    out_rank = u.shape.rank - 1
    lead = out_rank - len(p_dims)
    axes = list(range(1, 1 + lead))
    for j, d in enumerate(p_dims):
        out_dim = tf.compat.dimension_value(u.shape[1 + lead + j])
        if d == 1 and out_dim != 1:
            axes.append(1 + lead + j)
    if axes:
        u = tf.reduce_sum(u, axis=axes, keepdims=True)
    return tf.reshape(u, [-1] + list(p_dims))


@registry.register_rule("AddV2", "Add", "Sub", "Mul")
class BroadcastRule(registry.Rule):
    """`z = x + p`, `x - p`, `p - x` or `x * p`, with `p` broadcast over x's batch."""

    def unsupported(self, ctx):
        p_dims = _outer.static_dims(ctx.param)
        z = ctx.op.outputs[0]
        if p_dims is None or z.shape.rank is None:
            return "the parameter's shape or the output's rank is not static"
        if len(p_dims) == z.shape.rank and (not p_dims or p_dims[0] != 1):
            return "the parameter is not broadcast along the batch axis"
        if len(p_dims) > z.shape.rank:
            return "the parameter has a higher rank than the output"
        if ctx.op.inputs[0] is ctx.op.inputs[1]:
            return "both operands are the same tensor"
        return None

    def _u(self, ctx):
        g = ctx.grad
        if ctx.op.type == "Mul":
            other = ctx.other_input()
            return g * other
        if ctx.op.type == "Sub" and ctx.input_index == 1:
            return -g
        return g

    def per_example(self, ctx):
        p_dims = _outer.static_dims(ctx.param)
        if len(p_dims) == ctx.op.outputs[0].shape.rank:
            p_dims = p_dims[1:]      # [1, ...]: the leading 1 is the batch
            return tf.expand_dims(_sum_to_param(self._u(ctx), p_dims), 1)
        return _sum_to_param(self._u(ctx), p_dims)


@registry.register_rule("BiasAdd", "BiasAddV1")
class BiasAddRule(registry.Rule):
    """`z = BiasAdd(x, bias)`: example b's bias gradient sums dz[b] over all
    but the channel axis. Returns `[B, C]`."""

    reads_other_inputs = False      # dz and the data format only
    passes_gradient_to = (0,)       # d value = dz

    def unsupported(self, ctx):
        if ctx.input_index != 1:
            return "the parameter is the value, not the bias"
        return None

    def per_example(self, ctx):
        g = ctx.grad
        rank = g.shape.rank
        fmt = (ctx.op.get_attr("data_format").decode()
               if ctx.op.type == "BiasAdd" else "NHWC")
        channel = 1 if fmt.startswith("NC") else rank - 1
        return _reduce.per_example_channel_sums(g, channel)
