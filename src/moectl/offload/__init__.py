"""The expert-offloading runtime (below `engine/`): serve an MoE with only a budget of experts per layer resident."""

from moectl.offload.expert_store import DiskStore, ExpertStoreError, HostStore
from moectl.offload.offload_config import OffloadConfig
from moectl.offload.prefetch import PrefetchConfig
from moectl.offload.residency import parse_policy
from moectl.offload.runtime import OffloadedExperts, OffloadRuntime, offload

__all__ = [
    "DiskStore",
    "ExpertStoreError",
    "HostStore",
    "OffloadConfig",
    "OffloadRuntime",
    "OffloadedExperts",
    "PrefetchConfig",
    "offload",
    "parse_policy",
]
