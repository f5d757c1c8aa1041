"""x's per-example gradients through an op that sees no batch data.

A `rules.Chain` (`l2_loss(w)`, `gamma * rsqrt(var)`): the op's outputs have
per-example gradients from the rules (`chain.inner`), and x's are the op's
own gradient (TF's, so overrides hold) applied to them: a vector-Jacobian
product per example, vectorized by pfor, or one product scaled per example
when the output is a scalar.
"""

from __future__ import annotations

import tensorflow as tf

from custagg import sparse
from custagg.traversal.gradients import gradients
from custagg.graph import copier
from custagg.graph import pfor as pfor_lib


def is_scalar(chain):
    """Whether the chain has one scalar output (`l2_loss`)."""
    return len(chain.inner) == 1 and chain.inner[0].tensor.shape.rank == 0


def vjp(engine, chain, cotangents, a, batched):
    """x's gradient through `chain.op` for output cotangents (one list
    entry per `chain.inner`), in x's layout; `batched`: leading B."""
    op = chain.op
    ys = [inner.tensor for inner in chain.inner]
    wrt = [op.inputs[k] for k in chain.indices]
    if batched and copier.pads_explicitly(op):
        # pfor runs a convolution's filter gradient through its while-loop
        # fallback, which drops `explicit_paddings`: differentiate a copy
        # that pads with tf.pad and slides a VALID window (the same
        # function of the same inputs).
        outs = copier.Copier(one_row=False).copy_op(op, {})
        ys = [outs[inner.tensor.value_index] for inner in chain.inner]
    others = [t for k, t in enumerate(op.inputs) if k not in chain.indices]

    def one_vjp(seeds):
        grads = gradients(ys, wrt, grad_ys=seeds, stop_gradients=others,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return [sparse.dense(g) for g in grads]

    if not batched:
        parts = one_vjp(cotangents)
    elif is_scalar(chain):
        # A scalar output (l2_loss): each example's gradient is its own
        # multiple of one vector-Jacobian product.
        c = cotangents[0]
        parts = [tf.reshape(c, [-1] + [1] * g.shape.rank) * g[None]
                 for g in one_vjp([tf.ones([], c.dtype)])]
    else:
        @tf.autograph.experimental.do_not_convert
        def one(i):
            return one_vjp([tf.gather(c, i) for c in cotangents])
        dtypes = [pfor_lib.grad_dtype(t) for t in wrt]
        if pfor_lib.vectorizes_exactly([op], copied=True):
            parts = pfor_lib.chunked_pfor(
                one, engine.shared.batch_size(), engine.chunk, dtypes)
        else:     # a roll along a negative axis: one example at a time
            parts = pfor_lib.loop(one, engine.shared.batch_size(), dtypes)
    return [engine.to_x(p, a, batched) for p in parts]


def per_example(engine, chain, a):
    """`[B, *x]` parts of x's gradient through the chain."""
    cotangents = [engine.rules_per_example(inner) for inner in chain.inner]
    return vjp(engine, chain, cotangents, a, True)


def scaled(engine, chain, a):
    """(c `[B]`, v in x's layout): the scalar chain's g_b = c_b v."""
    c = engine.rules_per_example(chain.inner[0])
    v = vjp(engine, chain, [tf.ones([], c.dtype)], a, False)
    return c, tf.add_n(v) if len(v) > 1 else v[0]
