"""moectl int4 / int8 against llama.cpp Q4_K_M / Q8_0 at the same bits, decode speed in one run (issue 40 item 5).

Uncapped (everything resident), OLMoE-1B-7B's dimensions (``--model``: a checkpoint folder or a
``shape:`` spec, default the whole 16-layer ``shape:olmoe-1b-7b``; its random weights decode as fast
as learned ones). The files are made once in ``--work`` (``quant_vs_llama_files.py``; kept for the
next run). Then, per bit width, the llama.cpp file and the moectl variants of that width
(``--variants``, scheme:scope; ``all`` quantizes every Linear but the routers as llama.cpp quantizes
every matrix, ``experts`` only the experts) are loaded together (one width at a time, to stay under
~16 GB) and timed alternately, ``--repeats`` rounds, medians:

- llama.cpp (llama-cpp-python, ``use_mmap=False``, extra CPU buffer types off as
  ``quant_quality_llama.no_extra_bufts`` needs on this CPU): 1 row — its Python API decodes one
  sequence, so the 8-row ratios are to llama.cpp's 1-row speed;
- moectl's engine (``moectl.engine.Engine``, greedy, ``ignore_eos``): 1 and ``--rows`` rows.

Both decode the same prompts' token ids (moectl's tokenizer's; llama.cpp is fed ids, so the GGUF's
vocabulary — ``--tokenizer``'s, as the checkpoint has none — never tokenizes). Decode tokens/s are
``engine_vs_llama.py``'s: the generated tokens less the first over the time less a prompt-only run's.

Decode GB/s = weight bytes one decode step of one row reads × 1-row tokens/s. The bytes: every
weight tensor but the input embedding (one row of it is read), the expert tensors counted at
top_k / num_experts of their bytes (the experts one token picks; codes, scales and zeros included):
``moectl_step_bytes`` for moectl's models, ``gguf_step_bytes`` (tensor sizes in the GGUF) for
llama.cpp's. Beside them, the same run measures each expert kernel's GB/s (``quant_kernel_gbs.py``)
and prints ``decode_kernels.py``'s stored bf16 figures (``--kernels-json``).

Making the files for the whole 16-layer checkpoint took, on the 2-core development machine at load
4-6 with one thread: the BF16 GGUF 72 s, Q4_K_M 18 min, Q8_0 63 s, each moectl checkpoint 3-5 min
(``moectl checkpoint quantize`` loads the whole bf16 model: 16.8 GB peak RSS, the one step above
~16 GB; the timed run itself peaks at 15.8 GB, the int8 width). Under the ~20 minutes allowed for
it, so the figures are of all 16 layers, not of ``shape:olmoe-1b-7b@4``.

    python benchmarks/quant_vs_llama_speed.py --model /work/ckpt/olmoe-1b-7b --work /work/gguf/olmoe-16 \\
        --tokenizer models/moectl-small-standard --threads 1 --json benchmarks/results/quant_vs_llama_speed.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moectl
import quant_kernel_gbs
import quant_vs_llama_files as files
from bench_args import PROMPTS, fail
from engine_vs_llama import engine_tok_s, llama_tok_s
from llama_bufts import no_extra_bufts
from llama_peer import open_llama
from moectl.engine import Engine, EngineConfig
from moectl.engine.engine import encode
from moectl.io.atomic import write_text_atomic


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_width(scheme: str, gguf: Path, folders: dict, args) -> tuple[list[dict], dict]:
    """Rows of one bit width: llama.cpp's file and moectl's variants loaded together, timed alternately."""
    ids = None
    engines, facts = {}, {}
    for (s, scope), folder in folders.items():
        if s != scheme:
            continue
        model, tok, _ = moectl.load(str(folder))
        name = f"moectl {scheme} {scope}"
        facts[name] = files.moectl_step_bytes(model)
        engines[name] = Engine(model, tok, EngineConfig(max_batch=args.rows)).open()
        ids = encode(tok, PROMPTS[0])
    peer = f"llama.cpp {files.GGUF_OF[scheme]}"
    facts[peer] = files.gguf_step_bytes(gguf)
    with no_extra_bufts():
        llm = open_llama(gguf, args.threads, use_mmap=False)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.rows)]
    runs: dict[str, list[float]] = {f"{peer} 1 row": []}
    load_before = _load()
    try:
        llama_tok_s(llm, ids, 4)  # warm-up
        for name, engine in engines.items():
            engine_tok_s(engine, prompts[:1], 4)
            engine_tok_s(engine, prompts, 4)
            runs[f"{name} 1 row"], runs[f"{name} {args.rows} rows"] = [], []
        for _ in range(args.repeats):
            runs[f"{peer} 1 row"].append(llama_tok_s(llm, ids, args.tokens))
            for name, engine in engines.items():
                runs[f"{name} 1 row"].append(engine_tok_s(engine, prompts[:1], args.tokens))
                runs[f"{name} {args.rows} rows"].append(engine_tok_s(engine, prompts, args.tokens))
        paths = {name: engine.stats()["decode_forward"] for name, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.close()
        llm.close()
    llama = statistics.median(runs[f"{peer} 1 row"])
    rows = []
    for label, values in runs.items():
        system, n_rows = label.rsplit(" ", 2)[0], int(label.rsplit(" ", 2)[1])
        tok_s = statistics.median(values)
        step = facts[system]["step_bytes"]
        rows.append({"bits": scheme, "system": system, "rows": n_rows, "tok_s": tok_s, "runs": values,
                     "vs_llama_1_row": tok_s / llama, **facts[system],
                     "decode_gb_per_s": step * tok_s / 1e9 if n_rows == 1 else None})  # fmt: skip
    return rows, {"load_before": load_before, "load_after": _load(), "decode_forward": paths}


def show(result: dict) -> None:
    s = result["setup"]
    print(f"\n{s['model']} ({s['layers']} layers), {s['threads']} thread(s), {s['tokens']} tokens, "
          f"median of {s['repeats']}; load {s['load_before']} before, {s['load_after']} after")  # fmt: skip
    print(f"{'system':<26} {'rows':>4} {'tok/s':>8} {'vs llama.cpp 1 row':>19} {'step MiB':>9} {'GB/s':>6}")
    for r in result["rows"]:
        gbs = f"{r['decode_gb_per_s']:6.1f}" if r["decode_gb_per_s"] is not None else "     -"
        print(f"{r['system']:<26} {r['rows']:>4} {r['tok_s']:8.2f} {r['vs_llama_1_row']:18.2f}x "
              f"{r['step_bytes'] / 2**20:9.1f} {gbs}")  # fmt: skip
    print("\nexpert kernels, this run (OLMoE expert shapes, 64 experts cycled):")
    quant_kernel_gbs.show(result["kernels"])
    stored = result.get("decode_kernels_bf16")
    if stored:
        print(f"\ndecode_kernels.py's stored figures ({stored['file']}, {stored['threads']} thread(s)):")
        for r in stored["rows"]:
            print(f"  {r['kernel']:34s} {r['weight_gb_read_per_s']:6.1f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="shape:olmoe-1b-7b", help="checkpoint folder or shape: spec")
    ap.add_argument("--work", type=Path, default=Path("runs/quant_vs_llama"), help="files made once, kept")
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.json folder for the GGUF")
    ap.add_argument("--variants", default="int4:all,int4:experts,int8:all", help="moectl scheme:scope list")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep-bf16-gguf", action="store_true")
    ap.add_argument(
        "--kernels-json", type=Path, default=Path("benchmarks/results/decode_kernels_1thread.json")
    )
    ap.add_argument("--json", dest="json_path", type=Path, default=None)
    args = ap.parse_args()
    variants = [tuple(v.split(":")) for v in args.variants.split(",")]
    if any(len(v) != 2 or v[0] not in files.GGUF_OF or v[1] not in ("all", "experts") for v in variants):
        fail(f"--variants: scheme:scope pairs, scheme int4|int8, scope all|experts; got {args.variants!r}")
    if args.tokens < 2 or args.rows < 1 or args.threads < 1 or args.repeats < 1:
        fail("--tokens >= 2, --rows, --threads, --repeats >= 1")
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    made: dict = {}
    model = files.checkpoint(args.model, args.work, made)
    ggufs = files.ggufs(model, args.work, args.tokenizer, args.threads, args.keep_bf16_gguf, made)
    folders = files.moectl_checkpoints(model, args.work, variants, args.group_size, made)
    config = json.loads((model / "config.json").read_text())
    result: dict = {"setup": {"command": " ".join(sys.argv), "model": str(model), "layers": config["num_hidden_layers"],
                              "threads": args.threads, "tokens": args.tokens, "rows": args.rows,
                              "repeats": args.repeats, "group_size": args.group_size, "cpus": os.cpu_count(),
                              "load_before": _load(), "torch": torch.__version__, "made_s": made}}  # fmt: skip
    result["kernels"] = quant_kernel_gbs.measure(group_size=args.group_size)
    result["rows"], result["widths"] = [], {}
    for scheme in dict.fromkeys(s for s, _ in variants):
        rows, facts = run_width(scheme, ggufs[files.GGUF_OF[scheme]], folders, args)
        result["rows"] += rows
        result["widths"][scheme] = facts
        gc.collect()
    result["setup"]["load_after"] = _load()
    if args.kernels_json.is_file():
        stored = json.loads(args.kernels_json.read_text())
        result["decode_kernels_bf16"] = {"file": str(args.kernels_json), "threads": stored.get("threads"),
                                         "rows": [r for r in stored["rows"] if "weight_gb_read_per_s" in r]}  # fmt: skip
    show(result)
    if args.json_path is not None:
        write_text_atomic(args.json_path, json.dumps(result, indent=2, default=str) + "\n")
        print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
