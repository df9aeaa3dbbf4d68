"""Routing policies (mask, force/omit, top-k, replay, document pool, Gumbel-top-k, the option:K lens), the session that installs them, the trace,
and the one policy format (``config``: to_dict / from_dict / save; ``loader``: ``load_policy``)."""

from moectl.routing.force_omit import ForceOmit
from moectl.routing.gumbel import GumbelTopK
from moectl.routing.mask import ExpertMask
from moectl.routing.option_lens import OptionLens
from moectl.routing.policy_config import PolicyConfig, policy_types, register_policy, save_policy
from moectl.routing.policy_files import load_policy
from moectl.routing.pool import DocumentPool
from moectl.routing.protocols import (
    Policy,
    ResettablePolicy,
    RoutingPolicy,
    SeededPolicy,
    SequencePolicy,
)
from moectl.routing.replay import Replay
from moectl.routing.routing_state import RouteContext, RoutingState
from moectl.routing.session import RoutingSession, route
from moectl.routing.top_k import TopK
from moectl.routing.trace import RoutingTrace

__all__ = [
    "DocumentPool",
    "ExpertMask",
    "ForceOmit",
    "GumbelTopK",
    "OptionLens",
    "Policy",
    "PolicyConfig",
    "Replay",
    "ResettablePolicy",
    "RouteContext",
    "RoutingPolicy",
    "RoutingSession",
    "RoutingState",
    "RoutingTrace",
    "SeededPolicy",
    "SequencePolicy",
    "TopK",
    "load_policy",
    "policy_types",
    "register_policy",
    "route",
    "save_policy",
]
