"""Fine-tune an expert subset (EMO §5.2 "with fine-tuning", appendix C).

EMO appendix C: "we mask the input portion of the prompt and optimize only over output tokens.
Unless otherwise specified, finetuning follows standard Hugging Face settings with one epoch,
batch size 32, and learning rate 5e-5." The Hugging Face ``Trainer`` defaults behind "standard
settings" are AdamW (β = 0.9, 0.999, ε = 1e-8, no weight decay), a *linear* decay from the peak
learning rate to 0 with no warmup, and gradient clipping at norm 1 — ``FinetuneConfig``'s defaults.
The effective batch of 32 examples is reached by gradient accumulation over micro-batches; the
loss is the mean over every output token of the effective batch (as the Trainer computes it),
so the micro-batch size does not change the result. The loss is cross-entropy only (no router
auxiliary loss). ``lora=r`` trains LoRA adapters instead (PEFT; attention and other linear layers
plus the fused expert weights) and merges them into the weights before returning.

Data parallel (``accelerate launch -m moectl subset finetune …``, :mod:`moectl.distributed`): every
process draws the same order, takes its contiguous part of each step's examples and accumulates
their summed token loss over the *step's* output tokens; the gradients are then summed over the
processes, so a step on N processes is the one-process step on the whole batch (to the order of
the reductions). The batch size must split evenly over the processes; each holds the whole model.

    log = finetune_subset(model, tokenizer, read_examples("math_train.jsonl"))
    save_finetuned(model, tokenizer, "math-8-ft/", log, source="math-8/")
"""

from __future__ import annotations

import json
import math
import shutil
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import Progress, TaskID
from torch import Tensor, nn

from moectl.distributed import Ranks, check_divides, ranks
from moectl.errors import ConfigError
from moectl.io.portable_config import make_portable
from moectl.progress import progress_bar
from moectl.subsets.finetune_data import Example, as_example, collate, encode_example, targets
from moectl.train.checkpoint import write_dir_atomic
from moectl.train.master_weights import MasterWeights

LOG = "finetune.json"
SCHEDULES = ("linear", "constant", "cosine")


