"""A DP (or clipped) step against another step under one setting, one process.

    python -m benchmarks.dp_step MODE [--batch 256] [--repeats 9] [--models mlp,tutorial_cnn]
        [--write]

On the MLP 784-256-256-10 and TF Privacy's tutorial CNN, float32, one
thread; a configuration's steps timed interleaved (`common.interleaved`)
over the mode's base step (`_COLUMNS` has each mode's table). MODE
`tf_privacy_compare` puts custagg.privacy beside TF Privacy's own TF1
optimizers (TF <= 2.15: benchmarks/peers_env.sh's PREFIX-tf215, custagg on
the path); its parts `--parity --epsilon --timing` (all without
flags). docs/benchmarks.md says what each mode measures. --write:
benchmarks/results/MODE.{json,md} (tf_privacy_compare: the parts not run keep
their last figures).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time
from importlib import metadata

from benchmarks import common  # framework-free: before TF

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
common.legacy_keras()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import custagg  # noqa: E402
from benchmarks import memory  # noqa: E402
from custagg.app import datasets  # noqa: E402
from custagg.privacy import accounting as custagg_accounting  # noqa: E402
from custagg.privacy import dp_optimizer  # noqa: E402
from custagg.privacy.dp_query import gaussian_query  # noqa: E402
from custagg.privacy.dp_query import nested_query  # noqa: E402
from custagg.privacy.dp_query import quantile_adaptive_clip_sum_query as qa  # noqa: E402

MICROBATCH_CONFIGS = [("mlp", 512), ("tutorial_cnn", 512), ("tutorial_cnn", 256)]
QUERIES = ("fixed", "adaptive", "per_layer")
KINDS = ("aggregated", "per_example", "users_64", "users_8")
SOURCES = ("placeholder", "tf_data", "shuffle_batch_queue", "variables")
EPSILON_SETTINGS = [(60000, 256, 1.1, 60, 1e-5), (60000, 150, 1.3, 15, 1e-5),
                    (100000, 100, 1.0, 30, 1e-7), (100000000, 1024, 0.1, 10, 1e-7)]
PARTS = ("parity", "epsilon", "timing")


def tf_privacy():
    """TF Privacy's dp_optimizer and accountant modules, or None."""
    try:
        from tensorflow_privacy.privacy.analysis import compute_dp_sgd_privacy_lib  # pylint: disable=g-import-not-at-top
        from tensorflow_privacy.privacy.optimizers import dp_optimizer as tfp_optimizer  # pylint: disable=g-import-not-at-top
    except Exception:  # pylint: disable=broad-except
        return None
    return tfp_optimizer, compute_dp_sgd_privacy_lib


def systems():
    """{name: dp_optimizer module}: TF Privacy's (if importable) first, then custagg's."""
    tfp = tf_privacy()
    return dict({"tf_privacy": tfp[0]} if tfp else {}, custagg=dp_optimizer)


# Data, models and graphs.


def digits28(seed=0):
    """The bundled 8x8 digits as 28x28x1 (each pixel a 3x3 block, 2-pixel
    border), in place of MNIST's download; labels int32."""
    ds = datasets.load_digits(seed=seed)

    def up(x):
        x = np.kron(x.reshape(-1, 8, 8), np.ones((1, 3, 3), np.float32))
        return np.pad(x, ((0, 0), (2, 2), (2, 2)))[..., None].astype(np.float32)

    return (up(ds.x_train), ds.y_train.astype(np.int32), up(ds.x_test), ds.y_test.astype(np.int32))


def tutorial_cnn(features):
    """TF Privacy's tutorial model (mnist_dpsgd_tutorial_common.get_cnn_model)."""
    layers = tf.keras.layers
    y = tf.reshape(features, [-1, 28, 28, 1])
    y = layers.Conv2D(16, 8, strides=2, padding="same", activation="relu")(y)
    y = layers.MaxPool2D(2, 1)(y)
    y = layers.Conv2D(32, 4, strides=2, padding="valid", activation="relu")(y)
    y = layers.MaxPool2D(2, 1)(y)
    y = layers.Flatten()(y)
    y = layers.Dense(32, activation="relu")(y)
    return layers.Dense(10)(y)


