"""The "loop" form: one backward pass per example, `gradients(loss[i])`.

Obviously correct and O(B^2): a Python loop for a static B, else a
`tf.while_loop` over the examples. What "auto" builds when pfor cannot.
"""

from __future__ import annotations

import tensorflow as tf

from custagg import sparse
from custagg.traversal.gradients import gradients
from custagg.per_example.forms import base


class LoopForm(base.Form):
    name = "loop"
    strategy = "loop"
    what = "one backward pass per example"
    cost = "O(B^2)"
    scope = "per_example_loop"
    plan = base.takes_every_x

    def build(self, engine, group):
        tensors = [a.tensor for a in group]
        loss = engine.loss

        def one(i):
            grads = gradients(
                loss[i], tensors,
                unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return [tf.cast(sparse.dense(g), engine.x_dtype(a))
                    for g, a in zip(grads, group)]

        batch = engine.batch_size
        ids = [id(a) for a in group]
        if isinstance(batch, int):
            rows = [one(i) for i in range(batch)]
            return dict(zip(ids, [tf.stack(list(col), axis=0)
                                  for col in zip(*rows)]))
        batch = tf.cast(batch, tf.int32)
        arrays = [tf.TensorArray(engine.x_dtype(a), size=batch,
                                 element_shape=engine.static_x_shape(a))
                  for a in group]

        def body(i, arrays):
            return i + 1, [ta.write(i, g) for ta, g in zip(arrays, one(i))]

        _, arrays = tf.while_loop(lambda i, _: i < batch, body,
                                  [tf.constant(0), arrays])
        return dict(zip(ids, [ta.stack() for ta in arrays]))


LOOP = LoopForm()
