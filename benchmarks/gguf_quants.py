"""The GGUF files of one moectl checkpoint that llama.cpp users run: BF16, Q8_0, Q4_K_M (issue 40 item 4).

``moectl.export.write_gguf`` writes the BF16 file; llama.cpp's own quantizer
(``llama_cpp.llama_model_quantize``, the code behind ``llama-quantize``) makes Q8_0 and Q4_K_M
from it, as a user would. llama.cpp falls back to another type for a tensor whose row width its
type's block does not divide (Q4_K / Q6_K: 256): :func:`composition` says, per tensor kind, which
types each file really holds and its bits per weight, so a "Q4_K_M" row is read for what it is.

Needs llama-cpp-python (``pip install 'moectl[llama]'``).
"""

from __future__ import annotations

import ctypes
from collections import Counter
from pathlib import Path

FTYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def quantize_gguf(src: Path, out: Path, name: str, threads: int = 1) -> Path:
    """``src`` (a BF16/F32 GGUF) quantized by llama.cpp to type ``name`` (a key of :data:`FTYPES`)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[name])
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {name} failed (rc {rc})")
    return out


def write_all(model_dir: str | Path, work: Path, threads: int = 1) -> dict[str, Path]:
    """BF16 (moectl's export), Q8_0 and Q4_K_M (llama.cpp's quantizer) of ``model_dir`` in ``work``."""
    from moectl.export import write_gguf

    work.mkdir(parents=True, exist_ok=True)
    files = {"BF16": work / "model-bf16.gguf"}
    write_gguf(model_dir, files["BF16"], outtype="bf16", overwrite=True)
    for name in FTYPES:
        files[name] = quantize_gguf(files["BF16"], work / f"model-{name.lower()}.gguf", name, threads)
    return files


def _kind(name: str) -> str:
    """A tensor's kind: ``ffn_down_exps``, ``attn_q``, ``token_embd``, ... (its name less block and suffix)."""
    parts = name.split(".")
    return parts[2] if parts[0] == "blk" else parts[0]


def composition(path: Path) -> dict:
    """File bytes; per tensor kind, the GGUF types it holds (with counts) and its bits per weight."""
    import gguf

    reader = gguf.GGUFReader(path)
    kinds: dict[str, Counter] = {}
    sizes: dict[str, list[int]] = {}
    for t in reader.tensors:
        kind = _kind(t.name)
        kinds.setdefault(kind, Counter())[t.tensor_type.name] += 1
        size = sizes.setdefault(kind, [0, 0])
        size[0] += int(t.n_bytes)
        size[1] += int(t.n_elements)
    return {
        "file_bytes": path.stat().st_size,
        "tensors": {
            kind: {"types": dict(kinds[kind]), "bits_per_weight": 8 * sizes[kind][0] / sizes[kind][1]}
            for kind in sorted(kinds)
        },
    }
