"""Prefilling requests whose prompts start as stored ones (``prefix_cache.py``; which requests may,
and storing each prefilled prompt's KV: ``prefix_rules.py``).

Requests with a stored prefix are prefilled together in one forward over their remaining tokens:
the batch's cache starts as their prefixes, each left-padded to the longest, and the remaining
tokens follow, left-padded too, so a row's real columns are [pad | prefix | pad | rest]; the
2-D attention mask marks them and each row's positions continue from its prefix (m, m+1, …), as
they would in a prefill of the whole prompt. Each row's routing sees its own remaining tokens at
its own offset m (``rows.Group``). A mixin of ``Engine``: it uses the engine's model, router,
meter, ``_prefill_forward`` and ``_join_rows``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from moectl.engine.kv import new_cache
from moectl.engine.prefix_cache import Prefix
from moectl.engine.rows import Group
from moectl.lm.padding import left_pad

if TYPE_CHECKING:
    from moectl.engine.request import Request


class PrefixPrefill:
    """Prefix-cache use of the ``Engine`` (see the module doc)."""

    def _prefill_after(self: Any, jobs: list[tuple[Request, Prefix]]) -> None:
        """One forward over the remaining prompt tokens of requests with stored prefixes (module doc)."""
        reqs = [req for req, _ in jobs]
        k, dev = len(jobs), self.device
        starts = [prefix.length for _, prefix in jobs]
        width = max(starts)
        cache = new_cache(self.model)
        for layer in range(len(jobs[0][1].layers)):
            keys = torch.cat([F.pad(p.layers[layer][0], (0, 0, width - p.length, 0)) for _, p in jobs])
            values = torch.cat([F.pad(p.layers[layer][1], (0, 0, width - p.length, 0)) for _, p in jobs])
            cache.update(keys, values, layer)
        start = torch.tensor(starts, device=dev)
        before = (torch.arange(width, device=dev)[None, :] >= (width - start)[:, None]).long()
        rest = [req.prompt[m:] for req, m in zip(reqs, starts, strict=True)]
        ids, rest_mask = left_pad(rest, self._pad_id, dev)
        mask = torch.cat([before, rest_mask], 1)
        positions = start[:, None] + (rest_mask.cumsum(1) - 1).clamp(min=0)
        groups: dict[tuple[int, int, int], list[int]] = {}
        for i, req in enumerate(reqs):
            if req.policies:
                groups.setdefault((id(req.policies), ids.shape[1] - len(rest[i]), starts[i]), []).append(i)
        self.router.set_groups(
            [
                Group(torch.tensor(rows), reqs[rows[0]].policies, m, pad)
                for (_, pad, m), rows in groups.items()
            ],
            k,
            dev,
        )
        prev, switches = self.meter.new_rows(k, dev)
        self.meter.start(prev, switches, counting=False)
        self._pad_skip.keep([len(r) for r in rest], ids.shape[1], dev)  # the rests' padding skips the experts
        self._log("prefill", k)
        self._count_rows(reqs)
        logits, cache = self._prefill_forward(ids, mask, positions, cache)
        self.counters["prefix_tokens_reused"] += sum(starts)
        self._join_rows(reqs, cache, mask, logits, prev, switches)
