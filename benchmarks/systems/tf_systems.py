"""TensorFlow systems: the floor, custagg's strategies, TF's own baselines, TF Privacy.

One configuration a worker child (`run`): the model, the floor (the
aggregated gradient of the summed loss) and the system in one graph, the
system checked against the reference signature, then timed against the
floor in one session. What is timed is a fetch of the task's result (never
a tf.group: TF prunes work whose output is not fetched).
"""
import collections
import importlib.util
import os
import time

import numpy as np

from benchmarks import common, memory, models

Ctx = collections.namedtuple(
    "Ctx", "tf model batch_size variables var_list names x y loss f clip noise_scale")

# What a builder returns: `fetch` is timed; `check` maps signature keys to
# tensors (fetched once, with the noise scale fed as 0).
Built = collections.namedtuple("Built", "fetch check note")


def _tf():
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    return tf


def _dense_list(tf, grads):
    return [None if g is None else tf.convert_to_tensor(g) for g in grads]


# Reference (B=1 graph, looped over examples): writes the signature file.

def run_reference(cfg):
    tf = _tf()
    model, batch_size = cfg["model"], cfg["batch_size"]
    x_np, y_np = models.make_batch(model, batch_size)
    graph = tf.Graph()
    with graph.as_default():
        variables, var_list = models.tf_variables(model)
        x, y = models.tf_placeholders(model, 1)
        loss = models.tf_loss(model, variables, x, y)
        grads = _dense_list(tf, tf.compat.v1.gradients(tf.reduce_sum(loss), var_list))
        init = tf.compat.v1.global_variables_initializer()
    t0 = time.perf_counter()
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        builder = common.SignatureBuilder(
            list(variables), [v.shape.as_list() for v in var_list], batch_size)

        def example(i):
            return sess.run(grads, {x: x_np[i:i + 1], y: y_np[i:i + 1]})

        for i in range(batch_size):
            builder.add(i, example(i))
        builder.finish_pass1()
        for i in range(batch_size):
            builder.add_clipped(i, example(i))
    builder.save(cfg["ref_path"])
    return {"note": "reference: tf.compat.v1.gradients on B=1, looped over %d examples "
                    "(%.1f s), clip C=%.4g" % (batch_size, time.perf_counter() - t0, builder.clip),
            "check": "n/a"}


# Per-example gradient providers: ctx -> list of [B, *v.shape] tensors.

def _pe_tf_loop(ctx):
    tf = ctx.tf
    rows = [_dense_list(tf, tf.compat.v1.gradients(ctx.loss[i], ctx.var_list))
            for i in range(ctx.batch_size)]
    return [tf.stack(col) for col in zip(*rows)]


def _pe_tf_vmap(ctx):
    tf = ctx.tf

    def one_example(args):
        # The fast form: the forward pass of ONE example runs inside the map, so
        # its backward pass does not go through the whole batch.
        xi, yi = args
        li = models.tf_loss(ctx.model, ctx.variables, xi[None], yi[None])
        return _dense_list(tf, tf.compat.v1.gradients(tf.reduce_sum(li), ctx.var_list))

    return list(tf.vectorized_map(one_example, (ctx.x, ctx.y)))


def _pe_tf_jacobian(ctx):
    from tensorflow.python.ops.parallel_for import gradients as pfor_gradients
    return list(pfor_gradients.jacobian(ctx.loss, ctx.var_list))


class _Skip(Exception):
    """Raised by a builder when the system cannot run here (recorded as skipped)."""


def _pe_custagg(strategy):
    def provider(ctx):
        import custagg
        return list(custagg.per_example_gradients(ctx.loss, ctx.var_list, strategy=strategy))
    return provider


# Tasks on top of materialized per-example gradients.

def _sumsq_per_example(tf, per_example):
    return tf.add_n([tf.reduce_sum(tf.square(g), axis=list(range(1, g.shape.ndims)))
                     for g in per_example if g is not None])


def _projection_checks(ctx, per_example):
    tf = ctx.tf
    check = {}
    for name, g in zip(ctx.names, per_example):
        size = int(np.prod(g.shape.as_list()[1:]))
        r = tf.constant(common.projection_vector(name, size).astype(np.float32)[:, None])
        check["proj/" + name] = tf.squeeze(tf.matmul(tf.reshape(g, [-1, size]), r), 1)
    return check


