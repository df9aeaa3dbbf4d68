"""Generate from prompts while a routing session records, with a progress bar."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import LogitsProcessor, LogitsProcessorList

from moectl.data.jsonl import read_jsonl_rows

DEFAULT_PROMPTS = [
    {"prompt": "The quick brown fox jumps over the lazy dog because", "category": "chat"},
    {"prompt": "def fibonacci(n):\n    ", "category": "code"},
    {"prompt": "Let x be a real number such that 3x + 7 = 22. Then x =", "category": "math"},
    {"prompt": "Photosynthesis converts light energy into", "category": "stem"},
    {"prompt": "Der schnelle braune Fuchs springt über", "category": "multi-de"},
    {"prompt": "El rápido zorro marrón salta sobre", "category": "multi-es"},
]


@dataclass
class Prompt:
    text: str
    category: str = "all"


def load_prompts(path: str | Path | None) -> list[Prompt]:
    """Read JSONL prompts (``prompt`` or ``text`` field, optional ``category``); None: built-in set."""
    if path is None:
        return [Prompt(p["prompt"], p["category"]) for p in DEFAULT_PROMPTS]
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    prompts = [
        Prompt(row.get("prompt", row.get("text")), str(row.get("category", "all")))
        for row in read_jsonl_rows(path, ("prompt", "text"))
    ]
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


class _Tick(LogitsProcessor):
    def __init__(self, progress: Progress, task) -> None:
        self.progress, self.task = progress, task

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.progress.advance(self.task, input_ids.shape[0])
        return scores


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: list[Prompt],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    batch_size: int = 8,
    seed: int = 0,
    ignore_eos: bool = True,
    progress: bool = True,
) -> list[str]:
    """Generate ``max_new_tokens`` per prompt in batches (left padding); returns the new text.

    ``ignore_eos`` forces every sequence to its full length, as TE-MoE §3.1 measures switch rates
    on 256 generated tokens per prompt.
    """
    rows = generate_tokens(
        model, tokenizer, prompts, max_new_tokens, temperature, batch_size, seed, ignore_eos, progress
    )
    return [tokenizer.decode(row, skip_special_tokens=True) for row in rows]


@torch.no_grad()
def generate_tokens(
    model,
    tokenizer,
    prompts: list[Prompt],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    batch_size: int = 8,
    seed: int = 0,
    ignore_eos: bool = True,
    progress: bool = True,
) -> list[list[int]]:
    """As :func:`generate`, but the new token ids of each prompt (what the routing trace saw)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    outputs: list[list[int]] = []
    columns = [
        TextColumn("generating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, disable=not progress, transient=True) as bar:
        task = bar.add_task("gen", total=len(prompts) * max_new_tokens)
        for start in range(0, len(prompts), batch_size):
            batch = [p.text for p in prompts[start : start + batch_size]]
            enc = tokenizer(batch, return_tensors="pt", padding=True)
            enc = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
            kwargs = (
                {"do_sample": True, "temperature": temperature, "top_k": None}
                if temperature > 0
                else {"do_sample": False}
            )
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens if ignore_eos else None,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                logits_processor=LogitsProcessorList([_Tick(bar, task)]),
                **kwargs,
            )
            new = out[:, enc["input_ids"].shape[1] :]
            outputs.extend(row.tolist() for row in new)
    return outputs
