"""Expert loads: one interface, synchronous or overlapping compute.

A load copies one expert's weights from the store into its resident slot. ``submit`` starts it;
``wait`` is called right before the expert is used and holds compute back until the copy has
landed; ``drain`` completes everything (before the counters are read and before the slots are
freed). Back-ends:

- :class:`SyncLoader` (the default without CUDA): the whole load runs inside ``submit``.
- :class:`ThreadLoader` (``async_loads`` on CPU): one background worker runs the loads (store
  read and copy) in submission order (torch's copy kernels and zlib's checksum release the GIL);
  ``wait`` blocks on the load's future.
- :class:`~moectl.offload.cuda_loader.CudaStreamLoader` (``async_loads`` on CUDA, the default
  there): copies from pinned host memory on a side stream, an event per load, the compute
  stream waits on the event.

Accounting, exact per load so that overlap is visible (TE-MoE §A4 leaves grounding the
deliberation cost η in measured loading latency open, ``cost.py``; with overlapping loads the
latency that costs time is the stall, not the load):

- ``load_s``: the loads' own durations: the part run on the compute thread (``Ticket.host_s``:
  the whole load when synchronous; reading the store and pinning on CUDA) plus the interval the
  worker or the side stream spent on the copy (``Ticket.start`` .. ``Ticket.end``).
- ``stall_s``: time compute was held back by loads: ``host_s`` plus, for each wait, the part of
  the held interval during which the loader was busy with the awaited load or loads queued before
  it (:meth:`Wait.stall_s`). Each load's busy interval enters at most one wait, so
  ``stall_s <= load_s`` by construction; ``load_s - stall_s`` is load time hidden behind compute.
- ``wait_s``: host wall time blocked on loads (``host_s`` plus blocked waits). On CPU it exceeds
  ``stall_s`` by the worker's hand-off latency; on CUDA the compute stream waits, not the host.

Faults: any error of a store read is raised as ``ExpertStoreError`` naming the MoE layer and the
expert (the store's own message, e.g. the shard, kept), and a store that returns a tensor of
another shape is refused before anything is copied. The worker's loads are waited on for at most
``timeout_s`` (``OffloadConfig.load_timeout_s``): a stalled read then raises instead of hanging
the run (the worker finishes it later; with one worker in FIFO order, a later load into the same
slot still lands after it). The synchronous loader cannot interrupt a read on the calling
thread: a slow read there is only slow.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from moectl.offload.expert_store import ExpertStoreError


@dataclass(frozen=True)
class ExpertRead:
    """One expert of one MoE layer, to be read from ``store`` into its resident slot.

    ``into(dst)`` fills ``dst`` (the slot's views) in place: stores that can read straight into a
    caller's buffer (``read_into``: the checkpoint's shards) do so, with no intermediate copy of
    the expert; others return the expert (``load``) and it is copied. ``fetch()`` returns it as
    host tensors (the CUDA loader pins those, then copies on its side stream).
    """

    store: Any
    layer: int
    expert: int

    def _failed(self, err: Exception) -> ExpertStoreError:
        if isinstance(err, ExpertStoreError):
            return err
        return ExpertStoreError(f"MoE layer {self.layer}, expert {self.expert}: the load failed: {err}")

    def fetch(self) -> dict[str, Tensor]:
        try:
            return self.store.load(self.layer, self.expert)
        except Exception as err:
            raise self._failed(err) from err

    def into(self, dst: dict[str, Tensor]) -> None:
        read_into = getattr(self.store, "read_into", None)
        if read_into is not None and all(d.device.type == "cpu" for d in dst.values()):
            try:
                read_into(self.layer, self.expert, dst)
            except Exception as err:
                raise self._failed(err) from err
            return
        weights = self.fetch()
        for name, d in dst.items():
            w = weights.get(name)
            if w is None or tuple(w.shape) != tuple(d.shape):
                got = "nothing" if w is None else f"{list(w.shape)}"
                raise ExpertStoreError(
                    f"MoE layer {self.layer}, expert {self.expert}, {name}: the store returned {got}, "
                    f"the slot is {list(d.shape)}"
                )
        for name, d in dst.items():
            d.copy_(weights[name], non_blocking=True)


@dataclass(eq=False)
class Ticket:
    """One expert load; times on the loader's clock (seconds)."""

    layer: int
    expert: int
    prefetch: bool = False
    in_forward: bool = False  # submitted while the experts forward ran (for compute_s)
    host_s: float = 0.0  # work done on the compute thread (load and stall alike)
    start: float | None = None  # the worker's / side stream's busy interval
    end: float | None = None
    dequeued: bool = False  # already taken into a Wait
    error: BaseException | None = None  # the load failed (set by the worker)
    handle: Any = None  # back-end private: a future, or CUDA events and the source tensors

    @property
    def busy_s(self) -> float:
        return 0.0 if self.start is None or self.end is None else max(self.end - self.start, 0.0)


