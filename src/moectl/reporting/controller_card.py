"""A self-contained, Hugging Face-carded folder for one TE-MoE option controller (``moectl options card``).

``moectl options train --out RUN`` leaves ``RUN/final/`` (and ``RUN/checkpoints/step-N/``): the
controller (``controller.json`` + ``controller.safetensors``), the intra-option policy's LoRA
adapters and trained routers, and ``options.json`` (the training settings). :func:`write_controller_card`
copies one of those folders — without the checkpoints' ``trainer_state.pt`` (optimizer and
generator states, only needed to resume) — into DEST, together with

- ``training_log.jsonl``: RUN's ``log.jsonl`` rows up to that folder's step;
- ``training_curves.png``: TE-MoE Fig. 5 (§5) of those rows (:func:`moectl.reporting.option_curves.plot`);
- ``README.md``: a model card whose YAML front matter follows the Hub's metadata
  (``huggingface_hub.ModelCardData``: ``library_name``, ``base_model``, ``license``, ``tags`` and a
  ``model-index`` with the last window's reward, switch rate and KL per token and their bootstrap
  95% intervals), and whose body says what the folder is (TE-MoE §4), the training settings, the
  first- and last-window figures and how to use it.

Every figure on the card is read from files (``options.json``, ``controller.json``, ``log.jsonl``,
the base model's ``config.json``), none typed in. DEST is written atomically
(:func:`moectl.train.checkpoint.write_dir_atomic`): everything is read and checked first, and a
failure leaves no DEST. The folder loads wherever a controller folder does (``controller:DEST``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moectl.errors import (
    ConfigError,
    FileFormatError,
    MoectlFileError,
    OutputExistsError,
)
from moectl.reporting.option_curves import CARD_LOG, CURVES, RESAMPLES, WINDOW, plot, read_log, summarise
from moectl.train.checkpoint import complete_checkpoints

CARD = "README.md"
LOG_NAME = CARD_LOG
CURVES_NAME = "training_curves.png"
SKIPPED = ("trainer_state.pt",)  # resuming state: not part of a controller
REQUIRED = ("controller.json", "controller.safetensors", "options.json")
METRICS = ("reward", "switch_rate", "kl")  # the model-index's measured metrics
FILES = {
    "controller.json": "the controller's shapes and option budget (k̂, experts per MoE layer)",
    "controller.safetensors": "the controller's weights (per MoE layer: termination β, selection, Q_Ω and V_Ω heads)",
    "adapter.safetensors": "LoRA adapters of the intra-option policy (PEFT keys)",
    "adapter_config.json": "their PEFT configuration",
    "routers.safetensors": "the trained routers",
    "options.json": "the training settings",
    LOG_NAME: "the training log, one JSON row per step",
    CURVES_NAME: "the training curves (TE-MoE Fig. 5)",
}


@dataclass
class Source:
    """The controller folder of a run that the card is written for."""

    folder: Path
    label: str  # "final" or "step-000040"
    step: int


# -- reading and checking the inputs --------------------------------------------------------------
def parse_checkpoint(spec: str) -> str | int:
    """``final`` | ``latest`` | a step number; ``ValueError`` naming what is allowed otherwise."""
    spec = str(spec).strip()
    if spec in ("final", "latest"):
        return spec
    if spec.isdigit():
        return int(spec)
    raise ConfigError(f"--checkpoint {spec!r}: allowed are final, latest or a step number (e.g. 40)")


def _checkpoints(run: Path) -> dict[int, Path]:
    """The complete checkpoints of ``run`` by step."""
    return complete_checkpoints(run / "checkpoints")


def _allowed(run: Path) -> str:
    """What ``--checkpoint`` may be for ``run``."""
    steps = list(_checkpoints(run))
    choices = (["final"] if (run / "final" / "controller.json").is_file() else []) + (
        ["latest", *map(str, steps)] if steps else []
    )
    return ", ".join(choices) if choices else "none (the run has neither final/ nor a checkpoint yet)"


def find_source(run: Path, checkpoint: str | int, last_logged: int | None = None) -> Source:
    """The folder ``--checkpoint`` names in ``run`` and its step; ``FileNotFoundError`` naming the
    choices the run has otherwise. A final folder's step is the run's last logged step (written
    right after it), else its ``options.json``'s ``steps``."""
    run = Path(run)
    if checkpoint == "final":
        folder = run / "final"
        if not (folder / "controller.json").is_file():
            raise MoectlFileError(
                f"--checkpoint final: {run} has no final/ (training has not finished); allowed: {_allowed(run)}"
            )
        step = last_logged if last_logged is not None else int(_read_json(folder / "options.json")["steps"])
        return Source(folder, "final", step)
    found = _checkpoints(run)
    if checkpoint == "latest":
        if not found:
            raise MoectlFileError(
                f"--checkpoint latest: {run} has no checkpoints; allowed: {_allowed(run)}"
            )
        step = max(found)
    else:
        step = int(checkpoint)
        if step not in found:
            raise MoectlFileError(
                f"--checkpoint {step}: {run} has no checkpoints/step-{step:06d}; allowed: {_allowed(run)}"
            )
    return Source(found[step], found[step].name, step)


