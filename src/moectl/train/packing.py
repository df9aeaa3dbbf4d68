"""Document-aware packing: documents tokenised, joined with EOS and cut into fixed-length rows.

Every token keeps the id of its document (EMO's pools are per document) and its domain (for
per-domain validation loss). Rows are drawn in a seeded order that depends only on (seed, epoch),
so the batch of any step is a pure function of the step: resuming needs no data state but the step.

The packed rows are cached (``OUT/data/*.pt``) under a fingerprint of what made them: the corpus
files (path, size, modification time: a changed file rebuilds, without rereading gigabytes on every
resume), the tokenizer (its full serialisation), the split, ``seq_len`` and the domain list. A cache
of other inputs is rebuilt, never reused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from moectl.data.sample import corpus_files, iter_documents
from moectl.errors import ConfigError
from moectl.io.atomic import atomic_path

CACHE_VERSION = 1


@dataclass
class PackedSplit:
    """Rows of ``seq_len`` tokens: ``ids``, ``doc_ids`` (global document index), ``domain`` (index)."""

    ids: Tensor  # [R, L] int64
    doc_ids: Tensor  # [R, L] int64
    domain: Tensor  # [R, L] int16
    domains: list[str]

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    def batch(self, indices: Tensor) -> dict[str, Tensor]:
        return {
            "input_ids": self.ids[indices],
            "doc_ids": self.doc_ids[indices],
            "domain": self.domain[indices],
        }


def pack_documents(
    token_lists: list[list[int]], doc_domains: list[int], seq_len: int, eos_id: int, domains: list[str]
) -> PackedSplit:
    """Join documents (each followed by EOS) and cut the stream into rows of ``seq_len``."""
    if not token_lists:
        raise ConfigError("no documents to pack")
    lengths = torch.tensor([len(t) + 1 for t in token_lists])
    stream = torch.cat([torch.tensor([*doc, eos_id], dtype=torch.long) for doc in token_lists])
    doc_index = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    domain = torch.repeat_interleave(torch.tensor(doc_domains, dtype=torch.int16), lengths)
    rows = stream.numel() // seq_len
    if rows == 0:
        raise ConfigError(f"only {stream.numel()} tokens: fewer than one row of seq_len={seq_len}")
    cut = rows * seq_len
    return PackedSplit(
        stream[:cut].view(rows, seq_len),
        doc_index[:cut].view(rows, seq_len),
        domain[:cut].view(rows, seq_len),
        domains,
    )


def tokenize_split(
    corpus: str | Path, split: str, tokenizer, seq_len: int, domains: list[str] | None = None
) -> PackedSplit:
    """Tokenise one split of a corpus folder and pack it; documents in file order."""
    docs = list(iter_documents(corpus, split))
    if not docs:
        raise ConfigError(f"corpus {corpus} has no documents in split {split!r}")
    names = sorted({d["domain"] for d in docs}) if domains is None else list(domains)
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted({d["domain"] for d in docs} - set(index))
    if unknown:
        raise ConfigError(f"split {split!r} has domains {unknown} that the training split does not have")
    # documents longer than the model are expected here: they are packed into rows (no warning)
    encoded = tokenizer([d["text"] for d in docs], add_special_tokens=False, verbose=False)["input_ids"]
    return pack_documents(encoded, [index[d["domain"]] for d in docs], seq_len, tokenizer.eos_token_id, names)


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything that decides a tokenizer's ids: its full serialisation where it has one
    (fast tokenizers: vocabulary, merges, normalizer, added tokens), else its vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = [type(tokenizer).__name__, tokenizer.eos_token_id]
    return hashlib.sha256((text + json.dumps(extra)).encode()).hexdigest()


def data_fingerprint(corpus: str | Path, split: str, tokenizer, seq_len: int, domains=None) -> str:
    """The packed cache's key: corpus files (path, size, mtime), tokenizer, split, seq_len, domains."""
    files = []
    for file in corpus_files(corpus, split):
        stat = file.stat()
        files.append([str(file.resolve()), stat.st_size, stat.st_mtime_ns])
    key = {
        "version": CACHE_VERSION,
        "files": files,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "split": split,
        "seq_len": seq_len,
        "domains": None if domains is None else list(domains),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def load_or_pack(
    cache: Path, corpus: str | Path, split: str, tokenizer, seq_len: int, domains=None
) -> PackedSplit:
    """``tokenize_split`` cached in ``cache`` (a .pt file), so resumes and reruns skip tokenising;
    a cache made from other inputs (``data_fingerprint``) is rebuilt. Read with ``weights_only``."""
    key = data_fingerprint(corpus, split, tokenizer, seq_len, domains)
    if cache.exists():
        try:
            data = torch.load(cache, weights_only=True)
        except Exception:  # unreadable (an old format, a foreign file): rebuilt below
            data = {}
        if isinstance(data, dict) and data.pop("fingerprint", None) == key:
            return PackedSplit(**data)
    packed = tokenize_split(corpus, split, tokenizer, seq_len, domains)
    with atomic_path(cache) as tmp:
        torch.save({"fingerprint": key, **vars(packed)}, tmp)
    return packed


def row_order(rows: int, seed: int, epoch: int) -> Tensor:
    """The seeded permutation of rows for one epoch."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(rows, generator=generator)


def batch_indices(
    rows: int, seed: int, step: int, micro: int, rank: int, grad_accum: int, world: int, size: int
) -> Tensor:
    """Row indices of one micro-batch: a pure function of (step, micro-batch, rank)."""
    per_step = grad_accum * world * size
    start = (step * per_step) + (micro * world + rank) * size
    positions = torch.arange(start, start + size)
    epochs = positions // rows
    out = torch.empty(size, dtype=torch.long)
    for epoch in epochs.unique().tolist():  # at most two epochs meet in one micro-batch
        here = epochs == epoch
        out[here] = row_order(rows, seed, epoch)[positions[here] % rows]
    return out
