"""PyTorch peers: torch.func vmap(grad) and Opacus, on the same weights and data.

`make_module` builds `models.forward` as an nn.Module: a standard layer per
weight where Opacus has a per-sample rule (Linear, Conv2d, Embedding,
LayerNorm), the positional embedding and each recurrence (the whole loop
over time, one module) small custom modules (Opacus falls back to its
functorch path for them). Weights are copied from the TF-layout numpy arrays
(`models.init_params`) and per-example gradients are mapped back to TF
layout before the check.

Floor (same process): plain module, loss.sum().backward().
"""
import numpy as np

from benchmarks import common, models


class Ops(models.Ops):
    """`models.forward` in PyTorch on the tensors `p` (TF layout) by name."""

    def __init__(self, torch, p):
        super().__init__(p)
        F = torch.nn.functional
        self.relu, self.sigmoid, self.tanh, self.einsum = F.relu, torch.sigmoid, torch.tanh, \
            torch.einsum
        self.rsqrt, self.reciprocal = torch.rsqrt, lambda h: 1.0 / h
        self.softmax = lambda h: torch.softmax(h, dim=-1)
        self.mean = lambda h, axis, keepdims=False: h.mean(axis, keepdim=keepdims)
        self.sum = lambda h, axis: h.sum(axis)
        self.reshape = lambda h, shape: h.reshape(shape)
        self.concat = lambda hs: torch.cat(hs, dim=1)
        self.split = lambda h, n: h.chunk(n, dim=1)
        self.sqdiff = lambda h, name: (h - self.p[name]) ** 2
        self.pow = lambda h, name: h ** self.p[name]
        self.max_pool = lambda h: F.max_pool2d(h, 2)
        # A permuted NHWC batch with C=1 has channels_last strides, so conv1's
        # output is channels_last, and Opacus 1.6's conv2 per-sample gradients
        # are then wrong (sum of grad_sample != grad). .contiguous() keeps
        # those strides (C=1 counts as contiguous); a clone in
        # contiguous_format does not.
        self.images = lambda x: x.permute(0, 3, 1, 2).clone(memory_format=torch.contiguous_format)
        self.flatten = lambda h: h.permute(0, 2, 3, 1).reshape(h.shape[0], -1)  # TF's order

    def dense(self, h, w, b=None):
        return h @ self.p[w] if b is None else h @ self.p[w] + self.p[b]

    def scan(self, model, x):
        """The output (models.STATE) after the last step, a Python loop."""
        state = tuple(x.new_zeros(x.shape[0], n) for n in models.STATE[model])
        for t in range(models.LSTM_STEPS):
            state = models.step(self, model, state, x[:, t])
        return state[model == "norule_rnn"]


