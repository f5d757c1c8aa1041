"""PyTorch peers: torch.func vmap(grad) and Opacus, on the same weights and data.

The models are nn.Modules built from standard layers where Opacus has a
per-sample rule (Linear, Conv2d, Embedding, LayerNorm); the LSTM cell, the
GRU's two kernels (the whole recurrence, one module), the Keras LSTM/GRU,
norule_rnn and the positional embedding are small custom modules (Opacus falls back to its functorch path
for them). Weights are copied from the TF-layout numpy arrays
(`models.init_params`) and per-example gradients are mapped back to TF layout
before the check.

Floor (same process): plain module, loss.sum().backward().
"""
import numpy as np

from benchmarks import common, models


def _build_module(torch, model):
    nn = torch.nn
    F = torch.nn.functional

    class LSTMKernel(nn.Module):
        """The LSTM's affine map in TF layout: [x_t, h] @ kernel [D+H, 4H] + bias.

        One input on purpose: Opacus's functorch fallback calls a module with
        a single activation. Called once per time step (weights shared).
        """

        def __init__(self):
            super().__init__()
            self.kernel = nn.Parameter(torch.zeros(models.LSTM_IN + models.LSTM_HIDDEN,
                                                   4 * models.LSTM_HIDDEN))
            self.bias = nn.Parameter(torch.zeros(4 * models.LSTM_HIDDEN))

        def forward(self, xh):
            return xh @ self.kernel + self.bias

    class GRUKernels(nn.Module):
        """The GRU's affine maps in TF layout (`models._tf_gru`): x_t @ kernel
        [D, 3H] + bias and h @ recurrent [H, 3H], split into z, r, n."""

        def __init__(self):
            super().__init__()
            h = models.LSTM_HIDDEN
            self.kernel = nn.Parameter(torch.zeros(models.LSTM_IN, 3 * h))
            self.recurrent = nn.Parameter(torch.zeros(h, 3 * h))
            self.bias = nn.Parameter(torch.zeros(3 * h))

        def forward(self, x):
            h = x.new_zeros(x.shape[0], models.LSTM_HIDDEN)
            for t in range(models.LSTM_STEPS):
                xz, xr, xn = (x[:, t] @ self.kernel + self.bias).chunk(3, dim=1)
                hz, hr, hn = (h @ self.recurrent).chunk(3, dim=1)
                z = torch.sigmoid(xz + hz)
                r = torch.sigmoid(xr + hr)
                n = torch.tanh(xn + r * hn)
                h = (1.0 - z) * n + z * h
            return h

    class KerasRNN(nn.Module):
        """tf.keras LSTM / GRU(reset_after=True) in Keras's layout: kernel
        [D, kH], recurrent_kernel [H, kH], bias [kH] (GRU: [2, 3H])."""

        def __init__(self, kind):
            super().__init__()
            self.kind = kind
            h = models.LSTM_HIDDEN
            k = 4 if kind == "lstm" else 3
            self.kernel = nn.Parameter(torch.zeros(models.LSTM_IN, k * h))
            self.recurrent_kernel = nn.Parameter(torch.zeros(h, k * h))
            self.bias = nn.Parameter(torch.zeros(k * h) if kind == "lstm"
                                     else torch.zeros(2, k * h))

        def forward(self, x):
            h = x.new_zeros(x.shape[0], models.LSTM_HIDDEN)
            c = h
            for t in range(models.LSTM_STEPS):
                if self.kind == "lstm":
                    z = x[:, t] @ self.kernel + h @ self.recurrent_kernel + self.bias
                    i, f, g, o = z.chunk(4, dim=1)
                    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                    h = torch.sigmoid(o) * torch.tanh(c)
                else:
                    xz, xr, xh = (x[:, t] @ self.kernel + self.bias[0]).chunk(3, dim=1)
                    rz, rr, rh = (h @ self.recurrent_kernel + self.bias[1]).chunk(3, dim=1)
                    z = torch.sigmoid(xz + rz)
                    r = torch.sigmoid(xr + rr)
                    h = z * h + (1.0 - z) * torch.tanh(xh + r * rh)
            return h

    class NoRuleRNN(nn.Module):
        """`models._tf_norule_rnn`: elementwise kernel, leaky state and
        prototype readout, all inside the step loop."""

        def __init__(self):
            super().__init__()
            self.center = nn.Parameter(torch.zeros(models.LSTM_IN))
            self.power = nn.Parameter(torch.zeros(models.LSTM_IN))
            self.protos = nn.Parameter(torch.zeros(models.NUM_CLASSES, models.LSTM_IN))

        def forward(self, x):
            h = x.new_zeros(x.shape[0], models.LSTM_IN)
            acc = x.new_zeros(x.shape[0], models.NUM_CLASSES)
            for t in range(models.LSTM_STEPS):
                k = (1.0 / (1.0 + (x[:, t] - self.center) ** 2)) ** self.power
                h = 0.5 * h + 0.5 * torch.tanh(k - 0.5)
                acc = acc - ((h[:, None, :] - self.protos) ** 2).sum(dim=2)
            return acc * (1.0 / models.LSTM_STEPS)

    class PositionalEmbedding(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(models.TR_LEN, models.TR_DIM))

        def forward(self, h):
            return h + self.weight

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            if model == "softmax":
                self.dense = nn.Linear(784, 10)
            elif model == "mlp":
                self.l1, self.l2, self.l3 = nn.Linear(784, 256), nn.Linear(256, 256), nn.Linear(256, 10)
            elif model == "cnn":
                self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
                self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
                self.dense = nn.Linear(7 * 7 * 32, 10)
            elif model == "text":
                self.emb = nn.Embedding(models.TEXT_VOCAB, models.TEXT_DIM)
                self.dense = nn.Linear(models.TEXT_DIM, 10)
            elif model == "lstm":
                self.cell = LSTMKernel()
                self.dense = nn.Linear(models.LSTM_HIDDEN, 10)
            elif model == "gru":
                self.cell = GRUKernels()
                self.dense = nn.Linear(models.LSTM_HIDDEN, 10)
            elif model == "norule_rnn":
                self.net = NoRuleRNN()
            elif model in ("keras_lstm", "keras_gru"):
                self.cell = KerasRNN(model[len("keras_"):])
                self.dense = nn.Linear(models.LSTM_HIDDEN, 10)
            elif model == "transformer":
                d = models.TR_DIM
                self.tok = nn.Embedding(models.TR_VOCAB, d)
                self.pos = PositionalEmbedding()
                self.ln1 = nn.LayerNorm(d, eps=models.LN_EPS)
                self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
                self.o = nn.Linear(d, d)
                self.ln2 = nn.LayerNorm(d, eps=models.LN_EPS)
                self.ff1, self.ff2 = nn.Linear(d, models.TR_FF), nn.Linear(models.TR_FF, d)
                self.out = nn.Linear(d, 10)

        def forward(self, x):
            if model == "softmax":
                return self.dense(x)
            if model == "mlp":
                return self.l3(F.relu(self.l2(F.relu(self.l1(x)))))
            if model == "cnn":
                # A permuted NHWC batch with C=1 has channels_last strides, so
                # conv1's output is channels_last, and Opacus 1.6's conv2
                # per-sample gradients are then wrong (sum of grad_sample !=
                # grad). .contiguous() keeps those strides (C=1 counts as
                # contiguous); a clone in contiguous_format does not.
                h = x.permute(0, 3, 1, 2).clone(memory_format=torch.contiguous_format)
                h = F.max_pool2d(F.relu(self.conv1(h)), 2)
                h = F.max_pool2d(F.relu(self.conv2(h)), 2)
                # Flatten in NHWC order, as TF does.
                return self.dense(h.permute(0, 2, 3, 1).reshape(h.shape[0], -1))
            if model == "text":
                return self.dense(self.emb(x).mean(dim=1))
            if model == "lstm":
                h = x.new_zeros(x.shape[0], models.LSTM_HIDDEN)
                c = h
                for t in range(models.LSTM_STEPS):
                    i, f, g, o = self.cell(torch.cat([x[:, t], h], dim=1)).chunk(4, dim=1)
                    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                    h = torch.sigmoid(o) * torch.tanh(c)
                return self.dense(h)
            if model in ("gru", "keras_lstm", "keras_gru"):
                return self.dense(self.cell(x))
            if model == "norule_rnn":
                return self.net(x)
            return self._transformer(x)

        def _transformer(self, x):
            n, t, d, nh = x.shape[0], models.TR_LEN, models.TR_DIM, models.TR_HEADS
            dh = d // nh
            h = self.pos(self.tok(x))
            a = self.ln1(h)
            q, k, v = (m(a).reshape(n, t, nh, dh) for m in (self.q, self.k, self.v))
            w = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh), dim=-1)
            att = torch.einsum("bhqk,bkhd->bqhd", w, v).reshape(n, t, d)
            h = h + self.o(att)
            h = h + self.ff2(F.relu(self.ff1(self.ln2(h))))
            return self.out(h.mean(dim=1))

    return Net()


