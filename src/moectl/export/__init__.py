"""Write a model in another engine's format: GGUF, the file llama.cpp loads (``moectl export gguf``).

    from moectl.export import write_gguf
    report = write_gguf("models/moectl-small-standard", "small.gguf")                  # whole model
    report = write_gguf("models/moectl-small-standard", "math-8.gguf", subset="math.subset.json")

- ``gguf_arch``   which transformers architectures map to which llama.cpp architecture, the
                  hyper-parameters it reads, and what its loader cannot express (refused up front)
- ``gguf_vocab``  the tokenizer: a byte-level BPE's tokens, merges, special ids and the
                  ``tokenizer.ggml.pre`` name whose regex is the tokenizer's own
- ``gguf_tensors`` the plan: every GGUF tensor, its source tensor(s) in the checkpoint, shape, type
- ``to_gguf``     streams the plan into the file, one tensor at a time, atomically

Everything is written with the ``gguf`` package (llama.cpp's own Python GGUF library: its writer,
architecture and tensor-name tables, token types); nothing of ``convert_hf_to_gguf.py`` is used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["write_gguf"]


def __getattr__(name: str) -> Any:
    if name == "write_gguf":
        from moectl.export.to_gguf import write_gguf

        return write_gguf
    raise AttributeError(f"module 'moectl.export' has no attribute {name!r}")
