"""Norms of per-example gradients that are sums of terms, never materialized.

An x used by several rule ops (a shared weight, weight decay next to a
layer) has per-example gradients `g_b = sum_j term_j(b)`; its squared norm is
`sum_{i,j} <term_i(b), term_j(b)>`, each inner product formed from the
terms' own factors where an identity allows. A term is one of

  ("outer", Outer, param dims)   sum_t a_bt (x) g_bt (`rules.outer.Outer`)
  ("scaled", c [B], v)           c_b v (a scalar chain: `l2_loss(w)`)
  ("dense", [B, *x])             materialized
"""

from __future__ import annotations

import tensorflow as tf


def per_example_dot(u, v):
    """`[B]` <u_b, v_b> of two `[B, ...]` tensors."""
    batch = tf.shape(u)[0]
    return tf.reduce_sum(tf.reshape(u * tf.cast(v, u.dtype), [batch, -1]),
                         axis=1)


def inner(s, t):
    """`[B]` <s_b, t_b> for two terms, or None when they cannot be paired
    without materializing (two Outers laid out differently)."""
    if s[0] > t[0]:
        s, t = t, s          # order: dense < outer < scaled
    kinds = (s[0], t[0])
    if kinds == ("outer", "outer"):
        if s[1].key != t[1].key or s[2] != t[2]:
            return None
        return s[1].inner(t[1])
    if kinds == ("outer", "scaled"):
        v = tf.reshape(t[2], s[2])
        return tf.cast(t[1], s[1].a.dtype) * s[1].inner_dense(v, False)
    if kinds == ("dense", "outer"):
        m = tf.reshape(s[1], [-1] + list(t[2]))
        return t[1].inner_dense(m, True)
    if kinds == ("dense", "dense"):
        return per_example_dot(s[1], t[1])
    if kinds == ("dense", "scaled"):
        return tf.cast(t[1], s[1].dtype) * per_example_dot(
            s[1], tf.expand_dims(t[2], 0))
    # scaled, scaled
    return s[1] * tf.cast(t[1], s[1].dtype) * tf.reduce_sum(
        tf.cast(s[2], s[1].dtype) * tf.cast(t[2], s[1].dtype))


def squared_norms_of_terms(terms, dtype):
    """`[B]` (`[M]` for grouped terms) squared norms of the terms' sum from
    pairwise inner products, or None when two terms cannot be paired."""
    total = []
    for i, t in enumerate(terms):
        for j in range(i, len(terms)):
            ip = inner(t, terms[j])
            if ip is None:
                return None
            total.append(tf.cast(ip, dtype) * (1.0 if i == j else 2.0))
    return tf.add_n(total) if total else None
