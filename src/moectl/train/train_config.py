"""Pretraining configuration: the model presets and the training knobs, as plain values.

The model is a transformers Qwen2-MoE: a softmax router (EMO §3.1's p_t = softmax(r(x_t))),
top-k without renormalisation (as OLMoE, EMO's base), and a shared expert that is always on
(EMO §4.1, A.3: n_s = 1). Deviation: Qwen2-MoE scales its shared expert by a learned sigmoid gate;
we keep it (it is part of the family) so that every checkpoint loads with plain
``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from moectl.errors import ConfigError, MoectlFileError
from moectl.runconfig import RunConfig

Objective = Literal["standard", "emo"]
LBScope = Literal["micro", "dp", "global"]

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # trains in minutes on 2 CPU cores: tests and the README's default run
    "tiny": {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "intermediate_size": 256,
    },
    # moectl's reference models: 32 routed experts, top-4, one shared expert
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 256,
        "intermediate_size": 512,
    },
}

TRAIN_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"seq_len": 256, "micro_batch": 8, "grad_accum": 1, "max_steps": 300, "warmup_steps": 30},
    # 400 x 8 x 512 = 1.6M tokens: ~70 min on one CPU core per run (measured); raise max_steps on a GPU
    "small": {"seq_len": 512, "micro_batch": 8, "grad_accum": 1, "max_steps": 400, "warmup_steps": 40},
}


@dataclass
class TrainConfig(RunConfig):
    """Every knob of a pretraining run; saved beside its checkpoints (``config.json``) so a run can
    be redone or resumed (``TrainConfig.load``: every value checked against its field's type)."""

    kind: ClassVar[str] = "run config"

    out: str
    objective: Objective = "standard"
    preset: str = "tiny"
    corpus: str | None = None  # corpus folder; None: the sample corpus shipped with moectl
    tokenizer: str | None = None  # tokenizer folder; None: the tokenizer shipped with moectl
    seq_len: int = 256
    micro_batch: int = 8
    grad_accum: int = 1
    max_steps: int = 300
    warmup_steps: int = 30
    lr: float = 4e-3  # EMO A.4: 4e-3 was best for both standard and EMO
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    lb_coef: float = 0.1  # EMO A.4: load-balancing coefficient 1e-1
    z_coef: float = 1e-3  # router z-loss (OLMoE)
    lb_scope: LBScope = "global"
    lb_window: int = 0  # f pooled over this many previous steps too (train/lb_window.py); 0: EMO A.1 as is
    pool_d_min: int | None = None  # EMO: d ~ U{d_min, ..., n_r}, default d_min = k
    pool_d_max: int | None = None  # default n_r
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate only at the end
    eval_batches: int = 8
    final_eval_batches: int = 0  # 0: the whole validation split
    seed: int = 0
    bf16: bool = True  # bf16 autocast (CPU and GPU); False trains in float32
    experts_implementation: str = "moectl_grouped"  # grouped GEMMs under autocast; "eager": transformers'
    fused_ce: bool = True  # LM head + cross-entropy in row chunks, no [B, T, V] logits (train/fused_ce.py)
    fused_adamw: bool = True  # AdamW's fused kernel (CPU and CUDA); False: torch's default (foreach)
    anneal_from: str | None = None  # start from this checkpoint's weights (EMO §B.4)
    model: dict[str, Any] = field(default_factory=dict)  # overrides of the model preset

    def __post_init__(self) -> None:
        if self.objective not in ("standard", "emo"):
            raise ConfigError(f"objective must be 'standard' or 'emo', got {self.objective!r}")
        if self.preset not in MODEL_PRESETS:
            raise ConfigError(f"preset must be one of {', '.join(MODEL_PRESETS)}, got {self.preset!r}")
        if self.lb_scope not in ("micro", "dp", "global"):
            raise ConfigError(f"lb_scope must be 'micro', 'dp' or 'global', got {self.lb_scope!r}")
        if self.lb_window < 0:
            raise ConfigError(f"lb_window must be >= 0 (0: no window), got {self.lb_window}")
        for name in ("seq_len", "micro_batch", "grad_accum", "max_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps <= self.max_steps:
            raise ConfigError(
                f"warmup_steps must lie in 0..max_steps={self.max_steps}, got {self.warmup_steps}"
            )
        self.betas = tuple(self.betas)  # type: ignore[assignment]

    @classmethod
    def from_preset(cls, preset: str, **overrides: Any) -> TrainConfig:
        if preset not in TRAIN_PRESETS:
            raise ConfigError(f"preset must be one of {', '.join(TRAIN_PRESETS)}, got {preset!r}")
        given = {k: v for k, v in overrides.items() if v is not None}
        values = {**TRAIN_PRESETS[preset], **given}
        if "warmup_steps" not in given and values["warmup_steps"] > values["max_steps"] // 10:
            values["warmup_steps"] = values["max_steps"] // 10  # a shortened run keeps a 10% warmup
        return cls(preset=preset, **values)

    def model_kwargs(self) -> dict[str, Any]:
        return {**MODEL_PRESETS[self.preset], **self.model}

    def tokens_per_step(self, world_size: int = 1) -> int:
        return self.seq_len * self.micro_batch * self.grad_accum * world_size

    @classmethod
    def resume_from(cls, folder: str | Path, **overrides: Any) -> TrainConfig:
        """The config a run in ``folder`` was started with (its ``config.json``), ``overrides``
        applied (and checked again), ``out`` the folder: what ``pretrain --resume DIR`` runs."""
        saved = Path(folder) / "config.json"
        if not saved.exists():
            raise MoectlFileError(f"--resume {folder}: no config.json there (not a moectl run directory)")
        return cls.load(saved).with_(**overrides, out=str(folder))
