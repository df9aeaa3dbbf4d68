"""``moectl tokenizer train``: moectl's byte-level BPE tokenizer, trained on a corpus's training split.

It prints a rich table and, with ``--json PATH``, writes its result as JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from moectl.cli.common import MoectlGroup, check_out_folder, write_json
from moectl.cli.corpus import millions

__all__ = ["tokenizer_app"]

tokenizer_app = typer.Typer(cls=MoectlGroup, help="Train moectl's byte-level BPE tokenizer.", no_args_is_help=True)
_console = Console()


@tokenizer_app.callback()
def _tokenizer() -> None:
    """Byte-level BPE tokenizer trained on a corpus's training split."""


@tokenizer_app.command("train")
def train_command(
    corpus_dir: Annotated[Path, typer.Argument(help="corpus folder (from `moectl corpus build`)")],
    vocab: Annotated[int, typer.Option("--vocab", help="vocabulary size (8k-16k suits CPU-sized models)")] = 16384,
    out: Annotated[Path, typer.Option("--out", help="output folder (save_pretrained)", callback=check_out_folder)] = Path("data/tok"),
    max_chars_per_domain: Annotated[int | None, typer.Option("--max-chars-per-domain", min=1,
                                                             help="train on at most N characters per domain")] = None,
    count: Annotated[bool, typer.Option("--count/--no-count", help="count real tokens per domain and split")] = True,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the result here as JSON")] = None,
) -> None:
    """Train a byte-level BPE tokenizer on CORPUS_DIR's train split and save it for AutoTokenizer."""
    from moectl.data.tokenizer_train import MIN_VOCAB, count_tokens, train_tokenizer

    if not corpus_dir.is_dir():
        raise typer.BadParameter(f"corpus folder {corpus_dir} does not exist; build one with `moectl corpus build`",
                                 param_hint="CORPUS_DIR")
    if vocab < MIN_VOCAB:
        raise typer.BadParameter(f"vocabulary must be at least {MIN_VOCAB}, got {vocab}", param_hint="--vocab")
    summary = train_tokenizer(corpus_dir, vocab, out, max_chars_per_domain=max_chars_per_domain)
    table = Table(title=f"tokenizer: vocab {summary['vocab_size']:,} -> {out}")
    table.add_column("domain")
    table.add_column("train chars used", justify="right")
    if count:
        summary["tokens"] = count_tokens(corpus_dir, out)
        for col in ("train tokens", "validation tokens", "test tokens", "chars/token"):
            table.add_column(col, justify="right")
    for domain, chars in summary["characters_per_domain"].items():
        row = [domain, millions(chars)]
        if count:
            c = summary["tokens"].get(domain, {})
            toks = [c.get(s, {}).get("tokens", 0) for s in ("train", "validation", "test")]
            total_chars = sum(c.get(s, {}).get("characters", 0) for s in c)
            row += [millions(toks[0]), f"{toks[1]:,}", f"{toks[2]:,}", f"{total_chars / max(1, sum(toks)):.2f}"]
        table.add_row(*row)
    _console.print(table)
    write_json(json_path, summary, ensure_ascii=False)
