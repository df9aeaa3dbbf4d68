"""Evaluation data for ``roe score`` / ``roe tune``: JSONL (optionally .gz), one item per line.

Three kinds of line, told apart by their fields:

- language modelling — ``{"text": ...}`` (every token after the first is scored) or
  ``{"prompt"|"context": ..., "continuation": ...}`` (only the continuation is scored);
- multiple choice — ``{"context"|"prompt"|"question": ..., "choices": [...], "answer": index or text}``
  (RoE §3.1 follows Hu et al.: the choice with the highest log-probability is the prediction);
- generation — ``{"prompt": ..., "answer": ...}`` without ``choices``: exact match of the greedy
  continuation (whitespace-stripped prefix match), the paper's accuracy for generative tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from moectl.data.jsonl import iter_jsonl_rows
from moectl.errors import ConfigError, FileFormatError, MoectlFileError


@dataclass
class LMItem:
    """Score ``continuation`` given ``context`` ("" = score the whole text after its first token)."""

    context: str
    continuation: str


@dataclass
class ChoiceItem:
    """Multiple choice: the prediction is the choice with the highest RoE log-likelihood."""

    context: str
    choices: list[str]
    answer: int


@dataclass
class GenItem:
    """Generation: greedy continuation of ``prompt`` must start with ``answer``."""

    prompt: str
    answer: str


Item = LMItem | ChoiceItem | GenItem


def parse_item(row: dict, where: str) -> Item:
    """One JSONL object to an item; errors name the line and the accepted shapes."""
    if not isinstance(row, dict):
        raise FileFormatError(f"{where}: each line must be a JSON object")
    context = row.get("context", row.get("prompt", row.get("question")))
    if "choices" in row:
        choices = row["choices"]
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
            raise FileFormatError(f"{where}: 'choices' must be a list of at least two strings")
        answer = row.get("answer", row.get("label"))
        if isinstance(answer, str) and answer in choices:
            answer = choices.index(answer)
        if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
            raise FileFormatError(
                f"{where}: 'answer' must be a choice index 0..{len(choices) - 1} or one of the choices"
            )
        return ChoiceItem(str(context or ""), choices, answer)
    if "continuation" in row:
        return LMItem(str(context or ""), str(row["continuation"]))
    if "text" in row and isinstance(row["text"], str):
        return LMItem("", row["text"])
    if isinstance(context, str) and isinstance(row.get("answer"), str):
        return GenItem(context, row["answer"])
    raise FileFormatError(
        f"{where}: expected {{'text'}}, {{'prompt', 'continuation'}}, {{'context', 'choices', 'answer'}} "
        f"or {{'prompt', 'answer'}}; got fields {sorted(row)}"
    )


def load_items(path: str | Path, limit: int | None = None) -> list[Item]:
    """Read up to ``limit`` items from a JSONL(.gz) file."""
    path = Path(path)
    if not path.exists():
        raise MoectlFileError(f"data file {path} does not exist")
    items = [parse_item(row, f"{path}:{n}") for n, row in islice(iter_jsonl_rows(path), limit)]
    if not items:
        raise FileFormatError(f"{path} holds no items")
    return items


def item_kind(items: list[Item]) -> str:
    """'lm', 'choice' or 'gen' — the one kind every item has; raise on a mix."""
    kinds = {type(i) for i in items}
    bad = sorted(k.__name__ for k in kinds - {LMItem, ChoiceItem, GenItem})
    if bad:
        raise ConfigError(
            f"items must be LMItem, ChoiceItem or GenItem (moectl.roe.score_data), got {bad}; "
            "a text scored whole is LMItem('', text)"
        )
    if len(kinds) != 1:
        raise ConfigError(f"data mixes item kinds {sorted(k.__name__ for k in kinds)}; use one kind per file")
    return {LMItem: "lm", ChoiceItem: "choice", GenItem: "gen"}[kinds.pop()]
