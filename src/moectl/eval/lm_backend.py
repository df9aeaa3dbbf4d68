"""``MoectlLM``: moectl as an lm-eval model backend (``lm_eval --model moectl``), over moectl's own scorers.

lm-eval's ``LM`` interface is three methods; each hands its requests to moectl:

- ``loglikelihood`` → ``scoring.score_pairs`` (the one tokenisation of ``moectl.models.tokens``,
  canonical batching, the LM head on chunks of positions);
- ``loglikelihood_rolling`` → ``perplexity.document_nll`` (windows overlapping by one token);
- ``generate_until`` → ``eval_generation.generate_texts`` (on the inference engine, ``moectl.engine``).

Routing comes from a plan (``forward.RoutingPlan``) built once by
``policy_file.setup_routing`` from ``policy=``, ``roe=`` and ``controller=``, exactly as
``moectl eval`` builds it (``moectl eval`` runs the harness over this class), with randomness
keyed by request, so results do not depend on lm-eval's batching or order.

From lm-eval: ``--model moectl --model_args pretrained=MODEL,policy=FILE,roe=K=16,tau=0.3,...``
(keys: ``moectl.eval.model_args.MODEL_ARGS``). In process:
``MoectlLM(model, tokenizer, policies=[...] | plan=... | policy=..., batch_size=8)``.

Data parallel: under ``accelerate launch`` (``-m moectl eval`` or ``-m lm_eval --model moectl``)
the backend reports its ``rank`` and ``world_size`` and gathers with lm-eval's primitives
(``all_gather``, ``gather_object``, ``barrier``), so lm-eval splits the documents over the
processes and joins the metrics on rank 0 (:mod:`moectl.eval.rank_split`); each process runs
on its own device (``cuda:LOCAL_RANK``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lm_eval.api.model import LM
from torch import nn

from moectl.distributed import Ranks, process_device, ranks
from moectl.errors import ConfigError
from moectl.eval import model_args as margs
from moectl.eval.eval_generation import GenSettings, generate_texts
from moectl.eval.forward import RoutingPlan, SwitchStats, static_plan
from moectl.eval.perplexity import Document, document_nll
from moectl.eval.policy_file import EvalRouting, check_routing_args, setup_routing
from moectl.eval.rank_split import lm_eval_padding
from moectl.eval.scoring import score_pairs
from moectl.routing.routing_state import Policy

# no process-wide HF_HUB_OFFLINE / HF_DATASETS_OFFLINE: ``pretrained`` may be a hub id to download and,
# under ``lm_eval --model moectl``, the tasks lm-eval's own; moectl's task run, whose data is local,
# turns the hub off for its own duration (``lm_tasks.hub_offline``)
log = logging.getLogger(__name__)
GEN_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p")


@dataclass(frozen=True)
class ScoreSettings:
    """How a :class:`MoectlLM` scores and decodes its requests, as one value: requests per forward
    (``batch_size``), tokens per sequence (``max_length``, context cut on the left), the seed of
    routing noise and sampling, the default cap of generated tokens, and whether to show progress."""

    batch_size: int = 8
    max_length: int = 2048
    seed: int = 1234
    max_gen_toks: int = 256
    progress: bool = False

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_length", "max_gen_toks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"MoectlLM: {name} must be an integer >= 1, got {value!r}")


class MoectlLM(LM):
    """An lm-eval model: a causal MoE LM scored and decoded by moectl under a routing plan.

    ``pretrained`` is a spec (``tiny:FAMILY``, ``shape:…``, a folder, a hub id), loaded with
    ``dtype`` on ``device``, or a live model (then give ``tokenizer``). Routing: ``policy``,
    ``roe``, ``controller`` (as ``moectl eval --policy/--roe/--controller``), or in process a
    ready ``routing`` (:class:`EvalRouting`), fixed ``policies`` or a per-request ``plan``.
    ``switch_rate=True`` keeps a running switch rate in ``self.switch``. lm-eval builds it from
    keywords (``--model_args``); it keeps the loaded model, its routing (``routing``, ``plan``,
    ``info``) and how it scores (``settings``: :class:`ScoreSettings`).
    """

    def __init__(
        self,
        pretrained: str | nn.Module,
        tokenizer: Any = None,
        *,
        policy: Any = None,
        roe: Any = None,
        controller: str | os.PathLike | None = None,
        device: str | None = None,
        dtype: str = "auto",
        batch_size: int = 8,
        max_length: int | None = None,
        seed: int = 1234,
        routing: EvalRouting | None = None,
        policies: Sequence[Policy] = (),
        plan: RoutingPlan | None = None,
        info: Any = None,
        switch_rate: bool = False,
        progress: bool = False,
        max_gen_toks: int = 256,
        processes: Ranks | None = None,
    ) -> None:
        super().__init__()
        self.processes = processes if processes is not None else ranks()
        self._rank, self._world_size = self.processes.rank, self.processes.world
        given = [name for name, v in (("routing", routing), ("policies", policies), ("plan", plan)) if v]
        if len(given) > 1 or (given and any(v is not None for v in (policy, roe, controller))):
            raise ConfigError("give one routing: policy/roe/controller, routing, policies or plan")
        if isinstance(pretrained, str):
            check_routing_args(roe, controller, seed)  # a wrong flag fails before the model loads
            from moectl.models.load import load_model

            device = process_device(
                device or ("cuda" if torch.cuda.is_available() else "cpu"), self.processes
            )
            model, loaded_tok = load_model(pretrained, dtype=dtype, device=device, seed=0)
            tokenizer = tokenizer or loaded_tok
            self.spec = pretrained
        else:
            if tokenizer is None:
                raise ConfigError("MoectlLM over a live model needs its tokenizer")
            model = pretrained
            self.spec = type(model).__name__
        self.model, self.tokenizer = model, tokenizer
        if routing is None and not policies and plan is None:
            routing = setup_routing(model, policy, roe, controller, seed)
        self.routing = routing
        self.plan = plan or (routing.plan if routing is not None else static_plan(list(policies)))
        from moectl.adapters.inspect import inspect

        self.info = info or (routing.info if routing is not None else None) or inspect(model)
        self.settings = ScoreSettings(
            batch_size=int(batch_size),
            max_length=int(max_length or getattr(model.config, "max_position_embeddings", 2048) or 2048),
            seed=int(seed),
            max_gen_toks=int(max_gen_toks),
            progress=bool(progress),
        )
        self.switch = SwitchStats() if switch_rate else None
        self.task_label: str | None = None  # the task being run, in the progress bars (moectl eval sets it)
        self._device = next(model.parameters()).device

    # -- construction from lm-eval's model_args -----------------------------------------------------
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> MoectlLM:
        """From ``pretrained=…,policy=…`` (``roe=K=16,tau=0.3`` kept whole); lm-eval's ``batch_size``
        and ``device`` fill what model_args leave out."""
        return cls(**margs.normalise(margs.parse(arg_string), additional_config))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> MoectlLM:
        return cls(**margs.normalise(arg_dict, additional_config))

    # -- lm-eval's interface --------------------------------------------------------------------------
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(summed log-probability, all tokens greedy) of each (context, continuation) request."""
        if not requests:
            return []
        pad = lm_eval_padding(requests, self.world_size)  # copies of the last: answered, not scored
        requests = requests[: len(requests) - pad]
        pairs = [tuple(req.args) for req in requests]
        scored = score_pairs(
            self.model, self.tokenizer, pairs, self.plan, self.info, self.settings.batch_size,
            self.settings.max_length, self.switch, self.settings.progress and not disable_tqdm,
            self._bar("loglikelihood"),
        )  # fmt: skip
        out = [
            (float(lp), bool(g))
            for lp, g in zip(scored.logprob.tolist(), scored.greedy.tolist(), strict=True)
        ]
        for pair, result in zip(pairs, out, strict=True):
            self.cache_hook.add_partial("loglikelihood", pair, result)
        return out + out[-1:] * pad

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Log-probability of each whole string after the prefix token, in windows of ``max_length``."""
        if not requests:
            return []
        pad = lm_eval_padding(requests, self.world_size)
        requests = requests[: len(requests) - pad]
        docs = [Document(req.args[0]) for req in requests]
        nll, _ = document_nll(
            self.model, self.tokenizer, docs, self.plan, self.info, self.settings.max_length,
            self.settings.batch_size, self.switch, self.settings.progress and not disable_tqdm,
            self._bar("loglikelihood_rolling"),
        )  # fmt: skip
        out = [-float(x) for x in nll]
        for req, result in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", tuple(req.args), result)
        return out + out[-1:] * pad

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Generated text per (context, gen_kwargs) request, grouped by identical gen_kwargs."""
        pad = lm_eval_padding(requests, self.world_size)
        requests = requests[: len(requests) - pad]
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out: list[str] = [""] * len(requests)
        for members in groups.values():
            settings = self.gen_settings(requests[members[0]].args[1])
            contexts = [requests[i].args[0] for i in members]
            texts = generate_texts(
                self.model, self.tokenizer, contexts, settings, self.plan, self.info, self.settings.batch_size,
                self.settings.max_length, self.settings.seed, self.switch,
                progress=self.settings.progress and not disable_tqdm,
            )  # fmt: skip
            for i, text in zip(members, texts, strict=True):
                out[i] = text
                self.cache_hook.add_partial("generate_until", tuple(requests[i].args), text)
        return out + out[-1:] * pad

    def _bar(self, kind: str) -> str:
        """A progress bar's label: the request kind, after the task being run where one is set."""
        return kind if self.task_label is None else f"{self.task_label} {kind}"

    def gen_settings(self, gen_kwargs: dict[str, Any]) -> GenSettings:
        """lm-eval's generation kwargs as :class:`GenSettings` (EOS's text added to ``until``)."""
        from lm_eval.models.utils import normalize_gen_kwargs

        kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.settings.max_gen_toks)
        ignored = sorted(set(kwargs) - set(GEN_KEYS))
        if ignored:
            log.warning("moectl: generation kwargs %s are not supported and ignored", ignored)
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        eos = getattr(self.tokenizer, "eos_token", None)
        if isinstance(eos, str) and eos and eos not in until:
            until.append(eos)
        sample = bool(kwargs.get("do_sample", False))
        temperature = float(kwargs.get("temperature", 0.0) or 0.0) if sample else 0.0
        return GenSettings(
            tuple(until), int(kwargs["max_gen_toks"]), temperature, float(kwargs.get("top_p", 1.0) or 1.0)
        )

    # -- lm-eval's data-parallel primitives ---------------------------------------------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` of every process joined along dim 0 in rank order (a scalar per process: stacked)."""
        if self.world_size <= 1:
            return tensor
        parts = self.processes.gather_objects(tensor.detach().cpu())
        return (torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)).to(tensor.device)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every process's ``obj`` (rank order) on ``dst``; None on the others."""
        gathered = self.processes.gather_objects(obj)
        return gathered if self.rank == dst else None

    def barrier(self) -> None:
        self.processes.barrier()

    # -- what lm-eval reads besides ----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__)).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) if chat_template else None

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ConfigError(
                f"{self.spec}: the tokenizer has no chat template (--apply_chat_template needs one)"
            )
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def get_model_info(self) -> dict[str, Any]:
        """Added to lm-eval's results ``config``: the model spec and the routing."""
        return {
            "moectl_model": self.spec,
            "moectl_routing": self.routing.label if self.routing is not None else "plan",
        }
