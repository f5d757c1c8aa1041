"""Shared maths for ops whose parameter gradient is a sum of outer products.

For `z[b, t, k] = sum_d a[b, t, d] * w[d, k]` (MatMul, Einsum, BatchMatMul,
convolutions after patch extraction) example `b`'s gradient is
`G_b = sum_t a[b, t] (x) dz[b, t]`, shape `[D, K]`. Everything a rule needs
follows from `a` `[B, T, D]` and `g = dz` `[B, T, K]` without materializing
`[B, D, K]` where an identity allows it:

* `||G_b||^2 = ||a_b||^2 ||g_b||^2` when T = 1, else
  `sum_{t,s} (a_bt . a_bs)(g_bt . g_bs)` (the Gram form, cheaper when
  `T (D + K) < D K`), else materialize.
* `sum_b c_b G_b = (c a)^T g`.
* `sum_b G_b ** 2`: `(a^2)^T (g^2)` when T = 1, else materialize.
* Microbatches (M groups of B/M consecutive examples): the group gradient
  `sum_{b in m} G_b = sum_{b in m, t} a_bt (x) g_bt` is an Outer with
  `T' = (B/M) T` (`grouped`), so its norm is the block-diagonal Gram form
  `sum_{(b,t),(c,s) in m} (a_bt . a_cs)(g_bt . g_cs)` or the materialized
  `[M, D, K]`, whichever costs less (chosen at run time when B is dynamic).
* Users (groups by fed ids, `segments.Segments`, any sizes): the group
  gradient `G_u = sum_{b in u, t} a_bt (x) g_bt` (`SegmentedOuter`); its
  norm is the masked Gram form `sum_{r,s} [u_r = u_s] (a_r . a_s)(g_r . g_s)`
  over the `R = B T` rows, or the `[B, D, K]` per-example gradients summed
  per user, whichever holds fewer numbers (`R^2` against `B D K`).
"""

import numpy as np
import tensorflow as tf

from custagg.rules import _reduce
from custagg.rules import segments as segments_lib


def _static(dim):
    return tf.compat.dimension_value(dim)


