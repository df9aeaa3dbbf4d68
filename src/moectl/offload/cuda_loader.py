"""Expert loads on a CUDA side stream, overlapping compute (the ``async_loads`` back-end on CUDA).

Follows PyTorch's stream semantics (https://pytorch.org/docs/stable/notes/cuda.html#cuda-streams):

- the source must be pinned host memory for ``copy_(non_blocking=True)`` to be asynchronous: the
  host store is pinned already; anything else (the disk store's memory-mapped tensors) is copied
  into pinned memory on the compute thread first (``Ticket.host_s``);
- the side stream first waits on an event recorded on the compute stream at submission, so a
  slot is not overwritten while kernels queued earlier (which may read the evicted expert) run;
- each load records an event on the side stream after its copies; compute waits on it with
  ``current_stream().wait_event`` only right before the expert is used (``wait``), so the host
  never blocks and later loads keep overlapping compute;
- the slot views written on the side stream get ``record_stream`` and the source tensors are kept
  referenced until the load's event has completed (``settled``), so the caching allocators cannot
  hand either to another tensor while the copy is in flight.

Times come from timing events, relative to an origin event recorded when the loader is made: a
load's busy interval is its start/end events on the side stream; a wait's held interval is a
pair of events around ``wait_event`` on the compute stream (see ``expert_loader.py`` for stall_s).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from moectl.offload.expert_loader import ExpertRead, FifoQueue, Ticket, Wait


def _timed(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def _pinned(t: Tensor) -> Tensor:
    return t if t.is_pinned() else t.pin_memory()


@dataclass(eq=False)
class _CudaLoad:
    start: torch.cuda.Event
    end: torch.cuda.Event
    keep: dict[str, Tensor] | None  # the pinned sources, referenced until ``end`` completed


class CudaStreamLoader:
    """Copies on one dedicated side stream per device; compute waits on each load's event."""

    name = "cuda-stream"

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self._queue = FifoQueue()
        self._origin = _timed(torch.cuda.current_stream(self.device))

    def _t(self, event: torch.cuda.Event) -> float:
        return self._origin.elapsed_time(event) / 1e3

    def submit(self, ticket: Ticket, read: ExpertRead, dst: dict[str, Tensor]) -> None:
        t0 = time.perf_counter()
        weights = {name: _pinned(w) for name, w in read.fetch().items()}
        ticket.host_s = time.perf_counter() - t0
        compute = torch.cuda.current_stream(self.device)
        queued = torch.cuda.Event()
        queued.record(compute)  # everything compute has queued so far, reads of the evicted slot included
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(queued)
            start = _timed(self.stream)
            for name, d in dst.items():
                d.copy_(weights[name], non_blocking=True)
                d.record_stream(self.stream)
            end = _timed(self.stream)
        ticket.handle = _CudaLoad(start, end, weights)
        self._queue.append(ticket)

    def wait(self, ticket: Ticket, in_forward: bool) -> Wait:
        compute = torch.cuda.current_stream(self.device)
        before = _timed(compute)
        compute.wait_event(ticket.handle.end)
        after = _timed(compute)
        return Wait(self._queue.upto(ticket), in_forward, handle=(before, after))

    def settled(self, item: Ticket | Wait) -> bool:
        if isinstance(item, Ticket):
            load: _CudaLoad = item.handle
            if load.keep is not None:
                if not load.end.query():
                    return False
                item.start, item.end = self._t(load.start), self._t(load.end)
                load.keep = None
            return True
        if not all(self.settled(t) for t in item.tickets):
            return False
        before, after = item.handle
        if item.w1 is None:
            if not after.query():
                return False
            item.w0, item.w1 = self._t(before), self._t(after)
        return True

    def drain(self) -> None:
        torch.cuda.synchronize(self.device)  # the side stream's copies and the compute stream's waits

    def close(self) -> None:
        self.drain()
