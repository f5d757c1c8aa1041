"""Built-in per-example rules; importing this package registers them.

One module per op family:
  batch_norm FusedBatchNormV3 scale and offset (inference mode)
  bilinear   MatMul, BatchMatMulV2/V3, Einsum
  broadcast  BiasAdd, AddV2/Add/Sub/Mul with a parameter broadcast over the batch
  conv       Conv2D (Conv1D goes through it), DepthwiseConv2dNative
  gather     ResourceGather, GatherV2 (embedding tables, kept sparse)
  sparse_segments SparseSegmentSum/Mean/SqrtN (feature columns' sparse
             embedding lookups)
"""

from custagg.rules import batch_norm  # noqa: F401
from custagg.rules import bilinear  # noqa: F401
from custagg.rules import broadcast  # noqa: F401
from custagg.rules import conv  # noqa: F401
from custagg.rules import gather  # noqa: F401
from custagg.rules import sparse_segments  # noqa: F401
