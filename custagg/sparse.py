"""IndexedSlices helpers shared by the traversal's aggregation and the
per-example engines."""

from __future__ import annotations

import tensorflow as tf

from custagg._tf_compat import indexed_slices as indexed_slices_lib


def dense(g):
    """`g` as a dense Tensor (an IndexedSlices is converted; a Tensor or
    None is returned as is)."""
    if isinstance(g, indexed_slices_lib.IndexedSlices):
        return tf.convert_to_tensor(g)
    return g


def flatten_nested(g):
    """IndexedSlices whose values are IndexedSlices -> one level."""
    if isinstance(g.values, indexed_slices_lib.IndexedSlices):
        inner = flatten_nested(g.values)
        return indexed_slices_lib.IndexedSlices(
            inner.values, tf.gather(g.indices, inner.indices), g.dense_shape)
    return g


def concat_slices(slices):
    """Sum of IndexedSlices, kept sparse: rows are concatenated, not merged."""
    flat = [flatten_nested(s) for s in slices]
    # Indices may be int32 or int64; concat needs one type.
    if len(set(s.indices.dtype for s in flat)) > 1:
        flat = [indexed_slices_lib.IndexedSlices(
            s.values, tf.cast(s.indices, tf.int64), s.dense_shape)
            for s in flat]
    return indexed_slices_lib.IndexedSlices(
        tf.concat([s.values for s in flat], axis=0),
        tf.concat([s.indices for s in flat], axis=0),
        flat[0].dense_shape)
