"""MoE option-critic training, read top to bottom as TE-MoE's Algorithm 2 (§4.3, appendix A2).

Every training iteration (:meth:`OptionsTrainer.train_step`) is the algorithm's lines in order:

    line 2        sample prompts x ~ D
    lines 3–13    roll out with teacher mixing: options ω_t per layer (β_t, d_t, PL selection),
                  tokens a_t ~ p_mix = (1 − τ)π_{ω,θ} + τ p_teacher, weights w_t, rewards r_t
    lines 3–16    per MoE layer ℓ: critic loss (ψ), termination loss (ν), selection loss (ϕ)
    line 20       (ν, ψ, ϕ) ← (ν, ψ, ϕ) + α_controller · (1/L)(dν, dψ, dϕ)
    lines 17–19   intra-option policy gradient (θ: LoRA on attention and experts, routers)
    line 20       θ ← θ + α_intra · dθ

The terms are :mod:`moectl.options.option_losses`' functions, named as in §4.3; the rollout is
:mod:`moectl.options.rollout`.

Data parallel (``accelerate launch -m moectl options train …``, :mod:`moectl.distributed`): every
process draws the same global batch of prompts and rolls out its own slice; every draw is keyed
by the row of the global batch (``row_noise.py``), the losses' normalisers are sums over all
processes and the controller's and adapters' gradients are summed over them, so a step on N
processes is the step of one process on the whole batch (to the order of the reductions), and a
checkpoint resumes on any number of processes. Each process holds the frozen base model whole
(or spread over its devices with ``device_map``); rank 0 writes the log and the checkpoints. Defaults are §5's (16 prompts, lr 1e-4 for the controller and 2e-4
for the intra-option policy, LoRA r = α = 16). Checkpoints are atomic and resume exactly
(optimizers and the data generator are saved; every other draw is keyed by the step). Logs the paper's curves (reward, switch rate, P95
and std of the switch probability, value loss, repetition rate, teacher perplexity of the samples)
to ``log.jsonl`` and ``curves.png``.

Deviation (one line): ``critic_warmup`` steps may train ψ alone before ν and ϕ move (0 = the paper).
Beyond the paper (one line): ``eta_per_expert`` charges η_t ∝ the experts a switch loads (``switch_costs``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from moectl.adapters.inspect import inspect
from moectl.distributed import Ranks, check_divides, ranks
from moectl.errors import ConfigError
from moectl.lm.padding import left_pad
from moectl.options.controller import OptionController, build_controller
from moectl.options.option_losses import (
    controller_stats,
    critic_loss,
    intra_option_loss,
    layer_heads,
    selection_loss,
    switch_cost_stats,
    switch_costs,
    termination_loss,
)
from moectl.options.option_state import latest_checkpoint, load_weights, save_checkpoint, save_folder
from moectl.options.options_config import OptionsConfig
from moectl.options.policy import ControllerPolicy
from moectl.options.rollout import Rollout, rollout
from moectl.options.row_noise import row_codes
from moectl.options.step_stats import step_row, tokenize_prompts
from moectl.options.teacher import add_lora
from moectl.stopping import TrainingInterrupted, stop_on_signals
from moectl.train.checkpoint import check_nothing_to_resume
from moectl.train.master_weights import MasterWeights
from moectl.train.runlog import read_log, write_log

__all__ = ["OptionsConfig", "OptionsTrainer", "check_resume", "train_options"]
IGNORED_ON_RESUME = ("steps", "save_every")  # may change between a run and its resumption


class OptionsTrainer:
    """Holds the model (with adapters), controller, optimizers and generators of one run."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        prompts: list[str],
        config: OptionsConfig,
        out: Path,
        processes: Ranks | None = None,
    ) -> None:
        self.ranks = processes if processes is not None else ranks()
        check_divides(config.batch_size, self.ranks.world, "prompts per step")
        self.config, self.out, self.tokenizer = config, Path(out), tokenizer
        if self.ranks.is_main:
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
        self.snapshot = None  # the original routers: the teacher (teacher.py)
        if config.intra:
            with torch.random.fork_rng(devices=[]):  # LoRA A's initialisation, reproducible for a seed
                torch.manual_seed(config.seed)
                model, self.snapshot = add_lora(
                    model, info, config.lora_r, config.lora_alpha, config.train_router, config.lora_experts
                )
            info = inspect(model)
        self.model, self.info = model, info
        self.device = model.get_input_embeddings().weight.device  # where rollouts live (device_map too)
        self.controller.to(self.device)
        self.opt_ctrl = torch.optim.AdamW(self.controller.parameters(), lr=config.lr_controller)
        self.intra_params = [p for p in model.parameters() if p.requires_grad]
        self.masters = MasterWeights(self.intra_params)  # bf16/fp16 routers: float32 masters
        self.opt_intra = (
            torch.optim.AdamW(self.masters.optimizer_params(), lr=config.lr_intra)
            if config.intra and self.intra_params
            else None
        )
        self.policy = ControllerPolicy(self.controller, mode="sample", seed=config.seed + 1)
        self.data_gen = torch.Generator().manual_seed(config.seed + 2)
        self.step = 0
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_id = tokenizer.eos_token_id

    # -- one training iteration: Algorithm 2 ---------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """One iteration of Algorithm 2; returns the step's row of the training curves."""
        cfg, t0 = self.config, time.perf_counter()
        # line 2: sample prompts x ~ D (the global batch; this process takes its rows)
        prompt_ids, prompt_attention, codes = self.sample_prompts()
        # lines 3–13: roll out under the controller (ω_0 = TopK(g_0, k̂); then β_t, d_t ~ Bern(β_t),
        # ω_t by PL-sample at switches), a_t ~ p_mix, w_t = π(a_t)/p_mix(a_t), r_t = log p_teacher − log π
        roll = self.roll_out(prompt_ids, prompt_attention, codes)
        total = self.ranks.total  # Σ over the processes' rows: the whole batch's normalisers
        # lines 3–16 (continued), per MoE layer ℓ: the controller's losses of §4.3
        actor = self.step >= cfg.critic_warmup  # moectl: critic warm-up (0 = the paper)
        loss_controller = torch.zeros((), device=self.device)
        layers = sorted(roll.records)
        # β, Q_Ω, V_Ω, U along t, per layer; η_t: η, or eta_per_expert × the experts a switch brings in
        heads = [layer_heads(self.controller.layers[layer], roll.records[layer], roll) for layer in layers]
        etas = switch_costs(heads, cfg.eta, cfg.eta_per_expert, cfg.cross_layer)
        decides = [self.decides(layer) for layer in layers]
        critics = []
        for h, eta_t, decided in zip(heads, etas, decides, strict=True):
            # ψ, lines 4–12 and 16: (V_Ω − V̂targ)² + (Q_Ω − Q̂targ)², GAE(λ) targets
            critic = critic_loss(h, roll, cfg.gamma, cfg.lam, total)
            # ν, line 13 (eq. 9): w_t·β(h_t, ω_{t−1})·(Q_Ω(h_t, ω_{t−1}) − V_Ω(h_t) + η_t), RMS-normalised
            termination = termination_loss(h, roll, eta_t, total) if actor and decided else 0.0
            # ϕ, lines 14–15 (eq. 10), where d_t = 1: −w_t·log π_sel(ω_t | h_t)·(Q_Ω − V_Ω), RMS-normalised
            selection = selection_loss(h, roll, total) if actor else 0.0
            loss_controller = loss_controller + (cfg.value_coef * critic + termination + selection)
            critics.append(critic)
        loss_controller = loss_controller / max(len(heads), 1)  # line 20's 1/L
        stats = {
            **controller_stats(heads, critics, total, self.ranks.gather),
            **switch_cost_stats(heads, etas, decides, total),
        }
        # line 20: (ν, ψ, ϕ) ← (ν, ψ, ϕ) + α_controller · (1/L)(dν, dψ, dϕ)
        self.update(self.opt_ctrl, loss_controller, list(self.controller.parameters()))
        # lines 17–19: intra-option policy gradient, w_t·∇θ log π_{ω,θ}(a_t)·Ḡ_t (Ḡ_t standardised, A2)
        loss_intra = torch.zeros(())
        if self.opt_intra is not None:
            self.model.train()
            loss_intra = intra_option_loss(self.model, self.info, roll, cfg.gamma, total)
            # line 20: θ ← θ + α_intra · dθ
            self.update(self.opt_intra, loss_intra, self.intra_params, self.masters)
            self.model.eval()
        self.step += 1
        seconds = time.perf_counter() - t0
        row = step_row(self.step, roll, stats, loss_controller, loss_intra, seconds, total)
        if self.ranks.is_main:
            with (self.out / "log.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
        return row

    # -- the steps' pieces ----------------------------------------------------------------------
    def decides(self, layer: int) -> bool:
        """Whether MoE layer ``layer``'s termination head decides its switches (with ``cross_layer``,
        §A4, layer 0's decision is every layer's, so only layer 0's β learns)."""
        return not (self.config.cross_layer and layer > 0)

    def sample_prompts(self) -> tuple[Tensor, Tensor, Tensor]:
        """Line 2: ``batch_size`` prompts drawn with replacement (the same on every process); this
        process's rows, left-padded, and their row codes: (ids, attention, codes)."""
        pick = torch.randint(len(self.prompts), (self.config.batch_size,), generator=self.data_gen)
        rows = torch.arange(self.config.batch_size)[self.ranks.share(self.config.batch_size)]
        ids, attention = left_pad([self.prompts[i] for i in pick[rows].tolist()], self.pad_id, self.device)
        return ids, attention, row_codes(self.config.seed, self.step, rows).to(self.device)

    def roll_out(self, prompt_ids: Tensor, prompt_attention: Tensor, codes: Tensor) -> Rollout:
        """Lines 3–13: the teacher-mixed rollout under the controller (records every decision)."""
        cfg = self.config
        self.model.eval()
        return rollout(
            self.model,
            self.info,
            self.policy,
            prompt_ids,
            prompt_attention,
            cfg.max_new_tokens,
            cfg.tau,
            cfg.temperature,
            cfg.top_p,
            self.eos_id,
            self.pad_id,
            router_snapshot=self.snapshot,
            codes=codes,
        )

    def update(
        self,
        optimizer: torch.optim.Optimizer,
        loss: Tensor,
        params: list[nn.Parameter],
        masters: MasterWeights | None = None,
    ) -> None:
        """Line 20: one gradient step on ``loss``; the gradients summed over the processes first
        (each process's loss is its share of the whole batch's). With ``masters``, the optimizer
        steps their float32 masters and the model's half-precision parameters follow."""
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.ranks.reduce_gradients(params)
        if masters is not None:
            masters.to_masters()
        optimizer.step()
        if masters is not None:
            masters.to_model()

    # -- state --------------------------------------------------------------------------------
    def _trainer_state(self) -> dict[str, Any]:
        return {
            "opt_ctrl": self.opt_ctrl.state_dict(),
            "opt_intra": self.opt_intra.state_dict() if self.opt_intra else None,
            "masters": self.masters.state_dict(),
            "data_gen": self.data_gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "world_size": self.ranks.world,  # for the record: any world size resumes it
        }

    def save(self) -> Path | None:
        """Rank 0 writes ``checkpoints/step-N`` (every process holds the same state); the others wait."""
        path = None
        if self.ranks.is_main:
            cfg = asdict(self.config)
            path = save_checkpoint(
                self.out, self.step, self.controller, self.model, self.info, cfg, self._trainer_state()
            )
        self.ranks.barrier()
        return path

    def _save_final(self, cfg: dict) -> Path:
        path = self.out / "final"
        if self.ranks.is_main:
            save_folder(path, self.controller, self.model, self.info, cfg)
        self.ranks.barrier()
        return path

    def resume(self) -> bool:
        path = check_resume(self.out, self.config)
        if path is None:
            return False
        from safetensors.torch import load_file

        check_controller_fits(path, self.controller)
        self.controller.load_state_dict(load_file(str(path / "controller.safetensors")))
        load_weights(path, self.model, self.info)
        state = torch.load(path / "trainer_state.pt", weights_only=True)  # no code in a shared run
        self.opt_ctrl.load_state_dict(state["opt_ctrl"])
        self.masters.load_state_dict(state.get("masters"))  # absent: older checkpoints, from the weights
        if self.opt_intra is not None and state["opt_intra"] is not None:
            self.opt_intra.load_state_dict(state["opt_intra"])
        self.data_gen.set_state(state["data_gen"])
        torch.set_rng_state(state["torch_rng"])
        self.step = int(state["step"])
        log = self.out / "log.jsonl"
        if self.ranks.is_main and log.exists():  # drop lines written after the checkpoint (atomically)
            write_log(log, [r for r in read_log(log) if r["step"] <= self.step])
        self.ranks.barrier()
        return True


def check_resume(out: str | Path, config: OptionsConfig) -> Path | None:
    """The latest complete checkpoint in ``out`` (None if none) if ``config`` may continue it;
    ``ValueError`` naming the settings that differ and the fix otherwise (before any work)."""
    path = latest_checkpoint(Path(out))
    if path is None:
        check_nothing_to_resume(Path(out), "give a new --out, or --no-resume to start afresh")
        return None
    saved = json.loads((path / "options.json").read_text())
    mine = asdict(config)
    differ = sorted(k for k in mine if k not in IGNORED_ON_RESUME and saved.get(k) != mine[k])
    if differ:
        changes = ", ".join(f"{k} {saved.get(k)!r} → {mine[k]!r}" for k in differ)
        raise ConfigError(
            f"{path} was trained with other settings ({changes}): resume with the checkpoint's "
            "settings, or give a new --out (or --no-resume) to start afresh"
        )
    return path


def check_controller_fits(path: Path, controller: OptionController) -> None:
    """``ValueError`` if the checkpoint's controller was built for another model (shapes)."""
    saved = json.loads((path / "controller.json").read_text())
    mine = controller.config.to_dict()
    keys = ("hidden_size", "num_experts", "k_hat", "d_e", "d_h")
    if any(saved.get(k) != mine[k] for k in keys):
        shown = {k: saved.get(k) for k in keys}
        raise ConfigError(
            f"{path} holds a controller for another model ({shown}, this model: "
            f"{ {k: mine[k] for k in keys} }): resume with the model it was trained on, or give a new --out"
        )


def train_options(
    model: nn.Module,
    tokenizer,
    prompts: list[str],
    config: OptionsConfig,
    out: str | Path,
    resume: bool = True,
    progress: bool = True,
    stop_after: int | None = None,
    processes: Ranks | None = None,
) -> dict[str, Any]:
    """Train controllers (and LoRA adapters) on ``prompts``; write ``out/final`` and the curves.

    ``stop_after`` ends the process-level loop early at that step (for tests of resuming). Ctrl-C or
    SIGTERM stops after the current step, checkpoints it and raises ``TrainingInterrupted``.
    ``processes``: the data-parallel processes (default: the launched ones, :func:`moectl.distributed.ranks`).
    """
    out = Path(out)
    processes = processes if processes is not None else ranks()
    check_divides(config.batch_size, processes.world, "prompts per step")
    if resume:
        check_resume(out, config)  # a checkpoint of other settings: refused before the model is touched
    if processes.is_main:
        out.mkdir(parents=True, exist_ok=True)
    processes.barrier()
    trainer = OptionsTrainer(model, tokenizer, prompts, config, out, processes)
    resumed = trainer.resume() if resume else False
    if not resumed and processes.is_main:  # step 1 afresh: a log of an earlier start is not continued
        (out / "log.jsonl").unlink(missing_ok=True)
    from moectl.progress import progress_bar

    rows: list[dict] = []
    # steps i/N with the last step's reward: on an interactive terminal only, gone when done
    # (log.jsonl is the record; a redirected run prints nothing per step)
    shown = progress and processes.is_main
    with stop_on_signals() as stop, progress_bar("options", shown, suffix="{task.fields[info]}") as bar:
        task = bar.add_task("train", total=config.steps, completed=trainer.step, info="")
        while trainer.step < config.steps:
            row = trainer.train_step()
            rows.append(row)
            bar.update(
                task,
                completed=trainer.step,
                info=f"reward {row['reward']:.3f} switch {row['switch_rate']:.3f}",
            )
            saved = trainer.step % config.save_every == 0 or trainer.step == config.steps
            if saved:
                trainer.save()
            if stop_after is not None and trainer.step >= stop_after:
                return {"stopped_at": trainer.step, "rows": rows, "resumed": resumed}
            # Ctrl-C / SIGTERM: rank 0's request, for every process; the finished step checkpointed
            if processes.broadcast_object(stop.requested if processes.is_main else None):
                if not saved:
                    trainer.save()
                raise TrainingInterrupted(
                    out,
                    trainer.step,
                    resume=f"the same `moectl options train` command (it resumes from {out})",
                )
    final = trainer._save_final(asdict(config))
    log = processes.broadcast_object(_read_log(out) if processes.is_main else None)
    if processes.is_main:
        from moectl.reporting.option_plots import plot_curves

        plot_curves(log, out / "curves.png", title=f"k-hat={config.k_hat}, {config.cost_label()}")
    return {"final": str(final), "rows": rows, "resumed": resumed, "log": log}


def _read_log(out: Path) -> list[dict[str, Any]]:
    return read_log(out / "log.jsonl")
