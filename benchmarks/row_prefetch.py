"""moectl's bf16 row kernel with and without its prefetch for short rows, weights from memory (#39).

``kernels/bf16_rows.c`` prefetches each tile's weights ``AHEAD_BYTES`` along the row; where a row
is short (the reference model's 256 and 128 columns: 512 or 256 bytes) that lands in the tile's
own lines, and a tile's 8 short streams kept few loads in flight. The shipped rule prefetches the
next tile into L1 and ``FAR_TILES`` tiles on into L2 there (``SHORT_ROWS_AHEAD``). This builds the
shipped source both ways (``kernel_build.build`` with ``-DSHORT_ROWS_AHEAD=0`` for before) and
times one-row products of each shape over enough distinct weights (``--megabytes``) that they come
from memory, alternated ``--repeats`` times in this process, at each of ``--threads``. GB/s are the
weights' bytes over the time (medians). Run it quiet; the load is printed beside.

    python benchmarks/row_prefetch.py --json benchmarks/results/row_prefetch.json
"""

from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_variants
from bench_args import fail
from moectl.kernels import kernel_build

SOURCE = Path(kernel_build.__file__).with_name("bf16_rows.c")
WAYS = {"before (AHEAD_BYTES along the row)": ("SHORT_ROWS_AHEAD=0",), "shipped": ()}
SHAPES = {  # name: (N, K): the reference model's LM head, an expert's gate_up and down, OLMoE's projection
    "[8192, 256] LM head": (8192, 256),
    "[256, 256] gate_up": (256, 256),
    "[256, 128] down": (256, 128),
    "[2048, 2048] OLMoE": (2048, 2048),
}


def kernel(defines: tuple[str, ...]):
    path = kernel_build.build(SOURCE, defines)
    if path is None:
        fail("no C compiler: the kernel cannot be built here")
    f = ctypes.CDLL(str(path)).moectl_bf16_linear
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    f.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, ctypes.c_int]
    f.restype = None
    return f


def main() -> None:
    args, threads = kernel_variants.parse(__doc__.splitlines()[0])
    kernels = {name: kernel(defines) for name, defines in WAYS.items()}
    gbs: dict[tuple[str, int, str], list[float]] = {}
    for shape, (n, k) in SHAPES.items():
        count = max(2, args.megabytes * 2**20 // (n * k * 2))
        weights = [torch.randn(n, k).to(torch.bfloat16) for _ in range(count)]
        x, y = torch.randn(1, k), torch.empty(1, n)
        rounds = max(1, int(256e6 / (n * k * 2 * count)))
        for count_threads in threads:
            for _ in range(args.repeats):
                for name, f in kernels.items():
                    start = time.perf_counter()
                    for _ in range(rounds):
                        for w in weights:
                            f(x.data_ptr(), k, 1, w.data_ptr(), k, n, k, y.data_ptr(), n, count_threads)
                    seconds = (time.perf_counter() - start) / (rounds * len(weights))
                    gbs.setdefault((shape, count_threads, name), []).append(n * k * 2 / seconds / 1e9)
    kernel_variants.report(gbs, next(iter(WAYS)), "one-row bf16 products", args, None)


if __name__ == "__main__":
    main()
