"""Asynchronous expert loads and prefetch: same tokens, same traffic, exact stall/prefetch accounting."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

import moectl
from _serve_helpers import greedy, prompt
from moectl.cli.serve_offload import serve_app
from moectl.models.load import load_model
from moectl.offload import ExpertStoreError, OffloadConfig, offload
from moectl.offload.cuda_loader import CudaStreamLoader
from moectl.offload.expert_loader import (
    ExpertRead,
    LoadTotals,
    SyncLoader,
    ThreadLoader,
    Ticket,
    Wait,
    make_loader,
)
from moectl.offload.prefetch import PrefetchConfig, option_prediction
from moectl.offload.residency import ControllerResidency
from moectl.options.controller import build_controller
from moectl.options.policy import ControllerPolicy
from moectl.server.offload_batch import serve_offload

torch.set_num_threads(1)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _watch_budget(rt) -> list[int]:
    """Largest resident set per layer seen after every experts forward (slots checked too)."""
    seen = [0] * len(rt.modules)

    def hook(i):
        def fn(module, args, output):
            seen[i] = max(seen[i], len(module.res.where))
            assert all(s.shape[0] == rt.budget[i] for s in module.res.slots.values())

        return fn

    for i, m in enumerate(rt.modules):
        m.register_forward_hook(hook(i))
    return seen


COUNTS = ("loads", "bytes_moved", "hits", "misses", "prefetch_loads", "prefetch_hits", "prefetch_wasted")


def _counts(totals: dict) -> dict:
    return {k: totals[k] for k in COUNTS}


@pytest.mark.parametrize(
    ("family", "policy", "budget", "store"),
    [("olmoe", "lru", 2, "disk"), ("olmoe", "option:3", 3, "host"), ("gpt_oss", "option:2", 3, "disk")],
)
def test_async_cpu_loads_equal_sync_loads(family, policy, budget, store, tmp_path):
    model = moectl.tiny(family)
    ids = prompt()
    reference = greedy(model, ids)
    runs = {}
    for async_loads in (False, True):
        with offload(
            model,
            budget,
            policy,
            store=store,
            store_dir=tmp_path / str(async_loads),
            async_loads=async_loads,
            prefetch=False,
        ) as rt:
            assert rt.loader_name == ("thread" if async_loads else "sync") and not rt.prefetch
            out = greedy(model, ids)
            runs[async_loads] = (out, rt.totals(), rt.events())
    for asyn, (out, totals, _) in runs.items():
        assert torch.equal(out, reference)
        _check_stall(totals, asyn)
        assert totals["compute_s"] > 0
    (_, sync, sync_events), (_, asyn, async_events) = runs[False], runs[True]
    assert _counts(sync) == _counts(asyn)
    assert sync_events == async_events and sync["loads"] > 0
    assert sync["stall_s"] == pytest.approx(sync["load_s"])  # synchronous: every load holds compute


def _check_stall(totals: dict, async_loads: bool) -> None:
    """Synchronous loads stall compute for all of their time; overlapped ones for at most that
    (possibly none: a load that lands before its expert is needed costs no stall)."""
    assert totals["load_s"] > 0
    if async_loads:
        assert 0 <= totals["stall_s"] <= totals["load_s"]
    else:
        assert totals["stall_s"] == pytest.approx(totals["load_s"])


def _probs(ranking: list[int], e: int = 8) -> torch.Tensor:
    """Router probabilities whose order is ``ranking`` (most probable first; the rest after it)."""
    logits = torch.full((e,), -float(e))
    logits[torch.tensor(ranking)] = -torch.arange(len(ranking), dtype=torch.float)
    return torch.softmax(logits, -1)


@pytest.mark.parametrize("async_loads", [False, True])
def test_prefetch_accounting_matches_hand_computation(async_loads):
    """option:2 (k-hat = top-k = 2), budget 4, lookahead 1, 8 experts; routing = top-2 of the ranking.

    step 1 [0 1 2 ..]: take {0,1} (load 0, 1); runner-up 2 is outside: predicted {2,0}, prefetch 2
    step 2 [0 2 1 ..]: switch to {0,2}: 2 is resident (prefetch hit); predicted {1,0}: resident
    step 3 [3 4 5 ..]: switch to {3,4}: load 3 (free slot), 4 (evicts 1); predicted {5,3}: prefetch 5
                       over the LRU evictable expert 0
    step 4 [6 7 0 ..]: switch to {6,7}: load 6 (evicts 2), 7 (evicts 5: a wasted prefetch); predicted
                       {0,6}: prefetch 0 over 3
    step 5 [0 6 7 ..]: switch to {0,6}: 0 is resident (prefetch hit); predicted {7,0}: resident
    loads 6 + 3 prefetched; accesses: hits at steps 2 and 5 (4), misses at 1, 3, 4 (6).
    """
    model = moectl.tiny("olmoe")
    layer = moectl.inspect(model).layers[0]
    reference = copy.deepcopy(layer.block.experts)
    rankings = [
        [0, 1, 2, 3, 4, 5, 6, 7],
        [0, 2, 1, 3, 4, 5, 6, 7],
        [3, 4, 5, 0, 1, 2, 6, 7],
        [6, 7, 0, 1, 2, 3, 4, 5],
        [0, 6, 7, 1, 2, 3, 4, 5],
    ]
    gen = torch.Generator().manual_seed(0)
    with offload(model, 4, "option:2", store="host", async_loads=async_loads, prefetch=True) as rt:
        experts, res = rt.modules[0], rt.modules[0].res
        for ranking in rankings:
            x = torch.randn(1, 64, generator=gen)
            idx = torch.tensor([ranking[:2]])
            w = torch.softmax(torch.randn(1, 2, generator=gen), -1)
            experts.last_probs = _probs(ranking)[None]
            assert torch.equal(experts(x, idx, w), reference(x, idx, w))
            assert len(res.where) <= 4
        s = res.stats()
        assert [e for _, e in res.events] == [0, 1, 2, 3, 4, 5, 6, 7, 0]
    assert (s["loads"], s["prefetch_loads"], s["prefetch_hits"], s["prefetch_wasted"]) == (9, 3, 2, 1)
    assert (s["prefetch_unused"], s["hits"], s["misses"]) == (0, 4, 6)
    assert s["resident"] == [0, 4, 6, 7]
    assert s["bytes_moved"] == 9 * res.expert_bytes
    _check_stall(s, async_loads)


def test_option_prediction_is_the_runner_up_rule():
    p = _probs([5, 1, 3, 0, 2, 4, 6, 7])
    assert option_prediction(p, {5, 1}, top_k=2, k_hat=2) == [3, 5]  # runner-up 3 breaks {5,1}
    assert option_prediction(p, {5, 1, 3}, top_k=2, k_hat=3) == []  # ranks 1-3 all inside
    assert option_prediction(p, {5, 1, 3}, top_k=2, k_hat=3, lookahead=2) == [0, 5, 1]
    with pytest.raises(ValueError, match="lookahead"):
        PrefetchConfig(lookahead=0)
    with pytest.raises(ValueError, match="beta"):
        PrefetchConfig(beta=1.0)


@pytest.mark.parametrize("store", ["host", "disk"])
def test_prefetch_keeps_tokens_and_budget(store, tmp_path):
    """option:3 with budget 5: two free slots take prefetches; tokens equal the in-memory model's."""
    model = moectl.tiny("olmoe")
    ids = prompt(3, length=5)
    reference = greedy(model, ids, 16)
    totals = {}
    for async_loads in (False, True):
        for prefetch in (False, True):
            with offload(
                model,
                5,
                "option:3",
                store=store,
                store_dir=tmp_path / f"{async_loads}{prefetch}",
                async_loads=async_loads,
                prefetch=prefetch,
            ) as rt:
                seen = _watch_budget(rt)
                out = greedy(model, ids, 16)
                t = totals[async_loads, prefetch] = rt.totals()
            assert torch.equal(out, reference)
            assert max(seen) <= 5
            assert t["prefetch_hits"] + t["prefetch_wasted"] + t["prefetch_unused"] == t["prefetch_loads"]
            assert t["stall_s"] <= t["load_s"]
    assert totals[False, False]["prefetch_loads"] == 0
    assert totals[False, True]["prefetch_loads"] > 0 and totals[False, True]["prefetch_hits"] > 0
    for prefetch in (False, True):  # the loader changes timing only, never what is loaded
        assert _counts(totals[False, prefetch]) == _counts(totals[True, prefetch])


