"""The processes of a data-parallel run (``accelerate launch``), as the verbs beyond pretraining use them.

``accelerate launch [--cpu] --num_processes N -m moectl VERB …`` (or ``torchrun``) starts N copies
of a verb with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set; :func:`ranks` joins them through
accelerate's ``PartialState`` (NCCL on GPUs, gloo on CPUs) and returns a :class:`Ranks`: this
process's index, the world size, its device, and the few collectives the verbs need —

- ``total(x)``: the sum of a tensor over the processes (losses' normalisers, statistics);
- ``gather(x)``: 1-D tensors of any length from every process, joined in rank order;
- ``gather_objects(obj)``: a picklable object from every process, as a list in rank order;
- ``reduce_gradients(params)``: the sum of the gradients over the processes, in buckets;
- ``share(n)`` / ``part(n)``: the slice of n items (a global batch; any list) this process works on.

One process (no launcher) is a :class:`Ranks` of world size 1 whose collectives are identities,
so a verb's code is the same in both cases and accelerate is imported only when launched.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from moectl.errors import ConfigError

BUCKET_ELEMENTS = 1 << 25  # gradients all-reduced in flat buckets of at most 32 Mi elements


def launched_world_size() -> int:
    """The world size a launcher (accelerate, torchrun) set, without starting anything (1 if none)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


@dataclass(frozen=True)
class Ranks:
    """This process's place in a data-parallel run; collectives are identities in a world of one."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device | None = None  # the launcher's device for this process (cuda:LOCAL_RANK, cpu)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def share(self, n: int) -> slice:
        """This process's contiguous part of ``n`` items (``n`` must split evenly: :func:`check_divides`)."""
        check_divides(n, self.world, "items")
        per = n // self.world
        return slice(self.rank * per, (self.rank + 1) * per)

    def part(self, n: int) -> slice:
        """This process's contiguous part of ``n`` items split as evenly as they go (sizes differ by ≤ 1)."""
        base, extra = divmod(n, self.world)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (self.rank < extra))

    def total(self, x: Tensor) -> Tensor:
        """The sum of ``x`` over the processes (a new tensor; ``x`` itself alone)."""
        if not self.distributed:
            return x
        import torch.distributed as dist

        out = x.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def gather(self, x: Tensor) -> Tensor:
        """1-D ``x`` of every process joined in rank order (lengths may differ)."""
        if not self.distributed:
            return x
        import torch.distributed as dist

        x = x.detach().reshape(-1)
        sizes = [torch.zeros((), dtype=torch.long, device=x.device) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor(x.numel(), dtype=torch.long, device=x.device))
        longest = int(max(int(s) for s in sizes))
        padded = torch.zeros(longest, dtype=x.dtype, device=x.device)
        padded[: x.numel()] = x
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        return torch.cat([p[: int(s)] for p, s in zip(parts, sizes, strict=True)])

    def gather_objects(self, obj: Any) -> list[Any]:
        """``obj`` of every process, in rank order (on every process)."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every process."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def reduce_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Replace each gradient by its sum over the processes.

        A parameter no process has a gradient for keeps none (an optimizer then skips it, as it
        would alone); one that some processes lack a gradient for counts zero there. Flat buckets
        per (device, dtype), so a model spread over devices works and one collective moves many
        small tensors; every process must pass the same parameters in the same order.
        """
        if not self.distributed:
            return
        import torch.distributed as dist

        params = [p for p in params if p.requires_grad]
        if not params:
            return
        device = self.device if self.device is not None else params[0].device
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
        dist.all_reduce(has, op=dist.ReduceOp.SUM)  # how many processes hold each gradient
        held = [p for p, n in zip(params, has.tolist(), strict=True) if n > 0]
        groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
        for p in held:
            groups.setdefault((p.device, p.dtype), []).append(p)
        for plist in groups.values():
            for bucket in _buckets(plist):
                for p in bucket:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                flat = torch.cat([p.grad.reshape(-1) for p in bucket])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                offset = 0
                for p in bucket:
                    p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                    offset += p.numel()

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()


def _buckets(params: list[torch.nn.Parameter]) -> Iterable[list[torch.nn.Parameter]]:
    bucket: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        if bucket and size + p.numel() > BUCKET_ELEMENTS:
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += p.numel()
    if bucket:
        yield bucket


def check_divides(n: int, world: int, what: str, flag: str = "--batch-size") -> None:
    """``ValueError`` naming the fix when ``n`` (``what``: the items, for the reader) does not split
    evenly over ``world`` processes."""
    if world > 1 and n % world:
        lower = max(world, n - n % world)
        raise ConfigError(
            f"{flag} {n} does not split over {world} processes: give a multiple of {world} "
            f"(e.g. {lower} or {lower + world}) or launch a number of processes that divides {n}"
        )


def ranks() -> Ranks:
    """This process's :class:`Ranks`: joins the launched run (accelerate's ``PartialState``) when
    ``WORLD_SIZE`` > 1, else a world of one (nothing imported, nothing started)."""
    if launched_world_size() <= 1:
        return Ranks()
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
    state = PartialState(cpu=cpu)
    return Ranks(
        rank=int(state.process_index),
        world=int(state.num_processes),
        local_rank=int(state.local_process_index),
        device=torch.device(state.device),
    )


def process_device(device: str, ranks: Ranks) -> str:
    """The device a launched process uses for ``--device``: ``cuda`` becomes this process's GPU
    (``cuda:LOCAL_RANK``); anything else is kept (one process alone: unchanged). A device map
    (auto, balanced) with several processes is refused: each would spread over every GPU."""
    if not ranks.distributed:
        return device
    if device in ("auto", "balanced"):
        raise ConfigError(
            f"--device-map {device} with {ranks.world} processes: each process would spread the model over "
            "every GPU; give --device cuda (one GPU per process), or run one process with --device-map"
        )
    return f"cuda:{ranks.local_rank}" if device == "cuda" else device
