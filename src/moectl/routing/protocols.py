"""What moectl asks of a routing policy, as protocols: checked with ``isinstance``, not ``hasattr``.

- :class:`RoutingPolicy` (``bind`` + ``apply``): all ``route()`` needs; ``Policy`` is its old name.
- :class:`SequencePolicy` (``fork``): keeps per-sequence state; the engine forks one per request.
- :class:`ResettablePolicy` (``reset(seed=)``): forgets its sequence state, optionally reseeded.
- :class:`SeededPolicy` (``seed`` + ``draws()``): draws from a stream seeded by ``seed``; the
  evaluator runs such a policy one request per forward (``moectl.eval.request_noise``).
- :class:`MergingPolicy` (``pending`` + ``attach``): carries trained weights that merge into the
  model (a trained controller loaded without its model); ``route()`` attaches it first.
- :class:`RoutingSource` (``routing(info)``): not a routing policy itself but names the routing
  policies it needs (a serving residency policy); ``route()`` installs those.
- :class:`RenormPolicy` (``renorm``): names its renormalisation mode (default ``"pruned"``).

moectl's policies conform structurally (tests/test_routing_protocols.py checks each class); a
user's policy needs only ``bind`` and ``apply``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pathlib import Path

    from torch import nn

    from moectl.adapters.inspect import ModelInfo
    from moectl.routing.routing_state import RoutingState


@runtime_checkable
class RoutingPolicy(Protocol):
    """A routing policy: validated once against a model, then applied to each layer's state."""

    def bind(self, info: ModelInfo) -> None:
        """Check the policy against the model (raise ``ValueError`` on mismatch); reset state."""

    def apply(self, state: RoutingState) -> None:
        """Narrow ``state.allowed`` and/or add ``state.noise`` for ``state.layer``."""


Policy = RoutingPolicy  # its name before the protocols had a module of their own


@runtime_checkable
class SequencePolicy(Protocol):
    """A policy that keeps per-sequence state (a controller's option, a document pool's running mean,
    a Gumbel generator): one instance follows one batch of sequences from its first token.

    ``fork(seed)`` returns a fresh instance with the same configuration and no sequence state (the
    shared, read-only parts, e.g. a controller's weights, are shared, not copied). The engine forks
    one per request, so a request's routing is the same whatever else is in the batch.
    Policies without sequence state (an expert mask) are shared as they are.
    """

    def fork(self, seed: int) -> RoutingPolicy:
        """A fresh instance for new sequences, its random draws seeded by ``seed``."""


@runtime_checkable
class RowConstantPolicy(Protocol):
    """A policy whose effect at a layer is the same for every token of every row it routes (an
    expert mask of one set per layer, forced/omitted experts, ``topk:N``): the engine prepares such
    routings once for the whole batch instead of calling them per layer and group."""

    def row_effect(self, layer: int) -> Any:
        """The ``RowEffect`` at MoE layer ``layer``, or None where this policy is not row-constant."""


@runtime_checkable
class ResettablePolicy(Protocol):
    """A policy whose sequence state can be forgotten in place (new sequences follow)."""

    def reset(self, seed: int | None = None) -> None:
        """Forget the sequence state; reseed the draws when ``seed`` is given."""


@runtime_checkable
class SeededPolicy(Protocol):
    """A policy whose random draws come, in call order, from one stream seeded by ``seed``.

    Setting ``seed`` takes effect at the next ``bind`` (or ``reset(seed=)`` where the policy is
    also a :class:`ResettablePolicy`)."""

    seed: int

    def draws(self) -> bool:
        """Whether ``apply`` draws from the stream at all (a greedy controller does not)."""


@runtime_checkable
class MergingPolicy(Protocol):
    """A policy loaded without its model whose trained weights still merge into it."""

    pending: Path | None  # the folder whose weights merge in at ``attach``; None once merged / none

    def attach(self, model: nn.Module) -> None:
        """Merge the pending weights into ``model`` (in place)."""


@runtime_checkable
class RoutingSource(Protocol):
    """Something that is installed as the routing policies it names (a serving residency policy)."""

    def routing(self, info: ModelInfo) -> list[Any]:
        """The routing policies to install for the model ``info`` describes ([] for the model's own)."""


@runtime_checkable
class RenormPolicy(Protocol):
    """A policy that says how the router's weights are renormalised over what it allows."""

    renorm: str  # "pruned" (over the allowed experts) or "stock" (the model's rule on the chosen set)


def renorm_of(policy: Any) -> str:
    """``policy``'s renormalisation mode; ``"pruned"`` (the default) for a policy that names none."""
    return policy.renorm if isinstance(policy, RenormPolicy) else "pruned"


def carries_weights(policy: Any) -> bool:
    """Whether ``policy`` still has trained weights to merge into its model."""
    return isinstance(policy, MergingPolicy) and policy.pending is not None
