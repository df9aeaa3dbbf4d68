"""LoRA on the routed experts, applied to the activations of the selected experts (TE-MoE §4.3).

TE-MoE trains the intra-option policy through LoRA adapters on attention *and* on the experts
(§4.3; §5: r = α = 16). PEFT adapts a fused expert parameter ``[E, out, in]`` (``target_parameters``,
``lora.ParamWrapper``) by folding ``W + s·B_e·A_e`` for every expert into the weight on every
forward: O(E·out·in·r) work and an ``[E, out, in]`` weight gradient per call, whether an expert
is chosen or not (measured: 16 s vs 8.7 s an options step). Here the adapter runs where the
experts run: every (token, expert) pair goes through its expert's low-rank branch,

    y = x·W_eᵀ + s · (x·A_eᵀ)·B_eᵀ,   s = α / r,

for the up (``gate_up_proj`` / ``up_proj``) and the down projection, with the experts' own
grouping (pairs sorted by expert, one grouped GEMM per factor, as transformers' ``grouped_mm``
experts): O(tokens·k·r·(in + out)) work, nothing of size ``[E, out, in]``.

The factors are stored in PEFT's layout (``lora_A`` ``[E·r, in]`` expert-major, ``lora_B``
``[out, r·E]`` rank-major) and saved under the keys PEFT gives the nested ``ParamWrapper`` of each
parameter, so an adapter trained here loads in PEFT (``LoraConfig(target_parameters=...)``) and
PEFT's merge is this forward (tests/test_options_expert_lora.py).

Supported experts: transformers' fused experts modules (``@use_experts_implementation``: Qwen2-MoE,
OLMoE, Qwen3-MoE, Mixtral, DeepSeek-V2/V3, gpt-oss, ...), with or without biases, transposed or
not; anything else (per-expert ``ModuleList``s, Llama-4's experts) stays on PEFT.
Deviation: ``dropout`` on the branch input is allowed (PEFT's ``ParamWrapper`` refuses it, since a
folded delta cannot drop per input); TE-MoE uses none, the default.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.errors import ConfigError, UnsupportedModelError
from moectl.models.grouped_mm import combine, cpu_pad, group_by_expert
from moectl.models.grouped_mm import compute_dtype as _compute_dtype
from moectl.models.grouped_mm import grouped_mm as _grouped_mm
from moectl.offload.delta_store import set_pending_delta  # the offloading runtime reads them there
from moectl.train.master_weights import HALF

__all__ = [
    "ExpertLoRA",
    "add_expert_lora",
    "attach_pending_expert_lora",
    "expert_lora_disabled",
    "expert_lora_modules",
    "expert_lora_state_dict",
    "expert_lora_target_parameters",
    "experts_modules",
    "load_expert_lora_state_dict",
    "merge_expert_lora",
    "unsupported_reason",
]

PEFT_PREFIX = "base_model.model."  # what PEFT's state-dict keys start with (PeftModel → LoraModel → model)


def _projections(experts: nn.Module) -> tuple[str, str]:
    return ("gate_up_proj" if getattr(experts, "has_gate", True) else "up_proj"), "down_proj"


def unsupported_reason(experts: nn.Module) -> str | None:
    """Why :class:`ExpertLoRA` cannot wrap ``experts`` (None: it can)."""
    if isinstance(experts, ExpertLoRA):
        return "already wrapped"
    if not all(hasattr(experts, a) for a in ("has_gate", "has_bias", "is_transposed", "num_experts")):
        return f"{type(experts).__name__} is not a transformers fused experts module (@use_experts_implementation)"
    if getattr(experts, "_is_expert_parallel", False):
        return "expert-parallel experts"
    for name in _projections(experts):
        w = getattr(experts, name, None)
        if not isinstance(w, nn.Parameter) or w.dim() != 3 or not w.dtype.is_floating_point:
            return f"{type(experts).__name__}.{name} is not a floating-point [E, ., .] parameter"
        if w.device.type == "meta":
            return f"{type(experts).__name__}.{name} is on the meta device"
        if experts.has_bias and not isinstance(getattr(experts, f"{name}_bias", None), nn.Parameter):
            return f"{type(experts).__name__} has_bias but no {name}_bias"
    if not experts.has_gate and not hasattr(experts, "act_fn"):
        return f"{type(experts).__name__} has no act_fn"
    return None


def adapter_dtype(base: torch.dtype) -> torch.dtype:
    """The dtype the adapter factors are stored in: float32 over a bf16/fp16 base (PEFT's
    ``autocast_adapter_dtype=True``, its default for the attention adapters beside these: AdamW's
    small updates vanish in bf16), else the base's. Forwards cast them to the compute dtype."""
    return torch.float32 if base in HALF else base