def _noised(ctx, grads, own=False):
    """Each clipped sum plus its Gaussian noise, drawn once all sums exist (a
    control dependency): the draw needs nothing from the backward pass, and
    drawn when the step starts it would stay live through it (one more copy
    of the parameters in the step's peak), which no training step needs.
    `own`: custagg's draw, as its DP optimizers add it (a noise stream)."""
    if own:
        from custagg.privacy import core, noise
        return core.add_noise(grads, ctx.noise_scale * ctx.clip, noise.NoiseStream("noise"))
    tf, grads = ctx.tf, [ctx.tf.convert_to_tensor(g) for g in grads]
    with tf.control_dependencies(grads):
        return [g + tf.random.normal(tf.shape(g)) * (ctx.noise_scale * ctx.clip) for g in grads]


def _built(ctx, task, norms=None, sums=None, own_noise=False):
    """Task "norms" from the norms `[B]`, "clip" and "dpsgd" from the clipped sums."""
    if task == "norms":
        return Built(norms, {"norms": norms}, "")
    fetch = _noised(ctx, sums, own_noise) if task == "dpsgd" else sums
    return Built(fetch, _keyed("csum/", ctx.names, sums), "")


def _task_from_per_example(provider):
    def build(ctx, task):
        tf = ctx.tf
        per_example = provider(ctx)
        sumsq = _sumsq_per_example(tf, per_example)
        if task == "grads":
            check = _projection_checks(ctx, per_example)
            check["norms"] = tf.sqrt(sumsq)
            return Built(sumsq, check, "")
        norms = tf.sqrt(sumsq)
        if task == "norms":
            return _built(ctx, task, norms=norms)
        scale = ctx.clip / tf.maximum(norms, ctx.clip)
        return _built(ctx, task, sums=[tf.tensordot(scale, g, axes=1) for g in per_example])
    return build


def _keyed(prefix, names, tensors):
    return collections.OrderedDict((prefix + n, t) for n, t in zip(names, tensors))


def _custagg_system(strategy):
    def build(ctx, task):
        import custagg
        try:
            if task == "grads":
                return _task_from_per_example(_pe_custagg(strategy))(ctx, task)
            if task == "norms":
                return _built(ctx, task, norms=custagg.per_example_norms(
                    ctx.loss, ctx.var_list, strategy=strategy))
            if task in ("clip", "dpsgd"):
                return _built(ctx, task, sums=custagg.clipped_gradients(
                    ctx.loss, ctx.var_list, ctx.clip, strategy=strategy), own_noise=True)
        except ValueError as e:
            # A strategy that refuses a model by design (e.g. "rules" has no
            # rule for a While loop) is "skipped", not a failure of the run.
            if strategy != "auto" and "cannot give per-example gradients" in str(e):
                raise _Skip("not supported by strategy=%r: %s" % (strategy, str(e)[:300]))
            raise
        sums = list(custagg.weighted_gradients(ctx.loss, ctx.var_list, ctx.f))     # "custom"
        return Built(sums, _keyed("wsum/", ctx.names, sums),
                     "weighted_gradients takes no strategy (always one CUSTOM backward pass)")
    return build


def _custom_form(form):
    def build(ctx, task):
        import custagg as ca
        if form == "tf_grad_ys":
            sums = ctx.tf.compat.v1.gradients(ctx.loss, ctx.var_list, grad_ys=ctx.f)
        elif form == "grad_ys":
            sums = ca.gradients(ctx.loss, ctx.var_list, grad_ys=ctx.f)
        else:
            ys = [ctx.loss[i] for i in range(ctx.batch_size)] if form == "slices" else ctx.loss
            sums = ca.gradients(ys, ctx.var_list, aggregation_method=ca.AggregationMethod.CUSTOM,
                                gradient_factors=ctx.f)
        sums = list(sums)
        return Built(sums, _keyed("wsum/", ctx.names, sums), "")
    return build


# TF Privacy: load only its vectorized optimizer module (the package pins
# TF <= 2.15 and its __init__ fails on 2.21; the module itself is plain TF).

_TFP_REL = os.path.join("tensorflow_privacy", "privacy", "optimizers",
                        "dp_optimizer_vectorized.py")
TFP_TARGET = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          ".peers", "tfp")


def tfp_location():
    """(path to dp_optimizer_vectorized.py, version) or (None, reason)."""
    from importlib import metadata
    spec = importlib.util.find_spec("tensorflow_privacy")   # does not execute it
    roots = [os.path.dirname(p) for p in (spec and spec.submodule_search_locations or [])]
    for root in roots + [TFP_TARGET]:
        path = os.path.join(root, _TFP_REL)
        if os.path.exists(path):
            dist = next(metadata.distributions(name="tensorflow-privacy", path=[root]), None)
            return path, dist.version if dist else "unknown"
    return None, ("tensorflow-privacy not installed (pip install --no-deps --target "
                  "benchmarks/.peers/tfp tensorflow-privacy)")


