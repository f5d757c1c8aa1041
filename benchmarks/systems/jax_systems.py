"""JAX peer: jit(vmap(grad)) on the same weights and data as the TF models.

Floor (same process): jit(grad(sum of per-example losses)).
build_s is the time of jit lowering + XLA compilation; n_ops is not recorded
(a TF op count and an HLO count are not comparable).
"""
import time

import numpy as np

from benchmarks import common, models


def _dense(h, w, b):
    return h @ w + b


def _forward(jnp, lax, model, p, x):
    if model == "softmax":
        return _dense(x, p["w"], p["b"])
    if model == "mlp":
        h = jnp.maximum(_dense(x, p["w1"], p["b1"]), 0.0)
        h = jnp.maximum(_dense(h, p["w2"], p["b2"]), 0.0)
        return _dense(h, p["w3"], p["b3"])
    if model == "cnn":
        dn = ("NHWC", "HWIO", "NHWC")
        h = x
        for i in (1, 2):
            h = lax.conv_general_dilated(h, p["conv%d_w" % i], (1, 1), "SAME",
                                         dimension_numbers=dn)
            h = jnp.maximum(h + p["conv%d_b" % i], 0.0)
            h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return _dense(h.reshape(h.shape[0], -1), p["dense_w"], p["dense_b"])
    if model == "text":
        e = jnp.take(p["emb"], x, axis=0)
        return _dense(e.mean(axis=1), p["dense_w"], p["dense_b"])
    if model == "transformer":
        return _transformer(jnp, p, x)
    # The recurrent models: x [B, T, D], scanned over T.
    x_tm, h0 = jnp.transpose(x, (1, 0, 2)), jnp.zeros((x.shape[0], models.LSTM_HIDDEN), x.dtype)
    if model in ("lstm", "keras_lstm"):
        def affine(xt, h):
            if model == "lstm":
                return jnp.concatenate([xt, h], axis=1) @ p["kernel"] + p["bias"]
            return xt @ p["kernel"] + h @ p["recurrent_kernel"] + p["bias"]

        def lstm_step(carry, xt):
            h, c = carry
            i, f, g, o = jnp.split(affine(xt, h), 4, axis=1)
            c = _sigmoid(jnp, f) * c + _sigmoid(jnp, i) * jnp.tanh(g)
            return (_sigmoid(jnp, o) * jnp.tanh(c), c), None
        (h, _), _ = lax.scan(lstm_step, (h0, h0), x_tm)
        return _dense(h, p["dense_w"], p["dense_b"])
    if model in ("gru", "keras_gru"):
        # keras_gru: reset_after=True, its bias [input, recurrent].
        recurrent, bx, bh = ((p["recurrent"], p["bias"], 0.0) if model == "gru" else
                             (p["recurrent_kernel"], p["bias"][0], p["bias"][1]))

        def gru_step(h, xt):
            xz, xr, xn = jnp.split(xt @ p["kernel"] + bx, 3, axis=1)
            hz, hr, hn = jnp.split(h @ recurrent + bh, 3, axis=1)
            z = _sigmoid(jnp, xz + hz)
            r = _sigmoid(jnp, xr + hr)
            return (1.0 - z) * jnp.tanh(xn + r * hn) + z * h, None
        h, _ = lax.scan(gru_step, h0, x_tm)
        return _dense(h, p["dense_w"], p["dense_b"])
    if model == "norule_rnn":
        def norule_step(carry, xt):
            h, acc = carry
            k = (1.0 / (1.0 + jnp.square(xt - p["center"]))) ** p["power"]
            h = 0.5 * h + 0.5 * jnp.tanh(k - 0.5)
            acc = acc - jnp.sum(jnp.square(h[:, None, :] - p["protos"]), axis=2)
            return (h, acc), None
        n = x.shape[0]
        init = (jnp.zeros((n, models.LSTM_IN), x.dtype),
                jnp.zeros((n, models.NUM_CLASSES), x.dtype))
        (_, acc), _ = lax.scan(norule_step, init, x_tm)
        return acc * (1.0 / models.LSTM_STEPS)
    raise ValueError("no JAX form of model %r" % model)


