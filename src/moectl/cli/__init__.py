"""``moectl`` command line: one module per verb group, each thin (parse → library call → print / --json).

Every verb module imports only typer, rich and :mod:`moectl.cli.common` at its top; what the verb
needs (transformers, lm-eval, optuna, peft, matplotlib, accelerate) loads inside the command, so
``moectl --help`` and ``moectl VERB --help`` stay fast.

Errors: a :class:`moectl.errors.MoectlError` escaping any command (input or state moectl refuses) is
printed by :class:`~moectl.cli.common.MoectlGroup` as one line, ``error: MESSAGE``, with exit code 2; any other
exception is a bug and keeps its traceback; Ctrl-C is left to each verb (``common.interrupted``).
"""

from __future__ import annotations

from typing import Annotated

import typer

from moectl.cli import (
    baselines,
    card,
    checkpoint,
    corpus,
    data,
    demo,
    eval,
    export,
    inspect,
    modularity,
    offload,
    options,
    pretrain,
    report,
    roe,
    serve,
    serve_offload,
    subset,
    switch_rate,
    tokenizer,
)
from moectl.cli.helpformat import FlagGroup, flags_untyped

app = typer.Typer(
    help="Control expert routing in Mixture-of-Experts language models.", no_args_is_help=True, cls=FlagGroup
)


def _print_version(value: bool) -> None:
    """``moectl --version``: the installed distribution's version (what pip installed), then exit."""
    if value:
        from importlib.metadata import version

        typer.echo(f"moectl {version('moectl')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", help="Print moectl's version and exit.", callback=_print_version, is_eager=True),
    ] = False,
) -> None:
    """Control expert routing in Mixture-of-Experts language models."""

app.command("inspect")(inspect.inspect_cmd)
app.command("switch-rate")(switch_rate.switch_rate_cmd)
app.command("demo")(demo.demo_cmd)
app.add_typer(corpus.corpus_app, name="corpus", help="Build the offline multi-domain corpus.")
app.add_typer(tokenizer.tokenizer_app, name="tokenizer", help="Train moectl's byte-level BPE tokenizer.")
app.command("pretrain")(pretrain.pretrain_command)
app.command("card")(card.card_command)
app.command("eval")(eval.eval_command)
app.command("report")(report.report_command)
app.command("serve")(serve.serve_command)
app.command("serve-offload")(serve_offload.serve_offload_command)
app.add_typer(offload.offload_app, name="offload", help="Expert offloading: which experts to keep resident.")
app.add_typer(subset.subset_app, name="subset", help="Select, export and analyse per-domain expert subsets.")
app.command("modularity")(modularity.modularity_cmd)
app.add_typer(
    roe.roe_app, name="roe", help="Roster of Experts: Gumbel-routed ensembles with a clean KV cache."
)
app.add_typer(data.data_app, name="data", help="Fetch offline evaluation sets.")
app.add_typer(
    options.options_app, name="options", help="Temporally extended MoE: option controllers (TE-MoE)."
)
app.command("baselines")(baselines.baselines_command)
app.add_typer(
    checkpoint.checkpoint_app, name="checkpoint", help="Write checkpoints: real models' shapes, quantized models."
)
app.add_typer(
    export.export_app, name="export", help="Write a model in another engine's format (GGUF for llama.cpp)."
)
flags_untyped(app)


def main() -> None:
    """The ``moectl`` console script; ``pretrain`` re-executes itself under a page-keeping allocator."""
    import sys

    if len(sys.argv) > 1 and sys.argv[1] == "pretrain":
        from moectl.train.allocator import reexec_with_fast_allocator

        reexec_with_fast_allocator()  # training steps page-fault under glibc's defaults
    finished = False
    try:
        app()
        finished = True
    except SystemExit as stop:  # typer ends a command with SystemExit, 0 when it succeeded
        finished = stop.code in (0, None)
        raise
    finally:
        leave_process_group(finished)


def leave_process_group(finished: bool) -> None:
    """Under ``accelerate launch``, tear the process group down before the interpreter exits: gloo's
    threads still alive at exit end the process in ``std::terminate`` (SIGABRT) now and then. After a
    command that ``finished`` on this process, wait for every process first: destroyed while
    another process was still leaving, the group aborted 5 of 45 two-process evaluations here, and
    0 of 44 with the barrier (``tests/_distributed_eval_worker.py``). After an error, no barrier: the
    other processes may never come."""
    import sys

    torch = sys.modules.get("torch")  # never imported just for this
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        if finished:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
