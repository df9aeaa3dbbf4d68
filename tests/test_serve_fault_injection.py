"""Fault injection in serving (issue 29): expert reads that fail, hang or come back short, at chosen
points, under the synchronous and the thread loader.

Each scenario serves a tiny OLMoE with 2 resident experts per layer, injects one fault at the
N-th store read (or the N-th ``preadv`` of the checkpoint's shards), and checks:

- the fault ends in a clear ``ExpertStoreError`` naming the MoE layer and the expert (and the shard,
  for shard faults), or is absorbed (a short read completed, a slow read waited for) with output
  equal to the in-memory model's;
- no stale weights: every mapped slot holds exactly its expert's bytes, and a second generation
  in the same runtime (the recovery) equals the reference;
- after the runtime exits, the model has all its expert parameters back, unchanged, its experts
  implementation is unchanged, and the temporary store is gone.

Faults tried and handled are counted; the test asserts every one was handled. Then SIGTERM,
SIGHUP and SIGINT sent to ``moectl serve-offload tiny:olmoe`` mid-run leave nothing in its TMPDIR.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import moectl
from _serve_helpers import greedy, prompt
from moectl.io import range_read
from moectl.io.range_read import ALIGN
from moectl.io.shards import ShardReader
from moectl.offload import ExpertStoreError, OffloadConfig, offload

torch.set_num_threads(1)
TIMEOUT_S = 0.5  # load_timeout_s of the runs (a normal tiny load: ~50 us)
HANG_S = 1.0  # an injected stall: longer than the timeout
LOADERS = ("sync", "thread")


@dataclass
class Faults:
    """Which calls misbehave ({call number: kind}); what was injected."""

    plan: dict[int, str]
    calls: int = 0
    injected: list[str] = field(default_factory=list)
    hang_over: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next(self) -> str | None:
        with self.lock:
            self.calls += 1
            kind = self.plan.pop(self.calls, None)
            if kind is not None:
                self.injected.append(kind)
            return kind

    def hang(self) -> None:
        time.sleep(HANG_S)
        self.hang_over.set()


class FaultyStore:
    """An expert store whose planned reads raise, stall or return a tensor one element short."""

    def __init__(self, inner, faults: Faults) -> None:
        self.inner, self.faults = inner, faults
        self.kind = getattr(inner, "kind", "host")

    def load(self, layer: int, expert: int):
        fault = self.faults.next()
        if fault == "error":
            raise OSError(errno.EIO, "injected read error")
        if fault == "hang":
            self.faults.hang()
        out = self.inner.load(layer, expert)
        if fault == "short":
            name = next(iter(out))
            out = {**out, name: out[name].reshape(-1)[:-1]}
        return out


def faulty_preadv(faults: Faults, real=os.preadv):
    """``os.preadv`` whose planned calls read half (aligned), read nothing (a truncated file) or fail."""

    def preadv(fd: int, buffers, offset: int) -> int:
        fault = faults.next()
        if fault == "eio":
            raise OSError(errno.EIO, "injected I/O error")
        if fault == "eof":
            return 0
        if fault == "short":
            total = sum(memoryview(b).nbytes for b in buffers)
            limit = (total // 2) // ALIGN * ALIGN or total // 2
            if limit == 0:
                return real(fd, buffers, offset)
            kept, left = [], limit
            for b in buffers:
                b = memoryview(b)
                kept.append(b[: min(left, b.nbytes)])
                left -= kept[-1].nbytes
                if not left:
                    break
            return real(fd, kept, offset)
        return real(fd, buffers, offset)

    return preadv


def _experts(model) -> dict[int, dict[str, torch.Tensor]]:
    info = moectl.inspect(model)
    return {
        layer.index: {
            n: p.detach().clone()
            for n, p in layer.block.experts.named_parameters(recurse=False)
            if p.dim() >= 2 and p.shape[0] == layer.num_experts
        }
        for layer in info.layers
    }


def _slots_hold_their_experts(rt, original) -> bool:
    for res in rt.resident_sets:
        with contextlib.suppress(ExpertStoreError):  # a failed load nobody waited on: unmapped by drain
            res.drain()
        slots = list(res.where.values())
        if len(set(slots)) != len(slots):
            return False
        for expert, slot in res.where.items():
            for name, weight in original[res.layer].items():
                if not torch.equal(res.slots[name][slot], weight[expert]):
                    return False
    return True


def _error_is_clear(err: BaseException, shard: str | None) -> bool:
    text = str(err)
    return (
        isinstance(err, ExpertStoreError)
        and "MoE layer" in text
        and "expert" in text
        and (shard is None or shard in text)
        and "\n" not in text
    )


@pytest.fixture(scope="module")
def reference():
    model = moectl.tiny("olmoe")
    ids = prompt(3)
    return model, ids, greedy(model, ids), _experts(model)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, reference):
    path = tmp_path_factory.mktemp("ck")
    reference[0].save_pretrained(path)
    return path


def _scenario(model, ids, expected, original, config, install, shard, tmp: Path) -> tuple[bool, str]:
    """Run one faulted generation and a recovery; True when everything the module docstring lists held."""
    impl = model.config._experts_implementation
    outcome = "absorbed"
    with offload(model, config, reader=install.get("reader")) as rt:
        install["wrap"](rt)
        try:
            out = greedy(model, ids)
        except ExpertStoreError as err:
            if not _error_is_clear(err, shard):
                return False, f"unclear error: {err}"
            outcome = f"error: {err}"
        else:
            if not torch.equal(out, expected):
                return False, "output differs after an absorbed fault"
        install["faults"].hang_over.wait(HANG_S + 5) if "hang" in install["faults"].injected else None
        if not _slots_hold_their_experts(rt, original):
            return False, "a slot does not hold its expert"
        if not torch.equal(greedy(model, ids), expected):
            return False, "recovery differs from the reference"
    after = _experts(model)
    if any(not torch.equal(after[i][n], original[i][n]) for i in original for n in original[i]):
        return False, "expert parameters not restored"
    if model.config._experts_implementation != impl:
        return False, "experts implementation changed"
    if any(tmp.iterdir()):
        return False, f"left in the temp folder: {sorted(p.name for p in tmp.iterdir())}"
    return True, outcome


STORE_FAULTS = [(loader, kind, at) for loader in LOADERS for kind in ("error", "hang", "short") for at in (1, 5, 12)]
SHARD_FAULTS = [
    (loader, kind, at, method)
    for loader in LOADERS
    for kind, method in (("short", "direct"), ("short", "plain"), ("eof", "direct"), ("eio", "plain"))
    for at in (2, 9)
]


def test_injected_faults_are_all_handled(reference, checkpoint, tmp_path, monkeypatch):
    model, ids, expected, original = reference
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    tried = handled = 0
    failures = []
    for loader, kind, at in STORE_FAULTS:  # the expert store (a temporary disk store) misbehaves
        faults = Faults({at: kind})

        def wrap(rt, faults=faults):
            for res in rt.resident_sets:
                res.store = FaultyStore(res.store, faults)

        config = OffloadConfig(budget=2, store="disk", async_loads=loader == "thread", load_timeout_s=TIMEOUT_S)
        ok, why = _scenario(model, ids, expected, original, config, {"wrap": wrap, "faults": faults}, None, tmp)
        tried += len(faults.injected)
        handled += len(faults.injected) if ok else 0
        if not ok or not faults.injected:
            failures.append((loader, kind, at, why if faults.injected else "never injected"))
    for loader, kind, at, method in SHARD_FAULTS:  # the checkpoint's shards misbehave under the reader
        faults = Faults({at: kind})
        reader = ShardReader(checkpoint, model, method=method)
        config = OffloadConfig(
            budget=2, store="checkpoint", async_loads=loader == "thread", load_timeout_s=TIMEOUT_S, read_method=method
        )
        with monkeypatch.context() as m:

            def wrap(rt, m=m, faults=faults):
                m.setattr(range_read.os, "preadv", faulty_preadv(faults))

            install = {"wrap": wrap, "faults": faults, "reader": reader}
            ok, why = _scenario(model, ids, expected, original, config, install, "model.safetensors", tmp)
        reader.close()
        tried += len(faults.injected)
        handled += len(faults.injected) if ok else 0
        if not ok or not faults.injected:
            failures.append((loader, kind, at, method, why if faults.injected else "never injected"))
    print(f"fault injection: {tried} faults injected, {handled} handled")
    assert not failures, failures
    assert tried == handled == len(STORE_FAULTS) + len(SHARD_FAULTS)


def test_stalled_read_under_the_thread_loader_times_out_with_a_clear_error(reference, tmp_path, monkeypatch):
    model, ids, expected, _ = reference
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    faults = Faults({1: "hang"})
    config = OffloadConfig(budget=2, store="disk", async_loads=True, load_timeout_s=TIMEOUT_S)
    with offload(model, config) as rt:
        for res in rt.resident_sets:
            res.store = FaultyStore(res.store, faults)
        t0 = time.perf_counter()
        with pytest.raises(ExpertStoreError, match=rf"expert \d+: the load did not finish within {TIMEOUT_S:g} s"):
            greedy(model, ids)
        assert time.perf_counter() - t0 < HANG_S  # the run did not wait for the stalled read
        faults.hang_over.wait(HANG_S + 5)
        assert torch.equal(greedy(model, ids), expected)


SIGNALS = {"SIGTERM": (143, -15), "SIGHUP": (129, -1), "SIGINT": (130, 1)}


def _default_signals() -> None:
    """The child starts with SIGHUP and SIGINT at their defaults, as from a terminal (under nohup, or
    a CI runner without a terminal, they may start ignored, and moectl leaves an ignored signal alone)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_signals_mid_run_leave_nothing_in_the_temp_folder(tmp_path):
    """SIGTERM / SIGHUP / SIGINT to ``moectl serve-offload tiny:olmoe`` once its temporary expert
    store exists: the process leaves (exit 128 + signal; SIGINT: click's abort) and removes it."""
    runs = {}
    for name in SIGNALS:
        tmp = tmp_path / name
        tmp.mkdir()
        env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "moectl", "serve-offload", "tiny:olmoe", "--budget", "2", "--max-new-tokens", "900"]  # within the 1,024-token context
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals
        )
        runs[name] = (proc, tmp)
    deadline = time.monotonic() + 120
    pending = dict(runs)
    while pending and time.monotonic() < deadline:
        for name, (proc, tmp) in list(pending.items()):
            if proc.poll() is not None:
                pytest.fail(f"{name}: serve-offload ended before the signal: {proc.stderr.read()[-2000:]}")
            if any(tmp.glob("moectl-experts-*/manifest.json")):
                time.sleep(0.3)  # into generation
                proc.send_signal(getattr(signal, name))
                del pending[name]
        time.sleep(0.05)
    assert not pending, f"no temporary store appeared for {sorted(pending)}"
    for name, (proc, tmp) in runs.items():
        _, err = proc.communicate(timeout=60)
        assert proc.returncode in SIGNALS[name], (name, proc.returncode, err[-2000:])
        assert "Traceback" not in err, err[-2000:]
        left = [p for p in tmp.rglob("*") if p.is_file() or p.name.startswith("moectl")]
        assert left == [], (name, left)
