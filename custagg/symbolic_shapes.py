"""Moved to `custagg.batch_axis.symbolic_shapes`."""
# TODO(merge): delete this shim.
# pylint: disable=unused-import,wildcard-import
from custagg.batch_axis.symbolic_shapes import *  # noqa: F401,F403
from custagg.batch_axis.symbolic_shapes import ShapeCache, Dim, product, slice_vector  # noqa
