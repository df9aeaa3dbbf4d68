"""Routing policies (mask, document pool, Gumbel-top-k), the session that installs them, the trace."""

from moectl.routing.gumbel import GumbelTopK
from moectl.routing.mask import ExpertMask
from moectl.routing.pool import DocumentPool
from moectl.routing.session import RoutingSession, route
from moectl.routing.state import Policy, RouteContext, RoutingState
from moectl.routing.trace import RoutingTrace

__all__ = [
    "DocumentPool",
    "ExpertMask",
    "GumbelTopK",
    "Policy",
    "RouteContext",
    "RoutingSession",
    "RoutingState",
    "RoutingTrace",
    "route",
]
