"""The resident set of one MoE layer: a fixed number of expert slots on the compute device.

Slots are preallocated tensors [budget, *expert_shape] per expert parameter, so the resident
expert memory is exactly ``slot_bytes`` whatever is loaded. ``access(e)`` returns the slot of
expert ``e``, loading it on a miss into a free slot or over the least recently used expert that
is not pinned. Loads, bytes moved and load time are counted here; a hit is an access to an
expert that was resident before the current step and was not (re)loaded during it.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch
from torch import Tensor


class ResidentSet:
    def __init__(self, layer: int, store, budget: int, templates: dict[str, Tensor], device) -> None:
        self.layer, self.store, self.budget = layer, store, budget
        self.slots = {
            name: torch.empty((budget, *t.shape[1:]), dtype=t.dtype, device=device)
            for name, t in templates.items()
        }
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in templates.values())
        self.where: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recently used first
        self.pinned: set[int] = set()
        self.loads = self.hits = self.misses = 0
        self.bytes_moved = 0
        self.load_s = 0.0
        self.events: list[tuple[int, int]] = []  # (step, expert) of every load
        self.step = 0
        self._touched: set[int] = set()
        self._loaded_now: set[int] = set()

    @property
    def slot_bytes(self) -> int:
        """Bytes held by the resident slots, measured from the tensors."""
        return sum(t.numel() * t.element_size() for t in self.slots.values())

    @property
    def resident(self) -> list[int]:
        return sorted(self.where)

    def begin_step(self, step: int) -> None:
        self.step = step
        self._touched.clear()
        self._loaded_now.clear()

    def access(self, expert: int) -> int:
        """Slot of ``expert`` for computing with it now (loads it on a miss)."""
        if expert not in self._touched:
            self._touched.add(expert)
            if expert in self.where and expert not in self._loaded_now:
                self.hits += 1
            else:
                self.misses += 1
        slot = self.ensure(expert)
        self.where.move_to_end(expert)
        return slot

    def ensure(self, expert: int) -> int:
        """Make ``expert`` resident (a load on a miss) without counting an access."""
        if expert in self.where:
            return self.where[expert]
        if len(self.where) < self.budget:
            slot = len(self.where)
        else:
            victim = next((e for e in self.where if e not in self.pinned), None)
            if victim is None:
                raise RuntimeError(
                    f"MoE layer {self.layer}: all {self.budget} resident experts are pinned, none can make "
                    f"room for expert {expert}"
                )
            slot = self.where.pop(victim)
        t0 = time.perf_counter()
        weights = self.store.load(self.layer, expert)
        for name, dst in self.slots.items():
            dst[slot].copy_(weights[name], non_blocking=True)
        if dst.device.type == "cuda":
            torch.cuda.synchronize(dst.device)
        self.load_s += time.perf_counter() - t0
        self.where[expert] = slot
        self.loads += 1
        self.bytes_moved += sum(w.numel() * w.element_size() for w in weights.values())
        self._loaded_now.add(expert)
        self.events.append((self.step, expert))
        return slot

    def stats(self) -> dict:
        return {
            "loads": self.loads,
            "bytes_moved": self.bytes_moved,
            "hits": self.hits,
            "misses": self.misses,
            "load_s": self.load_s,
            "resident": self.resident,
        }