def mlp(features):
    """MLP 784-256-256-10 (custagg's benchmark model)."""
    layers = tf.keras.layers
    y = tf.reshape(features, [-1, 784])
    y = layers.Dense(256, activation="relu")(y)
    y = layers.Dense(256, activation="relu")(y)
    return layers.Dense(10)(y)


MODELS = {"tutorial_cnn": tutorial_cnn, "mlp": mlp}


def _loss(model, xb, yb):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=MODELS[model](xb))


def batches(x, y, batch, count, seed=0):
    rng = np.random.RandomState(seed)
    return [(x[idx], y[idx]) for idx in (rng.choice(len(x), batch, replace=False)
                                         for _ in range(count))]


def _data():
    x, y, _, _ = digits28()
    return np.concatenate([x] * 2), np.concatenate([y] * 2)


class Graph(object):
    """`build()` -> ({kind: fetch}, feed(kind, xb, yb), start or None) in a
    graph of its own; a one-thread session. `start(sess)` starts queue
    threads and returns their stop function."""

    def __init__(self, build, seed=0):
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf.compat.v1.set_random_seed(seed)
            self.fetches, self.feed, start = build()
            self.sess = common.session(self.graph)
            self.sess.run([tf.compat.v1.global_variables_initializer(),
                           tf.compat.v1.local_variables_initializer()])
            self.stop = start(self.sess) if start else None

    def runner(self, kind):
        return lambda xb, yb: self.sess.run(self.fetches[kind], self.feed(kind, xb, yb))

    def peak(self, kind):
        return lambda xb, yb: memory.step_peak_bytes(
            self.sess, self.fetches[kind], self.feed(kind, xb, yb))[0]

    def close(self):
        if self.stop:
            self.stop()
        self.sess.close()


class Step(Graph):
    """One model + DP optimizer: the tutorial's optimizer call with
    `dp_module`, or `optimizer(vars)`; `run(xb, yb)` one training step."""

    def __init__(self, dp_module, model, batch, microbatches, noise, lr=0.15, seed=0,
                 optimizer=None):
        def build():
            self.x = tf.compat.v1.placeholder(tf.float32, [batch, 28, 28, 1])
            self.y = tf.compat.v1.placeholder(tf.int32, [batch])
            vector_loss = _loss(model, self.x, self.y)
            self.vars = tf.compat.v1.trainable_variables()
            # The tutorial's optimizer call, word for word.
            opt = optimizer(self.vars) if optimizer else (
                dp_module.DPGradientDescentGaussianOptimizer(
                    l2_norm_clip=1.0, noise_multiplier=noise,
                    num_microbatches=microbatches, learning_rate=lr))
            global_step = tf.compat.v1.train.get_or_create_global_step()
            self.grads = [g for g, _ in opt.compute_gradients(vector_loss, self.vars)]
            train_op = opt.apply_gradients(zip(self.grads, self.vars), global_step=global_step)
            return {"step": train_op}, lambda kind, xb, yb: {self.x: xb, self.y: yb}, None
        super(Step, self).__init__(build, seed)

    def run(self, xb, yb, fetch=None):
        return self.sess.run(self.fetches["step"] if fetch is None else fetch,
                             {self.x: xb, self.y: yb})

    def weights(self):
        return self.sess.run(self.vars)

    def set_weights(self, values):
        with self.graph.as_default():
            for v, value in zip(self.vars, values):
                v.load(value, self.sess)


def _step_times(steps, x, y, batch, repeats):
    """{key: median s} of `steps` {key: Step}, timed in turn on the same
    batches; closes them."""
    try:
        return common.interleaved({k: st.run for k, st in steps.items()},
                                  batches(x, y, batch, repeats + 1, seed=3))[0]
    finally:
        for st in steps.values():
            st.close()


