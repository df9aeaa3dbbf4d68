"""The one error adapters raise for models they cannot re-route."""


class UnsupportedModelError(ValueError):
    """The model has no router moectl can re-route, or something bypasses the routers."""
