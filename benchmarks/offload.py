"""Expert offloading: bytes moved per token, hit rate and tokens/s per policy at 50% and 25% budgets.

For each model (a tiny random OLMoE and, when given, moectl's own pretrained MoE), with experts
in host memory (and on disk with --disk), one run prints per policy and budget: decode loads and
bytes moved per generated token, hit rate, and tokens/s relative to the fully resident model
(measured in the same run, one prompt at a time, greedy). Policies: ``lru``, ``option:B`` (the
router-as-option rule with k-hat = the budget B), ``option:K`` (k-hat = top-k K, when B > K: the
budget's spare slots take prefetches) and ``static`` (the B experts used most often per layer on
the same prompts by the in-memory model: an oracle subset, routing restricted to it).

Each policy runs twice: synchronous loads, and asynchronous loads with prefetch (a worker thread
on CPU, a side stream on CUDA; ``moectl.offload.expert_loader``, ``moectl.offload.prefetch``). Also printed:
stall seconds per token (the load time compute waited for; with synchronous loads all of it) and
the prefetch hit rate (prefetched experts demanded before eviction / prefetch loads; "-" when
nothing was prefetched: with k-hat = B every slot holds the pinned option, so there is no room).

Goal (issue 8): at 25%, option moves >= 5x fewer bytes per token than lru and keeps >= 0.8x the
resident tokens/s with experts in host memory. Also printed: what each policy's measured loads
per token per layer would cost per token on gpt-oss-20b, OLMoE-1B-7B and Mixtral-8x7B at the
measured host-memory bandwidth (a CPU RAM copy here; on a GPU host the PCIe bandwidth applies).

With ``--llama-cpp`` (``pip install 'moectl[llama]'``), every checkpoint-folder model is also
exported to GGUF (``moectl export gguf``) and decoded by llama.cpp on the same prompt tokens, same
greedy length, same thread count (``--threads``): fully resident and memory-mapped
(``llama_peer.py``), printed beside the offloading rows relative to the same resident baseline.

    python benchmarks/offload.py [--model tiny:olmoe --model runs/standard-small/checkpoints/step-000199]
        [--max-new-tokens 32] [--disk] [--llama-cpp] [--threads 1] [--json out/offload.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import torch

import moectl
from moectl.generate import generate, load_prompts
from moectl.models.load import load_model
from moectl.offload.offload_config import OffloadConfig
from moectl.server.offload_batch import serve_offload

# (MoE layers, top-k, experts, bytes of one expert in bf16): from the public configs
REAL_MODELS = {
    "gpt-oss-20b": (24, 4, 32, 2 * (2880 * 5760 + 5760 + 2880 * 2880 + 2880)),
    "OLMoE-1B-7B": (16, 8, 64, 2 * 3 * 2048 * 1024),
    "Mixtral-8x7B": (32, 2, 8, 2 * 3 * 4096 * 14336),
}


def _resident_tokens_per_s(model, tok, prompts, n: int) -> tuple[float, float]:
    """(tokens per wall second, tokens per process CPU second) of the fully resident model."""
    t0, c0 = time.perf_counter(), time.process_time()
    generate(model, tok, prompts, n, batch_size=1, progress=False)
    return len(prompts) * n / (time.perf_counter() - t0), len(prompts) * n / (time.process_time() - c0)


def _frequent_subsets(model, tok, prompts, n: int, b: int) -> dict[int, list[int]]:
    with moectl.route(model, record=True) as session:
        generate(model, tok, prompts, n, batch_size=1, progress=False)
    trace = session.trace
    return {
        layer: trace.chosen_mask(layer)[trace.valid].sum(0).topk(b).indices.sort().values.tolist()
        for layer in trace.chosen
    }


def _policies(b: int, top_k: int, subset_file: Path) -> list[str]:
    spare = [f"option:{top_k}"] if b > top_k else []  # room for prefetches next to the option
    return ["lru", f"option:{b}", *spare, f"static:{subset_file}"]


def _run_name(folder: Path) -> str:
    return folder.parent.name if folder.name == "final" else folder.name


def _controlled(model, folder: Path) -> tuple[object, object, int]:
    """(model with the controller's adapters merged, its controller, k-hat): a copy, the base stays."""
    from moectl.options.option_state import load_controlled

    net, controller, _, _ = load_controlled(copy.deepcopy(model), folder, merge=True)
    net.eval()
    return net, controller, controller.k_hat


def bench_model(spec: str, max_new_tokens: int, stores: list[str], controllers: list[Path] = ()) -> dict:
    model, tok = load_model(spec)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # what offloading runs: compare like with like
    info = moectl.inspect(model)
    prompts = load_prompts(None)
    e, k = info.num_experts, info.top_k
    base = [_resident_tokens_per_s(model, tok, prompts, max_new_tokens)]
    rows = []
    trained = [_controlled(model, folder) for folder in controllers]
    for frac in (0.5, 0.25):
        b = int(frac * e)
        subsets = _frequent_subsets(model, tok, prompts, max_new_tokens, b)
        with tempfile.TemporaryDirectory() as tmp:
            subset_file = Path(tmp) / "subset.json"
            subset_file.write_text(json.dumps(subsets))
            runs = [(model, p, p) for p in _policies(b, k, subset_file)]
            runs += [(net, ctrl, f"controller:{_run_name(folder)}") for (net, ctrl, k_hat), folder in
                     zip(trained, controllers, strict=True) if k_hat <= b]  # fmt: skip
            for store in stores:
                for (net, policy, label), async_loads in (
                    (run, a) for run in runs for a in (False, True)
                ):
                    if not isinstance(policy, str):  # a controller: fresh per-sequence state each run
                        from moectl.offload.residency import ControllerResidency

                        policy = ControllerResidency(policy, seed=0)
                    config = OffloadConfig(frac, policy, store, async_loads=async_loads, prefetch=async_loads)
                    r = serve_offload(net, tok, prompts, config, max_new_tokens, progress=False)
                    base.append(_resident_tokens_per_s(model, tok, prompts, max_new_tokens))
                    rows.append(
                        {
                            "budget": frac,
                            "experts": b,
                            "store": store,
                            "policy": label if label.startswith("controller:") else r["policy"],
                            "async_loads": r["async_loads"],
                            "loader": r["loader"],
                            "prefetch": r["prefetch"],
                            "loads_per_token": r["loads_per_token"],
                            "loads_per_token_per_layer": r["loads_per_token"] / info.num_moe_layers,
                            "bytes_moved_per_token": r["bytes_moved_per_token"],
                            "hit_rate": r["hit_rate"],
                            "tokens_per_s": r["tokens_per_s"],
                            "tokens_per_cpu_s": r["tokens_per_cpu_s"],
                            "load_s": r["load_s"],
                            "stall_s": r["stall_s"],
                            "stall_s_per_token": r["stall_s_per_token"],
                            "load_overlap": r["load_overlap"],
                            "prefetch_loads": r["prefetch_loads"],
                            "prefetch_hits": r["prefetch_hits"],
                            "prefetch_wasted": r["prefetch_wasted"],
                            "prefetch_hit_rate": r["prefetch_hit_rate"],
                            "expert_compute_s": r["expert_compute_s"],
                            "resident_expert_bytes": r["resident_expert_bytes"],
                            "total_expert_bytes": r["total_expert_bytes"],
                            "one_expert_load_s": r["load_latency"]["load_s"],
                            "bandwidth_bytes_per_s": r["load_latency"]["bandwidth_bytes_per_s"],
                            "eta": r["eta"]["value"],
                        }
                    )
    # medians of the resident runs, interleaved with the offloaded ones so that drift hits both
    resident = sorted(w for w, _ in base)[len(base) // 2]
    resident_cpu = sorted(c for _, c in base)[len(base) // 2]
    for row in rows:
        row["relative_tokens_per_s"] = row["tokens_per_s"] / resident
        row["relative_tokens_per_cpu_s"] = row["tokens_per_cpu_s"] / resident_cpu
    return {
        "model": spec,
        "experts": e,
        "top_k": k,
        "resident_tokens_per_s": resident,
        "resident_tokens_per_cpu_s": resident_cpu,
        "rows": rows,
    }


def real_model_costs(rows: list[dict], top_k: int, bandwidth: float) -> list[dict]:
    """Seconds of loading per token on real models if they loaded experts at the measured rate.

    The measured loads per token per layer are taken as a fraction of top-k replaced per step
    and scaled to each model's top-k (an extrapolation from a small model, not a measurement).
    """
    out = []
    for row in rows:
        for name, (layers, k, _, expert_bytes) in REAL_MODELS.items():
            loads = row["loads_per_token_per_layer"] / top_k * k * layers
            out.append(
                {
                    "policy": row["policy"],
                    "budget": row["budget"],
                    "model": name,
                    "loads_per_token": loads,
                    "bytes_per_token": loads * expert_bytes,
                    "load_s_per_token": loads * expert_bytes / bandwidth,
                }
            )
    return out


def _llama_rows(spec: str, max_new_tokens: int, threads: int, resident: float) -> list[dict]:
    """llama.cpp on the same prompts and token count (``llama_peer.py``), relative to ``resident``."""
    from transformers import AutoTokenizer

    from llama_peer import llama_cpp_rows

    tok = AutoTokenizer.from_pretrained(spec)
    with tempfile.TemporaryDirectory() as tmp:
        texts = [p.text for p in load_prompts(None)]
        rows = llama_cpp_rows(spec, tok, texts, max_new_tokens, threads, Path(tmp))
    return [{**r, "relative_tokens_per_s": r["tokens_per_s"] / resident} for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="tiny:FAMILY or a checkpoint (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--disk", action="store_true", help="also serve from the disk store")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--controller", type=Path, action="append", default=[],
        help="a `moectl options train` folder for the (last) --model; run where its k-hat fits the budget",
    )  # fmt: skip
    parser.add_argument("--llama-cpp", action="store_true", help="also decode with llama.cpp (llama_peer.py)")
    parser.add_argument("--threads", type=int, default=1, help="torch and llama.cpp threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    stores = ["host", "disk"] if args.disk else ["host"]
    results = []
    specs = args.model or ["tiny:olmoe"]
    for spec in specs:
        res = bench_model(spec, args.max_new_tokens, stores, args.controller if spec == specs[-1] else [])
        host = [r for r in res["rows"] if r["store"] == "host" and not r["async_loads"]]
        bandwidth = sorted(r["bandwidth_bytes_per_s"] for r in host)[len(host) // 2]
        res["host_bandwidth_bytes_per_s"] = bandwidth
        res["real_models"] = real_model_costs(host, res["top_k"], bandwidth)
        if args.llama_cpp and Path(spec).is_dir():
            res["llama_cpp"] = _llama_rows(spec, args.max_new_tokens, args.threads, res["resident_tokens_per_s"])
        results.append(res)
        print(
            f"\n{spec}: {res['experts']} experts, top-{res['top_k']}, resident "
            f"{res['resident_tokens_per_s']:.1f} tok/s, {res['resident_tokens_per_cpu_s']:.1f} tok/cpu-s"
        )
        print(
            f"{'budget':>6} {'store':>5} {'policy':>28} {'loads':>11} {'loads/tok':>9} {'KiB/tok':>9} "
            f"{'hit':>6} {'stall ms/tok':>12} {'prefetch hit':>12} {'rel tok/s':>9} {'rel tok/cpu-s':>13}"
        )
        for r in res["rows"]:
            loads = (
                "async+pf" if r["async_loads"] and r["prefetch"] else "async" if r["async_loads"] else "sync"
            )
            pf = "-" if r["prefetch_hit_rate"] is None else f"{r['prefetch_hit_rate']:.3f}"
            print(
                f"{r['budget']:>6} {r['store']:>5} {r['policy']:>28} {loads:>11} {r['loads_per_token']:>9.2f} "
                f"{r['bytes_moved_per_token'] / 1024:>9.1f} {r['hit_rate']:>6.3f} "
                f"{r['stall_s_per_token'] * 1e3:>12.3f} {pf:>12} {r['relative_tokens_per_s']:>9.2f} "
                f"{r['relative_tokens_per_cpu_s']:>13.2f}"
            )
        for frac in (0.5, 0.25):
            at = [r for r in host if r["budget"] == frac]
            by = {
                "lru": next(r for r in at if r["policy"] == "lru"),
                "option": next(r for r in at if r["policy"] == f"option:{r['experts']}"),
            }
            if by["option"]["bytes_moved_per_token"] > 0:
                ratio = by["lru"]["bytes_moved_per_token"] / by["option"]["bytes_moved_per_token"]
                print(
                    f"budget {frac}: lru moves {ratio:.2f}x the bytes per token of option (goal at 0.25: >= 5)"
                )
        print(
            f"host bandwidth {bandwidth / 1e9:.2f} GB/s; load seconds per token on real models (extrapolated):"
        )
        for c in res["real_models"]:
            print(
                f"  {c['model']:>13} {c['policy']:>28} @{c['budget']}: {c['load_s_per_token'] * 1e3:8.2f} ms/token"
            )
        for r in res.get("llama_cpp", []):
            decode = "-" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.1f}"
            print(
                f"llama.cpp {r['setting']:>8} ({r['outtype']}, {r['threads']} threads): {r['tokens_per_s']:.1f} tok/s "
                f"= {r['relative_tokens_per_s']:.2f}x resident transformers; decode steps alone {decode} tok/s"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
