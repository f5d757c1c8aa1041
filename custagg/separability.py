"""Moved to `custagg.batch_axis` (table, separation) and `custagg.graph`."""
# TODO(merge): delete this shim once per_example/, loop_rules and the tests
# import custagg.batch_axis and custagg.graph directly.
# pylint: disable=unused-import
from custagg.batch_axis.separation import LOOP_TYPES
from custagg.batch_axis.separation import coupling
from custagg.batch_axis.separation import propagate
from custagg.batch_axis.separation import step
from custagg.batch_axis.separation import walk_body
from custagg.batch_axis.table import MIXES
from custagg.batch_axis.table import NO_BATCH
from custagg.batch_axis.table import NO_PATH
from custagg.batch_axis.table import Folded
from custagg.batch_axis.table import ListOf
from custagg.batch_axis.table import Reason
from custagg.graph import ancestors
from custagg.graph import gradient_paths