@dataclass(eq=False)
class Wait:
    """Compute held back until ``tickets[-1]`` landed; ``tickets`` are the loads it may overlap."""

    tickets: list[Ticket]
    in_forward: bool = False
    blocked_s: float = 0.0  # host wall time blocked
    w0: float | None = None  # the held interval on the loader's clock
    w1: float | None = None
    handle: Any = None

    def stall_s(self) -> float:
        """Seconds of the held interval during which the loader was busy with these loads."""
        if self.w0 is None or self.w1 is None:
            return 0.0
        return sum(interval_overlap(self.w0, self.w1, t.start, t.end) for t in self.tickets)


def interval_overlap(a0: float, a1: float, b0: float | None, b1: float | None) -> float:
    """Length of [a0, a1] ∩ [b0, b1] (0 when either is empty or unknown)."""
    if b0 is None or b1 is None:
        return 0.0
    return max(0.0, min(a1, b1) - max(a0, b0))


@dataclass
class LoadTotals:
    """Settled figures of the loads and waits of one resident set."""

    load_s: float = 0.0
    stall_s: float = 0.0
    wait_s: float = 0.0
    forward_wait_s: float = 0.0  # of which inside the experts forward (subtracted from compute_s)
    unsettled: list[Ticket | Wait] = field(default_factory=list)

    def add(self, item: Ticket | Wait) -> None:
        if isinstance(item, Ticket):
            self.load_s += item.host_s + item.busy_s
            self.stall_s += item.host_s
            self.wait_s += item.host_s
            if item.in_forward:
                self.forward_wait_s += item.host_s
        else:
            stall = item.stall_s()
            self.stall_s += stall
            self.wait_s += item.blocked_s
            if item.in_forward:
                self.forward_wait_s += max(stall, item.blocked_s)


class Loader(Protocol):
    name: str

    def submit(self, ticket: Ticket, read: ExpertRead, dst: dict[str, Tensor]) -> None:
        """Start copying ``read`` into ``dst`` (views of the resident slot)."""

    def wait(self, ticket: Ticket, in_forward: bool) -> Wait | None:
        """Hold compute back until ``ticket``'s copy has landed (raises its load's error)."""

    def settled(self, item: Ticket | Wait) -> bool:
        """True once ``item``'s times are final (fills them in); never blocks."""

    def drain(self) -> None:
        """Complete every submitted load; raise the first error of a load nobody waited on."""

    def close(self) -> None: ...


