"""Switch rate (TE-MoE §2.2): how often a layer's expert mask ω changes along a sequence.

    switch rate = (1/L) Σ_ℓ (1/(T−1)) Σ_{t=1}^{T−1} 1[ω_t^(ℓ) ≠ ω_{t−1}^(ℓ)]

With a controller (or any policy that sets ``allowed``) ω is the recorded mask. For a plain model
the router is treated as an option policy: at a switch point ω is set to the top-k-hat experts,
and it persists until the k experts activated at a later position are no longer all inside it.
With k-hat = k this is TE-MoE's Table 1.

Defaults (``source="auto"``, ``region="auto"``), so that ``switch_rate(session.trace)`` reads any
trace as it is meant:

- source: the recorded masks ω (``"allowed"``) when no ``k_hat`` is given and a policy recorded a
  mask at *every* MoE layer of the trace (a controller, an expert mask or subset on all layers, a
  document pool); otherwise the router as an option policy (``"router"``, k-hat default top-k).
  Giving ``k_hat`` always measures the router.
- region: ``"generated"`` (from the last prompt token on, as the paper measures) when the trace
  holds generated tokens (decoding steps after the first call); ``"all"`` for a trace of plain
  forward calls, which has no generated tokens.

Deviation, for routers whose choice adds a score-correction bias (DeepSeek-V3 family): the option
at a switch is the activated experts plus the most probable others (top-k-hat of p otherwise),
so that the option always contains the experts the router actually used; for routers without a
bias this is exactly top-k-hat of p.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from moectl.errors import ConfigError
from moectl.routing.trace import RoutingTrace


def mask_switches(masks: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Switch counts and step counts per row for masks [B, T, E] over valid positions [B, T].

    A step t counts when positions t−1 and t are both valid.
    """
    step = valid[:, 1:] & valid[:, :-1]
    changed = (masks[:, 1:] != masks[:, :-1]).any(-1) & step
    return changed.sum(-1), step.sum(-1)


def option_of(probs: Tensor, chosen_onehot: Tensor, k_hat: int) -> Tensor:
    """The option started at a switch: activated experts first, then the most probable, k-hat in all."""
    score = probs.float() + 2.0 * chosen_onehot.float()
    idx = score.topk(k_hat, dim=-1).indices
    return torch.zeros_like(chosen_onehot).scatter_(-1, idx, True)


def option_step(
    current: Tensor | None, probs: Tensor, chosen: Tensor, k_hat: int, restart: Tensor | None = None
) -> Tensor:
    """One step of the router-as-option recurrence (TE-MoE §2.2): ω [..., E] kept while the activated
    experts ``chosen`` [..., E] (bool) stay inside ``current``, else a fresh option (``option_of``);
    ``current`` None, or ``restart`` [...] True: a fresh option."""
    fresh = option_of(probs, chosen, k_hat)
    if current is None:
        return fresh
    keep = ~(chosen & ~current).any(-1, keepdim=True)
    if restart is not None:
        keep = keep & ~restart[..., None]
    return torch.where(keep, current, fresh)


def router_option_masks(probs: Tensor, chosen: Tensor, k_hat: int, start: Tensor | None = None) -> Tensor:
    """ω for a plain router treated as an option policy, for probs [N, T, E] and chosen [N, T, E] bool.

    ``start`` [N] is the first position of the measured region (default 0): there the first
    option is taken. The recurrence over T is sequential by definition; it is vectorised over
    sequences and layers (N).
    """
    n, t, e = probs.shape
    if not 1 <= k_hat <= e:
        raise ConfigError(f"k-hat must be in 1..{e}, got {k_hat}")
    k = int(chosen.sum(-1).max())
    if k_hat < k:
        raise ConfigError(
            f"k-hat = {k_hat} is smaller than top-k = {k}: an option must hold the activated experts"
        )
    start = torch.zeros(n, dtype=torch.long) if start is None else start.long()
    masks = torch.zeros(n, t, e, dtype=torch.bool)
    current: Tensor | None = None
    for pos in range(t):  # sequential by definition; one tensor step per position, no host sync
        current = option_step(current, probs[:, pos], chosen[:, pos], k_hat, restart=start == pos)
        masks[:, pos] = current
    return masks