# TF name -> (torch parameter name, layout transform: "" | "T" | "conv").
_MAPPING = {
    "softmax": {"w": ("dense.weight", "T"), "b": ("dense.bias", "")},
    "mlp": {"w1": ("l1.weight", "T"), "b1": ("l1.bias", ""), "w2": ("l2.weight", "T"),
            "b2": ("l2.bias", ""), "w3": ("l3.weight", "T"), "b3": ("l3.bias", "")},
    "cnn": {"conv1_w": ("conv1.weight", "conv"), "conv1_b": ("conv1.bias", ""),
            "conv2_w": ("conv2.weight", "conv"), "conv2_b": ("conv2.bias", ""),
            "dense_w": ("dense.weight", "T"), "dense_b": ("dense.bias", "")},
    "text": {"emb": ("emb.weight", ""), "dense_w": ("dense.weight", "T"),
             "dense_b": ("dense.bias", "")},
    "lstm": {"kernel": ("cell.kernel", ""), "bias": ("cell.bias", ""),
             "dense_w": ("dense.weight", "T"), "dense_b": ("dense.bias", "")},
    "gru": {"kernel": ("cell.kernel", ""), "recurrent": ("cell.recurrent", ""),
            "bias": ("cell.bias", ""), "dense_w": ("dense.weight", "T"),
            "dense_b": ("dense.bias", "")},
    "keras_lstm": {"kernel": ("cell.kernel", ""), "recurrent_kernel": ("cell.recurrent_kernel", ""),
                   "bias": ("cell.bias", ""), "dense_w": ("dense.weight", "T"),
                   "dense_b": ("dense.bias", "")},
    "keras_gru": {"kernel": ("cell.kernel", ""), "recurrent_kernel": ("cell.recurrent_kernel", ""),
                  "bias": ("cell.bias", ""), "dense_w": ("dense.weight", "T"),
                  "dense_b": ("dense.bias", "")},
    "norule_rnn": {"center": ("net.center", ""), "power": ("net.power", ""),
                   "protos": ("net.protos", "")},
    "transformer": {"tok_emb": ("tok.weight", ""), "pos_emb": ("pos.weight", ""),
                    "ln1_g": ("ln1.weight", ""), "ln1_b": ("ln1.bias", ""),
                    "wq": ("q.weight", "T"), "wk": ("k.weight", "T"), "wv": ("v.weight", "T"),
                    "wo": ("o.weight", "T"), "bo": ("o.bias", ""),
                    "ln2_g": ("ln2.weight", ""), "ln2_b": ("ln2.bias", ""),
                    "w1": ("ff1.weight", "T"), "b1": ("ff1.bias", ""),
                    "w2": ("ff2.weight", "T"), "b2": ("ff2.bias", ""),
                    "out_w": ("out.weight", "T"), "out_b": ("out.bias", "")},
}


