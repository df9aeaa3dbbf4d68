"""``moectl options train | generate | eval | card`` (TE-MoE controllers) and ``moectl baselines``
(its pruning baselines, :mod:`moectl.cli.baselines`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from moectl.cli.common import (
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    MaxNewTokensOpt,
    ModelArg,
    MoectlGroup,
    check_out_file,
    check_out_folder,
    console,
    fail,
    load,
    write_json,
)

options_app = typer.Typer(cls=MoectlGroup, no_args_is_help=True, help="Learn and use per-layer option controllers (TE-MoE).")

ControllerOpt = Annotated[
    Path, typer.Option("--controller", help="Folder written by `moectl options train` (its final/).")
]
SeedOpt = Annotated[
    int, typer.Option("--seed", help="Seed of sampling, training and a tiny model's weights.")
]
TemperatureOpt = Annotated[
    float, typer.Option("--temperature", help="Sampling temperature of generation (0: greedy).")
]


@options_app.command("train")
def train_cmd(
    ctx: typer.Context,
    model: ModelArg,
    k_hat: Annotated[int, typer.Option("--k-hat", help="Experts per option k̂ (top-k ≤ k̂ ≤ N).")],
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            help="Output folder (checkpoints/, final/, log.jsonl, curves.png).",
            callback=check_out_folder,
        ),
    ],
    eta: Annotated[float, typer.Option("--eta", help="Deliberation cost η (nats per switch).")] = 0.02,
    eta_from_latency: Annotated[
        float | None,
        typer.Option(
            "--eta-from-latency",
            help="Set η from measured expert-load and decode latency, at this many nats per token of delay.",
        ),
    ] = None,
    eta_per_expert: Annotated[
        float | None,
        typer.Option(
            "--eta-per-expert",
            help="Charge a switch this many nats per expert it brings in, instead of a constant --eta.",
        ),
    ] = None,
    eta_bytes_from_latency: Annotated[
        float | None,
        typer.Option(
            "--eta-bytes-from-latency",
            help="Set --eta-per-expert from one expert's measured load and decode latency, at this many "
            "nats per token of delay.",
        ),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data", help="Prompts: JSONL ('prompt'/'text') or a corpus folder; default sample corpus."
        ),
    ] = None,
    steps: Annotated[int, typer.Option("--steps", help="Training steps.")] = 300,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Prompts per step.")] = 16,
    max_new_tokens: MaxNewTokensOpt = 64,
    max_prompt_tokens: Annotated[
        int, typer.Option("--max-prompt-tokens", help="Prompt tokens kept (the last ones).")
    ] = 128,
    tau: Annotated[float, typer.Option("--tau", help="Teacher mixing ratio τ.")] = 0.2,
    no_intra: Annotated[
        bool, typer.Option("--no-intra", help="Train the controller only (no LoRA, routers frozen).")
    ] = False,
    cross_layer: Annotated[
        bool, typer.Option("--cross-layer", help="One switch decision for all layers (§A4).")
    ] = False,
    lora_r: Annotated[int, typer.Option("--lora-r", help="LoRA rank (alpha = rank).")] = 16,
    no_lora_experts: Annotated[
        bool,
        typer.Option(
            "--no-lora-experts", help="LoRA on attention only (expert LoRA costs a delta per forward)."
        ),
    ] = False,
    lr_controller: Annotated[
        float, typer.Option("--lr-controller", help="Controller learning rate (§5: 1e-4).")
    ] = 1e-4,
    value_head: Annotated[
        str, typer.Option("--value-head", help="V_Ω head: mlp (moectl) or linear (A2, router-initialised).")
    ] = "mlp",
    critic_warmup: Annotated[
        int,
        typer.Option(
            "--critic-warmup", help="Steps that train only the critics before β and selection move."
        ),
    ] = 0,
    save_every: Annotated[int, typer.Option("--save-every", help="Steps between checkpoints.")] = 50,
    seed: SeedOpt = 0,
    no_resume: Annotated[bool, typer.Option("--no-resume", help="Ignore checkpoints in --out.")] = False,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "float32",
    json_path: JsonOpt = None,
) -> None:
    """Train per-layer option controllers with a deliberation cost (TE-MoE Algorithm 2).

    Data parallel: put ``accelerate launch --multi_gpu --num_processes 2 -m`` before ``moectl options train``.
    Each process then rolls out batch_size / 2 prompts; gradients are summed over the processes."""
    from moectl.distributed import ranks
    from moectl.options.train_run import OptionsConfig, OptionsRunConfig, run_train
    from moectl.stopping import TrainingInterrupted

    per_expert = "--eta-per-expert" if eta_per_expert is not None else "--eta-bytes-from-latency"
    if _given(ctx, "eta") and (eta_per_expert is not None or eta_bytes_from_latency is not None):
        fail(f"--eta and {per_expert} each set the deliberation cost: give one of them")
    options = OptionsConfig(
        k_hat=k_hat,
        eta=eta,
        eta_per_expert=eta_per_expert,
        steps=steps,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        max_prompt_tokens=max_prompt_tokens,
        tau=tau,
        intra=not no_intra,
        cross_layer=cross_layer,
        lora_r=lora_r,
        lora_alpha=lora_r,
        lora_experts=not no_lora_experts,
        save_every=save_every,
        seed=seed,
        lr_controller=lr_controller,
        value_head=value_head,
        critic_warmup=critic_warmup,
    )
    config = OptionsRunConfig(
        model, out, options, data, eta_from_latency, resume=not no_resume, device=device, dtype=dtype,
        eta_bytes_from_latency=eta_bytes_from_latency,
    )  # fmt: skip
    try:
        result = run_train(config)
    except TrainingInterrupted as stopped:
        if ranks().is_main:
            console.print(f"[yellow]{stopped}[/yellow]")
        raise typer.Exit(code=130) from None
    if not ranks().is_main:
        return  # rank 0 prints and writes the results
    latency, trained = result["latency"], result["options"]
    if latency is not None:
        cost = (
            f"η = {latency['eta']:.4f}"
            if "eta" in latency
            else f"η = {latency['eta_per_expert']:.4f} per expert brought in ({latency['eta_per_byte']:.3g} per byte)"
        )
        console.print(
            f"η from latency: one expert {latency['expert_bytes']} B in {latency['load_s'] * 1e6:.0f} µs, "
            f"decode step {latency['token_s'] * 1e3:.2f} ms → {cost}"
        )
    log = result["log"]
    first, last = log[0], log[-1]
    per = trained["eta_per_expert"]
    eta_text = f"η={trained['eta']:.4f}" if per is None else f"η={per:.4f} per expert brought in"
    table = Table(title=f"options training, k̂={k_hat}, {eta_text}")
    for col in ("", "reward", "switch rate", "switch prob P95", "value loss", "teacher ppl"):
        table.add_column(col)
    for name, row in (("first step", first), ("last step", last)):
        table.add_row(
            name,
            f"{row['reward']:.4f}",
            f"{row['switch_rate']:.4f}",
            f"{row['switch_prob_p95']:.4f}",
            f"{row['value_loss']:.4f}",
            f"{row['teacher_ppl']:.2f}",
        )
    console.print(table)
    console.print(f"[dim]controller: {result['final']}; curves: {out / 'curves.png'}[/dim]")
    write_json(json_path, {"config": trained, "latency": latency, "final": result["final"], "log": log})


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the command's parameter ``name`` was given (not left at its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def _load(model: str, controller: Path | None, device: str, dtype: str, seed: int, merge: bool = True):
    """(model, tokenizer, controller, options config, router snapshot) through the shared loader."""
    from moectl.options.option_state import attach_controller

    lm, tokenizer = load(model, device, dtype, seed=seed)
    lm, ctrl, config, snapshot = attach_controller(lm, controller, merge)
    return lm, tokenizer, ctrl, config, snapshot


@options_app.command("generate")
def generate_cmd(
    model: ModelArg,
    controller: ControllerOpt,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", help="A prompt (repeatable).")] = None,
    max_new_tokens: MaxNewTokensOpt = 64,
    temperature: TemperatureOpt = 0.5,
    greedy_controller: Annotated[
        bool,
        typer.Option("--greedy-controller", help="Switch when β > 1/2 and take the top-k̂ (no sampling)."),
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot", help="Write the options over positions (Fig. 6) here.", callback=check_out_file
        ),
    ] = None,
    seed: SeedOpt = 0,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "float32",
    json_path: JsonOpt = None,
) -> None:
    """Generate under a controller and show where the options switch."""
    from moectl.generate import Prompt, generate_completions
    from moectl.metrics.switch_rate import switch_rate
    from moectl.options.events import marked_text, omega_switches, switch_events
    from moectl.options.policy import ControllerPolicy
    from moectl.routing import RoutingTrace

    lm, tokenizer, ctrl, _, _ = _load(model, controller, device, dtype, seed)
    policy = ControllerPolicy(
        ctrl, mode="greedy" if greedy_controller else "sample", seed=seed, record=True
    )
    prompts = [Prompt(p) for p in (prompt or ["The history of the"])]
    done = generate_completions(
        lm, tokenizer, prompts, max_new_tokens, temperature, seed=seed, progress=False,
        policies=policy, record=True,
    )  # fmt: skip
    generated = [c.token_ids for c in done]
    trace = RoutingTrace.join([c.trace for c in done])  # each prompt routed by its own fork of the policy
    report = switch_rate(trace, source="allowed")
    switches = omega_switches(trace.allowed, trace.valid)
    rows = []
    for i, (p, ids) in enumerate(zip(prompts, generated, strict=True)):
        events = switch_events(switches, trace.prompt_len, i)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        console.print(f"[bold]{p.text}[/bold]{marked_text(tokenizer, ids, events)}")
        console.print(f"[dim]switch events per layer (generated position): {events}[/dim]")
        rows.append({"prompt": p.text, "text": text, "switch_events": events})
    console.print(f"switch rate {report.mean:.4f} (per layer {[round(x, 4) for x in report.per_layer]})")
    if plot is not None:
        from moectl.reporting.option_plots import plot_options

        for i, p in enumerate(prompts):
            plot_options(trace, plot / f"options_prompt{i}.png", row=i, label=f"prompt {i}: {p.text!r}", model=model)
        console.print(f"[dim]wrote option plots to {plot}[/dim]")
    write_json(json_path, {"switch_rate": report.mean, "per_layer": report.per_layer, "samples": rows})


@options_app.command("eval")
def eval_cmd(
    model: ModelArg,
    controller: Annotated[
        Path | None,
        typer.Option("--controller", help="Trained controller folder; without it the plain model."),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data", help="Held-out texts: JSONL or corpus folder (test split); default sample corpus."
        ),
    ] = None,
    prompts: Annotated[
        Path | None, typer.Option("--prompts", help="Prompts for the switch rate (JSONL); default built-in.")
    ] = None,
    k_hat: Annotated[
        int | None, typer.Option("--k-hat", help="k̂ for the plain model's router-as-option switch rate.")
    ] = None,
    max_docs: Annotated[int, typer.Option("--max-docs", help="Documents per domain.")] = 16,
    max_length: Annotated[int, typer.Option("--max-length", help="Tokens per held-out document.")] = 256,
    max_new_tokens: MaxNewTokensOpt = 128,
    temperature: TemperatureOpt = 0.5,
    seed: SeedOpt = 0,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "float32",
    json_path: JsonOpt = None,
) -> None:
    """Quality against the teacher (per-token KL, per-domain perplexity) and switch rate."""
    from functools import partial

    from moectl.adapters.inspect import inspect
    from moectl.generate import load_prompts
    from moectl.options.evaluate import generation_switch_rate, heldout_quality
    from moectl.options.policy import ControllerPolicy
    from moectl.options.prompt_data import texts_by_domain
    from moectl.options.teacher import teacher_mode

    texts = texts_by_domain(data, "test", max_docs)
    lm, tokenizer, ctrl, config, snapshot = _load(model, controller, device, dtype, seed, merge=False)
    info = inspect(lm)
    if ctrl is None:
        policies = list
        teacher = partial(lambda: teacher_mode(lm, info, None))
        k = k_hat or info.top_k
    else:
        policies = lambda: [ControllerPolicy(ctrl, seed=seed)]  # noqa: E731
        teacher = partial(teacher_mode, lm, info, snapshot)
        k = ctrl.k_hat
    quality = heldout_quality(lm, info, tokenizer, texts, policies, teacher, max_length, progress=True)
    switching = generation_switch_rate(
        lm,
        info,
        tokenizer,
        load_prompts(prompts),
        policies,
        k,
        max_new_tokens,
        temperature,
        seed=seed,
        progress=True,
    )
    table = Table(title=f"{'controller ' + str(controller) if controller else 'plain model'}, k̂={k}")
    for col in ("domain", "KL(teacher‖student)", "ppl", "teacher ppl", "docs"):
        table.add_column(col)
    for domain, row in quality["domains"].items():
        table.add_row(
            domain,
            f"{row['kl']:.4f} ± {row['kl_ci95']:.4f}",
            f"{row['ppl']:.2f}",
            f"{row['teacher_ppl']:.2f}",
            str(row["documents"]),
        )
    console.print(table)
    console.print(
        f"switch rate on generated tokens: {switching['switch_rate']:.4f} ± {switching['switch_rate_ci95']:.4f} "
        f"({switching['source']})"
    )
    write_json(
        json_path,
        {
            "model": model,
            "controller": str(controller) if controller else None,
            "k_hat": k,
            "options": config,
            "quality": quality,
            "switching": switching,
        },
    )


@options_app.command("card")
def card_cmd(
    run: Annotated[Path, typer.Argument(help="The run folder of `moectl options train` (its --out).")],
    base: Annotated[
        Path,
        typer.Option("--base", help="The base model's folder (config.json): the model it was trained on."),
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            help="The folder to write: controller files, log, curves, README.md.",
            callback=check_out_folder,
        ),
    ],
    checkpoint: Annotated[
        str,
        typer.Option(
            "--checkpoint", help="final (default), latest (the newest checkpoint) or a step number."
        ),
    ] = "final",
    name: Annotated[
        str | None, typer.Option("--name", help="The card's title (default: the folder's name).")
    ] = None,
    license: Annotated[
        str | None, typer.Option("--license", help="The card's license id (default: moectl's, apache-2.0).")
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace --out if it exists.")] = False,
    json_path: JsonOpt = None,
) -> None:
    """Write a self-contained controller folder with a Hugging Face model card (use it as controller:OUT).

    The controller of RUN's final/ (or a checkpoint, without its trainer state), the training log up to
    that step, the training curves (TE-MoE Fig. 5) and README.md, every figure read from files."""
    from rich.markup import escape

    from moectl.reporting.controller_card import write_controller_card

    result = write_controller_card(
        run, base, out, checkpoint=checkpoint, name=name, license=license, overwrite=overwrite
    )
    summary = result["summary"]
    n = min(summary["window"], summary["steps_logged"])
    where = f"{result['checkpoint']} (step {result['step']})"
    table = Table(title=escape(f"{result['name']}: k̂={result['k_hat']}, η={result['eta']}, {where}"))
    for col in ("", f"first {n} steps", f"last {n} steps"):
        table.add_column(col)
    for key, label in (("reward", "reward"), ("switch_rate", "switch rate"), ("kl", "KL per token"),
                       ("teacher_ppl", "teacher ppl")):  # fmt: skip
        cells = [summary[key][f"{which}_{n}"] for which in ("first", "last")]
        table.add_row(label, *(f"{c['mean']:.4f} [{c['ci95'][0]:.4f}, {c['ci95'][1]:.4f}]" for c in cells))
    console.print(table)
    console.print(f"[dim]{summary['steps_logged']} steps logged; base model {result['base_model']}[/dim]")
    console.print(f"wrote {escape(str(out))} ({', '.join(result['files'])})")
    console.print(
        f"[dim]use: moectl serve-offload {escape(str(base))} --policy controller:{escape(str(out))}[/dim]"
    )
    write_json(json_path, result)