class ExpertLoRA(nn.Module):
    """A fused experts module with LoRA on its two projections, computed on the selected experts.

    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` is the experts
    module's own call. ``enabled = False`` runs the wrapped module unchanged (the teacher). The
    wrapped module is ``.experts`` (not PEFT's ``base_layer``: PEFT's unload would take this
    module for one of its own layers).
    """

    def __init__(self, experts: nn.Module, r: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        reason = unsupported_reason(experts)
        if reason is not None:
            raise UnsupportedModelError(f"cannot put expert LoRA on this module: {reason}")
        if r < 1:
            raise ConfigError(f"LoRA rank r must be >= 1, got {r}")
        self.experts = experts
        self.r, self.alpha, self.scaling = int(r), alpha, alpha / r
        self.num_experts = int(experts.num_experts)
        self.enabled = True
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for name in _projections(experts):
            w = getattr(experts, name)
            e, d_in, d_out = (w.shape[0], w.shape[1], w.shape[2]) if experts.is_transposed else (
                w.shape[0], w.shape[2], w.shape[1])  # fmt: skip
            dtype = adapter_dtype(w.dtype)
            a = torch.empty(e * r, d_in, device=w.device, dtype=dtype)
            nn.init.kaiming_uniform_(a, a=5**0.5)  # nn.Linear's (and PEFT's) initialisation of A
            self.lora_A[name] = nn.Parameter(a)
            self.lora_B[name] = nn.Parameter(torch.zeros(d_out, r * e, device=w.device, dtype=dtype))

    def factors(self, name: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(A [E, in, r], B [E, r, out]) of projection ``name``: x·A[e]·B[e] is x·A_eᵀ·B_eᵀ."""
        a = self.lora_A[name].to(dtype).view(self.num_experts, self.r, -1).transpose(1, 2)
        b = self.lora_B[name].to(dtype).view(-1, self.r, self.num_experts).permute(2, 1, 0).contiguous()
        return a, b

    def delta(self, name: str) -> Tensor:
        """s·B_e·A_e for every expert, in the layout of the wrapped parameter (for merging)."""
        a = self.lora_A[name].float().view(self.num_experts, self.r, -1)
        b = self.lora_B[name].float().view(-1, self.r, self.num_experts)
        d = torch.einsum("ore,eri->eoi", b, a) * self.scaling
        return d.transpose(1, 2) if self.experts.is_transposed else d

    def _project(self, name: str, x: Tensor, offsets: Tensor, sorted_experts: Tensor) -> Tensor:
        base = self.experts
        w = getattr(base, name).to(x.dtype)
        y = _grouped_mm(x, w if base.is_transposed else w.transpose(-2, -1), offsets)
        if base.has_bias:
            y = y + getattr(base, f"{name}_bias").to(x.dtype)[sorted_experts]
        a, b = self.factors(name, x.dtype)
        return y + self.scaling * _grouped_mm(_grouped_mm(self.dropout(x), a, offsets), b, offsets)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        base = self.experts
        if not self.enabled:
            return base(hidden_states, top_k_index, top_k_weights)
        dtype = _compute_dtype(hidden_states)
        pad = cpu_pad(hidden_states, dtype, top_k_index, self.num_experts)
        groups = group_by_expert(top_k_index, self.num_experts, pad)
        sorted_experts = groups.row_experts()
        first, down = _projections(base)
        h = self._project(first, groups.gather(hidden_states.to(dtype)), groups.offsets, sorted_experts)
        h = base._apply_gate(h) if base.has_gate else base.act_fn(h)
        out = self._project(down, h, groups.offsets, sorted_experts)
        if getattr(base, "has_post_expert_norm", False):
            out = base.post_expert_norm(out)
        return combine(out, top_k_weights, groups, hidden_states.shape[0]).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, experts={self.num_experts}, enabled={self.enabled}"


# -- injection -------------------------------------------------------------------------------
def _root(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def experts_modules(model: nn.Module, info: ModelInfo | None = None) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of each MoE block's ``experts`` child, paths relative to the transformers model."""
    root = _root(model)
    info = info or inspect(model)
    names = {id(m): n for n, m in root.named_modules()}
    out = []
    for layer in info.layers:
        experts = getattr(layer.block, "experts", None)
        if isinstance(experts, nn.Module) and id(experts) in names:
            out.append((names[id(experts)], experts))
    return out


def add_expert_lora(
    model: nn.Module, info: ModelInfo | None = None, r: int = 16, alpha: float = 16, dropout: float = 0.0
) -> list[nn.Parameter]:
    """Wrap every MoE layer's fused experts with :class:`ExpertLoRA` (in place); returns the new
    trainable parameters. The experts' own weights are frozen. ValueError if a layer's experts are
    not supported (see :func:`unsupported_reason`) or the model has no experts module."""
    found = experts_modules(model, info)
    if not found:
        raise UnsupportedModelError("found no MoE block with an `experts` module to put expert LoRA on")
    bad = {n: reason for n, m in found if (reason := unsupported_reason(m)) is not None}
    if bad:
        name, reason = next(iter(bad.items()))
        raise UnsupportedModelError(f"expert LoRA cannot wrap {name} ({reason}); use PEFT's target_parameters there")
    root = _root(model)
    params: list[nn.Parameter] = []
    for name, experts in found:
        experts.requires_grad_(False)
        wrapped = ExpertLoRA(experts, r, alpha, dropout)
        parent, _, child = name.rpartition(".")
        setattr(root.get_submodule(parent), child, wrapped)
        params += [*wrapped.lora_A.values(), *wrapped.lora_B.values()]
    return params


def expert_lora_modules(model: nn.Module) -> list[tuple[str, ExpertLoRA]]:
    """``(path relative to the transformers model, module)`` of every :class:`ExpertLoRA`."""
    return [(n, m) for n, m in _root(model).named_modules() if isinstance(m, ExpertLoRA)]


@contextmanager
def expert_lora_disabled(model: nn.Module) -> Iterator[None]:
    """The enclosed forwards run the experts without their adapters (TE-MoE's teacher)."""
    modules = [m for _, m in expert_lora_modules(model)]
    before = [m.enabled for m in modules]
    for m in modules:
        m.enabled = False
    try:
        yield
    finally:
        for m, on in zip(modules, before, strict=True):
            m.enabled = on


def merge_expert_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its experts' weights (W += s·B·A per expert) and put the plain
    experts module back in place; returns ``model`` (changed in place)."""
    root = _root(model)
    with torch.no_grad():
        for name, module in expert_lora_modules(model):
            base = module.experts
            for proj in _projections(base):
                w = getattr(base, proj)
                w.add_(module.delta(proj).to(w.dtype))
            parent, _, child = name.rpartition(".")
            setattr(root.get_submodule(parent), child, base)
    return model


# -- PEFT-compatible saving ------------------------------------------------------------------
def _peft_keys(name: str, experts: nn.Module) -> dict[tuple[str, str], str]:
    """``{(projection, "A"|"B"): PEFT key}``. PEFT wraps the targeted parameters of one module in
    declaration order, each new ``ParamWrapper`` around the last, so the first-declared parameter
    sits deepest (``experts.base_layer.lora_A.weight``) and the last outermost (``experts.lora_A.weight``)."""
    projections = set(_projections(experts))
    declared = [n for n, _ in experts.named_parameters(recurse=False) if n in projections]
    keys = {}
    for depth, proj in enumerate(reversed(declared)):
        stem = f"{PEFT_PREFIX}{name}." + "base_layer." * depth
        keys[(proj, "A")] = f"{stem}lora_A.weight"
        keys[(proj, "B")] = f"{stem}lora_B.weight"
    return keys


def expert_lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Every expert adapter under PEFT's keys (as ``get_peft_model_state_dict`` names them)."""
    out = {}
    for name, module in expert_lora_modules(model):
        for (proj, which), key in _peft_keys(name, module.experts).items():
            p = module.lora_A[proj] if which == "A" else module.lora_B[proj]
            out[key] = p.detach().contiguous().cpu()
    return out


def load_expert_lora_state_dict(model: nn.Module, state: dict[str, Tensor]) -> set[str]:
    """Copy the expert adapters of ``state`` (PEFT keys) into the model's :class:`ExpertLoRA`
    modules; returns the keys used. KeyError / ValueError when one is missing or mis-shaped."""
    used = set()
    with torch.no_grad():
        for name, module in expert_lora_modules(model):
            for (proj, which), key in _peft_keys(name, module.experts).items():
                if key not in state:
                    raise KeyError(f"the adapter file has no {key} (expert LoRA of {name}.{proj})")
                p = module.lora_A[proj] if which == "A" else module.lora_B[proj]
                if tuple(state[key].shape) != tuple(p.shape):
                    raise ValueError(
                        f"{key}: shape {tuple(state[key].shape)} in the adapter file, the model needs {tuple(p.shape)}"
                    )
                p.copy_(state[key])
                used.add(key)
    return used


def expert_lora_target_parameters(model: nn.Module) -> list[str]:
    """PEFT ``target_parameters`` naming what the expert adapters adapt (``mlp.experts.down_proj``, ...)."""
    names = set()
    for name, module in expert_lora_modules(model):
        suffix = ".".join(name.split(".")[-2:])
        names.update(f"{suffix}.{proj}" for proj in _projections(module.experts))
    return sorted(names)


def expert_lora_rank(model: nn.Module) -> tuple[int, float] | None:
    """(r, alpha) of the expert adapters, None when the model has none."""
    modules = expert_lora_modules(model)
    return (modules[0][1].r, modules[0][1].alpha) if modules else None


# -- experts not in memory (a lazily loaded checkpoint) ---------------------------------------


class PendingExpertLoRA:
    """The expert adapters of an experts module whose weights are not in memory (the meta device:
    ``serve-offload`` of a checkpoint reads each expert from its shards when it is needed). Nothing
    can be merged into such weights, so each expert's s·B_e·A_e is added when the expert is loaded
    (``moectl.offload.offload`` finds it with ``moectl.offload.delta_store.pending_delta``): what ``merge_expert_lora`` would have
    folded in, one expert at a time."""

    def __init__(
        self, experts: nn.Module, factors: dict[str, tuple[Tensor, Tensor]], r: int, alpha: float
    ) -> None:
        self.factors, self.r, self.scaling = factors, int(r), alpha / r
        self.num_experts = int(experts.num_experts)
        self.transposed = bool(experts.is_transposed)

    def delta(self, expert: int) -> dict[str, Tensor]:
        """``{projection: s·B_e·A_e}`` of ``expert`` in the layout of the experts' parameter, float32."""
        out = {}
        for name, (a, b) in self.factors.items():
            a_e = a.float().view(self.num_experts, self.r, -1)[expert]  # [r, in]
            b_e = b.float().view(-1, self.r, self.num_experts)[:, :, expert]  # [out, r]
            d = (b_e @ a_e) * self.scaling
            out[name] = d.T if self.transposed else d
        return out


def attach_pending_expert_lora(model: nn.Module, state: dict[str, Tensor], r: int, alpha: float) -> set[str]:
    """Attach the expert adapters of ``state`` (PEFT keys) to the experts modules whose weights are
    on the meta device, as :class:`PendingExpertLoRA`; returns the keys used. KeyError when a
    module has some of its keys but not all."""
    used: set[str] = set()
    for name, experts in experts_modules(model):
        projections = _projections(experts)
        if not all(getattr(getattr(experts, p, None), "is_meta", False) for p in projections):
            continue
        keys = _peft_keys(name, experts)
        if not any(k in state for k in keys.values()):
            continue
        missing = [k for k in keys.values() if k not in state]
        if missing:
            raise KeyError(f"the adapter file has no {missing[0]} (expert LoRA of {name})")
        factors = {p: (state[keys[(p, "A")]], state[keys[(p, "B")]]) for p in projections}
        set_pending_delta(experts, PendingExpertLoRA(experts, factors, r, alpha))
        used |= set(keys.values())
    return used
