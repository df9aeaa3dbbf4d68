"""Pretraining loop for moectl's MoEs: the standard objective and EMO's document-pool objective.

One readable loop (nanoGPT style): document-aware packed batches, AdamW with linear warmup and
cosine decay, load-balancing and router z-losses, gradient accumulation, ``accelerate`` for data
parallelism (also on CPU with gloo) and bf16 on GPU, atomic checkpoints and exact resume (the
batch of a step and EMO's pool sizes are pure functions of the step, so resuming restores the
weights, optimizer and scheduler and nothing else is needed), a progress bar with tokens/s, a
JSONL log and a loss-curve PNG.

EMO (§3.2–3.3, A.1–A.2): per document, pool = top-d of the mean routing probabilities over its
tokens, d ~ U{k, ..., n_r} per document; routing restricted to the pool and renormalised; shared
experts always on (they sit outside the router); global load balancing.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from moectl.adapters.inspect import inspect
from moectl.errors import OutputExistsError
from moectl.io.portable_config import make_portable
from moectl.models.grouped_experts import register as register_grouped_experts
from moectl.progress import progress_bar
from moectl.routing.pool import DocumentPool, sample_pool_sizes
from moectl.routing.session import route
from moectl.stopping import StopRequest, TrainingInterrupted, stop_on_signals
from moectl.train.checkpoint import (
    check_nothing_to_resume,
    latest_checkpoint,
    load_trainer_state,
    save_checkpoint,
    write_dir_atomic,
)
from moectl.train.lb_window import CountWindow
from moectl.train.model import build_model
from moectl.train.objective import NextTokenLoss
from moectl.train.packing import PackedSplit, batch_indices, load_or_pack
from moectl.train.pretrain_losses import all_reduce_sum, expert_counts, load_balancing_loss, router_z_loss
from moectl.train.runlog import read_log, write_log
from moectl.train.train_config import TrainConfig


def lr_lambda(config: TrainConfig):
    """Linear warmup to lr, then cosine decay to lr * min_lr_ratio at max_steps."""

    def factor(step: int) -> float:
        if config.warmup_steps and step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine

    return factor


def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    from moectl.data.tokenizer_train import default_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(path or default_tokenizer_dir()))


def _emo_policy(
    config: TrainConfig, doc_ids: torch.Tensor, k: int, n_r: int, step: int, micro: int, rank: int
):
    """EMO's document pool for one micro-batch, pool sizes drawn from a generator seeded by the step."""
    generator = torch.Generator().manual_seed(hash((config.seed, step, micro, rank)) % 2**63)
    d = sample_pool_sizes(doc_ids, config.pool_d_min or k, config.pool_d_max or n_r, generator)
    return DocumentPool(d, mode="full", doc_ids=doc_ids)


