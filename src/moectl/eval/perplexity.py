"""Perplexity on a JSONL corpus, overall and per domain, with bootstrap intervals.

The corpus is a ``.jsonl`` / ``.jsonl.gz`` file, or a corpus folder holding ``SPLIT.jsonl[.gz]``
(moectl's corpus layout), with one document per line: ``text`` and, for ``--by-domain``,
``domain``. Each document is ``[BOS] + tokens``, cut into windows of ``max_length`` tokens that
overlap by one token, so every token after BOS is predicted exactly once (from at most
``max_length - 1`` tokens of context). Windows are scored in batches, routed like every other
evaluation.

Perplexity is token-level over the whole set, exp(Σ nll / Σ tokens); bits per byte
(Σ nll / ln 2 / Σ UTF-8 bytes) does not depend on the tokenizer. Intervals resample documents
with a seeded bootstrap.
"""

from __future__ import annotations

import gzip
import json
import math
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn

from moectl.adapters.inspect import ModelInfo
from moectl.eval.forward import (
    RequestBatch,
    RoutingPlan,
    SwitchStats,
    continuation_log_probs,
    request_keys,
    routed_log_probs,
)
from moectl.eval.intervals import DEFAULT_SEED, bootstrap_interval, perplexity_interval
from moectl.eval.results import metric
from moectl.eval.scoring import encode


@dataclass
class Document:
    text: str
    domain: str = "all"


def read_corpus(path: str | os.PathLike, split: str = "test", limit: int | None = None) -> list[Document]:
    """Documents of a JSONL file or a corpus folder's ``split`` (``text`` and optional ``domain``)."""
    path = Path(path)
    if path.is_dir():
        candidates = [path / f"{split}.jsonl", path / f"{split}.jsonl.gz"]
        found = [c for c in candidates if c.exists()]
        if not found:
            raise FileNotFoundError(
                f"corpus folder {path} has no {split}.jsonl or {split}.jsonl.gz; "
                "pass a JSONL file or a folder with that split (--split)"
            )
        path = found[0]
    if not path.exists():
        raise FileNotFoundError(
            f"corpus {path} does not exist (expected a .jsonl/.jsonl.gz file or a corpus folder)"
        )
    opener = gzip.open if path.suffix == ".gz" else open
    docs = []
    with opener(path, "rt", encoding="utf-8") as handle:
        for n, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not valid JSON ({err.msg})") from err
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f"{path}:{n}: each line needs a string field 'text' (and optional 'domain')")
            if row["text"]:
                docs.append(Document(row["text"], str(row.get("domain", "all"))))
            if limit is not None and len(docs) >= limit:
                break
    if not docs:
        raise ValueError(f"{path} holds no documents with text")
    return docs


def _windows(ids: list[int], length: int) -> list[list[int]]:
    """Windows of ``length`` overlapping by one token; together they predict ids[1:] once each."""
    step = length - 1
    return [ids[start : start + length] for start in range(0, max(1, len(ids) - 1), step)]


@torch.no_grad()
def document_nll(
    model: nn.Module,
    tokenizer: Any,
    docs: Sequence[Document],
    plan: RoutingPlan,
    info: ModelInfo,
    max_length: int = 1024,
    batch_size: int = 8,
    stats: SwitchStats | None = None,
    progress: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Summed negative log-likelihood and scored-token count per document."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    bos = getattr(tokenizer, "bos_token_id", None)
    bos = bos if bos is not None else getattr(tokenizer, "eos_token_id", 0)
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    windows: list[tuple[int, list[int]]] = []
    for d, doc in enumerate(docs):
        for window in _windows([bos, *encode(tokenizer, doc.text)], max_length):
            windows.append((d, window))
    windows.sort(key=lambda w: -len(w[1]))
    device = next(model.parameters()).device
    nll = torch.zeros(len(docs), dtype=torch.float64)
    tokens = torch.zeros(len(docs), dtype=torch.long)
    columns = [TextColumn("perplexity"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
    with Progress(*columns, disable=not progress, transient=True) as bar:
        task = bar.add_task("windows", total=len(windows))
        for start in range(0, len(windows), batch_size):
            chunk = windows[start : start + batch_size]
            lengths = torch.tensor([len(w) for _, w in chunk])
            ids = torch.full((len(chunk), int(lengths.max())), pad, dtype=torch.long)
            for r, (_, window) in enumerate(chunk):  # assembling the batch
                ids[r, : len(window)] = torch.tensor(window)
            mask = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
            ids, mask = ids.to(device), mask.to(device)
            batch = RequestBatch(ids, mask.long(), request_keys(ids, mask), "loglikelihood")
            logp = routed_log_probs(model, batch, plan, info, stats, region="all")
            total, _ = continuation_log_probs(logp, ids, mask)
            owner = torch.tensor([d for d, _ in chunk])
            nll.index_add_(0, owner, -total.double().cpu())
            tokens.index_add_(0, owner, (lengths - 1).clamp(min=0))
            bar.advance(task, len(chunk))
    return nll.numpy(), tokens.numpy()


def perplexity_results(
    docs: Sequence[Document],
    nll: np.ndarray,
    tokens: np.ndarray,
    by_domain: bool = False,
    iters: int = 1000,
    seed: int = DEFAULT_SEED,
) -> dict[str, dict[str, Any]]:
    """Task entries ``perplexity/all`` (and ``perplexity/DOMAIN``) of the results schema."""
    groups: dict[str, list[int]] = {"all": list(range(len(docs)))}
    if by_domain:
        per: dict[str, list[int]] = defaultdict(list)
        for i, doc in enumerate(docs):
            per[doc.domain].append(i)
        groups.update(sorted(per.items()))
    nbytes = np.array([len(doc.text.encode("utf-8")) for doc in docs], dtype=np.float64)
    out = {}
    for name, idx in groups.items():
        sel = np.asarray(idx)
        n_tok = float(tokens[sel].sum())
        if n_tok == 0:
            continue
        ppl = math.exp(float(nll[sel].sum()) / n_tok)
        bpb = float(nll[sel].sum()) / math.log(2) / float(nbytes[sel].sum())

        def bpb_stat(counts: np.ndarray, sel: np.ndarray = sel) -> np.ndarray:
            return (counts @ nll[sel]) / math.log(2) / np.maximum(counts @ nbytes[sel], 1.0)

        out[f"perplexity/{name}"] = {
            "kind": "perplexity",
            "n": len(idx),
            "split": None,
            "primary": "perplexity",
            "metrics": {
                "perplexity": metric(
                    ppl, perplexity_interval(nll[sel], tokens[sel], iters, seed), "bootstrap", False
                ),
                "bits_per_byte": metric(
                    bpb, bootstrap_interval(bpb_stat, len(sel), iters, seed), "bootstrap", False
                ),
                "tokens": metric(n_tok, None, "none", False),
            },
            "switch_rate": None,
        }
    return out
