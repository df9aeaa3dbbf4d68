"""Shared by the serve tests: greedy decoding of a fixed number of tokens, and seeded prompts."""

from __future__ import annotations

import torch

NEW = 10


def greedy(model, ids: torch.Tensor, n: int = NEW) -> torch.Tensor:
    """Exactly ``n`` greedy tokens after ``ids`` (EOS does not stop it)."""
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=2,
    )


def prompt(seed: int = 0, length: int = 6) -> torch.Tensor:
    """A seeded random prompt [1, length] of byte-range token ids."""
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(seed))
