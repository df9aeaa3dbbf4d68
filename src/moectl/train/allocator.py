"""A memory allocator that keeps freed pages: ~25% faster CPU training steps, set before start-up.

A training step allocates and frees the same multi-megabyte buffers (a chunk of logits, a weight
cast to bf16) hundreds of times. glibc's malloc serves each from fresh ``mmap``-ed pages and hands
them back on free, so every use pays page faults: on the ``small`` preset (bf16, 2 threads)
the step took 1.43 s with glibc's defaults, 1.0 s with tcmalloc and 1.2-1.3 s with glibc told to
keep its memory (measured; ``benchmarks/pretrain.py --allocator`` re-measures). An allocator can
only be chosen before the process starts, so ``reexec_with_fast_allocator`` restarts the current
command once with tcmalloc preloaded where the system has it (Debian: ``libtcmalloc-minimal4``),
else with glibc's mmap and trim thresholds raised. ``MOECTL_ALLOCATOR=system`` opts out.
"""

from __future__ import annotations

import glob
import os
import sys

_MARK = "MOECTL_ALLOCATOR"
_TCMALLOC_GLOBS = (
    "/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/*-linux-gnu/libtcmalloc.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)
_GLIBC_KEEP = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}


def find_tcmalloc() -> str | None:
    for pattern in _TCMALLOC_GLOBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def fast_allocator_env(environ: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    """The environment to restart with, and the allocator's name ("tcmalloc" or "glibc-keep")."""
    env = dict(os.environ if environ is None else environ)
    lib = find_tcmalloc()
    if lib is not None:
        env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
        env[_MARK] = "tcmalloc"
    else:
        env.update(_GLIBC_KEEP)
        env[_MARK] = "glibc-keep"
    return env, env[_MARK]


def current_allocator() -> str:
    """The allocator this process runs with: "tcmalloc", "glibc-keep" or "system"."""
    return os.environ.get(_MARK, "system")


def reexec_with_fast_allocator() -> None:
    """Restart this exact command line once with a page-keeping allocator (no-op when already
    restarted, when opted out, or off Linux). Never returns when it restarts."""
    if _MARK in os.environ or not sys.platform.startswith("linux"):
        return
    env, _ = fast_allocator_env()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)
