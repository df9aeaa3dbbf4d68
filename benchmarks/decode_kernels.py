"""How fast can one decode step read expert weights on this CPU? Candidate kernels, in GB/s.

Issue 18 part 3: decoding OLMoE-1B-7B reads ≈ 2.35 GB of active bf16 weights per token; a
decode built on a kernel that reads 12 GB/s tops out near 5 tok/s whatever the residency policy.
This measures, for one token against ``--experts`` experts of OLMoE's shapes (gate_up [2I, H],
down [H, I]; enough experts that the caches do not hold them), each candidate's time and the
weight bytes it reads per second, all in one run so the ratios hold on a busy machine:

- bf16 ``F.linear`` per expert (transformers' eager experts loop today);
- fp32 ``F.linear`` per expert (twice the bytes; the slots would hold fp32);
- bf16 ``F.linear`` with the token's row repeated to 16 rows (the GEMM path instead of GEMV);
- bf16 weights cast to fp32 on the fly, then fp32 ``F.linear`` (no extra resident memory);
- one batched matmul over the stacked selected experts (bf16 and fp32);
- one ``grouped_mm`` over the experts, a row each (bf16 and fp32): what the offloaded slot forward
  (``offload/slot_forward.py``) and moectl's training experts run;
- int8 weight-only (``aten._weight_int8pack_mm``, per-row scales): half the bytes of bf16, not exact;
- moectl's own bf16 kernel (``moectl.kernels.bf16_rows``: bf16 converted to fp32 in registers), per
  expert and as one grouped call, which every moectl experts forward and ``nn.Linear`` run on the CPU;
- bf16 ``F.linear`` and moectl's kernel with 8 rows (a batch of 8 decoding requests on one expert).

    OMP_NUM_THREADS=2 python benchmarks/decode_kernels.py --json benchmarks/results/decode_kernels.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def _best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64, help="distinct experts read per call (cache-busting)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    h, i, n = args.hidden, args.intermediate, args.experts
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(n, 2 * i, h, generator=g).bfloat16()
    down = torch.randn(n, h, i, generator=g).bfloat16()
    x = torch.randn(1, h, generator=g)
    xb = x.bfloat16()
    y = torch.randn(1, i, generator=g)
    yb = y.bfloat16()
    gu32, d32 = gate_up.float(), down.float()
    scales_gu = gu32.abs().amax(-1) / 127
    scales_d = d32.abs().amax(-1) / 127
    q_gu = (gu32 / scales_gu[..., None]).round().to(torch.int8)
    q_d = (d32 / scales_d[..., None]).round().to(torch.int8)
    sgu, sd = scales_gu.bfloat16(), scales_d.bfloat16()
    bf16_bytes = (gate_up.numel() + down.numel()) * 2

    def bf16_linear():
        for e in range(n):
            F.linear(xb, gate_up[e])
            F.linear(yb, down[e])

    def fp32_linear():
        for e in range(n):
            F.linear(x, gu32[e])
            F.linear(y, d32[e])

    xb16, yb16 = xb.expand(16, h).contiguous(), yb.expand(16, i).contiguous()

    def bf16_linear_m16():
        for e in range(n):
            F.linear(xb16, gate_up[e])
            F.linear(yb16, down[e])

    def bf16_to_fp32_linear():
        for e in range(n):
            F.linear(x, gate_up[e].float())
            F.linear(y, down[e].float())

    def bf16_bmm():
        torch.bmm(gate_up, xb.expand(n, h)[:, :, None])
        torch.bmm(down, yb.expand(n, i)[:, :, None])

    def fp32_bmm():
        torch.bmm(gu32, x.expand(n, h)[:, :, None])
        torch.bmm(d32, y.expand(n, i)[:, :, None])

    offsets = torch.arange(1, n + 1, dtype=torch.int32)  # one row (the token) per expert
    gu_t, d_t, gu32_t, d32_t = (w.transpose(-2, -1) for w in (gate_up, down, gu32, d32))
    xs, ys, xs32, ys32 = (v.expand(n, v.shape[1]).contiguous() for v in (xb, yb, x, y))

    def bf16_grouped_mm():
        F.grouped_mm(xs, gu_t, offs=offsets)
        F.grouped_mm(ys, d_t, offs=offsets)

    def fp32_grouped_mm():
        F.grouped_mm(xs32, gu32_t, offs=offsets)
        F.grouped_mm(ys32, d32_t, offs=offsets)

    def int8_weight_only():
        for e in range(n):
            torch.ops.aten._weight_int8pack_mm(xb, q_gu[e], sgu[e])
            torch.ops.aten._weight_int8pack_mm(yb, q_d[e], sd[e])

    from moectl.kernels import bf16_rows

    def moectl_rows():
        for e in range(n):
            bf16_rows.linear(xb, gate_up[e])
            bf16_rows.linear(yb, down[e])

    def moectl_grouped():
        bf16_rows.grouped(xs, gate_up, offsets)
        bf16_rows.grouped(ys, down, offsets)

    xb8, yb8 = xb.expand(8, h).contiguous(), yb.expand(8, i).contiguous()

    def bf16_linear_8():
        for e in range(n):
            F.linear(xb8, gate_up[e])
            F.linear(yb8, down[e])

    def moectl_rows_8():
        for e in range(n):
            bf16_rows.linear(xb8, gate_up[e])
            bf16_rows.linear(yb8, down[e])

    candidates = {
        "bf16 F.linear per expert": (bf16_linear, 2),
        "bf16 F.linear, row padded to 16": (bf16_linear_m16, 2),
        "bf16 cast to fp32, F.linear": (bf16_to_fp32_linear, 2),
        "fp32 F.linear per expert": (fp32_linear, 4),
        "bf16 bmm over stacked experts": (bf16_bmm, 2),
        "fp32 bmm over stacked experts": (fp32_bmm, 4),
        "bf16 grouped_mm (serve slot forward)": (bf16_grouped_mm, 2),
        "fp32 grouped_mm": (fp32_grouped_mm, 4),
        "int8 weight-only per expert": (int8_weight_only, 1),
        "moectl bf16_rows per expert": (moectl_rows, 2),
        "moectl bf16_rows grouped (one call)": (moectl_grouped, 2),
        "bf16 F.linear, 8 rows": (bf16_linear_8, 2),
        "moectl bf16_rows, 8 rows": (moectl_rows_8, 2),
    }
    if not bf16_rows.available():
        for name in [k for k in candidates if k.startswith("moectl")]:
            del candidates[name]
    rows = []
    for name, (fn, bytes_per_weight) in candidates.items():
        try:
            s = _best(fn, args.repeats)
        except (RuntimeError, NotImplementedError) as err:
            rows.append({"kernel": name, "error": str(err).splitlines()[0]})
            continue
        read = bf16_bytes // 2 * bytes_per_weight
        rows.append(
            {
                "kernel": name,
                "seconds": s,
                "weight_gb_read_per_s": read / s / 1e9,
                "bf16_equivalent_gb_per_s": bf16_bytes / s / 1e9,
            }
        )
    base = next(r["seconds"] for r in rows if "seconds" in r)
    print(f"{n} experts of [{2 * i}x{h}] + [{h}x{i}], one token, {torch.get_num_threads()} threads")
    print(f"{'kernel':34s} {'ms':>8s} {'GB/s read':>10s} {'bf16-eq GB/s':>13s} {'speed vs bf16':>14s}")
    for r in rows:
        if "seconds" in r:
            r["speedup_vs_bf16_linear"] = base / r["seconds"]
            print(
                f"{r['kernel']:34s} {r['seconds'] * 1e3:8.2f} {r['weight_gb_read_per_s']:10.1f} "
                f"{r['bf16_equivalent_gb_per_s']:13.1f} {r['speedup_vs_bf16_linear']:13.2f}x"
            )
        else:
            print(f"{r['kernel']:34s} unavailable: {r['error']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
