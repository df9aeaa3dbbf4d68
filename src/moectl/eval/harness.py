"""``RoutedLM``: lm-eval's ``HFLM`` over a live model, with moectl routing applied per request.

Static policies (a mask, an exported subset) also work with a plain ``HFLM`` inside
``with moectl.route(model, policies):`` — the hooks stay on the model while the harness runs.
``RoutedLM`` is for routing that belongs to a request (RoE ensembles, controllers with
per-sequence state), and it is what ``moectl eval`` uses for every run, because it also tells the
model which positions are padding. How lm-eval batches, and what this class does about it:

- **log-likelihood**: ``HFLM._loglikelihood_tokens`` sorts requests by length (longest first),
  groups requests sharing a context, right-pads each batch with token 0 and calls
  ``_model_call(inps)`` without an attention mask. Before delegating, ``RoutedLM`` records every
  input it will see (context + continuation, left-truncated, minus the last token, exactly as
  HFLM builds it); in ``_model_call`` each row's real length is the longest recorded prefix
  followed only by padding. That gives the attention mask (so the trace and any policy that pools
  over a sequence ignore padding) and a per-row key (:func:`moectl.eval.forward.request_keys`),
  so a request is routed the same whatever batch, order or padding it gets. The returned
  log-probabilities are normalised, so HFLM's own ``log_softmax`` leaves them unchanged.
- **generation**: ``HFLM.generate_until`` left-pads contexts and calls ``_model_generate`` with
  the attention mask. ``RoutedLM`` builds the same request batch from it, enters ``route()`` with
  the plan's policies for the whole ``generate`` (KV-cache offsets are tracked by the session) and,
  for ensembles, decodes itself with lm-eval's stop sequences: under RoE (``roe``) with
  ``moectl.roe.Ensemble`` (K routing samples per token over one shared clean cache, RoE §2.3),
  for ``repeats > 1`` with K routed copies per row that share one token stream chosen from the
  averaged distribution.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils_hf import stop_sequences_criteria

from moectl.adapters.inspect import ModelInfo, inspect
from moectl.eval.forward import (
    BatchRouting,
    RequestBatch,
    RoutingPlan,
    SwitchStats,
    request_keys,
    routed_log_probs,
    static_plan,
)
from moectl.routing.session import route
from moectl.routing.state import Policy


class RoutedLM(HFLM):
    """An lm-eval model: ``model`` (a live transformers causal LM) routed by ``plan`` or ``policies``.

    ``plan`` is called once per forward batch with a :class:`RequestBatch` and returns a
    :class:`BatchRouting`; without it the fixed ``policies`` apply to every request.
    ``switch_rate=True`` keeps a running switch rate (see :class:`SwitchStats`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        policies: Sequence[Policy] = (),
        plan: RoutingPlan | None = None,
        batch_size: int = 8,
        max_length: int | None = None,
        switch_rate: bool = False,
        info: ModelInfo | None = None,
        seed: int = 1234,
        **kwargs: Any,
    ) -> None:
        if plan is not None and policies:
            raise ValueError("give either fixed `policies` or a per-request `plan`, not both")
        super().__init__(
            pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length, **kwargs
        )
        if self.backend != "causal":
            raise ValueError("RoutedLM evaluates decoder-only (causal) models only")
        self.info = info or inspect(model)
        self.plan = plan or static_plan(policies)
        self.switch = SwitchStats() if switch_rate else None
        self.seed = seed
        self._known: dict[int, set[tuple[int, ...]]] | None = None

    # -- log-likelihood ------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """HFLM's scoring loop, after recording the exact inputs it will build (to undo its padding)."""
        known: dict[int, set[tuple[int, ...]]] = defaultdict(set)
        for _, context, continuation in requests:
            inp = (context + continuation)[-(self.max_length + 1) :][:-1]
            known[len(inp)].add(tuple(inp))
        self._known = known
        try:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        finally:
            self._known = None

    def _real_lengths(self, inps: Tensor) -> Tensor:
        """Per row, the length of the request it holds (the rest is right padding with 0)."""
        b, t = inps.shape
        lengths = torch.full((b,), t, dtype=torch.long)
        if not self._known:
            return lengths
        nonzero = (inps != 0).to("cpu")
        last = torch.where(
            nonzero.any(1), t - nonzero.flip(1).int().argmax(1), torch.zeros(b, dtype=torch.long)
        )
        rows = inps.to("cpu").tolist()
        for i, row in enumerate(rows):
            for length in range(t, int(last[i]) - 1, -1):  # longest recorded prefix, padding after it
                if length in self._known and tuple(row[:length]) in self._known[length]:
                    lengths[i] = length
                    break
        return lengths

    def _model_call(
        self, inps: Tensor, attn_mask: Tensor | None = None, labels: Tensor | None = None
    ) -> Tensor:
        """Routed, normalised log-probabilities of a right-padded batch, padding masked out."""
        if attn_mask is not None or labels is not None:
            raise ValueError("RoutedLM evaluates decoder-only (causal) models only")
        lengths = self._real_lengths(inps).to(inps.device)
        mask = (torch.arange(inps.shape[1], device=inps.device)[None, :] < lengths[:, None]).long()
        batch = RequestBatch(inps, mask, request_keys(inps, mask), "loglikelihood")
        return routed_log_probs(self.model, batch, self.plan, self.info, self.switch, region="all")

    # -- generation --------------------------------------------------------------------------------
    def _model_generate(
        self, context: Tensor, max_length: int, stop: list[str], **generation_kwargs: Any
    ) -> Tensor:
        """``generate`` under the plan's routing (or the ensemble decoder when ``repeats > 1``)."""
        mask = generation_kwargs.pop("attention_mask", None)
        if mask is None:
            mask = torch.ones_like(context)
        batch = RequestBatch(context, mask, request_keys(context, mask), "generate")
        routing = self.plan(batch)
        if routing.roe is not None:
            return self._roe_generate(batch, routing, max_length, stop, generation_kwargs)
        if routing.repeats > 1:
            return self._ensemble_generate(batch, routing, max_length, stop, generation_kwargs)
        record = self.switch is not None
        with route(self.model, list(routing.policies), record=record, info=self.info) as session:
            out = super()._model_generate(context, max_length, stop, attention_mask=mask, **generation_kwargs)
        if self.switch is not None:
            self.switch.add(session.trace, "generated")
        return out

    def _decode(
        self,
        context: Tensor,
        first: Tensor,
        step: Callable[[Tensor], Tensor],
        max_length: int,
        stop: list[str],
        gen: dict[str, Any],
    ) -> Tensor:
        """Decode from next-token log-probs: ``first`` [B, V] after the context, ``step(token)`` after each token.

        Greedy unless lm-eval asks for sampling (``do_sample`` with a temperature); rows stop at EOS
        or at one of lm-eval's stop sequences; finished rows are filled with the pad token.
        """
        b = context.shape[0]
        temperature = float(gen.get("temperature", 0.0) or 0.0)
        sample = bool(gen.get("do_sample", False)) and temperature > 0
        generator = torch.Generator(device="cpu").manual_seed(self.seed)
        criteria = stop_sequences_criteria(self.tokenizer, stop, context.shape[1], b)
        out = context.clone()
        done = torch.zeros(b, dtype=torch.bool, device=context.device)
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        logp = first
        for n in range(max(0, max_length - context.shape[1])):
            if sample:
                probs = torch.softmax(logp.float().cpu() / temperature, dim=-1)
                token = torch.multinomial(probs, 1, generator=generator).squeeze(1).to(context.device)
            else:
                token = logp.argmax(-1)
            token = torch.where(done, torch.full_like(token, pad), token)
            out = torch.cat([out, token[:, None]], dim=1)
            done |= token == eos
            for crit in criteria:
                crit(out, None)
                done |= torch.tensor(crit.done_tracker, device=done.device)
            if bool(done.all()) or n == max_length - context.shape[1] - 1:
                break
            logp = step(token)
        return out

    @torch.no_grad()
    def _roe_generate(
        self,
        batch: RequestBatch,
        routing: BatchRouting,
        max_length: int,
        stop: list[str],
        gen: dict[str, Any],
    ) -> Tensor:
        """Decode with Roster of Experts (RoE §2.3): K routing samples per token, one shared clean cache."""
        from moectl.roe.ensemble import Ensemble

        assert routing.roe is not None
        with Ensemble(self.model, routing.roe, info=self.info, policies=list(routing.policies)) as ens:
            first = ens.start(batch.input_ids, batch.attention_mask).logprobs
            return self._decode(
                batch.input_ids, first, lambda token: ens.step(token).logprobs, max_length, stop, gen
            )

    @torch.no_grad()
    def _ensemble_generate(
        self,
        batch: RequestBatch,
        routing: BatchRouting,
        max_length: int,
        stop: list[str],
        gen: dict[str, Any],
    ) -> Tensor:
        """Decode with K routed copies per row, each with its own history, sharing one token stream."""
        k, b = int(routing.repeats), batch.size
        mask = batch.attention_mask.repeat_interleave(k, 0).long()
        past = None

        def forward(step_ids: Tensor) -> Tensor:
            nonlocal past
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            result = self.model(
                input_ids=step_ids, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True
            )
            past = result.past_key_values
            logp = F.log_softmax(result.logits[:, -1].float(), dim=-1).view(b, k, -1)
            return torch.logsumexp(logp, dim=1) - math.log(k)

        def step(token: Tensor) -> Tensor:
            nonlocal mask
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            return forward(token.repeat_interleave(k)[:, None])

        record = self.switch is not None
        with route(self.model, list(routing.policies), record=record, info=self.info) as session:
            first = forward(batch.input_ids.repeat_interleave(k, 0))
            out = self._decode(batch.input_ids, first, step, max_length, stop, gen)
        if self.switch is not None:
            self.switch.add(session.trace, "generated")
        return out