def _logged(log, mode, row):
    """`row`, printed as its line of MODE's table."""
    log("  ".join("%s %s" % (head, fmt % (key(row) if callable(key) else row[key]))
                  for head, key, fmt in _COLUMNS[mode]))
    return row


# The modes: each returns rows, one per step of each configuration.


def microbatches(repeats=7, configs=MICROBATCH_CONFIGS, log=print, **_):
    x, y = _data()
    rows = []
    for model, batch in configs:
        for dynamic in (False, True):
            mbs = [batch, batch // 4, 1]
            med = _step_times({m: Step(dp_optimizer, model, None if dynamic else batch, m,
                                       noise=1.1) for m in mbs}, x, y, batch, repeats)
            rows += [_logged(log, "microbatches", dict(
                model=model, batch=batch, dynamic=dynamic, microbatches=m,
                seconds_per_step=med[m], ratio_to_m_eq_b=med[m] / med[batch])) for m in mbs]
    return rows


def make_query(kind, num_vars, batch, sigma=1.1):
    if kind == "fixed":
        return gaussian_query.GaussianSumQuery(1.0, sigma)
    if kind == "adaptive":
        return qa.QuantileAdaptiveClipSumQuery(
            initial_l2_norm_clip=1.0, noise_multiplier=sigma,
            target_unclipped_quantile=0.5, learning_rate=0.2,
            clipped_count_stddev=batch / 20.0, expected_num_records=batch)
    clip = 1.0 / np.sqrt(num_vars)
    return nested_query.NestedSumQuery(
        [gaussian_query.GaussianSumQuery(clip, clip * sigma) for _ in range(num_vars)])


def adaptive_clipping(batch=256, repeats=9, models=("mlp", "tutorial_cnn"), log=print, **_):
    x, y = _data()
    rows = []
    for model in models:
        med = _step_times({k: Step(None, model, batch, None, None, optimizer=(
            lambda xs, k=k: dp_optimizer.DPGradientDescentOptimizer(
                make_query(k, len(xs), batch), learning_rate=0.15))) for k in QUERIES},
            x, y, batch, repeats)
        rows += [_logged(log, "adaptive_clipping", dict(
            model=model, batch=batch, query=k, seconds_per_step=med[k],
            ratio_to_fixed=med[k] / med["fixed"])) for k in QUERIES]
    return rows


def user_ids(batch, users, seed=0):
    """`[batch]` int64 ids of `users` users, unequal sizes (every user at
    least one example), shuffled; ids are large values, not 0..U-1."""
    rng = np.random.RandomState(seed)
    users = min(users, batch)
    weights = 1.0 / np.arange(1, users + 1)
    extra = rng.choice(users, batch - users, p=weights / weights.sum())
    ids = np.concatenate([np.arange(users), extra])
    rng.shuffle(ids)
    return (ids * 7919 + 2 ** 40).astype(np.int64)


def _users_graph(model, batch):
    ids = {"users_64": user_ids(batch, 64, 1), "users_8": user_ids(batch, 8, 2)}

    def build():
        x = tf.compat.v1.placeholder(tf.float32, [batch, 28, 28, 1])
        y = tf.compat.v1.placeholder(tf.int32, [batch])
        g = tf.compat.v1.placeholder(tf.int64, [batch])
        loss = _loss(model, x, y)
        xs = tf.compat.v1.trainable_variables()
        dense = lambda gs: [tf.convert_to_tensor(t) for t in gs]
        users = dense(custagg.clipped_gradients(loss, xs, 1.0, group_ids=g))
        fetches = {"aggregated": dense(tf.gradients(tf.reduce_sum(loss), xs)),
                   "per_example": dense(custagg.clipped_gradients(loss, xs, 1.0)),
                   "users_64": users, "users_8": users}

        def feed(kind, xb, yb):
            out = {x: xb, y: yb}
            if kind in ids:
                out[g] = ids[kind]
            return out
        return fetches, feed, None
    return Graph(build)


def user_level_clipping(batch=256, repeats=9, models=("mlp", "tutorial_cnn"), log=print, **_):
    x, y = _data()
    rows = []
    for model in models:
        f = _users_graph(model, batch)
        med, peaks = common.interleaved({k: f.runner(k) for k in KINDS},
                                        batches(x, y, batch, repeats + 1, seed=3),
                                        {k: f.peak(k) for k in KINDS})
        f.close()
        rows += [_logged(log, "user_level_clipping", dict(
            model=model, batch=batch, kind=k, seconds=med[k],
            time_ratio=med[k] / med["aggregated"], peak_mb=memory.mb(peaks[k]),
            memory_ratio=peaks[k] / peaks["aggregated"])) for k in KINDS]
    return rows


def _source(kind, x, y, batch):
    """`(images [batch, 28, 28, 1], labels [batch], feed, start)`: `feed()`
    a run's feed dict (placeholder only), `start` as in `Graph`."""
    if kind == "placeholder":
        xp = tf.compat.v1.placeholder(tf.float32, [None, 28, 28, 1])
        yp = tf.compat.v1.placeholder(tf.int32, [None])
        rng = np.random.RandomState(3)

        def feed():
            idx = rng.choice(len(x), batch, replace=False)
            return {xp: x[idx], yp: y[idx]}
        return xp, yp, feed, None
    if kind == "tf_data":
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
            len(x), seed=3).repeat().batch(batch)
        xb, yb = tf.compat.v1.data.make_one_shot_iterator(ds).get_next()
        return xb, yb, dict, None
    if kind == "shuffle_batch_queue":
        # The TF1 tutorials' pipeline: slice_input_producer + shuffle_batch.
        xs, ys = tf.compat.v1.train.slice_input_producer([tf.constant(x), tf.constant(y)], seed=3)
        xb, yb = tf.compat.v1.train.shuffle_batch(
            [xs, ys], batch_size=batch, capacity=4 * batch,
            min_after_dequeue=2 * batch, num_threads=1, seed=3)

        def start(sess):
            coord = tf.train.Coordinator()
            threads = tf.compat.v1.train.start_queue_runners(sess, coord)
            return lambda: (coord.request_stop(), coord.join(threads, stop_grace_period_secs=10))
        return xb, yb, dict, start
    if kind == "variables":
        # A batch held in non-trainable variables (benchmarks, small-data
        # notebooks): the same batch every run.
        xv = tf.compat.v1.Variable(x[:batch], trainable=False)
        yv = tf.compat.v1.Variable(y[:batch], trainable=False)
        return tf.identity(xv), tf.identity(yv), dict, None
    raise ValueError("source must be one of %s, got %r" % (SOURCES, kind))


