"""Fine-tuning data for expert subsets (EMO appendix C): prompt masked, loss on the output only.

A JSONL line is either ``{"prompt": ..., "response": ...}`` (or ``"completion"`` instead of
``"response"``) — the loss covers the response tokens only, "we mask the input portion of the
prompt and optimize only over output tokens" — or ``{"text": ...}``, a plain document with the
loss on every token. Prompt and response are tokenised separately and concatenated (so the mask
boundary is exact), with EOS appended to the response when the tokenizer has one. Too-long
examples lose prompt tokens from the left first, then response tokens from the right.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch
from torch import Tensor

from moectl.data.jsonl import iter_jsonl_rows
from moectl.errors import FileFormatError

IGNORE = -100  # label of a position without loss (prompt, padding): PyTorch's cross-entropy default


@dataclass(frozen=True)
class Example:
    """One fine-tuning example; ``prompt`` is empty for a plain document."""

    prompt: str
    response: str


def as_example(row: Example | Mapping | str, where: str = "example") -> Example:
    """An ``Example`` from a JSON object (``prompt``+``response``/``completion``, or ``text``) or a string."""
    if isinstance(row, Example):
        return row
    if isinstance(row, str):
        row = {"text": row}
    if not isinstance(row, Mapping):
        raise FileFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")
    answers = [key for key in ("response", "completion") if key in row]
    if "prompt" in row or answers:
        if "text" in row:
            raise FileFormatError(f'{where}: give either "text" or "prompt" + "response", not both')
        if len(answers) != 1:
            raise FileFormatError(f'{where}: a "prompt" needs exactly one of "response" or "completion"')
        prompt, response = row.get("prompt"), row[answers[0]]
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise FileFormatError(f'{where}: "prompt" and "{answers[0]}" must both be strings')
        if not response.strip():
            raise FileFormatError(f'{where}: empty "{answers[0]}": nothing to train on')
        return Example(prompt, response)
    if not isinstance(row.get("text"), str):
        raise FileFormatError(f'{where}: each line needs a string "text", or "prompt" and "response"/"completion"')
    if not row["text"].strip():
        raise FileFormatError(f'{where}: empty "text": nothing to train on')
    return Example("", row["text"])


def read_examples(path: str | Path, limit: int | None = None) -> list[Example]:
    """Every example of a JSONL file (blank lines skipped), at most ``limit``; ValueError naming the line."""
    path = Path(path)
    rows = islice(iter_jsonl_rows(path), limit)
    examples = [as_example(row, f"{path}:{number}") for number, row in rows]
    if not examples:
        raise FileFormatError(f"{path}: no examples")
    return examples


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    if not text:
        return []
    # verbose=False: long documents are cut to the example length by the caller
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=special, verbose=False)]


def encode_example(tokenizer, example: Example, max_length: int) -> tuple[list[int], list[int]]:
    """(input ids, labels) with ``IGNORE`` on the prompt; at most ``max_length`` tokens."""
    if example.prompt:
        prompt, response = _ids(tokenizer, example.prompt, True), _ids(tokenizer, example.response, False)
    else:
        prompt, response = [], _ids(tokenizer, example.response, True)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and (not response or response[-1] != eos):
        response.append(int(eos))
    response = response[:max_length]
    prompt = prompt[len(prompt) - (max_length - len(response)) :] if max_length > len(response) else []
    return prompt + response, [IGNORE] * len(prompt) + response


def targets(labels: Sequence[int]) -> int:
    """Positions with a loss: labels after the first (the first token is never predicted)."""
    return sum(1 for label in labels[1:] if label != IGNORE)


def collate(encoded: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (``IGNORE`` on padding).

    Right padding keeps every example's positions at 0, 1, …, as in training without padding.
    """
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    labels = torch.full((len(encoded), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, (ids, lab) in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(lab)] = torch.tensor(lab)
        mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