def test_controller_prefetch_keeps_tokens_and_budget():
    model = moectl.tiny("qwen2_moe")
    info = moectl.inspect(model)
    ctrl = build_controller(info, 4)
    with torch.no_grad():
        for layer in ctrl.layers:
            layer.termination[-1].bias.fill_(0.5)  # β around 1/2: switches and predictions
    ids = prompt(4)
    with moectl.route(model, ControllerPolicy(ctrl, seed=3)):
        reference = greedy(model, ids, 12)
    totals = {}
    for async_loads in (False, True):
        policy = ControllerResidency(ctrl, seed=3)
        config = PrefetchConfig(beta=0.5)
        with offload(
            model, 6, policy, store="host", async_loads=async_loads, prefetch=True, prefetch_config=config
        ) as rt:
            seen = _watch_budget(rt)
            with moectl.route(model, rt.policy.routing(rt.info)):
                out = greedy(model, ids, 12)
            t = totals[async_loads] = rt.totals()
            for i, r in enumerate(rt.resident_sets):  # the option is always resident
                option = policy.route_policy.current_option[i][0].nonzero().flatten().tolist()
                assert set(option) <= set(r.resident)
        assert torch.equal(out, reference)
        assert max(seen) <= 6
        assert t["prefetch_hits"] + t["prefetch_wasted"] + t["prefetch_unused"] == t["prefetch_loads"]
    assert totals[False]["prefetch_loads"] > 0
    assert _counts(totals[False]) == _counts(totals[True])


