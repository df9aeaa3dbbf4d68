"""Capability gating (EMO §6, "fine-grained control"): block a domain's experts, measure per-domain loss.

``block_mask`` allows every expert except a domain subset's (per MoE layer); ``domain_losses``
gives the mean next-token loss of each domain's texts (padding excluded) under optional routing
policies. Blocking domain A's subset should raise A's loss more than the others': ``gate_report``
measures both and the difference (``selectivity``), what ``moectl subset gate`` prints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moectl.adapters.inspect import ModelInfo
from moectl.errors import ConfigError
from moectl.routing import ExpertMask, route
from moectl.subsets.calibrate import tokenize


def block_mask(info: ModelInfo, keep: Mapping[int, Sequence[int]]) -> ExpertMask:
    """A mask allowing every expert except ``keep[layer]``; layers not named stay unrestricted."""
    allowed = {}
    for index, ids in keep.items():
        layer = info.layer(int(index))
        rest = [e for e in range(layer.num_experts) if e not in set(ids)]
        if len(rest) < layer.top_k:
            raise ConfigError(
                f"MoE layer {index}: blocking {len(ids)} experts leaves {len(rest)}, fewer than top-k = "
                f"{layer.top_k}"
            )
        allowed[int(index)] = rest
    return ExpertMask.from_lists(info, allowed, renorm="pruned")


@torch.no_grad()
def mean_loss(model: nn.Module, tokenizer, texts: Sequence[str], policies=(), max_length: int = 512) -> float:
    """Mean next-token cross-entropy over the real tokens of ``texts`` (one padded batch)."""
    batch = tokenize(tokenizer, texts, max_length)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    device = next(model.parameters()).device
    with route(model, list(policies)):
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()
    targets = mask[:, :-1].bool() & mask[:, 1:].bool()
    if not bool(targets.any()):
        raise ConfigError("no text has two or more tokens: nothing to predict")
    nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    return float(nll[targets].mean())


def domain_losses(
    model: nn.Module, tokenizer, texts: Mapping[str, Sequence[str]], policies=(), max_length: int = 512
) -> dict[str, float]:
    """``{domain: mean loss}`` under ``policies``."""
    return {name: mean_loss(model, tokenizer, docs, policies, max_length) for name, docs in texts.items()}


def gate_report(
    model: nn.Module, tokenizer, texts: Mapping[str, Sequence[str]], keep: Mapping[int, Sequence[int]],
    info: ModelInfo, own: str | None = None, max_length: int = 512,
) -> dict:  # fmt: skip
    """Each domain's loss with every expert (``full``) and with ``keep``'s experts blocked
    (``blocked``), the ``increase`` and the ``relative`` change.

    ``own``: the subset's own domain (None when it is not one of ``texts``); with it and another
    domain, ``selectivity`` = own increase − the other domains' mean increase (EMO §6: blocking a
    domain's experts should hurt that domain most).
    """
    full = domain_losses(model, tokenizer, texts, max_length=max_length)
    blocked = domain_losses(model, tokenizer, texts, [block_mask(info, keep)], max_length=max_length)
    rows = {
        name: {"full": full[name], "blocked": blocked[name], "increase": blocked[name] - full[name],
               "relative": blocked[name] / full[name] - 1}
        for name in texts
    }  # fmt: skip
    own = own if own in texts else None
    report: dict = {"blocked_experts": len(next(iter(keep.values()))), "domain": own, "domains": rows}
    others = [row["increase"] for name, row in rows.items() if name != own]
    if own is not None and others:
        report["selectivity"] = rows[own]["increase"] - sum(others) / len(others)
    return report
