"""Options training loop (TE-MoE §4.3, Algorithm 2; defaults from §5).

Each step: sample a batch of prompts, roll out with teacher mixing, update the controller
(termination, selection, critics; lr 1e-4) and the intra-option policy (LoRA on attention and
experts, routers trainable; lr 2e-4). Checkpoints are atomic and resume exactly (optimizers and
every random generator are saved). Logs the paper's curves (reward, switch rate, P95 and std of
the switch probability, value loss, repetition rate, teacher perplexity of the samples) to
``log.jsonl`` and ``curves.png``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moectl.adapters.inspect import inspect
from moectl.options.controller import OptionController, build_controller
from moectl.options.losses import controller_loss, intra_option_loss
from moectl.options.policy import ControllerPolicy
from moectl.options.rollout import Rollout, left_pad, rollout
from moectl.options.state import latest_checkpoint, load_weights, save_checkpoint, save_folder
from moectl.options.teacher import add_lora


@dataclass
class OptionsConfig:
    """Training configuration; names follow the paper (k̂, η, τ, γ, λ)."""

    k_hat: int
    eta: float = 0.02  # deliberation cost η (reward units: nats per token)
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
    value_head: str = "mlp"  # V_Ω: "linear" (A2) or "mlp" (see LayerController.v)

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
            "top_p": 0.0 < self.top_p <= 1.0,
            "temperature": self.temperature > 0,
            "save_every": self.save_every >= 1,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            allowed = "steps, batch_size, save_every >= 1; max_new_tokens >= 2; tau, gamma, lam in [0, 1]; eta >= 0; top_p in (0, 1]; temperature > 0"
            raise ValueError(
                f"bad options setting(s) {', '.join(f'{k}={getattr(self, k)}' for k in bad)}; allowed: {allowed}"
            )


def repetition_rate(roll: Rollout) -> float:
    """1 − unique-token fraction of each sampled continuation, averaged (§A3)."""
    rates = []
    for row, valid in zip(roll.actions.tolist(), roll.valid.tolist(), strict=False):
        tokens = [a for a, v in zip(row, valid, strict=False) if v]
        if tokens:
            rates.append(1.0 - len(set(tokens)) / len(tokens))
    return sum(rates) / max(len(rates), 1)


def tokenize_prompts(tokenizer, prompts: list[str], max_tokens: int) -> list[list[int]]:
    out = []
    for text in prompts:
        ids = tokenizer.encode(text)[:max_tokens]
        if ids:
            out.append(list(ids))
    if not out:
        raise ValueError("no prompt produced any token")
    return out


class OptionsTrainer:
    """Holds the model (with adapters), controller, optimizers and generators of one run."""

    def __init__(
        self, model: nn.Module, tokenizer, prompts: list[str], config: OptionsConfig, out: Path
    ) -> None:
        self.config, self.out, self.tokenizer = config, Path(out), tokenizer
        self.out.mkdir(parents=True, exist_ok=True)
        self.prompts = tokenize_prompts(tokenizer, prompts, config.max_prompt_tokens)
        info = inspect(model)
        self.controller: OptionController = build_controller(
            info,
            config.k_hat,
            config.d_e,
            config.d_h,
            config.cross_layer,
            seed=config.seed,
            value_head=config.value_head,
        )
        self.snapshot = None
        if config.intra:
            with torch.random.fork_rng(devices=[]):  # LoRA A's initialisation, reproducible for a seed
                torch.manual_seed(config.seed)
                model, self.snapshot = add_lora(
                    model, info, config.lora_r, config.lora_alpha, config.train_router, config.lora_experts
                )
            info = inspect(model)
        self.model, self.info = model, info
        self.device = next(model.parameters()).device
        self.opt_ctrl = torch.optim.AdamW(self.controller.parameters(), lr=config.lr_controller)
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt_intra = torch.optim.AdamW(params, lr=config.lr_intra) if config.intra and params else None
        self.policy = ControllerPolicy(self.controller, mode="sample", seed=config.seed + 1)
        self.data_gen = torch.Generator().manual_seed(config.seed + 2)
        self.sample_gen = torch.Generator(device=self.device).manual_seed(config.seed + 3)
        self.step = 0
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_id = tokenizer.eos_token_id

    # -- state --------------------------------------------------------------------------------
    def _trainer_state(self) -> dict[str, Any]:
        return {
            "opt_ctrl": self.opt_ctrl.state_dict(),
            "opt_intra": self.opt_intra.state_dict() if self.opt_intra else None,
            "data_gen": self.data_gen.get_state(),
            "sample_gen": self.sample_gen.get_state(),
            "policy_gen": self.policy._gen(self.device).get_state(),
            "torch_rng": torch.get_rng_state(),
        }

    def save(self) -> Path:
        cfg = asdict(self.config)
        return save_checkpoint(
            self.out, self.step, self.controller, self.model, self.info, cfg, self._trainer_state()
        )

    def _save_final(self, cfg: dict) -> Path:
        return save_folder(self.out / "final", self.controller, self.model, self.info, cfg)

    def resume(self) -> bool:
        path = latest_checkpoint(self.out)
        if path is None:
            return False
        from safetensors.torch import load_file

        saved = json.loads((path / "options.json").read_text())
        mine = asdict(self.config)
        differ = {k for k in mine if k not in ("steps", "save_every") and saved.get(k) != mine[k]}
        if differ:
            raise ValueError(
                f"{path}: checkpoint was trained with different settings ({sorted(differ)}); use a new --out"
            )
        self.controller.load_state_dict(load_file(str(path / "controller.safetensors")))
        load_weights(path, self.model, self.info)
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        self.opt_ctrl.load_state_dict(state["opt_ctrl"])
        if self.opt_intra is not None and state["opt_intra"] is not None:
            self.opt_intra.load_state_dict(state["opt_intra"])
        self.data_gen.set_state(state["data_gen"])
        self.sample_gen.set_state(state["sample_gen"])
        self.policy._gen(self.device).set_state(state["policy_gen"])
        torch.set_rng_state(state["torch_rng"])
        self.step = int(state["step"])
        log = self.out / "log.jsonl"
        if log.exists():  # drop lines written after the checkpoint
            lines = [ln for ln in log.read_text().splitlines() if ln and json.loads(ln)["step"] <= self.step]
            log.write_text("".join(ln + "\n" for ln in lines))
        return True

    # -- one step -----------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        cfg = self.config
        t0 = time.perf_counter()
        pick = torch.randint(len(self.prompts), (cfg.batch_size,), generator=self.data_gen).tolist()
        ids, attn = left_pad([self.prompts[i] for i in pick], self.pad_id, self.device)
        self.model.eval()
        roll = rollout(
            self.model,
            self.info,
            self.policy,
            ids,
            attn,
            cfg.max_new_tokens,
            cfg.tau,
            cfg.temperature,
            cfg.top_p,
            self.eos_id,
            self.pad_id,
            self.sample_gen,
            self.snapshot,
        )
        loss_c, stats = controller_loss(
            self.controller,
            roll,
            cfg.eta,
            cfg.gamma,
            cfg.lam,
            cfg.value_coef,
            actor=self.step >= cfg.critic_warmup,
        )
        self.opt_ctrl.zero_grad(set_to_none=True)
        loss_c.backward()
        self.opt_ctrl.step()
        loss_i = torch.zeros(())
        if self.opt_intra is not None:
            self.model.train()
            loss_i = intra_option_loss(self.model, self.info, roll, cfg.gamma)
            self.opt_intra.zero_grad(set_to_none=True)
            loss_i.backward()
            self.opt_intra.step()
            self.model.eval()
        self.step += 1
        valid = roll.valid.float()
        n = valid.sum().clamp(min=1)
        row = {
            "step": self.step,
            "reward": float((roll.rewards * valid).sum() / n),
            "switch_rate": stats["switch_rate"],
            "switch_prob_mean": stats["beta_mean"],
            "switch_prob_p95": stats["beta_p95"],
            "switch_prob_std": stats["beta_std"],
            "value_loss": stats["value_loss"],
            "repetition_rate": repetition_rate(roll),
            "teacher_ppl": float(torch.exp(-(roll.logp_teacher * valid).sum() / n)),
            "controller_loss": float(loss_c.detach()),
            "intra_loss": float(loss_i.detach()),
            "tokens": int(n),
            "seconds": time.perf_counter() - t0,
            "switch_rate_per_layer": stats["switch_rate_per_layer"],
        }
        with (self.out / "log.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        return row


def train_options(
    model: nn.Module,
    tokenizer,
    prompts: list[str],
    config: OptionsConfig,
    out: str | Path,
    resume: bool = True,
    progress: bool = True,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train controllers (and LoRA adapters) on ``prompts``; write ``out/final`` and the curves.

    ``stop_after`` ends the process-level loop early at that step (for tests of resuming).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    trainer = OptionsTrainer(model, tokenizer, prompts, config, out)
    resumed = trainer.resume() if resume else False
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    rows: list[dict] = []
    columns = (
        TextColumn("options"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("train", total=config.steps, completed=trainer.step, info="")
        while trainer.step < config.steps:
            row = trainer.train_step()
            rows.append(row)
            bar.update(
                task,
                completed=trainer.step,
                info=f"reward {row['reward']:.3f} switch {row['switch_rate']:.3f}",
            )
            if trainer.step % config.save_every == 0 or trainer.step == config.steps:
                trainer.save()
            if stop_after is not None and trainer.step >= stop_after:
                return {"stopped_at": trainer.step, "rows": rows, "resumed": resumed}
    final = trainer._save_final(asdict(config))
    from moectl.options.plots import plot_curves

    log = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines() if ln]
    plot_curves(log, out / "curves.png", title=f"k-hat={config.k_hat}, eta={config.eta}")
    return {"final": str(final), "rows": rows, "resumed": resumed, "log": log}
