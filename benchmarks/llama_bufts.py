"""llama.cpp without its extra CPU buffer types, for the benchmarks that run it (torch-free).

Imported by ``llama_decode.py``, which runs under a memory cap, so it must not load torch."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def no_extra_bufts() -> Iterator[None]:
    """llama.cpp without its extra CPU buffer types (``use_extra_bufts=False``, llama-server's
    ``--no-extra-bufts``): with them, evaluating a Q8_0 or Q4_K_M file here dies of SIGILL (this
    CPU reports AMX_INT8; the AMX / repacked layouts are what they add). llama-cpp-python's ``Llama``
    has no argument for it, so its default model parameters are patched while one is built."""
    import llama_cpp.llama as llama_module

    default = llama_module.llama_cpp.llama_model_default_params

    def params():
        out = default()
        out.use_extra_bufts = False
        return out

    llama_module.llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        llama_module.llama_cpp.llama_model_default_params = default
