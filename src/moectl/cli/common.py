"""What the ``moectl`` verbs share: the console, ``--json`` writing, error exit, common options,
and the one model loader (:func:`load`) every verb that loads a model goes through.

Every verb reports bad input as ``error: MESSAGE`` and exit code 2 (:func:`fail`), and writes its
results with ``--json PATH`` atomically (:func:`write_json`). This module imports no torch,
transformers or other heavy package: ``moectl --help`` stays fast.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import click
import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from moectl.errors import MoectlError
from moectl.io.atomic import write_text_atomic

console = Console(width=None if Console().is_terminal else 160)
err_console = Console(stderr=True, width=None if Console(stderr=True).is_terminal else 160)
"""Errors go to standard error, so a verb's standard output stays its results."""

ModelArg = Annotated[
    str, typer.Argument(help="tiny:FAMILY, a checkpoint directory, a hub id or a .gguf file.")
]
OptionalModelArg = Annotated[
    str | None,
    typer.Argument(help="tiny:FAMILY, a checkpoint directory, a hub id or a .gguf file (or use --tiny)."),
]
FAMILY_HELP = "olmoe, mixtral, qwen3_moe, deepseek_v3, gpt_oss, ... (all: `python -c 'import moectl; print(moectl.FAMILIES)'`)"
TinyOpt = Annotated[str | None, typer.Option("--tiny", help=f"Tiny random model of a family: {FAMILY_HELP}.")]
JsonOpt = Annotated[
    Path | None,
    typer.Option(
        "--json", help="Also write the results to this JSON file.", callback=lambda p: check_json_path(p)
    ),
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Apply a subset, expert mask or tau profile made for another model anyway (refused by default, "
        "naming both models: moectl.routing.made_for).",
    ),
]
DeviceOpt = Annotated[
    str,
    typer.Option(
        "--device",
        "--device-map",
        help="Where the model runs: cpu, cuda, cuda:1, ...; auto or balanced spread a model larger than "
        "one device over every visible device (accelerate's device_map; one process).",
    ),
]
DtypeOpt = Annotated[
    str,
    typer.Option("--dtype", help="Weights dtype: auto (the checkpoint's), float32, bfloat16, float16."),
]


def check_quantize(value: str | None) -> str | None:
    """``--quantize`` checked when the command line is parsed: one of ``moectl.quant.SCHEMES`` (int8,
    int4), else ``error: ...`` naming them and exit 2 before any model loads."""
    if value is not None:
        from moectl.quant.quant_config import SCHEMES

        if value not in SCHEMES:
            fail(f"--quantize must be one of {', '.join(SCHEMES)}, got {value!r}")
    return value


QuantizeOpt = Annotated[
    str | None,
    typer.Option(
        "--quantize",
        help="Quantize the experts at load (issue 40): int4 (group-wise, groups of 64) or int8 (per output "
        "channel), run by PyTorch's weight-only CPU kernels; the routers stay in --dtype.",
        callback=check_quantize,
    ),
]
MaxNewTokensOpt = Annotated[int, typer.Option("--max-new-tokens", help="Tokens generated per prompt.")]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        "--threads",
        help="torch threads; default: the CPUs this process may use that are idle now "
        "(affinity, cgroup quota, /proc/stat: moectl.threads).",
    ),
]


def use_threads(requested: int | None) -> int:
    """Set torch's thread count (``--threads``, else ``moectl.threads.pick_threads``); returns it."""
    import torch

    from moectl.threads import pick_threads

    n = pick_threads(requested)
    torch.set_num_threads(n)
    return n

# -- Roster of Experts (RoE §2): the ensemble's knobs, one spelling for every verb that takes them
RoEKOpt = Annotated[
    int | None,
    typer.Option(
        "--k", help="Routing samples per token K (sample 0 is clean); default: the profile's, else 16."
    ),
]
RoETemperaturesOpt = Annotated[
    str | None,
    typer.Option(
        "--temperatures",
        "--tau",
        help="Tau profile JSON, one tau for all MoE layers, or a comma list per layer.",
    ),
]
RoECacheOpt = Annotated[str, typer.Option("--cache", help="clean (RoE §2.3) | separate | none.")]
RoEAggregationOpt = Annotated[
    str, typer.Option("--aggregation", help="prob_mean (the paper's) | logprob_mean.")
]
RoESeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the Gumbel routing noise.")]
EvalsCacheOpt = Annotated[
    Path | None, typer.Option("--cache", help="Evaluation set cache (default $MOECTL_EVALS).")
]