def _pipeline_graph(model, source, x, y, batch):
    forms = {}

    def build():
        xb, yb, feed, start = _source(source, x, y, batch)
        loss = _loss(model, xb, yb)
        xs = tf.compat.v1.trainable_variables()
        forms.update(collections.Counter(custagg.plan_per_example(loss, xs).forms()))
        return {"plain": tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
                    tf.reduce_mean(loss), var_list=xs),
                "dp": dp_optimizer.DPGradientDescentGaussianOptimizer(
                    l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=None,
                    learning_rate=0.1).minimize(loss, var_list=xs)
                }, lambda kind, xb_, yb_: feed(), start
    return Graph(build), forms


def input_pipelines(batch=256, repeats=9, models=("mlp", "tutorial_cnn"),
                    sources=SOURCES, log=print, **_):
    """Rows of `{model, source, batch, plain_s, dp_s, ratio, forms,
    plain_peak_mb, memory_ratio}`; each run draws its own batch."""
    x, y = _data()
    rows = []
    for model in models:
        for source in sources:
            s, forms = _pipeline_graph(model, source, x, y, batch)
            try:
                med, peaks = common.interleaved(
                    {k: s.runner(k) for k in ("plain", "dp")}, [(None, None)] * (repeats + 1),
                    {k: s.peak(k) for k in ("plain", "dp")})
            finally:
                s.close()
            rows.append(_logged(log, "input_pipelines", dict(
                model=model, source=source, batch=batch, plain_s=med["plain"], dp_s=med["dp"],
                ratio=med["dp"] / med["plain"], forms=dict(forms),
                plain_peak_mb=memory.mb(peaks["plain"]),
                memory_ratio=peaks["dp"] / peaks["plain"])))
    return rows


