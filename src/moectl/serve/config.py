"""What the offloading runtime needs besides the model: one dataclass instead of fifteen parameters.

``OffloadConfig`` is what ``moectl serve-offload`` parses its options into, what ``offload()``
installs and what ``serve_offload()`` reports, so a run's settings travel as one value::

    from moectl.serve import OffloadConfig, offload
    with offload(model, OffloadConfig(budget=0.25, policy="option:8")) as rt:
        ...

Stores (where the experts that are not resident live):

- ``"disk"``: read from disk. A model loaded from a checkpoint folder is served from that
  checkpoint's own safetensors shards (``moectl.models.shards.ShardReader``, no second copy; its
  experts need never be in memory at all, see ``moectl.models.lazy``); a model built in memory
  (``tiny:``, ``shape:``) has its experts written once to a temporary store (``store.DiskStore``).
- ``"checkpoint"``: the checkpoint's own shards, and an error if the model has no checkpoint folder.
- ``"host"``: every expert in host memory (pinned with CUDA); only the compute device is budgeted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from moectl.errors import ConfigError
from moectl.models.range_read import DEFAULT_READ_METHOD, READ_METHODS
from moectl.serve.int8 import SLOT_DTYPES
from moectl.serve.prefetch import PrefetchConfig

STORES = ("disk", "checkpoint", "host")
EXPERTS_FORWARDS = ("grouped", "eager")  # serve/slot_forward.py, or transformers' eager loop


@dataclass(frozen=True)
class OffloadConfig:
    """Settings of one offloaded run (TE-MoE §3.2: only the active experts need be resident).

    ``budget``: resident experts per MoE layer, a fraction in (0, 1] of the layer's experts or a
    count (at least the policy's minimum, top-k for lru). ``policy``: any residency policy spec
    or object (``moectl.serve.policies.parse_policy``). ``async_loads`` / ``prefetch``: ``None``
    is on with CUDA, off without (``offload.py``). ``read_method``: how checkpoint shards are read
    (``moectl.models.range_read``: ``direct`` keeps the page cache out of the memory budget).
    ``verify``: CRC-check experts read from a written disk store. ``experts_forward``:
    ``"grouped"`` multiplies the resident slots with one grouped GEMM per projection where the
    layout allows (``serve/slot_forward.py``), ``"eager"`` runs transformers' per-expert loop.
    ``slot_dtype``: ``"same"`` keeps resident experts in the model's dtype; ``"int8"`` keeps their
    weights as int8 with per-row scales (``serve/int8.py``: half the memory of bf16 per resident
    expert and the int8 weight-only kernel on CPU; not exact). ``load_timeout_s``: the longest
    compute waits for one expert's load from the worker thread before raising (``loader.py``).
    """

    budget: float | int = 0.25
    policy: Any = "lru"
    store: str = "disk"
    store_dir: Path | None = None
    verify: bool = True
    async_loads: bool | None = None
    prefetch: bool | None = None
    prefetch_config: PrefetchConfig = field(default_factory=PrefetchConfig)
    read_method: str = DEFAULT_READ_METHOD
    experts_forward: str = "grouped"
    slot_dtype: str = "same"
    load_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        t = self.load_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t < float("inf")):
            raise ConfigError(f"load_timeout_s (--load-timeout) must be a finite number of seconds > 0, got {t!r}")
        if self.slot_dtype not in SLOT_DTYPES:
            raise ConfigError(f"slot dtype must be one of {', '.join(SLOT_DTYPES)}, got {self.slot_dtype!r}")
        if self.experts_forward not in EXPERTS_FORWARDS:
            raise ConfigError(
                f"experts forward must be one of {', '.join(EXPERTS_FORWARDS)}, got {self.experts_forward!r}"
            )
        if self.store not in STORES:
            raise ConfigError(f"store must be one of {', '.join(STORES)}, got {self.store!r}")
        if self.read_method not in READ_METHODS:
            raise ConfigError(
                f"read method must be one of {', '.join(READ_METHODS)}, got {self.read_method!r}"
            )
        if self.store_dir is not None and not isinstance(self.store_dir, Path):
            object.__setattr__(self, "store_dir", Path(self.store_dir))

    def with_(self, **changes: Any) -> OffloadConfig:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)

    def describe(self) -> dict[str, Any]:
        """JSON-ready settings (the policy by its name)."""
        policy = (
            self.policy
            if isinstance(self.policy, str)
            else getattr(self.policy, "name", type(self.policy).__name__)
        )
        return {
            "budget": self.budget,
            "policy": policy,
            "store": self.store,
            "async_loads": self.async_loads,
            "prefetch": self.prefetch,
            "read_method": self.read_method,
            "experts_forward": self.experts_forward,
            "slot_dtype": self.slot_dtype,
        }
