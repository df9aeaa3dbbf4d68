"""Routers that are a bare ``nn.Linear`` inside a remote-code MoE block (EMO's ``gate``).

A transformers-5 router is a module returning ``(logits, weights, indices)``; moectl hooks it and
replaces weights and indices. Remote-code blocks (``trust_remote_code``) often hold only
``gate = nn.Linear(hidden, experts)`` and do the routing math inline in the block's forward, so
there is no router output to replace. For such a block moectl does three things:

1. **A router to hook.** ``GateRouter`` is a thin module over the block's own gate Linear: gate →
   logits → the routed experts' logits → the block's rule (``RouterRule``) → the usual triple over
   the *routed* experts. Experts every token uses (shared, always-active) stay the block's, as a
   shared expert does in every other family. ``MoELayer.router`` is this module, so sessions,
   policies, recorders and the subset code hook and call it like any router. It lives in the
   block's ``__dict__``, outside the module tree: ``state_dict`` and ``named_modules`` are unchanged.
2. **The block uses moectl's selection.** While anything hooks the ``GateRouter`` (a routing
   session, the offloading runtime), the block's ``forward`` is replaced, as an instance
   attribute removed with the router's last hook, by the family's *driven forward*: block input →
   ``GateRouter`` (its hooks may re-route) → ``GateRouter.route`` (``finish``: routed ids mapped back
   to the block's, its shared experts added with the block's own weights) → the block's experts.
   With no hook the block runs its own code, untouched.
3. **A self-test that does not trust the replica.** ``observed_weights`` reads the weight the block
   itself gave every expert: each expert's output is replaced by a one-hot marker on its own hidden
   column, so the block's output (Σ_e w_e · expert_e) holds w_e in column e.

A family is a ``GateFamily``: the block's class name (remote-code classes load from each
checkpoint's own dynamic module, so they cannot be imported to key the registry), the rule over its
routed experts, which experts are shared, ``finish`` and the driven forward (``emo.py``: about
twenty lines per routing path). Blocks must hold their experts as an ``nn.ModuleList`` whose
weighted outputs sum to the block's output; anything else is refused.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from moectl.adapters.registry import Adapter, gate_families
from moectl.adapters.rules import RouterRule
from moectl.errors import UnsupportedModelError

# block -> its GateRouter, made once (hooks on it must outlive one inspect); keyed weakly, not kept on
# the user's block: the entry goes with the block (the router holds the block only weakly)
_ROUTERS: weakref.WeakKeyDictionary[nn.Module, GateRouter] = weakref.WeakKeyDictionary()

Finish = Callable[[nn.Module, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def _no_shared(block: nn.Module) -> list[int]:
    return []


def _unchanged(block: nn.Module, logits: Tensor, weights: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    return weights, idx


def _nothing(block: nn.Module, kept: list[int], config: Any, layer_idx: int) -> None:
    return None


@dataclass(frozen=True)
class GateFamily:
    """One remote-code MoE block with a bare gate Linear: what moectl needs to read and drive it."""

    block_class: str  # the block's class name
    adapter: Adapter  # family name; build_rule(GateRouter) reads the block (``router.block``)
    forward: Callable[[nn.Module, GateRouter, Tensor], Any]  # (block, router, block input) -> block output
    shared: Callable[[nn.Module], list[int]] = _no_shared  # expert ids every token uses, outside routing
    # (block, gate logits [N, E], routed weights [N, k], routed ids as block ids) -> the block's selection
    finish: Finish = _unchanged
    # (block, kept block ids, model config, decoder layer) after slicing: fix ids the block or config hold
    after_slice: Callable[[nn.Module, list[int], Any, int], None] = _nothing
    gate_attr: str = "gate"


class GateRouter(nn.Module):
    """The router moectl sees for a block with a bare gate Linear.

    ``forward(hidden [N, H])`` returns (routed logits [N, R], weights [N, k], routed indices [N, k]),
    indices in 0 … R − 1 over the routed experts (the block's experts without its shared ones).
    """

    def __init__(self, block: nn.Module, block_class: str) -> None:
        super().__init__()
        self.gate = getattr(block, gate_families_of(block_class).gate_attr)
        self._block = weakref.ref(block)  # not a child, not a strong reference: the block owns its router
        self.block_class = block_class
        self.logits: Tensor | None = None  # the gate's logits over all the block's experts, latest call

    @property
    def block(self) -> nn.Module:
        """The block this router routes (alive while anything uses the router)."""
        block = self._block()
        if block is None:
            raise RuntimeError("the block of this GateRouter was garbage-collected")
        return block

    @property
    def family(self) -> GateFamily:
        return gate_families_of(self.block_class)

    @property
    def rule(self) -> RouterRule:
        return self.family.adapter.build_rule(self)

    @property
    def weight(self) -> Tensor:
        """The gate's rows, as on transformers routers (controllers and teachers read and write it)."""
        return self.gate.weight

    @property
    def bias(self) -> Tensor | None:
        return self.gate.bias

    def routed_ids(self, device: torch.device | str = "cpu") -> Tensor:
        """Block expert id of each routed expert, [R]."""
        return _routed_ids(int(self.gate.out_features), tuple(self.family.shared(self.block))).to(device)

    def forward(self, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        self.logits = self.gate(hidden)
        routed = self.logits.index_select(-1, self.routed_ids(hidden.device))
        weights, idx = self.rule.select(routed.reshape(-1, routed.shape[-1]))
        return routed, weights, idx

    def route(self, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(weights, block expert ids, gate logits) for block input rows ``hidden`` [N, H]: this router's
        selection, after any hook re-routed it, mapped to the block's experts and ``finish``-ed."""
        _, weights, idx = self(hidden)
        logits, self.logits = self.logits, None
        weights, ids = self.finish(logits, weights, idx)
        return weights, ids, logits

    def finish(self, logits: Tensor, weights: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
        """A routed selection (indices 0 … R − 1) as the block's: its expert ids, shared experts added."""
        return self.family.finish(self.block, logits, weights, self.routed_ids(idx.device)[idx])

    def routed_output(self, x: Tensor, weights: Tensor, idx: Tensor) -> Tensor:
        """Σ over slots of weights · expert(x) for routed indices ``idx`` [N, k] (0 … R − 1), without the
        shared experts: what ``experts(x, idx, weights)`` gives for a transformers-5 experts module."""
        return run_experts(self.block.experts, x, weights.to(x.dtype), self.routed_ids(idx.device)[idx])

    # -- while hooked, the block runs the driven forward ------------------------------------------
    def register_forward_hook(self, hook: Callable, *args: Any, **kwargs: Any) -> _Handle:
        return self._engage(super().register_forward_hook(hook, *args, **kwargs))

    def register_forward_pre_hook(self, hook: Callable, *args: Any, **kwargs: Any) -> _Handle:
        return self._engage(super().register_forward_pre_hook(hook, *args, **kwargs))

    def _engage(self, handle: Any) -> _Handle:
        self.block.forward = functools.partial(self.family.forward, self.block, self)
        return _Handle(handle, self._release)

    def _release(self) -> None:
        if not self._forward_hooks and not self._forward_pre_hooks:
            self.block.__dict__.pop("forward", None)


class _Handle:
    """A hook handle that also gives the block back its own forward when the router's last hook goes."""

    def __init__(self, handle: Any, release: Callable[[], None]) -> None:
        self.handle, self.release = handle, release

    def remove(self) -> None:
        self.handle.remove()
        self.release()

    def __enter__(self) -> _Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


@functools.cache
def _routed_ids(n: int, shared: tuple[int, ...]) -> Tensor:
    skip = set(shared)
    return torch.tensor([e for e in range(n) if e not in skip], dtype=torch.long)


def gate_families_of(block_class: str) -> GateFamily:
    return gate_families()[block_class]


def gate_router(block: nn.Module, family: GateFamily) -> GateRouter:
    """The block's ``GateRouter`` (made once, kept in the block); refuses blocks of another shape."""
    gate, experts = getattr(block, family.gate_attr, None), getattr(block, "experts", None)
    if not (
        isinstance(gate, nn.Linear)
        and isinstance(experts, nn.ModuleList)
        and len(experts) == gate.out_features
    ):
        raise UnsupportedModelError(
            f"{type(block).__name__} ({family.adapter.family}, remote code): expected a bare nn.Linear "
            f"`{family.gate_attr}` and an nn.ModuleList `experts` with one expert per gate output; found "
            f"{type(gate).__name__} and {type(experts).__name__} (another revision of this remote code?)"
        )
    router = _ROUTERS.get(block)
    if router is None or router.gate is not gate:
        router = _ROUTERS[block] = GateRouter(block, family.block_class)
    return router


def run_experts(experts: nn.ModuleList, x: Tensor, weights: Tensor, idx: Tensor) -> Tensor:
    """Σ over slots of weights · experts[idx](x) for rows ``x`` [N, H], ``weights`` in x's dtype.

    Expert by expert, each one's tokens ordered by slot then token, as the usual remote-code loop
    (one-hot [E, k, N]) does, so an unchanged selection gives the block's own output bit for bit.
    """
    out = torch.zeros_like(x)
    by_slot = idx.t()
    for e, expert in enumerate(experts):
        slot, token = torch.where(by_slot == e)
        if token.numel():
            out.index_add_(0, token, (expert(x[token]) * weights[token, slot, None]).to(x.dtype))
    return out


@torch.no_grad()
def observed_weights(block: nn.Module, hidden: Tensor) -> Tensor:
    """[N, E] the weight the block itself gives each expert for input ``hidden`` [..., H] (0: unused).

    Each expert's output is replaced by a one-hot marker on its own column of the hidden size; the
    block's output is then w_e in column e (in the block's dtype). More experts than hidden units
    take further passes. Only for blocks whose output is the weighted sum of their experts' outputs.
    """
    experts, width = block.experts, hidden.shape[-1]
    observed = torch.zeros(hidden[..., 0].numel(), len(experts), dtype=hidden.dtype, device=hidden.device)
    for start in range(0, len(experts), width):
        handles = [expert.register_forward_hook(_marker(e - start)) for e, expert in enumerate(experts)]
        try:
            out = block(hidden)
        finally:
            for handle in handles:
                handle.remove()
        out = (out[0] if isinstance(out, tuple) else out).reshape(-1, width)
        stop = min(start + width, len(experts))
        observed[:, start:stop] = out[:, : stop - start]
    return observed


def _marker(column: int) -> Callable:
    def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        marker = torch.zeros_like(output)
        if 0 <= column < output.shape[-1]:
            marker[..., column] = 1
        return marker

    return hook
