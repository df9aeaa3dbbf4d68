"""Where a decode step spends its time: plain transformers ``generate`` vs ``moectl serve-offload``.

Issue 15.5 asks that the routing and residency machinery cost <= 10% of a decode step. This
script measures, it does not optimise: on the same model, prompts (moectl's defaults) and token
count, greedy, batch 1, it runs

- ``transformers``: ``moectl.generate.generate`` on the model as loaded (the experts'
  default implementation) and with ``set_experts_implementation("eager")`` (what offloading runs);
- ``serve-offload``: what ``moectl serve-offload MODEL --budget B`` runs (its defaults: lru, the
  checkpoint's shards as the store), the model loaded once, only ``serve_offload`` timed.

- with ``--llama-cpp``: llama.cpp on the GGUF export, resident and mmap'd (``llama_peer.py``).

All are timed without a profiler, in ``--rounds`` interleaved rounds (so that a shared machine's
drift hits each alike; medians printed, per wall second and per process-CPU second), then the three torch runs once more under
``cProfile``: own time grouped by where the code lives (moectl, transformers, torch's Python,
torch/C++ built-ins, other), the top functions by own time, and moectl's by cumulative time.
Profiler overhead inflates Python-heavy paths: compare groups and call counts between runs, and
trust the unprofiled tokens/s for speed. ``serve-offload`` at budget 1.0 loads every expert once
per run (each run is a fresh offload context, as each command is), included in its time; the
``warm`` row is the same offloaded model entered once with every budgeted expert already
resident — the routing and residency machinery of a steady-state decode step, no loads.

    python benchmarks/decode_profile.py [--model models/moectl-small-standard] [--budget 1.0]
        [--max-new-tokens 128] [--threads 2] [--rounds 3] [--llama-cpp] [--no-profile] [--top 15] [--json out/decode_profile.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from moectl.generate import generate, load_prompts
from moectl.models.load import load_model


def _group(file: str, name: str) -> str:
    if "/moectl/" in file:
        return "moectl (python)"
    if "/transformers/" in file:
        return "transformers (python)"
    if "/torch/" in file:
        return "torch (python)"
    if file == "~" and ("torch" in name or "Tensor" in name or "_C." in name):
        return "torch ops (C++ built-ins)"
    return "other"


def breakdown(stats: pstats.Stats, top: int) -> dict:
    """Own time per group; top functions by own time; moectl functions by cumulative time."""
    groups: dict[str, float] = defaultdict(float)
    rows = []
    for (file, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        groups[_group(file, name)] += tottime
        where = f"{Path(file).name}:{line}({name})" if file != "~" else name
        rows.append({"function": where, "file": file, "calls": calls, "own_s": tottime, "cum_s": cumtime})
    total = sum(groups.values())
    by_own = sorted(rows, key=lambda r: -r["own_s"])[:top]
    moectl_cum = sorted((r for r in rows if "/moectl/" in r["file"]), key=lambda r: -r["cum_s"])[:top]
    return {
        "total_own_s": total,
        "groups": {k: {"s": v, "share": v / total} for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_own": by_own,
        "top_moectl_cumulative": moectl_cum,
    }


def _plain(model, tok, prompts, n: int) -> None:
    generate(model, tok, prompts, n, batch_size=1, progress=False)


def _serve_setup(spec: str, budget: float):
    """What ``moectl serve-offload SPEC --budget B`` builds before generating (its defaults: lru,
    the checkpoint's shards as the store, read on demand): (model, tokenizer, config, reader)."""
    from moectl.models.load_lazy import load_lazy
    from moectl.offload.offload_config import OffloadConfig
    from moectl.offload.residency import parse_policy

    net, tok, reader = load_lazy(spec)
    config = OffloadConfig(budget=budget, store="disk")
    return net, tok, config.with_(policy=parse_policy("lru", net)), reader


def _serve(setup, prompts, n: int, out: dict) -> None:
    from moectl.server.offload_batch import serve_offload

    net, tok, config, reader = setup
    out.update(serve_offload(net, tok, prompts, config, n, progress=False, reader=reader))


def _warm(setup):
    """The offloaded model entered once, every budgeted expert made resident: what a decode step
    costs in steady state, without the one-time loads a fresh ``serve-offload`` run includes."""
    from moectl.offload import offload
    from moectl.routing import route

    net, tok, config, reader = setup
    if hasattr(net, "set_experts_implementation"):
        net.set_experts_implementation("eager")
    rt = offload(net, config, reader=reader).__enter__()
    for res in rt.resident_sets:
        for expert in range(res.budget):
            res.ensure(expert)
        res.drain()

    def run(prompts, n: int) -> None:
        with route(net, rt.policy.routing(rt.info)):
            _plain(net, tok, prompts, n)

    return rt, run


def profile(label: str, fn, tokens: int, top: int) -> dict:
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.runcall(fn)
    wall = time.perf_counter() - t0
    return {"run": label, "profiled_tokens_per_s": tokens / wall} | breakdown(pstats.Stats(profiler), top)


def _llama_runners(spec: str, tok, prompts, n: int, threads: int, tmp: Path) -> dict:
    """llama.cpp on the same prompt ids and greedy length (``llama_peer.py``), resident and mmap'd."""
    from llama_peer import SETTINGS, decode_all, greedy, open_llama
    from moectl.export import write_gguf

    path = tmp / "model.gguf"
    report = write_gguf(spec, path)
    ids = [tok(p.text)["input_ids"] for p in prompts]
    runners = {}
    for setting, kwargs in SETTINGS.items():
        llm = open_llama(path, threads, n_ctx=max(map(len, ids)) + n + 8, **kwargs)
        greedy(llm, ids[0], 4, tok.eos_token_id)  # warm-up
        runners[f"llama.cpp {setting} ({report['outtype']})"] = lambda llm=llm: decode_all(
            llm, ids, n, tok.eos_token_id
        )
    return runners


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/moectl-small-standard")
    parser.add_argument("--budget", default="1.0")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, runs interleaved; medians")
    parser.add_argument("--llama-cpp", action="store_true", help="also time llama.cpp (llama_peer.py)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--no-profile", action="store_true", help="timing only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = load_prompts(None)
    n = args.max_new_tokens
    tokens = len(prompts) * n
    model, tok = load_model(args.model)
    impl = getattr(model.config, "_experts_implementation", None) or "default"

    def plain(experts: str):
        def fn() -> None:
            if hasattr(model, "set_experts_implementation") and experts != "default":
                model.set_experts_implementation(experts)
            _plain(model, tok, prompts, n)

        return fn

    setup = _serve_setup(args.model, float(args.budget))
    eager = (*setup[:2], setup[2].with_(experts_forward="eager"), setup[3])  # the per-expert loop it replaced
    served: dict = {}
    warm_setup = _serve_setup(args.model, float(args.budget))  # a second lazily loaded copy, kept offloaded
    warm_rt, warm_run = _warm(warm_setup)
    runners = {
        f"transformers ({impl} experts)": plain(impl),
        "transformers (eager experts)": plain("eager"),
        f"serve-offload --budget {args.budget}": lambda: _serve(setup, prompts, n, served),
        f"serve-offload --budget {args.budget} (eager)": lambda: _serve(eager, prompts, n, served),
        f"serve-offload --budget {args.budget}, warm": lambda: warm_run(prompts, n),
    }
    with tempfile.TemporaryDirectory() as tmp:
        if args.llama_cpp:
            runners |= _llama_runners(args.model, tok, prompts, n, args.threads, Path(tmp))
        plain(impl)()  # warm-up
        speeds: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
        for _ in range(args.rounds):
            for name, fn in runners.items():
                t0, c0 = time.perf_counter(), time.process_time()
                fn()
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                speeds[name].append((tokens / wall, tokens / cpu))
    timing = [
        {
            "run": k,
            "tokens_per_s": sorted(w for w, _ in v)[len(v) // 2],
            "tokens_per_cpu_s": sorted(c for _, c in v)[len(v) // 2],
            "rounds": v,
        }
        for k, v in speeds.items()
    ]
    names = [] if args.no_profile else list(runners)[:3]
    profiles = [profile(name, runners[name], tokens, args.top) for name in names]
    setup[3].close()
    warm_rt.close()
    warm_setup[3].close()
    for fn in runners.values():
        if hasattr(fn, "llm"):
            fn.llm.close()
    print(f"{args.model}: {len(prompts)} prompts x {n} greedy tokens, batch 1, {args.threads} threads")
    print(f"median of {args.rounds} interleaved rounds, prompt included; per process-CPU second too (the")
    print("figure a shared machine distorts least at 1 thread: spinning threads inflate it at more):")
    base, base_cpu = timing[0]["tokens_per_s"], timing[0]["tokens_per_cpu_s"]
    for t in timing:
        print(f"  {t['run']:>34}: {t['tokens_per_s']:7.1f} tok/s {t['tokens_per_s'] / base:5.2f}x | "
              f"{t['tokens_per_cpu_s']:7.1f} tok/cpu-s {t['tokens_per_cpu_s'] / base_cpu:5.2f}x | "
              f"rounds {' '.join(f'{w:.1f}' for w, _ in t['rounds'])}")  # fmt: skip
    for r in profiles:
        print(f"\n== {r['run']} under cProfile: {r['profiled_tokens_per_s']:.1f} tok/s")
        print(f"own time {r['total_own_s']:.2f} s by group:")
        for name, g in r["groups"].items():
            print(f"  {name:>26}: {g['s']:7.2f} s  {100 * g['share']:5.1f}%")
        print("top functions by own time (s, calls):")
        for f in r["top_own"]:
            print(f"  {f['own_s']:7.3f} s  {f['calls']:>8}  {f['function']}")
        if r["top_moectl_cumulative"]:
            print("moectl functions by cumulative time:")
            for f in r["top_moectl_cumulative"]:
                print(f"  {f['cum_s']:7.3f} s  {f['calls']:>8}  {f['function']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "model": args.model,
            "threads": args.threads,
            "tokens": tokens,
            "timing": timing,
            "profiles": profiles,
        }
        args.json.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
