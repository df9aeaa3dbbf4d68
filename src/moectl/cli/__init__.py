"""``moectl`` command line: one module per verb group, each thin (parse → library call → print / --json).

Every verb module imports only typer, rich and :mod:`moectl.cli.common` at its top; what the verb
needs (transformers, lm-eval, optuna, peft, matplotlib, accelerate) loads inside the command, so
``moectl --help`` and ``moectl VERB --help`` stay fast.

Errors: a :class:`moectl.errors.MoectlError` escaping any command (input or state moectl refuses) is
printed by :class:`~moectl.cli.common.MoectlGroup` as one line, ``error: MESSAGE``, with exit code 2; any other
exception is a bug and keeps its traceback; Ctrl-C is left to each verb (``common.interrupted``).
"""

from __future__ import annotations

import typer

from moectl.cli import (
    baselines,
    card,
    checkpoint,
    corpus,
    demo,
    eval,
    export,
    inspect,
    offload,
    options,
    pretrain,
    roe,
    serve,
    server,
    subset,
    switch_rate,
)
from moectl.cli.common import MoectlGroup

app = typer.Typer(
    cls=MoectlGroup,
    help="Control expert routing in Mixture-of-Experts language models.",
    no_args_is_help=True,
)

app.command("inspect")(inspect.inspect_cmd)
app.command("switch-rate")(switch_rate.switch_rate_cmd)
app.command("demo")(demo.demo_cmd)
app.add_typer(corpus.corpus_app, name="corpus", help="Build the offline multi-domain corpus.")
app.add_typer(corpus.tokenizer_app, name="tokenizer", help="Train moectl's byte-level BPE tokenizer.")
app.command("pretrain")(pretrain.pretrain_command)
app.command("card")(card.card_command)
app.command("eval")(eval.eval_command)
app.command("report")(eval.report_command)
app.command("serve")(server.serve_command)
app.command("serve-offload")(serve.serve_offload_command)
app.add_typer(offload.offload_app, name="offload", help="Expert offloading: which experts to keep resident.")
app.add_typer(subset.subset_app, name="subset", help="Select, export and analyse per-domain expert subsets.")
app.command("modularity")(subset.modularity_cmd)
app.add_typer(
    roe.roe_app, name="roe", help="Roster of Experts: Gumbel-routed ensembles with a clean KV cache."
)
app.add_typer(eval.data_app, name="data", help="Fetch offline evaluation sets.")
app.add_typer(
    options.options_app, name="options", help="Temporally extended MoE: option controllers (TE-MoE)."
)
app.command("baselines")(baselines.baselines_command)
app.add_typer(checkpoint.checkpoint_app, name="checkpoint", help="Write checkpoints of real models' shapes.")
app.add_typer(
    export.export_app, name="export", help="Write a model in another engine's format (GGUF for llama.cpp)."
)


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