def _sigmoid(jnp, v):
    return 1.0 / (1.0 + jnp.exp(-v))


def _layer_norm(jnp, h, g, b):
    mu = h.mean(-1, keepdims=True)
    d = h - mu
    var = (d * d).mean(-1, keepdims=True)
    return d / jnp.sqrt(var + models.LN_EPS) * g + b


def _transformer(jnp, p, x):
    n, t, dm, nh = x.shape[0], models.TR_LEN, models.TR_DIM, models.TR_HEADS
    dh = dm // nh
    h = jnp.take(p["tok_emb"], x, axis=0) + p["pos_emb"]
    a = _layer_norm(jnp, h, p["ln1_g"], p["ln1_b"])
    q, k, v = ((a @ p[w]).reshape(n, t, nh, dh) for w in ("wq", "wk", "wv"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh)
    scores = scores - scores.max(-1, keepdims=True)
    w = jnp.exp(scores)
    w = w / w.sum(-1, keepdims=True)
    att = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(n, t, dm)
    h = h + att @ p["wo"] + p["bo"]
    m = jnp.maximum(_layer_norm(jnp, h, p["ln2_g"], p["ln2_b"]) @ p["w1"] + p["b1"], 0.0)
    h = h + m @ p["w2"] + p["b2"]
    return _dense(h.mean(axis=1), p["out_w"], p["out_b"])


def run(cfg):
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.scipy.special import logsumexp

    # "rbg": XLA compiles the default threefry generator slowly on CPU (the
    # DP-SGD step's noise took ~10x the compile time of the gradients).
    jax.config.update("jax_default_prng_impl", "rbg")
    model, batch_size, task = cfg["model"], cfg["batch_size"], cfg["task"]
    sig = common.load_signature(cfg["ref_path"])
    names = [s.name for s in models.param_specs(model)]
    params = {k: jnp.asarray(v) for k, v in models.init_params(model).items()}
    x_np, y_np = models.make_batch(model, batch_size)
    x, y = jnp.asarray(x_np), jnp.asarray(y_np)
    clip = float(sig["clip"])

    def loss_vec(p, xb, yb):
        logits = _forward(jnp, lax, model, p, xb)
        return logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, yb[:, None], -1)[:, 0]

    def loss_one(p, xi, yi):
        return loss_vec(p, xi[None], yi[None])[0]

    per_example = jax.vmap(jax.grad(loss_one), in_axes=(None, 0, 0))

    def sumsq(g):
        return sum(jnp.sum(jnp.square(g[n]).reshape(batch_size, -1), axis=1) for n in names)

    def grads_task(p, xb, yb):
        return sumsq(per_example(p, xb, yb))

    def norms_task(p, xb, yb):
        return jnp.sqrt(sumsq(per_example(p, xb, yb)))

    def clip_task(p, xb, yb):
        g = per_example(p, xb, yb)
        scale = clip / jnp.maximum(jnp.sqrt(sumsq(g)), clip)
        return {n: jnp.tensordot(scale, g[n], axes=1) for n in names}

    def dpsgd_task(p, xb, yb, key, noise_multiplier):
        g = per_example(p, xb, yb)
        scale = clip / jnp.maximum(jnp.sqrt(sumsq(g)), clip)
        keys = jax.random.split(key, len(names))
        return {n: jnp.tensordot(scale, g[n], axes=1)
                + noise_multiplier * clip * jax.random.normal(k, g[n].shape[1:])
                for n, k in zip(names, keys)}

    key = jax.random.PRNGKey(0)
    if cfg.get("system") == "jax_privacy":
        built = _jax_privacy(jax, jnp, loss_vec, task, clip, key)
        if isinstance(built, dict):
            return built
        clip_task, dpsgd_task = built
    if task == "grads":
        fn, args = grads_task, (params, x, y)
    elif task == "norms":
        fn, args = norms_task, (params, x, y)
    elif task == "clip":
        fn, args = clip_task, (params, x, y)
    elif task == "dpsgd":
        fn, args = dpsgd_task, (params, x, y, key, jnp.float32(common.NOISE_MULTIPLIER))
    else:
        return {"status": "skipped", "note": "task %r not implemented for JAX" % task}

    floor = jax.jit(jax.grad(lambda p, xb, yb: loss_vec(p, xb, yb).sum())).lower(
        params, x, y).compile()
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    build_s = time.perf_counter() - t0

    def call(f, a):
        return lambda: jax.block_until_ready(f(*a))

    call(floor, (params, x, y))()
    first_run_ms = common.timed_ms(call(compiled, args))

    if task == "grads":
        g = jax.jit(per_example)(params, x, y)
        values = common.signature_of_per_example(names, [np.asarray(g[n]) for n in names])
        values["norms"] = np.sqrt(np.asarray(compiled(*args)))
        del g
    elif task == "norms":
        values = {"norms": np.asarray(compiled(*args))}
    else:
        out = (compiled(*args) if task == "clip"
               else compiled(params, x, y, key, jnp.float32(0.0)))
        values = {"csum/" + n: np.asarray(out[n]) for n in names}
    return common.measured(
        sig, values, call(compiled, args), call(floor, (params, x, y)), cfg, first_run_ms,
        lambda: (_xla_peak_bytes(floor), _xla_peak_bytes(compiled)), build_s=build_s,
        floor_system="jax.jit(jax.grad(sum(loss)))",
        peak_method="XLA buffer assignment: compiled.memory_analysis() temp + output bytes",
        framework_version="jax %s (jaxlib %s)%s" % (
            jax.__version__, _jaxlib_version(), _jax_privacy_version(cfg)))


