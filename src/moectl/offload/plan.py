"""Memory a served model will hold, computed before anything is loaded, against the machine's cap.

Issue 18: a cap or a budget that cannot hold the non-expert weights plus top-k experts per layer
is refused before loading, naming the minimum. The figures come from the model built on the meta
device (shapes and dtypes, no memory) and the residency policy's minimum budget; the cap is the
memory cgroup's limit (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``, the smallest on the
path from this process's group to the root: what ``shared/tools/memcap`` sets) or the machine's
physical memory.

``headroom_bytes`` is what the plan adds for everything that is not a weight: the KV cache and
activations of a short generation, the allocator's and Python's own memory (≈ 0.6 GiB measured:
``moectl serve-offload`` on a 2-layer slice, RSS minus weights).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass

from torch import nn

from moectl.adapters import inspect
from moectl.errors import MemoryLimitError
from moectl.io.cgroup import memory_limits
from moectl.offload.expert_tensors import per_expert
from moectl.offload.int8 import expert_slot_bytes

HEADROOM_BYTES = 640 * 2**20


def memory_limit() -> int | None:
    """Bytes this process may use: the tightest cgroup limit, else physical memory (None if unknown)."""
    limits = memory_limits()
    with contextlib.suppress(ValueError, OSError, AttributeError):
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return min(limits) if limits else None


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of weights the served model will hold, and the smallest configuration that runs."""

    non_expert_bytes: int
    expert_bytes: list[int]  # one expert of each MoE layer
    budget_experts: list[int]  # resident experts per MoE layer, as asked
    min_experts: list[int]  # the policy's minimum per MoE layer (top-k for lru)
    headroom_bytes: int
    limit_bytes: int | None

    @property
    def resident_expert_bytes(self) -> int:
        return sum(b * e for b, e in zip(self.budget_experts, self.expert_bytes, strict=True))

    @property
    def planned_bytes(self) -> int:
        return self.non_expert_bytes + self.resident_expert_bytes + self.headroom_bytes

    @property
    def minimum_bytes(self) -> int:
        experts = sum(m * e for m, e in zip(self.min_experts, self.expert_bytes, strict=True))
        return self.non_expert_bytes + experts + self.headroom_bytes

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "resident_expert_bytes": self.resident_expert_bytes,
            "planned_bytes": self.planned_bytes,
            "minimum_bytes": self.minimum_bytes,
        }


def _expert_params(module: nn.Module, num_experts: int) -> list:
    return list(per_expert(module, num_experts).values())  # a quantized module's too: its bytes


def plan_memory(
    model: nn.Module, budget_experts: list[int], min_experts: list[int], slot_dtype: str = "same"
) -> MemoryPlan:
    """The plan for ``model`` (any device, meta included) with ``budget_experts`` resident in slots
    of ``slot_dtype`` (``offload/int8.py``)."""
    info = inspect(model)
    expert_ids, per_expert = set(), []
    for layer in info.layers:
        params = _expert_params(layer.block.experts, layer.num_experts)
        expert_ids |= {id(p) for p in params}
        per_expert.append(expert_slot_bytes(params, slot_dtype))
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in expert_ids:
            seen[id(t)] = t.numel() * t.element_size()
    return MemoryPlan(
        non_expert_bytes=sum(seen.values()),
        expert_bytes=per_expert,
        budget_experts=list(budget_experts),
        min_experts=list(min_experts),
        headroom_bytes=HEADROOM_BYTES,
        limit_bytes=memory_limit(),
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"


def check_plan(plan: MemoryPlan) -> None:
    """``MemoryError`` naming the minimum when the plan cannot fit the memory limit."""
    limit = plan.limit_bytes
    if limit is None or plan.planned_bytes <= limit:
        return
    if plan.minimum_bytes > limit:
        raise MemoryLimitError(
            f"the memory limit is {_gib(limit)}, but serving needs at least {_gib(plan.minimum_bytes)}: "
            f"{_gib(plan.non_expert_bytes)} of non-expert weights + the policy's minimum of "
            f"{plan.min_experts[0]} experts per MoE layer + {_gib(plan.headroom_bytes)} headroom"
        )
    spare = limit - plan.minimum_bytes
    fits = [
        m + spare // max(e * len(plan.expert_bytes), 1)
        for m, e in zip(plan.min_experts, plan.expert_bytes, strict=True)
    ]
    raise MemoryLimitError(
        f"the memory limit is {_gib(limit)}, but a budget of {plan.budget_experts[0]} experts per MoE layer "
        f"needs {_gib(plan.planned_bytes)}; at most {min(fits)} experts per layer fit "
        f"(minimum {_gib(plan.minimum_bytes)} with {plan.min_experts[0]})"
    )


def preflight(model: nn.Module, budget: float | int, policy, slot_dtype: str = "same") -> MemoryPlan:
    """Check ``budget`` against the policy's minimum and the plan against the memory limit, for a
    model not loaded yet (built on meta): ``BudgetError`` / ``MemoryError`` naming the minimum."""
    from moectl.offload.runtime import BudgetError, resolve_budget

    info = inspect(model)
    budgets = [resolve_budget(budget, layer.num_experts) for layer in info.layers]
    minimum = [
        policy.min_budget(layer.index, layer.top_k) if policy is not None else layer.top_k
        for layer in info.layers
    ]
    for layer, b, m in zip(info.layers, budgets, minimum, strict=True):
        if b < m:
            raise BudgetError(
                f"MoE layer {layer.index}: a budget of {b} resident experts is too small: at least {m} are "
                f"needed (top-k = {layer.top_k}, {layer.num_experts} experts per layer)"
            )
    plan = plan_memory(model, budgets, minimum, slot_dtype)
    check_plan(plan)
    return plan
