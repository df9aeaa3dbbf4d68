"""The files ``quant_vs_llama_speed.py`` compares, made once in a work folder (issue 40 item 5).

- the checkpoint: a folder as given, or a ``shape:`` spec written there by ``moectl checkpoint make``;
- llama.cpp's: ``moectl export gguf --outtype bf16`` (``model-bf16.gguf``), then llama.cpp's own
  quantizer (``gguf_quants.quantize_gguf``) to ``model-q4_k_m.gguf`` and ``model-q8_0.gguf``; the
  BF16 file is deleted once both exist unless ``keep_bf16``;
- moectl's: ``moectl checkpoint quantize`` per (scheme, scope) (``moectl-int4-all-g64`` ...), run in a
  child process so the bf16 model it loads (the whole of it) is gone before anything is timed.

A file already there is kept (delete it to remake it). :func:`gguf_step_bytes` and
:func:`moectl_step_bytes` give the weight bytes one decode step of one row reads in each system.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from gguf_quants import quantize_gguf

GGUF_OF = {"int4": "Q4_K_M", "int8": "Q8_0"}  # moectl scheme -> llama.cpp type at the same bits


def _timed(label: str, fn, made: dict) -> None:
    start = time.perf_counter()
    print(f"making {label} ...", flush=True)
    fn()
    made[label] = round(time.perf_counter() - start, 1)
    print(f"made {label} in {made[label]} s", flush=True)


def checkpoint(spec: str, work: Path, made: dict) -> Path:
    """``spec`` if it is a folder, else ``work/checkpoint`` made from the ``shape:`` spec."""
    if Path(spec).expanduser().is_dir():
        return Path(spec).expanduser()
    out = work / "checkpoint"
    if not (out / "config.json").is_file():
        cmd = ["moectl", "checkpoint", "make", spec, "--out", str(out)]
        _timed(f"checkpoint {spec}", lambda: subprocess.run(cmd, check=True), made)
    return out


def ggufs(model: Path, work: Path, tokenizer: Path | None, threads: int, keep_bf16: bool, made: dict) -> dict:
    """{"Q4_K_M": path, "Q8_0": path} in ``work`` (the BF16 export made first where one is missing)."""
    from moectl.export import write_gguf

    bf16 = work / "model-bf16.gguf"
    files = {name: work / f"model-{name.lower()}.gguf" for name in GGUF_OF.values()}
    missing = [name for name, path in files.items() if not path.is_file()]
    if missing and not bf16.is_file():
        if tokenizer is None and not (model / "tokenizer.json").is_file():
            raise SystemExit(
                f"{model} has no tokenizer.json: pass --tokenizer DIR (for the GGUF's vocabulary)"
            )
        _timed("GGUF BF16", lambda: write_gguf(model, bf16, outtype="bf16", tokenizer=tokenizer), made)
    for name in missing:  # written under a temporary name: a killed run leaves no file that looks whole
        part = files[name].with_suffix(".part")
        _timed(f"GGUF {name}", lambda name=name, part=part: quantize_gguf(bf16, part, name, threads), made)
        part.rename(files[name])
    if not keep_bf16 and bf16.is_file():
        bf16.unlink()
    return files


def moectl_checkpoints(
    model: Path, work: Path, variants: list[tuple[str, str]], group: int, made: dict
) -> dict:
    """(scheme, scope) -> the folder ``moectl checkpoint quantize`` wrote in ``work``."""
    out = {}
    for scheme, scope in variants:
        folder = work / f"moectl-{scheme}-{scope}-g{group}"
        if not (folder / "config.json").is_file():
            cmd = [sys.executable, "-m", "moectl.cli", "checkpoint", "quantize", str(model), "--out", str(folder),
                   "--quantize", scheme, "--group-size", str(group), "--scope", scope, "--overwrite"]  # fmt: skip
            _timed(f"moectl {scheme} {scope}", lambda cmd=cmd: subprocess.run(cmd, check=True), made)
        out[(scheme, scope)] = folder
    return out


def gguf_step_bytes(path: Path) -> dict:
    """Weight bytes one decode step of one row reads from a GGUF: every tensor but ``token_embd``
    (one row of it is read: left out, as moectl's count leaves its embedding out), the expert
    tensors (``*_exps``) at ``expert_used_count / expert_count`` of their bytes."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    used = int(reader.fields[f"{arch}.expert_used_count"].parts[-1][0])
    count = int(reader.fields[f"{arch}.expert_count"].parts[-1][0])
    experts = rest = 0
    for t in reader.tensors:
        if t.name.startswith("token_embd"):
            continue
        if "_exps" in t.name:
            experts += int(t.n_bytes)
        else:
            rest += int(t.n_bytes)
    step = rest + experts * used // count
    return {"step_bytes": step, "expert_bytes_per_step": experts * used // count, "other_bytes": rest,
            "file_bytes": path.stat().st_size}  # fmt: skip


def moectl_step_bytes(model) -> dict:
    """The same count for a moectl model (``quantized_experts._step_bytes``: every parameter and buffer
    but the input embedding, each MoE layer's expert tensors at top_k / num_experts)."""
    import moectl
    from quantized_experts import _step_bytes

    return {"step_bytes": _step_bytes(model), "model_bytes": moectl.quant.model_bytes(model)}
