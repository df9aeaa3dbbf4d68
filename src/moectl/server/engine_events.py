"""One request through the engine, seen from the event loop.

The engine calls ``on_event`` from its own thread; :class:`Generation` moves each event onto the
event loop (``loop.call_soon_threadsafe``) into an ``asyncio.Queue`` the handler awaits, and
measures on the way what a client sees: time to first token and inter-token latency. Whoever
stops listening before the last event — a client that disconnected, a cancelled stream — calls
:meth:`Generation.cancel`, and the engine frees the row and its cache at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from moectl.server.api_errors import APIError
from moectl.server.metrics import ServerMetrics

RETRY_AFTER_S = 1


class Generation:
    """A submitted request's events, in order, ending with the one that has a ``finish_reason``."""

    def __init__(self, engine: Any, metrics: ServerMetrics, arrived: float) -> None:
        self.engine, self.metrics, self.arrived = engine, metrics, arrived
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.request_id: Any = None
        self.finished = False

    def _on_event(self, event: Any) -> None:
        """Called from the engine thread."""
        with contextlib.suppress(RuntimeError):  # a closed loop: the server is gone, nobody listens
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def submit(self, prompt_ids: list[int], params: Any, routing: str | None) -> None:
        """Hand the request to the engine: 429 when its queue is full, 400 for what it refuses."""
        from moectl.engine import QueueFull

        try:
            self.request_id = self.engine.submit(prompt_ids, params, routing=routing, on_event=self._on_event)
        except QueueFull as err:
            raise APIError(
                429,
                f"the server's queue is full ({err or 'all --max-queue places taken'}); retry in {RETRY_AFTER_S} s",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from err
        except ValueError as err:
            raise APIError(400, str(err)) from err
        except RuntimeError as err:  # the engine stopped accepting (shutting down)
            raise APIError(503, f"the server is shutting down: {err}", headers={"Retry-After": "5"}) from err
        self.metrics.prompt_tokens.inc(len(prompt_ids))

    async def events(self) -> AsyncIterator[Any]:
        """The engine's events for this request; the last one has a ``finish_reason``."""
        last: float | None = None
        while not self.finished:
            event = await self.queue.get()
            now = time.perf_counter()
            if event.token_ids:
                n = len(event.token_ids)
                if last is None:
                    self.metrics.ttft.observe(now - self.arrived)
                else:
                    self.metrics.itl.observe((now - last) / n)  # one step may bring several tokens
                last = now
                self.metrics.tokens(n)
            self.finished = event.finish_reason is not None
            yield event

    def cancel(self) -> None:
        """Stop the request if it is still running (idempotent)."""
        if self.request_id is not None and not self.finished:
            self.finished = True
            self.engine.cancel(self.request_id)


async def merged(generations: list[Generation]) -> AsyncIterator[tuple[int, Any]]:
    """(index, event) of every generation's events as they come (a request's ``n`` choices or its
    prompts, streamed together), each generation's in its order, until all have finished. Events
    that are ready together come in index order."""
    streams = [g.events() for g in generations]
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            ready, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(ready, key=pending.__getitem__):
                index = pending.pop(future)
                try:
                    event = future.result()
                except StopAsyncIteration:
                    continue
                yield index, event
                if event.finish_reason is None:
                    pending[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for future in pending:
            future.cancel()


async def wait_disconnect(receive: Any) -> None:
    """Return when the client has gone (the request's body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


@dataclass
class Collected:
    """A finished request as a non-streamed response needs it: its text, its last event (finish
    reason, usage, routing), its token ids and (where asked for) their log-probabilities."""

    text: str
    last: Any
    token_ids: list[int]
    logprobs: list | None


async def gather(generation: Generation) -> Collected:
    parts: list[str] = []
    ids: list[int] = []
    lps: list | None = None
    event = None
    async for event in generation.events():
        parts.append(event.text or "")
        ids += event.token_ids
        if event.logprobs is not None:
            lps = lps if lps is not None else []
            lps.extend(event.logprobs)
    return Collected("".join(parts), event, ids, lps)


async def collect(generations: list[Generation], receive: Any) -> list[Collected] | None:
    """Each request's :class:`Collected`, in order; None (and every request cancelled) when the
    client disconnects first."""
    work = asyncio.ensure_future(asyncio.gather(*(gather(g) for g in generations)))
    gone = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():  # the client left first, or this handler was cancelled
            work.cancel()
            for generation in generations:
                generation.cancel()
    return list(work.result()) if work.done() and not work.cancelled() else None
