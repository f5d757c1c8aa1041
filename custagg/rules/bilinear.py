"""Rules for ops linear in a parameter and in a batch activation.

`MatMul` (every transpose combination, the parameter on either side),
`BatchMatMulV2`/`BatchMatMulV3`/`BatchMatMul` with a rank-2 parameter
broadcast over a batch-leading activation (sequence models
`[B, T, D] x [D, K]`), and two-operand `Einsum` without ellipsis.

Each op is written as an einsum `a_sub, p_sub -> out_sub` with the batch
letter on the activation. Example b's gradient is
`einsum(a_sub + "," + out_sub + "->" + p_sub)` restricted to row b. When the
letters split cleanly into sequence (T: activation and output), contracted
(D: activation and parameter) and output (K: parameter and output) letters,
the maths is the outer-product family in `_outer.Outer` (norms and weighted
sums without materializing); otherwise a generic einsum materializes.
"""

import tensorflow as tf

from custagg import registry
from custagg.rules import _outer


class BilinearRule(registry.Rule):
    """Base: subclasses give `subscripts(ctx)` = (a_sub, p_sub, out_sub, b)."""

    def subscripts(self, ctx):
        raise NotImplementedError

    def unsupported(self, ctx):
        try:
            a_sub, p_sub, out_sub, b = self.subscripts(ctx)
        except ValueError as e:
            return str(e)
        if b in p_sub or b not in out_sub or b not in a_sub:
            return "the parameter shares the batch axis"
        for sub in (a_sub, p_sub, out_sub):
            if len(set(sub)) != len(sub):
                return "repeated einsum letters (a trace or diagonal)"
        if any(c not in a_sub + out_sub for c in p_sub):
            return "a parameter axis is summed away inside the op"
        if _outer.static_dims(ctx.param) is None:
            return "the parameter's shape is not static"
        return None

    def output_batch_axis(self, ctx):
        _, _, out_sub, b = self.subscripts(ctx)
        return out_sub.index(b)

    def _activation(self, ctx):
        return ctx.other_input()

    def _outer(self, ctx):
        """An `_outer.Outer`, or None when the letters do not split cleanly."""
        a_sub, p_sub, out_sub, b = self.subscripts(ctx)
        t_letters = [c for c in a_sub if c in out_sub and c != b]
        d_letters = [c for c in a_sub if c in p_sub]
        k_letters = [c for c in p_sub if c in out_sub]
        if (set(t_letters) & set(p_sub) or set(d_letters) & set(out_sub)
                or len(a_sub) != 1 + len(t_letters) + len(d_letters)
                or len(p_sub) != len(d_letters) + len(k_letters)):
            return None
        p_dims = dict(zip(p_sub, _outer.static_dims(ctx.param)))
        d_dims = [p_dims[c] for c in d_letters]
        k_dims = [p_dims[c] for c in k_letters]
        a = self._activation(ctx)
        a = tf.einsum("%s->%s" % (a_sub, b + "".join(t_letters + d_letters)),
                      a) if a_sub != b + "".join(t_letters + d_letters) else a
        g = ctx.grad
        g_order = b + "".join(t_letters + k_letters)
        if out_sub != g_order:
            g = tf.einsum("%s->%s" % (out_sub, g_order), g)
        batch = tf.shape(a)[0]
        a = tf.reshape(a, [batch, -1, _outer.prod(d_dims)])
        g = tf.reshape(g, [batch, -1, _outer.prod(k_dims)])
        order = d_letters + k_letters
        perm = [order.index(c) for c in p_sub]
        return _outer.Outer(a, g, _outer.layout(d_dims, k_dims, perm))

    def per_example(self, ctx):
        outer = self._outer(ctx)
        if outer is not None:
            return outer.per_example()
        a_sub, p_sub, out_sub, b = self.subscripts(ctx)
        return tf.einsum("%s,%s->%s" % (a_sub, out_sub, b + p_sub),
                         self._activation(ctx), ctx.grad)

    def squared_norms(self, ctx):
        outer = self._outer(ctx)
        if outer is not None:
            return outer.squared_norms()
        return super(BilinearRule, self).squared_norms(ctx)

    def weighted_sum(self, ctx, weights):
        outer = self._outer(ctx)
        if outer is not None:
            return outer.weighted_sum(weights)
        a_sub, p_sub, out_sub, b = self.subscripts(ctx)
        # The weights index the batch axis wherever it sits in the output.
        shape = [1] * len(out_sub)
        shape[out_sub.index(b)] = -1
        g = ctx.grad * tf.reshape(tf.cast(weights, ctx.grad.dtype), shape)
        return tf.einsum("%s,%s->%s" % (a_sub, out_sub, p_sub),
                         self._activation(ctx), g)

    def squared_sum(self, ctx):
        outer = self._outer(ctx)
        if outer is not None:
            return outer.squared_sum()
        return super(BilinearRule, self).squared_sum(ctx)


