"""The work behind ``moectl eval``: load a model, set up its routing, run tasks, fill one results document.

``evaluate(EvalConfig("tiny:olmoe", tasks=["arc_easy"], limit=20))`` is ``moectl eval tiny:olmoe
--tasks arc_easy --limit 20``: the command only parses its flags into the config.

Under ``accelerate launch`` the requests are split over the processes and the results gathered on
rank 0 (:mod:`moectl.eval.rank_split`), which alone returns the document.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from moectl.distributed import launched_world_size, process_device, ranks
from moectl.ensemble.roe_config import config_dict
from moectl.errors import ConfigError
from moectl.eval.eval_config import ENGINES, EvalConfig
from moectl.eval.forward import SwitchStats
from moectl.eval.policy_file import EvalRouting, check_routing_args, experts_allowed, setup_routing
from moectl.eval.results import new_results
from moectl.extras import require

__all__ = ["ENGINES", "EvalConfig", "evaluate"]


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def evaluate(
    config: EvalConfig, *, progress: bool = True, model_and_tokenizer: tuple[Any, Any] | None = None
) -> dict[str, Any] | None:
    """Evaluate ``config.model`` as ``config`` says (``moectl eval`` is this function); returns a
    results document (on rank 0; None on the other processes of a launched run).

    ``model_and_tokenizer`` skips loading (for callers that hold a model already). Code tasks
    (humaneval, mbpp) are refused before the model is loaded unless ``config.allow_code_exec`` or
    ``$MOECTL_ALLOW_CODE_EXEC=1``.
    """
    c = config
    model_spec, tasks, perplexity, engine, cache, seed = c.model, c.tasks, c.perplexity, c.engine, c.cache, c.seed
    policy, roe, controller, switch, max_length = c.policy, c.roe, c.controller, c.switch, c.max_length
    if launched_world_size() > 1 and tasks and engine == "moectl":
        raise ConfigError(
            f"--engine moectl scores in one process; with {launched_world_size()} processes use --engine "
            "lm-eval (the default: the same scores, the documents split over the processes)"
        )
    if engine == "lm-eval":
        require("eval", "moectl.eval.evaluate with engine lm-eval")  # before any data or model loads
    processes = ranks()
    # the arguments first, then the data: a wrong flag is named even where no set is fetched yet
    check_routing_args(roe, controller, seed)
    if tasks:
        from moectl.eval.lm_tasks import check_data, resolve_tasks

        tasks = resolve_tasks(list(tasks))
        check_data(tasks, cache)  # before loading a model: a missing set fails fast
        from moectl.eval.code_exec import check_code_tasks

        check_code_tasks(tasks, True if c.allow_code_exec else None)  # refuses unless opted into
    torch.manual_seed(seed)
    if model_and_tokenizer is None:
        from moectl.models.load import load_model

        model, tokenizer = load_model(
            model_spec, dtype=c.dtype, device=process_device(c.device, processes), seed=0
        )
    else:
        model, tokenizer = model_and_tokenizer
    # --policy: any file load_policy reads; --controller: a controller folder (TE-MoE: adapters and
    # trained routers merged into the model, per-sequence option state); --roe: a RoE config
    routing = setup_routing(model, policy, roe, controller, seed)
    # --quantize: after the routing, so that a controller's adapters merge into the unquantized weights
    if c.quantize is not None:
        from moectl.quant.quantize_model import quantize_model, quantized_scheme

        if quantized_scheme(model) != c.quantize:
            quantize_model(model, c.quantize)
    info, policies, roe_cfg = routing.info, routing.policies, routing.roe
    assert info is not None
    switch = bool(policies) and roe_cfg is None if switch is None else switch
    if roe_cfg is not None:
        switch = False  # K samples route differently: a switch rate of the ensemble is not defined
    max_length = max_length or int(getattr(model.config, "max_position_embeddings", 2048))
    summary = info.summary()
    doc = new_results(
        model={
            "spec": model_spec,
            "label": c.label or model_spec,
            "family": summary["family"],
            "num_experts": summary["num_experts"][0],
            "top_k": summary["top_k"][0],
            "moe_layers": len(summary["moe_layers"]),
            "quantize": c.quantize,
        },
        routing={
            "label": routing.label,
            "policy_file": str(policy) if policy is not None else None,
            "policies": routing.specs,
            "experts_allowed": experts_allowed(policies, info),
            "roe": config_dict(roe_cfg, info.num_moe_layers) if roe_cfg is not None else None,
            "controller": routing.controller,
        },
        engine={"name": engine, "version": _lm_eval_version() if engine == "lm-eval" else None},
        settings={
            "limit": c.limit,
            "num_fewshot": c.num_fewshot,
            "max_gen_toks": c.max_gen_toks,
            "batch_size": c.batch_size,
            "max_length": max_length,
            "seed": seed,
            "device": c.device,
        },
    )
    plan = routing.plan
    if tasks:
        from moectl.eval.code_exec import code_exec_allowed

        with code_exec_allowed(c.allow_code_exec):
            doc["tasks"].update(
                _run_tasks(
                    model, tokenizer, routing, tasks, c, max_length, switch, progress and processes.is_main, processes
                )
            )
    if perplexity is not None:
        from moectl.eval.multiple_choice import switch_summary
        from moectl.eval.perplexity import perplexity_results, read_corpus
        from moectl.eval.rank_split import merged_switch, shared_document_nll

        docs = read_corpus(perplexity, split=c.split, limit=c.limit)
        stats = SwitchStats() if switch else None
        nll, counts = shared_document_nll(
            processes, model, tokenizer, docs, plan, info, max_length, c.batch_size, stats,
            progress and processes.is_main,
        )  # fmt: skip
        stats = merged_switch(stats, processes)
        entries = perplexity_results(docs, nll, counts, by_domain=c.by_domain, seed=seed)
        entries["perplexity/all"]["switch_rate"] = switch_summary(stats, seed)
        for entry in entries.values():
            entry["split"] = c.split
        doc["tasks"].update(entries)
    return doc if processes.is_main else None


def _run_tasks(
    model: Any,
    tokenizer: Any,
    routing: EvalRouting,
    tasks: Sequence[str],
    config: EvalConfig,
    max_length: int,
    switch: bool,
    progress: bool,
    processes: Any = None,
) -> dict[str, Any]:
    """Evaluate each task with the chosen engine; returns results-schema task entries (on rank 0
    of a launched run: lm-eval splits the documents over ``processes`` and gathers the metrics).

    Both engines score through moectl's scorers: ``moectl`` runs multiple-choice items in
    process; ``lm-eval`` runs lm-eval's harness over :class:`moectl.eval.lm_backend.MoectlLM`
    (the backend of ``lm_eval --model moectl``), so the two give the same numbers.
    """
    from moectl.eval.multiple_choice import switch_summary

    cache, limit, num_fewshot, seed = config.cache, config.limit, config.num_fewshot, config.seed
    batch_size, max_gen_toks = config.batch_size, config.max_gen_toks
    out: dict[str, Any] = {}
    if config.engine == "moectl":
        from moectl.eval.multiple_choice import evaluate_multiple_choice, mc_items

        for i, task in enumerate(tasks, 1):
            items = mc_items(task, cache, limit, num_fewshot, seed)
            entry = evaluate_multiple_choice(
                model,
                tokenizer,
                items,
                routing.plan,
                routing.info,
                batch_size,
                max_length,
                switch,
                progress,
                seed,
                description=f"{_task_label(task, i, len(tasks))} choices",
            )
            entry.pop("per_item")
            out[task] = entry
        return out
    from moectl.eval.lm_backend import MoectlLM
    from moectl.eval.lm_tasks import run_lm_eval, tasks_from_lm_eval
    from moectl.eval.rank_split import merged_switch

    processes = processes if processes is not None else ranks()

    lm = MoectlLM(
        model,
        tokenizer,
        routing=routing,
        batch_size=batch_size,
        max_length=max_length,
        seed=seed,
        progress=progress,
        processes=processes,
    )
    for i, task in enumerate(tasks, 1):  # one harness run per task, so each gets its own switch rate
        lm.switch = SwitchStats() if switch else None
        lm.task_label = _task_label(task, i, len(tasks))
        gen = {"max_gen_toks": max_gen_toks} if max_gen_toks else None
        raw = run_lm_eval(lm, [task], cache, limit, num_fewshot, seed, gen_kwargs=gen)
        stats = merged_switch(lm.switch, processes)  # every process's sequences, order-free
        if raw is None:  # not rank 0: lm-eval gathered the metrics there
            continue
        entries = tasks_from_lm_eval(raw)
        if task in entries:
            entries[task]["switch_rate"] = switch_summary(stats, seed)
        for name, entry in entries.items():  # a group's members do not replace a task run on its own
            if name == task or name not in out:
                out[name] = entry
    return out


def _task_label(task: str, index: int, count: int) -> str:
    """The task in a progress bar's label: ``arc_easy (2/3)``, the count only for several tasks."""
    return task if count == 1 else f"{task} ({index}/{count})"
