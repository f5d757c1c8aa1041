"""`custagg.use_as_tf_gradients()`: custagg as the process-wide tf.gradients.

Inside the block TF's public gradient functions and (by default) its internal
helper, which cond_v2 / while_v2 / tf.function backward passes call with
`src_graph=`, are custagg's; on exit TF's are back, also after an error.
"""

import numpy as np
import pytest
import tensorflow as tf

import custagg
from custagg import _tf_compat
from custagg import install


def _entry_points():
    mod, impl, util = _tf_compat.gradients_modules()
    return {"tf.gradients": (tf, "gradients"),
            "tf.compat.v1.gradients": (tf.compat.v1, "gradients"),
            "gradients.gradients": (mod, "gradients"),
            "gradients_impl.gradients": (impl, "gradients"),
            "gradients_impl.gradients_v2": (impl, "gradients_v2"),
            "gradients_util._GradientsHelper": (util, "_GradientsHelper")}


def _current():
    return {k: getattr(o, a) for k, (o, a) in _entry_points().items()}


def _counting(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("src_graph"))
        return custagg.gradients(*args, **kwargs)

    monkeypatch.setattr(install, "_gradients", spy)
    return calls


def _model():
    x = tf.compat.v1.placeholder(tf.float64, [3])
    w = tf.constant([0.5, -1.0, 2.0], tf.float64)

    @tf.function
    def f(v):
        return tf.reduce_sum(tf.sin(v) * w)

    c = tf.cond(tf.reduce_sum(x) > 0, lambda: tf.square(x), lambda: x * 3.0)
    _, h = tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, h * x),
                         [0, c])
    return x, f(h) + tf.reduce_sum(h)


def test_replaces_and_restores(graph, monkeypatch):
    before = _current()
    calls = _counting(monkeypatch)
    with custagg.use_as_tf_gradients():
        inside = _current()
        x, loss = _model()
        g, = tf.gradients(loss, [x])
    assert _current() == before
    for k in before:
        assert inside[k] is not before[k], k
    assert inside["tf.compat.v1.gradients"] is install.gradients_v1
    assert inside["gradients_util._GradientsHelper"] is \
        install.gradients_helper
    # The public call plus backward passes of cond, while and tf.function,
    # which pass src_graph (a function graph).
    assert calls[0] is None
    assert len([c for c in calls if c is not None]) >= 3, calls
    want, = tf.compat.v1.gradients(loss, [x])
    with tf.compat.v1.Session() as sess:
        for v in ([0.3, 0.2, -0.1], [-1.0, 0.5, 0.2]):
            a, b = sess.run([g, want], {x: v})
            np.testing.assert_allclose(a, b, rtol=1e-12)


def test_public_only(graph, monkeypatch):
    before = _current()
    calls = _counting(monkeypatch)
    with custagg.use_as_tf_gradients(internal=False):
        assert _current()["gradients_util._GradientsHelper"] is \
            before["gradients_util._GradientsHelper"]
        x, loss = _model()
        tf.compat.v1.gradients(loss, [x])
    assert calls == [None]       # nested passes stayed TF's
    assert _current() == before


def test_restored_after_an_error(graph):
    before = _current()
    with pytest.raises(ValueError, match="^Unknown value for "
                       "unconnected_gradients: 'nonsense'"):
        with custagg.use_as_tf_gradients():
            tf.gradients(tf.constant(1.0), [tf.constant(2.0)],
                         unconnected_gradients="nonsense")
    assert _current() == before