# tf_privacy_compare's parts.


def parity(steps=5, log=print):
    """Weights after `steps` noise-free steps, TF Privacy vs custagg."""
    mods = systems()
    if "tf_privacy" not in mods:
        return {"skipped": "TF Privacy is not importable here"}
    x, y, _, _ = digits28()
    rows = []
    for model, batch, mb in [("tutorial_cnn", 64, 64), ("tutorial_cnn", 64, 16),
                             ("mlp", 64, 64), ("mlp", 64, 16)]:
        runs = {name: Step(mod, model, batch, mb, noise=0.0) for name, mod in mods.items()}
        init = runs["tf_privacy"].weights()
        runs["custagg"].set_weights(init)
        for xb, yb in batches(x, y, batch, steps, seed=1):
            for r in runs.values():
                r.run(xb, yb)
        wa, wb = runs["tf_privacy"].weights(), runs["custagg"].weights()
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(wa, wb))
        moved = max(float(np.max(np.abs(a - i))) for a, i in zip(wa, init))
        # Noise std: the spread of one coordinate's gradient over draws.
        stds = {}
        for k, (name, mod) in enumerate(mods.items()):
            # Distinct graph seeds: independent noise for each system.
            noisy = Step(mod, model, batch, mb, noise=1.1, seed=10 + k)
            noisy.set_weights(init)
            xb, yb = batches(x, y, batch, 1, seed=2)[0]
            draws = np.array([noisy.run(xb, yb, noisy.grads[-1]) for _ in range(200)])
            stds[name] = float(draws.std(axis=0).mean())
            noisy.close()
        row = dict(model=model, batch=batch, microbatches=mb, steps=steps,
                   max_abs_weight_diff=diff, max_weight_change=moved,
                   noise_std=stds, noise_std_expected=1.1 * 1.0 / mb)
        log("parity %s" % row)
        rows.append(row)
        for r in runs.values():
            r.close()
    return rows


def epsilon(log=print):
    tfp = tf_privacy()
    rows = []
    for s in EPSILON_SETTINGS:
        ours, order = custagg_accounting.compute_dp_sgd_privacy(*s)
        pld, _ = custagg_accounting.compute_dp_sgd_privacy(*s, accountant="pld")
        row = dict(setting=list(s), custagg_rdp=ours, custagg_order=order, custagg_pld=pld)
        if tfp is not None:
            theirs, t_order = tfp[1].compute_dp_sgd_privacy(*s)
            row.update(tf_privacy=float(theirs), tf_privacy_order=float(t_order),
                       rel_diff=abs(ours - theirs) / theirs)
        log("epsilon %s" % row)
        rows.append(row)
    return rows


