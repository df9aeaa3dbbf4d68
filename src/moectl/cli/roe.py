"""``moectl roe ...``: Roster of Experts from the command line (``moectl.cli`` mounts ``roe_app`` as ``roe``).

    moectl roe generate MODEL --k 16 --temperatures profile.json --prompt "..." --max-new-tokens 128
    moectl roe score    MODEL --k 16 --temperatures profile.json --data heldout.jsonl
    moectl roe tune     MODEL --k 16 --data val.jsonl --objective ppl --trials 50 --max-tau 0.5 --skip-layers 1 --out profile.json
    moectl roe bench    MODEL --k 1,2,4,8,16,32,64

MODEL is ``tiny:FAMILY`` (an offline random model), a checkpoint directory or a hub id; ``--tiny
FAMILY`` works too. ``--temperatures`` takes a tau profile JSON (from ``roe tune``), one number for
every MoE layer, or a comma list with one value per MoE layer. Each verb prints a rich table and
writes the same results with ``--json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moectl.cli.common import (
    DeviceOpt,
    DtypeOpt,
    ForceOpt,
    JsonOpt,
    MaxNewTokensOpt,
    MoectlGroup,
    OptionalModelArg,
    QuantizeOpt,
    RoEAggregationOpt,
    RoECacheOpt,
    RoEKOpt,
    RoESeedOpt,
    RoETemperaturesOpt,
    TinyOpt,
    check_out_file,
    check_out_folder,
    console,
    interrupted,
    load,
    model_spec,
    write_json,
)
from moectl.errors import ConfigError

roe_app = typer.Typer(cls=MoectlGroup, help="Roster of Experts: K-sample routing ensembles with a clean KV cache (RoE §2).",
                      no_args_is_help=True)  # fmt: skip

BatchSizeOpt = Annotated[int, typer.Option("--batch-size", help="Sequences per forward pass.")]
MaxLengthOpt = Annotated[
    int, typer.Option("--max-length", help="Tokens per sequence (context cut on the left).")
]
LimitOpt = Annotated[int | None, typer.Option("--limit", help="Use only the first N items of --data.")]


# -- helpers --------------------------------------------------------------------------------
def _config(k: int | None, temperatures: str | None, cache: str, aggregation: str, seed: int):
    """RoEConfig from the CLI options (``moectl.ensemble.roe_config.config_from_options``)."""
    from moectl.ensemble.roe_config import config_from_options

    try:
        return config_from_options(k, temperatures, cache, aggregation, seed)
    except ValueError as err:
        if not str(err).startswith("--temperatures"):
            raise
        raise typer.BadParameter(str(err)) from None


def _taus_text(taus: list[float]) -> str:
    return "0" if not any(taus) else ", ".join(f"{t:.3g}" for t in taus)


# -- generate -------------------------------------------------------------------------------
@roe_app.command("generate")
def generate_cmd(
    model: OptionalModelArg = None,
    tiny: TinyOpt = None,
    k: RoEKOpt = None,
    temperatures: RoETemperaturesOpt = None,
    prompt: Annotated[
        list[str] | None, typer.Option("--prompt", help="A prompt (repeat for a batch).")
    ] = None,
    prompts: Annotated[
        Path | None, typer.Option("--prompts", help="JSONL with 'prompt' (or 'text') per line.")
    ] = None,
    max_new_tokens: MaxNewTokensOpt = 128,
    sampling_temperature: Annotated[
        float, typer.Option("--sampling-temperature", help="0 = greedy (the paper's setting); > 0 samples.")
    ] = 0.0,
    top_p: Annotated[
        float, typer.Option("--top-p", help="Nucleus sampling mass (with a sampling temperature).")
    ] = 1.0,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Always generate max-new-tokens.")] = False,
    adaptive: Annotated[
        float | None,
        typer.Option("--adaptive", help="Adaptive K: noisy samples only where clean entropy > this (nats)."),
    ] = None,
    cache: RoECacheOpt = "clean",
    aggregation: RoEAggregationOpt = "prob_mean",
    seed: RoESeedOpt = 0,
    batch_size: BatchSizeOpt = 8,
    stream: Annotated[
        bool, typer.Option("--stream/--no-stream", help="Print tokens as they come (one prompt).")
    ] = True,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    quantize: QuantizeOpt = None,
    force: ForceOpt = False,
    json_path: JsonOpt = None,
) -> None:
    """Generate with a K-sample RoE ensemble per token (greedy by default, RoE §3.1)."""
    from moectl.adapters.inspect import inspect
    from moectl.ensemble.roe_config import config_dict
    from moectl.generate import load_prompts
    from moectl.roe.roe_generate import GenerationStats, generate
    from moectl.routing.made_for import policy_target

    spec = model_spec(model, tiny)
    config = _config(k, temperatures, cache, aggregation, seed)
    texts = list(prompt or [])
    if prompts is not None:
        texts += [p.text for p in load_prompts(str(prompts))]
    if not texts:
        raise ConfigError("give --prompt TEXT (repeatable) or --prompts FILE.jsonl")
    lm, tokenizer = load(spec, device, dtype, quantize=quantize)
    info = inspect(lm)
    with policy_target(spec, force=force):  # a tau profile made for another model: refused unless --force
        taus = config.taus(info.num_moe_layers)
    streaming = stream and len(texts) == 1
    if streaming:
        console.print(f"[bold]{texts[0]}[/bold]", end="")

    def on_text(row: int, piece: str) -> None:
        console.print(piece, end="", markup=False, highlight=False, soft_wrap=True)

    stats = GenerationStats()
    outs = generate(
        lm, tokenizer, texts, config, max_new_tokens=max_new_tokens, temperature=sampling_temperature,
        top_p=top_p, stop=stop or (), ignore_eos=ignore_eos, batch_size=batch_size, sample_seed=seed,
        on_text=on_text if streaming else None, progress=not streaming, info=info,
        adaptive_threshold=adaptive, stats=stats,
    )  # fmt: skip
    if streaming:
        console.print()
    table = Table(title=f"RoE generate {spec}: K={config.K}, tau=[{_taus_text(taus)}], cache={config.cache}")
    table.add_column("#", justify="right")
    table.add_column("prompt")
    table.add_column("generated")
    table.add_column("tokens", justify="right")
    table.add_column("finish")
    for n, out in enumerate(outs):
        table.add_row(str(n), out.prompt[:40], out.text[:200], str(len(out.token_ids)), out.finish_reason)
    console.print(table)
    ms = 1e3 * stats.seconds / max(stats.steps, 1)
    console.print(
        f"{stats.steps} steps, {stats.forwards} forwards, {ms:.1f} ms per step, "
        f"{stats.sample_tokens / max(stats.tokens, 1):.2f} routing samples per generated token"
    )
    write_json(json_path, {
        "model": spec,
        "config": config_dict(config, info.num_moe_layers),
        "decoding": {"max_new_tokens": max_new_tokens, "temperature": sampling_temperature, "top_p": top_p,
                     "stop": stop or [], "ignore_eos": ignore_eos, "adaptive_threshold": adaptive},
        "outputs": [out.__dict__ for out in outs],
        "stats": stats.__dict__,
    })  # fmt: skip


# -- score ----------------------------------------------------------------------------------
@roe_app.command("score")
def score_cmd(
    model: OptionalModelArg = None,
    tiny: TinyOpt = None,
    k: RoEKOpt = None,
    temperatures: RoETemperaturesOpt = None,
    data: Annotated[
        Path | None, typer.Option("--data", help="JSONL(.gz): text | prompt+continuation | choices.")
    ] = None,
    limit: LimitOpt = None,
    batch_size: BatchSizeOpt = 8,
    max_length: MaxLengthOpt = 512,
    method: Annotated[str, typer.Option("--method", help="auto | parallel | stepwise.")] = "auto",
    baseline: Annotated[
        bool, typer.Option("--baseline/--no-baseline", help="Also score the plain model.")
    ] = True,
    adaptive: Annotated[
        str | None,
        typer.Option(
            "--adaptive", help="Adaptive-K trade-off: entropy thresholds (comma list, nats) or 'auto'."
        ),
    ] = None,
    cache: RoECacheOpt = "clean",
    aggregation: RoEAggregationOpt = "prob_mean",
    seed: RoESeedOpt = 0,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    quantize: QuantizeOpt = None,
    force: ForceOpt = False,
    json_path: JsonOpt = None,
) -> None:
    """RoE log-likelihood of held-out data: perplexity, multiple-choice or exact-match accuracy."""
    from moectl.adapters.inspect import inspect
    from moectl.ensemble.roe_config import config_dict
    from moectl.roe.score import score
    from moectl.roe.score_data import load_items
    from moectl.routing.made_for import policy_target

    spec = model_spec(model, tiny)
    if data is None:
        raise ConfigError("give --data FILE.jsonl (see `moectl.roe.score_data` for the accepted lines)")
    config = _config(k, temperatures, cache, aggregation, seed)
    items = load_items(data, limit)
    lm, tokenizer = load(spec, device, dtype, quantize=quantize)
    info = inspect(lm)
    with policy_target(spec, force=force):  # a tau profile made for another model: refused unless --force
        taus = config.taus(info.num_moe_layers)
    runs = [("RoE", config)]
    if baseline:
        runs.insert(0, ("plain (K=1)", config.with_(K=1, tau=0.0)))
    results = {}
    for label, cfg in runs:
        results[label] = score(
            lm, tokenizer, items, cfg, batch_size=batch_size, max_length=max_length, method=method,
            progress=True, info=info,
        )  # fmt: skip
    trade = None
    if adaptive is not None:
        from moectl.roe.adaptive import trade_off

        try:
            thresholds = None if adaptive == "auto" else [float(x) for x in adaptive.split(",")]
        except ValueError:
            raise ConfigError(f"--adaptive must be auto or a comma list of numbers (nats), got {adaptive!r}") from None
        trade = trade_off(lm, tokenizer, items, config, thresholds, batch_size=batch_size,
                          max_length=max_length, info=info)  # fmt: skip
    table = Table(title=f"RoE score {spec} on {data}: K={config.K}, tau=[{_taus_text(taus)}]")
    for col in ("run", "items", "tokens", "perplexity", "accuracy", "seconds"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for label, res in results.items():
        acc = "" if res.accuracy is None else f"{res.accuracy:.4f}"
        ppl = "" if res.kind == "gen" else f"{res.ppl:.4f}"
        table.add_row(label, str(res.items), str(res.tokens), ppl, acc, f"{res.seconds:.2f}")
    console.print(table)
    if trade:
        t2 = Table(title="Adaptive K: quality vs compute (teacher-forced, clean cache)")
        for col in ("mode", "samples/token", "noisy tokens", "perplexity", "seconds"):
            t2.add_column(col, justify="left" if col == "mode" else "right")
        for row in trade:
            t2.add_row(row["mode"], f"{row['samples_per_token']:.2f}", f"{row['noisy_fraction']:.0%}",
                       f"{row['ppl']:.4f}", f"{row['seconds']:.1f}")  # fmt: skip
        console.print(t2)
    write_json(json_path, {
        "model": spec,
        "data": str(data),
        "config": config_dict(config, info.num_moe_layers),
        "results": {label: res.summary() for label, res in results.items()},
        "adaptive": trade,
    })  # fmt: skip


# -- tune -----------------------------------------------------------------------------------
@roe_app.command("tune")
def tune_cmd(
    model: OptionalModelArg = None,
    tiny: TinyOpt = None,
    k: RoEKOpt = None,
    data: Annotated[Path | None, typer.Option("--data", help="Validation JSONL(.gz).")] = None,
    objective: Annotated[
        str, typer.Option("--objective", help="ppl (validation perplexity) | acc (accuracy).")
    ] = "ppl",
    trials: Annotated[
        int, typer.Option("--trials", help="Tuning budget (total trials, resumed studies included).")
    ] = 50,
    max_tau: Annotated[
        float, typer.Option("--max-tau", help="Upper bound of each tau (RoE §2.2.2: 0.5).")
    ] = 0.5,
    skip_layers: Annotated[
        int, typer.Option("--skip-layers", help="First and last L MoE layers held at tau = 0.")
    ] = 1,
    uniform: Annotated[
        bool, typer.Option("--uniform", help="Sweep one shared tau instead (Appendix B).")
    ] = False,
    uniform_step: Annotated[
        float, typer.Option("--uniform-step", help="Grid step of --uniform's sweep.")
    ] = 0.05,
    out: Annotated[
        Path, typer.Option("--out", help="Profile JSON to write.", callback=check_out_file)
    ] = Path("out/roe/profile.json"),
    storage: Annotated[
        Path | None,
        typer.Option(
            "--storage",
            help="Optuna study file: SQLite (.db), or a .journal file (several processes); default next to --out. Reruns resume.",
        ),
    ] = None,
    study_name: Annotated[
        str | None,
        typer.Option("--study-name", help="Optuna study name (default: roe-FAMILY-KK-OBJECTIVE-MODE)."),
    ] = None,
    plot_dir: Annotated[
        Path | None,
        typer.Option(
            "--plot-dir", help="Where the PNGs go (default: --out's folder).", callback=check_out_folder
        ),
    ] = None,
    limit: LimitOpt = None,
    max_docs: Annotated[
        int | None,
        typer.Option("--max-docs", min=1, help="Score a fixed slice: N items spread evenly over --data."),
    ] = None,
    batch_size: BatchSizeOpt = 8,
    max_length: MaxLengthOpt = 256,
    aggregation: RoEAggregationOpt = "prob_mean",
    seed: RoESeedOpt = 0,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    json_path: JsonOpt = None,
) -> None:
    """Tune per-layer tau with Optuna TPE (RoE §2.2); writes a profile JSON and a heatmap PNG."""
    from moectl.distributed import launched_world_size, ranks
    from moectl.roe.tune import TuneConfig, run

    several = launched_world_size() > 1  # `accelerate launch -m moectl roe tune`: one shared study
    config = TuneConfig(
        model=model_spec(model, tiny), data=data, K=16 if k is None else k, objective=objective, trials=trials,
        max_tau=max_tau, skip_layers=skip_layers, seed=seed, aggregation=aggregation, uniform=uniform,
        uniform_step=uniform_step, storage=storage, study_name=study_name, out=out, plot_dir=plot_dir,
        batch_size=batch_size, max_length=max_length, limit=limit, max_docs=max_docs, device=device, dtype=dtype,
    )  # fmt: skip
    study_file = storage or out.with_suffix(".optuna.journal" if several else ".optuna.db")
    kept = f"the finished trials are kept in {study_file}; run the same command again to resume the study"
    with interrupted(kept):  # optuna missing: `moectl.cli.extras` names the train extra
        result = run(config)
    if several and not ranks().is_main:
        return  # rank 0 reports the study every process added to
    label = "validation perplexity" if objective == "ppl" else "validation accuracy"
    spec, k, moe_layers = config.model, config.K, len(result.tau)
    table = Table(title=f"RoE tune {spec}: K={k}, {label}, {result.trials} trials ({result.info['mode']})")
    table.add_column("MoE layer", justify="right")
    table.add_column("decoder layer", justify="right")
    table.add_column("tau", justify="right")
    for i, tau in enumerate(result.tau):
        held = not uniform and (i < skip_layers or i >= moe_layers - skip_layers)
        table.add_row(str(i), str(result.info["moe_layers"][i]), f"{tau:.4f}" + (" (held)" if held else ""))
    console.print(table)
    base = "" if result.baseline is None else f" (tau = 0: {result.baseline:.6g})"
    import statistics

    per_trial = [h["seconds"] for h in result.history if h.get("seconds") is not None]
    median = f", median {statistics.median(per_trial):.1f} s a trial" if per_trial else ""
    console.print(f"best {label}: {result.value:.6g}{base}; {result.seconds:.1f} s this run{median}")
    for path in [result.profile, *result.figures]:
        console.print(f"[dim]wrote {path}[/dim]")
    write_json(json_path, {
        "model": spec, "K": k, "objective": objective, "tau": result.tau, "value": result.value,
        "baseline_tau0": result.baseline, "trials": result.trials, "seconds": result.seconds,
        "profile": str(result.profile), "figures": [str(f) for f in result.figures], "history": result.history,
        **result.info,
    })  # fmt: skip


# -- bench ----------------------------------------------------------------------------------
@roe_app.command("bench")
def bench_cmd(
    model: OptionalModelArg = None,
    tiny: TinyOpt = None,
    k: Annotated[str, typer.Option("--k", help="Comma list of K.")] = "1,2,4,8,16,32,64",
    variants: Annotated[
        str, typer.Option("--variants", help="Comma list of clean, separate, none.")
    ] = "clean,separate,none",
    prompt_tokens: Annotated[
        int, typer.Option("--prompt-tokens", help="Random prompt length in tokens.")
    ] = 128,
    new_tokens: Annotated[int, typer.Option("--new-tokens", help="Tokens decoded per measurement.")] = 32,
    batch: Annotated[int, typer.Option("--batch", help="Prompts per batch B.")] = 1,
    repeats: Annotated[
        int, typer.Option("--repeats", help="Measurements per point (the fastest is kept).")
    ] = 3,
    tau: Annotated[float, typer.Option("--tau", help="tau on every MoE layer during the benchmark.")] = 0.3,
    memory: Annotated[bool, typer.Option("--memory/--no-memory", help="Also measure peak memory.")] = True,
    threads: Annotated[
        int, typer.Option("--threads", help="torch threads (1: CPU-time ratios robust to a shared machine).")
    ] = 1,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    json_path: JsonOpt = None,
) -> None:
    """Per-token latency, peak memory and KV-cache bytes vs K, as ratios to the plain model (RoE §3.3)."""
    import torch

    from moectl.roe.bench import measure_overhead

    spec = model_spec(model, tiny)
    try:
        ks = [int(x) for x in k.split(",")]
    except ValueError:
        raise ConfigError(f"--k must be a comma list of integers (e.g. 1,2,4), got {k!r}") from None
    if threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    lm, tokenizer = load(spec, device, dtype)
    vocab = int(getattr(tokenizer, "vocab_size", lm.config.vocab_size))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(
        3, max(4, min(vocab, lm.config.vocab_size)), (batch, prompt_tokens), generator=generator
    )
    ids = ids.to(lm.device)
    result = measure_overhead(
        lm, ids, torch.ones_like(ids), Ks=ks, variants=[v.strip() for v in variants.split(",")],
        new_tokens=new_tokens, repeats=repeats, tau=tau, memory=memory,
    )  # fmt: skip
    table = Table(
        title=f"RoE overhead {spec}: B={batch}, prompt {prompt_tokens}, {new_tokens} new tokens, tau={tau}"
    )
    columns = (
        "variant",
        "K",
        "CPU ms/token",
        "latency ×",
        "wall ms/token",
        "peak MB",
        "memory ×",
        "KV KB",
        "KV ×",
    )
    for col in columns:
        table.add_column(col, justify="left" if col == "variant" else "right")
    for row in result["rows"]:
        mem = "" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**20:.2f}"
        mem_r = "" if row["memory_ratio"] is None else f"{row['memory_ratio']:.3f}"
        kv_r = "" if row["variant"] == "none" or row["kv_ratio"] is None else f"{row['kv_ratio']:.2f}"
        kv = "no cache" if row["variant"] == "none" else f"{row['kv_cache_bytes'] / 1024:.1f}"
        table.add_row(
            row["variant"], "" if row["K"] is None else str(row["K"]), f"{row['ms_per_token']:.2f}",
            f"{row['latency_ratio']:.3f}", f"{row['wall_ms_per_token']:.2f}", mem, mem_r, kv, kv_r,
        )  # fmt: skip
    console.print(table)
    console.print(f"[dim]latency: {result['latency_method']}; memory: {result['memory_method']}[/dim]")
    write_json(json_path, {"model": spec, **result})