def test_stall_is_the_overlap_of_waits_with_busy_loads():
    a = Ticket(0, 1, start=0.0, end=2.0)
    b = Ticket(0, 2, start=2.0, end=5.0, prefetch=True)
    c = Ticket(0, 3, host_s=0.5, in_forward=True)  # a synchronous load: load and stall at once
    wait = Wait([a, b], in_forward=True, blocked_s=3.5, w0=1.0, w1=4.5)  # held 1.0 .. 4.5
    assert wait.stall_s() == pytest.approx(1.0 + 2.5)
    totals = LoadTotals()
    for item in (a, b, c, wait):
        totals.add(item)
    assert totals.load_s == pytest.approx(2.0 + 3.0 + 0.5)
    assert totals.stall_s == pytest.approx(3.5 + 0.5)
    assert totals.wait_s == pytest.approx(3.5 + 0.5)
    assert totals.forward_wait_s == pytest.approx(3.5 + 0.5)
    assert totals.stall_s <= totals.load_s


class _CallStore:
    """An expert store whose load(layer, expert) calls a function (one expert per read)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def load(self, layer: int, expert: int) -> dict:
        return self.fn()


def _read(fn) -> ExpertRead:
    return ExpertRead(_CallStore(fn), 0, 0)


def test_thread_loader_orders_copies_and_reports_errors():
    loader = make_loader(torch.device("cpu"), True)
    assert isinstance(loader, ThreadLoader)
    assert isinstance(make_loader(torch.device("cpu"), False), SyncLoader)
    dst = {"w": torch.zeros(3)}
    first, second = Ticket(0, 0), Ticket(0, 1)
    loader.submit(first, _read(lambda: {"w": torch.ones(3)}), dst)
    loader.submit(second, _read(lambda: {"w": torch.full((3,), 2.0)}), dst)  # same slot: lands second
    wait = loader.wait(second, in_forward=False)
    assert torch.equal(dst["w"], torch.full((3,), 2.0))
    assert wait.tickets == [first, second] and loader.wait(first, False).tickets == []
    assert first.end <= second.start and wait.stall_s() <= first.busy_s + second.busy_s

    def broken():
        raise ExpertStoreError("checksum mismatch")

    bad = Ticket(0, 2)
    loader.submit(bad, _read(broken), dst)
    with pytest.raises(ExpertStoreError):
        loader.wait(bad, False)
    loader.drain()  # already reported at the wait
    loader.submit(Ticket(0, 3), _read(broken), dst)  # never waited on: reported by drain
    with pytest.raises(ExpertStoreError):
        loader.drain()
    loader.close()


def test_async_loads_from_a_corrupted_store_raise(tmp_path):
    model = moectl.tiny("olmoe")
    with (
        pytest.raises(ExpertStoreError),
        offload(model, 2, "lru", store="disk", store_dir=tmp_path, async_loads=True),
    ):
        for p in tmp_path.glob("layer_*.safetensors"):
            data = bytearray(p.read_bytes())
            data[len(data) // 2 :] = bytes(len(data) - len(data) // 2)
            p.write_bytes(bytes(data))
        with pytest.raises(ExpertStoreError, match="checksum mismatch"):
            model(prompt())


def test_serve_offload_and_cli_report_stall_and_prefetch(tmp_path):
    model, tok = load_model("tiny:olmoe")
    r = serve_offload(
        model,
        tok,
        ["hello world"],
        OffloadConfig(5, "option:3", "host", async_loads=True, prefetch=True),
        6,
        progress=False,
    )
    json.dumps(r)
    assert r["loader"] == "thread" and r["async_loads"] and r["prefetch"]
    assert 0 <= r["stall_s"] <= r["load_s"] and 0 <= r["load_overlap"] <= 1
    assert r["stall_s_per_token"] == pytest.approx(r["stall_s"] / 6)
    assert r["prefetch_hits"] + r["prefetch_wasted"] + r["prefetch_unused"] == r["prefetch_loads"]
    assert r["prefetch_hit_rate"] is None or 0 <= r["prefetch_hit_rate"] <= 1
    out = tmp_path / "out.json"
    args = ["--tiny", "olmoe", "--budget", "5", "--policy", "option:3", "--max-new-tokens", "3"]
    args += ["--store", "host"]
    result = CliRunner().invoke(serve_app, [*args, "--async-loads", "--prefetch", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["loader"] == "thread" and data["prefetch"] is True
    result = CliRunner().invoke(serve_app, [*args, "--json", str(out)])  # default without CUDA: sync
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["loader"] == ("cuda-stream" if torch.cuda.is_available() else "sync")
    assert data["prefetch"] is torch.cuda.is_available()
    bad = CliRunner().invoke(serve_app, [*args, "--prefetch-lookahead", "0"])
    assert bad.exit_code == 2 and "lookahead" in bad.output


def test_cuda_loader_has_the_loader_interface():
    for name in ("submit", "wait", "settled", "drain", "close"):
        assert callable(getattr(CudaStreamLoader, name))
    assert CudaStreamLoader.name == "cuda-stream"


@cuda
@pytest.mark.parametrize("store", ["host", "disk"])
def test_cuda_stream_loads_equal_sync_loads(store, tmp_path):
    model = moectl.tiny("olmoe").cuda()
    ids = prompt().cuda()
    reference = greedy(model, ids, 16)
    totals = {}
    for async_loads in (False, True):
        with offload(
            model,
            5,
            "option:3",
            store=store,
            store_dir=tmp_path / str(async_loads),
            async_loads=async_loads,
            prefetch=True,
        ) as rt:
            assert rt.loader_name == ("cuda-stream" if async_loads else "sync")
            seen = _watch_budget(rt)
            out = greedy(model, ids, 16)
            totals[async_loads] = rt.totals()
        assert torch.equal(out, reference)
        assert max(seen) <= 5
        _check_stall(totals[async_loads], async_loads)
    assert _counts(totals[False]) == _counts(totals[True])
    assert totals[True]["prefetch_loads"] > 0


@cuda
def test_cuda_default_is_async_with_prefetch():
    model = moectl.tiny("olmoe").cuda()
    with offload(model, 5, "option:3", store="host") as rt:
        assert rt.async_loads and rt.prefetch and rt.loader_name == "cuda-stream"
        assert all(r.loader.stream != torch.cuda.current_stream() for r in rt.resident_sets)
        out = greedy(model, prompt().cuda(), 4)
    assert out.shape[1] == 6 + 4
