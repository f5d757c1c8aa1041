"""The public path `custagg.distributed`: DP-SGD on TensorFlow's distributed
runtime, re-exported from `custagg.privacy.distributed` (where the code and
its documentation live; docs/distributed.md). This module defines nothing.
"""

from custagg.privacy.distributed import DistributedDPOptimizer
from custagg.privacy.distributed import local_cluster_spec
from custagg.privacy.distributed import sync_replicas_dp_optimizer
from custagg.privacy.distributed import wait_until_initialized
from custagg.privacy.distributed import worker_session_config

__all__ = ["DistributedDPOptimizer", "sync_replicas_dp_optimizer",
           "local_cluster_spec", "worker_session_config",
           "wait_until_initialized"]
