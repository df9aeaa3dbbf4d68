"""moectl: control expert routing in Mixture-of-Experts language models."""

from moectl.adapters import ModelInfo, UnsupportedModelError, inspect, self_test, supported_routers
from moectl.models.tiny import FAMILIES, tiny
from moectl.routing import DocumentPool, ExpertMask, GumbelTopK, RoutingTrace, route

__version__ = "0.1.0"

__all__ = [
    "FAMILIES",
    "DocumentPool",
    "ExpertMask",
    "GumbelTopK",
    "ModelInfo",
    "RoutingTrace",
    "UnsupportedModelError",
    "inspect",
    "route",
    "self_test",
    "supported_routers",
    "tiny",
]
