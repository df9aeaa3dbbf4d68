"""What a routing policy sees and changes: the context of a forward call and one layer's state."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

from moectl.adapters.rules import Renorm, RouterRule
from moectl.routing.protocols import Policy, SequencePolicy  # noqa: F401  (their import path before protocols.py)


@dataclass
class RouteContext:
    """The forward call being routed: batch shape, absolute offset, valid (non-padding) tokens.

    ``offset`` is the number of positions already in the KV cache (0 for a fresh sequence);
    the call covers absolute positions ``offset .. offset + T - 1``. Where the rows are different
    sequences (the engine's batch), ``offsets`` [B] gives each row's own count of tokens seen, and
    ``row_codes`` [B] each row's key for draws keyed by request (``moectl.eval.request_noise``).
    """

    batch: int = 0
    length: int = 0
    offset: int = 0
    valid: Tensor | None = None  # [B, T] bool; None: every token is valid
    calls: int = 0  # forward calls since the session started
    offsets: Tensor | None = None  # [B] int64 tokens each row has seen before this call; None: ``offset``
    row_codes: Tensor | None = None  # [B] int64 32-bit keys of the rows' requests; None: the policy's own

    def valid_mask(self, device: torch.device) -> Tensor:
        if self.valid is None:
            return torch.ones(self.batch, self.length, dtype=torch.bool, device=device)
        return self.valid.to(device)


@dataclass(frozen=True)
class RowEffect:
    """What a policy does at one MoE layer to every token of the rows it routes, whatever their
    position, logits or history (``RowConstantPolicy``): experts allowed [E] and forced [E] (bool, or
    None), experts per token (``topk:N``, or None), the renormalisation of a restriction."""

    allowed: Tensor | None = None
    forced: Tensor | None = None
    top_k: int | None = None
    renorm: Renorm = "pruned"

    def then(self, later: RowEffect) -> RowEffect:
        """This effect followed by ``later``'s, as ``apply`` would compose them on one state."""
        allowed = self.allowed if later.allowed is None else later.allowed if self.allowed is None else self.allowed & later.allowed
        forced = self.forced if later.forced is None else later.forced if self.forced is None else self.forced | later.forced
        return RowEffect(
            allowed, forced, later.top_k if later.top_k is not None else self.top_k,
            later.renorm if later.allowed is not None else self.renorm,
        )  # fmt: skip


@dataclass
class RoutingState:
    """One MoE layer's routing inputs during one forward call, as policies leave them.

    ``logits`` [B, T, E] are the router's raw output (float32) and ``probs`` its distribution
    p = rule.probs(logits). ``hidden`` is the router's input (TE-MoE's controller state h_t). Policies narrow ``allowed`` ([B, T, E] bool, or None for all) and add
    to ``noise`` (on the logits used for choosing only).
    """

    layer: int
    logits: Tensor
    rule: RouterRule
    ctx: RouteContext
    allowed: Tensor | None = None
    noise: Tensor | None = None
    renorm: Renorm = "pruned"
    restrictions: int = 0  # how many policies narrowed ``allowed`` (one alone was checked at bind)
    forced: Tensor | None = None  # [B, T, E] bool: experts chosen first (``force``), or None
    top_k: int | None = None  # experts chosen per token (``topk:N``), or None: the rule's
    row_top_k: dict[int, Tensor] | None = None  # per row where rows differ: N -> rows [n] (the engine's)
    replayed: Tensor | None = None  # [B, T, k] int64: each token's experts as given (``replay``); -1: the router's
    hidden: Tensor | None = None  # [B, T, H] the router's input h_t (pre-MLP hidden state), as the model holds it
    extras: dict = field(default_factory=dict)

    @cached_property
    def probs(self) -> Tensor:
        """[B, T, E] the router's distribution p (computed on first use)."""
        return self.rule.probs(self.logits)

    def restrict(self, allowed: Tensor, renorm: Renorm | None = None) -> None:
        """Intersect the allowed set with ``allowed`` (broadcastable to [B, T, E])."""
        allowed = allowed.to(self.logits.device).expand_as(self.logits)
        self.allowed = allowed if self.allowed is None else self.allowed & allowed
        self.restrictions += 1
        if renorm is not None:
            self.renorm = renorm

    def force(self, forced: Tensor) -> None:
        """Have the experts of ``forced`` (broadcastable to [B, T, E]) chosen first."""
        forced = forced.to(self.logits.device).expand_as(self.logits)
        self.forced = forced if self.forced is None else self.forced | forced

    def replay(self, experts: Tensor) -> None:
        """Fix the experts of the tokens ``experts`` [B, T, k] covers (rows of -1: not covered)."""
        self.replayed = experts.to(self.logits.device)

    def add_noise(self, noise: Tensor) -> None:
        self.noise = noise if self.noise is None else self.noise + noise
