"""``moectl corpus build|sources``: the offline multi-domain corpus (``moectl tokenizer``: ``cli/tokenizer.py``).

Every command prints a rich table and, with ``--json PATH``, writes its result as JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from moectl.cli.common import MoectlGroup, check_out_folder, write_json
from moectl.data.sources import DOMAINS, SOURCES

__all__ = ["corpus_app"]

corpus_app = typer.Typer(cls=MoectlGroup, help="Build the offline multi-domain text corpus.", no_args_is_help=True)
_console = Console()


@corpus_app.callback()
def _corpus() -> None:
    """Offline multi-domain corpus (Debian packages, PyPI wheels, the Python standard library)."""


def _parse_domains(domains: str | None) -> list[str] | None:
    if domains is None:
        return None
    allowed = tuple(dict.fromkeys(s.domain for s in SOURCES))
    names = [d.strip() for d in domains.split(",") if d.strip()]
    unknown = [d for d in names if d not in allowed]
    if unknown or not names:
        raise typer.BadParameter(
            f"unknown domain(s) {', '.join(unknown) or repr(domains)}; allowed: {', '.join(allowed)}",
            param_hint="--domains",
        )
    return names


def millions(n: int) -> str:
    """``1234567`` -> ``"1.23M"``."""
    return f"{n / 1e6:,.2f}M"


def corpus_table(stats: dict[str, Any]) -> Table:
    """Rich table of documents / characters / approximate tokens per domain and split."""
    table = Table(title="corpus statistics (approx. tokens = characters / 4)")
    for col in ("domain", "documents", "characters", "approx tokens", "train docs", "validation docs",
                "test docs"):
        table.add_column(col, justify="left" if col == "domain" else "right")
    for domain, d in stats["domains"].items():
        sp = d["splits"]
        table.add_row(domain, f"{d['documents']:,}", millions(d["characters"]), millions(d["approx_tokens"]),
                      f"{sp['train']['documents']:,}", f"{sp['validation']['documents']:,}",
                      f"{sp['test']['documents']:,}")
    t = stats["total"]
    table.add_row("[bold]total", f"{t['documents']:,}", millions(t["characters"]), millions(t["approx_tokens"]), "", "", "")
    return table


@corpus_app.command("build")
def build_command(
    out: Annotated[Path, typer.Option("--out", help="output folder for {train,validation,test}.jsonl", callback=check_out_folder)] = Path(
        "data/corpus"),
    cache: Annotated[Path, typer.Option("--cache", help="download/unpack/document cache")] = Path("data/cache"),
    domains: Annotated[str | None, typer.Option("--domains", help=f"comma-separated subset of: "
                                                f"{','.join(DOMAINS)}")] = None,
    max_docs_per_source: Annotated[int | None, typer.Option("--max-docs-per-source", min=1,
                                                            help="quick builds: at most N documents per source")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the statistics here as JSON")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="show progress bars")] = True,
) -> None:
    """Fetch the sources, strip markup, de-duplicate, split by document id, write JSONL and stats.json."""
    from moectl.data.build import build_corpus

    chosen = _parse_domains(domains)
    stats = build_corpus(out, cache, chosen, max_docs_per_source, progress=progress, sources=SOURCES)
    _console.print(corpus_table(stats))
    _console.print(f"corpus written to {out} (stats in {out / 'stats.json'})")
    write_json(json_path, stats, ensure_ascii=False)


@corpus_app.command("sources")
def sources_command(
    json_path: Annotated[Path | None, typer.Option("--json", help="write the source table here as JSON")] = None,
) -> None:
    """List the corpus sources: domain, packages, decoder, markup, cap and licence."""
    table = Table(title="corpus sources")
    for col in ("domain", "source", "kind", "packages", "format", "cap", "licence"):
        table.add_column(col)
    rows = []
    for s in SOURCES:
        cap = millions(s.max_chars) + " chars" if s.max_chars else ""
        table.add_row(s.domain, s.name, s.kind, ", ".join(s.packages), s.markup if s.decoder == "file" else s.decoder,
                      cap, s.licence)
        rows.append({"name": s.name, "domain": s.domain, "kind": s.kind, "packages": list(s.packages),
                     "decoder": s.decoder, "markup": s.markup, "max_chars": s.max_chars, "licence": s.licence,
                     "note": s.note})
    _console.print(table)
    write_json(json_path, {"sources": rows}, ensure_ascii=False)
