"""custagg inside a `tf.function`, on variables created eagerly (TF 2 style).

In a `tf.function` the default graph is a FuncGraph: an eagerly created
variable's handle and eager constants are captured into it when converted,
and `tf.compat.v1.gradients` works there. These tests check that
`custagg.gradients`, the per-example API and the optimizers do the same and
give the same numbers as the obviously-correct reference (one
`tf.compat.v1.gradients` per example, `custagg.testing.loop_per_example`) in
the same function.

Eager mode is needed, and the test process runs with eager execution off
(tests/conftest.py), so each test runs its checks in one subprocess
(`run_python`) and reads back a JSON line.
"""

import json

import pytest

_PRELUDE = """
import json, os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import numpy as np
import tensorflow as tf
import custagg
from custagg import testing
assert tf.executing_eagerly()
out = {}

def dense(t):
    if isinstance(t, tf.IndexedSlices):
        t = tf.convert_to_tensor(t)
    return t.numpy()

def err(fn):
    try:
        fn()
        return "no error"
    except Exception as e:          # the type is checked by the test
        return "%s: %s" % (type(e).__name__, str(e)[:400])
"""


def _result(run_python, code, timeout=900):
    proc = run_python(_PRELUDE + code, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


def test_gradients_of_captured_eager_variables_and_tensors(run_python):
    """custagg.gradients equals tf.compat.v1.gradients in a tf.function on
    eager variables and constants: plain, through a while loop and a cond
    reading the variable, through gathers (IndexedSlices), CUSTOM factors;
    also as TF's gradients (and internal helper), and Optimizer.minimize."""
    out = _result(run_python, """
rng = np.random.default_rng(0)
v = tf.Variable(rng.normal(size=[4, 3]))            # float64
c = tf.constant(rng.normal(size=[3]))
idx = tf.constant([0, 2, 2, 3])

def models(grad_fn):
    got = {}
    y = tf.reduce_sum(v * v * c)
    got["plain"] = grad_fn(y, [v, c])
    _, h = tf.while_loop(lambda i, h: i < 3,
                         lambda i, h: (i + 1, tf.tanh(h * v[0])), [0, c])
    got["while"] = grad_fn(tf.reduce_sum(h), [v, c])
    z = tf.cond(tf.reduce_sum(c) > 0, lambda: tf.reduce_sum(v * c),
                lambda: tf.reduce_sum(tf.sin(v)))
    got["cond"] = grad_fn(z, [v, c])
    g = tf.gather(v, idx) * tf.gather(v, [1, 1, 0, 0])
    got["gather"] = grad_fn(tf.reduce_sum(g * c), [v, c])
    # Eager tensors as ys too, with xs the ys do not reach.
    got["eager_ys"] = grad_fn([c, v * c], [c, v])
    got["unused"] = grad_fn(tf.reduce_sum(v) * 2.0, [c])
    return got

@tf.function
def with_tf():
    return models(tf.compat.v1.gradients)

@tf.function
def with_custagg():
    return models(custagg.gradients)

@tf.function
def as_tf_gradients():
    with custagg.use_as_tf_gradients(internal=True):
        return models(tf.gradients)

ref = with_tf()
for name, fn in (("custagg", with_custagg), ("installed", as_tf_gradients)):
    got = fn()
    for key in ref:
        assert len(got[key]) == len(ref[key]), key
        for a, b in zip(got[key], ref[key]):
            assert (a is None) == (b is None), (name, key)
            if a is not None:
                np.testing.assert_allclose(dense(a), dense(b), rtol=1e-12,
                                           err_msg="%s %s" % (name, key))
    out[name] = sorted(got)
    out[name + "_sparse"] = isinstance(got["gather"][0], tf.IndexedSlices)
out["tf_sparse"] = isinstance(ref["gather"][0], tf.IndexedSlices)
out["unused_is_none"] = ref["unused"] == [None]

# CUSTOM: sum_i f[i] * d loss_i / d v, the factors an eager constant.
f = tf.constant(rng.normal(size=[4]))
@tf.function
def custom():
    loss = tf.reduce_sum(v * v, axis=1) * tf.reduce_sum(c)
    got, = custagg.gradients(
        loss, [v], aggregation_method=custagg.AggregationMethod.CUSTOM,
        gradient_factors=f)
    ref = tf.add_n([f[i] * tf.compat.v1.gradients(loss[i], [v])[0]
                    for i in range(4)])
    return got, ref
got, want = custom()
np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12)
out["custom"] = True

# Optimizer.minimize in a tf.function, custagg installed as tf.gradients.
def descend(install):
    w = tf.Variable([1.0, -2.0, 0.5])
    opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    @tf.function
    def step():
        opt.minimize(lambda: tf.reduce_sum(tf.sin(w) * w), var_list=[w])
    for _ in range(3):
        if install:
            with custagg.use_as_tf_gradients():
                step()
        else:
            step()
    return w.numpy()
np.testing.assert_allclose(descend(True), descend(False), rtol=1e-6)
out["minimize"] = descend(True).tolist()

# custagg builds its graph itself: autograph leaves its functions as they
# are (it would rewrite their Python loops and conditions otherwise).
from tensorflow.python.autograph.impl import conversion
out["not_converted"] = [conversion.is_allowlisted(fn) for fn in (
    custagg.gradients, custagg.per_example_norms, custagg.clipped_gradients)]

# Outside any graph: still the clear eager-mode error.
out["eager_call"] = err(lambda: custagg.gradients(v * v, [v]))
print("RESULT" + json.dumps(out))
""")
    assert out["custagg"] == ["cond", "eager_ys", "gather", "plain", "unused",
                              "while"]
    assert out["unused_is_none"]
    assert out["installed"] == out["custagg"]
    assert out["custagg_sparse"] and out["tf_sparse"]
    assert out["installed_sparse"]
    assert out["custom"]
    assert out["minimize"] != [1.0, -2.0, 0.5]
    assert out["not_converted"] == [True, True, True]
    assert out["eager_call"].startswith(
        "RuntimeError: custagg.gradients builds graph-mode gradients"), out


_PER_EXAMPLE_MODEL = """
rng = np.random.default_rng(1)
w = tf.Variable(rng.normal(size=[3, 4]), name="w")     # float64
b = tf.Variable(rng.normal(size=[4]), name="b")
u = tf.Variable(rng.normal(size=[4]), name="u")
xs_ = [w, b, u]

def per_example_loss(x):
    h = tf.tanh(tf.matmul(x, w) + b)
    return tf.reduce_sum(h * u, axis=1) ** 2
"""


@pytest.mark.parametrize("strategy", ["auto", "rules", "pfor", "loop"])
def test_per_example_api_matches_the_loop_in_the_same_function(
        run_python, strategy):
    """per_example_norms / clipped_gradients / per_example_gradients in a
    tf.function on eager float64 variables equal the loop of
    tf.compat.v1.gradients traced in the same function, for B in
    {1, 5, 32, 33}, with the batch dynamic (input_signature [None, 3]) and
    static."""
    out = _result(run_python, _PER_EXAMPLE_MODEL + """
strategy = %r
clip = 0.7

def ours(x):
    loss = per_example_loss(x)
    return (custagg.per_example_norms(loss, xs_, strategy=strategy),
            custagg.clipped_gradients(loss, xs_, clip, strategy=strategy),
            custagg.per_example_gradients(loss, xs_, strategy=strategy))

dynamic = tf.function(ours, input_signature=[
    tf.TensorSpec([None, 3], tf.float64)])

@tf.function
def static_with_reference(x):
    # The reference (one tf.compat.v1.gradients per example) in the same
    # function as custagg's results.
    loop = testing.loop_per_example(per_example_loss(x), xs_)
    return ours(x), loop

checked = []
for batch in (1, 5, 32, 33):
    x = tf.constant(rng.normal(size=[batch, 3]))
    (norms, clipped, per_ex), loop = static_with_reference(x)
    loop = [g.numpy() for g in loop]
    want_clipped, want_norms = testing.numpy_clipped(loop, clip)
    for kind, (n, cl, pe) in (("static", (norms, clipped, per_ex)),
                              ("dynamic", dynamic(x))):
        label = "B=%%d %%s" %% (batch, kind)
        testing.assert_close(n.numpy(), want_norms, 1e-10, label + " norms")
        for j in range(3):
            testing.assert_close(dense(cl[j]), want_clipped[j], 1e-10,
                                 label + " clipped %%d" %% j)
            testing.assert_close(dense(pe[j]), loop[j], 1e-10,
                                 label + " per-example %%d" %% j)
        checked.append(label)
out["checked"] = checked
print("RESULT" + json.dumps(out))
""" % strategy)
    assert len(out["checked"]) == 8, out


def test_plans_and_optimizers_in_a_function(run_python):
    """The same plan as in a TF1 graph; the optimizers' compute_gradients on
    eager variables and on a tf-keras model's variables, checked against the
    loop reference in the same function."""
    out = _result(run_python, _PER_EXAMPLE_MODEL + """
from custagg import optimizers

@tf.function
def plan_in_function(x):
    out["function_plan"] = str(custagg.plan_per_example(
        per_example_loss(x), xs_))
    return x
plan_in_function(tf.constant(rng.normal(size=[5, 3])))

values = [v.numpy() for v in xs_]
with tf.Graph().as_default():
    w_g, b_g, u_g = [tf.compat.v1.Variable(val, name=v.name.split(":")[0])
                     for val, v in zip(values, xs_)]
    x_g = tf.compat.v1.placeholder(tf.float64, [5, 3])
    h = tf.tanh(tf.matmul(x_g, w_g) + b_g)
    out["graph_plan"] = str(custagg.plan_per_example(
        tf.reduce_sum(h * u_g, axis=1) ** 2, [w_g, b_g, u_g]))

# DPOptimizer without noise is ClippedOptimizer: (1/B) sum_i clip(g_i).
def check_optimizer(loss_fn, variables, batch, label):
    opt = optimizers.ClippedOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1), l2_norm_clip=0.5)
    x = tf.constant(rng.normal(size=[batch, 3]), variables[0].dtype)
    @tf.function
    def step(x):
        loss = loss_fn(x)
        loop = testing.loop_per_example(loss, variables)
        gv = opt.compute_gradients(loss, var_list=variables)
        return [g for g, _ in gv], opt.per_example_norms, loop
    grads, norms, loop = step(x)
    loop = [g.numpy().astype(np.float64) for g in loop]
    want, want_norms = testing.numpy_clipped(loop, 0.5)
    rtol = 1e-10 if variables[0].dtype == tf.float64 else 1e-4
    testing.assert_close(norms.numpy(), want_norms, rtol, label + " norms")
    for j, g in enumerate(grads):
        testing.assert_close(dense(g), want[j] / batch, rtol,
                             label + " grad %d" % j)
    out.setdefault("optimizers", []).append(label)

for batch in (1, 33):
    check_optimizer(per_example_loss, xs_, batch, "eager B=%d" % batch)

try:
    import tf_keras
except ImportError:     # TF <= 2.15 without tf-keras: tf.keras is Keras 2
    tf_keras = tf.keras
model = tf_keras.Sequential([
    tf_keras.layers.Dense(5, activation="tanh"), tf_keras.layers.Dense(2)])
model.build((None, 3))
labels = tf.constant([0, 1, 1, 0, 1, 0, 0])
def keras_loss(x):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=model(x))
check_optimizer(keras_loss, model.trainable_variables, 7, "tf_keras B=7")
print("RESULT" + json.dumps(out))
""")
    assert out["function_plan"] == out["graph_plan"], out
    assert "w" in out["graph_plan"]
    assert out["optimizers"] == ["eager B=1", "eager B=33", "tf_keras B=7"]