class Trainer:
    """Holds the run's state: model, optimizer, data, accelerator; ``fit()`` trains to max_steps."""

    def __init__(
        self, config: TrainConfig, resume: bool = False, progress: bool = True, overwrite: bool = False
    ) -> None:
        from accelerate import Accelerator
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no "Loading weights" / "Writing model shards" bars: ours shows progress
        self.config = config
        self.out = Path(config.out)
        self.progress = progress
        # bf16 autocast on CPU too: this CPU multiplies bf16 ~4x as fast as fp32 (benchmarks/pretrain.py)
        # no GPU: join the launcher's processes over gloo on CPU (without cpu=True a process started by
        # `accelerate launch --multi_gpu` with no GPU visible would train alone)
        self.accelerator = Accelerator(
            mixed_precision="bf16" if config.bf16 else "no", cpu=not torch.cuda.is_available()
        )
        self.tokenizer = load_tokenizer(config.tokenizer)
        corpus = config.corpus or str(_sample_dir())
        cache = self.out / "data"
        if not resume and not overwrite and (self.out / "config.json").exists():
            raise OutputExistsError(
                f"{self.out} already holds a run; continue it with --resume {self.out}, "
                "or pass --overwrite to start it again from step 0"
            )
        with self.accelerator.main_process_first():  # one process tokenises, the others read its cache
            if overwrite and not resume and self.accelerator.is_main_process:
                shutil.rmtree(self.out / "checkpoints", ignore_errors=True)
                shutil.rmtree(cache, ignore_errors=True)  # a fresh start packs its data afresh too
            self.train_data = load_or_pack(
                cache / "train.pt", corpus, "train", self.tokenizer, config.seq_len
            )
            self.val_data = load_or_pack(
                cache / "validation.pt",
                corpus,
                "validation",
                self.tokenizer,
                config.seq_len,
                self.train_data.domains,
            )
        # a run stopped before its first checkpoint resumes from step 0
        checkpoint = latest_checkpoint(self.out) if resume else None
        if resume and checkpoint is None:
            check_nothing_to_resume(self.out)
        self.start_step = 0
        model_source = checkpoint or (Path(config.anneal_from) if config.anneal_from else None)
        if model_source is not None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_source, dtype=torch.float32)
        else:
            special = {
                "bos_token_id": self.tokenizer.bos_token_id,
                "eos_token_id": self.tokenizer.eos_token_id,
                "pad_token_id": self.tokenizer.pad_token_id,
            }
            model = build_model(config.model_kwargs(), len(self.tokenizer), special, config.seed)
        self.info = inspect(model)
        if hasattr(model, "set_experts_implementation"):
            impl = config.experts_implementation
            model.set_experts_implementation(register_grouped_experts() if impl == "moectl_grouped" else impl)
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
        no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": config.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=config.lr,
            betas=config.betas,
            fused=config.fused_adamw,  # one kernel for all parameters: 3.4x torch's foreach step on CPU
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
        self.lb_window = CountWindow(config.lb_window, len(self.info.layers), self.info.num_experts)
        if checkpoint is not None:
            state = load_trainer_state(checkpoint)
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            if "lb_window" in state:
                self.lb_window.load_state_dict(state["lb_window"])
            self.start_step = int(state["step"]) + 1
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(
            NextTokenLoss(model, fused=config.fused_ce), optimizer, scheduler
        )
        self.raw_model = self.accelerator.unwrap_model(self.model).model
        self.log_path = self.out / "log.jsonl"
        self.stop = StopRequest()
        if self.accelerator.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            config.save(self.out / "config.json")
            truncate_log(self.log_path, self.start_step)

    # -- one optimisation step ---------------------------------------------------------------
    def _micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        c, acc = self.config, self.accelerator
        return [
            self.train_data.batch(
                batch_indices(
                    self.train_data.rows,
                    c.seed,
                    step,
                    m,
                    acc.process_index,
                    c.grad_accum,
                    acc.num_processes,
                    c.micro_batch,
                )
            )
            for m in range(c.grad_accum)
        ]

    def _policies(self, batch: dict[str, torch.Tensor], step: int, micro: int) -> list:
        if self.config.objective != "emo":
            return []
        k, n_r = self.info.top_k, self.info.num_experts
        doc_ids = batch["doc_ids"].to(self.accelerator.device)
        return [_emo_policy(self.config, doc_ids, k, n_r, step, micro, self.accelerator.process_index)]

    @torch.no_grad()
    def _global_counts(
        self, batches: list[dict[str, torch.Tensor]], step: int
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Expert counts over the whole global batch: a no-grad routing pass over every micro-batch."""
        counts = [torch.zeros(self.info.num_experts, dtype=torch.float64) for _ in self.info.layers]
        tokens = torch.zeros((), dtype=torch.float64)
        for m, batch in enumerate(batches):
            ids = batch["input_ids"].to(self.accelerator.device)
            with (
                route(
                    self.raw_model, self._policies(batch, step, m), collect=True, info=self.info
                ) as session,
                self.accelerator.autocast(),
            ):
                self.raw_model.model(input_ids=ids)  # the decoder alone: routing needs no logits
            valid = torch.ones_like(ids, dtype=torch.bool)
            for i, (_, chosen) in session.collected.items():
                counts[i] += expert_counts(chosen, valid, self.info.num_experts).cpu()
            tokens += valid.sum().cpu()
        return [all_reduce_sum(c.to(self.accelerator.device)) for c in counts], all_reduce_sum(
            tokens.to(self.accelerator.device)
        )

    def train_step(self, step: int) -> dict[str, float]:
        """One optimiser step over ``grad_accum`` micro-batches; returns the step's mean losses."""
        c, acc = self.config, self.accelerator
        self.model.train()
        batches = self._micro_batches(step)
        pre = self._global_counts(batches, step) if c.lb_scope == "global" and c.grad_accum > 1 else None
        sums = {"loss": 0.0, "ce": 0.0, "lb": 0.0, "z": 0.0}
        past_counts, past_tokens = self.lb_window.history()  # zeros when lb_window = 0
        step_counts = torch.zeros_like(past_counts)
        step_tokens = torch.zeros((), dtype=torch.float64)
        for m, batch in enumerate(batches):
            ids = batch["input_ids"].to(acc.device)
            sync = acc.no_sync(self.model) if m < len(batches) - 1 else nullcontext()
            with (
                sync,
                route(
                    self.raw_model, self._policies(batch, step, m), collect=True, info=self.info
                ) as session,
            ):
                with acc.autocast():
                    ce = self.model(ids)
                valid = torch.ones_like(ids, dtype=torch.bool)
                if pre is not None:
                    tokens = pre[1]
                else:  # the same for every layer: counted (and reduced) once per micro-batch
                    tokens = valid.sum().to(torch.float64)
                    if c.lb_scope != "micro":
                        tokens = all_reduce_sum(tokens)
                micro_tokens = float(tokens)
                lb_terms, z_terms = [], []
                for i, (logits, chosen) in session.collected.items():
                    if pre is not None:
                        counts = pre[0][i]
                    else:
                        counts = expert_counts(chosen, valid, self.info.num_experts).to(acc.device)
                        if c.lb_scope != "micro":
                            counts = all_reduce_sum(counts)
                        step_counts[i] += counts.detach().cpu()
                    pooled = tokens
                    if c.lb_window:  # f pooled with the previous lb_window steps (train/lb_window.py)
                        counts = counts + past_counts[i].to(counts.device)
                        pooled = tokens + past_tokens.to(counts.device)
                    lb_terms.append(load_balancing_loss(logits, valid, counts, pooled))
                    z_terms.append(router_z_loss(logits, valid))
                step_tokens += micro_tokens
                lb, z = torch.stack(lb_terms).mean(), torch.stack(z_terms).mean()
                loss = ce + c.lb_coef * lb + c.z_coef * z
                acc.backward(loss / c.grad_accum)
            for key, value in (("loss", loss), ("ce", ce), ("lb", lb), ("z", z)):
                sums[key] += float(value.detach()) / c.grad_accum
        if pre is not None:
            step_counts, step_tokens = torch.stack([x.cpu() for x in pre[0]]), pre[1].cpu()
        self.lb_window.push(step_counts, step_tokens)
        grad_norm = (
            acc.clip_grad_norm_(self.model.parameters(), c.grad_clip)
            if c.grad_clip > 0
            else torch.tensor(0.0)
        )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        sums["grad_norm"] = float(grad_norm)
        sums["lr"] = self.scheduler.get_last_lr()[0]
        return sums

    # -- evaluation -----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, data: PackedSplit | None = None, batches: int | None = None) -> dict[str, Any]:
        """Validation loss as a full model (no pools: EMO Table 1), overall and per domain."""
        data = data or self.val_data
        self.model.eval()
        n_rows = data.rows if batches is None else min(data.rows, batches * self.config.micro_batch)
        # a limited evaluation takes rows spread over the split, so every domain is represented
        picked = torch.linspace(0, data.rows - 1, n_rows).round().long().unique()
        loss_sum = torch.zeros(len(data.domains), dtype=torch.float64)
        count = torch.zeros(len(data.domains), dtype=torch.float64)
        for start in range(0, len(picked), self.config.micro_batch):
            batch = data.batch(picked[start : start + self.config.micro_batch])
            ids = batch["input_ids"].to(self.accelerator.device)
            logits = self.raw_model(input_ids=ids).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            dom = batch["domain"][:, 1:].long().flatten()
            loss_sum += torch.zeros_like(loss_sum).index_add_(0, dom, nll.flatten().double().cpu())
            count += torch.bincount(dom, minlength=len(data.domains)).double()
        per_domain = {d: float(loss_sum[i] / count[i]) for i, d in enumerate(data.domains) if count[i] > 0}
        return {
            "val_loss": float(loss_sum.sum() / count.sum()),
            "val_loss_per_domain": per_domain,
            "val_tokens": int(count.sum()),
        }

    # -- the loop -------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        c, acc = self.config, self.accelerator
        tokens_per_step = c.tokens_per_step(acc.num_processes)
        # resumed after its last step (a crash while writing final/): the final record's training
        # figures are the last logged step's, as in the run that was not interrupted
        logged = read_log(self.log_path) if self.start_step and acc.is_main_process else []
        last: dict[str, Any] = next((r for r in reversed(logged) if "ce" in r and not r.get("final")), {})
        window_start, window_tokens = time.perf_counter(), 0
        shown = self.progress and acc.is_main_process  # steps i/N on an interactive terminal only
        with progress_bar("[bold]{task.description}", shown, suffix="{task.fields[stats]}") as bar:
            task = bar.add_task(
                f"{c.objective} {c.preset}", total=c.max_steps, completed=self.start_step, stats=""
            )
            for step in range(self.start_step, c.max_steps):
                if self.stop.requested:
                    if step > self.start_step:
                        self.save(step - 1)
                    raise TrainingInterrupted(self.out, step - 1)
                stats = self.train_step(step)
                window_tokens += tokens_per_step
                stats.update(step=step, tokens=(step + 1) * tokens_per_step)
                if (step + 1) % c.log_every == 0 or step == c.max_steps - 1:
                    elapsed = time.perf_counter() - window_start
                    stats["tokens_per_s"] = window_tokens / max(elapsed, 1e-9)
                    window_start, window_tokens = time.perf_counter(), 0
                    if c.eval_every and (step + 1) % c.eval_every == 0:
                        stats.update(self.evaluate(batches=c.eval_batches))
                    self._log(stats)
                    bar.update(
                        task,
                        stats=f"loss {stats['ce']:.3f}  lb {stats['lb']:.2f}  {stats['tokens_per_s']:.0f} tok/s",
                    )
                bar.advance(task)
                if c.checkpoint_every and (step + 1) % c.checkpoint_every == 0 and step != c.max_steps - 1:
                    self.save(step)
                last = stats
        final = self.evaluate(batches=c.final_eval_batches or None)
        final.update({k: last.get(k) for k in ("ce", "lb", "z", "tokens_per_s")}, step=c.max_steps - 1)
        self.save(c.max_steps - 1)  # every process: save() waits for all, then the main one writes
        if acc.is_main_process:
            self._log({"final": True, **final})
            write_dir_atomic(self.out / "final", self._write_final)  # old or new final/, never a mix
            plot_loss_curve(self.log_path, self.out / "loss_curve.png")
        return final

    def _write_final(self, folder: Path) -> None:
        self.raw_model.save_pretrained(folder, safe_serialization=True)
        self.tokenizer.save_pretrained(folder)
        make_portable(folder)  # the config keys and tokenizer class other loaders read

    def save(self, step: int) -> Path | None:
        self.accelerator.wait_for_everyone()
        if not self.accelerator.is_main_process:
            return None
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "lb_window": self.lb_window.state_dict(),
        }
        path = save_checkpoint(
            self.out, step, self.raw_model, self.tokenizer, state, self.config.keep_checkpoints
        )
        plot_loss_curve(self.log_path, self.out / "loss_curve.png")
        return path

    def _log(self, record: dict[str, Any]) -> None:
        if not self.accelerator.is_main_process:
            return
        with self.log_path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")


