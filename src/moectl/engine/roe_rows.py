"""The engine's RoE rows: requests of one RoE routing decoded together, B prompts × K samples per step.

A RoE request (a routing registered with a ``RoEConfig``) runs through ``moectl.roe.Ensemble``: K
routing samples of its current token over one clean KV cache, their next-token distributions
averaged (RoE §2, §2.3). Requests of the same routing share one ensemble — one forward per step for
all of them — and join and leave it at step boundaries as the plain rows do (``engine.kv``):
requests admitted together are prefilled in one ``Ensemble.start`` over their left-padded prompts,
then their cache rows are appended to the running ensemble's (``ensemble_rows.join_rows``:
left-padded to a common length); a finished or cancelled request's rows are selected away
(``keep_rows``) and columns that became padding in every row dropped.

Independence from batch-mates: a request's next token is chosen with its own seed
(``sampling.choose_tokens``, keyed by request and step), and the Gumbel routing noise is a hash of
(routing seed, MoE layer, sample, position, expert) (``ensemble.noise.SampleGumbel``), with each row's
own position id (its real tokens, not the padding in front of them): the same draws whichever rows
share the batch. Requests of one routing therefore see the same noise at the same position, as the
prompts of one ``moectl roe generate`` batch always did.

The row operations of each cache variant are in ``ensemble_rows``. What cannot be re-batched there
(hybrid models' recurrent states; sliding-window, chunked or model-specific cache layers) runs one
ensemble per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from moectl.engine.batch import prefill_groups
from moectl.engine.ensemble_rows import join_rows, keep_rows, rebatchable
from moectl.engine.output import Output
from moectl.engine.roe_experts import RoeExperts
from moectl.ensemble.adaptive_ensemble import AdaptiveEnsemble
from moectl.ensemble.ensemble import Ensemble
from moectl.lm.padding import left_pad


@dataclass
class RoeHost:
    """What the RoE rows use of their engine, handed to them (they read nothing else of it)."""

    model: nn.Module
    info: Any  # ModelInfo
    prefill_tokens: int  # EngineConfig.prefill_tokens: the most padded tokens of one prefill forward
    pad_id: int
    device: torch.device
    output: Output  # tokens to requests, requests to their ends
    counters: dict[str, Any]
    choose: Callable[[Tensor, list], Tensor]  # the sampler: each request's next token from its log-probs
    log: Callable[[str, int], None]  # the engine's forward log (kind, rows)
    residency: Callable[[], list]  # the offload runtime's routing policies, composed into each ensemble


@dataclass
class RoeGroup:
    """One running ensemble: its routing, its requests (one row each, in order), each row's latest
    token [B], and whether rows may join and leave (else it holds one request)."""

    routing: Any
    ensemble: Any
    reqs: list
    last: Tensor
    shared: bool


class RoeRows:
    """The engine's RoE requests, grouped by routing into ensembles (see the module doc).

    Adds to the engine's counters ``roe_forwards`` (ensemble forwards: a prefill or a step of one
    group) and ``roe_sample_tokens`` (routing samples run for the rows' tokens: K per row, or
    adaptive K's count)."""

    def __init__(self, host: RoeHost) -> None:
        self.host = host
        self.experts = RoeExperts(host.info)  # the routed experts of requests that ask (roe_experts.py)
        self.groups: list[RoeGroup] = []
        self._rebatchable: dict[str, bool] = {}

    def __len__(self) -> int:
        return sum(len(g.reqs) for g in self.groups)

    def __bool__(self) -> bool:
        return bool(self.groups)

    def __iter__(self) -> Iterator:
        return (req for g in self.groups for req in g.reqs)

    def _shared(self, routing) -> bool:
        if routing.name not in self._rebatchable:
            self._rebatchable[routing.name] = rebatchable(self.host.model, routing.roe)
        return self._rebatchable[routing.name]

    def batches(self, reqs: list) -> list[list]:
        """Admitted RoE requests in prefill batches: by routing, then by ``batch.prefill_groups``
        where the routing's ensembles re-batch, else one request each."""
        by_routing: dict[str, list] = {}
        for req in reqs:
            by_routing.setdefault(req.routing.name, []).append(req)
        out: list[list] = []
        for same in by_routing.values():
            if not self._shared(same[0].routing):
                out += [[req] for req in same]
                continue
            lengths = [len(r.prompt) for r in same]
            out += [[same[i] for i in g] for g in prefill_groups(lengths, self.host.prefill_tokens)]
        return out

    def _new_ensemble(self, routing):
        host = self.host
        policies = [*host.residency(), *routing.policies]
        adaptive = getattr(routing, "adaptive", None)
        if adaptive is not None:
            return AdaptiveEnsemble(host.model, routing.roe, adaptive, info=host.info, policies=policies)
        return Ensemble(host.model, routing.roe, info=host.info, policies=policies)

    def prefill(self, reqs: list) -> None:
        """Start one ensemble on the prompts of ``reqs`` (one routing), choose their first tokens and
        join the routing's running group (or start one). If a shared prefill fails, each request is
        prefilled alone, so only a bad one fails."""
        host = self.host
        routing = reqs[0].routing
        ensemble = self._new_ensemble(routing)
        ids, mask = left_pad([r.prompt for r in reqs], host.pad_id, host.device)
        host.log("prefill", len(reqs))
        try:
            with ensemble, self.experts.recording(reqs, [len(r.prompt) for r in reqs], routing.roe.K):
                out = ensemble.start(ids, mask)
        except Exception:
            if len(reqs) == 1:
                raise
            for req in reqs:  # each alone: only a bad one fails
                try:
                    self.prefill([req])
                except Exception as err:
                    if not req.done.is_set():
                        host.output.finish(req, "error", error=f"{type(err).__name__}: {err}")
            return
        for req in reqs:
            req.seen = len(req.prompt)
        self._count(ensemble, len(reqs))
        host.counters["prefills"] += len(reqs)
        host.counters["prefill_forwards"] += 1
        tokens = host.choose(out.logprobs, reqs)
        shared = self._shared(routing)
        group = next((g for g in self.groups if g.shared and g.routing is routing), None) if shared else None
        if group is None:
            group = RoeGroup(routing, ensemble, [], tokens[:0], shared)
            self.groups.append(group)
        else:
            join_rows(group.ensemble, ensemble)
        first = len(group.reqs)
        group.reqs += reqs
        group.last = torch.cat([group.last, tokens])
        self._emit(group, tokens, first)

    def step(self) -> None:
        """One decoding forward per group: every row's next token."""
        host = self.host
        for group in list(self.groups):
            host.log("decode", len(group.reqs))
            with group.ensemble, self.experts.recording(group.reqs, None, group.routing.roe.K):
                out = group.ensemble.step(group.last)
            for req in group.reqs:
                req.seen += 1
            self._count(group.ensemble, len(group.reqs))
            group.last = host.choose(out.logprobs, group.reqs)
            self._emit(group, group.last, 0)

    def _count(self, ensemble, rows: int) -> None:
        counters = self.host.counters
        counters["roe_forwards"] = counters.get("roe_forwards", 0) + 1
        counters["roe_sample_tokens"] = counters.get("roe_sample_tokens", 0.0) + ensemble.last_samples * rows

    def _emit(self, group: RoeGroup, tokens: Tensor, first: int) -> None:
        reqs = group.reqs[first:]
        emit = self.host.output.emit
        done = [first + i for i, (r, t) in enumerate(zip(reqs, tokens.tolist(), strict=True)) if emit(r, t)]
        if done:
            self._drop(group, done)

    def _drop(self, group: RoeGroup, rows: list[int]) -> None:
        """Remove ``rows`` of ``group`` and finish their requests (``ending``; else cancelled)."""
        gone = set(rows)
        done = [group.reqs[i] for i in sorted(gone)]
        kept = [i for i in range(len(group.reqs)) if i not in gone]
        if kept:
            index = torch.tensor(kept, dtype=torch.long, device=group.last.device)
            keep_rows(group.ensemble, index)
            group.reqs = [group.reqs[i] for i in kept]
            group.last = group.last[index]
        else:
            self.groups.remove(group)
        for req in done:
            reason, piece = req.ending or ("cancelled", "")
            self.host.output.finish(req, reason, piece=piece)

    def cancel(self, ids: set[str]) -> None:
        """Finish the cancelled requests among the running ones; their rows are freed."""
        for group in list(self.groups):
            rows = [i for i, r in enumerate(group.reqs) if r.id in ids]
            if rows:
                self._drop(group, rows)

    def clear(self) -> list:
        """Forget every group (the batch failed); returns their requests."""
        reqs = list(self)
        self.groups = []
        return reqs