class SyncLoader:
    """The load runs inside ``submit``: compute is held back for all of it."""

    name = "sync"

    def submit(self, ticket: Ticket, read: ExpertRead, dst: dict[str, Tensor]) -> None:
        t0 = time.perf_counter()
        read.into(dst)
        d = next(iter(dst.values()))
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        ticket.host_s = time.perf_counter() - t0

    def wait(self, ticket: Ticket, in_forward: bool) -> Wait | None:
        return None

    def settled(self, item: Ticket | Wait) -> bool:
        return True

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class FifoQueue:
    """Loads in submission order, for attributing a single worker's busy time to waits."""

    def __init__(self) -> None:
        self._queue: deque[Ticket] = deque()

    def append(self, ticket: Ticket) -> None:
        self._queue.append(ticket)

    def upto(self, ticket: Ticket) -> list[Ticket]:
        """Take the loads queued up to and including ``ticket`` (none if it was taken already):
        with one worker in FIFO order, those are what a wait for ``ticket`` can overlap."""
        if ticket.dequeued:
            return []
        out = []
        while self._queue:
            t = self._queue.popleft()
            t.dequeued = True
            out.append(t)
            if t is ticket:
                break
        return out


class ThreadLoader:
    """One background worker thread copies in submission order; ``wait`` blocks on the future."""

    name = "thread"

    def __init__(self, timeout_s: float | None = None) -> None:
        """``timeout_s``: the longest a wait (or ``drain``) blocks on the worker; None: no limit."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moectl-expert-loads")
        self._queue = FifoQueue()
        self._errors: list[BaseException] = []
        self.timeout_s = timeout_s
        self._stalled = False  # a load outlived its wait: close() does not wait for the worker

    def _run(self, ticket: Ticket, read: ExpertRead, dst: dict[str, Tensor]) -> None:
        ticket.start = time.perf_counter()
        try:
            read.into(dst)
        except BaseException as err:
            ticket.error = err
            self._errors.append(err)
            raise
        finally:
            ticket.end = time.perf_counter()

    def submit(self, ticket: Ticket, read: ExpertRead, dst: dict[str, Tensor]) -> None:
        ticket.handle = self._pool.submit(self._run, ticket, read, dst)
        self._queue.append(ticket)

    def wait(self, ticket: Ticket, in_forward: bool) -> Wait:
        future: Future = ticket.handle
        w0 = time.perf_counter()
        try:
            future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._stalled = True
            ticket.error = ExpertStoreError(
                f"MoE layer {ticket.layer}, expert {ticket.expert}: the load did not finish within "
                f"{self.timeout_s:g} s (a stalled read); load_timeout_s sets the limit"
            )
            raise ticket.error from None
        except BaseException as err:
            if err in self._errors:
                self._errors.remove(err)  # reported here, not again at drain
            raise
        w1 = time.perf_counter()
        return Wait(self._queue.upto(ticket), in_forward, blocked_s=w1 - w0, w0=w0, w1=w1)

    def settled(self, item: Ticket | Wait) -> bool:
        if isinstance(item, Wait):
            return True  # created after its loads completed
        return item.handle.done()

    def drain(self) -> None:
        try:  # one worker, FIFO: every earlier load is done
            self._pool.submit(lambda: None).result(timeout=self.timeout_s)
        except FutureTimeout:
            self._stalled = True
            raise ExpertStoreError(
                f"expert loads did not finish within {self.timeout_s:g} s (a stalled read)"
            ) from None
        if self._errors:
            err = self._errors[0]
            self._errors.clear()
            raise err

    def close(self) -> None:
        # a stalled read may never end: leave the worker to finish it (its slot views stay alive)
        self._pool.shutdown(wait=not self._stalled, cancel_futures=self._stalled)


def make_loader(device: torch.device, async_loads: bool, timeout_s: float | None = None) -> Loader:
    """The loader for slots on ``device``: synchronous, a worker thread (CPU) or a CUDA side stream.
    ``timeout_s`` bounds the worker's waits (the CUDA loader reads on the calling thread)."""
    if not async_loads:
        return SyncLoader()
    if device.type == "cuda":
        from moectl.offload.cuda_loader import CudaStreamLoader

        return CudaStreamLoader(device)
    return ThreadLoader(timeout_s)