def check_source(source: Source) -> list[Path]:
    """The files of ``source`` to copy (all but ``trainer_state.pt``); ``FileNotFoundError`` if one
    of the controller's files is missing."""
    missing = [name for name in REQUIRED if not (source.folder / name).is_file()]
    if missing:
        raise MoectlFileError(
            f"{source.folder}: no {', '.join(missing)} (a controller folder of `moectl options train` holds "
            f"{', '.join(REQUIRED)})"
        )
    return sorted(p for p in source.folder.iterdir() if p.is_file() and p.name not in SKIPPED)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise MoectlFileError(f"{path}: no such file") from None
    except ValueError as err:
        raise FileFormatError(f"{path}: not JSON ({err})") from None


def read_base(base: Path) -> dict[str, Any]:
    """The base model's ``config.json``; ``FileNotFoundError`` if ``base`` is no model folder."""
    if not (Path(base) / "config.json").is_file():
        raise MoectlFileError(
            f"--base {base}: no config.json there; give the folder of the base model (config.json + weights)"
        )
    return _read_json(Path(base) / "config.json")


def num_experts(config: dict[str, Any]) -> int | None:
    """Routed experts per MoE layer, under the names the families use."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if config.get(key):
            return int(config[key])
    return None


def check_base(base: Path, config: dict[str, Any], controller: dict[str, Any]) -> None:
    """``ValueError`` if the base model's config contradicts the controller's shapes (hidden size,
    experts per MoE layer); keys either file lacks are not compared."""
    ours = {"hidden size": config.get("hidden_size"), "experts": num_experts(config)}
    theirs = {
        "hidden size": controller.get("hidden_size"),
        "experts": max(controller.get("num_experts") or [0]) or None,
    }
    differ = [k for k in ours if ours[k] is not None and theirs[k] is not None and ours[k] != theirs[k]]
    if differ:
        shown = ", ".join(f"{k} {ours[k]} (controller: {theirs[k]})" for k in differ)
        raise ConfigError(f"--base {base}: {shown}; give the base model the run was trained on")


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies under it (resolved)."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def check_dest(dest: Path, run: Path, base: Path, overwrite: bool) -> None:
    """``FileExistsError`` / ``ValueError`` if DEST may not be written: it exists (without
    ``overwrite``), or replacing it would remove RUN or the base model."""
    for what, folder in (("the run", run), ("the base model", base)):
        if _inside(folder, dest):
            raise ConfigError(f"--out {dest}: it is or holds {what} ({folder}); give a folder outside it")
    if dest.exists() and not dest.is_dir():
        raise OutputExistsError(f"--out {dest} is a file; give a folder path")
    if dest.exists() and not overwrite:
        raise OutputExistsError(
            f"--out {dest} already exists; pass --overwrite to replace it, or give a new folder"
        )


def rows_up_to(run: Path, rows: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    """RUN's log ``rows`` up to and including ``step``; ``ValueError`` if the log does not reach it."""
    rows = [r for r in rows if r["step"] <= step]
    if not rows or rows[-1]["step"] != step:
        last = rows[-1]["step"] if rows else "none"
        raise ConfigError(
            f"{run / 'log.jsonl'}: no row for step {step} (rows up to it end at step {last}); "
            "the log does not belong to this checkpoint"
        )
    return rows


