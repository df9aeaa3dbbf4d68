"""moectl's one-row int4 loop with bf16 dot products against its fp32 widening, weights from memory (#40).

``kernels/unpack.c``'s ``moectl_int4_row`` takes a bf16 row by AVX512-BF16 dot products where the
CPU has them (``row_block_dp``: codes turned into bf16 pairs by byte permutes, ``vdpbf16ps``), else
by widening each code to fp32 (``row_block``). This builds the shipped source both ways
(``kernel_build.build`` with ``-DNO_DP_BF16`` for before) and times one-row products of OLMoE-1B-7B's
and Qwen3-30B-A3B's expert shapes (g64, bf16 scales) over enough distinct weights
(``--megabytes``) that they come from memory, alternated ``--repeats`` times in this process, at
each of ``--threads``. GB/s are the codes' and scales' bytes over the time (medians). Run it quiet;
the load is printed beside.

    python benchmarks/int4_dp.py --json benchmarks/results/int4_dp.json
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
from moectl.kernels import kernel_build, unpack
from moectl.quant import int4_groups

SOURCE = Path(kernel_build.__file__).with_name("unpack.c")
WAYS = {"fp32 widening (before)": ("NO_DP_BF16",), "bf16 dot products (shipped)": ()}
SHAPES = {  # name: (N, K)
    "[2048, 2048] OLMoE gate_up": (2048, 2048),
    "[2048, 1024] OLMoE down": (2048, 1024),
    "[1536, 2048] Qwen3 gate_up": (1536, 2048),
    "[2048, 768] Qwen3 down": (2048, 768),
}
GROUP = 64


def kernel(defines: tuple[str, ...]):
    path = kernel_build.build(SOURCE, defines)
    if path is None:
        fail("no C compiler: the kernel cannot be built here")
    f = ctypes.CDLL(str(path)).moectl_int4_row
    f.argtypes, f.restype = unpack._SIGNATURES["moectl_int4_row"], None
    return f


def main() -> None:
    args, threads = kernel_variants.parse(__doc__.splitlines()[0])
    if "avx512f" not in kernel_build.cpu_flags().split():
        fail("moectl's int4 row loop needs an AVX-512 CPU")
    kernels = {name: kernel(defines) for name, defines in WAYS.items()}
    gbs: dict[tuple[str, int, str], list[float]] = {}
    for shape, (n, k) in SHAPES.items():
        one = int4_groups.quantize(torch.randn(n, k).to(torch.bfloat16), GROUP, torch.bfloat16)
        nbytes = one[0].numel() * one[0].element_size() + one[1].numel() * one[1].element_size()
        count = max(2, args.megabytes * 2**20 // nbytes)
        weights = [one[:2]] + [(one[0].clone(), one[1].clone()) for _ in range(count - 1)]  # same values, own memory
        x, y = torch.randn(1, k).to(torch.bfloat16), torch.empty(1, n, dtype=torch.bfloat16)
        rounds = max(1, int(256e6 / (nbytes * count)))
        for count_threads in threads:
            for _ in range(args.repeats):
                for name, f in kernels.items():
                    start = time.perf_counter()
                    for _ in range(rounds):
                        for packed, scale_zero in weights:
                            f(x.data_ptr(), packed.data_ptr(), scale_zero.data_ptr(), n, k, GROUP, y.data_ptr(), 1,
                              count_threads)  # fmt: skip
                    seconds = (time.perf_counter() - start) / (rounds * len(weights))
                    gbs.setdefault((shape, count_threads, name), []).append(nbytes / seconds / 1e9)
    kernel_variants.report(gbs, next(iter(WAYS)), f"one-row int4 products (g{GROUP})", args, {"group": GROUP})


if __name__ == "__main__":
    main()
