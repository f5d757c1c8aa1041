"""custagg's DP wrappers (`custagg.privacy.wrappers`: `DPOptimizer`,
`ClippedOptimizer`, the `DP...GaussianWrapper` classes, public as
`custagg.optimizers`) against updates written by hand in numpy (float64),
on the model of tests/optimizer_reference.py: clipping (global, per layer,
microbatches), the noise, TF1 optimizer behaviour, bad arguments.
"""

import numpy as np
import pytest
import tensorflow as tf

from custagg import optimizers as opt_lib

from optimizer_reference import B
from optimizer_reference import B0
from optimizer_reference import CLIP
from optimizer_reference import D
from optimizer_reference import K
from optimizer_reference import LR
from optimizer_reference import STRATEGY
from optimizer_reference import W0
from optimizer_reference import Model
from optimizer_reference import batches
from optimizer_reference import clipped_update
from optimizer_reference import gd
from optimizer_reference import np_clip_factors
from optimizer_reference import np_per_example
from optimizer_reference import np_run
from optimizer_reference import run_steps


@pytest.mark.parametrize("num_steps", [1, 4])
def test_clipped(num_steps):
    steps = batches(num_steps, seed=3)
    w, b, norms, _ = run_steps(
        lambda: opt_lib.ClippedOptimizer(gd(), CLIP, strategy=STRATEGY),
        steps)
    ew, eb, enorms = np_run(steps, clipped_update(CLIP))
    np.testing.assert_allclose(w, ew, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(b, eb, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(norms, enorms, rtol=1e-10)
    # The test means something: some examples are clipped, some are not.
    all_norms = np.concatenate(enorms)
    assert (all_norms > CLIP).any() and (all_norms < CLIP).any()


@pytest.mark.parametrize("strategy", ["rules", "pfor", "loop"])
def test_clipped_each_strategy(strategy):
    steps = batches(2, seed=3)
    w, b, _, _ = run_steps(lambda: opt_lib.DPOptimizer(
        gd(), [1.0, 0.5], 0.0, strategy=strategy), steps)
    ew, eb, _ = np_run(steps, clipped_update((1.0, 0.5)))
    np.testing.assert_allclose(w, ew, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(b, eb, rtol=1e-10, atol=1e-12)


def test_dp_without_noise_is_clipped():
    steps = batches(3, seed=4)
    w, b, _, _ = run_steps(lambda: opt_lib.DPOptimizer(
        gd(), CLIP, noise_multiplier=0.0, seed=1, strategy=STRATEGY), steps)
    ew, eb, _ = np_run(steps, clipped_update(CLIP))
    np.testing.assert_allclose(w, ew, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(b, eb, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("form", ["list", "dict_names", "dict_vars"])
def test_clipped_per_layer(form):
    clip = (0.8, 0.3)
    steps = batches(3, seed=5)

    def make():
        graph = tf.compat.v1.get_default_graph()
        w, b = (graph.get_collection("variables")[0],
                graph.get_collection("variables")[1])
        spec = {"list": [clip[0], clip[1]],
                "dict_names": {"w": clip[0], "b:0": clip[1]},
                "dict_vars": {w: clip[0], b: clip[1]}}[form]
        return opt_lib.ClippedOptimizer(gd(), spec, strategy=STRATEGY)

    w, b, _, _ = run_steps(make, steps)
    ew, eb, _ = np_run(steps, clipped_update(clip))
    np.testing.assert_allclose(w, ew, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(b, eb, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("microbatches", [1, 2, 3])
def test_microbatches(microbatches):
    steps = batches(3, seed=6)
    w, b, norms, _ = run_steps(lambda: opt_lib.ClippedOptimizer(
        gd(), 0.5, num_microbatches=microbatches, strategy=STRATEGY), steps)
    ew, eb, _ = np_run(steps, clipped_update(0.5, microbatches))
    np.testing.assert_allclose(w, ew, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(b, eb, rtol=1e-10, atol=1e-12)
    assert norms[0].shape == (microbatches,)


def test_microbatches_per_layer():
    clip = (0.4, 0.2)
    steps = batches(2, seed=7)
    w, b, _, _ = run_steps(lambda: opt_lib.ClippedOptimizer(
        gd(), list(clip), num_microbatches=2, strategy=STRATEGY), steps)
    ew, eb, _ = np_run(steps, clipped_update(clip, 2))
    np.testing.assert_allclose(w, ew, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(b, eb, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("microbatches", [None, 3])
def test_dynamic_batch_size(microbatches):
    """B known only at run time: clipping, microbatches and the divide-by-M
    all work from tf.shape; a batch M does not divide is a run-time error."""
    steps = batches(2, seed=14)
    with tf.Graph().as_default():
        model = Model(batch=None)
        opt = opt_lib.ClippedOptimizer(gd(), 0.8,
                                       num_microbatches=microbatches,
                                       strategy=STRATEGY)
        train = opt.minimize(model.loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for xb, yb in steps:
                sess.run(train, model.feed(xb, yb))
            w, b = sess.run([model.w, model.b])
            if microbatches:
                with pytest.raises(tf.errors.InvalidArgumentError,
                                   match="num_microbatches=3 must divide"):
                    sess.run(train, model.feed(xb[:4], yb[:4]))
    ew, eb, _ = np_run(steps, clipped_update(0.8, microbatches))
    np.testing.assert_allclose(w, ew, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(b, eb, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("clip", [0.7, (0.5, 0.25)], ids=["global",
                                                          "per_layer"])
@pytest.mark.parametrize("microbatches", [None, 3])
def test_every_contribution_within_clip(clip, microbatches):
    """||clip(g_m)|| <= C for every microbatch, checked via the norms."""
    xb, yb = batches(1, seed=8)[0]
    with tf.Graph().as_default():
        model = Model()
        opt = opt_lib.DPOptimizer(
            gd(), list(clip) if isinstance(clip, tuple) else clip,
            noise_multiplier=1.0, num_microbatches=microbatches, seed=0,
            strategy=STRATEGY)
        opt.compute_gradients(model.loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            norms, clipped, std = sess.run(
                [opt.per_example_norms, opt.per_example_clipped_norms,
                 opt.noise_stddev], model.feed(xb, yb))
    gw, gb, _ = np_per_example(W0, B0, xb, yb)
    if microbatches:
        gw = gw.reshape(microbatches, -1, D, K).mean(1)
        gb = gb.reshape(microbatches, -1, K).mean(1)
    fw, fb = np_clip_factors(gw, gb, clip)
    np.testing.assert_allclose(
        norms, np.sqrt((gw ** 2).sum((1, 2)) + (gb ** 2).sum(1)), rtol=1e-10)
    expected = np.sqrt((fw ** 2) * (gw ** 2).sum((1, 2)) +
                       (fb ** 2) * (gb ** 2).sum(1))
    np.testing.assert_allclose(clipped, expected, rtol=1e-10)
    bound = np.sqrt(np.sum(np.square(clip)))
    assert (clipped <= bound * (1 + 1e-12)).all()
    assert (norms > bound).any()
    np.testing.assert_allclose(std, 1.0 * bound, rtol=1e-12)


# --------------------------------------------------------------------------
# Noise.


def test_noise_statistics():
    """noise = (DP grad - clipped grad) * B ~ N(0, (z C)^2), i.i.d."""
    z, clip, draws = 1.3, 0.9, 150
    xb, yb = batches(1, seed=9)[0]
    with tf.Graph().as_default():
        model = Model()
        dp = opt_lib.DPOptimizer(gd(), clip, z, seed=1234, strategy=STRATEGY)
        clipped = opt_lib.ClippedOptimizer(gd(), clip, strategy=STRATEGY)
        dp_g = [g for g, _ in dp.compute_gradients(model.loss)]
        cl_g = [g for g, _ in clipped.compute_gradients(model.loss)]
        noise = tf.concat([tf.reshape((a - c) * B, [-1])
                           for a, c in zip(dp_g, cl_g)], 0)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            samples = np.stack([sess.run(noise, model.feed(xb, yb))
                                for _ in range(draws)])
            sess.run(tf.compat.v1.global_variables_initializer())
            again = sess.run(noise, model.feed(xb, yb))
    sigma = z * clip
    n = samples.size  # 150 draws x 15 parameters
    # Bounds: 5 standard errors (mean: sigma/sqrt(n); std: sigma/sqrt(2n)).
    assert abs(samples.mean()) < 5 * sigma / np.sqrt(n)
    assert abs(samples.std() - sigma) < 5 * sigma / np.sqrt(2 * n)
    # Each parameter gets noise of the same scale, and the draws differ
    # between steps and between parameters.
    per_param_std = samples.std(axis=0)
    assert (np.abs(per_param_std - sigma) < 6 * sigma / np.sqrt(
        2 * draws)).all()
    corr = np.corrcoef(samples.T)
    assert np.abs(corr[np.triu_indices_from(corr, 1)]).max() < 0.35
    assert len(np.unique(samples[:, 0])) == draws
    # Seeded: re-initializing the step counter replays the same noise.
    np.testing.assert_array_equal(again, samples[0])


def test_noise_seeded_across_graphs_and_unseeded_varies():
    xb, yb = batches(1, seed=10)[0]

    def draw(seed, graph_seed=None):
        with tf.Graph().as_default():
            if graph_seed is not None:
                tf.compat.v1.set_random_seed(graph_seed)
            model = Model()
            dp = opt_lib.DPOptimizer(gd(), 1.0, 1.0, seed=seed,
                                     strategy=STRATEGY)
            g = dp.compute_gradients(model.loss)[0][0]
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                return [sess.run(g, model.feed(xb, yb)) for _ in range(2)]

    a, b = draw(7), draw(7)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], a[1])
    assert not np.array_equal(draw(8)[0], a[0])
    # seed=None: the checkpointed stream's key comes from the graph-level
    # seed (custagg.privacy.noise), so two runs from scratch repeat.
    c, d = draw(None, graph_seed=3), draw(None, graph_seed=3)
    np.testing.assert_array_equal(c[0], d[0])


# --------------------------------------------------------------------------
# TF1 optimizer behaviour: slots, variables, Saver, names.


def test_slots_variables_and_names():
    xb, yb = batches(1)[0]
    with tf.Graph().as_default():
        model = Model()
        inner = tf.compat.v1.train.MomentumOptimizer(0.1, momentum=0.9)
        opt = opt_lib.DPOptimizer(inner, 1.0, 0.5, seed=0, strategy=STRATEGY)
        train = opt.minimize(model.loss, global_step=model.global_step,
                             name="my_train_op")
        assert train.name == "my_train_op"
        assert opt.get_slot_names() == ["momentum"]
        assert opt.get_slot(model.w, "momentum") is inner.get_slot(
            model.w, "momentum")
        assert opt.get_slot(model.w, "nope") is None
        names = [v.name for v in opt.variables()]
        assert names == sorted(["b/Momentum:0", "w/Momentum:0",
                                opt.get_name() + "_noise_step:0"])
        assert opt.optimizer is inner
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train, model.feed(xb, yb))
            assert sess.run(model.global_step) == 1
            assert np.abs(sess.run(opt.get_slot(model.b, "momentum"))).sum() \
                > 0


def test_gate_graph_and_grad_loss():
    xb, yb = batches(1, seed=11)[0]
    scale = np.linspace(0.5, 2.0, B)
    with tf.Graph().as_default():
        model = Model()
        opt = opt_lib.ClippedOptimizer(gd(), CLIP, strategy=STRATEGY)
        gv = opt.compute_gradients(
            model.loss, gate_gradients=opt.GATE_GRAPH,
            grad_loss=tf.constant(scale))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            gw, gb = sess.run([g for g, _ in gv], model.feed(xb, yb))
    ew, eb, _ = np_per_example(W0, B0, xb, yb)
    dw, db = clipped_update(CLIP)(ew * scale[:, None, None],
                                  eb * scale[:, None], 0)
    np.testing.assert_allclose(gw, dw, rtol=1e-10)
    np.testing.assert_allclose(gb, db, rtol=1e-10)


def test_saver_round_trip_with_adam_and_noise(tmp_path):
    """Save after 3 steps; restoring and running 3 more steps gives exactly
    the state of an uninterrupted run: variables, Adam slots, beta powers,
    global_step and the noise step all come back."""
    steps = batches(6, seed=12)
    ckpt = str(tmp_path / "model.ckpt")

    def build():
        model = Model()
        opt = opt_lib.DPAdamGaussianWrapper(
            l2_norm_clip=1.0, noise_multiplier=0.7, learning_rate=0.05,
            seed=5, strategy=STRATEGY)
        train = opt.minimize(model.loss, global_step=model.global_step)
        return model, opt, train

    def state(sess):
        gvars = tf.compat.v1.global_variables()
        return dict(zip([v.name for v in gvars], sess.run(gvars)))

    with tf.Graph().as_default():
        model, opt, train = build()
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for xb, yb in steps[:3]:
                sess.run(train, model.feed(xb, yb))
            saved = state(sess)
            saver.save(sess, ckpt)
            for xb, yb in steps[3:]:
                sess.run(train, model.feed(xb, yb))
            uninterrupted = state(sess)

    assert {"w/Adam:0", "w/Adam_1:0", "beta1_power:0", "global_step:0",
            opt.get_name() + "_noise_step:0"} <= set(saved)
    assert saved["global_step:0"] == 3
    assert saved[opt.get_name() + "_noise_step:0"] == 3

    with tf.Graph().as_default():
        model, opt, train = build()
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            saver.restore(sess, ckpt)
            restored = state(sess)
            for xb, yb in steps[3:]:
                sess.run(train, model.feed(xb, yb))
            resumed = state(sess)

    assert restored.keys() == saved.keys()
    for k in saved:
        np.testing.assert_array_equal(restored[k], saved[k], err_msg=k)
    for k in uninterrupted:
        np.testing.assert_array_equal(resumed[k], uninterrupted[k], err_msg=k)
    assert not np.array_equal(saved["w:0"], uninterrupted["w:0"])


def test_gaussian_classes():
    # TF Privacy's short names take a DPQuery: custagg.privacy's classes.
    from custagg.privacy import dp_optimizer
    assert opt_lib.DPGradientDescentOptimizer is \
        dp_optimizer.DPGradientDescentOptimizer
    # custagg's wrapper classes keep their earlier names, with a warning;
    # the class's own name tells them from TF Privacy's classes of that name.
    with pytest.warns(FutureWarning, match="DPAdamGaussianWrapper"):
        assert opt_lib.DPAdamGaussianOptimizer is \
            opt_lib.DPAdamGaussianWrapper
    assert opt_lib.DPAdamGaussianWrapper.__name__ == "DPAdamGaussianWrapper"
    steps = batches(2, seed=13)
    w, b, _, _ = run_steps(lambda: opt_lib.DPGradientDescentGaussianWrapper(
        CLIP, 0.0, None, LR, strategy=STRATEGY), steps)
    ew, eb, _ = np_run(steps, clipped_update(CLIP))
    np.testing.assert_allclose(w, ew, rtol=1e-10, atol=1e-12)
    mom = opt_lib.DPMomentumGaussianWrapper(1.0, 1.0, learning_rate=0.1,
                                            momentum=0.9)
    assert isinstance(mom.optimizer, tf.compat.v1.train.MomentumOptimizer)


# --------------------------------------------------------------------------
# Bad arguments name the argument.


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(l2_norm_clip=0.0), ValueError, "l2_norm_clip must be a positive"),
    (dict(l2_norm_clip=-1.0), ValueError, "l2_norm_clip must be a positive"),
    (dict(l2_norm_clip="1"), ValueError, "l2_norm_clip must be a positive"),
    (dict(l2_norm_clip=float("nan")), ValueError, "l2_norm_clip"),
    (dict(l2_norm_clip=[1.0, -2.0]), ValueError, r"l2_norm_clip\[1\]"),
    (dict(l2_norm_clip=[]), ValueError, "l2_norm_clip is an empty list"),
    (dict(noise_multiplier=-0.1), ValueError,
     "noise_multiplier must be a non-negative"),
    (dict(noise_multiplier=True), ValueError, "noise_multiplier"),
    (dict(num_microbatches=0), ValueError, "num_microbatches must be"),
    (dict(num_microbatches=2.0), ValueError, "num_microbatches must be"),
    (dict(seed="x"), ValueError, "seed must be an int"),
    (dict(optimizer=tf.compat.v1.train.GradientDescentOptimizer), TypeError,
     "Pass an instance"),
    (dict(optimizer="sgd"), TypeError, "optimizer must be a tf.compat.v1"),
    (dict(strategy=3), TypeError, "strategy must be a string"),
])
def test_bad_constructor_args(kwargs, exc, match):
    args = dict(optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1),
                l2_norm_clip=1.0, noise_multiplier=1.0)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        opt_lib.DPOptimizer(**args)


@pytest.mark.parametrize("case, exc, match", [
    ("scalar_loss", ValueError, r"loss must be the vector.*\[B\]"),
    ("int_loss", TypeError, "loss must be a float"),
    ("not_tensor", TypeError, "loss must be a tf.Tensor"),
    ("gate", ValueError, "gate_gradients must be one of"),
    ("aggregation", ValueError, "aggregation_method"),
    ("custom", ValueError, "WeightedOptimizer"),
    ("clip_list_len", ValueError, "l2_norm_clip holds 3 per-layer"),
    ("clip_dict_missing", ValueError, "no clip norm for variable 'b'"),
    ("clip_dict_extra", ValueError, r"l2_norm_clip names \['v'\]"),
    ("microbatch_divide", ValueError,
     "num_microbatches=4 does not divide the batch size 6"),
    ("grad_loss_shape", ValueError, "grad_loss must have the shape"),
    ("no_vars", ValueError, "no variables to optimize"),
    ("no_grads", ValueError, "no gradients for any variable"),
])
def test_bad_compute_args(case, exc, match):
    with tf.Graph().as_default():
        model = Model()
        kw = {}
        clip = 1.0
        mb = None
        loss = model.loss
        var_list = None
        if case == "scalar_loss":
            loss = tf.reduce_mean(model.loss)
        elif case == "int_loss":
            loss = model.y
        elif case == "not_tensor":
            loss = [1.0, 2.0]
        elif case == "gate":
            kw["gate_gradients"] = 5
        elif case == "aggregation":
            kw["aggregation_method"] = "bogus"
        elif case == "custom":
            kw["aggregation_method"] = "custom"
        elif case == "clip_list_len":
            clip = [1.0, 2.0, 3.0]
        elif case == "clip_dict_missing":
            clip = {"w": 1.0}
        elif case == "clip_dict_extra":
            clip = {"w": 1.0, "b": 1.0, "v": 2.0}
        elif case == "microbatch_divide":
            mb = 4
        elif case == "grad_loss_shape":
            kw["grad_loss"] = tf.ones([B + 1], tf.float64)
        elif case == "no_vars":
            var_list = []
        elif case == "no_grads":
            var_list = [tf.compat.v1.get_variable(
                "other", initializer=tf.constant(1.0, tf.float64))]
        opt = opt_lib.DPOptimizer(gd(), clip, 1.0, num_microbatches=mb,
                                  strategy=STRATEGY)
        with pytest.raises(exc, match=match):
            if case == "no_grads":
                opt.minimize(loss, var_list=var_list)
            else:
                opt.compute_gradients(loss, var_list=var_list, **kw)


def test_attributes_before_compute():
    opt = opt_lib.DPOptimizer(gd(), 1.0, 1.0)
    with pytest.raises(ValueError, match="after compute_gradients"):
        _ = opt.per_example_norms
    with pytest.raises(ValueError, match="after compute_gradients"):
        _ = opt.noise_stddev
    with pytest.raises(ValueError, match="after compute_gradients"):
        _ = opt.per_example_clipped_norms
