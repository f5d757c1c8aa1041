"""Rules for convolution filters: `Conv2D` and `DepthwiseConv2dNative`.

A convolution is a matmul of image patches with the flattened filter:
`z[b, p, :] = patches[b, p, :] @ W.reshape(kh*kw*Cin, Cout)`, so example b's
filter gradient is `sum_p patches[b, p] (x) dz[b, p]` (the `_outer` family,
with T = the output positions).

Per-example filter gradients (Conv2D tries windows, folded, offsets,
patches in that order):

* folded: the batch folded into the channels (`[1, H, W, B*Cin]`) makes B
  separate convolutions one grouped (Conv2D) or depthwise convolution, whose
  filter gradient, one kernel call, is the B per-example gradients side by
  side. Needs TF's oneDNN CPU kernels (TF's own reject grouped filters and
  run a batch-1 depthwise gradient on one thread) and, for Conv2D, float32.
* windows: the inputs under each filter offset side by side as patches,
  one batched matmul (static H and W, patches of bounded size): fastest
  measured here.
* offsets: one batched matmul per filter offset (static H and W); for
  depthwise filters with more than a few channels this beats the folded
  call (see `DepthwiseConv2dRule`).
* patches: `tf.image.extract_patches`, then one batched matmul.

Norms and weighted sums keep memory bounded (issue 26: the whole-batch
window patches `[B, P, kh*kw*Cin]` and their slices were 2-5x the
aggregated gradient's peak):

* squared norms: the per-example gradients (or the Gram form) of one chunk
  of examples at a time, inside a `tf.while_loop` with one iteration at a
  time, the chunk sized so its temporaries stay within
  `_CHUNK_MAX_ELEMENTS`; only the `[B]` norms leave the loop. Exact: an
  example's gradient reads only its own rows of the image and of dz, so a
  chunk's slice of both gives the same per-example gradients as the whole
  batch. Inside a chunk Conv2D takes whichever is cheaper: the Gram (ghost)
  form, exact by `||A_b^T G_b||_F^2 = <A_b A_b^T, G_b G_b^T>` over output
  positions, costing `P^2 (K + Cout)` per example, or the materialized
  kernels, `P K Cout` (K = kh*kw*Cin; grouped kernel call first).
* weighted sums `sum_b c_b G_b`: ONE backprop-filter call of the op's own
  kernel, with each example's rows of the image or of dz (whichever is
  smaller) scaled by c_b. Exact: the filter gradient is a sum over examples
  of terms bilinear in example b's image and dz, so scaling either by c_b
  scales example b's term; nothing per-example is kept. Dilated filters
  (no CPU kernel for their summed gradient in TF's own kernels): each
  chunk's per-example gradients, weighted and added in the loop.
* clipped sums (`clipped_gradients`, one clip norm, no microbatches or
  user groups) skip Conv2D's weighted sum: one `tf.while_loop` over chunks
  builds every Conv2D's per-example kernels of the chunk once
  (`chunk_clip_parts`), adds their squared norms to the other variables'
  (computed before the loop), so the chunk's clip factors are final, and
  adds `sum_b f_b G_b` over the chunk (custagg/per_example/api.py,
  `_clipped_from_chunks`). The norms and a weighted backprop-filter call
  built each filter gradient twice (issue 26: mnist_deep's second
  convolution, ~15-20% of its step each time).

`Conv1D` reaches `Conv2D` through an `ExpandDims` of its filter, which the
front door follows.
"""

import os

import tensorflow as tf

from custagg import _tf_compat
from custagg.rules import registry
from custagg.rules import outer as _outer
from custagg.rules import _reduce

def _nhwc(t, data_format):
    return tf.transpose(t, [0, 2, 3, 1]) if data_format == "NCHW" else t


def _hw(values, data_format):
    values = list(values)
    return values[2:4] if data_format == "NCHW" else values[1:3]


def _explicit_hw_pads(op, data_format):
    """The op's explicit paddings of H and W: `[[top, bottom], [left, right]]`.

    `explicit_paddings` lists (before, after) per dimension in the op's own
    data_format order.
    """
    pads = list(op.get_attr("explicit_paddings"))
    return _hw([pads[i:i + 2] for i in range(0, 8, 2)], data_format)


def _fold_batch(t, data_format, channels, batch):
    """`[B, H, W, C]` (or `[B, C, H, W]`) -> `[1, H, W, B*C]`, channel b*C + c."""
    t = tf.transpose(t, [2, 3, 0, 1] if data_format == "NCHW" else [1, 2, 0, 3])
    hw = tf.shape(t)[:2]
    return tf.reshape(t, tf.concat([[1], hw, [batch * channels]], 0))


