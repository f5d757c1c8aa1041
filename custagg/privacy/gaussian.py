"""The Gaussian sampler of every custagg DP noise draw: Box-Muller over
TF's stateless uniforms, a pure function of a `[2]` seed (`noise.NoiseStream`
supplies the seeds), and its in-place form that adds the draw into a tensor
piece by piece with the same values (docs/privacy.md, "The sampler").

Public through `custagg.privacy.noise` (`stateless_gaussian`,
`add_stateless_gaussian`, `joint_gaussian`).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = ["add_stateless_gaussian", "joint_gaussian", "stateless_gaussian"]


# Dtypes drawn by Box-Muller over stateless uniforms (float16 and bfloat16
# in float32, then cast); float64 keeps TF's kernel, faster there.
_BOX_MULLER_DTYPES = (tf.float32, tf.float16, tf.bfloat16)


def stateless_gaussian(shape, seed, stddev=1.0, dtype=tf.float32):
    """`N(0, stddev^2)` noise of `shape`, a pure function of `seed`: the
    sampler of every custagg DP noise draw.

    float32 (float16 and bfloat16: drawn in float32, then cast): Box-Muller
    over two `[h]` `tf.random.stateless_uniform` draws `u, v` (23-bit, in
    [0, 1)), h = ceil(n/2), n the number of values, from the two seeds
    `tf.random.experimental.stateless_split(seed, 2)`: with `r = stddev
    sqrt(-2 log(1 - u))`, the noise is the first n of `concat([r cos(2 pi
    v), r sin(2 pi v)])` in `shape`. TF's `stateless_normal` runs the same
    transform on the same kind of uniforms one pair at a time inside its
    kernel; as separate element-wise ops it costs 6.8 ns per value against
    TF's 12.4 drawn alone on one thread, 4.5 against 6.5 on two, less
    inside a DP step (`docs/privacy.md`, "The sampler"). `1 - u` lies in
    [2^-23, 1], so no log of zero: |noise| <= 5.65 stddev, as with TF's
    kernel (which clamps u at 1e-7: 5.68).

    float64: `tf.random.stateless_normal` itself (a Box-Muller in float64
    ops measured 30 ns per value against its 25).

    Args:
      shape: a list of ints, a `TensorShape` (fully defined) or a 1-D int
        tensor.
      seed: a `[2]` int32/int64 tensor, as `tf.random.stateless_normal`'s.
      stddev: a number or scalar tensor.
      dtype: a floating dtype.

    Returns:
      A `shape` tensor of `dtype`.

    Raises:
      TypeError: `dtype` not floating.
      ValueError: `shape` a `TensorShape` with unknown dims, or `seed` not
        of shape `[2]`.
    """
    dtype = tf.as_dtype(dtype)
    if not dtype.is_floating:
        raise TypeError("stateless_gaussian: `dtype` must be a floating dtype "
                        "(float16, bfloat16, float32 or float64), got %s."
                        % dtype.name)
    if isinstance(shape, tf.TensorShape) and not shape.is_fully_defined():
        raise ValueError("stateless_gaussian: `shape` %s has unknown dims; "
                         "pass a 1-D int tensor (tf.shape(t)) for a shape "
                         "known at run time." % shape)
    seed = _checked_seed(seed, "stateless_gaussian")
    if dtype not in _BOX_MULLER_DTYPES:
        # A Python number straight to dtype: tf.cast would round it via
        # float32.
        stddev = (tf.cast(stddev, dtype) if tf.is_tensor(stddev) else
                  tf.constant(stddev, dtype))
        return tf.random.stateless_normal(
            shape, seed=seed, stddev=stddev, dtype=dtype)
    static = tf.get_static_value(shape) if tf.is_tensor(shape) else shape
    try:
        dims = [int(d) for d in static]
    except (TypeError, ValueError):   # a dynamic shape (or dims)
        dims = None
    if dims is not None:
        out_shape = dims
        n = int(np.prod(dims, dtype=np.int64))
        half = [(n + 1) // 2]
    else:
        out_shape = tf.cast(tf.convert_to_tensor(shape), tf.int64)
        n = tf.reduce_prod(out_shape)
        half = tf.reshape((n + 1) // 2, [1])
    # Two seeds split from one: the radii's uniforms and the angles'.
    seeds = tf.random.experimental.stateless_split(seed, 2)
    z = _box_muller(
        tf.random.stateless_uniform(half, seed=seeds[1], dtype=tf.float32),
        lambda: tf.random.stateless_uniform(half, seed=seeds[0],
                                            dtype=tf.float32),
        stddev)
    if dims is None or n % 2:
        z = z[:n]
    z = tf.reshape(z, out_shape)
    return z if dtype == tf.float32 else tf.cast(z, dtype)


def _checked_seed(seed, fn):
    """`seed` as a tensor; a ValueError naming `fn` unless its shape fits
    `[2]`."""
    seed = tf.convert_to_tensor(seed)
    if not seed.shape.is_compatible_with([2]):
        raise ValueError("%s: `seed` must be a [2] int tensor, as "
                         "tf.random.stateless_normal's, got shape %s."
                         % (fn, seed.shape))
    return seed


def joint_gaussian(shapes, seed, stddev, dtype):
    """One `stateless_gaussian` draw of `[P]` values (P the shapes' total
    size) split into pieces of `shapes`, in order.

    Args:
      shapes: 1-D int tensors or lists of ints.
      seed, stddev, dtype: as for `stateless_gaussian`.
    """
    # One int dtype: an IndexedSlices' dense_shape may be int64 where a
    # tensor's shape is int32 (add_n and split mix none).
    shapes = [tf.cast(s, tf.int64) for s in shapes]
    sizes = [tf.reduce_prod(s) for s in shapes]
    total = tf.add_n(sizes) if len(sizes) > 1 else sizes[0]
    flat = stateless_gaussian([total], seed, stddev, dtype)
    return [tf.reshape(piece, s)
            for piece, s in zip(tf.split(flat, sizes), shapes)]


def _box_muller(v, draw_u, stddev):
    """`[2h]` `N(0, stddev^2)` values from two `[h]` float32 uniforms in
    [0, 1), `v` and `draw_u()`: the first h are `r cos(a)`, the last h
    `r cos(a - pi/2) = r sin(a)`, with `r = stddev sqrt(-2 log(1 - u))`,
    `a = 2 pi v`.

    One cos over the `[2, h]` angles that a broadcast subtraction makes,
    scaled by `r` in place. u is drawn once the angles exist (a control
    dependency), so the draw holds the angles and r at most (1.5n values;
    r made first would be live beside v and the angles: 2n).
    """
    angles = (2.0 * np.pi) * v - tf.constant([[0.0], [0.5 * np.pi]])
    with tf.control_dependencies([angles]):
        u = draw_u()
    # 1 - u lies in [2^-23, 1]: no log of zero.
    r = tf.sqrt(-2.0 * tf.math.log(1.0 - u)) * tf.cast(stddev, tf.float32)
    return tf.reshape(tf.cos(angles) * r, [-1])


def add_stateless_gaussian(t, seed, stddev=1.0):
    """`t + stateless_gaussian(tf.shape(t), seed, stddev, t.dtype)`, the same
    values bit for bit, added into `t`'s buffer piece by piece where it can.

    The whole draw holds its angles and radii beside `t` (2.5 values per
    value of `t` at its peak: the MLP's DP step at B = 32 peaked at twice
    its plain step). For a float32 graph tensor whose size has a suitable
    row length (`_pieces`), each piece of the draw is computed and added
    before the next is drawn, so the peak holds `t` and one piece's
    temporaries.

    In place, safely: the first piece is written by a
    `TensorStridedSliceUpdate`, which takes `t`'s buffer when nothing else
    holds it and copies it otherwise; the `InplaceAdd`s of the others then
    write to a buffer no other op reads (the seed goes through a stateful
    `DeepCopy`, so Grappler never folds that update into a constant). Not
    under XLA (`jit_compile`): `InplaceAdd` has no XLA kernel, and no
    gradient.

    Bit for bit: each piece computes its uniforms, angles and radii as the
    whole draw does, on ranges that start on a 64-value boundary and end
    on one or at the array's end, so every element takes the same kernel
    path (SIMD packets or the scalar tail) as in the whole draw; a range's
    uniforms come from Philox's counter advanced to its start
    (`_counters`). Any other tensor (or eagerly): the whole draw, added.

    Args:
      t: a tensor.
      seed, stddev: as for `stateless_gaussian`.

    Returns:
      A tensor of `t`'s shape and dtype.

    Raises:
      ValueError: `seed` not of shape `[2]`.
    """
    t = tf.convert_to_tensor(t)
    seed = _checked_seed(seed, "add_stateless_gaussian")
    pieces = None if tf.executing_eagerly() or t.dtype != tf.float32 \
        else _pieces(t.shape.num_elements())
    if pieces is None:
        return t + stateless_gaussian(tf.shape(t), seed, stddev, t.dtype)
    row, bounds = pieces
    half = t.shape.num_elements() // 2
    starts = [start for start, _ in bounds]
    # A stateful copy of the seed: no graph rewrite folds the first piece's
    # update into a constant (whose buffer the InplaceAdds would then write
    # into at every run: a constant t and seed did) or merges two calls.
    seed = tf.raw_ops.DeepCopy(x=seed)
    seeds = tf.random.experimental.stateless_split(seed, 2)
    radii, angles = _counters(seeds[0], starts), _counters(seeds[1], starts)
    out = tf.reshape(t, [2, half // row, row])
    for k, (start, stop) in enumerate(bounds):
        # Each piece is drawn once the one before it is in: one piece's
        # temporaries live at a time.
        with tf.control_dependencies([out]):
            v = _uniform(angles, k, stop - start)
        z = tf.reshape(_box_muller(v, lambda: _uniform(radii, k, stop - start),
                                   stddev), [2, -1, row])
        if k == 0:
            out = tf.raw_ops.TensorStridedSliceUpdate(
                input=out, begin=[0, 0, 0], end=[2, stop // row, row],
                strides=[1, 1, 1], value=out[:, :stop // row] + z)
            out = tf.reshape(out, [-1, row])
            continue
        first = np.arange(start // row, stop // row, dtype=np.int32)
        out = tf.raw_ops.InplaceAdd(
            x=out, i=np.concatenate([first, first + half // row]),
            v=tf.reshape(z, [-1, row]))
    return tf.reshape(out, t.shape)


# The pieces of `add_stateless_gaussian` after the first cover at most
# about this many values each (both halves), or a sixteenth of the tensor
# where that is more: their temporaries, about 1.5 times as many values,
# stay small beside it, and a large tensor is not cut into more than about
# 16 pieces (each one ~15 ops).
_PIECE_VALUES = 1 << 16
# Piece bounds are multiples of this many values (every SIMD packet size).
_ALIGN = 64
# The row length of the `InplaceAdd`s lies in this range: rows of fewer
# values cost a kernel call each for little; the first piece (a strided
# slice update, 2-3 ns per value against 0.9 for `InplaceAdd`) spans one
# row, or the least multiple of `_ALIGN` it divides.
_ROWS = (256, 1024)
_INT64_MIN = np.int64(-(1 << 63))


def _pieces(n):
    """`(row, [(start, stop), ...])`: the half-index ranges of
    `add_stateless_gaussian`'s pieces over `[n]` values (piece `[start,
    stop)` covers those indices of both halves of the whole draw's `[2,
    n/2]` array), all multiples of `row`, which divides n/2; or None: n
    None or odd, n/2 with no divisor in `_ROWS` whose least common multiple
    with `_ALIGN` (the first piece) is at most `2 * _ROWS[1]`, or too few
    values for two pieces after the first."""
    if n is None or n % 2:
        return None
    half = n // 2
    row = next((c for c in range(_ROWS[1], _ROWS[0] - 1, -1)
                if half % c == 0 and np.lcm(c, _ALIGN) <= 2 * _ROWS[1]),
               None)
    if row is None:
        return None
    first = int(np.lcm(row, _ALIGN))
    # After the first piece, as few pieces as the size allows, of even
    # sizes (multiples of `first`): no remainder piece of a few rows.
    units, most = (half - first) // first, max(_PIECE_VALUES, n // 16) // 2
    count = -(-units // max(1, most // first))
    if count < 2:
        return None
    starts = [0] + [first + first * (units * j // count) for j in range(count)]
    return row, list(zip(starts, starts[1:] + [half]))


def _counters(seed, starts):
    """`(key, [P, 2] counters, alg)`: Philox's key and algorithm as
    `tf.random.stateless_uniform(shape, seed)` derives them, and its
    counter advanced to each value index of `starts` (`_advanced`)."""
    key, counter, alg = tf.raw_ops.StatelessRandomGetKeyCounterAlg(seed=seed)
    return key, _advanced(counter, starts), alg


def _advanced(counter, starts):
    """`[P, 2]` uint64: the 128-bit `[2]` uint64 counter (low word first)
    advanced by `starts[i] / 4` steps (Philox gives 4 values per step;
    starts are multiples of 4), the carry into the high word taken as
    unsigned."""
    counter = tf.bitcast(counter, tf.int64)
    low = counter[0] + np.asarray(starts, np.int64) // 4
    carry = tf.cast(tf.bitwise.bitwise_xor(low, _INT64_MIN) <
                    tf.bitwise.bitwise_xor(counter[0], _INT64_MIN), tf.int64)
    return tf.bitcast(tf.stack([low, counter[1] + carry], 1), tf.uint64)


def _uniform(state, k, size):
    """`size` float32 uniforms of `tf.random.stateless_uniform` from value
    index `starts[k]` of `_counters(seed, starts)` (`state`) on."""
    key, counters, alg = state
    return tf.raw_ops.StatelessRandomUniformV2(
        shape=[size], key=key, counter=counters[k], alg=alg,
        dtype=tf.float32)
