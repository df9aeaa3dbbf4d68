"""Train moectl's byte-level BPE tokenizer on a corpus's training split; count tokens per domain.

The tokenizer is GPT-2 style byte-level BPE (every string is encodable, ``decode(encode(x)) == x``)
trained with the ``tokenizers`` library and saved as a transformers ``PreTrainedTokenizerFast``
with ``<|bos|>``, ``<|eos|>`` and ``<|pad|>`` as BOS/EOS/PAD, so
``AutoTokenizer.from_pretrained(out_dir)`` loads it. No special token is added by ``encode``;
training code appends ``<|eos|>`` between documents itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from moectl.data.sample import corpus_files, iter_documents
from moectl.data.split import SPLITS
from moectl.errors import ConfigError
from moectl.io.atomic import atomic_dir
from moectl.io.portable_config import make_portable

__all__ = [
    "BOS",
    "EOS",
    "MIN_VOCAB",
    "PAD",
    "SPECIAL_TOKENS",
    "count_tokens",
    "default_tokenizer_dir",
    "train_tokenizer",
]

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, PAD)
MIN_VOCAB = 512
"""Smallest vocabulary accepted: 256 byte symbols, the special tokens and some merges."""


def default_tokenizer_dir() -> Path:
    """Folder of the small tokenizer shipped with moectl (trained on the sample corpus)."""
    from importlib import resources

    return Path(str(resources.files("moectl") / "resources" / "tokenizer"))


def _texts(corpus_dir: Path, domains: Iterable[str] | None, max_chars_per_domain: int | None,
           used: dict[str, int]) -> Iterator[str]:
    for doc in iter_documents(corpus_dir, "train", domains):
        domain = doc["domain"]
        if max_chars_per_domain is not None and used.get(domain, 0) >= max_chars_per_domain:
            continue
        used[domain] = used.get(domain, 0) + len(doc["text"])
        yield doc["text"]


def train_tokenizer(
    corpus_dir: str | Path,
    vocab_size: int = 16384,
    out_dir: str | Path = "data/tok",
    min_frequency: int = 2,
    max_chars_per_domain: int | None = None,
    domains: Iterable[str] | None = None,
    model_max_length: int = 4096,
) -> dict[str, Any]:
    """Train a byte-level BPE tokenizer on the ``train`` split of ``corpus_dir`` and save it to ``out_dir``.

    Args:
        corpus_dir: a corpus folder (see :func:`moectl.data.sample.iter_documents`).
        vocab_size: total vocabulary size including the 256 byte symbols and the special tokens.
        out_dir: where ``save_pretrained`` writes ``tokenizer.json`` and its configs.
        min_frequency: a pair must occur this often to be merged.
        max_chars_per_domain: train on at most this many characters per domain (in file order),
            to balance domains or save time; ``None`` uses the whole training split.
        domains: train only on these domains.
        model_max_length: recorded in the tokenizer config.

    Returns:
        a summary: vocabulary size, characters used per domain, output folder.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = Path(corpus_dir)
    if vocab_size < MIN_VOCAB:
        raise ConfigError(f"vocab_size must be at least {MIN_VOCAB} (256 bytes + special tokens), got {vocab_size}")
    corpus_files(corpus, "train")  # raises a clear error for a missing corpus or split
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    used: dict[str, int] = {}
    tok.train_from_iterator(_texts(corpus, domains, max_chars_per_domain, used), trainer=trainer)
    if not used:
        raise ConfigError(f"corpus {corpus} has no training documents" + (f" in domains {domains}" if domains else ""))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=model_max_length,
    )
    out = Path(out_dir)
    summary = {
        "vocab_size": fast.vocab_size,
        "requested_vocab_size": vocab_size,
        "special_tokens": {"bos": BOS, "eos": EOS, "pad": PAD},
        "trained_on": str(corpus),
        "characters_per_domain": dict(sorted(used.items())),
        "out_dir": str(out),
    }
    with atomic_dir(out, keep_others=True) as tmp:  # the old tokenizer or the new, never a mix
        fast.save_pretrained(str(tmp))
        make_portable(tmp)  # a tokenizer class every loader knows (io/portable_config.py)
        (tmp / "moectl_tokenizer.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def count_tokens(
    corpus_dir: str | Path, tokenizer: Any, splits: Iterable[str] = SPLITS, batch_size: int = 256
) -> dict[str, dict[str, dict[str, int]]]:
    """Real token counts: ``{domain: {split: {"documents", "characters", "tokens"}}}``.

    ``tokenizer`` is a folder or a loaded transformers tokenizer; no special tokens are counted.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer)) if isinstance(tokenizer, str | Path) else tokenizer
    backend = tok.backend_tokenizer
    counts: dict[str, dict[str, dict[str, int]]] = {}

    def flush(split: str, batch: list[dict[str, Any]]) -> None:
        encodings = backend.encode_batch([d["text"] for d in batch], add_special_tokens=False)
        for doc, enc in zip(batch, encodings, strict=True):
            c = counts.setdefault(doc["domain"], {}).setdefault(split, {"documents": 0, "characters": 0, "tokens": 0})
            c["documents"] += 1
            c["characters"] += len(doc["text"])
            c["tokens"] += len(enc.ids)

    for split in splits:
        batch: list[dict[str, Any]] = []
        for doc in iter_documents(corpus_dir, split):
            batch.append(doc)
            if len(batch) >= batch_size:
                flush(split, batch)
                batch = []
        if batch:
            flush(split, batch)
    return counts
