"""Moved to `custagg.batch_axis.rowwise`."""
# TODO(merge): delete this shim.
# pylint: disable=unused-import,wildcard-import
from custagg.batch_axis.rowwise import *  # noqa: F401,F403
from custagg.batch_axis.rowwise import _Interpreter  # noqa: F401  (tests)
from custagg.batch_axis.rowwise import NotProved, Rows, Dims, SAME, SIZE  # noqa