def _jax_privacy(jax, jnp, loss_vec, task, clip, key):
    """JAX Privacy 2.x's own clipped sum (`clipping.clipped_grad`: vmap over
    the examples, clip, sum; under the caller's jit) and, for the DP step,
    its Gaussian privatizer (`noise_addition.gaussian_privatizer`)."""
    try:
        from jax_privacy import clipping, noise_addition
    except ImportError as e:
        return {"status": "skipped", "note": "jax-privacy not installed (%s)" % e}
    if task not in ("clip", "dpsgd"):
        return {"status": "skipped", "note": "jax_privacy runs clip and dpsgd only"}
    clipped = clipping.clipped_grad(lambda p, xb, yb: loss_vec(p, xb, yb).sum(),
                                    l2_clip_norm=clip, batch_argnums=(1, 2))

    def dpsgd_task(p, xb, yb, key, noise_multiplier):
        g = clipped(p, xb, yb)
        privatizer = noise_addition.gaussian_privatizer(stddev=noise_multiplier * clip,
                                                        prng_key=key)
        noisy, _ = privatizer.update(g, privatizer.init(g))
        return noisy

    return clipped, dpsgd_task


def _jax_privacy_version(cfg):
    if cfg.get("system") != "jax_privacy":
        return ""
    from importlib import metadata
    return ", jax-privacy " + metadata.version("jax-privacy")


def _xla_peak_bytes(compiled):
    """Bytes a compiled step allocates beyond its arguments, from XLA's
    buffer assignment: its temporaries plus its outputs (outputs aliasing an
    argument excluded). XLA plans every buffer before the run, so this is the
    step's allocation (an upper bound on the live bytes at any instant, as
    TF's figure from its allocation records is a measured peak). None when
    the backend does not report it."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # pragma: no cover - depends on the jaxlib build
        return None
    if stats is None:
        return None
    return (stats.temp_size_in_bytes + stats.output_size_in_bytes
            - getattr(stats, "alias_size_in_bytes", 0))


def _jaxlib_version():
    try:
        import jaxlib
        return jaxlib.__version__
    except Exception:  # pragma: no cover - informational only
        return "?"