def split_list(value: str | None) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]`` (a comma-separated option; None -> [])."""
    return [v.strip() for v in value.split(",") if v.strip()] if value else []


def load(
    spec: str,
    device: str = "cpu",
    dtype: str = "auto",
    seed: int = 0,
    with_tokenizer: bool = True,
    quantize: str | None = None,
    merge_first: Any = (),
):
    """``(model, tokenizer)`` for a model spec (``moectl.models.load.load_model``), imported here so
    that ``--help`` never loads transformers. ``device`` auto or balanced is a device map (the
    model spread over every visible device); under ``accelerate launch``, ``cuda`` is each
    process's own GPU (:func:`moectl.distributed.process_device`). ``quantize`` (``--quantize``):
    the experts quantized at load, after the controllers among the routing specs ``merge_first`` are
    attached (``moectl.loaded.quantize_loaded``)."""
    from moectl.distributed import launched_world_size
    from moectl.models.load import load_model

    if launched_world_size() > 1:
        from moectl.distributed import process_device, ranks

        device = process_device(device, ranks())
    model, tokenizer = load_model(spec, dtype=dtype, device=device, seed=seed, with_tokenizer=with_tokenizer)
    if quantize is not None:
        from moectl.loaded import quantize_loaded

        summary = quantize_loaded(model, quantize, merge_first=merge_first)
        if summary is not None:  # None: a quantized checkpoint of that scheme, loaded as it is
            err_console.print(f"[dim]quantized {escape(str(summary))}[/dim]")
    return model, tokenizer


def model_spec(model: str | None, tiny: str | None) -> str:
    """The model spec from MODEL or ``--tiny FAMILY`` (exactly one of them)."""
    if (model is None) == (tiny is None):
        raise typer.BadParameter(
            "give exactly one of MODEL (tiny:FAMILY, a checkpoint path or hub id) or --tiny FAMILY"
        )
    return f"tiny:{tiny}" if tiny else str(model)


def write_json(path: Path | None, data: Any, ensure_ascii: bool = True) -> None:
    """Write ``data`` as indented JSON to ``path`` (nothing if None) atomically: a temporary file
    beside it, renamed into place. Values JSON does not know are written as their ``str``."""
    if path is None:
        return
    try:
        write_text_atomic(path, json.dumps(data, indent=2, default=str, ensure_ascii=ensure_ascii) + "\n")
    except OSError as err:  # the atomic writers' errors name the path already (io/atomic.py: output_error)
        fail(f"--json {err}" if err.strerror is None else f"--json {path}: {err.strerror}")
    console.print(f"[dim]wrote {path}[/dim]")


def output_problem(path: Path, folder: bool = False) -> str | None:
    """Why ``path`` (a file to write, or with ``folder`` a folder to create or fill) cannot be written,
    or None: the wrong kind of thing already there, a file where a parent folder must go, or a
    parent folder this process may not write in. Cheap, so every verb checks before any work."""
    path = Path(path).expanduser()
    if not folder and path.is_dir():
        name = "results.json" if path.suffix != ".json" else "out.json"
        return f"{path} is a folder: give a file path, e.g. {path / name}"
    if folder and path.exists() and not path.is_dir():
        return f"{path} is a file: give a folder"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{path} cannot be written: {parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path} cannot be written: no permission to write in {parent}"
    return None


def check_out_file(param: typer.CallbackParam, path: Path | None) -> Path | None:
    """A typer callback: an output file checked when the command line is parsed, before any work;
    ``error: --OPTION PROBLEM`` and exit 2 when it cannot be written."""
    problem = None if path is None else output_problem(path)
    if problem:
        fail(f"{param.opts[0]} {problem}")
    return path


def check_out_folder(param: typer.CallbackParam, path: Path | None) -> Path | None:
    """A typer callback: an output folder checked when the command line is parsed, before any work."""
    problem = None if path is None else output_problem(path, folder=True)
    if problem:
        fail(f"{param.opts[0]} {problem}")
    return path


def check_json_path(path: Path | None) -> Path | None:
    """``--json`` checked when the command line is parsed, before any work: not a folder, and its
    folder creatable and writable."""
    problem = None if path is None else output_problem(path)
    if problem:
        fail(f"--json {problem}")
    return path


@contextmanager
def interrupted(kept: str) -> Iterator[None]:
    """Ctrl-C inside the block ends the command with one line, ``interrupted: KEPT`` (what was kept
    and how to go on), and exit code 130, instead of a traceback or a bare blank line."""
    try:
        yield
    except KeyboardInterrupt:
        err_console.print(f"[bold yellow]interrupted:[/bold yellow] {escape(kept)}")
        raise typer.Exit(code=130) from None


@contextmanager
def handle_moectl_errors(*legacy: type[Exception]) -> Iterator[None]:
    """Within the block, a :class:`moectl.errors.MoectlError` ends the command with ``error: MESSAGE``
    and exit code 2 (:func:`fail`), as do the built-in errors ``legacy`` the library still raises
    for bad input where it does not raise a ``MoectlError`` yet. A ``typer.Exit`` passes through.

    Under ``moectl`` every verb already has this handler (:class:`MoectlGroup`); the block is for a
    verb run outside the group (``python -m moectl.pretrain`` through ``typer.run``). No verb passes
    ``legacy`` types any more: a built-in error is a bug and keeps its traceback."""
    from moectl.errors import MoectlError

    try:
        yield
    except typer.Exit:
        raise
    except (MoectlError, *legacy) as err:
        fail(err)


def write_or_fail(option: str, write, *args, **kwargs):
    """``write(*args, **kwargs)``; an ``OSError`` (a full disk, a folder gone) as ``error: OPTION ...``
    and exit 2, not a traceback after the work is done."""
    try:
        return write(*args, **kwargs)
    except OSError as err:
        fail(f"{option} {err}" if err.strerror is None else f"{option} {err.filename or ''}: {err.strerror}")


class MoectlGroup(TyperGroup):
    """The command line's one error handler, the class of ``moectl`` and of every verb group: each
    command runs inside :meth:`invoke`, so a ``MoectlError`` from anywhere below it (the library
    refusing its input) ends as ``error: MESSAGE`` and exit code 2, the line :func:`fail` prints, under
    the console script and under ``CliRunner().invoke(app or a group's app, ...)`` alike. Any other
    exception is a bug and keeps its traceback; Ctrl-C is each verb's (:func:`interrupted`)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MoectlError as err:
            fail(err)
        except USAGE_ERROR as err:  # a verb's bad option value, a missing argument, an unknown verb
            usage_failed(err)

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except USAGE_ERROR as err:  # the group's own options (``moectl --bogus``)
            usage_failed(err)


USAGE_ERROR: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
"""click's ``UsageError`` as typer raises it (typer 0.2x carries its own copy of click)."""


def usage_failed(err: Exception) -> NoReturn:
    """A usage error as the one line every error is (``error: Invalid value for '--num-experts': ...``,
    exit 2) instead of typer's usage box; a group given no verb still prints its help."""
    if type(err).__name__ == "NoArgsIsHelpError":
        raise err
    unnamed = type(err).__name__ == "BadParameter" and getattr(err, "param", None) is None
    if unnamed and getattr(err, "param_hint", None) is None:  # raised by a verb: its message names the flags
        fail(getattr(err, "message", str(err)))
    fail(err.format_message() if hasattr(err, "format_message") else str(err))


class _AloneCommand(TyperCommand):
    """A verb run on its own (:func:`run_alone`): a usage error is the one ``error:`` line."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except USAGE_ERROR as err:
            usage_failed(err)


def run_alone(command: Callable[..., Any]) -> None:
    """``typer.run(command)`` for a verb run outside ``moectl`` (``python -m moectl.pretrain``, what
    ``accelerate launch -m`` runs), its usage errors one ``error:`` line as under ``moectl``."""
    alone = typer.Typer(add_completion=False)
    alone.command(cls=_AloneCommand)(command)
    alone()


def fail(err: Exception | str) -> NoReturn:
    """Print ``error: ERR`` on standard error, on one line however long, and leave with exit code 2."""
    err_console.print(f"[bold red]error:[/bold red] {escape(str(err))}", soft_wrap=True)
    raise typer.Exit(code=2) from (err if isinstance(err, BaseException) else None)