@registry.register_rule("MatMul")
class MatMulRule(BilinearRule):
    """`MatMul`: `[B, D] x [D, K]` (parameter right) or `[M, K] x [K, B]` (left).

    Per-example gradient of the parameter `[B, *p.shape]`, e.g. `a_b (x) dz_b`.
    """

    def subscripts(self, ctx):
        ta, tb = ctx.op.get_attr("transpose_a"), ctx.op.get_attr("transpose_b")
        x_sub = "km" if ta else "mk"
        y_sub = "nk" if tb else "kn"
        if ctx.input_index == 1:    # z[b, n] = a[b, k] w[k, n]: batch is m
            return x_sub.replace("m", "b"), y_sub, "bn", "b"
        return y_sub.replace("n", "b"), x_sub, "mb", "b"


def _leading(rank):
    if rank is None or rank < 3:
        raise ValueError("the activation needs a known rank of 2 or more")
    return "b" + "tuvwxyz"[:rank - 3]


@registry.register_rule("BatchMatMulV2", "BatchMatMulV3", "BatchMatMul")
class BatchMatMulRule(BilinearRule):
    """Batch matmul of a batch-leading activation with a rank-2 parameter.

    The activation is `[B, ..., T, D]` (broadcast against the parameter), or
    a `[B, D]` matrix, which makes the op a MatMul.
    """

    def subscripts(self, ctx):
        op = ctx.op
        adj_x, adj_y = op.get_attr("adj_x"), op.get_attr("adj_y")
        if ctx.param.shape.rank != 2:
            raise ValueError("the parameter must have rank 2 (got %s)"
                             % ctx.param.shape)
        x_sub = "kq" if adj_x else "qk"
        y_sub = "nk" if adj_y else "kn"
        out_sub = "qn"
        if ctx.other_input().shape.rank == 2:
            # Two matrices, as in MatMul: the batch is the activation's free
            # axis (q when the activation is on the left, n on the right).
            free = "q" if ctx.input_index == 1 else "n"
            x_sub, y_sub, out_sub = (s.replace(free, "b")
                                     for s in (x_sub, y_sub, out_sub))
            lead = ""
        else:
            lead = _leading(ctx.other_input().shape.rank)
        if ctx.input_index == 1:
            return lead + x_sub, y_sub, lead + out_sub, "b"
        return lead + y_sub, x_sub, lead + out_sub, "b"

    def unsupported(self, ctx):
        if ctx.op.type == "BatchMatMulV3" and (
                ctx.op.get_attr("Ta") != ctx.op.get_attr("Tb")):
            return "mixed input dtypes"
        return super(BatchMatMulRule, self).unsupported(ctx)


@registry.register_rule("Einsum")
class EinsumRule(BilinearRule):
    """Two-operand `Einsum`; the batch is the activation's first letter."""

    def subscripts(self, ctx):
        eq = ctx.op.get_attr("equation").decode().replace(" ", "")
        if "..." in eq:
            raise ValueError("einsum with an ellipsis ('...')")
        if "->" not in eq:
            raise ValueError("einsum without an explicit output")
        ins, out_sub = eq.split("->")
        ins = ins.split(",")
        if len(ins) != 2:
            raise ValueError("einsum with %d operands" % len(ins))
        p_sub = ins[ctx.input_index]
        a_sub = ins[1 - ctx.input_index]
        if not a_sub:
            raise ValueError("a scalar activation")
        return a_sub, p_sub, out_sub, a_sub[0]
