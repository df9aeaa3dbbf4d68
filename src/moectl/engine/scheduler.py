"""The waiting queue and each step's plan: which requests are admitted and how each is prefilled.

``Scheduler.schedule`` decides, before anything runs, what the engine's next step admits — as a
:class:`StepPlan` of plain lists (vLLM's ``SchedulerOutput``): requests cancelled while they waited
(finished at once), RoE prefills by ensemble batch (``roe_rows``), prompts that start as stored
ones (prefilled past their prefix, together: ``prefix_rules``), long prompts that start a chunked
prefill (a chunk per step from now), and the other prompts in few left-padded forwards
(``batch.prefill_groups``). Requests whose prompt and routing equal an earlier one's of this step
(or of a prompt still prefilled in chunks), where that prompt's KV will be in the prefix cache, go
back to the front of the queue: at the next step they prefill only their last token from it (``n``
choices of one prompt, clients sending the same one). The engine then runs the plan: the
prefills, the cancellations (:meth:`take_cancelled`), a chunk, the decoding step.

The queue is shared with the threads that submit and cancel: every change is under :attr:`lock`
(a condition the engine's loop also waits on).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from moectl.engine.batch import prefill_groups
from moectl.engine.prefix_cache import Prefix
from moectl.engine.prefix_rules import PrefixRules
from moectl.engine.rows import splittable


@dataclass
class StepPlan:
    """What one engine step admits and how (see the module doc); plain lists of requests."""

    cancelled: list = field(default_factory=list)  # taken from the queue, cancelled while waiting
    roe: list[list] = field(default_factory=list)  # RoE prefills, one list per ensemble batch
    after_prefix: list[list[tuple[Any, Prefix]]] = field(default_factory=list)  # (request, its stored prefix)
    chunked: list = field(default_factory=list)  # long prompts: prefilled a chunk per step from now
    prefills: list[list] = field(default_factory=list)  # the other prompts, one list per forward

    @property
    def admitted(self) -> bool:
        return bool(self.cancelled or self.roe or self.after_prefix or self.chunked or self.prefills)


class Scheduler:
    """The queue of waiting requests and the choice of each step's admissions (see the module doc).

    ``config`` is the engine's (``max_batch``, ``solo``, ``prefill_chunk``, ``prefill_tokens``);
    ``roe_batches`` splits admitted RoE requests into ensemble prefills (``RoeRows.batches``)."""

    def __init__(self, config: Any, prefixes: PrefixRules, roe_batches: Callable[[list], list[list]]) -> None:
        self.config = config
        self.prefixes = prefixes
        self.roe_batches = roe_batches
        self.lock = threading.Condition()
        self.waiting: deque = deque()
        self.cancelled: set[str] = set()  # ids to finish at the next step boundary

    def take_cancelled(self) -> set[str]:
        """The ids cancelled since the last call (the engine drops their rows)."""
        with self.lock:
            taken, self.cancelled = self.cancelled, set()
        return taken

    def put_back(self, reqs: Sequence[Any]) -> None:
        """Return ``reqs`` to the front of the queue, in order (a plan that could not run)."""
        if reqs:
            with self.lock:
                self.waiting.extendleft(reversed(list(reqs)))

    def schedule(self, rows_used: int, chunked: Sequence[Any]) -> StepPlan:
        """The plan of the next step, given the rows in use (running, RoE and chunked requests) and
        the requests being prefilled in chunks; the admitted requests leave the queue."""
        plan = StepPlan()
        taken: list = []
        used = rows_used
        config = self.config
        while used < config.max_batch and not (config.solo and (used or taken)):
            with self.lock:
                if not self.waiting or used + self.waiting[0].copies > config.max_batch:
                    break
                req = self.waiting.popleft()
                cancelled = req.id in self.cancelled
            if cancelled:
                plan.cancelled.append(req)
                continue
            taken.append(req)
            used += req.copies
        taken = self._defer_twins(taken, chunked)
        plan.roe = self.roe_batches([r for r in taken if r.routing is not None and r.routing.roe is not None])
        plain = [r for r in taken if r.routing is None or r.routing.roe is None]
        hits = [(r, p) for r in plain if (p := self.prefixes.lookup(r)) is not None]
        if hits:  # prompts that start as stored ones prefill only the rest, together
            plain = [r for r in plain if all(r is not h for h, _ in hits)]
            lengths = [len(r.prompt) - p.length for r, p in hits]
            plan.after_prefix = [[hits[i] for i in group] for group in prefill_groups(lengths, config.prefill_tokens)]
        plan.chunked = [r for r in plain if self._chunks(r)]
        plain = [r for r in plain if all(r is not q for q in plan.chunked)]
        groups = prefill_groups([len(r.prompt) for r in plain], config.prefill_tokens)
        plan.prefills = [[plain[i] for i in group] for group in groups]
        return plan

    def _chunks(self, req: Any) -> bool:
        """Whether ``req``'s prompt is prefilled a chunk per step."""
        return (
            len(req.prompt) > self.config.prefill_chunk
            and req.copies == 1
            and req.params.prompt_logprobs is None  # echo: the whole prompt's states in one forward
            and not self.config.solo
            and splittable(req.policies)
        )

    def _defer_twins(self, taken: list, chunked: Sequence[Any]) -> list:
        """``taken`` without the twins of an earlier prompt (module doc); those go back to the queue."""
        seen = {t for req in chunked if (t := self.prefixes.twin_key(req)) is not None}
        kept: list = []
        deferred: list = []
        for req in taken:
            twin = self.prefixes.twin_key(req)
            if twin is not None and twin in seen and self.prefixes.lookup(req) is None:
                deferred.append(req)
                continue
            if twin is not None:
                seen.add(twin)
            kept.append(req)
        self.put_back(deferred)
        return kept