def timing(slow_limit=30.0, repeats=5, log=print):
    mods = systems()
    x, y = _data()
    rows = []
    configs = [(m, b, mb) for m in ("tutorial_cnn", "mlp") for b in (64, 256)
               for mb in (b, b // 4)]
    configs += [("mlp", 512, 512), ("mlp", 512, 128)]
    last = {}
    for model, batch, mb in configs:
        for name, mod in mods.items():
            key = (name, model, mb == batch)
            if name == "tf_privacy" and batch == 512:
                continue
            row = dict(system=name, model=model, batch=batch, microbatches=mb)
            est = last.get(key)
            if est is not None and est[1] * (batch / est[0]) ** 2 > slow_limit:
                row["skipped"] = "estimated > %gs" % slow_limit
            else:
                t0 = time.perf_counter()
                step = Step(mod, model, batch, mb, noise=1.1)
                row["build_seconds"] = time.perf_counter() - t0
                sec = row["seconds_per_step"] = _step_times({0: step}, x, y, batch, repeats)[0]
                last[key] = (batch, sec)
            log("time %s" % row)
            rows.append(row)
    return rows


def tf_privacy_markdown(result):
    def noise(r):
        std = r["noise_std"]
        return "%.5f / %.5f / %.5f" % (std["tf_privacy"], std["custagg"], r["noise_std_expected"])

    def pick(key, fmt):
        return lambda r: fmt % r[key] if key in r else "-"
    lines = ["# custagg.privacy vs TF Privacy 0.9.0 (one process)", "",
             "`%s`; %s." % (result["command"], result["machine"]), ""]
    if isinstance(result.get("parity"), list):
        lines += ["## Parity (noise off, same weights and batches)", "", common.table([
            ("model", "model", "%s"), ("B", "batch", "%d"), ("M", "microbatches", "%d"),
            ("steps", "steps", "%d"), ("max abs weight diff", "max_abs_weight_diff", "%.1e"),
            ("noise std tfp / custagg / expected", noise, "%s")], result["parity"])]
    if result.get("epsilon"):
        lines += ["## epsilon (compute_dp_sgd_privacy)", "", common.table(
            [(h, lambda r, i=i: r["setting"][i], "%s")
             for i, h in enumerate(("n", "B", "sigma", "epochs", "delta"))]
            + [("TF Privacy", pick("tf_privacy", "%.6g"), "%s"),
               ("custagg RDP", "custagg_rdp", "%.6g"),
               ("rel diff", pick("rel_diff", "%.1e"), "%s"),
               ("custagg PLD", "custagg_pld", "%.6g")], result["epsilon"])]
    if result.get("timing"):
        cells = {(r["model"], r["batch"], r["microbatches"], r["system"]): r
                 for r in result["timing"]}
        rows = []
        for model, b, mb in sorted({k[:3] for k in cells}, key=lambda k: (k[0], k[1], -k[2])):
            t, c = (cells.get((model, b, mb, s), {}) for s in ("tf_privacy", "custagg"))
            ts, cs = t.get("seconds_per_step"), c.get("seconds_per_step")
            rows.append([model, b, mb, "%.4f" % ts if ts else t.get("skipped", "-"),
                         "%.4f" % cs if cs else c.get("skipped", "-"),
                         "%.0fx" % (ts / cs) if ts and cs else "-"])
        lines += ["## Seconds per DP-SGD step (median, 1 thread)", "", common.md_table(
            ["model", "B", "M", "TF Privacy", "custagg", "ratio"], rows, ["---"] + ["---:"] * 5)]
        mlp = {r["microbatches"]: r.get("seconds_per_step") for r in result["timing"]
               if r["system"] == "custagg" and r["model"] == "mlp" and r["batch"] == 512}
        if mlp.get(512) and mlp.get(128):
            lines += ["custagg MLP B=512: M=B/4 step / M=B step = %.2fx (timed one after the "
                      "other on a shared machine; `python -m benchmarks.dp_step microbatches` "
                      "times them interleaved: benchmarks/results/microbatches.md)."
                      % (mlp[128] / mlp[512]), ""]
    return "\n".join(lines)


# Tables: (header, key or fn(row), format) per column.

_COLUMNS = {
    "microbatches": [
        ("model", "model", "%s"), ("B", "batch", "%d"),
        ("batch dim", lambda r: "dynamic" if r["dynamic"] else "static", "%s"),
        ("M", "microbatches", "%d"), ("s/step", "seconds_per_step", "%.4f"),
        ("/ (M = B)", "ratio_to_m_eq_b", "%.2fx")],
    "adaptive_clipping": [
        ("model", "model", "%s"), ("B", "batch", "%d"), ("query", "query", "%s"),
        ("s/step", "seconds_per_step", "%.4f"), ("ratio to fixed", "ratio_to_fixed", "%.2fx")],
    "user_level_clipping": [
        ("model", "model", "%s"), ("B", "batch", "%d"), ("gradient", "kind", "%s"),
        ("s", "seconds", "%.4f"), ("time ratio", "time_ratio", "%.2fx"),
        ("peak MB", "peak_mb", "%.1f"), ("memory ratio", "memory_ratio", "%.2fx")],
    "input_pipelines": [
        ("model", "model", "%s"), ("source", "source", "%s"), ("B", "batch", "%d"),
        ("plain s", "plain_s", "%.4f"), ("DP step s", "dp_s", "%.4f"),
        ("DP / plain", "ratio", "%.2fx"), ("peak DP / plain", "memory_ratio", "%.2fx"),
        ("forms", lambda r: ", ".join("%s %d" % kv for kv in sorted(r["forms"].items())), "%s")],
}
MODES = collections.OrderedDict((m, globals()[m]) for m in _COLUMNS)


def markdown(mode, rows):
    return common.table(_COLUMNS[mode], rows)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.dp_step",
                                description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=list(MODES) + ["tf_privacy_compare"])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, help="default 9 (microbatches: 7)")
    p.add_argument("--models", default="mlp,tutorial_cnn")
    p.add_argument("--write", action="store_true", help="write benchmarks/results/MODE.*")
    for part in PARTS:
        p.add_argument("--" + part, action="store_true", help="tf_privacy_compare: this part")
    p.add_argument("--slow-limit", type=float, default=30.0, help="tf_privacy_compare --timing")
    p.add_argument("--json", action="store_true", help="tf_privacy_compare: print the result "
                   "as JSON on the last line")
    args = p.parse_args(argv)
    tf.compat.v1.disable_eager_execution()
    if args.mode == "tf_privacy_compare":
        return compare_with_tf_privacy(args, argv)
    args.repeats = args.repeats or (7 if args.mode == "microbatches" else 9)
    rows = MODES[args.mode](batch=args.batch, repeats=args.repeats,
                            models=tuple(args.models.split(",")))
    if args.write:
        meta = dict(tf=tf.__version__, python=platform.python_version(), repeats=args.repeats)
        common.write_outputs(args.mode, dict(meta=meta, rows=rows), "%s\n\nTF %s, %s.\n" % (
            markdown(args.mode, rows).rstrip("\n"), tf.__version__,
            "median of %d interleaved runs, one thread%s" % (
                args.repeats, "; peak from one traced run" if "memory_ratio" in rows[0] else "")))
    return 0


