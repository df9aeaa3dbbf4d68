"""``replay``: route each token to the experts a record gives it (routing replay for RL and analysis).

What Megatron-Core's ``RouterReplay`` (REPLAY_FORWARD) does for a trainer, for any model moectl
routes: a rollout engine (``moectl serve`` with ``return_routed_experts``, vLLM, SGLang) records the
experts each token used; a training forward of the same tokens routes exactly so, and the
gradient flows through the router's weights over those experts. Weights are recomputed from the
router's own probabilities over the replayed set, by the family's rule (``RouterRule.weights_of``:
the top-k softmax weights, renormalised where the family renormalises), so a greedy request
replayed from its own record gives the same tokens and log-probabilities, bit for bit.

A record is ``experts`` [T, MoE layers, k] (one sequence) or [B, T, MoE layers, k] (one per row),
integer expert ids, in the layout vLLM's ``routed_experts`` and SGLang's ``meta_info`` hold: row i
is the i-th real token of the sequence (the prompt's first token is 0; padding is not counted).
``start`` is the position of the record's first row (SGLang's ``routed_experts_start_len``). A
token the record does not cover (past its end, before ``start``, or a row of -1) is routed by
the router as usual; a replayed token's experts are the record's whatever other policies of the
same routing say. A record of k' experts per token routes every token of its rows to k' experts
(``topk:k'`` past the record), so a record made under ``topk:N`` replays as it was made.

    {"type": "replay", "experts": "<base64 .npy>" | [[[...]]], "start": 0}
    Replay(torch.load(...)) | Replay.from_trace(trace) | Replay.from_routed_experts(choice["routed_experts"])

Positions: in the engine each request counts its own real tokens. In ``moectl.route`` a forward
call's tokens are counted from the KV cache's length (0 for a training forward): replay a
left-padded batch in one forward without a cache (the training use), or through the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo
from moectl.errors import ConfigError
from moectl.io.npy_text import decode, encode
from moectl.routing.policy_config import PolicyConfig, register_policy
from moectl.routing.routing_state import RoutingState

_FIXED_K = ("sparsemixer", "sigmoid_dense")


def _record(experts: Any) -> Tensor:
    """``experts`` as an int64 [B, T, L, k] tensor (a base64 .npy, nested lists, an array)."""
    if isinstance(experts, str):
        experts = decode(experts, "replay 'experts'")
    elif not isinstance(experts, Tensor):
        try:
            experts = torch.as_tensor(experts)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ConfigError(
                f"replay 'experts' must be [tokens, MoE layers, k] integer expert ids (a base64 .npy or nested lists): {err}"
            ) from None
    if experts.dtype.is_floating_point or experts.dtype.is_complex or experts.dtype == torch.bool:
        raise ConfigError(f"replay 'experts' must hold integer expert ids, got {experts.dtype}")
    if experts.dim() == 3:
        experts = experts.unsqueeze(0)
    if experts.dim() != 4 or experts.shape[-1] < 1 or experts.shape[1] < 1:
        raise ConfigError(
            f"replay 'experts' must be [tokens, MoE layers, k] or [rows, tokens, MoE layers, k], got shape {list(experts.shape)}"
        )
    return experts.to(torch.int64).cpu().contiguous()


@register_policy("replay")
@dataclass(eq=False, repr=False)
class Replay(PolicyConfig):
    """Each token routed to the experts a record gives it (see the module doc)."""

    experts: Any
    start: int = 0
    _by_device: dict[Any, Tensor] = field(default_factory=dict, repr=False)  # device -> [L, B, T, k]

    def __post_init__(self) -> None:
        self.experts = _record(self.experts)
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise ConfigError(f"replay 'start' must be an integer >= 0 (the record's first position), got {self.start!r}")
        ids = self.experts
        real = ids >= 0
        partial = real.any(-1) & ~real.all(-1)
        if bool(partial.any()):
            where = partial.nonzero()[0].tolist()
            raise ConfigError(
                f"replay 'experts': token {where[1]} of MoE layer {where[2]} mixes -1 with expert ids; "
                "a token is either replayed (k ids) or not (all -1)"
            )
        ordered = ids.sort(-1).values
        twice = real[..., 1:] & (ordered[..., 1:] == ordered[..., :-1])
        if bool(twice.any()):
            where = twice.nonzero()[0].tolist()
            raise ConfigError(f"replay 'experts': token {where[1]} lists an expert twice at MoE layer {where[2]}")

    def __repr__(self) -> str:
        return f"Replay(experts={list(self.experts.shape)}, start={self.start})"

    @property
    def k(self) -> int:
        """Experts per replayed token."""
        return int(self.experts.shape[-1])

    @classmethod
    def from_trace(cls, trace: Any, start: int = 0) -> Replay:
        """The replay of a ``RoutingTrace``: each row's real tokens in order (padding dropped)."""
        chosen = trace.chosen
        if not chosen:
            raise ConfigError("replay: the trace records no chosen experts")
        stacked = torch.stack([chosen[layer] for layer in sorted(chosen)], 2)  # [B, T, L, k]
        valid = trace.valid.bool()
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # real tokens first, in order
        packed = stacked.gather(1, order[:, :, None, None].expand_as(stacked))
        kept = torch.arange(valid.shape[1])[None, :] < valid.sum(1, keepdim=True)
        return cls(packed.masked_fill(~kept[:, :, None, None], -1), start)

    @classmethod
    def from_routed_experts(cls, experts: Any, start: int = 0) -> Replay:
        """The replay of a routed-experts response (base64 .npy, vLLM's/SGLang's [tokens, layers, k])."""
        return cls(experts, start)

    def config_fields(self) -> dict[str, Any]:
        experts = self.experts[0] if self.experts.shape[0] == 1 else self.experts
        return {"experts": encode(experts), "start": self.start}

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], info: ModelInfo | None = None, *, model: nn.Module | None = None
    ) -> Replay:
        unknown = sorted(set(data) - {"type", "format_version", "experts", "start"})
        if unknown:
            raise ConfigError(f"a 'replay' policy has no field {unknown[0]!r}; its fields: experts, start")
        if data.get("experts") is None:
            raise ConfigError("a 'replay' policy needs 'experts': [tokens, MoE layers, k] expert ids")
        policy = cls(data["experts"], data.get("start", 0))
        if info is not None:
            policy.bind(info)
        return policy

    def fork(self, seed: int) -> Replay:
        """A copy for one request: its own positions, the record shared (``SequencePolicy``)."""
        twin = Replay.__new__(Replay)
        twin.experts, twin.start, twin._by_device = self.experts, self.start, self._by_device
        return twin

    def bind(self, info: ModelInfo) -> None:
        layers = info.num_moe_layers
        if self.experts.shape[2] != layers:
            raise ConfigError(
                f"replay 'experts' covers {self.experts.shape[2]} MoE layers; the model has {layers}"
            )
        for layer in info.layers:
            ids = self.experts[:, :, layer.index]
            n = layer.num_experts
            if self.k > n:
                raise ConfigError(f"replay: {self.k} experts per token at MoE layer {layer.index}, which has {n}")
            bad = (ids < -1) | (ids >= n)
            if bool(bad.any()):
                value = int(ids[bad][0])
                raise ConfigError(
                    f"replay 'experts': expert {value} at MoE layer {layer.index} is out of range; valid ids are 0..{n - 1}"
                )
            if layer.rule.kind in _FIXED_K and (layer.rule.kind == "sparsemixer" or self.k != layer.rule.top_k):
                raise ConfigError(
                    f"replay: MoE layer {layer.index}'s router ({layer.rule.kind}) cannot take "
                    f"{self.k} given experts per token"
                )

    def _layers(self, device: torch.device) -> Tensor:
        found = self._by_device.get(device)
        if found is None:
            found = self.experts.permute(2, 0, 1, 3).contiguous().to(device)
            self._by_device[device] = found
        return found

    def apply(self, state: RoutingState) -> None:
        ctx = state.ctx
        b = state.logits.shape[0]
        device = state.logits.device
        record = self._layers(device)[state.layer]  # [B_r, T_r, k]
        rows, length = record.shape[0], record.shape[1]
        if rows not in (1, b):
            raise ConfigError(f"replay: the record holds {rows} rows, the forward {b}")
        valid = ctx.valid_mask(device)
        seen = ctx.offsets.to(device)[:, None] if ctx.offsets is not None else ctx.offset
        position = seen + valid.long().cumsum(1) - 1 - self.start  # [B, T] index into the record
        covered = valid & (position >= 0) & (position < length)
        row = torch.arange(b, device=device)[:, None] if rows == b else torch.zeros(b, 1, dtype=torch.long, device=device)
        given = record[row, position.clamp(0, length - 1)]  # [B, T, k]
        state.replay(given.masked_fill(~covered[..., None], -1))
        if self.k != state.rule.top_k:
            state.top_k = self.k


