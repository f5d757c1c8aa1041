"""Graph plumbing below every analysis: walks, function lookup, copies.

Nothing here knows about batches or gradients of examples; `batch_axis`
and the per-example engine build on it. `copier` (the `Copier` of
forward-pass ops: one object per copy job, no module state) and `pfor`
(`chunked_pfor`) are imported by module. Imports go one way: `graph`
imports only TensorFlow, `custagg._tf_compat` and `custagg.op_kinds`
(the named kinds of op types: `op_kinds.V2_LOOPS` ...).
"""

from custagg.graph.functions import FunctionNotFound
from custagg.graph.functions import func_graph
from custagg.graph.functions import is_accumulator
from custagg.graph.functions import own_loop_variables
from custagg.graph.walks import ancestors
from custagg.graph.walks import blocks_gradient
from custagg.graph.walks import depth_first
from custagg.graph.walks import downstream
from custagg.graph.walks import gradient_paths
from custagg.graph.walks import has_replaced_gradient
from custagg.graph.walks import in_creation_order
from custagg.graph.walks import upstream

__all__ = [
    "FunctionNotFound", "func_graph", "is_accumulator", "own_loop_variables",
    "ancestors", "blocks_gradient",
    "depth_first", "downstream", "gradient_paths", "has_replaced_gradient",
    "in_creation_order", "upstream",
]
