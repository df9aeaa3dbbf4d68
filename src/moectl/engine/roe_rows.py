"""The engine's RoE rows: requests of one RoE routing decoded together, B prompts × K samples per step.

A RoE request (a routing registered with a ``RoEConfig``) runs through ``moectl.roe.Ensemble``: K
routing samples of its current token over one clean KV cache, their next-token distributions
averaged (RoE §2, §2.3). Requests of the same routing share one ensemble — one forward per step for
all of them — and join and leave it at step boundaries as the plain rows do (``engine.kv``):
requests admitted together are prefilled in one ``Ensemble.start`` over their left-padded prompts,
then their clean-cache rows are appended to the running ensemble's (``join_rows``: left-padded to a
common length); a finished or cancelled request's rows are selected away (``keep_rows``) and
columns that became padding in every row dropped.

Independence from batch-mates: a request's next token is chosen with its own seed
(``sampling.choose_tokens``, keyed by request and step), and the Gumbel routing noise is a hash of
(routing seed, MoE layer, sample, position, expert) (``roe.noise.SampleGumbel``), with each row's
own position id (its real tokens, not the padding in front of them): the same draws whichever rows
share the batch. Requests of one routing therefore see the same noise at the same position, as the
prompts of one ``moectl roe generate`` batch always did.

What cannot be re-batched runs one ensemble per request (the engine's earlier behaviour): the
``separate`` and ``none`` cache variants (their state is K cache rows or the whole sequence), hybrid
models (recurrent states), and caches with sliding-window, chunked or model-specific layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from moectl.engine.batch import left_pad, prefill_groups


def rebatchable(model, config) -> bool:
    """Whether ``config``'s ensembles on ``model`` can take and drop rows (see the module doc)."""
    if config.cache != "clean":
        return False
    from transformers.cache_utils import DynamicLayer

    from moectl.roe.clean_cache import new_clean_cache
    from moectl.roe.masks import attention_kinds

    kinds, _ = attention_kinds(model.config)
    if any(k.kind != "full" for k in kinds):
        return False
    layers = new_clean_cache(model).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def join_rows(ensemble, other) -> None:
    """Append ``other``'s rows (an ensemble of the same config, started on new prompts) to
    ``ensemble``'s: clean caches and real-token flags left-padded to the longer of the two."""
    mine, theirs = ensemble.variant, other.variant
    length = max(mine.length, theirs.length)
    for a, b in zip(mine.cache.layers, theirs.cache.layers, strict=True):
        a.keys = torch.cat([_pad_left(a.keys, length), _pad_left(b.keys, length)])
        a.values = torch.cat([_pad_left(a.values, length), _pad_left(b.values, length)])
    mine.valid = torch.cat([_pad_flags(mine.valid, length), _pad_flags(theirs.valid, length)])
    mine.n_real = torch.cat([mine.n_real, theirs.n_real])
    mine.length = length
    for name in ("samples_run", "tokens_run"):  # adaptive K's counters
        if hasattr(ensemble, name):
            setattr(ensemble, name, getattr(ensemble, name) + getattr(other, name))
    if hasattr(ensemble, "entropies"):
        ensemble.entropies += other.entropies


def keep_rows(ensemble, rows: Tensor) -> None:
    """Keep the rows ``rows`` (indices, in order) of ``ensemble``, then drop leading columns that
    are padding in every row (one host sync per leave, none per step)."""
    v = ensemble.variant
    v.valid, v.n_real = v.valid[rows], v.n_real[rows]
    for layer in v.cache.layers:
        layer.keys, layer.values = layer.keys[rows], layer.values[rows]
    first_real = int(v.valid.any(0).long().argmax())
    if first_real > 0:
        v.valid = v.valid[:, first_real:]
        v.length -= first_real
        for layer in v.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, first_real:], layer.values[:, :, first_real:]


def _pad_left(t: Tensor, length: int) -> Tensor:
    """[B, H, L, D] -> [B, H, length, D] with zeros in front."""
    return F.pad(t, (0, 0, length - t.shape[-2], 0)) if t.shape[-2] < length else t


def _pad_flags(valid: Tensor, length: int) -> Tensor:
    return F.pad(valid, (length - valid.shape[1], 0)) if valid.shape[1] < length else valid


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

    def __init__(self, engine) -> None:
        self.engine = engine
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
            self._rebatchable[routing.name] = rebatchable(self.engine.model, routing.roe)
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
            out += [[same[i] for i in g] for g in prefill_groups(lengths, self.engine.config.prefill_tokens)]
        return out

    def _new_ensemble(self, routing):
        from moectl.roe.ensemble import Ensemble

        engine = self.engine
        policies = [*engine._residency, *routing.policies]
        adaptive = getattr(routing, "adaptive", None)
        if adaptive is not None:
            from moectl.roe.adaptive import AdaptiveEnsemble

            return AdaptiveEnsemble(engine.model, routing.roe, adaptive, info=engine.info, policies=policies)
        return Ensemble(engine.model, routing.roe, info=engine.info, policies=policies)

    def prefill(self, reqs: list) -> None:
        """Start one ensemble on the prompts of ``reqs`` (one routing), choose their first tokens and
        join the routing's running group (or start one)."""
        engine = self.engine
        routing = reqs[0].routing
        ensemble = self._new_ensemble(routing)
        ids, mask = left_pad([r.prompt for r in reqs], engine._pad_id, engine.device)
        engine._log("prefill", len(reqs))
        with ensemble:
            out = ensemble.start(ids, mask)
        for req in reqs:
            req.seen = len(req.prompt)
        self._count(ensemble, len(reqs))
        engine.counters["prefills"] += len(reqs)
        engine.counters["prefill_forwards"] += 1
        tokens = engine._choose(out.logprobs, reqs)
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
        engine = self.engine
        for group in list(self.groups):
            engine._log("decode", len(group.reqs))
            with group.ensemble:
                out = group.ensemble.step(group.last)
            for req in group.reqs:
                req.seen += 1
            self._count(group.ensemble, len(group.reqs))
            group.last = engine._choose(out.logprobs, group.reqs)
            self._emit(group, group.last, 0)

    def _count(self, ensemble, rows: int) -> None:
        counters = self.engine.counters
        counters["roe_forwards"] = counters.get("roe_forwards", 0) + 1
        counters["roe_sample_tokens"] = counters.get("roe_sample_tokens", 0.0) + ensemble.last_samples * rows

    def _emit(self, group: RoeGroup, tokens: Tensor, first: int) -> None:
        reqs = group.reqs[first:]
        emit = self.engine._emit
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
            self.engine._finish(req, reason, piece=piece)

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