def _to_torch_layout(value, transform):
    if transform == "T":
        return value.T
    if transform == "conv":               # HWIO -> OIHW
        return value.transpose(3, 2, 0, 1)
    return value


def _to_tf_layout(value, transform, batched):
    """Inverse of _to_torch_layout for a numpy array (with a leading B if batched)."""
    off = 1 if batched else 0
    if transform == "T":
        axes = list(range(value.ndim))
        axes[off], axes[off + 1] = axes[off + 1], axes[off]
        return value.transpose(axes)
    if transform == "conv":               # OIHW -> HWIO
        return value.transpose(list(range(off)) + [off + 2, off + 3, off + 1, off])
    return value


def make_module(torch, model):
    module = _build_module(torch, model)
    state = {}
    for name, value in models.init_params(model).items():
        tname, transform = _MAPPING[model][name]
        state[tname] = torch.from_numpy(np.ascontiguousarray(_to_torch_layout(value, transform)))
    module.load_state_dict(state, strict=True)
    return module


def _tf_names(model):
    return [s.name for s in models.param_specs(model)]


def run(cfg):
    import torch
    torch.manual_seed(0)
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    model, batch_size, task, system = cfg["model"], cfg["batch_size"], cfg["task"], cfg["system"]
    sig = common.load_signature(cfg["ref_path"])
    clip = float(sig["clip"])
    names = _tf_names(model)
    mapping = _MAPPING[model]
    x_np, y_np = models.make_batch(model, batch_size)
    x = torch.from_numpy(x_np).long() if x_np.dtype == np.int32 else torch.from_numpy(x_np)
    y = torch.from_numpy(y_np).long()
    ce = torch.nn.functional.cross_entropy

    floor_module = make_module(torch, model)

    def floor_fn():
        floor_module.zero_grad(set_to_none=True)
        ce(floor_module(x), y, reduction="none").sum().backward()

    runner = {"torch_func": _torch_func, "opacus": _opacus, "opacus_ghost": _opacus_ghost}[system](
        torch, model, task, make_module(torch, model), x, y, clip, batch_size)
    if isinstance(runner, dict):
        return runner
    timed_fn, check_fn, build_s, version = runner

    floor_fn()
    first_run_ms = common.timed_ms(timed_fn)
    kind, out = check_fn()
    if kind == "per_example":
        values = common.signature_of_per_example(
            names, [_to_tf_layout(out[mapping[n][0]], mapping[n][1], True) for n in names])
    elif kind == "norms":
        values = {"norms": out}
    else:
        values = {"csum/" + n: _to_tf_layout(out[mapping[n][0]], mapping[n][1], False)
                  for n in names}
    return common.measured(
        sig, values, timed_fn, floor_fn, cfg, first_run_ms,
        lambda: (_profiled_peak_bytes(torch, floor_fn), _profiled_peak_bytes(torch, timed_fn)),
        build_s=build_s, floor_system="torch loss.sum().backward()",
        peak_method="torch.profiler profile_memory=True: running sum of [memory] events",
        framework_version="torch %s%s" % (torch.__version__, version))


