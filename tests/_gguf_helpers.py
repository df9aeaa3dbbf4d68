"""Shared by the GGUF tests: a tiny model saved with moectl's tokenizer, and reading a GGUF back."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import torch

import moectl
from moectl.data.tokenizer_train import default_tokenizer_dir

VOCAB = 8192  # moectl's bundled tokenizer


def saved(folder, family="qwen2_moe", dtype=torch.float32, tokenizer=True, **overrides):
    """A tiny random model of ``family`` saved as a checkpoint folder with moectl's tokenizer."""
    overrides = {"vocab_size": VOCAB, "tie_word_embeddings": True, **overrides}
    model = moectl.tiny(family, **overrides).to(dtype).eval()
    model.save_pretrained(folder)
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(default_tokenizer_dir() / name, folder / name)
    return model


def read(path) -> tuple[gguf.GGUFReader, dict[str, gguf.ReaderTensor]]:
    reader = gguf.GGUFReader(path)
    return reader, {t.name: t for t in reader.tensors}


def values(t: gguf.ReaderTensor) -> torch.Tensor:
    """A GGUF tensor as a float32 torch tensor of its numpy (row-major) shape."""
    if t.tensor_type == gguf.GGMLQuantizationType.BF16:
        bits = np.ascontiguousarray(t.data).view(np.int16)
        return torch.from_numpy(bits.copy()).view(torch.bfloat16).float()
    return torch.from_numpy(np.array(t.data)).float()