def _tfp_system(ctx, task):
    path, version = tfp_location()
    if path is None:
        raise _Skip(version)
    spec = importlib.util.spec_from_file_location("_tfp_dp_optimizer_vectorized", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    opt = module.VectorizedDPSGDOptimizer(
        l2_norm_clip=ctx.clip, noise_multiplier=ctx.noise_scale,
        num_microbatches=None, learning_rate=0.1)
    grads = [g for g, _ in opt.compute_gradients(ctx.loss, var_list=ctx.var_list)]
    # TF Privacy returns (clipped sum + noise) / B.
    scaled = [g * float(ctx.batch_size) for g in grads]
    return Built(grads, _keyed("csum/", ctx.names, scaled),
                 "tensorflow-privacy %s, dp_optimizer_vectorized.py loaded alone" % version)


BUILDERS = {
    "custagg_auto": _custagg_system("auto"),
    "custagg_rules": _custagg_system("rules"),
    "custagg_pfor": _custagg_system("pfor"),
    "custagg_loop": _custagg_system("loop"),
    "custagg_custom_vector": _custom_form("vector"),
    "custagg_custom_slices": _custom_form("slices"),
    "custagg_grad_ys": _custom_form("grad_ys"),
    "tf_grad_ys": _custom_form("tf_grad_ys"),
    "tf_loop": _task_from_per_example(_pe_tf_loop),
    "tf_vmap": _task_from_per_example(_pe_tf_vmap),
    "tf_jacobian": _task_from_per_example(_pe_tf_jacobian),
    "tfp_vectorized": _tfp_system,
}


# One configuration.

# Systems that index the batch in Python (loss[i] for i in range(B)) or take
# it from static shapes: they keep static placeholders on every model.
STATIC_BATCH_SYSTEMS = ("tf_loop", "tf_jacobian", "custagg_loop", "custagg_custom_slices")


def dynamic_batch(model, system, builder=False):
    """Whether `system` on `model` is built on `[None, ...]` placeholders (a
    builder's model: always)."""
    return (builder or model in models.DYNAMIC_BATCH_MODELS) and \
        system not in STATIC_BATCH_SYSTEMS


def run(cfg):
    """One configuration: `cfg["model"]` a harness model (checked against the
    loop reference of cfg["ref_path"]) or a builder's (`models.build`, the
    zoo and the TF1 models: C = 1, no check); task "step" (the zoo's): the DP
    step over the tutorial's Adam step."""
    tf = _tf()
    model, batch_size, task = cfg["model"], cfg["batch_size"], cfg["task"]
    sig = common.load_signature(cfg["ref_path"]) if cfg.get("ref_path") else None
    # A builder's model (`cfg["builder"]`, the zoo's and the TF1 models) may
    # share a harness model's name (the TF1 transformer): the flag decides.
    builder = bool(cfg.get("builder"))
    dynamic = dynamic_batch(model, cfg["system"], builder)
    graph = tf.Graph()
    with graph.as_default():
        if not builder:
            variables, var_list = models.tf_variables(model)
            x, y = models.tf_placeholders(model, batch_size, dynamic=dynamic)
            loss = models.tf_loss(model, variables, x, y)
            feed, names = dict(zip((x, y), models.make_batch(model, batch_size))), list(variables)
        else:
            loss, var_list, feed_of, _ = models.build(model)
            x = y = variables = None
            feed, names = feed_of(batch_size), [v.op.name for v in var_list]
        f = tf.compat.v1.placeholder(tf.float32, [None if dynamic else batch_size], name="factors")
        noise_scale = tf.compat.v1.placeholder_with_default(
            tf.constant(common.NOISE_MULTIPLIER, tf.float32), [], name="noise_multiplier")
        ctx = Ctx(tf, model, batch_size, variables, var_list, names, x, y, loss, f,
                  float(sig["clip"]) if sig else 1.0, noise_scale)

        n0, t0 = len(graph.get_operations()), time.perf_counter()
        floor = (adam_step(tf, loss, var_list) if task == "step" else
                 tf.compat.v1.gradients(tf.reduce_sum(loss), var_list))
        floor_build_s, floor_n_ops = time.perf_counter() - t0, len(graph.get_operations()) - n0

        n0, t0 = len(graph.get_operations()), time.perf_counter()
        try:
            built = (Built(adam_step(tf, loss, var_list, dp=True), {}, "") if task == "step"
                     else BUILDERS[cfg["system"]](ctx, task))
        except _Skip as e:
            return {"status": "skipped", "note": str(e)}
        build_s, n_ops = time.perf_counter() - t0, len(graph.get_operations()) - n0
        init = tf.group(tf.compat.v1.global_variables_initializer(),
                        tf.compat.v1.tables_initializer())
        extra = {}
        if cfg.get("plan"):   # the plan's forms (zoo.md, tf1_models.md; --plans prints it)
            import custagg
            plan = custagg.plan_per_example(loss, var_list)
            extra = dict(forms=dict(collections.Counter(f or "unconnected" for f in plan.forms())),
                         plan=str(plan), not_rules=["%s: %s" % (a.name, a.form)
                                                    for a in plan.assignments
                                                    if a.form not in ("rules", None)])

    feed[f] = sig["factors"] if sig else common.factors(batch_size)
    with common.session(graph, cfg.get("threads", 0)) as sess:
        sess.run(init)
        try:
            floor_first_ms = common.timed_ms(lambda: sess.run(floor, feed))
            first_run_ms = common.timed_ms(lambda: sess.run(built.fetch, feed))
        except tf.errors.OpError as e:          # the TF1 models' run-time failures
            return dict(extra, status="failed", note="%s: %s" % (type(e).__name__,
                                                                 _first_line(e.message)))
        values = sess.run(dict(built.check), {**feed, noise_scale: 0.0})
        var_shapes = {n: v.shape.as_list() for n, v in zip(ctx.names, var_list)}
        values = {k: common.dense_value(v, var_shapes.get(k.split("/", 1)[-1]))
                  for k, v in values.items()}
        return common.measured(
            sig, values, lambda: sess.run(built.fetch, feed), lambda: sess.run(floor, feed),
            cfg, first_run_ms, lambda: common.tf_peaks(
                graph, init, feed, {"floor": floor, "system": built.fetch},
                cfg.get("threads", 0)),
            note=built.note, build_s=build_s, n_ops=n_ops, floor_build_s=floor_build_s,
            floor_n_ops=floor_n_ops, floor_first_run_ms=floor_first_ms,
            floor_system="tf.compat.v1.gradients(sum(loss))" if task != "step" else
            "Adam(1e-4) on the mean loss", framework_version="tensorflow " + tf.__version__,
            batch_axis="dynamic" if dynamic else "static", **extra)


def adam_step(tf, loss, xs, dp=False):
    """The tutorial's Adam step on the mean loss, or (`dp`) DPOptimizer
    around it (C = 1, sigma = 1.1), in a variable scope of its own (their
    Adam slots apart)."""
    import custagg
    adam = tf.compat.v1.train.AdamOptimizer(1e-4)
    with tf.compat.v1.variable_scope("dp" if dp else "orig"):
        if dp:
            return custagg.DPOptimizer(adam, l2_norm_clip=1.0,
                                       noise_multiplier=1.1).minimize(loss, var_list=xs)
        return adam.minimize(tf.reduce_mean(loss), var_list=xs)


def _first_line(message):
    """The line of a TF error saying what failed (a graph execution error's
    first line is only "Graph execution error:")."""
    lines = [l.strip() for l in message.strip().split("\n") if l.strip()]
    for line in lines:
        if "assertion failed" in line or "custagg" in line:
            return line[:300]
    return lines[-1][:300] if lines else ""


def profile(name, batch_sizes, top=8):
    """`--zoo --profile`: prints, per batch size and fetch, the traced step's
    peak and the tensors live at it. Returns {(batch, fetch name): peak bytes}."""
    tf = _tf()
    import custagg
    found = {}
    graph = tf.Graph()
    with graph.as_default():
        loss, xs, feed, _ = models.build(name)
        fetch_of = {"floor": tf.compat.v1.gradients(tf.reduce_sum(loss), xs),
                    "norms": custagg.per_example_norms(loss, xs),
                    "clip": custagg.clipped_gradients(loss, xs, 1.0)}
        if name in ("mnist_deep", "cnn", "mlp"):
            fetch_of["step_orig"], fetch_of["step_dp"] = (adam_step(tf, loss, xs, dp)
                                                          for dp in (False, True))
        with common.session(graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for batch in batch_sizes:
                fd = feed(batch)
                for key, fetch in fetch_of.items():
                    sess.run(fetch, fd)                      # warm up
                    stats = memory.traced_step_stats(sess, fetch, fd)
                    found[(batch, key)] = peak = memory.peak_from_step_stats(stats)[0]
                    base = "floor" if not key.startswith("step") else "step_orig"
                    print("%s B=%d %-9s peak %8.2f MB  %.2fx %s" % (
                        name, batch, key, peak / 1e6, peak / float(found[(batch, base)]),
                        base), flush=True)
                    for nbytes, node, op_type in memory.live_at_peak(stats)[:top]:
                        print("    %8.2f MB  %-16s %s" % (nbytes / 1e6, op_type, node))
    return found