class Outer(object):
    """Per-example gradients `sum_t a[b,t] (x) g[b,t]` and their reductions.

    Args:
      a: `[B, D]` or `[B, T, D]` activations (T may be several axes already
        flattened by the caller).
      g: `[B, K]` or `[B, T, K]` output gradients.
      to_param: maps a `[..., D, K]` tensor (leading `B` or not) to the
        parameter's layout `[..., *p.shape]`.
    """

    def __init__(self, a, g, to_param):
        if a.shape.rank == 2:
            a, g = a[:, None, :], g[:, None, :]
        self.a, self.g = a, g
        self.to_param = to_param
        self.seq_len = _static(a.shape[1])
        self._choose_at_run_time = False

    def grouped(self, num_groups):
        """The Outer of the M group gradients `sum_{b in m} G_b` (M =
        `num_groups` groups of B/M consecutive examples; M, an int or a
        scalar tensor, must divide B).
        With `num_groups` a `segments.Segments` (groups by fed ids), a
        `SegmentedOuter`."""
        if isinstance(num_groups, segments_lib.Segments):
            return SegmentedOuter(self, num_groups)
        if isinstance(num_groups, int) and \
                num_groups == _static(self.a.shape[0]):
            return self
        d, k = _static(self.a.shape[2]), _static(self.g.shape[2])
        a = tf.reshape(self.a, [num_groups, -1, d if d is not None else
                                tf.shape(self.a)[2]])
        g = tf.reshape(self.g, [num_groups, -1, k if k is not None else
                                tf.shape(self.g)[2]])
        out = Outer(a, g, self.to_param)
        out._choose_at_run_time = True   # (B/M) T may be known only then
        return out

    def per_example(self):
        # One batched matmul `a_b^T g_b` for any T (for T = 1 an outer
        # product): on a CPU it writes the [B, D, K] result about 25% faster
        # than a broadcast multiply.
        return self.to_param(tf.matmul(self.a, self.g, transpose_a=True))

    def _gram_is_cheaper(self):
        t, d, k = self.seq_len, _static(self.a.shape[2]), _static(
            self.g.shape[2])
        if None in (t, d, k):
            return False
        return t * (d + k) < d * k

    def squared_norms(self):
        if self.seq_len == 1:
            return (_reduce.per_example_squared_norms(self.a[:, 0]) *
                    _reduce.per_example_squared_norms(self.g[:, 0]))
        if self.seq_len is None and self._choose_at_run_time:
            d, k = _static(self.a.shape[2]), _static(self.g.shape[2])
            if d is not None and k is not None:
                return tf.cond(tf.shape(self.a)[1] * (d + k) < d * k,
                               self._gram_norms, self._full_norms)
        if self._gram_is_cheaper():
            return self._gram_norms()
        return self._full_norms()

    def _gram_norms(self):
        gram_g, gram_a = after_gradient(
            lambda: tf.matmul(self.g, self.g, transpose_b=True),
            lambda: tf.matmul(self.a, self.a, transpose_b=True))
        return tf.reduce_sum(gram_a * gram_g, axis=[1, 2])

    def _full_norms(self):
        full = tf.einsum("btd,btk->bdk", self.a, self.g)
        return _reduce.per_example_squared_norms(full)

    def weighted_sum(self, weights):
        c = tf.cast(weights, self.a.dtype)[:, None, None]
        d = tf.shape(self.a)[2]
        k = tf.shape(self.g)[2]
        a, g = self.a, self.g
        # Scale whichever side is narrower: a Dense layer's 21632 inputs
        # against its 3 outputs is a [B, 3] multiply instead of [B, 21632].
        d_static, k_static = _static(a.shape[2]), _static(g.shape[2])
        narrow = None not in (d_static, k_static) and k_static < d_static
        if narrow:
            g = g * c
        else:
            a = a * c
        a, g = tf.reshape(a, [-1, d]), tf.reshape(g, [-1, k])
        if (narrow and k_static <= self._NARROW_K
                and a.dtype.base_dtype == tf.float32):
            # A few outputs: (G^T A)^T, the [K, D] product written along
            # its long rows, then a small transpose.
            return self.to_param(tf.transpose(tf.matmul(g, a,
                                                        transpose_a=True)))
        return self.to_param(tf.matmul(a, g, transpose_a=True))

    # Up to this many outputs K, float32 `A^T G` is formed as `(G^T A)^T`:
    # 1 thread, oneDNN, rows x D x K = 256 x 21632 x 3: 2.8 ms against
    # 4.3 ms; 256 x 784 x 10: 0.38 against 0.58; 256 x 3136 x 1024: 19.0
    # against 15.7 (hence the bound). In float64 it was slower at 21632 x 3.
    _NARROW_K = 16

    @property
    def key(self):
        """Outers with equal keys lay `[D, K]` out the same way in p."""
        return self.to_param.key

    def inner(self, other):
        """`[B]` inner products `<G_b, G'_b>` with an Outer of the same key:
        `sum_{t,s} (a_bt . a'_bs)(g_bt . g'_bs)` (a shared weight's cross
        term, without materializing either)."""
        if self.seq_len == 1 and other.seq_len == 1:
            return (tf.reduce_sum(self.a[:, 0] * other.a[:, 0], axis=1) *
                    tf.reduce_sum(self.g[:, 0] * other.g[:, 0], axis=1))
        gram_g, gram_a = after_gradient(
            lambda: tf.matmul(self.g, other.g, transpose_b=True),
            lambda: tf.matmul(self.a, other.a, transpose_b=True))
        return tf.reduce_sum(gram_a * gram_g, axis=[1, 2])

    def inner_dense(self, m, batched):
        """`[B]` inner products `<G_b, M_b>` (`batched`: m is `[B, *p]`) or
        `<G_b, M>` (m is `[*p]`): `sum_t a_bt^T M g_bt`."""
        m = self.to_param.from_param(tf.cast(m, self.a.dtype), batched)
        # Two plain matmuls, (a M) then the row dots with g: TF's einsum of
        # the three operands was 4x slower on a CPU (B=256, D=784, K=256).
        if batched:
            am = tf.matmul(self.a, m)                             # [B, T, K]
        else:
            d, k = tf.shape(self.a)[2], tf.shape(m)[1]
            am = tf.reshape(tf.matmul(tf.reshape(self.a, [-1, d]), m),
                            tf.concat([tf.shape(self.a)[:2], [k]], 0))
        return tf.reduce_sum(am * self.g, axis=[1, 2])

    def squared_sum(self):
        if self.seq_len == 1:
            return self.to_param(tf.matmul(tf.square(self.a[:, 0]),
                                           tf.square(self.g[:, 0]),
                                           transpose_a=True))
        full = tf.einsum("btd,btk->bdk", self.a, self.g)
        return self.to_param(tf.reduce_sum(tf.square(full), axis=0))


