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

from custagg import _tf_compat
from custagg.batch_axis import symbolic_shapes
from custagg.rules import registry
from custagg._tf_compat import tensor_util
from custagg.rules import outer as _outer


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

    def _grad(self, ctx):
        return ctx.grad

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
        g = self._grad(ctx)
        g_order = b + "".join(t_letters + k_letters)
        if out_sub != g_order:
            g = tf.einsum("%s->%s" % (out_sub, g_order), g)
        batch = tf.shape(a)[0]
        # The sequence length T (the product of the t letters) is kept
        # static where it is known: T = 1 (a Dense layer on [None, D]) must
        # stay visible so norms use ||a|| ||g|| instead of materializing.
        t_dims = [tf.compat.dimension_value(d) for d in
                  a.shape[1:1 + len(t_letters)]] if a.shape.rank else [None]
        seq = -1 if None in t_dims else _outer.prod(t_dims)
        a = tf.reshape(a, [batch, seq, _outer.prod(d_dims)])
        g = tf.reshape(g, [batch, seq, _outer.prod(k_dims)])
        order = d_letters + k_letters
        perm = [order.index(c) for c in p_sub]
        return _outer.Outer(a, g, _outer.layout(d_dims, k_dims, perm))

    def outer(self, ctx):
        return self._outer(ctx)

    def per_example(self, ctx):
        outer = self._outer(ctx)
        if outer is not None:
            return outer.per_example()
        a_sub, p_sub, out_sub, b = self.subscripts(ctx)
        return tf.einsum("%s,%s->%s" % (a_sub, out_sub, b + p_sub),
                         self._activation(ctx), self._grad(ctx))

    def squared_norms(self, ctx):
        outer = self._outer(ctx)
        if outer is not None:
            return outer.squared_norms()
        return super(BilinearRule, self).squared_norms(ctx)

    def group_squared_norms(self, ctx, num_groups):
        outer = self._outer(ctx)
        if outer is not None:
            return outer.grouped(num_groups).squared_norms()
        return super(BilinearRule, self).group_squared_norms(ctx, num_groups)

    def segment_squared_norms(self, ctx, segments):
        outer = self._outer(ctx)
        if outer is not None:
            return outer.grouped(segments).squared_norms()
        return super(BilinearRule, self).segment_squared_norms(ctx, segments)

    def weighted_sum(self, ctx, weights):
        outer = self._outer(ctx)
        if outer is not None:
            return outer.weighted_sum(weights)
        a_sub, p_sub, out_sub, b = self.subscripts(ctx)
        # The weights index the batch axis wherever it sits in the output.
        shape = [1] * len(out_sub)
        shape[out_sub.index(b)] = -1
        g = self._grad(ctx)
        g = g * tf.reshape(tf.cast(weights, g.dtype), shape)
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
        folded = _folded_rows(ctx)
        if folded is not None:      # z[(b, t...), n] = x[b, t..., k] w[k, n]
            lead = "b" + "tuvwxyz"[:folded[0].shape.rank - 2]
            return lead + "k", y_sub, lead + "n", "b"
        if ctx.input_index == 1:    # z[b, n] = a[b, k] w[k, n]: batch is m
            return x_sub.replace("m", "b"), y_sub, "bn", "b"
        return y_sub.replace("n", "b"), x_sub, "mb", "b"

    def _activation(self, ctx):
        folded = _folded_rows(ctx)
        return folded[0] if folded is not None else ctx.other_input()

    def _grad(self, ctx):
        folded = _folded_rows(ctx)
        if folded is None:
            return ctx.grad
        x, _ = folded
        return tf.reshape(ctx.grad, tf.concat(
            [tf.shape(x)[:-1], tf.shape(ctx.grad)[-1:]], axis=0))

    def coupling_start(self, ctx):
        folded = _folded_rows(ctx)
        if folded is not None:
            return folded[1].outputs[0], 0
        return super(MatMulRule, self).coupling_start(ctx)


def _skip_identity_transpose(t):
    """`t`'s input when `t` is a transpose by the identity permutation."""
    if t.op.type == "Transpose":
        perm = tensor_util.constant_value(t.op.inputs[1])
        if perm is not None and list(perm) == list(range(len(perm))):
            return t.op.inputs[0]
    return t


def _folded_rows(ctx):
    """`(x, unfold_op)` when this MatMul is a dense layer on `[B, T..., D]`.

    `tf.tensordot` (and so Keras/`tf.compat.v1.layers` Dense on inputs of
    rank 3 or more) reshapes `x` `[B, T..., D]` to rows `[B*T, D]`, multiplies
    and reshapes back to `[B, T..., K]`. Row `(b, t)` belongs to example b,
    so the rule can read `x` and the unfolded output gradient directly and
    sum over T per example. Recognized only when the shapes prove it: the
    fold keeps D as the last axis (row-major order then makes row n =
    (b, t)), and the product's only consumer (`_tf_compat.forward_consumers`)
    unfolds it to `[?, T..., K]` with the same T: equal static dims, or,
    for a dynamic T (`[None, None, D]` placeholders), the same symbolic
    dims (`batch_axis.symbolic_shapes`: tensordot unfolds to
    `gather(tf.shape(x), free) + [K]`, which is x's own `B, T...`).
    """
    op = ctx.op
    if (ctx.input_index != 1 or op.get_attr("transpose_a")
            or op.inputs[0].op.type != "Reshape"):
        return None
    x = _skip_identity_transpose(op.inputs[0].op.inputs[0])
    p_dims = _outer.static_dims(ctx.param)
    if x.shape.rank is None or x.shape.rank < 3 or p_dims is None:
        return None
    depth = p_dims[1] if op.get_attr("transpose_b") else p_dims[0]
    middle = x.shape[1:-1]
    if tf.compat.dimension_value(x.shape[-1]) != depth:
        return None
    # Ops that read only the product's shape, and those a backward pass
    # added (TF <= 2.15's Reshape gradient reads its shape), do not count:
    # the answer must not change once any gradient exists in the graph.
    consumers = _tf_compat.forward_consumers(op.outputs[0])
    if len(consumers) != 1 or consumers[0].type != "Reshape":
        return None
    unfold = consumers[0]
    out = unfold.outputs[0]
    width = p_dims[0] if op.get_attr("transpose_b") else p_dims[1]
    if (unfold.inputs[0] is not op.outputs[0] or out.shape.rank != x.shape.rank
            or tf.compat.dimension_value(out.shape[-1]) != width):
        return None
    if not (middle.is_fully_defined() and
            out.shape[1:-1].as_list() == middle.as_list()):
        shapes = symbolic_shapes.ShapeCache()
        x_dims, out_dims = shapes.shape(x), shapes.shape(out)
        if x_dims is None or out_dims is None or None in x_dims[1:-1] or \
                x_dims[1:-1] != out_dims[1:-1]:
            return None
    return x, unfold


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