@dataclass
class FinetuneConfig:
    """EMO appendix C's knobs; the defaults are its "standard Hugging Face settings"."""

    epochs: int = 1
    lr: float = 5e-5
    batch_size: int = 32  # examples per optimiser step (effective batch)
    micro_batch_size: int = 8  # examples per forward/backward pass
    max_length: int = 512
    schedule: str = "linear"  # linear decay to 0 (HF default) | constant | cosine
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    lora: int | None = None  # LoRA rank; None: full fine-tuning
    lora_alpha: float | None = None  # default 2·rank
    master_weights: bool = True  # float32 masters of bf16/fp16 trained weights (train/master_weights.py)
    max_steps: int | None = None  # stop early (a budget); None: the whole epochs
    seed: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise ConfigError(f"epochs must be at least 1, got {self.epochs}")
        if not self.lr > 0:
            raise ConfigError(f"the learning rate must be positive, got {self.lr}")
        if not 1 <= self.micro_batch_size <= self.batch_size:
            raise ConfigError(
                f"need 1 <= micro batch size <= batch size, got {self.micro_batch_size} and {self.batch_size}"
            )
        if self.max_length < 2:
            raise ConfigError(f"max length must be at least 2 tokens, got {self.max_length}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"warmup ratio must lie in [0, 1), got {self.warmup_ratio}")
        if self.lora is not None and self.lora < 1:
            raise ConfigError(f"LoRA rank must be at least 1, got {self.lora}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max steps must be at least 1, got {self.max_steps}")


def finetune_subset(
    model: nn.Module,
    tokenizer,
    examples: Sequence[Example | Mapping | str],
    config: FinetuneConfig | None = None,
    progress: bool = False,
    processes: Ranks | None = None,
    **overrides,
) -> dict:
    """Fine-tune ``model`` in place on ``examples`` (EMO appendix C); returns the log.

    ``processes``: the data-parallel processes (default: the launched ones, :func:`moectl.distributed.ranks`).
    ``examples``: ``Example``s, JSON-like rows (``prompt``+``response``/``completion`` or ``text``)
    or plain strings. ``overrides`` replace fields of ``config`` (``lr=1e-4``, ``max_steps=10``).
    The log holds the config, the number of examples and output tokens, and one record per
    optimiser step (``step``, ``epoch``, ``loss`` — mean over the step's output tokens —, ``lr``,
    ``grad_norm``, ``tokens``).
    """
    config = FinetuneConfig(**{**asdict(config or FinetuneConfig()), **overrides})
    processes = processes if processes is not None else ranks()
    check_divides(config.batch_size, processes.world, "examples per optimiser step")
    rows = [as_example(row, f"example {i}") for i, row in enumerate(examples)]
    encoded = [encode_example(tokenizer, ex, config.max_length) for ex in rows]
    usable = [e for e in encoded if targets(e[1]) > 0]
    if not usable:
        raise ConfigError("no example has an output token to train on (after the prompt, within max length)")
    pad_id = getattr(tokenizer, "pad_token_id", None)
    pad_id = int(getattr(tokenizer, "eos_token_id", None) or 0) if pad_id is None else int(pad_id)
    per_epoch = math.ceil(len(usable) / config.batch_size)
    total = (
        per_epoch * config.epochs
        if config.max_steps is None
        else min(config.max_steps, per_epoch * config.epochs)
    )
    train_model, merge = _with_lora(model, config) if config.lora else (model, None)
    params = [p for p in train_model.parameters() if p.requires_grad]
    masters = MasterWeights(params, enabled=config.master_weights)
    optimizer = torch.optim.AdamW(masters.optimizer_params(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = _scheduler(optimizer, config, total)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(config.seed)
    steps: list[dict] = []
    start = time.perf_counter()
    train_model.train()
    with _bar(progress and processes.is_main, total) as (bar, task):
        for epoch in range(config.epochs):
            order = torch.randperm(len(usable), generator=generator).tolist()
            for first in range(0, len(order), config.batch_size):
                if len(steps) >= total:
                    break
                batch = [usable[i] for i in order[first : first + config.batch_size]]
                record = _step(
                    train_model, batch, config, pad_id, device, params, optimizer, processes, masters
                )
                scheduler.step()
                record.update(step=len(steps), epoch=epoch)
                steps.append(record)
                if bar is not None:
                    bar.update(task, advance=1, stats=f"loss {record['loss']:.3f}  lr {record['lr']:.2e}")
    train_model.eval()
    if merge is not None:
        merge()
    model.eval()
    return {
        "config": asdict(config),
        "examples": len(rows),
        "skipped": len(rows) - len(usable),
        "output_tokens": sum(targets(lab) for _, lab in usable),
        "trainable_parameters": sum(p.numel() for p in params),
        "steps": steps,
        "final_loss": steps[-1]["loss"],
        "seconds": time.perf_counter() - start,
    }


def _step(
    model: nn.Module,
    batch: list[tuple[list[int], list[int]]],
    config: FinetuneConfig,
    pad_id: int,
    device: torch.device,
    params: list[Tensor],
    optimizer: torch.optim.Optimizer,
    processes: Ranks,
    masters: MasterWeights,
) -> dict:
    """One optimiser step: accumulate the summed token loss of each micro-batch / the step's tokens
    (this process's part of the step's examples; the gradients then summed over the processes)."""
    count = sum(targets(lab) for _, lab in batch)  # every process knows the whole step's tokens
    per = -(-len(batch) // processes.world)  # a short last batch: the last processes get fewer
    mine = batch[processes.rank * per : (processes.rank + 1) * per]
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for first in range(0, len(mine), config.micro_batch_size):
        micro = collate(mine[first : first + config.micro_batch_size], pad_id)
        ids, labels = micro["input_ids"].to(device), micro["labels"].to(device)
        logits = model(
            input_ids=ids, attention_mask=micro["attention_mask"].to(device), use_cache=False
        ).logits
        nll = F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
        )
        (nll / count).backward()
        loss_sum += nll.detach().double()
    processes.reduce_gradients(params)
    norm = torch.nn.utils.clip_grad_norm_(params, config.grad_clip) if config.grad_clip > 0 else None
    lr = optimizer.param_groups[0]["lr"]
    masters.to_masters()
    optimizer.step()
    masters.to_model()
    optimizer.zero_grad(set_to_none=True)
    return {
        "loss": float(processes.total(loss_sum)) / count,
        "lr": lr,
        "grad_norm": None if norm is None else float(norm),
        "tokens": count,
    }


def _scheduler(optimizer: torch.optim.Optimizer, config: FinetuneConfig, total: int):
    from transformers import get_scheduler

    name = (
        "constant_with_warmup" if config.schedule == "constant" and config.warmup_ratio else config.schedule
    )
    warmup = math.ceil(config.warmup_ratio * total)
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)


def _with_lora(model: nn.Module, config: FinetuneConfig):
    """(PEFT-wrapped model, a function that merges the adapters into ``model``'s weights in place)."""
    from peft import LoraConfig

    from moectl.adapters.inspect import inspect
    from moectl.adapters.slicing import get_tensor, per_expert_tensors
    from moectl.models.peft_quiet import get_peft_model

    experts = sorted(  # fused [E, ·, ·] expert weights: LoRA on parameters (biases left out)
        {e.name.rsplit(".", 1)[-1] for e in per_expert_tensors(model, inspect(model)).values()
         if e.part == "experts" and get_tensor(model, e.name).dim() == 3}
    )  # fmt: skip
    lora = LoraConfig(
        r=config.lora,
        lora_alpha=config.lora_alpha or 2 * config.lora,
        lora_dropout=0.0,
        target_modules="all-linear",
        target_parameters=experts or None,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's notes on fused-expert patterns, transformers deprecations
        wrapped = get_peft_model(model, lora)

    def merge() -> None:
        wrapped.merge_and_unload()

    return wrapped, merge


@contextmanager
def _bar(show: bool, total: int) -> Iterator[tuple[Progress | None, TaskID | None]]:
    """A rich progress bar over the optimiser steps, or (None, None) when not shown."""
    if not show:
        yield None, None
        return
    with progress_bar("[bold]finetune", suffix="{task.fields[stats]}") as bar:  # a terminal only, transient
        yield bar, bar.add_task("finetune", total=total, stats="")


def save_finetuned(
    model: nn.Module,
    tokenizer,
    out: str | Path,
    log: dict,
    source: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the fine-tuned model atomically: weights (``save_pretrained``), tokenizer, ``finetune.json``,
    ``loss_curve.png`` and, from ``source``, its ``moectl_subset.json`` (the kept experts)."""
    from moectl.reporting.plots import plot_curves
    from moectl.subsets.export import METADATA

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        make_portable(tmp)  # the config keys and tokenizer class other loaders read
        (tmp / LOG).write_text(json.dumps(log, indent=2, default=str) + "\n")
        steps = [s["step"] for s in log["steps"]]
        plot_curves({"train loss (output tokens)": (steps, [s["loss"] for s in log["steps"]])},
                    tmp / "loss_curve.png", xlabel="optimiser step", title="subset fine-tuning")  # fmt: skip
        if source is not None and (Path(source) / METADATA).exists():
            shutil.copy(Path(source) / METADATA, tmp / METADATA)

    return write_dir_atomic(Path(out), write, overwrite=overwrite)