class SegmentedOuter(object):
    """The group gradients `G_u = sum_{b in u} G_b` of an `Outer`, the groups
    given by fed ids (`segments.Segments`: any sizes, U known at run time).

    Offers what `norm_algebra` asks of a grouped Outer (`squared_norms`,
    `inner`, `inner_dense`, `key`), each `[U]`.
    """

    def __init__(self, outer, segments):
        self.base = outer
        self.segments = segments
        self.a, self.g = outer.a, outer.g
        self.to_param = outer.to_param

    @property
    def key(self):
        return self.base.key

    def _rows(self):
        """(`[R, D]` activations, `[R, K]` output gradients, `[R]` segment
        of each row), `R = B T` (row b*T + t is position t of example b)."""
        a, g = self.a, self.g
        t = tf.shape(a)[1]
        seg = tf.reshape(tf.tile(self.segments.ids[:, None], tf.stack([1, t])),
                         [-1])
        return (tf.reshape(a, [-1, tf.shape(a)[2]]),
                tf.reshape(g, [-1, tf.shape(g)[2]]), seg)

    def _masked_gram(self, other):
        """`[U]`: `sum_{r in u, s in u} (a_r . a'_s)(g_r . g'_s)`."""
        a, g, seg = self._rows()
        a2, g2, seg2 = other._rows()  # pylint: disable=protected-access
        gram_g, (gram_a, same) = after_gradient(
            lambda: tf.matmul(g, tf.cast(g2, g.dtype), transpose_b=True),
            lambda: (tf.matmul(a, a2, transpose_b=True),
                     self.segments.same(seg, seg2, a.dtype)))
        gram = gram_a * gram_g * same                             # [R, R']
        return tf.math.unsorted_segment_sum(tf.reduce_sum(gram, axis=1), seg,
                                            self.segments.count)

    def _full_norms(self):
        """`[U]` from the `[B, D, K]` per-example gradients summed per user
        (cheaper than the `[R, R]` Gram for long rows of small layers)."""
        full = self.segments.sum(tf.matmul(self.a, self.g, transpose_a=True))
        return _reduce.per_example_squared_norms(full)

    def squared_norms(self):
        # Numbers held: the Gram's R^2 = B^2 T^2 against B D K, i.e. the
        # Gram when B T^2 < D K; decided in the graph when all four are
        # static, else at run time (only the chosen branch runs).
        b, t = _static(self.a.shape[0]), _static(self.a.shape[1])
        d, k = _static(self.a.shape[2]), _static(self.g.shape[2])
        if None not in (b, t, d, k):
            return (self._masked_gram(self) if b * t * t < d * k
                    else self._full_norms())
        shape_a, shape_g = tf.shape(self.a), tf.shape(self.g)
        gram_wins = (tf.cast(shape_a[0] * shape_a[1], tf.int64) *
                     tf.cast(shape_a[1], tf.int64) <
                     tf.cast(shape_a[2], tf.int64) *
                     tf.cast(shape_g[2], tf.int64))
        return tf.cond(gram_wins, lambda: self._masked_gram(self),
                       self._full_norms)

    def inner(self, other):
        """`[U]` `<G_u, G'_u>` with a `SegmentedOuter` of the same key and
        segments (a shared weight's cross term)."""
        return self._masked_gram(other)

    def inner_dense(self, m, batched):
        """`[U]` `<G_u, M_u>` (`batched`: m is `[U, *p]`) or `<G_u, M>`: the
        per-example products summed per user (a batched m is spread to the
        examples first: `[B, *p]`, the size of the dense term it came
        from)."""
        if batched:
            m = self.segments.spread(m)
        return tf.math.unsorted_segment_sum(
            self.base.inner_dense(m, batched), self.segments.ids,
            self.segments.count)


def after_gradient(gradient_part, forward_part):
    """`(gradient_part(), forward_part())`, the second built to run after
    the first.

    A term of forward values alone (an activations' Gram, an id mask)
    would otherwise run in the forward pass, as soon as its inputs exist,
    and be held until the backward pass reaches the layer: `[B, T, T]` per
    layer on top of the aggregated gradient's peak (a transformer block at
    B = 512, T = 16: 0.5 MB each).
    """
    first = gradient_part()
    with tf.control_dependencies(tf.nest.flatten(first)):
        return first, forward_part()


def layout(d_dims, k_dims, perm):
    """A `to_param` for parameters of shape `transpose(d_dims + k_dims, perm)`.

    Args:
      d_dims, k_dims: static lists of the contracted and output dims.
      perm: permutation taking `d_dims + k_dims` order to the parameter's
        axis order (None for identity).
    """
    n = len(d_dims) + len(k_dims)
    identity = perm is None or list(perm) == list(range(n))

    def to_param(t):
        batched = t.shape.rank == 3
        lead = [tf.shape(t)[0]] if batched else []
        out = tf.reshape(t, lead + list(d_dims) + list(k_dims))
        if not identity:
            shift = 1 if batched else 0
            full_perm = list(range(shift)) + [p + shift for p in perm]
            out = tf.transpose(out, full_perm)
        return out

    def from_param(t, batched):
        """The inverse: `[B?, *p.shape]` -> `[B?, D, K]`."""
        shift = 1 if batched else 0
        lead = [tf.shape(t)[0]] if batched else []
        if not identity:
            inverse = [0] * n
            for i, p in enumerate(perm):
                inverse[p] = i
            dims = list(d_dims) + list(k_dims)
            t = tf.reshape(t, lead + [dims[p] for p in perm])
            t = tf.transpose(t, list(range(shift)) +
                             [i + shift for i in inverse])
        return tf.reshape(t, lead + [prod(d_dims), prod(k_dims)])

    to_param.from_param = from_param
    to_param.key = (tuple(d_dims), tuple(k_dims),
                    None if identity else tuple(perm))
    return to_param


def static_dims(t):
    dims = [_static(d) for d in t.shape] if t.shape.rank is not None else None
    if dims is None or any(d is None for d in dims):
        return None
    return dims


def prod(dims):
    return int(np.prod(dims)) if dims else 1
