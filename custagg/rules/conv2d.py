"""The rule for `Conv2D` filters (`tf.nn.conv2d`, `tf.compat.v1.layers.conv2d`;
`Conv1D` reaches it through an `ExpandDims` of its filter).

Per-example filter gradients from the window patches, the grouped (folded)
kernel call, one batched matmul per offset, or image patches; norms in
chunks with the Gram form where it is smaller; the clipped sums' chunk
kernels (`conv.ConvBase` has the shared machinery, `conv` the notes). The
rule is registered through `conv_views`, which also takes the
space-to-batch rows of dilated convolutions and transposed convolutions.
"""

from __future__ import annotations

import tensorflow as tf

from custagg.rules import conv
from custagg.rules import outer as _outer


class Conv2DRule(conv.ConvBase):
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
        than float32, or no oneDNN (see `folded_kernels_available`).
        `norms_only`: the `[B]` squared norms instead.
        """
        if not self._grouped_runs(ctx):
            return None
        fmt, strides, dilations, padding = self._attrs(ctx)
        kh, kw, cin, cout = _outer.static_dims(ctx.param)
        x = ctx.op.inputs[0]
        batch = tf.shape(x)[0]
        x = conv.fold_batch(x, fmt, cin, batch)
        g = conv.fold_batch(ctx.grad, fmt, cout, batch)
        if padding == "EXPLICIT":
            x = tf.pad(x, [[0, 0]] + conv.explicit_hw_pads(ctx.op, fmt) +
                       [[0, 0]])
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
                and conv.folded_kernels_available())

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
        if (conv.batch_bound(ctx) or 256) * positions * kh * kw * cin > \
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
        out_hw = [tf.compat.dimension_value(d) for d in conv.hw(
            ctx.grad.shape, ctx.op.get_attr("data_format").decode())]
        if None in out_hw or not self._takes_gram(ctx, out_hw[0] * out_hw[1]):
            return None
        # The patches (forward values alone) wait for dz: see
        # `outer.after_gradient`.
        with tf.control_dependencies([ctx.grad]):
            patches, g, channels_first = self._window_patches(
                ctx, any_filter=True)
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
        out_hw = [tf.compat.dimension_value(d) for d in conv.hw(
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
