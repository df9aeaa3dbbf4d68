"""``moectl baselines``: TE-MoE's pruning baselines (§5 "Baselines", A2) from the command line.

    moectl baselines MODEL --k-hat 8 --method frequency --calib calib.jsonl --out masks.json --json report.json
    moectl baselines tiny:olmoe --k-hat 4 --method reconstruction --generate 32
    moectl baselines tiny:olmoe --k-hat 4 --method random --json random.json

MODEL is ``tiny:FAMILY``, a checkpoint directory or a hub id. ``--calib`` is a JSONL file
(``text`` or ``prompt`` per line) or a moectl corpus folder (its validation documents,
interleaved across domains); the default is the sample corpus shipped with moectl. The fixed
baselines write their masks with ``--out`` as a subset file (``moectl.subsets.files``), which
``moectl subset export`` and ``ExpertMask.from_lists`` read; ``random`` redraws its experts at
every token and has no fixed mask to write.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from moectl.cli.common import (
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    ModelArg,
    check_out_file,
    console,
    load,
    write_json,
)

PROMPT_CHARS = 400  # with --generate, a corpus document's prompt is its start (``options.prompt_data``)


def baselines_command(
    model: ModelArg,
    k_hat: Annotated[int, typer.Option("--k-hat", help="Experts kept per MoE layer k̂ (top-k ≤ k̂ ≤ N).")],
    method: Annotated[str, typer.Option("--method", help="frequency | reconstruction | random | wanda | reap")],
    calib: Annotated[
        Path | None,
        typer.Option(
            "--calib", help="Calibration JSONL ('text'/'prompt') or corpus folder; default sample corpus."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", help="Write the masks as a subset file (fixed baselines).", callback=check_out_file
        ),
    ] = None,
    json_path: JsonOpt = None,
    num_prompts: Annotated[
        int, typer.Option("--num-prompts", help="Calibration texts used (TE-MoE: 128).")
    ] = 128,
    generate_tokens: Annotated[
        int, typer.Option("--generate", help="Append N tokens the model generates to each calibration text.")
    ] = 0,
    temperature: Annotated[
        float, typer.Option("--temperature", help="Sampling temperature of --generate (0: greedy).")
    ] = 0.0,
    max_length: Annotated[
        int, typer.Option("--max-length", help="Tokens per calibration text (the last ones).")
    ] = 512,
    layerwise: Annotated[
        bool, typer.Option("--layerwise", help="Prune layer l before measuring layer l+1.")
    ] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed (random draws, sampling, tiny weights).")] = 0,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
) -> None:
    """Per-layer expert masks of TE-MoE's pruning baselines (frequency, reconstruction, random, wanda)."""
    from moectl.adapters import inspect
    from moectl.errors import ConfigError
    from moectl.options.baselines import baseline_keep, baseline_name, calibration_batch
    from moectl.options.prompt_data import read_prompts
    from moectl.options.random_options import check_k_hat
    from moectl.subsets.files import save_subset

    method = baseline_name(method)
    for name, value, low in (("--num-prompts", num_prompts, 1), ("--generate", generate_tokens, 0),
                             ("--max-length", max_length, 1)):  # fmt: skip
        if value < low:
            raise ConfigError(f"{name} must be >= {low}, got {value}")
    if method == "random" and out is not None:
        raise ConfigError(
            "--out: the random baseline redraws k-hat experts at every token and has no fixed mask "
            "to write; use --json for its report"
        )
    lm, tokenizer = load(model, device, dtype, seed=seed)
    info = inspect(lm)
    check_k_hat(info, k_hat)
    keep: dict[int, list[int]] | None = None
    calibration: dict[str, Any] = {}
    if method != "random":
        chars = PROMPT_CHARS if generate_tokens else sys.maxsize
        texts = read_prompts(calib, "validation", num_prompts, chars)
        batch = calibration_batch(
            lm, tokenizer, texts, max_length, generate_tokens, temperature, seed, progress=True
        )
        keep = baseline_keep(lm, batch, method, k_hat, seed, info, layerwise)
        calibration = {
            "data": str(calib) if calib is not None else "sample corpus",
            "documents": len(texts),
            "tokens": int(batch["attention_mask"].sum()),
            "max_length": max_length,
            "generate": generate_tokens,
            "temperature": temperature,
            "layerwise": layerwise,
            "seed": seed,
        }
    _print_table(info, method, k_hat, keep)
    if out is not None and keep is not None:
        save_subset(out, keep, model=model, method=method, calibration=calibration)
        console.print(f"[dim]wrote {out}[/dim]")
    report = {
        "model": model,
        "method": method,
        "k_hat": k_hat,
        "num_experts": info.num_experts,
        "top_k": info.top_k,
        "per_token": keep is None,
        "keep": None if keep is None else {str(layer): ids for layer, ids in sorted(keep.items())},
        "seed": seed,
        "calibration": calibration,
        "out": None if out is None else str(out),
    }
    write_json(json_path, report)


def _print_table(info, method: str, k_hat: int, keep: dict[int, list[int]] | None) -> None:
    table = Table(title=f"{method} baseline: k-hat = {k_hat} of {info.num_experts} experts per MoE layer")
    for column in ("MoE layer", "decoder layer", "kept experts"):
        table.add_column(column)
    for layer in info.layers:
        kept = (
            f"random {k_hat} of {layer.num_experts}, redrawn at every token"
            if keep is None
            else " ".join(map(str, keep[layer.index]))
        )
        table.add_row(str(layer.index), str(layer.layer_idx), kept)
    console.print(table)
