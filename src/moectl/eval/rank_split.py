"""Evaluation over the processes of ``accelerate launch`` (:mod:`moectl.distributed`): requests split, results gathered.

- **lm-eval's tasks** take lm-eval's own data-parallel path: :class:`moectl.eval.lm_backend.MoectlLM`
  reports ``rank``/``world_size`` and gathers with ``all_gather``/``gather_object``/``barrier``;
  lm-eval gives each process every ``world_size``-th document, pads the processes to equal request
  counts with copies of a last request, and joins the metrics on rank 0. :func:`lm_eval_padding`
  finds those copies, so they are neither scored nor counted in a switch rate.
- **perplexity** (``--perplexity``): documents split into contiguous parts, per-document NLL and
  token counts gathered back in order (:func:`shared_document_nll`).
- **switch rates**: every process's per-sequence rates joined and sorted (:func:`merged_switch`), so
  the summary does not depend on which process scored a sequence or in what order.

Routing randomness belongs to the request (``request_noise.py``), so a request scores the same on
any process: results equal the one-process results (to float reduction order in sums).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from moectl.distributed import Ranks
from moectl.eval.forward import RoutingPlan, SwitchStats
from moectl.eval.perplexity import Document, document_nll


def lm_eval_padding(requests: Sequence[Any], world: int) -> int:
    """How many trailing requests are lm-eval's padding: with several processes it appends copies
    of the last request (the same object, ``repeats`` times per pad) to even out the counts."""
    if world <= 1 or not requests:
        return 0
    last = requests[-1]
    run = 0
    for req in reversed(requests):
        if req is not last:
            break
        run += 1
    return max(0, run - int(getattr(last, "repeats", 1) or 1))


def merged_switch(stats: SwitchStats | None, processes: Ranks) -> SwitchStats | None:
    """One :class:`SwitchStats` holding every process's per-sequence rates, sorted (order-free)."""
    if stats is None:
        return None
    merged = SwitchStats(stats.k_hat)
    for source in ("router", "allowed"):
        joined = [x for part in processes.gather_objects(stats.rates[source]) for x in part]
        merged.rates[source] = sorted(joined)
    return merged


def shared_document_nll(
    processes: Ranks,
    model: Any,
    tokenizer: Any,
    docs: Sequence[Document],
    plan: RoutingPlan,
    info: Any,
    max_length: int,
    batch_size: int,
    stats: SwitchStats | None,
    progress: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`moectl.eval.perplexity.document_nll` with the documents split over the processes;
    every process gets the whole (nll, tokens) in document order."""
    part = processes.part(len(docs))
    mine = list(docs)[part]
    if mine:
        nll, tokens = document_nll(
            model, tokenizer, mine, plan, info, max_length, batch_size, stats, progress
        )
    else:  # fewer documents than processes
        nll, tokens = np.zeros(0, dtype=np.float64), np.zeros(0, dtype=np.int64)
    if not processes.distributed:
        return nll, tokens
    parts = processes.gather_objects((nll, tokens))
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
