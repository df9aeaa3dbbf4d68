"""Load time of a quantized checkpoint against quantize-at-load (issue 40 item 2: quantize once).

For each ``--models`` entry (a checkpoint folder, or any spec ``moectl.load`` takes) and each
``--schemes`` scheme: ``moectl.quant.quantize_checkpoint`` writes the quantized checkpoint once
(timed), then ``--rounds`` interleaved rounds time ``moectl.load(MODEL, quantize=SCHEME)`` (load the
bf16 weights, quantize) against ``moectl.load(CHECKPOINT)`` (read the codes, pack int4 for the
kernel), after one untimed warm-up of each (imports, the page cache). It checks that both give the
same logits on one prompt (``logits_equal``) and reports the medians, the bytes on disk of each, and
the machine's load average beside them.

    moectl checkpoint make shape:olmoe-1b-7b@2 --out /tmp/olmoe2   # OLMoE-1B-7B dims, 2 layers
    python benchmarks/quantized_checkpoint_load.py \\
        --models models/moectl-small-standard /tmp/olmoe2 --schemes int4 int8 --rounds 3 \\
        --json benchmarks/results/quantized_checkpoint_load.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import moectl
from moectl.quant import quantize_checkpoint


def _folder_bytes(path: str | Path) -> int | None:
    folder = Path(path)
    if not folder.is_dir():
        return None
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix == ".safetensors")


def _timed_load(spec: str | Path, **kw) -> tuple[float, torch.nn.Module, object]:
    started = time.perf_counter()
    model, tok, _ = moectl.load(spec, **kw)
    return time.perf_counter() - started, model, tok


@torch.no_grad()
def measure(model: str, scheme: str, rounds: int, work: Path) -> dict:
    out = work / f"{Path(model).name or 'model'}-{scheme}"
    summary = quantize_checkpoint(model, out, scheme, overwrite=True)
    at_load, ckpt = [], []
    _, a, tok = _timed_load(model, quantize=scheme)  # warm-up, and the logits to compare
    _, b, _ = _timed_load(out)
    ids = tok(["The history of the city of"], return_tensors="pt")["input_ids"]
    equal = bool(torch.equal(a(ids).logits, b(ids).logits))
    del a, b
    for _ in range(rounds):
        seconds, m, _ = _timed_load(model, quantize=scheme)
        at_load.append(seconds)
        del m
        seconds, m, _ = _timed_load(out)
        ckpt.append(seconds)
        del m
    return {
        "model": model,
        "scheme": scheme,
        "group_size": summary["quantization_config"]["group_size"],
        "write_once_s": summary["seconds"],
        "bytes_source": _folder_bytes(model),
        "bytes_checkpoint": summary["bytes_after"],
        "quantize_at_load_s": at_load,
        "load_checkpoint_s": ckpt,
        "quantize_at_load_median_s": statistics.median(at_load),
        "load_checkpoint_median_s": statistics.median(ckpt),
        "speedup": statistics.median(at_load) / statistics.median(ckpt),
        "logits_equal": equal,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["models/moectl-small-standard"])
    parser.add_argument("--schemes", nargs="+", default=["int4", "int8"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory(prefix="qck-", dir=os.environ.get("TMPDIR")) as work:
        for model in args.models:
            for scheme in args.schemes:
                row = measure(model, scheme, args.rounds, Path(work))
                row["loadavg"] = os.getloadavg()
                results.append(row)
                print(
                    f"{model} {scheme}: quantize at load {row['quantize_at_load_median_s']:.2f} s, "
                    f"load checkpoint {row['load_checkpoint_median_s']:.2f} s "
                    f"({row['speedup']:.1f}x), written once in {row['write_once_s']['total']:.1f} s, "
                    f"{row['bytes_checkpoint'] / 2**20:.1f} MiB, logits equal {row['logits_equal']}, "
                    f"load average {row['loadavg'][0]:.2f}",
                    flush=True,
                )
    doc = {"threads": args.threads, "torch": torch.__version__, "cpus": os.cpu_count(), "results": results}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
