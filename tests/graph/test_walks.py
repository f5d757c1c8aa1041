"""The graph walks (`custagg.graph`) every analysis shares."""

import tensorflow as tf

from custagg import graph


def test_upstream_downstream_and_stops():
    x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
    w = tf.constant([[1.0], [2.0]], name="w")
    z = tf.matmul(x, w, name="z")
    positive = tf.reduce_all(z > 0.0, name="positive")
    checked = tf.raw_ops.Assert(condition=positive, data=[z], name="check")
    with tf.control_dependencies([checked]):
        out = tf.identity(z, name="out")
    assert {op.name for op in graph.ancestors(z)} == {"x", "w", "z"}
    assert z.op in graph.downstream([x]) and x.op not in graph.downstream([x])
    with_control = graph.upstream([out], control=True)
    assert checked in with_control and checked not in graph.ancestors(out)
    assert positive.op in with_control
    # Not into what an assert checks: its inputs are left out.
    stopped = graph.upstream([out], control=True, stop_types={"Assert"})
    assert checked in stopped and positive.op not in stopped
    assert z.op in stopped          # through out's data input
    assert graph.upstream([out], stop_tensors={z.ref()}) == {out.op}
    assert graph.in_creation_order({z.op, x.op}, x.graph) == [x.op, z.op]


def test_gradient_paths_do_not_depend_on_an_earlier_call():
    x = tf.compat.v1.placeholder(tf.float32, [None, 2])
    w = tf.Variable([[1.0], [2.0]])
    a = tf.reduce_sum(tf.matmul(x, w), axis=1)
    b = tf.reduce_sum(tf.stop_gradient(tf.matmul(x, w)), axis=1)
    first = graph.gradient_paths(a)
    assert graph.gradient_paths(b) != first
    assert graph.gradient_paths(a) == first
    # The graph grows: the answer for `a` is computed again, and equal.
    c = a * 2.0
    assert graph.gradient_paths(a) == first
    assert c.ref() in graph.gradient_paths(c)
    # Another graph's loss of the same name gets its own answer.
    with tf.Graph().as_default():
        x2 = tf.compat.v1.placeholder(tf.float32, [None, 2])
        a2 = tf.reduce_sum(x2 * 3.0, axis=1)
        assert x2.ref() in graph.gradient_paths(a2)
