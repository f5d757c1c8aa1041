"""Where the examples are: ONE batch-axis table and the analyses on it.

* `table`: one `Entry` per op type: per (op, input index, input batch
  descriptor) -> the outputs' descriptors, `MIXES` or `NO_BATCH`, read
  forward (`forward`) and backward (`sources.inverse`); and, where the
  batch size flows, the row-wise proof's values (`size_rule`).
* `proof_values`: those values (`Rows`, `Dims`, `SAME`, `SIZE`, ...).
* `separation`: the forward walk (`coupling`: do examples stay apart from
  a tensor to the loss; `walk_body` inside loop bodies; `propagate`: the
  table plus v2 loops).
* `sources`: the batch sources, inferred backward from axis 0 of the loss
  (`infer`, `batch_region`); the ops that may read fed data at all, found
  forward from the feeds (`data_region`).
* `rowwise`: the proof that the forward pass is row-wise (for the
  per-example copies).
* `symbolic_shapes`: dimensions as products of symbols, for reshapes.

Imports go one way: `custagg.graph` <- `proof_values` <- `table` <-
`separation` <- `sources`, `rowwise`.
"""

from custagg.batch_axis.rowwise import NotProved
from custagg.batch_axis.rowwise import Unexplained
from custagg.batch_axis.rowwise import prove as prove_rowwise
from custagg.batch_axis.separation import coupling
from custagg.batch_axis.separation import propagate
from custagg.batch_axis.separation import step
from custagg.batch_axis.separation import walk_body
from custagg.batch_axis.sources import BatchAxes
from custagg.batch_axis.sources import batch_region
from custagg.batch_axis.sources import brings_data
from custagg.batch_axis.sources import data_region
from custagg.batch_axis.sources import infer
from custagg.batch_axis.sources import inverse
from custagg.batch_axis.sources import is_leaf
from custagg.batch_axis.sources import no_sources_reason
from custagg.batch_axis.sources import untraced
from custagg.batch_axis.table import ELEMENTWISE
from custagg.batch_axis.table import MIXES
from custagg.batch_axis.table import NO_BATCH
from custagg.batch_axis.table import Folded
from custagg.batch_axis.table import ListOf
from custagg.batch_axis.table import Reason
from custagg.batch_axis.table import Stacked
from custagg.batch_axis.table import forward
from custagg.batch_axis.table import known
from custagg.batch_axis.table import mixes_text
from custagg.batch_axis.table import normalize

__all__ = [
    "NotProved", "Unexplained", "untraced", "prove_rowwise", "coupling", "propagate",
    "step", "walk_body", "BatchAxes", "batch_region", "brings_data",
    "data_region", "infer", "inverse",
    "is_leaf", "no_sources_reason", "ELEMENTWISE", "MIXES", "NO_BATCH",
    "Folded", "ListOf", "Reason", "Stacked", "forward", "known", "mixes_text",
    "normalize",
]
