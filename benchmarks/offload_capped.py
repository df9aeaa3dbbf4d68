"""Serve a checkpoint larger than the memory it is given: moectl and llama.cpp under memory caps.

Issue 18. Each row runs one system in a fresh process under ``shared/tools/memcap`` (a memory
cgroup that counts the page cache, started cold) at a cap that is a fraction of the checkpoint's
bytes, or uncapped, and records: decode tokens/s, time to first token, the cgroup's peak, the
process's peak RSS, bytes read from disk per generated token, the hit rate, the switch rate of an
option policy, and the exact command. Rows that die for memory are kept, marked ``killed``.

    moectl checkpoint make shape:olmoe-1b-7b --out /work/ckpt/olmoe-1b-7b          # 13.8 GB, random bf16
    python benchmarks/offload_capped.py --checkpoint /work/ckpt/olmoe-1b-7b \\
        --caps none,0.60,0.45,0.35 --policies lru,option:8 --budget 0.25 --tokens 16 \\
        [--gguf /work/ckpt/olmoe-1b-7b.gguf] --json benchmarks/results/offload_capped.json

Quantized (issue 40 item 5): ``--moectl-checkpoint DIR`` serves a quantized checkpoint (``moectl
checkpoint quantize``; its store then reads int4) in the moectl rows while the caps stay fractions of
``--checkpoint``'s bf16 bytes, ``--gguf`` a Q4_K_M of the same model with ``--llama-no-extra-bufts``,
and ``--cap-budgets 0.45:1.0,0.25:0.5`` gives each cap its own resident budget:

    python benchmarks/offload_capped.py --checkpoint /work/ckpt/olmoe-1b-7b \
        --moectl-checkpoint /work/gguf/olmoe-16/moectl-int4-all-g64 --gguf /work/gguf/olmoe-16/model-q4_k_m.gguf \
        --llama-no-extra-bufts --caps 0.45,0.25,0.15 --cap-budgets 0.45:1.0,0.25:0.5,0.15:0.25 --policies lru \
        --tokens 32 --threads 2 --json benchmarks/results/quant_capped.json

``--routings none,topk:4`` runs each policy also with a routing every prompt is served with
(``serve-offload --routing``: N experts per token instead of top-k read fewer experts per token).

Random weights route unlike a trained model (near-uniform expert use, switch rates near 1): the
residency policies' hit rates here are a floor, not what a trained model gets. The same table on
moectl's own reference models is ``--checkpoint models/moectl-small-standard``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEMCAP = ROOT.parent / "shared" / "tools" / "memcap"
PEAK = re.compile(r"memcap: cap \S+, peak (\d+) MiB, hit the cap (\d+) times, exit (-?\d+)")


def checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def active_weight_bytes(folder: Path) -> int:
    """Bytes of the weights one decoded token reads: every matrix but the routed experts it is not
    routed to and the embedding table (``parameter_counts``' active_without_embedding, at the
    checkpoint's dtype). Times decode tokens/s, the GB/s of weights a decode step reads (item 3)."""
    import torch
    from transformers import AutoConfig

    from moectl.models.shapes import build_from_config, parameter_counts

    config = AutoConfig.from_pretrained(folder)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = build_from_config(config, dtype=dtype, device="meta")
    return parameter_counts(model)["active_without_embedding"] * dtype.itemsize


def _run(cmd: list[str], cap: int | None, out: Path, timeout: int) -> dict:
    """Run ``cmd`` (which writes its JSON to ``out``) under the cap; the row's measured figures."""
    full = [str(MEMCAP), str(cap), "--", *cmd] if cap is not None else cmd
    if cap is None:  # uncapped rows start cold too, like memcap's
        subprocess.run(["sync"], check=False)
        if os.access("/proc/sys/vm/drop_caches", os.W_OK):
            Path("/proc/sys/vm/drop_caches").write_text("1")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(full, capture_output=True, text=True, timeout=timeout, check=False)
        rc, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as err:
        rc, stderr = (
            124,
            (err.stderr or b"").decode() if isinstance(err.stderr, bytes) else (err.stderr or ""),
        )
    row: dict = {"command": shlex.join(full), "exit": rc, "wall_s": time.perf_counter() - t0}
    match = PEAK.search(stderr)
    if match:
        row["cgroup_peak_bytes"] = int(match.group(1)) * 2**20
        row["cap_hits"] = int(match.group(2))
    if rc == 0 and out.exists():
        row.update(json.loads(out.read_text()))
    else:
        row["status"] = "killed (out of memory)" if rc in (137, -9) else f"failed (exit {rc})"
        row["stderr_tail"] = [line for line in stderr.strip().splitlines() if not PEAK.search(line)][-3:]
    row.pop("texts", None)
    row.pop("timeline", None)
    return row


def corpus_prompts(args) -> list[str]:
    """The first 200 characters of the first ``--prompt-docs`` test documents of each domain."""
    per_domain: dict[str, list[str]] = {}
    with open(args.corpus / "test.jsonl") as f:
        for line in f:
            doc = json.loads(line)
            texts = per_domain.setdefault(doc.get("domain", "all"), [])
            if len(texts) < args.prompt_docs:
                texts.append(doc["text"][:200])
    return [text for domain in sorted(per_domain) for text in per_domain[domain]]


def moectl_cmd(
    args,
    policy: str,
    slot_dtype: str,
    out: Path,
    prompts: Path,
    routing: str = "none",
    budget: str | None = None,
) -> list[str]:
    return [
        sys.executable, "-m", "moectl.cli", "serve-offload", str(args.moectl_checkpoint or args.checkpoint),
        "--budget", budget or str(args.budget), "--policy", policy, "--store", "disk",
        "--read-method", args.read_method, "--slot-dtype", slot_dtype, "--max-new-tokens", str(args.tokens),
        "--prompts", str(prompts), "--json", str(out), *(["--routing", routing] if routing != "none" else []),
    ]  # fmt: skip


def whole_cmd(args, out: Path) -> list[str]:
    """moectl's engine on the whole model (``moectl_decode.py``): where it fits the cap, the best policy."""
    return [
        sys.executable, str(ROOT / "benchmarks" / "moectl_decode.py"), "--model", str(args.moectl_checkpoint or args.checkpoint),
        "--tokens", str(args.tokens), "--threads", str(args.threads), "--prompt", args.prompt, "--json", str(out),
        *(["--compile"] if args.whole == "compiled" else []),
    ]  # fmt: skip


def llama_cmd(args, out: Path) -> list[str]:
    return [
        sys.executable, str(ROOT / "benchmarks" / "llama_decode.py"), "--gguf", str(args.gguf),
        "--tokens", str(args.tokens), "--threads", str(args.threads), "--prompt", args.prompt, "--json", str(out),
        *(["--no-extra-bufts"] if args.llama_no_extra_bufts else []),
    ]  # fmt: skip


def _fmt(row: dict) -> str:
    def g(key, scale=1.0, digits=2):
        v = row.get(key)
        return "-" if v is None else f"{v / scale:.{digits}f}"

    cap = (
        "none"
        if row["cap_fraction"] is None
        else f"{row['cap_fraction']:.0%} ({row['cap_bytes'] / 2**30:.1f} GiB)"
    )
    return (
        f"| {row['system']} | {row.get('policy_label', '-')} | {cap} | {row.get('status', 'ok')} | "
        f"{g('decode_tokens_per_s')} | {g('time_to_first_token_s')} | {g('cgroup_peak_bytes', 2**30)} | "
        f"{g('peak_rss_bytes', 2**30)} | {g('disk_read_bytes_per_token', 2**20, 1)} | {g('hit_rate', 1, 3)} | "
        f"{g('switch_rate', 1, 3)} | {g('weights_gb_per_s')} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--gguf", type=Path, help="llama.cpp rows from this GGUF (its converter's output)")
    ap.add_argument(
        "--caps", default="none,0.60,0.45,0.35", help="fractions of the checkpoint's bytes, or none"
    )
    ap.add_argument("--policies", default="lru,option:8")
    ap.add_argument(
        "--routings",
        default="none",
        help="comma list of routings each policy runs with "
        "(none: the model's; topk:N, a policy file or JSON: serve-offload --routing)",
    )
    ap.add_argument("--budget", default="0.25")
    ap.add_argument(
        "--cap-budgets", default="", help="per cap, the budget of the moectl rows: 0.45:1.0,0.25:0.5"
    )
    ap.add_argument(
        "--moectl-checkpoint", type=Path, help="the moectl rows serve this folder (a quantized checkpoint)"
    )
    ap.add_argument(
        "--whole", choices=["eager", "compiled"], help="also rows of moectl's engine on the whole model"
    )
    ap.add_argument(
        "--llama-no-extra-bufts", action="store_true", help="llama.cpp rows without extra CPU buffer types"
    )
    ap.add_argument(
        "--slot-dtypes",
        default="same",
        help="moectl rows per resident slot dtype: same,int8 (offload/int8.py)",
    )
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--read-method", default="direct", choices=["direct", "fadvise", "plain"])
    ap.add_argument("--prompt", default="The history of the city begins with")
    ap.add_argument(
        "--corpus",
        type=Path,
        help="prompts from this corpus's test split: --prompt-docs documents per domain",
    )
    ap.add_argument("--prompt-docs", type=int, default=2, help="with --corpus: documents per domain")
    ap.add_argument(
        "--prompts",
        type=Path,
        help='a JSONL of prompts ({"prompt": ...} per line) instead of --prompt (moectl rows)',
    )
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per row")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.corpus is not None and not (args.corpus / "test.jsonl").is_file():
        print(
            f"error: --corpus {args.corpus} has no test.jsonl (a folder from moectl corpus build)",
            file=sys.stderr,
        )
        return 2
    if args.prompts is not None and not args.prompts.is_file():
        print(f"error: --prompts {args.prompts} is not a file (a JSONL of prompts)", file=sys.stderr)
        return 2
    total = checkpoint_bytes(args.checkpoint)
    if total == 0:
        print(f"error: {args.checkpoint} holds no *.safetensors", file=sys.stderr)
        return 2
    active = active_weight_bytes(args.checkpoint)
    caps = [None if c.strip() == "none" else float(c) for c in args.caps.split(",")]
    if any(c is not None for c in caps) and not MEMCAP.exists():
        print(f"error: {MEMCAP} not found (the memory-cap tool beside the project)", file=sys.stderr)
        return 2
    unknown = sorted(set(args.slot_dtypes.split(",")) - {"same", "int8"})
    if unknown:
        print(f"error: --slot-dtypes takes same and int8, got {', '.join(unknown)}", file=sys.stderr)
        return 2
    try:
        cap_budgets = {
            (None if c == "none" else float(c)): b
            for c, b in (item.split(":") for item in args.cap_budgets.split(",") if item)
        }
    except ValueError:
        print(
            f"error: --cap-budgets takes CAP:BUDGET pairs, e.g. 0.45:1.0,0.25:0.5; got {args.cap_budgets!r}",
            file=sys.stderr,
        )
        return 2
    rows = []
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    with tempfile.TemporaryDirectory(prefix="moectl-capped-") as tmp:
        prompts = args.prompts or Path(tmp) / "prompts.jsonl"
        if args.corpus is not None:
            prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in corpus_prompts(args)))
        elif args.prompts is None:
            prompts.write_text(json.dumps({"prompt": args.prompt}) + "\n")
        slot_dtypes = args.slot_dtypes.split(",")
        routings = args.routings.split(",")
        systems = [
            ("moectl", p, d, r) for d in slot_dtypes for p in args.policies.split(",") for r in routings
        ]
        if args.whole is not None:
            systems.insert(0, ("moectl (whole)", args.whole, "same", "none"))
        if args.gguf is not None:
            systems.insert(0, ("llama.cpp", "mmap", "bf16", "none"))
        for fraction in caps:
            cap = None if fraction is None else int(fraction * total)
            for system, policy, slot_dtype, routing in systems:
                name = f"{system}-{policy}-{slot_dtype}-{routing}-{fraction}.json"
                out = Path(tmp) / name.replace(":", "_").replace(" ", "_")
                if system == "llama.cpp":
                    cmd = llama_cmd(args, out)
                elif system == "moectl (whole)":
                    cmd = whole_cmd(args, out)
                else:
                    cmd = moectl_cmd(
                        args, policy, slot_dtype, out, prompts, routing, cap_budgets.get(fraction)
                    )
                print(f"[{system} {policy} {slot_dtype} {routing} cap={fraction}] running ...", flush=True)
                row = _run(cmd, cap, out, args.timeout)
                label = policy if slot_dtype == "same" else f"{policy}, {slot_dtype} slots"
                label += "" if routing == "none" else f", routing {routing}"
                row.update(
                    system=system,
                    policy_label=label
                    if system == "moectl"
                    else ("mmap" if system == "llama.cpp" else f"whole, {policy}"),
                    budget=cap_budgets.get(fraction, args.budget) if system == "moectl" else None,
                    served=str(args.gguf)
                    if system == "llama.cpp"
                    else str(args.moectl_checkpoint or args.checkpoint),
                    cap_fraction=fraction,
                    cap_bytes=cap,
                    checkpoint_bytes=total,
                    active_weight_bytes_per_token=active,
                )
                if (
                    row.get("decode_tokens_per_s") and args.moectl_checkpoint is None
                ):  # bf16 bytes: not of a quantized row
                    row["weights_gb_per_s"] = active * row["decode_tokens_per_s"] / 1e9
                rows.append(row)
                print(_fmt(row), flush=True)
    header = (
        "| system | policy | cap | status | decode tok/s | TTFT s | cgroup peak GiB | peak RSS GiB | "
        "disk MiB/token | hit rate | switch rate | weights GB/s |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    print(
        f"\ncheckpoint {args.checkpoint} ({total / 1e9:.2f} GB), budget {args.budget}, {args.tokens} tokens"
        f" per prompt"
    )
    print(header)
    for row in rows:
        print(_fmt(row))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "checkpoint": str(args.checkpoint),
                    "bytes": total,
                    "active_weight_bytes_per_token": active,
                    "rows": rows,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
