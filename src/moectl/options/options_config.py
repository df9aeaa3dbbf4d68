"""The settings of an options training run (TE-MoE §4.3 and §5); names follow the paper (k̂, η, τ, γ, λ)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from moectl.errors import ConfigError
from moectl.runconfig import RunConfig


@dataclass
class OptionsConfig(RunConfig):
    """Training configuration; names follow the paper (k̂, η, τ, γ, λ). A run's checkpoints keep it
    as ``options.json`` (``OptionsConfig.load`` reads it back, values checked)."""

    kind: ClassVar[str] = "options config"

    k_hat: int
    eta: float = 0.02  # deliberation cost η (reward units: nats per token)
    # η per expert a switch brings in (nats per expert; one expert = the model's expert bytes): when
    # set, a switch at t is charged η_t = eta_per_expert × n_new_t instead of ``eta`` (option_losses.py)
    eta_per_expert: float | None = None
    steps: int = 300
    batch_size: int = 16  # prompts per step (§5: 16)
    max_prompt_tokens: int = 128
    max_new_tokens: int = 64
    tau: float = 0.2  # teacher mixing ratio τ
    gamma: float = 0.95
    lam: float = 0.95
    value_coef: float = 0.01
    lr_controller: float = 1e-4
    lr_intra: float = 2e-4
    lora_r: int = 16
    lora_alpha: int = 16
    intra: bool = True  # train the intra-option policy (LoRA + routers)
    train_router: bool = True
    lora_experts: bool = True  # LoRA on the stacked expert weights too (PEFT target_parameters)
    temperature: float = 1.0
    top_p: float = 0.95
    seed: int = 0
    cross_layer: bool = False
    save_every: int = 50
    d_e: int | None = None
    d_h: int | None = None
    critic_warmup: int = 0  # steps that train only V_Ω and Q_Ω before β and the selection head move
    value_head: Literal["linear", "mlp"] = "mlp"  # V_Ω: "linear" (A2) or "mlp" (see LayerController.v)

    def __post_init__(self) -> None:
        checks = {
            "steps": self.steps >= 1,
            "batch_size": self.batch_size >= 1,
            "max_new_tokens": self.max_new_tokens >= 2,
            "max_prompt_tokens": self.max_prompt_tokens >= 1,
            "tau": 0.0 <= self.tau <= 1.0,
            "gamma": 0.0 <= self.gamma <= 1.0,
            "lam": 0.0 <= self.lam <= 1.0,
            "eta": self.eta >= 0.0,
            "eta_per_expert": self.eta_per_expert is None or self.eta_per_expert >= 0.0,
            "top_p": 0.0 < self.top_p <= 1.0,
            "temperature": self.temperature > 0,
            "save_every": self.save_every >= 1,
            "value_head": self.value_head in ("linear", "mlp"),
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            allowed = "steps, batch_size, save_every >= 1; max_new_tokens >= 2; tau, gamma, lam in [0, 1]; eta, eta_per_expert >= 0; top_p in (0, 1]; temperature > 0; value_head linear or mlp"
            raise ConfigError(
                f"bad options setting(s) {', '.join(f'{k}={getattr(self, k)}' for k in bad)}; allowed: {allowed}"
            )

    def cost_label(self) -> str:
        """The deliberation cost as a figure's title shows it: ``eta=0.02`` (nats per switch) or
        ``eta=0.005/expert`` (nats per expert a switch brings in)."""
        if self.eta_per_expert is None:
            return f"eta={self.eta}"
        return f"eta={self.eta_per_expert}/expert"
