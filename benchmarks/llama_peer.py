"""llama.cpp as a peer: decode a moectl checkpoint's GGUF export with llama-cpp-python, greedy.

Used by ``offload.py --llama-cpp`` (the llama.cpp rows beside the offloading figures) and
``gguf_check.py`` (logits and greedy tokens against transformers). The loop is the one moectl's
``generate`` runs: per prompt, the prompt's token ids (the transformers tokenizer's), then
``n`` greedy tokens with EOS suppressed (``min_new_tokens``); logits are read from llama.cpp's
context for the last position only (``llama_get_logits_ith``), so nothing beyond what a decode
step needs is computed or copied.

Settings (llama.cpp's own): ``resident`` loads every weight into memory (``use_mmap=False``);
``mmap`` maps the file and lets the OS page weights in on first use and out under pressure,
llama.cpp's default and its way of running a model larger than RAM from disk. ``--n-cpu-moe``
(MoE weights of the first N layers kept in host memory while the rest runs on a GPU) only
applies to a GPU build: on a CPU-only build every weight is in host memory already.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SETTINGS = {"resident": {"use_mmap": False}, "mmap": {"use_mmap": True}}


def last_logits(llm) -> np.ndarray:
    """The logits of the last evaluated position, copied out of llama.cpp's context."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def greedy(llm, ids: Sequence[int], n: int, eos: int | None) -> tuple[np.ndarray, list[int]]:
    """(last-position logits of the prompt, ``n`` greedy tokens with ``eos`` suppressed)."""
    llm.reset()
    llm.eval(list(ids))
    first = last_logits(llm)
    logits, out = first.copy(), []
    for _ in range(n):
        if eos is not None:
            logits[eos] = -np.inf
        out.append(int(logits.argmax()))
        llm.eval([out[-1]])
        logits = last_logits(llm)
    return first, out


def decode_all(llm, ids: Sequence[Sequence[int]], n: int, eos: int | None) -> None:
    """Every prompt, one at a time: the prompt, then ``n`` greedy tokens."""
    for row in ids:
        greedy(llm, row, n, eos)


def open_llama(path: str | Path, threads: int, n_ctx: int = 1024, **settings):
    import llama_cpp

    return llama_cpp.Llama(
        str(path),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
        **settings,
    )


def llama_cpp_rows(
    folder: str | Path, tok, prompts: Sequence[str], n: int, threads: int, out_dir: Path
) -> list[dict]:
    """tokens/s of llama.cpp on ``folder``'s GGUF export (``moectl export gguf``), per setting:
    prompt and ``n`` greedy tokens per prompt, one prompt at a time, wall and process-CPU time."""
    import llama_cpp

    from moectl.export import write_gguf

    path = out_dir / "model.gguf"
    report = write_gguf(folder, path, overwrite=True)
    ids = [tok(p)["input_ids"] for p in prompts]
    rows = []
    for setting, kwargs in SETTINGS.items():
        llm = open_llama(path, threads, n_ctx=max(map(len, ids)) + n + 8, **kwargs)
        greedy(llm, ids[0], 4, tok.eos_token_id)  # warm-up: first-touch of mmap'd pages not timed
        llama_cpp.llama_perf_context_reset(llm.ctx)
        t0, c0 = time.perf_counter(), time.process_time()
        decode_all(llm, ids, n, tok.eos_token_id)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        perf = llama_cpp.llama_perf_context(llm.ctx)
        rows.append(
            {
                "engine": "llama.cpp",
                "setting": setting,
                "outtype": report["outtype"],
                "threads": threads,
                "tokens_per_s": len(ids) * n / wall,
                "tokens_per_cpu_s": len(ids) * n / cpu,
                # llama.cpp's own counter: decode steps only (no prompt, no Python around it)
                "decode_tokens_per_s": perf.n_eval / (perf.t_eval_ms / 1e3) if perf.t_eval_ms > 0 else None,
                "gguf_bytes": report["file_bytes"],
            }
        )
        llm.close()
    return rows
