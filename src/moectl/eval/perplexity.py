"""Perplexity on a JSONL corpus, overall and per domain, with bootstrap intervals.

The corpus is a ``.jsonl`` / ``.jsonl.gz`` file, or a corpus folder holding ``SPLIT.jsonl[.gz]``
(moectl's corpus layout), with one document per line: ``text`` and, for ``--by-domain``,
``domain``. Each document is ``[BOS] + tokens``, cut into windows of ``max_length`` tokens that
overlap by one token, so every token after BOS is predicted exactly once (from at most
``max_length - 1`` tokens of context: ``moectl.models.tokens.rolling_windows``). Windows are
scored in batches by ``scoring.score_requests``, routed like every other evaluation; the same
windows serve lm-eval's ``loglikelihood_rolling`` (``lm_backend.MoectlLM``).

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
from torch import nn

from moectl.adapters.inspect import ModelInfo
from moectl.errors import ConfigError, FileFormatError, MoectlFileError
from moectl.eval.forward import RoutingPlan, SwitchStats
from moectl.eval.intervals import DEFAULT_SEED, bootstrap_interval, perplexity_interval
from moectl.eval.results import metric
from moectl.eval.scoring import score_requests
from moectl.models.tokens import Request, rolling_windows


@dataclass
class Document:
    text: str
    domain: str = "all"


def read_corpus(path: str | os.PathLike, split: str = "test", limit: int | None = None) -> list[Document]:
    """Documents of a JSONL file or a corpus folder's ``split`` (``text`` and optional ``domain``),
    in file order; ``limit``: at most that many per domain (the first of each), as ``options eval
    --max-docs`` and ``texts_by_domain`` count, so a limited run still covers every domain (a corpus
    file is sorted by domain: the first N in file order covered 2 of the sample's 9)."""
    path = Path(path)
    if path.is_dir():
        candidates = [path / f"{split}.jsonl", path / f"{split}.jsonl.gz"]
        found = [c for c in candidates if c.exists()]
        if not found:
            raise MoectlFileError(
                f"corpus folder {path} has no {split}.jsonl or {split}.jsonl.gz; "
                "pass a JSONL file or a folder with that split (--split)"
            )
        path = found[0]
    if not path.exists():
        raise MoectlFileError(
            f"corpus {path} does not exist (expected a .jsonl/.jsonl.gz file or a corpus folder)"
        )
    opener = gzip.open if path.suffix == ".gz" else open
    docs = []
    taken: dict[str, int] = defaultdict(int)  # documents kept per domain
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            for n, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise FileFormatError(f"{path}:{n}: not valid JSON ({err.msg})") from err
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise FileFormatError(f"{path}:{n}: each line needs a string field 'text' (and optional 'domain')")
                domain = str(row.get("domain", "all"))
                if row["text"] and (limit is None or taken[domain] < limit):
                    docs.append(Document(row["text"], domain))
                    taken[domain] += 1
    except UnicodeDecodeError as err:  # a binary file, or another encoding
        raise FileFormatError(f"{path}: not UTF-8 text ({err.reason})") from err
    except (EOFError, gzip.BadGzipFile) as err:  # a truncated or mislabelled .gz
        raise FileFormatError(f"{path}: not a complete gzip file ({err})") from err
    if not docs:
        raise FileFormatError(f"{path} holds no documents with text")
    return docs


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
    description: str = "perplexity",
) -> tuple[np.ndarray, np.ndarray]:
    """Summed negative log-likelihood and scored-token count per document (``description``: the
    progress bar's label)."""
    if max_length < 2:
        raise ConfigError(f"max_length must be >= 2, got {max_length}")
    windows: list[Request] = []
    owner: list[int] = []
    for d, doc in enumerate(docs):
        for window in rolling_windows(tokenizer, doc.text, max_length):
            windows.append(window)
            owner.append(d)
    scored = score_requests(model, windows, plan, info, batch_size, stats, progress, description)
    index = torch.tensor(owner, dtype=torch.long)
    nll = torch.zeros(len(docs), dtype=torch.float64).index_add_(0, index, -scored.logprob)
    tokens = torch.zeros(len(docs), dtype=torch.long).index_add_(0, index, scored.tokens)
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
