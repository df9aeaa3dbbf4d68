"""Decode GB/s of moectl's expert kernels at OLMoE-1B-7B's expert shapes, bf16 beside int8 / int4 (issue 40 item 5).

The quantized counterpart of ``decode_kernels.py``: ``experts`` experts of OLMoE's shapes (gate_up
[2I, H], down [H, I]; enough that the caches do not hold them), each product run through the very
code moectl's experts forward runs — ``F.linear``, and ``moectl.kernels.bf16_rows`` where it applies
(not on a CPU with native bf16 products), for bf16;
``Int8Weights.linear`` (moectl's ``kernels/int8_rows`` for few rows, PyTorch's
``aten._weight_int8pack_mm`` timed beside it) and ``Int4Weights.linear``
(``aten._weight_int4pack_mm_for_cpu``) for the quantized formats — at 1 and 8 rows. GB/s is the
bytes each format holds for those experts (codes, scales and zeros included) over the best of
``repeats`` timed calls; ``bf16-eq GB/s`` is the bf16 bytes of the same weights over the same time
(how fast the kernel consumes the model, whatever it stores). Used by ``quant_vs_llama_speed.py``.

    python benchmarks/quant_kernel_gbs.py --threads 1
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moectl.quant import quantize_weights


def _best(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(
    experts: int = 64, hidden: int = 2048, inter: int = 1024, rows: tuple[int, ...] = (1, 8),
    group_size: int = 64, repeats: int = 5,
) -> list[dict]:  # fmt: skip
    """One row per (kernel, rows): ms per pass over ``experts`` experts, GB/s read and bf16-eq GB/s."""
    from moectl.kernels import bf16_rows, int8_rows

    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02).bfloat16()
    down = (torch.randn(experts, hidden, inter, generator=gen) * 0.02).bfloat16()
    bf16_bytes = (gate_up.numel() + down.numel()) * 2
    formats = {
        "int8": (quantize_weights(gate_up, "int8", group_size), quantize_weights(down, "int8", group_size)),
        f"int4 g{group_size}": (
            quantize_weights(gate_up, "int4", group_size), quantize_weights(down, "int4", group_size)
        ),
    }  # fmt: skip
    out = []
    for m in rows:
        x = torch.randn(m, hidden, generator=gen).bfloat16()
        y = torch.randn(m, inter, generator=gen).bfloat16()
        cands: dict[str, tuple[Callable[[], object], int]] = {
            "bf16 F.linear": (lambda x=x, y=y: [(F.linear(x, gate_up[e]), F.linear(y, down[e])) for e in range(experts)],
                              bf16_bytes),
        }  # fmt: skip
        if bf16_rows.applies(x, gate_up[0]):
            cands["bf16 moectl bf16_rows"] = (
                lambda x=x, y=y: [(bf16_rows.linear(x, gate_up[e], None), bf16_rows.linear(y, down[e], None))
                                  for e in range(experts)],
                bf16_bytes,
            )  # fmt: skip
        for name, (gu, dn) in formats.items():
            kernel = "int4pack_mm" if name != "int8" else "int8_rows" if int8_rows.applies(x, gu.codes) else "int8pack_mm"
            cands[f"{name} moectl ({kernel})"] = (
                lambda x=x, y=y, gu=gu, dn=dn: [(gu.linear(x, e), dn.linear(y, e)) for e in range(experts)],
                gu.nbytes() + dn.nbytes(),
            )
        gu, dn = formats["int8"]  # PyTorch's int8 kernel beside moectl's (what int8 ran before int8_rows)
        cands["int8 aten _weight_int8pack_mm"] = (
            lambda x=x, y=y, gu=gu, dn=dn: [
                (torch.ops.aten._weight_int8pack_mm(x, gu.codes[e], gu.scale[e].to(x.dtype)),
                 torch.ops.aten._weight_int8pack_mm(y, dn.codes[e], dn.scale[e].to(y.dtype))) for e in range(experts)
            ],
            gu.nbytes() + dn.nbytes(),
        )  # fmt: skip
        for name, (fn, nbytes) in cands.items():
            s = _best(fn, repeats)
            out.append({"kernel": name, "rows": m, "ms": s * 1e3, "bytes": nbytes,
                        "gb_per_s": nbytes / s / 1e9, "bf16_eq_gb_per_s": bf16_bytes / s / 1e9})  # fmt: skip
    return out


def show(rows: list[dict]) -> None:
    print(f"{'kernel':34s} {'rows':>4s} {'ms':>8s} {'GB/s read':>10s} {'bf16-eq GB/s':>13s}")
    for r in rows:
        print(
            f"{r['kernel']:34s} {r['rows']:4d} {r['ms']:8.2f} {r['gb_per_s']:10.1f} {r['bf16_eq_gb_per_s']:13.1f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    show(measure(args.experts, group_size=args.group_size, repeats=args.repeats))


if __name__ == "__main__":
    main()
