"""Adapters: one per router family, registered by router class."""

from moectl.adapters.inspect import ModelInfo, MoELayer, UnsupportedModelError, inspect
from moectl.adapters.registry import supported_routers
from moectl.adapters.rules import RouterRule
from moectl.adapters.selftest import SelfTestResult, self_test

__all__ = [
    "MoELayer",
    "ModelInfo",
    "RouterRule",
    "SelfTestResult",
    "UnsupportedModelError",
    "inspect",
    "self_test",
    "supported_routers",
]
