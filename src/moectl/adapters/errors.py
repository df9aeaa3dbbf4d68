"""The one error adapters raise for models they cannot re-route."""

from moectl.errors import MoectlError


class UnsupportedModelError(MoectlError, ValueError):
    """The model has no router moectl can re-route, or something bypasses the routers."""


class NoSuchLayerError(MoectlError, IndexError):
    """A MoE layer index the model does not have (the message names the valid range)."""
