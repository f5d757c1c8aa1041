"""Examples grouped by fed ids (users): the grouping behind `group_ids`.

Microbatches group B examples into M runs of B/M consecutive ones, which
a reshape to `[M, B/M, ...]` expresses. Users group them by a fed `[B]`
id of any values, in any order and any group sizes (a singleton, or one
user holding the whole batch), and the number of users U is known only at
run time: `tf.unique` maps the ids to `0 .. U-1` (in order of first
appearance) and segment sums replace the reshape.
"""

from __future__ import annotations

import collections

import tensorflow as tf


class Segments(collections.namedtuple("Segments", ["ids", "count"])):
    """Examples grouped into U segments.

    Attributes:
      ids: `[B]` int32, example b's segment, in `0 .. U-1` (segment u is the
        u-th distinct fed id in order of first appearance, `tf.unique`'s
        order).
      count: U, an int32 scalar tensor (known only at run time).
    """

    __slots__ = ()

    @classmethod
    def from_ids(cls, group_ids):
        """Segments of a `[B]` integer tensor of arbitrary ids."""
        if group_ids.dtype not in (tf.int32, tf.int64):
            group_ids = tf.cast(group_ids, tf.int64)
        unique, idx = tf.unique(group_ids, out_idx=tf.int32)
        return cls(idx, tf.size(unique, out_type=tf.int32))

    def sum(self, t):
        """`[B, ...]` -> `[U, ...]`: row u sums the rows of segment u."""
        if isinstance(t, tf.IndexedSlices):
            t = tf.convert_to_tensor(t)
        return tf.math.unsorted_segment_sum(t, self.ids, self.count)

    def spread(self, values):
        """`[U, ...]` -> `[B, ...]`: each example gets its segment's row."""
        return tf.gather(values, self.ids)

    def sizes(self, dtype):
        """`[U]` number of examples in each segment, as `dtype`."""
        return tf.math.unsorted_segment_sum(
            tf.ones_like(self.ids, dtype=dtype), self.ids, self.count)

    def same(self, row_ids, other_row_ids, dtype):
        """`[R, S]` mask: 1 where two rows belong to one segment.

        Args:
          row_ids, other_row_ids: `[R]`, `[S]` segment of each row.
        """
        return tf.cast(tf.equal(row_ids[:, None], other_row_ids[None, :]),
                       dtype)