# -- the card -----------------------------------------------------------------------------------
def _window_key(summary: dict[str, Any], which: str) -> str:
    return f"{which}_{min(summary['window'], summary['steps_logged'])}"


def metrics_of(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The model-index's metrics: the last window's mean reward, switch rate and KL per token,
    each with its bootstrap 95% interval (read from :func:`moectl.reporting.option_curves.summarise`)."""
    last = _window_key(summary, "last")
    titles = {key: title for key, title, _ in CURVES}
    return [
        {
            "type": key,
            "value": summary[key][last]["mean"],
            "ci95": summary[key][last]["ci95"],
            "name": f"{titles[key]}, mean of the {last.replace('_', ' ')} logged steps",
            "window": int(last.split("_")[1]),
        }
        for key in METRICS
    ]


def _f(x: float) -> str:
    return f"{x:.4f}"


def _cell(entry: dict[str, Any]) -> str:
    low, high = entry["ci95"]
    return f"{_f(entry['mean'])} [{_f(low)}, {_f(high)}]"


def _span(steps: list[int]) -> str:
    return f"step {steps[0]}" if steps[0] == steps[1] else f"steps {steps[0]}–{steps[1]}"


def _value(v: Any) -> str:
    return "—" if v is None else f"`{json.dumps(v)}`"


def front_matter(
    name: str, base_name: str, license: str, model_type: str | None, summary: dict[str, Any], run_name: str
) -> str:
    """The YAML front matter (``huggingface_hub.ModelCardData``) with the measured metrics."""
    from huggingface_hub import EvalResult, ModelCardData

    data = ModelCardData(
        model_name=name,
        license=license,
        library_name="moectl",
        base_model=base_name,
        tags=[
            "moectl",
            "mixture-of-experts",
            "temporally-extended-moe",
            "option-critic",
            "expert-routing",
            *([model_type] if model_type else []),
        ],
        eval_results=[
            EvalResult(
                task_type="text-generation",
                dataset_type="moectl-options-rollouts",
                dataset_name=f"options training rollouts ({run_name})",
                dataset_split="train",
                metric_type=m["type"],
                metric_value=round(m["value"], 6),
                metric_name=m["name"],
                metric_args={
                    "window": m["window"],
                    "ci95": [round(x, 6) for x in m["ci95"]],
                    "bootstrap_resamples": RESAMPLES,
                },
            )
            for m in metrics_of(summary)
        ],
    )
    return data.to_yaml()


def card_text(
    *,
    name: str,
    dest: Path,
    base: Path,
    base_config: dict[str, Any],
    controller: dict[str, Any],
    options: dict[str, Any],
    source: Source,
    run: Path,
    summary: dict[str, Any],
    files: list[str],
    license: str,
) -> str:
    """README.md: front matter, then what the folder is, its figures, its settings and its use."""
    base_name = base.resolve().name
    model_type = base_config.get("model_type")
    experts = controller.get("num_experts") or []
    first, last = _window_key(summary, "first"), _window_key(summary, "last")
    steps = [int(s) for s in (summary["first_step"], summary["last_step"])]
    n = int(last.split("_")[1])
    intra = "adapter.safetensors" in files
    d, b = dest.as_posix(), base.as_posix()
    lines = [
        "---", front_matter(name, base_name, license, model_type, summary, run.name).rstrip("\n"), "---", "",
        f"# {name}",
        "",
        f"A TE-MoE option controller (temporally extended mixture of experts, §4) for `{base_name}` "
        f"({model_type}, {base_config.get('num_hidden_layers')} layers, {num_experts(base_config)} routed experts, "
        f"top-{controller.get('top_k')}), trained with `moectl options train`. In each of the model's "
        f"{len(experts)} MoE layers the controller keeps an option — a mask of k̂ = {controller.get('k_hat')} "
        f"experts — and the router chooses only among those; it learns when to end the option (termination "
        f"head β) and which to take next (selection head), paying a deliberation cost {_cost(options)} "
        "(option-critic with deliberation cost, §4.3)"
        + (
            f"; the intra-option policy — LoRA adapters (rank {options.get('lora_r')}) and the routers — was trained with it."
            if intra else "; the model's own weights were not trained (controller only)."
        ),
        "",
        f"This folder is `{source.label}` of the run `{run.name}`: the controller at **step {source.step}**. "
        f"The training log below has {summary['steps_logged']} steps ({steps[0]}–{steps[1]}).",
        "",
        "| file | what |",
        "|---|---|",
        *[f"| `{f}` | {FILES.get(f, '')} |" for f in files],
        "",
        "## Training curves (TE-MoE Fig. 5)",
        "",
        f"Means over the first and the last {n} logged steps, with bootstrap 95% intervals (resampling each "
        f"window with replacement, {RESAMPLES} times). The reward is log p_teacher(a_t) − log π(a_t) per token "
        "(eq. 6, the teacher being the base model); KL is −reward, the per-token reverse KL to the teacher "
        "estimated on the tokens drawn from the teacher-mixed distribution p_mix (eq. 7).",
        "",
        f"| curve | first {n} steps ({_span(summary['first_window_steps'])}) | last {n} steps "
        f"({_span(summary['last_window_steps'])}) |",
        "|---|---:|---:|",
        *[f"| {title} | {_cell(summary[key][first])} | {_cell(summary[key][last])} |" for key, title, _ in CURVES],
        "",
    ]  # fmt: skip
    if "switch_rate_per_layer_last" in summary:
        per_layer = ", ".join(f"{x:.3f}" for x in summary["switch_rate_per_layer_last"])
        lines += [f"Switch rate per MoE layer over the last {n} steps: {per_layer}.", ""]
    lines += [
        f"![training curves: raw values, running mean over {summary['window']} steps, bootstrap 95% band]({CURVES_NAME})",
        "",
        f"These are the figures of a single training run (seed {options.get('seed')}): the intervals are "
        "bootstrap intervals within that run, not a spread over runs or seeds. Per-step log: "
        f"[`{LOG_NAME}`]({LOG_NAME}).",
        "",
        "## Training settings",
        "",
        f"From `options.json` (`moectl options train`; `steps` is the run's planned length — this controller "
        f"is from step {source.step}).",
        "",
        "| setting | value |",
        "|---|---|",
        *[f"| `{k}` | {_value(v)} |" for k, v in options.items()],
        "",
        "## Use",
        "",
        f"Give the base model the controller was trained on (`{b}` here) as MODEL, and this folder as the "
        "controller:",
        "",
        "```",
        f"moectl serve-offload {b} --policy controller:{d}",
        f'moectl options generate {b} --controller {d} --prompt "The history of the"',
        f"moectl options eval {b} --controller {d}",
        f"moectl eval {b} --controller {d} --tasks arc_easy",
        "```",
        "",
        "(`moectl eval` reads evaluation sets fetched beforehand with `moectl data fetch-evals`.)",
        "",
        "or in Python:",
        "",
        "```python",
        "import moectl",
        "from moectl.models.load import load_model",
        "",
        f'model, tokenizer = load_model("{b}")',
        f'policy = moectl.load_policy("controller:{d}", model)  # merges the adapters and routers into model',
        "with moectl.route(model, policy):",
        "    ...  # generate or score: routing keeps to each layer's option",
        "```",
        "",
    ]  # fmt: skip
    return "\n".join(lines)


# -- writing ------------------------------------------------------------------------------------
def write_controller_card(
    run: str | Path,
    base: str | Path,
    dest: str | Path,
    *,
    checkpoint: str | int = "final",
    name: str | None = None,
    license: str | None = None,
    overwrite: bool = False,
    window: int = WINDOW,
) -> dict[str, Any]:
    """Write DEST: the controller of RUN's ``checkpoint`` (``final`` | ``latest`` | a step) with its
    training log, curves and model card; returns the summary reported by ``--json``.

    Every input is read and checked before anything is written (``ValueError``,
    ``FileNotFoundError`` or ``FileExistsError`` naming what is wrong); DEST appears complete or not at all.
    """
    from moectl.reporting.model_card import package_license
    from moectl.train.checkpoint import write_dir_atomic

    run, base, dest = Path(run), Path(base), Path(dest)
    checkpoint = parse_checkpoint(str(checkpoint)) if not isinstance(checkpoint, int) else checkpoint
    if not run.is_dir():
        raise MoectlFileError(
            f"{run}: no such run folder (give the --out folder of `moectl options train`)"
        )
    logged = read_log(run)  # no log, or a broken one: said before the checkpoint is looked for
    source = find_source(run, checkpoint, int(logged[-1]["step"]))
    copies = check_source(source)
    base_config = read_base(base)
    controller = _read_json(source.folder / "controller.json")
    options = _read_json(source.folder / "options.json")
    check_base(base, base_config, controller)
    check_dest(dest, run, base, overwrite)
    rows = rows_up_to(run, logged, source.step)
    summary = summarise(run.name, rows, window)
    n = min(window, len(rows))
    summary["first_step"] = int(rows[0]["step"])
    summary["first_window_steps"] = [int(rows[0]["step"]), int(rows[n - 1]["step"])]
    summary["last_window_steps"] = [int(rows[-n]["step"]), int(rows[-1]["step"])]
    name = name or dest.resolve().name
    license = license or package_license()
    files = sorted({p.name for p in copies} | {LOG_NAME, CURVES_NAME, CARD})
    text = card_text(
        name=name, dest=dest, base=base, base_config=base_config, controller=controller, options=options,
        source=source, run=run, summary=summary, files=[f for f in files if f != CARD], license=license,
    )  # fmt: skip

    title = (
        f"{name}: k-hat={options.get('k_hat')}, eta={_eta(options)}, step {source.step} "
        f"(running mean over {window} steps, bootstrap 95% band)"
    )

    def write(tmp: Path) -> None:
        """Fill the temporary folder that becomes DEST."""
        for path in copies:
            shutil.copyfile(path, tmp / path.name)
        (tmp / LOG_NAME).write_text("".join(json.dumps(r) + "\n" for r in rows))
        plot({run.name: rows}, tmp / CURVES_NAME, window, title=title)
        (tmp / CARD).write_text(text, encoding="utf-8")

    try:
        write_dir_atomic(dest, write, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(dest.with_name(f".tmp-{dest.name}"), ignore_errors=True)  # no half-written folder left
        raise
    return {
        "dest": str(dest),
        "card": str(dest / CARD),
        "run": str(run),
        "checkpoint": source.label,
        "source": str(source.folder),
        "step": source.step,
        "base": str(base),
        "base_model": base.resolve().name,
        "name": name,
        "license": license,
        "k_hat": options.get("k_hat"),
        "eta": options.get("eta"),
        "files": files,
        "metrics": metrics_of(summary),
        "summary": summary,
    }


def _eta(options: dict[str, Any]) -> str:
    """The run's deliberation cost in a title: η, or η per expert a switch brings in."""
    per_expert = options.get("eta_per_expert")
    return str(options.get("eta")) if per_expert is None else f"{per_expert}/expert"


def _cost(options: dict[str, Any]) -> str:
    """The run's deliberation cost in the card's text, with its unit."""
    per_expert = options.get("eta_per_expert")
    if per_expert is None:
        return f"η = {options.get('eta')} nats per switch"
    return f"η = {per_expert} nats per expert a switch brings in"
