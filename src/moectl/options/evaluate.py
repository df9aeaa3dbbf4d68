"""Quality and switch rate of a routing policy against the unrestricted teacher (TE-MoE §5).

- held-out quality (teacher forcing): per-token KL(p_teacher ‖ p_student) and perplexities of
  student and teacher, per domain, with 95% intervals over documents;
- switch rate on generated tokens (§2.2): of the policy's recorded masks when it sets them
  (controller, random baseline), else of the router treated as an option policy with k-hat.

The "teacher" is the model without the policy (and, for a trained controller, with the adapters
disabled and the original routers: ``teacher`` is a context manager that switches to it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from rich.progress import Progress, TaskID
from torch import nn

from moectl.adapters.inspect import ModelInfo
from moectl.generate import Prompt, generate_traced
from moectl.lm.padding import left_pad
from moectl.metrics.switch_rate import switch_rate
from moectl.options.rollout import positions
from moectl.progress import progress_bar
from moectl.routing import route
from moectl.routing.routing_state import Policy

PolicyFactory = Callable[[], Sequence[Policy]]

KL_CHUNK = 128
"""Positions per block in :func:`token_kl` (at vocab 152k: about 78 MB per float32 block)."""


def ci95(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its normal 95% interval."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, 1.96 * math.sqrt(var / n)


def _batch(tokenizer, texts: list[str], max_length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [tokenizer.encode(t, verbose=False)[:max_length] for t in texts]
    ids = [x if len(x) >= 2 else x + [tokenizer.eos_token_id or 0] * (2 - len(x)) for x in ids]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return left_pad(ids, pad, device)


def token_kl(
    teacher_logits: torch.Tensor, student_logits: torch.Tensor, targets: torch.Tensor, chunk: int = KL_CHUNK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position KL(p_teacher ‖ p_student), log p_teacher(target) and log p_student(target).

    ``teacher_logits`` and ``student_logits`` are [B, T, V] (any float dtype, views are fine),
    ``targets`` [B, T]; the results are [B, T] float32. The float32 log-softmaxes are taken
    ``chunk`` positions of one row at a time, so the extra memory is a few [chunk, V] float32
    tensors rather than [B, T, V] ones; each position's numbers are those of the whole-batch
    computation.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    rows, length = targets.shape
    out = [torch.empty(rows, length, dtype=torch.float32, device=targets.device) for _ in range(3)]
    for b in range(rows):
        for start in range(0, length, chunk):
            span = slice(start, start + chunk)
            kl, lp_t, lp_s = _block_kl(teacher_logits[b, span], student_logits[b, span], targets[b, span])
            out[0][b, span], out[1][b, span], out[2][b, span] = kl, lp_t, lp_s
    return out[0], out[1], out[2]


def _block_kl(
    teacher_logits: torch.Tensor, student_logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`token_kl` of one block of positions: [N, V] logits, [N] targets."""
    lt = F.log_softmax(teacher_logits.float(), -1)
    ls = F.log_softmax(student_logits.float(), -1)
    kl = (lt.exp() * (lt - ls)).sum(-1)
    target = targets[:, None]
    return kl, lt.gather(-1, target).squeeze(-1), ls.gather(-1, target).squeeze(-1)


@torch.no_grad()
def heldout_quality(
    model: nn.Module,
    info: ModelInfo,
    tokenizer,
    texts_by_domain: dict[str, list[str]],
    policies: PolicyFactory,
    teacher: Callable[[], AbstractContextManager] = nullcontext,
    max_length: int = 256,
    batch_size: int = 8,
    progress: bool = False,
) -> dict:
    """Per-domain KL to the teacher and perplexities; documents are the unit of the intervals."""
    device = next(model.parameters()).device
    result: dict = {"domains": {}}
    all_kl: list[float] = []
    total = sum(len(texts) for texts in texts_by_domain.values())
    with progress_bar("held-out KL", progress) as bar:
        task = bar.add_task("held-out KL", total=total)
        for domain, texts in texts_by_domain.items():
            result["domains"][domain], kl_docs = _domain_quality(
                model, info, tokenizer, texts, policies, teacher, max_length, batch_size, device, bar, task
            )
            all_kl.extend(kl_docs)
    mean, half = ci95(all_kl)
    doms = result["domains"].values()
    result["kl"], result["kl_ci95"] = mean, half
    result["kl_docs"] = all_kl  # per document, in the order of texts_by_domain: for paired comparisons
    result["ppl_ratio"] = sum(d["ppl"] / d["teacher_ppl"] for d in doms) / max(len(doms), 1)
    return result


def _domain_quality(
    model: nn.Module,
    info: ModelInfo,
    tokenizer,
    texts: list[str],
    policies: PolicyFactory,
    teacher: Callable[[], AbstractContextManager],
    max_length: int,
    batch_size: int,
    device: torch.device,
    bar: Progress,
    task: TaskID,
) -> tuple[dict, list[float]]:
    """One domain's row of :func:`heldout_quality` and its per-document KLs."""
    kl_docs: list[float] = []
    nll_s, nll_t, count = 0.0, 0.0, 0
    for start in range(0, len(texts), batch_size):
        ids, attn = _batch(tokenizer, texts[start : start + batch_size], max_length, device)
        kwargs = {"input_ids": ids, "attention_mask": attn, "position_ids": positions(attn)}
        with teacher():
            teacher_logits = model(**kwargs).logits[:, :-1]
        with route(model, list(policies()), info=info):
            student_logits = model(**kwargs).logits[:, :-1]
        kl, lp_t, lp_s = token_kl(teacher_logits, student_logits, ids[:, 1:])
        del teacher_logits, student_logits
        pair = (attn[:, :-1] & attn[:, 1:]).float()
        kl = kl * pair
        kl_docs.extend((kl.sum(1) / pair.sum(1).clamp(min=1)).tolist())
        nll_s -= float((lp_s * pair).sum())
        nll_t -= float((lp_t * pair).sum())
        count += int(pair.sum())
        bar.advance(task, len(texts[start : start + batch_size]))
    mean, half = ci95(kl_docs)
    row = {
        "kl": mean,
        "kl_ci95": half,
        "ppl": math.exp(nll_s / max(count, 1)),
        "teacher_ppl": math.exp(nll_t / max(count, 1)),
        "documents": len(kl_docs),
        "tokens": count,
    }
    return row, kl_docs


def generation_switch_rate(
    model: nn.Module,
    info: ModelInfo,
    tokenizer,
    prompts: list[Prompt],
    policies: PolicyFactory,
    k_hat: int,
    max_new_tokens: int = 128,
    temperature: float = 0.5,
    batch_size: int = 8,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """Switch rate on generated tokens with 95% interval over sequences (§2.2, Tables 2–3)."""
    pols = list(policies())
    texts, trace = generate_traced(
        model, tokenizer, prompts, max_new_tokens, temperature, batch_size, seed,
        progress=progress, policies=pols or None,
    )  # fmt: skip
    source = "allowed" if trace.allowed else "router"
    report = switch_rate(trace, k_hat=k_hat if source == "router" else None, source=source)
    mean, half = ci95(report.per_sequence)
    return {
        "switch_rate": mean,
        "switch_rate_ci95": half,
        "per_layer": report.per_layer,
        "source": source,
        "sequences": len(report.per_sequence),
        "samples": texts[:3],
    }