def compare_with_tf_privacy(args, argv):
    """The tf_privacy_compare mode: its parts' rows; --write:
    results/tf_privacy_compare.*, the parts not run this time kept."""
    parts = [k for k in PARTS if getattr(args, k)] or list(PARTS)
    log = (lambda s: print(s, file=sys.stderr)) if args.json else print
    result = dict(
        command="python -m benchmarks.dp_step " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        machine="%s, %d cores; python %s; tensorflow %s; tensorflow-privacy %s; custagg %s" % (
            platform.processor() or platform.machine(), os.cpu_count(),
            platform.python_version(), tf.__version__,
            metadata.version("tensorflow-privacy") if tf_privacy() else "absent", custagg.__version__))
    for part in parts:
        result[part] = (timing(slow_limit=args.slow_limit, log=log) if part == "timing" else
                        globals()[part](log=log))
    if args.write:
        path = os.path.join(common.RESULTS, "tf_privacy_compare.json")
        if os.path.exists(path):
            with open(path) as f:
                old = json.load(f)
            for k in PARTS:
                if k not in result and k in old:
                    result[k] = old[k]
                    result.setdefault("commands", {})[k] = old.get(
                        "commands", {}).get(k, old["command"])
        common.write_outputs("tf_privacy_compare", result, tf_privacy_markdown(result))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