def overlay(rule: Any, logits: Tensor, weights: Tensor, idx: Tensor, replayed: Tensor) -> tuple[Tensor, Tensor]:
    """(weights, indices) [N, W] with the replayed tokens' experts in place of the choice: ``weights``
    / ``idx`` [N, k] the choice for every token, ``replayed`` [N, k'] the record's (-1: not
    covered, or a slot past a narrower record's k'), ``logits`` [N, E] the router's. A covered
    token's slots past its own k' repeat its first expert with weight 0."""
    width = max(idx.shape[-1], replayed.shape[-1])
    if idx.shape[-1] < width:
        extra = width - idx.shape[-1]
        weights = torch.cat([weights, weights.new_zeros(weights.shape[0], extra)], -1)
        idx = torch.cat([idx, idx[:, :1].expand(-1, extra)], -1)
    if replayed.shape[-1] < width:
        replayed = torch.cat([replayed, replayed.new_full((replayed.shape[0], width - replayed.shape[-1]), -1)], -1)
    live = replayed >= 0
    covered = live[:, :1]
    given = torch.where(live, replayed, replayed[:, :1].clamp(min=0))
    # uncovered tokens take every slot as live: their (unused) weights stay finite, so no NaN reaches a gradient
    given_weights = rule.weights_of(logits, given, live | ~covered)
    return torch.where(covered, given_weights.to(weights.dtype), weights), torch.where(covered, given, idx)