def _folded_kernels_available():
    """Whether the folded (grouped / batch-1 depthwise) form should be used.

    TF's own CPU kernels reject a Conv2D filter with fewer input channels
    than the image (a grouped convolution), and run a depthwise filter
    gradient of one image on one thread; TF's oneDNN kernels do both well.
    TF turns oneDNN on by default on x86 CPUs with AVX512-VNNI / AVX-VNNI /
    AMX and off with `TF_ENABLE_ONEDNN_OPTS=0`; this asks TF. The choice is
    made when the graph is built: set `CUSTAGG_FOLDED_CONV=0` to build
    graphs that will run where oneDNN is off (exported graphs, remote
    workers), `=1` to force the folded form.
    """
    forced = os.environ.get("CUSTAGG_FOLDED_CONV", "")
    if forced:
        if forced not in ("0", "1"):
            raise ValueError(
                "custagg: the environment variable CUSTAGG_FOLDED_CONV is %r; "
                "expected '0' (per-offset or patch forms for convolution "
                "rules), '1' (the folded form) or unset (ask TF whether its "
                "oneDNN kernels are on)." % forced)
        return forced == "1"
    return _tf_compat.is_mkl_enabled()


class _ChunkOp(object):
    """A convolution op seen on a chunk of its examples: the op's attributes
    and filter, the chunk's rows of the image (`inputs[0]`). The forms read
    only these, so they build the chunk's per-example gradients unchanged.
    `max_batch`: the chunk's largest size when static (the forms size their
    temporaries by it), else None."""

    def __init__(self, op, image, max_batch):
        self._op = op
        self.inputs = [image, op.inputs[1]]
        self.type = op.type
        self.name = op.name
        self.max_batch = max_batch

    def get_attr(self, name):
        return self._op.get_attr(name)


def _batch_bound(ctx):
    """The batch size the forms size their temporaries by: a chunk's
    largest size, the static B, or None."""
    bound = getattr(ctx.op, "max_batch", None)
    if bound is not None:
        return bound
    return tf.compat.dimension_value(ctx.op.inputs[0].shape[0])


def _scale_rows(t, c):
    """`c_b * t[b]` for `t` `[B, ...]`, `c` `[B]`: as `[B, -1] * c[:, None]`,
    TF's fast 2-D broadcast (a rank-4 broadcasting Mul took 3x as long:
    [256, 14, 14, 32] float32, 1 thread, 3.0 against 0.9 ms)."""
    rows = tf.reshape(t, tf.stack([tf.shape(t)[0], -1]))
    return tf.reshape(rows * c[:, None], tf.shape(t))


