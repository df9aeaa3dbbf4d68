"""The resident set of one MoE layer: a fixed number of expert slots on the compute device.

Slots are preallocated tensors [budget, *expert_shape] per expert parameter, so the resident
expert memory is exactly ``slot_bytes`` whatever is loaded. ``access(e)`` returns the slot of
expert ``e`` for computing with it now: on a miss it loads it into a free slot or over a victim,
and it waits for the expert's load (if one is still in flight) right before returning.

The victim is never pinned, and never an expert the current forward still needs when another will
do (``expect`` names the forward's experts, which its loops visit in ascending order): the least
recently used expert this forward does not need; else, of those it has already computed with, the
one the fewest of its tokens used (the least likely to be needed by the next step's rows; ties:
least recently used); else (all needed, none used yet: more distinct experts than the budget) the needed
one it visits last (Belady's choice: the furthest next use). Plain LRU order would evict a resident
expert the forward needs but has not reached yet, then reload it moments later: with a batch
whose union of experts exceeds the budget, LRU over an ascending visit hits nothing at all. ``ensure(e)`` makes ``e`` resident without waiting (a policy
starting an option's loads); ``prefetch`` loads predicted experts only into free slots or over
evictable ones (see :meth:`ResidentSet.prefetch`).

Loads go through a loader (``expert_loader.py``: synchronous, a worker thread or a CUDA side stream);
loads, bytes moved, load time, stall time and prefetch outcomes are counted here. A hit is an
access to an expert that was resident before the current step and was not (re)loaded during it.

A load that fails leaves the expert unmapped and its slot free (never mapped to a slot that did
not receive its bytes, never two experts to one slot): synchronously, ``submit`` raises and the
slot is returned; with a worker, the error surfaces when the expert is waited on (or at
``drain``) and the expert is unmapped then (that load stays counted: it was submitted).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor

from moectl.offload.expert_loader import ExpertRead, Loader, LoadTotals, SyncLoader, Ticket


class ResidentSet:
    def __init__(
        self,
        layer: int,
        store,
        budget: int,
        templates: dict[str, Tensor],
        device,
        loader: Loader | None = None,
    ) -> None:
        self.layer, self.store, self.budget = layer, store, budget
        self.loader: Loader = loader if loader is not None else SyncLoader()
        self.slots = {
            name: torch.empty((budget, *t.shape[1:]), dtype=t.dtype, device=device)
            for name, t in templates.items()
        }
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in templates.values())
        self.where: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recently used first
        self._free: list[int] = list(range(budget))  # slots holding no expert, ascending
        self.pinned: set[int] = set()
        self.loads = self.hits = self.misses = 0
        self.bytes_moved = 0
        self.prefetch_loads = self.prefetch_hits = self.prefetch_wasted = 0
        self.prefetched: set[int] = set()  # prefetched and resident, not yet demanded
        self.events: list[tuple[int, int]] = []  # (step, expert) of every load
        self.step = 0
        self.in_forward = False  # set by the experts forward, for compute_s
        self.timing = LoadTotals()
        self._pending: dict[int, Ticket] = {}  # expert -> its load, not yet waited on
        self._touched: set[int] = set()
        self._loaded_now: set[int] = set()
        self._needed: frozenset[int] = frozenset()  # the current forward's experts (``expect``)
        self._uses: dict[int, int] = {}  # tokens of the current forward using each of them

    # -- figures ----------------------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        """Bytes held by the resident slots, measured from the tensors."""
        return sum(t.numel() * t.element_size() for t in self.slots.values())

    @property
    def resident(self) -> list[int]:
        return sorted(self.where)

    @property
    def load_s(self) -> float:
        return self.timing.load_s

    @property
    def stall_s(self) -> float:
        return self.timing.stall_s

    # -- steps and demand -------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step
        self._touched.clear()
        self._loaded_now.clear()
        self._needed = frozenset()
        self._uses = {}
        self.settle()

    def expect(self, experts: list[int], uses: list[int] | None = None) -> None:
        """The distinct experts the current forward will access and how many of its tokens use each
        (see the module doc on victims)."""
        self._needed = frozenset(experts)
        self._uses = dict(zip(experts, uses, strict=True)) if uses is not None else {}

    def _victim(self) -> int | None:
        """Which resident expert to evict for a miss (see the module doc), None if all are pinned."""
        done = later = None
        for e in self.where:  # least recently used first
            if e in self.pinned:
                continue
            if e not in self._needed:
                return e
            if e in self._touched:
                if done is None or self._uses.get(e, 0) < self._uses.get(done, 0):
                    done = e
            elif later is None or e > later:
                later = e
        return done if done is not None else later

    def access(self, expert: int) -> int:
        """Slot of ``expert`` for computing with it now (loads it on a miss, waits for its load)."""
        if expert not in self._touched:
            self._touched.add(expert)
            if expert in self.where and expert not in self._loaded_now:
                self.hits += 1
            else:
                self.misses += 1
        slot = self.ensure(expert)
        ticket = self._pending.pop(expert, None)
        if ticket is not None:
            try:
                wait = self.loader.wait(ticket, self.in_forward)
            except BaseException:
                self._unmap(expert)  # its slot never received its bytes
                raise
            if wait is not None:
                self.timing.unsettled.append(wait)
        self.where.move_to_end(expert)
        return slot

    def ensure(self, expert: int) -> int:
        """Make ``expert`` resident (a load on a miss, not waited on) without counting an access."""
        if expert in self.where:
            if expert in self.prefetched:  # a prefetch hit: the demand finds it resident
                self.prefetched.discard(expert)
                self.prefetch_hits += 1
            return self.where[expert]
        if self._free:
            slot = self._free.pop(0)
        else:
            victim = self._victim()
            if victim is None:
                raise RuntimeError(
                    f"MoE layer {self.layer}: all {self.budget} resident experts are pinned, none can make "
                    f"room for expert {expert}"
                )
            slot = self._evict(victim)
        self._load(expert, slot, prefetch=False)
        return slot

    def prefetch(self, experts: list[int], protect: set[int] | frozenset[int] = frozenset()) -> int:
        """Start loading the missing ones of ``experts`` (in priority order); returns how many.

        Only into free slots or over evictable experts: not pinned, not in ``protect`` (what the
        current token still needs), not accessed in this step and not among ``experts``, least
        recently used first. When there is no such slot left, the rest are not prefetched: the
        budget is never exceeded and nothing the current step needs is evicted.
        """
        keep = set(experts) | set(protect) | self.pinned | self._touched | self._needed
        started = 0
        for expert in dict.fromkeys(experts):
            if expert in self.where:
                continue
            if self._free:
                slot = self._free.pop(0)
            else:
                victim = next((e for e in self.where if e not in keep), None)
                if victim is None:
                    break
                slot = self._evict(victim)
            self._load(expert, slot, prefetch=True)
            started += 1
        return started

    # -- loads ------------------------------------------------------------------------------------
    def _evict(self, victim: int) -> int:
        slot = self.where.pop(victim)
        self._pending.pop(victim, None)  # its load (if in flight) stays ordered before the next copy
        if victim in self.prefetched:
            self.prefetched.discard(victim)
            self.prefetch_wasted += 1
        return slot

    def _release(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort()

    def _unmap(self, expert: int) -> None:
        """Forget ``expert`` after its load failed: unmapped, its slot free, not a prefetch."""
        slot = self.where.pop(expert, None)
        if slot is not None:
            self._release(slot)
        self._pending.pop(expert, None)
        self.prefetched.discard(expert)
        self._loaded_now.discard(expert)

    def _forget_failed(self) -> None:
        """Unmap the experts whose load (not yet waited on) failed in the worker."""
        for expert, ticket in list(self._pending.items()):
            if ticket.error is not None:
                self._unmap(expert)

    def _load(self, expert: int, slot: int, prefetch: bool) -> None:
        ticket = Ticket(self.layer, expert, prefetch=prefetch, in_forward=self.in_forward)
        dst = {name: t[slot] for name, t in self.slots.items()}
        try:
            self.loader.submit(ticket, ExpertRead(self.store, self.layer, expert), dst)
        except BaseException:
            self._release(slot)  # the slot may hold part of the expert: free, mapped to nobody
            raise
        self.where[expert] = slot
        self._pending[expert] = ticket
        self.timing.unsettled.append(ticket)
        self.loads += 1
        self.bytes_moved += self.expert_bytes
        self._loaded_now.add(expert)
        self.events.append((self.step, expert))
        if prefetch:
            self.prefetch_loads += 1
            self.prefetched.add(expert)

    def settle(self) -> None:
        """Account the loads and waits whose times are final (never blocks)."""
        still = []
        for item in self.timing.unsettled:
            if self.loader.settled(item):
                self.timing.add(item)
            else:
                still.append(item)
        self.timing.unsettled = still

    def drain(self) -> None:
        """Complete every load in flight and account it (a failed one: unmapped, then raised)."""
        try:
            self.loader.drain()
        finally:
            self._forget_failed()
            self.settle()

    def stats(self) -> dict:
        self.drain()
        return {
            "loads": self.loads,
            "bytes_moved": self.bytes_moved,
            "hits": self.hits,
            "misses": self.misses,
            "load_s": self.timing.load_s,
            "stall_s": self.timing.stall_s,
            "wait_s": self.timing.wait_s,
            "prefetch_loads": self.prefetch_loads,
            "prefetch_hits": self.prefetch_hits,
            "prefetch_wasted": self.prefetch_wasted,
            "prefetch_unused": len(self.prefetched),
            "resident": self.resident,
        }