def truncate_log(log_path: Path, start_step: int) -> None:
    """Drop log records of steps >= ``start_step`` (written after the checkpoint a run resumes from),
    so the log and the loss curve continue without repeats; a fresh run (0) starts a new log. The
    rewrite is atomic, and a last line torn by a crash is dropped with a warning (``runlog``)."""
    if not log_path.exists():
        return
    if start_step == 0:
        log_path.unlink()
        return
    kept = [r for r in read_log(log_path) if r.get("step", -1) < start_step and not r.get("final")]
    write_log(log_path, kept)


def _sample_dir() -> Path:
    from moectl.data.sample import sample_corpus_dir

    return sample_corpus_dir()


def plot_loss_curve(log_path: Path, png: Path) -> Path | None:
    """Training loss (and validation loss where logged) against tokens."""
    if not log_path.exists():
        return None
    from moectl.reporting.plots import plot_curves

    rows = read_log(log_path)
    train = [r for r in rows if "ce" in r and not r.get("final")]
    if not train:
        return None
    series = {"train CE": ([r["tokens"] for r in train], [r["ce"] for r in train])}
    val = [r for r in train if "val_loss" in r]
    final = next((r for r in reversed(rows) if r.get("final")), None)
    if final is not None:  # the final evaluation (whole validation split) closes the curve
        val.append({"tokens": train[-1]["tokens"], "val_loss": final["val_loss"]})
    if val:
        series["validation (full model)"] = ([r["tokens"] for r in val], [r["val_loss"] for r in val])
    config_path = log_path.parent / "config.json"
    title = None
    if config_path.exists():
        config = json.loads(config_path.read_text())
        title = f"{config.get('objective', '')} objective, {config.get('preset', '')} preset: {log_path.parent.name}"
    return plot_curves(
        series, png, xlabel="training tokens", ylabel="cross-entropy (nats/token)", title=title
    )


def pretrain(
    config: TrainConfig, resume: bool = False, progress: bool = True, overwrite: bool = False
) -> dict[str, Any]:
    """Train (or resume) a run; returns the final evaluation.

    Ctrl-C or SIGTERM (in the main thread) stops after the current step, checkpoints it and raises
    ``TrainingInterrupted`` naming the resume command; a second Ctrl-C stops at once.
    """
    with stop_on_signals() as stop:
        trainer = Trainer(config, resume=resume, progress=progress, overwrite=overwrite)
        trainer.stop = stop
        return trainer.fit()
