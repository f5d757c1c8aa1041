"""Rules for convolution filters: `Conv2D` and `DepthwiseConv2dNative`
(registered by `conv_views`, which also views transposed and space-to-batch
convolutions through them).

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
  call (see `depthwise.DepthwiseConv2dRule`).
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

def nhwc(t, data_format):
    return tf.transpose(t, [0, 2, 3, 1]) if data_format == "NCHW" else t


def hw(values, data_format):
    values = list(values)
    return values[2:4] if data_format == "NCHW" else values[1:3]


def explicit_hw_pads(op, data_format):
    """The op's explicit paddings of H and W: `[[top, bottom], [left, right]]`.

    `explicit_paddings` lists (before, after) per dimension in the op's own
    data_format order.
    """
    pads = list(op.get_attr("explicit_paddings"))
    return hw([pads[i:i + 2] for i in range(0, 8, 2)], data_format)


def fold_batch(t, data_format, channels, batch):
    """`[B, H, W, C]` (or `[B, C, H, W]`) -> `[1, H, W, B*C]`, channel b*C + c."""
    t = tf.transpose(t, [2, 3, 0, 1] if data_format == "NCHW" else [1, 2, 0, 3])
    hw = tf.shape(t)[:2]
    return tf.reshape(t, tf.concat([[1], hw, [batch * channels]], 0))


def even_chunks(most, batch):
    """Examples per chunk for `batch` examples in chunks of at most `most`:
    as few chunks as `most` allows, each of the smallest size that covers
    `batch` in that many (`ceil(batch / ceil(batch / most))`), so the last
    chunk is not a small remainder beside full ones whose temporaries set
    the peak (B = 32, at most 29: chunks of 16, not 29 and 3; the CNN's
    clipped sum at B = 32 peaked 1.0 MB lower). A Python int where both
    are, else a scalar int32 tensor; >= 1.
    """
    if isinstance(most, int) and isinstance(batch, int):
        chunks = -(-batch // max(1, most))
        return max(1, -(-batch // max(1, chunks)))
    most = tf.maximum(1, tf.cast(most, tf.int32))
    batch = tf.cast(batch, tf.int32)
    chunks = tf.maximum(1, (batch + most - 1) // most)
    return tf.maximum(1, (batch + chunks - 1) // chunks)


def folded_kernels_available():
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


class ConvView(object):
    """A convolution op as the forms see it: its attributes and filter, and
    an image (`inputs[0]`) that may be another tensor than the op's own.
    The forms read only these, so on a view they build the view's
    per-example gradients unchanged. Used for a chunk of the op's examples
    (the chunk's rows of the image) and by `conv_views` (a transposed
    convolution seen as the Conv2D it is the input gradient of; the rows
    of a space-to-batch convolution regrouped per example).

    Args:
      op: the op (or another view) whose attributes are read.
      image: the view's `inputs[0]`.
      max_batch: the view's largest batch when static (the forms size
        their temporaries by it), else None.
      filter: the view's `inputs[1]` (default: the op's).
      attrs: attribute values that replace the op's (`{"padding":
        b"VALID"}`).
      op_type: the view's op type (default: the op's).
    """

    def __init__(self, op, image, max_batch, filter=None, attrs=None,
                 op_type=None):
        self._op = op
        self.inputs = [image, op.inputs[1] if filter is None else filter]
        self.type = op_type or op.type
        self.name = op.name
        self.max_batch = max_batch
        self._attrs = dict(attrs or {})

    def get_attr(self, name):
        if name in self._attrs:
            return self._attrs[name]
        return self._op.get_attr(name)


def batch_bound(ctx):
    """The batch size the forms size their temporaries by: a chunk's
    largest size, the static B, or None."""
    bound = getattr(ctx.op, "max_batch", None)
    if bound is not None:
        return bound
    return tf.compat.dimension_value(ctx.op.inputs[0].shape[0])


def scale_rows(t, c):
    """`c_b * t[b]` for `t` `[B, ...]`, `c` `[B]`: as `[B, -1] * c[:, None]`,
    TF's fast 2-D broadcast (a rank-4 broadcasting Mul took 3x as long:
    [256, 14, 14, 32] float32, 1 thread, 3.0 against 0.9 ms)."""
    rows = tf.reshape(t, tf.stack([tf.shape(t)[0], -1]))
    return tf.reshape(rows * c[:, None], tf.shape(t))


def filter_unsupported(ctx, formats=("NHWC", "NCHW")):
    """A convolution rule's static checks: the parameter is the filter
    (input 1), of static shape, and the op's data_format one of `formats`;
    None when they pass, else the reason."""
    if ctx.input_index != 1:
        return "the parameter is the image, not the filter"
    if _outer.static_dims(ctx.param) is None:
        return "the filter shape is not static"
    fmt = ctx.op.get_attr("data_format").decode()
    if fmt not in formats:
        return "data_format %s" % fmt
    return None


class ConvBase(registry.Rule):

    def unsupported(self, ctx):
        return filter_unsupported(ctx)

    def _attrs(self, ctx):
        op = ctx.op
        fmt = op.get_attr("data_format").decode()
        strides = hw(op.get_attr("strides"), fmt)
        dilations = hw(op.get_attr("dilations"), fmt)
        padding = op.get_attr("padding").decode()
        return fmt, strides, dilations, padding

    def _patches(self, ctx):
        """`[B, P, kh*kw*Cin]` patches and `[B, P, C_out]` output gradients."""
        fmt, strides, dilations, padding = self._attrs(ctx)
        kh, kw = _outer.static_dims(ctx.param)[:2]
        x = nhwc(ctx.op.inputs[0], fmt)
        if padding == "EXPLICIT":
            x = tf.pad(x, [[0, 0]] + explicit_hw_pads(ctx.op, fmt) + [[0, 0]])
            padding = "VALID"
        patches = tf.image.extract_patches(
            x, sizes=[1, kh, kw, 1], strides=[1] + strides + [1],
            rates=[1] + dilations + [1], padding=padding)
        batch = tf.shape(x)[0]
        patches = tf.reshape(patches, [batch, -1, tf.shape(patches)[3]])
        g = nhwc(ctx.grad, fmt)
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
        x = nhwc(ctx.op.inputs[0], fmt)
        g = nhwc(ctx.grad, fmt)
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
                pads.append(explicit_hw_pads(ctx.op, fmt)[axis])
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
        out_hw = [tf.compat.dimension_value(d) for d in hw(ctx.grad.shape,
                                                             fmt)]
        image = x.shape[1:].num_elements()
        if None not in out_hw and image is not None:
            per = self._chunk_elements_per_example(
                ctx, out_hw[0] * out_hw[1], image)
            return max(1, self._CHUNK_MAX_ELEMENTS // per)
        positions = tf.reduce_prod(hw(tf.unstack(tf.shape(ctx.grad)), fmt))
        per = self._chunk_elements_per_example(
            ctx, positions, tf.reduce_prod(tf.shape(x)[1:]))
        return tf.maximum(1, self._CHUNK_MAX_ELEMENTS // per)

    def _chunk_context(self, ctx, start, stop):
        """The context of examples `start:stop`: the same op attributes and
        filter, the chunk's rows of the image and of dz, no cache."""
        size = self._chunk_size(ctx)
        chunk_op = ConvView(ctx.op, ctx.op.inputs[0][start:stop],
                            size if isinstance(size, int) else None)
        return registry.RuleContext(chunk_op, ctx.input_index,
                                    ctx.grad[start:stop], stop - start, None)

    def _over_chunks(self, ctx, fn, initial, combine, invariant):
        """Folds `fn(chunk context, start, stop)` over consecutive chunks of
        examples `start:stop` in a `tf.while_loop` that runs one chunk at a
        time (`parallel_iterations=1`), so one chunk's temporaries are live
        at a time: `combine(acc, fn(...))` from `initial`."""
        batch = tf.shape(ctx.grad)[0]
        chunk = even_chunks(self._chunk_size(ctx), tf.compat.dimension_value(
            ctx.grad.shape[0]) or batch)

        def body(start, acc):
            stop = tf.minimum(start + chunk, batch)
            part = fn(self._chunk_context(ctx, start, stop), start, stop)
            acc = combine(acc, part)
            if invariant.is_fully_defined():
                # A part of unknown static shape broadcast onto a
                # one-element accumulator leaves `[None]` (see
                # `chunk_clip_parts`): the loop needs the invariant back.
                acc = tf.reshape(acc, invariant)
            return stop, acc

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
            return self._backprop_filter(ctx, ctx.grad, x=scale_rows(x, c))
        return self._backprop_filter(ctx, scale_rows(ctx.grad, c))

    # --- clipped sums from the norms' chunks ---------------------------------

    # The chunk kernels' share of a clipped sum (`f @ kernels` and its
    # accumulation) costs a pass over the per-example kernels, about 1.6 ns
    # per filter element and example (1 thread, float32, measured at
    # [5, 5, 128, 256] and [3, 3, 64, 64]); the weighted backprop-filter
    # call it replaces costs P multiply-adds per filter element and example
    # (P output positions; 0.021-0.035 ns each, the same shapes). Below
    # this many positions the chunk loop costs more than the call it saves
    # (a DCGAN generator's 7x7 transposed convolutions, B=64: clipped sum
    # 1.24x the aggregated gradient with them in the loop, 1.02x without).
    _CHUNK_CLIP_MIN_POSITIONS = 64

    def chunk_clip_ready(self, ctx):
        """Whether a clipped sum should take this op's weighted sum from the
        per-example kernels its chunked norms build anyway
        (`chunk_clip_parts`), instead of a second backprop-filter call: not
        where the norms take the Gram form (they build no kernels), nor
        where the per-example gradients exist already (one tensordot), nor
        where the op's output positions are too few or not static (the
        pass over the kernels then costs more than the call:
        `_CHUNK_CLIP_MIN_POSITIONS`)."""
        if self.has_per_example(ctx) or self._chunk_takes_gram(ctx):
            return False
        fmt = ctx.op.get_attr("data_format").decode()
        positions = ctx.grad.shape[1:].num_elements()
        channels = tf.compat.dimension_value(
            ctx.grad.shape[1 if fmt == "NCHW" else 3])
        if positions is None or not channels:
            return False
        return positions // channels > self._CHUNK_CLIP_MIN_POSITIONS

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
        FLOPs again).

        The share has the static shape `[K]` (K the filter's size) whatever
        the chunk: it is a `tf.while_loop` variable, and a share whose
        static shape the forms leave unknown would turn a `[1]` filter's
        `[1]` sum into `[None]` after one iteration (broadcasting), which
        the loop rejects at graph construction."""
        squared, weigh = self._chunk_kernel_parts(
            self._chunk_context(ctx, start, stop))
        size = ctx.param.shape.num_elements()
        return squared, lambda f: tf.reshape(weigh(f), [size])

    def _chunk_kernel_parts(self, chunk):
        rows = tf.reshape(self._chunk_per_example(chunk),
                          tf.stack([tf.shape(chunk.grad)[0], -1]))
        return (_reduce.per_example_squared_norms(rows),
                lambda f: tf.matmul(f[None, :], rows)[0])

    def _chunked_weighted_sum(self, ctx, c):
        """`sum_b c_b G_b` from each chunk's per-example gradients."""
        return self._over_chunks(
            ctx, lambda chunk, start, stop: tf.tensordot(
                c[start:stop], self._chunk_per_example(chunk), axes=1),
            tf.zeros(_outer.static_dims(ctx.param), ctx.grad.dtype),
            lambda acc, part: acc + part, ctx.param.shape)
