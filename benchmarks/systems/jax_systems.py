"""JAX peer: jit(vmap(grad)) on the same weights and data as the TF models.

Floor (same process): jit(grad(sum of per-example losses)).
build_s is the time of jit lowering + XLA compilation; n_ops is not recorded
(a TF op count and an HLO count are not comparable).
"""
import time
from importlib import metadata

import numpy as np

from benchmarks import common, models


class Ops(models.Ops):
    """`models.forward` in JAX on the parameters `p` (TF layout)."""

    def __init__(self, p):
        super().__init__(p)
        import jax
        import jax.numpy as jnp
        from jax import lax
        self.jnp, self.lax = jnp, lax
        self.relu, self.sigmoid, self.tanh = jax.nn.relu, jax.nn.sigmoid, jnp.tanh
        self.softmax, self.einsum, self.rsqrt = jax.nn.softmax, jnp.einsum, lax.rsqrt
        self.images, self.reciprocal = (lambda x: x), (lambda h: 1.0 / h)
        self.mean = lambda h, axis, keepdims=False: h.mean(axis, keepdims=keepdims)
        self.sum = lambda h, axis: h.sum(axis)
        self.reshape = lambda h, shape: h.reshape(shape)
        self.concat = lambda hs: jnp.concatenate(hs, axis=1)
        self.split = lambda h, n: jnp.split(h, n, axis=1)
        self.embed = lambda ids, table: jnp.take(p[table], ids, axis=0)
        self.sqdiff = lambda h, name: jnp.square(h - p[name])
        self.pow = lambda h, name: h ** p[name]
        self.flatten = lambda h: h.reshape(h.shape[0], -1)
        self.max_pool = lambda h: lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1),
                                                    (1, 2, 2, 1), "VALID")
        self.conv = lambda h, w, b: lax.conv_general_dilated(
            h, p[w], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) + p[b]

    def dense(self, h, w, b=None):
        return h @ self.p[w] if b is None else h @ self.p[w] + self.p[b]

    def scan(self, model, x):
        """The output (models.STATE) after the last step: `lax.scan` over time."""
        zeros = tuple(self.jnp.zeros((x.shape[0], n), x.dtype) for n in models.STATE[model])
        state, _ = self.lax.scan(lambda state, xt: (models.step(self, model, state, xt), None),
                                 zeros, self.jnp.transpose(x, (1, 0, 2)))
        return state[model == "norule_rnn"]


def run(cfg):
    import jax
    import jax.numpy as jnp
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
        logits = models.forward(Ops(p), model, xb)
        return logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, yb[:, None], -1)[:, 0]

    def loss_one(p, xi, yi):
        return loss_vec(p, xi[None], yi[None])[0]

    per_example = jax.vmap(jax.grad(loss_one), in_axes=(None, 0, 0))

    def task_fn(p, xb, yb, key=None, noise_multiplier=0.0):
        """The task on the per-example gradients (a task is one of TASKS)."""
        g = per_example(p, xb, yb)
        sq = sum(jnp.sum(jnp.square(g[n]).reshape(batch_size, -1), axis=1) for n in names)
        if task in ("grads", "norms"):
            return sq if task == "grads" else jnp.sqrt(sq)
        scale = clip / jnp.maximum(jnp.sqrt(sq), clip)
        sums = {n: jnp.tensordot(scale, g[n], axes=1) for n in names}
        if task == "clip":
            return sums
        keys = jax.random.split(key, len(names))
        return {n: sums[n] + noise_multiplier * clip * jax.random.normal(k, g[n].shape[1:])
                for n, k in zip(names, keys)}

    key = jax.random.PRNGKey(0)
    fn, args = task_fn, (params, x, y) + (
        (key, jnp.float32(common.NOISE_MULTIPLIER)) if task == "dpsgd" else ())
    if cfg["system"] == "jax_privacy":
        built = _jax_privacy(jax, jnp, loss_vec, task, clip, key)
        if isinstance(built, dict):
            return built
        fn = built[task == "dpsgd"]

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
            jax.__version__, metadata.version("jaxlib"), ", jax-privacy " + metadata.version(
                "jax-privacy") if cfg["system"] == "jax_privacy" else ""))


def _jax_privacy(jax, jnp, loss_vec, task, clip, key):
    """JAX Privacy 2.x's own clipped sum (`clipping.clipped_grad`: vmap over
    the examples, clip, sum; under the caller's jit) and, for the DP step,
    its Gaussian privatizer (`noise_addition.gaussian_privatizer`)."""
    try:
        from jax_privacy import clipping, noise_addition
    except ImportError as e:
        return {"status": "skipped", "note": "jax-privacy not installed (%s)" % e}
    clipped = clipping.clipped_grad(lambda p, xb, yb: loss_vec(p, xb, yb).sum(),
                                    l2_clip_norm=clip, batch_argnums=(1, 2))

    def dpsgd_task(p, xb, yb, key, noise_multiplier):
        g = clipped(p, xb, yb)
        privatizer = noise_addition.gaussian_privatizer(stddev=noise_multiplier * clip,
                                                        prng_key=key)
        noisy, _ = privatizer.update(g, privatizer.init(g))
        return noisy

    return clipped, dpsgd_task


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