class _ConvBase(registry.Rule):

    def unsupported(self, ctx):
        if ctx.input_index != 1:
            return "the parameter is the image, not the filter"
        if _outer.static_dims(ctx.param) is None:
            return "the filter shape is not static"
        fmt = ctx.op.get_attr("data_format").decode()
        if fmt not in ("NHWC", "NCHW"):
            return "data_format %s" % fmt
        return None

    def _attrs(self, ctx):
        op = ctx.op
        fmt = op.get_attr("data_format").decode()
        strides = _hw(op.get_attr("strides"), fmt)
        dilations = _hw(op.get_attr("dilations"), fmt)
        padding = op.get_attr("padding").decode()
        return fmt, strides, dilations, padding

    def _patches(self, ctx):
        """`[B, P, kh*kw*Cin]` patches and `[B, P, C_out]` output gradients."""
        fmt, strides, dilations, padding = self._attrs(ctx)
        kh, kw = _outer.static_dims(ctx.param)[:2]
        x = _nhwc(ctx.op.inputs[0], fmt)
        if padding == "EXPLICIT":
            x = tf.pad(x, [[0, 0]] + _explicit_hw_pads(ctx.op, fmt) + [[0, 0]])
            padding = "VALID"
        patches = tf.image.extract_patches(
            x, sizes=[1, kh, kw, 1], strides=[1] + strides + [1],
            rates=[1] + dilations + [1], padding=padding)
        batch = tf.shape(x)[0]
        patches = tf.reshape(patches, [batch, -1, tf.shape(patches)[3]])
        g = _nhwc(ctx.grad, fmt)
        g = tf.reshape(g, [batch, -1, tf.shape(g)[3]])
        return patches, g

    def _offset_windows(self, ctx, channels_first=False):
        """The inputs under each filter offset, or None (dynamic H or W).

        For offset (i, j) the inputs under it at every output position are a
        strided slice of the image padded as the op pads it. Returns
        (windows, g, B, P): `kh*kw` windows `[B, P, Cin]` in (i, j) order
        (`[B, Cin, P]` with `channels_first`: the image is transposed once,
        not each window), the NHWC output gradient and the number of output
        positions P.
        """
        fmt, strides, dilations, padding = self._attrs(ctx)
        kh, kw = _outer.static_dims(ctx.param)[:2]
        x = _nhwc(ctx.op.inputs[0], fmt)
        g = _nhwc(ctx.grad, fmt)
        in_hw = [tf.compat.dimension_value(d) for d in x.shape[1:3]]
        out_hw = [tf.compat.dimension_value(d) for d in g.shape[1:3]]
        if None in in_hw or None in out_hw:
            return None
        pads = []
        for axis, (n_in, n_out, k, s, d) in enumerate(zip(
                in_hw, out_hw, (kh, kw), strides, dilations)):
            if padding == "VALID":
                pads.append([0, 0])
            elif padding == "SAME":
                total = max((n_out - 1) * s + (k - 1) * d + 1 - n_in, 0)
                pads.append([total // 2, total - total // 2])
            else:
                pads.append(_explicit_hw_pads(ctx.op, fmt)[axis])
        x = tf.pad(x, [[0, 0]] + pads + [[0, 0]])
        batch = tf.shape(x)[0]
        cin = tf.compat.dimension_value(x.shape[3])
        positions = out_hw[0] * out_hw[1]
        sh, sw = strides
        dh, dw = dilations
        if channels_first:
            x = tf.transpose(x, [0, 3, 1, 2])
        windows = []
        for i in range(kh):
            for j in range(kw):
                rows = slice(i * dh, i * dh + (out_hw[0] - 1) * sh + 1, sh)
                cols = slice(j * dw, j * dw + (out_hw[1] - 1) * sw + 1, sw)
                if channels_first:
                    windows.append(tf.reshape(x[:, :, rows, cols],
                                              [batch, cin, positions]))
                else:
                    windows.append(tf.reshape(x[:, rows, cols, :],
                                              [batch, positions, cin]))
        return windows, g, batch, positions

    def _backprop_filter(self, ctx, g, x=None):
        """The op's own filter-gradient kernel on image `x` (default: the
        op's) and output gradient `g`: `sum_b dW(x_b, g_b)`."""
        raise NotImplementedError

    # --- bounded memory: chunks of examples --------------------------------

    # Elements (of the rule's dtype) that one chunk's per-example
    # temporaries may take: 4 MB of float32. A chunk is at least one
    # example. mnist_deep (zoo, B=64 and 256, peak over the aggregated
    # gradient's): clipped sums 0.76x / 0.90x with 2, 4 or 8 MB (the peak
    # is elsewhere); keras_separable B=64 1.50x / 1.58x / 1.70x; times
    # level within this machine's noise.
    _CHUNK_MAX_ELEMENTS = 1 << 20

    def _chunk_elements_per_example(self, ctx, positions, image):
        """Temporaries of one example's per-example gradient, an upper
        bound over the forms: a copy of its image (`image` elements: the
        folded and padded forms) and of its dz (`P*Cout`), its window
        patches (`P*kh*kw*Cin`, twice while the windows are concatenated),
        its kernel (twice: built, then transposed) and its Gram matrices
        when that form is taken. P and `image` may be tensors (dynamic H,
        W)."""
        kh, kw, cin, cout = _outer.static_dims(ctx.param)
        width = kh * kw * cin
        return image + positions * cout + 2 * positions * width + \
            2 * width * cout + self._chunk_gram_elements(ctx, positions)

    def _chunk_gram_elements(self, ctx, positions):
        del ctx, positions
        return 0

    def _chunk_size(self, ctx):
        """Examples per chunk (a Python int with static output H and W, else
        a scalar int32 tensor), >= 1."""
        fmt = ctx.op.get_attr("data_format").decode()
        x = ctx.op.inputs[0]
        out_hw = [tf.compat.dimension_value(d) for d in _hw(ctx.grad.shape,
                                                             fmt)]
        image = x.shape[1:].num_elements()
        if None not in out_hw and image is not None:
            per = self._chunk_elements_per_example(
                ctx, out_hw[0] * out_hw[1], image)
            return max(1, self._CHUNK_MAX_ELEMENTS // per)
        positions = tf.reduce_prod(_hw(tf.unstack(tf.shape(ctx.grad)), fmt))
        per = self._chunk_elements_per_example(
            ctx, positions, tf.reduce_prod(tf.shape(x)[1:]))
        return tf.maximum(1, self._CHUNK_MAX_ELEMENTS // per)

    def _chunk_context(self, ctx, start, stop):
        """The context of examples `start:stop`: the same op attributes and
        filter, the chunk's rows of the image and of dz, no cache."""
        size = self._chunk_size(ctx)
        chunk_op = _ChunkOp(ctx.op, ctx.op.inputs[0][start:stop],
                            size if isinstance(size, int) else None)
        return registry.RuleContext(chunk_op, ctx.input_index,
                                    ctx.grad[start:stop], stop - start, None)

    def _over_chunks(self, ctx, fn, initial, combine, invariant):
        """Folds `fn(chunk context, start, stop)` over consecutive chunks of
        examples `start:stop` in a `tf.while_loop` that runs one chunk at a
        time (`parallel_iterations=1`), so one chunk's temporaries are live
        at a time: `combine(acc, fn(...))` from `initial`."""
        batch = tf.shape(ctx.grad)[0]
        chunk = self._chunk_size(ctx)

        def body(start, acc):
            stop = tf.minimum(start + chunk, batch)
            part = fn(self._chunk_context(ctx, start, stop), start, stop)
            return stop, combine(acc, part)

        _, acc = tf.compat.v1.while_loop(
            lambda start, _: start < batch, body, [tf.constant(0), initial],
            shape_invariants=[tf.TensorShape([]), invariant],
            parallel_iterations=1, back_prop=False,
            name="per_example_chunks")
        return acc

    def _chunk_per_example(self, ctx):
        """`[c, *filter]`: one chunk's per-example gradients."""
        return self.per_example(ctx)

    def _chunk_squared_norms(self, ctx):
        """`[c]` squared norms of one chunk's examples."""
        return _reduce.per_example_squared_norms(self._chunk_per_example(ctx))

    def squared_norms(self, ctx):
        if self.has_per_example(ctx):
            # Built anyway (the caller asked for them): reduce.
            return _reduce.per_example_squared_norms(
                self.cached_per_example(ctx))
        norms = self._over_chunks(
            ctx, lambda chunk, start, stop: self._chunk_squared_norms(chunk),
            tf.zeros([0], ctx.grad.dtype),
            lambda acc, part: tf.concat([acc, part], 0), tf.TensorShape([None]))
        return tf.reshape(norms, [ctx.batch_size] if isinstance(
            ctx.batch_size, int) else tf.shape(ctx.grad)[:1])

    def weighted_sum(self, ctx, weights):
        """`sum_b c_b G_b` (filter-shaped), nothing per-example kept."""
        c = tf.cast(weights, ctx.grad.dtype)
        if self.has_per_example(ctx):
            # Built anyway: a [B] x [B, K] product is cheaper than a pass.
            return tf.tensordot(c, self.cached_per_example(ctx), axes=1)
        _, _, dilations, _ = self._attrs(ctx)
        if max(dilations) > 1:
            # TF's own CPU backprop-filter kernels reject dilations (oneDNN's
            # float32 Conv2D ones do not; graphs may run elsewhere): the
            # per-example gradients chunk by chunk, each chunk's weighted
            # sum added.
            return self._chunked_weighted_sum(ctx, c)
        x = ctx.op.inputs[0]
        # sum_b dW(x_b, c_b g_b) = sum_b dW(c_b x_b, g_b): scale the smaller
        # (the zeros the op pads with stay zeros). Static sizes decide;
        # without them, dz.
        x_size = x.shape[1:].num_elements()
        g_size = ctx.grad.shape[1:].num_elements()
        if x_size is not None and g_size is not None and x_size < g_size:
            return self._backprop_filter(ctx, ctx.grad, x=_scale_rows(x, c))
        return self._backprop_filter(ctx, _scale_rows(ctx.grad, c))

    # --- clipped sums from the norms' chunks ---------------------------------

    def chunk_clip_ready(self, ctx):
        """Whether a clipped sum may take this op's weighted sum from the
        per-example kernels its chunked norms build anyway
        (`chunk_clip_parts`), instead of a second backprop-filter call: not
        where the norms take the Gram form (they build no kernels) nor
        where the per-example gradients exist already (one tensordot)."""
        return not self.has_per_example(ctx) and not self._chunk_takes_gram(
            ctx)

    def _chunk_takes_gram(self, ctx):
        del ctx
        return False

    def chunk_size(self, ctx):
        """Examples per chunk of `chunk_clip_parts` (int, or a scalar int32
        tensor without static output H and W), >= 1."""
        return self._chunk_size(ctx)

    def chunk_clip_parts(self, ctx, start, stop):
        """Examples `start:stop`'s squared norms `[c]` and a function of
        their clip factors `f` (`[c]`) giving their share of the clipped
        sum, `sum_b f_b G_b` flattened (filter order), from the per-example
        kernels the chunked norms build (`_chunk_kernel_parts`). The norms'
        kernels, reused, cost a `[c] x [c, K]` product where the weighted
        sum cost a filter gradient of the whole batch (about the norms'
        FLOPs again)."""
        return self._chunk_kernel_parts(self._chunk_context(ctx, start, stop))

    def _chunk_kernel_parts(self, chunk):
        rows = tf.reshape(self._chunk_per_example(chunk),
                          tf.stack([tf.shape(chunk.grad)[0], -1]))
        return (tf.reduce_sum(tf.square(rows), axis=1),
                lambda f: tf.matmul(f[None, :], rows)[0])

    def _chunked_weighted_sum(self, ctx, c):
        """`sum_b c_b G_b` from each chunk's per-example gradients."""
        return self._over_chunks(
            ctx, lambda chunk, start, stop: tf.tensordot(
                c[start:stop], self._chunk_per_example(chunk), axes=1),
            tf.zeros(_outer.static_dims(ctx.param), ctx.grad.dtype),
            lambda acc, part: acc + part, ctx.param.shape)


@registry.register_rule("Conv2D")
class Conv2DRule(_ConvBase):
    """`Conv2D` filter `[kh, kw, Cin, Cout]`; per-example `[B, kh, kw, Cin, Cout]`."""

    def _grouped_per_example(self, ctx, norms_only=False):
        """`[B, kh, kw, Cin, Cout]` from one grouped backprop-filter call.

        Folding the batch into the channels turns B images `[H, W, Cin]`
        into one `[1, H, W, B*Cin]`, and their output gradients into
        `[1, H', W', B*Cout]`. A convolution with B groups (filter
        `[kh, kw, Cin, B*Cout]`: group b reads input channels of image b
        and writes output channels of image b) is then exactly B separate
        convolutions, and its filter gradient is the B per-example filter
        gradients side by side. One kernel call at about the cost of the
        summed filter gradient, against `kh*kw` small batched matmuls (the
        offset form, 2-3x slower on a CPU) or B calls (TF's pfor converter
        loops). Returns None where the kernels cannot run it: another dtype
        than float32, or no oneDNN (see `_folded_kernels_available`).
        `norms_only`: the `[B]` squared norms instead.
        """
        if not self._grouped_runs(ctx):
            return None
        fmt, strides, dilations, padding = self._attrs(ctx)
        kh, kw, cin, cout = _outer.static_dims(ctx.param)
        x = ctx.op.inputs[0]
        batch = tf.shape(x)[0]
        x = _fold_batch(x, fmt, cin, batch)
        g = _fold_batch(ctx.grad, fmt, cout, batch)
        if padding == "EXPLICIT":
            x = tf.pad(x, [[0, 0]] + _explicit_hw_pads(ctx.op, fmt) + [[0, 0]])
            padding = "VALID"
        grouped = tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=tf.stack([kh, kw, cin, batch * cout]),
            out_backprop=g, strides=[1] + strides + [1],
            use_cudnn_on_gpu=ctx.op.get_attr("use_cudnn_on_gpu"),
            padding=padding, data_format="NHWC",
            dilations=[1] + dilations + [1])
        # [kh, kw, Cin, B*Cout], channel b*Cout + o -> [B, kh, kw, Cin, Cout].
        if norms_only == "kernel_major":
            return tf.reshape(grouped, tf.stack([kh * kw * cin, batch, cout]))
        grouped = tf.reshape(grouped, tf.stack([kh, kw, cin, batch, cout]))
        if norms_only:
            # Squares summed over every axis but B without the transpose:
            # over the leading kh*kw*Cin rows by a matmul with ones, then
            # over each example's Cout (a strided reduction over the middle
            # axes is several times slower than the transpose).
            rows = tf.reshape(grouped, tf.stack([kh * kw * cin, -1]))
            sums = tf.matmul(tf.ones([1, kh * kw * cin], rows.dtype),
                             tf.square(rows))
            return tf.reduce_sum(tf.reshape(sums, tf.stack([batch, cout])),
                                 axis=1)
        return tf.transpose(grouped, [3, 0, 1, 2, 4])

    def _grouped_runs(self, ctx):
        return (ctx.op.inputs[0].dtype.base_dtype == tf.float32
                and _folded_kernels_available())

    def _offsets_per_example(self, ctx):
        """`[B, kh, kw, Cin, Cout]` from one batched matmul per filter offset.

        Example b's gradient at offset (i, j) is `window_b^T dz_b`
        (`[Cin, Cout]`, see `_offset_windows`). This avoids
        `extract_patches`, which is slow on the CPU. Returns None without
        static spatial dims.
        """
        kh, kw, cin, cout = _outer.static_dims(ctx.param)
        found = self._offset_windows(ctx)
        if found is None:
            return None
        windows, g, batch, positions = found
        g = tf.reshape(g, [batch, positions, cout])
        parts = [tf.matmul(w, g, transpose_a=True) for w in windows]
        return tf.reshape(tf.stack(parts, axis=1),
                          [batch, kh, kw, cin, cout])

    # The windows form builds `[B, P, kh*kw*Cin]` patches; above this many
    # elements (or with a dynamic batch whose size is unknown here, judged
    # at B = 256) the per-offset matmuls keep memory down.
    _WINDOWS_MAX_ELEMENTS = 1 << 26
    # One strided slice per filter offset: with strides, or with many
    # offsets, the slices cost more than the grouped kernel call (TF
    # Privacy's tutorial CNN, 8x8 / stride 2 and 4x4 / stride 2, B=256:
    # norms 6.5x the aggregated gradient with windows, 2.3x without).
    _WINDOWS_MAX_OFFSETS = 25
    _WINDOWS_STRIDED = False

    # Up to this many input channels the windows are stacked channels-first
    # as whole [Cin, P] blocks: an NHWC concat interleaves Cin-wide pieces,
    # which cost more than the matmul (B=256, 28x28, Cin=2: 20 ms of a
    # 185 ms clipped-sum step).
    _WINDOWS_CHANNELS_FIRST_MAX = 7

    def _window_patches(self, ctx, any_filter=False):
        """(patches, g, channels_first) from the offset windows side by side,
        or None (no static spatial dims, or patches too big): patches are
        `[B, P, kh*kw*Cin]` in the filter's (i, j, c) order, or
        `[B, kh*kw*Cin, P]` when `channels_first`; g is `[B, P, Cout]`.
        `any_filter`: where the windows decline (strided or large filters),
        the patches from `extract_patches` in one op instead (channels last).
        """
        found = self._build_window_patches(ctx)
        if found is None and any_filter:
            patches, g = self._patches(ctx)
            found = (patches, g, False)
        return found

    def _build_window_patches(self, ctx):
        kh, kw, cin, cout = _outer.static_dims(ctx.param)
        _, strides, _, _ = self._attrs(ctx)
        if (max(strides) > 1 and not self._WINDOWS_STRIDED) or \
                kh * kw > self._WINDOWS_MAX_OFFSETS:
            return None
        channels_first = cin <= self._WINDOWS_CHANNELS_FIRST_MAX
        found = self._offset_windows(ctx, channels_first=channels_first)
        if found is None:
            return None
        windows, g, batch, positions = found
        if (_batch_bound(ctx) or 256) * positions * kh * kw * cin > \
                self._WINDOWS_MAX_ELEMENTS:
            return None
        g = tf.reshape(g, [batch, positions, cout])
        if channels_first:
            patches = tf.reshape(tf.stack(windows, axis=1),
                                 [batch, kh * kw * cin, positions])
        else:
            patches = tf.concat(windows, axis=2)
        return patches, g, channels_first

    def _windows_per_example(self, ctx):
        """`[B, kh, kw, Cin, Cout]` from the window patches and one batched
        matmul with dz. Measured on a 2-core x86 CPU at B=256 (28x28, Cin
        1-2, Cout 32; 32 steps, Cin 64): 10-14 ms against 14-22 ms per
        offset and 18-23 ms grouped; level at Cin 32 (5x5, 14x14).
        None without static spatial dims or when the patches are too big.
        """
        found = self._window_patches(ctx)
        if found is None:
            return None
        patches, g, channels_first = found
        per = tf.matmul(patches, g, transpose_a=not channels_first)
        return tf.reshape(per, [tf.shape(g)[0]] + _outer.static_dims(
            ctx.param))

    # The Gram form is taken when its cost times this factor is below the
    # materialized one's (tests set 0 to force it).
    _GRAM_FACTOR = 1

    def _takes_gram(self, ctx, positions):
        kh, kw, cin, cout = _outer.static_dims(ctx.param)
        width = kh * kw * cin
        return self._GRAM_FACTOR * positions * (width + cout) < width * cout

    def _gram_norms(self, ctx):
        """`[B]` squared norms `sum_{p,q} (a_p . a_q)(g_p . g_q)` over output
        positions, or None. Cheaper than materializing when there are few
        positions against the filter size, `P (kh kw Cin + Cout) < kh kw
        Cin Cout` (a conv1d over a short sequence: P=30, 3x64 -> 64)."""
        out_hw = [tf.compat.dimension_value(d) for d in _hw(
            ctx.grad.shape, ctx.op.get_attr("data_format").decode())]
        if None in out_hw or not self._takes_gram(ctx, out_hw[0] * out_hw[1]):
            return None
        patches, g, channels_first = self._window_patches(ctx,
                                                          any_filter=True)
        gram_a = tf.matmul(patches, patches, transpose_a=channels_first,
                           transpose_b=not channels_first)    # [B, P, P]
        gram_g = tf.matmul(g, g, transpose_b=True)
        return tf.reduce_sum(gram_a * gram_g, axis=[1, 2])

    def _outer(self, ctx):
        patches, g = self._patches(ctx)
        kh, kw, cin, cout = _outer.static_dims(ctx.param)
        # extract_patches orders each patch as (kh, kw, Cin).
        return _outer.Outer(patches, g,
                            _outer.layout([kh, kw, cin], [cout], None))

    def outer(self, ctx):
        """`sum_p patch_bp (x) dz_bp` over output positions p, like the
        bilinear rules: cross terms with other uses of the filter, and the
        loop rules' sum over iterations, without materializing. None when
        the image's channels are not the filter's Cin (a grouped
        convolution: a patch would mix the groups)."""
        fmt = ctx.op.get_attr("data_format").decode()
        image = ctx.op.inputs[0]
        if image.shape.rank != 4:
            return None
        channels = tf.compat.dimension_value(
            image.shape[1 if fmt == "NCHW" else 3])
        if channels != _outer.static_dims(ctx.param)[2]:
            return None
        return self._outer(ctx)

    def per_example(self, ctx):
        return self._first_form(ctx, ("windows", "grouped", "offsets"))

    def _chunk_per_example(self, ctx):
        """A chunk's per-example gradients: the grouped kernel call first
        (where it runs; mnist_deep's 5x5x32x64 layer at B=256, 1 thread:
        109 ms in chunks of 5, against 290 ms for the windows in chunks of
        1, whose NHWC concat of 32-channel pieces dominates), then the
        windows, offsets and patches."""
        return self._first_form(ctx, ("grouped", "windows", "offsets"))

    def _first_form(self, ctx, names):
        for name in names:
            per = getattr(self, "_%s_per_example" % name)(ctx)
            if per is not None:
                return per
        return self._outer(ctx).per_example()

    def _chunk_squared_norms(self, ctx):
        # The Gram form (ghost norm) where it costs less than materializing
        # (P^2 (K + C) < P K C: short sequences), else the per-example
        # gradients: both exact for the chunk's examples.
        norms = self._gram_norms(ctx)
        if norms is None:
            norms = self._grouped_per_example(ctx, norms_only=True)
        if norms is not None:
            return norms
        return super(Conv2DRule, self)._chunk_squared_norms(ctx)

    def _chunk_kernel_parts(self, chunk):
        # The grouped call's kernels as they come, `[K, c, Cout]` (K =
        # kh*kw*Cin), without the transpose to `[c, ...]`: the squares
        # summed as `_grouped_per_example`'s norms are, and `sum_b f_b G_b`
        # as one batched product `[1, c] x [K, c, Cout]`.
        kernels = self._grouped_per_example(chunk, norms_only="kernel_major")
        if kernels is None:
            return super(Conv2DRule, self)._chunk_kernel_parts(chunk)
        kh, kw, cin, cout = _outer.static_dims(chunk.param)
        rows = tf.reshape(kernels, tf.stack([kh * kw * cin, -1]))
        sums = tf.matmul(tf.ones([1, kh * kw * cin], rows.dtype),
                         tf.square(rows))
        squared = tf.reduce_sum(tf.reshape(sums, tf.stack([-1, cout])),
                                axis=1)
        return squared, lambda f: tf.reshape(
            tf.matmul(f[None, None, :], kernels), [-1])

    def _chunk_takes_gram(self, ctx):
        out_hw = [tf.compat.dimension_value(d) for d in _hw(
            ctx.grad.shape, ctx.op.get_attr("data_format").decode())]
        return None not in out_hw and self._takes_gram(ctx,
                                                       out_hw[0] * out_hw[1])

    def _chunk_gram_elements(self, ctx, positions):
        if not isinstance(positions, int) or not self._takes_gram(
                ctx, positions):
            return 0
        cout = _outer.static_dims(ctx.param)[3]
        return 2 * positions * positions + positions * cout

    def _chunk_elements_per_example(self, ctx, positions, image):
        # The grouped call (taken first where it runs, unless the Gram
        # form is) builds no patches: folded copies of the image and dz,
        # the kernels and their transpose.
        gram = isinstance(positions, int) and self._takes_gram(ctx,
                                                                positions)
        if gram or not self._grouped_runs(ctx):
            return super(Conv2DRule, self)._chunk_elements_per_example(
                ctx, positions, image)
        kh, kw, cin, cout = _outer.static_dims(ctx.param)
        return image + positions * cout + 2 * kh * kw * cin * cout

    def _backprop_filter(self, ctx, g, x=None):
        fmt, _, _, padding = self._attrs(ctx)
        op = ctx.op
        return tf.raw_ops.Conv2DBackpropFilter(
            input=op.inputs[0] if x is None else x,
            filter_sizes=tf.shape(op.inputs[1]),
            out_backprop=g, strides=op.get_attr("strides"),
            use_cudnn_on_gpu=op.get_attr("use_cudnn_on_gpu"),
            padding=padding,
            explicit_paddings=op.get_attr("explicit_paddings"),
            data_format=fmt, dilations=op.get_attr("dilations"))


@registry.register_rule("DepthwiseConv2dNative")
class DepthwiseConv2dRule(_ConvBase):
    """Depthwise filter `[kh, kw, Cin, M]`; output channel `c * M + m`.

    Example b's gradient: `sum_p patches[b, p, k, c] * dz[b, p, c, m]`,
    per-example `[B, kh, kw, Cin, M]`.
    """

    # Below this many channels (Cin * M) the folded kernel call is the
    # fastest form; above it, one batched matmul per offset (measured on a
    # 2-core x86 CPU, B=256, 28x28: Cin*M = 2: folded 0.7 ms vs 5.5 ms;
    # Cin*M = 64: 223 ms vs 89 ms).
    _FOLDED_MAX_CHANNELS = 8

    def chunk_clip_ready(self, ctx):
        # Not in the clipped sums' joint chunk loop: the loop's chunk is
        # the smallest of its convolutions', and a depthwise filter's (the
        # windows of its many channels) drags the others' down while its
        # own summed gradient is one cheap call. keras_separable B=64,
        # 1 thread, clipped sum / aggregated gradient: 2.6x with neither
        # in the loop, 2.6x with either alone, 3.2x with both.
        del ctx
        return False

    def per_example(self, ctx):
        _, _, dilations, _ = self._attrs(ctx)
        kh, kw, cin, m = _outer.static_dims(ctx.param)
        # TF's CPU depthwise backprop-filter kernels reject dilations.
        folded_ok = max(dilations) == 1 and _folded_kernels_available()
        if folded_ok and cin * m <= self._FOLDED_MAX_CHANNELS:
            return self._folded_per_example(ctx)
        per = self._offsets_per_example(ctx)
        if per is not None:
            return per
        if folded_ok:
            return self._folded_per_example(ctx)
        patches, g = self._patches(ctx)
        batch = tf.shape(patches)[0]
        patches = tf.reshape(patches, [batch, -1, kh * kw, cin])
        g = tf.reshape(g, [batch, -1, cin, m])
        per = tf.einsum("bpkc,bpcm->bkcm", patches, g)
        return tf.reshape(per, [batch, kh, kw, cin, m])

    # Per example, the stacked windows `[kh*kw, Cin, P]` up to this many
    # elements are contracted in one batched matmul; beyond it offset by
    # offset (the stack holds kh*kw copies of the image). B=256, 28x28,
    # Cin=32, M=2, 1 thread: stacked 344 ms, per offset 407 ms, per offset
    # with each window transposed 519 ms (the summed kernel: 122 ms).
    _STACKED_MAX_ELEMENTS = 1 << 18

    def _offsets_per_example(self, ctx):
        """`[B, kh, kw, Cin, M]`: channel by channel, batched matmuls
        `[B*Cin, kh*kw, P] x [B*Cin, P, M]` (all offsets at once when the
        stack is small, else one offset at a time); image and dz are
        transposed to channels-first once."""
        kh, kw, cin, m = _outer.static_dims(ctx.param)
        found = self._offset_windows(ctx, channels_first=True)
        if found is None:
            return None
        windows, g, batch, positions = found                 # [B, Cin, P]
        g = tf.transpose(tf.reshape(g, [batch, positions, cin, m]),
                         [0, 2, 1, 3])                        # [B, Cin, P, M]
        if kh * kw * cin * positions <= self._STACKED_MAX_ELEMENTS:
            per = tf.matmul(tf.stack(windows, axis=2), g)     # [B, Cin, K, M]
        else:
            per = tf.stack([tf.matmul(w[:, :, None, :], g)[:, :, 0, :]
                            for w in windows], axis=2)       # [B, Cin, K, M]
        per = tf.transpose(per, [0, 2, 1, 3])                 # [B, K, Cin, M]
        return tf.reshape(per, [batch, kh, kw, cin, m])

    def _folded_per_example(self, ctx):
        """`[B, kh, kw, Cin, M]` from one depthwise backprop-filter call.

        A depthwise convolution never mixes channels, so B images folded
        into one `[1, H, W, B*Cin]` image (channel b*Cin + c) convolved with
        a `[kh, kw, B*Cin, M]` filter are B independent convolutions; the
        filter gradient of the folded call is the per-example gradients
        side by side. Output channel (b*Cin + c)*M + m is exactly the
        folded `[1, H', W', B*Cin*M]` output gradient.
        """
        fmt, strides, dilations, padding = self._attrs(ctx)
        kh, kw, cin, m = _outer.static_dims(ctx.param)
        x = ctx.op.inputs[0]
        batch = tf.shape(x)[0]
        x = _fold_batch(x, fmt, cin, batch)
        g = _fold_batch(ctx.grad, fmt, cin * m, batch)
        explicit = []
        if padding == "EXPLICIT":
            explicit = [0, 0] + sum(_explicit_hw_pads(ctx.op, fmt), []) + [0, 0]
        folded = tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
            input=x, filter_sizes=tf.stack([kh, kw, batch * cin, m]),
            out_backprop=g, strides=[1] + strides + [1], padding=padding,
            explicit_paddings=explicit, data_format="NHWC",
            dilations=[1] + dilations + [1])
        folded = tf.reshape(folded, tf.stack([kh, kw, batch, cin, m]))
        return tf.transpose(folded, [2, 0, 1, 3, 4])

    def _backprop_filter(self, ctx, g, x=None):
        fmt, _, _, padding = self._attrs(ctx)
        op = ctx.op
        return tf.raw_ops.DepthwiseConv2dNativeBackpropFilter(
            input=op.inputs[0] if x is None else x, filter_sizes=tf.shape(op.inputs[1]),
            out_backprop=g, strides=op.get_attr("strides"), padding=padding,
            explicit_paddings=op.get_attr("explicit_paddings"),
            data_format=fmt, dilations=op.get_attr("dilations"))