@dataclass
class SwitchRateReport:
    """Per-sequence and per-layer switch rates; ``mean`` is the paper's average."""

    k_hat: int | None
    source: str
    per_layer: list[float]  # mean over sequences, per MoE layer
    per_sequence: list[float]  # mean over layers, per sequence
    mean: float
    std: float  # across sequences
    steps: int
    rows: list[int]  # trace rows measured (rows with no two consecutive positions are dropped)
    per_sequence_layer: list[list[float]]  # [sequence][layer]
    region: str = "generated"

    def to_dict(self) -> dict:
        return asdict(self)


def has_generated(trace: RoutingTrace) -> bool:
    """Whether ``trace`` holds positions after a row's prompt (tokens produced by decoding steps)."""
    t = trace.valid.shape[1]
    return bool((trace.valid & (torch.arange(t)[None, :] >= trace.prompt_len[:, None])).any())


def masks_everywhere(trace: RoutingTrace) -> bool:
    """Whether a policy recorded an allowed mask at every MoE layer the trace routed."""
    allowed = set(trace.allowed)
    return bool(allowed) and set(trace.chosen) <= allowed


def switch_rate(
    trace: RoutingTrace, k_hat: int | None = None, region: str = "auto", source: str = "auto"
) -> SwitchRateReport:
    """Switch rate of the sequences in ``trace``.

    ``source='router'``: the plain router as an option policy with ``k_hat`` (default: top-k).
    ``source='allowed'``: the recorded masks of a policy or controller.
    ``region='generated'`` measures positions from the end of the prompt on (the paper measures
    generated tokens); ``'all'`` every valid position. ``'auto'`` (both defaults): see the module doc
    — the recorded masks when every MoE layer has one and no ``k_hat`` is given, the generated
    region when the trace has generated tokens.
    """
    if region not in ("auto", "generated", "all"):
        raise ConfigError(f"region must be 'auto', 'generated' or 'all', got {region!r}")
    if source not in ("auto", "router", "allowed"):
        raise ConfigError(f"source must be 'auto', 'router' or 'allowed', got {source!r}")
    if source == "auto":
        source = "allowed" if k_hat is None and masks_everywhere(trace) else "router"
    if region == "auto":
        region = "generated" if has_generated(trace) else "all"
    valid = trace.valid
    b, t = valid.shape
    start = torch.zeros(b, dtype=torch.long)
    if region == "generated":
        start = (trace.prompt_len - 1).clamp(min=0)
        valid = valid & (torch.arange(t)[None, :] >= start[:, None])
    layers = sorted(trace.chosen) if source == "router" else sorted(trace.allowed)
    if not layers:
        raise ConfigError("the trace holds no recorded masks (source='allowed' needs a policy that sets them)")
    if source == "router":
        k_hat = trace.top_k if k_hat is None else int(k_hat)
        probs = torch.stack([trace.probs[layer] for layer in layers]).reshape(-1, t, trace.num_experts)
        chosen = torch.stack([trace.chosen_mask(layer) for layer in layers]).reshape(-1, t, trace.num_experts)
        masks = router_option_masks(probs, chosen, k_hat, start.repeat(len(layers)))
    else:
        masks = torch.stack([trace.allowed[layer] for layer in layers]).reshape(-1, t, trace.num_experts)
    switches, steps = mask_switches(masks, valid.repeat(len(layers), 1))
    rates = (switches.float() / steps.clamp(min=1).float()).reshape(len(layers), b)
    has_steps = (steps.reshape(len(layers), b) > 0).all(0)
    rows = has_steps.nonzero().flatten().tolist()
    rates = rates[:, has_steps]
    if rates.numel() == 0:
        raise ConfigError("no sequence in the trace has two consecutive measured positions")
    per_seq = rates.mean(0)
    return SwitchRateReport(
        k_hat=k_hat,
        source=source,
        per_layer=rates.mean(1).tolist(),
        per_sequence=per_seq.tolist(),
        mean=float(per_seq.mean()),
        std=float(per_seq.std(unbiased=False)) if per_seq.numel() > 1 else 0.0,
        steps=int(steps.sum()),
        rows=rows,
        per_sequence_layer=rates.T.tolist(),
        region=region,
    )