def _profiled_peak_bytes(torch, fn):
    """Peak bytes allocated during one call of `fn`, from PyTorch's profiler:
    with `profile_memory=True` every CPU allocation and free is a "[memory]"
    event (bytes, negative for a free, time stamp); the peak of their running
    sum in time order is the step's peak above what was live before it (as
    TF's figure from its allocation records). None if the profiler's events
    are not available in this torch build."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                  if e.name() == "[memory]"]
    except Exception:  # pragma: no cover - depends on the torch build
        return None
    live = peak = 0
    for _, nbytes in sorted(events, key=lambda e: (e[0], e[1] < 0)):
        live += nbytes
        peak = max(peak, live)
    return peak


def _sumsq(torch, grads, batch_size):
    return sum(g.reshape(batch_size, -1).pow(2).sum(1) for g in grads)


def _torch_func(torch, model, task, module, x, y, clip, batch_size):
    from torch.func import functional_call, grad, vmap
    ce = torch.nn.functional.cross_entropy
    params = {k: v.detach() for k, v in module.named_parameters()}

    def loss_one(p, xi, yi):
        return ce(functional_call(module, p, (xi[None],)), yi[None], reduction="sum")

    per_example = vmap(grad(loss_one), in_dims=(None, 0, 0))
    state = {}

    def timed_fn():
        g = per_example(params, x, y)
        sq = _sumsq(torch, g.values(), batch_size)
        if task == "grads":
            state["out"] = sq
        elif task == "norms":
            state["out"] = sq.sqrt()
        elif task == "clip":
            scale = clip / sq.sqrt().clamp(min=clip)
            state["out"] = {k: torch.tensordot(scale, v, dims=1) for k, v in g.items()}
        else:
            scale = clip / sq.sqrt().clamp(min=clip)
            noise = state.get("noise", common.NOISE_MULTIPLIER) * clip
            state["out"] = {k: torch.tensordot(scale, v, dims=1) + noise * torch.randn(v.shape[1:])
                            for k, v in g.items()}
        return state["out"]

    def check_fn():
        if task == "grads":
            return "per_example", {k: v.numpy() for k, v in per_example(params, x, y).items()}
        if task == "norms":
            return "norms", timed_fn().numpy()
        state["noise"] = 0.0
        out = timed_fn()
        del state["noise"]
        return "csum", {k: v.numpy() for k, v in out.items()}

    return timed_fn, check_fn, None, ""


def _opacus(torch, model, task, module, x, y, clip, batch_size):
    try:
        import opacus
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer
    except ImportError as e:
        return {"status": "skipped", "note": "opacus not installed (%s)" % e}
    import time
    ce = torch.nn.functional.cross_entropy
    t0 = time.perf_counter()
    gsm = GradSampleModule(module, batch_first=True, loss_reduction="sum")
    opt = None
    if task in ("clip", "dpsgd"):
        opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.0),
                          noise_multiplier=common.NOISE_MULTIPLIER, max_grad_norm=clip,
                          expected_batch_size=batch_size, loss_reduction="sum")
    build_s = time.perf_counter() - t0
    named = [(k[len("_module."):] if k.startswith("_module.") else k, p)
             for k, p in gsm.named_parameters()]

    def backward():
        gsm.zero_grad(set_to_none=True)
        ce(gsm(x), y, reduction="none").sum().backward()

    def timed_fn():
        if task in ("clip", "dpsgd"):   # clip: the optimizer's clipped sum, noise 0
            opt.zero_grad(set_to_none=True)
            ce(gsm(x), y, reduction="none").sum().backward()
            opt.step()
            return None
        backward()
        sq = _sumsq(torch, [p.grad_sample for _, p in named], batch_size)
        return sq if task == "grads" else sq.sqrt()

    def check_fn():
        if task == "grads":
            backward()
            return "per_example", {k: p.grad_sample.detach().numpy().copy() for k, p in named}
        if task == "norms":
            return "norms", timed_fn().detach().numpy()
        opt.noise_multiplier = 0.0
        timed_fn()
        opt.noise_multiplier = _noise(task)
        return "csum", {k: p.grad.detach().numpy().copy() for k, p in named}

    return timed_fn, check_fn, build_s, ", opacus " + opacus.__version__


def _noise(task):
    return common.NOISE_MULTIPLIER if task == "dpsgd" else 0.0


def _opacus_ghost(torch, model, task, module, x, y, clip, batch_size):
    """Opacus 1.6 ghost clipping, as `PrivacyEngine.make_private(...,
    grad_sample_mode="ghost")` wires it: GradSampleModuleFastGradientClipping
    (ghost norms where a layer has them, per-sample gradients elsewhere),
    DPOptimizerFastGradientClipping and the loss wrapper whose backward()
    runs the two passes (norms, then the clip-weighted gradient)."""
    if task not in ("clip", "dpsgd"):
        return {"status": "skipped", "note": "opacus_ghost runs clip and dpsgd only"}
    try:
        import opacus
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
    except ImportError as e:
        return {"status": "skipped", "note": "opacus (>= 1.5) not installed (%s)" % e}
    import time
    t0 = time.perf_counter()
    gsm = GradSampleModuleFastGradientClipping(module, batch_first=True, loss_reduction="sum",
                                               max_grad_norm=clip, use_ghost_clipping=True)
    opt = DPOptimizerFastGradientClipping(torch.optim.SGD(gsm.parameters(), lr=0.0),
                                          noise_multiplier=_noise(task), max_grad_norm=clip,
                                          expected_batch_size=batch_size, loss_reduction="sum")
    criterion = DPLossFastGradientClipping(gsm, opt, torch.nn.CrossEntropyLoss(reduction="sum"),
                                           loss_reduction="sum")
    build_s = time.perf_counter() - t0
    named = [(k[len("_module."):] if k.startswith("_module.") else k, p)
             for k, p in gsm.named_parameters()]

    def timed_fn():
        opt.zero_grad(set_to_none=True)
        criterion(gsm(x), y).backward()
        if task == "dpsgd":
            opt.step()

    def check_fn():
        opt.noise_multiplier = 0.0
        opt.zero_grad(set_to_none=True)
        criterion(gsm(x), y).backward()
        opt.step()
        opt.noise_multiplier = _noise(task)
        return "csum", {k: p.grad.detach().numpy().copy() for k, p in named}

    return timed_fn, check_fn, build_s, ", opacus %s (ghost)" % opacus.__version__
