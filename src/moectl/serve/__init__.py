"""Expert-offloading runtime: serve an MoE with only a budget of experts per layer resident."""

from moectl.serve.config import OffloadConfig
from moectl.serve.offload import OffloadedExperts, OffloadRuntime, offload
from moectl.serve.policies import parse_policy
from moectl.serve.prefetch import PrefetchConfig
from moectl.serve.store import DiskStore, ExpertStoreError, HostStore

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
