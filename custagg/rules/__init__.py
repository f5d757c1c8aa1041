"""Built-in per-example rules; importing this package registers them.

One module per op family:
  batch_norm FusedBatchNormV3 scale and offset (inference mode)
  bilinear   MatMul, BatchMatMulV2/V3, Einsum
  broadcast  BiasAdd, AddV2/Add/Sub/Mul with a parameter broadcast over the batch
  conv       the convolution rules' shared forms and chunks (ConvBase)
  conv2d     the Conv2D rule (Conv1D goes through it)
  depthwise  the DepthwiseConv2dNative rule
  conv_views Conv2D and DepthwiseConv2dNative (space-to-batch rows of
             dilated convolutions included), Conv2DBackpropInput
             (transposed convolutions' filters)
  conv3d     Conv3D
  gather     ResourceGather, GatherV2 (embedding tables, kept sparse);
             its rows and repeated-id norms in gather_norms, nce_loss's
             split of the sampled rows in gather_sampled
  sparse_segments SparseSegmentSum/Mean/SqrtN (feature columns' sparse
             embedding lookups)
"""

from custagg.rules import batch_norm  # noqa: F401
from custagg.rules import bilinear  # noqa: F401
from custagg.rules import broadcast  # noqa: F401
from custagg.rules import conv  # noqa: F401
from custagg.rules import conv3d  # noqa: F401
from custagg.rules import conv_views  # noqa: F401
from custagg.rules import gather  # noqa: F401
from custagg.rules import sparse_segments  # noqa: F401