def make_module(torch, model):
    """`model` as an nn.Module whose layers its first call makes (below);
    `tf_names`: its parameters' TF names and layouts ("", "T", "conv")."""
    nn, params = torch.nn, models.init_params(model)

    class Custom(nn.Module):
        """TF-layout parameters by their TF names and `fn(Ops, h)` on them."""

        def __init__(self, names, fn):
            super().__init__()
            self.names, self.fn = names, fn
            for n in names:
                self.register_parameter(n, nn.Parameter(torch.zeros(params[n].shape)))

        def forward(self, h):
            return self.fn(Ops(torch, {n: getattr(self, n) for n in self.names}), h)

    class Layers(Ops):
        """The net's ops: each weight's layer, made at its first use."""

        def __init__(self, net):
            super().__init__(torch, {})
            self.net = net

        def _layer(self, key, make, names):
            """Layer `key`, made by `make()` the first time with its
            parameters `names` {torch name: (TF name, layout)} set."""
            if key not in self.net.layers:
                layer = make()
                with torch.no_grad():
                    for name, (tf_name, layout) in names.items():
                        value = params[tf_name]
                        value = (value.T if layout == "T" else value.transpose(3, 2, 0, 1)
                                 if layout == "conv" else value)            # HWIO -> OIHW
                        getattr(layer, name).copy_(torch.from_numpy(np.ascontiguousarray(value)))
                        self.net.tf_names["layers.%s.%s" % (key, name)] = (tf_name, layout)
                self.net.layers[key] = layer
            return self.net.layers[key]

        def dense(self, h, w, b=None):
            return self._layer(w, lambda: nn.Linear(*params[w].shape, bias=b is not None), dict(
                weight=(w, "T"), **({"bias": (b, "")} if b else {})))(h)

        def conv(self, h, w, b):
            k, _, c_in, c_out = params[w].shape
            return self._layer(w, lambda: nn.Conv2d(c_in, c_out, k, padding=k // 2), {
                "weight": (w, "conv"), "bias": (b, "")})(h)

        def embed(self, ids, table):
            return self._layer(table, lambda: nn.Embedding(*params[table].shape),
                               {"weight": (table, "")})(ids)

        def layer_norm(self, h, g, b):
            return self._layer(g, lambda: nn.LayerNorm(len(params[g]), eps=models.LN_EPS), {
                "weight": (g, ""), "bias": (b, "")})(h)

        def add_param(self, h, name):
            return self._layer(name, lambda: Custom([name], lambda o, h: h + o.p[name]),
                               {name: (name, "")})(h)

        def scan(self, model, x):
            names = [s.name for s in models.param_specs(model) if not s.name.startswith("dense_")]
            return self._layer("core", lambda: Custom(names, lambda o, x: o.scan(model, x)),
                               {n: (n, "") for n in names})(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers, self.tf_names, self.ops = nn.ModuleDict(), {}, Layers(self)
            self(_tensor(torch, models.make_batch(model, 1)[0]))      # makes the layers

        def forward(self, x):
            return models.forward(self.ops, model, x)
    return Net()


def _tensor(torch, value):
    return torch.from_numpy(value).long() if value.dtype == np.int32 else torch.from_numpy(value)


def _to_tf_layout(value, transform, batched):
    """A gradient (with a leading B if batched) back in TF's layout."""
    off = 1 if batched else 0
    if transform == "T":
        axes = list(range(value.ndim))
        axes[off], axes[off + 1] = axes[off + 1], axes[off]
        return value.transpose(axes)
    if transform == "conv":               # OIHW -> HWIO
        return value.transpose(list(range(off)) + [off + 2, off + 3, off + 1, off])
    return value


def run(cfg):
    import torch
    torch.manual_seed(0)
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    model, batch_size, task, system = cfg["model"], cfg["batch_size"], cfg["task"], cfg["system"]
    sig = common.load_signature(cfg["ref_path"])
    clip = float(sig["clip"])
    names = [s.name for s in models.param_specs(model)]
    x_np, y_np = models.make_batch(model, batch_size)
    x, y = _tensor(torch, x_np), torch.from_numpy(y_np).long()
    ce = torch.nn.functional.cross_entropy

    floor_module = make_module(torch, model)
    mapping = {tf: (name, layout) for name, (tf, layout) in floor_module.tf_names.items()}

    def floor_fn():
        floor_module.zero_grad(set_to_none=True)
        ce(floor_module(x), y, reduction="none").sum().backward()

    args = (torch, model, task, make_module(torch, model), x, y, clip, batch_size)
    runner = (_torch_func(*args) if system == "torch_func" else
              _opacus(*args, ghost=system == "opacus_ghost"))
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
    """Peak bytes allocated during one call of `fn`: the running sum, in time
    order, of the profiler's "[memory]" events (`profile_memory=True`; a free
    negative), as TF's figure from its allocation records. None if this
    torch build has no such events."""
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

    def timed_fn(noise=_noise(task)):
        g = per_example(params, x, y)
        sq = _sumsq(torch, g.values(), batch_size)
        if task in ("grads", "norms"):
            return sq if task == "grads" else sq.sqrt()
        scale = clip / sq.sqrt().clamp(min=clip)
        return {k: torch.tensordot(scale, v, dims=1) + noise * clip * torch.randn(v.shape[1:])
                if task == "dpsgd" else torch.tensordot(scale, v, dims=1) for k, v in g.items()}

    def check_fn():
        if task == "grads":
            return "per_example", {k: v.numpy() for k, v in per_example(params, x, y).items()}
        if task == "norms":
            return "norms", timed_fn().numpy()
        return "csum", {k: v.numpy() for k, v in timed_fn(noise=0.0).items()}

    return timed_fn, check_fn, None, ""


def _opacus(torch, model, task, module, x, y, clip, batch_size, ghost=False):
    """Opacus's hooks mode (GradSampleModule, DPOptimizer) or (`ghost`) its
    1.6 ghost clipping as `PrivacyEngine.make_private(...,
    grad_sample_mode="ghost")` wires it: GradSampleModuleFastGradientClipping
    (ghost norms where a layer has them, per-sample gradients elsewhere),
    DPOptimizerFastGradientClipping and the loss wrapper whose backward()
    runs the two passes (norms, then the clip-weighted gradient)."""
    try:
        import opacus
        from opacus import GradSampleModule, optimizers
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
    except ImportError as e:
        return {"status": "skipped", "note": "opacus (>= 1.5) not installed (%s)" % e}
    import time
    t0 = time.perf_counter()
    if ghost:
        gsm = GradSampleModuleFastGradientClipping(module, batch_first=True, loss_reduction="sum",
                                                   max_grad_norm=clip, use_ghost_clipping=True)
    else:
        gsm = GradSampleModule(module, batch_first=True, loss_reduction="sum")
    opt = None
    if task in ("clip", "dpsgd"):
        opt = (optimizers.DPOptimizerFastGradientClipping if ghost else optimizers.DPOptimizer)(
            torch.optim.SGD(gsm.parameters(), lr=0.0), noise_multiplier=_noise(task),
            max_grad_norm=clip, expected_batch_size=batch_size, loss_reduction="sum")
    if ghost:
        loss = DPLossFastGradientClipping(gsm, opt, torch.nn.CrossEntropyLoss(reduction="sum"),
                                          loss_reduction="sum")
    else:
        loss = lambda out, y: torch.nn.functional.cross_entropy(  # noqa: E731
            out, y, reduction="none").sum()
    build_s = time.perf_counter() - t0
    named = _named(gsm)

    def backward():
        (opt or gsm).zero_grad(set_to_none=True)
        loss(gsm(x), y).backward()

    def timed_fn():
        backward()
        if task == "dpsgd" or (task == "clip" and not ghost):
            opt.step()          # hooks: the optimizer makes the clipped sum
        elif task in ("grads", "norms"):
            sq = _sumsq(torch, [p.grad_sample for _, p in named], batch_size)
            return sq if task == "grads" else sq.sqrt()

    def check_fn():
        if task == "grads":
            backward()
            return "per_example", {k: p.grad_sample.detach().numpy().copy() for k, p in named}
        if task == "norms":
            return "norms", timed_fn().detach().numpy()
        opt.noise_multiplier = 0.0
        backward()
        opt.step()
        opt.noise_multiplier = _noise(task)
        return "csum", {k: p.grad.detach().numpy().copy() for k, p in named}

    return timed_fn, check_fn, build_s, ", opacus %s%s" % (opacus.__version__,
                                                          " (ghost)" if ghost else "")


def _noise(task):
    return common.NOISE_MULTIPLIER if task == "dpsgd" else 0.0


def _named(gsm):
    """An Opacus-wrapped module's (parameter name, parameter), its own names."""
    return [(k[len("_module."):] if k.startswith("_module.") else k, p)
            for k, p in gsm.named_parameters()]
