"""The CUDA paths of docs/gpu.md ("What has never run on a GPU"), each against a CPU / float32 reference.

Skipped without CUDA. ``MOECTL_CUDA_TESTS_DEVICE=cpu`` runs them on the CPU instead (to check their
logic on a machine without a GPU): the paths that exist only on CUDA (pinned buffers, side streams,
events) then take their CPU branch, and the few checks that only mean something on CUDA are skipped
with a reason. One test (or a small group) per path:

1. bf16 autocast training: grouped experts, fused cross-entropy, fused AdamW (``moectl.train``);
2. trace recording's pinned ``non_blocking`` copies and events (``routing/trace.py``);
3. offloading: loads on a side stream from pinned memory, prefetch, event-timed forwards (``offload/``);
4. int8 resident slots (``--slot-dtype int8``);
5. ``ShardReader`` reading into device slots, a lazy checkpoint served on the device (``io/shards.py``);
6. RoE span scoring, ``moectl roe score`` / ``bench`` with ``--device``;
7. options (controller) training on the device;
8. the engine: batches equal solo runs and ``model.generate``, routings, rows joining and leaving, offload;
9. ``moectl serve --device``: a completion and a streamed chat completion;
10. ``--device-map auto``, and a map split between the GPU and the CPU (CUDA only).

Tiny built-in models only (no models/ folder, no lm-eval, no datasets); the file needs no conftest
fixture (``--noconftest`` works). Float32 matmuls on CUDA without TF32, so greedy tokens are compared
exactly; bf16 paths are compared within bf16 tolerances.
"""

from __future__ import annotations

import copy
import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

import moectl
from _serve_helpers import greedy, prompt

_MODE = os.environ.get("MOECTL_CUDA_TESTS_DEVICE", "").strip().lower()
if _MODE not in ("", "cpu", "cuda"):
    raise ValueError(f"MOECTL_CUDA_TESTS_DEVICE must be cpu or cuda, got {_MODE!r}")
DEV: torch.device | None
if _MODE == "cpu":
    DEV = torch.device("cpu")
elif torch.cuda.is_available():
    DEV = torch.device("cuda")
else:
    DEV = None
CUDA = DEV is not None and DEV.type == "cuda"

pytestmark = pytest.mark.skipif(
    DEV is None, reason="needs a CUDA device (MOECTL_CUDA_TESTS_DEVICE=cpu runs these tests on the CPU)"
)
cuda_only = pytest.mark.skipif(not CUDA, reason="a CUDA-only path: nothing to check on the CPU")

if CUDA:  # float32 means float32: greedy tokens on the GPU are compared with exact equality
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

MICRO_MODEL = {  # tests/test_train.py's micro pretraining model
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "intermediate_size": 64,
}
SPECIAL = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
PROMPTS = [
    "The history of the city of",
    "def f(x):",
    "2 + 2 = 4, and 3 + 3 = 6, and so on for a while longer than the others",
    "a",
    "Photosynthesis converts",
]
MASK = {"type": "expert_mask", "experts": {"0": [0, 1, 2, 3], "2": [4, 5, 6, 7]}}


def _dev(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` on the device under test (the original stays on the CPU)."""
    return copy.deepcopy(model).to(DEV)


def _same_choices(got: torch.Tensor, want: torch.Tensor, probs: torch.Tensor, tie: float = 1e-4) -> None:
    """Top-k choices [B, T, k] equal as sets, except where the reference ``probs`` [B, T, E] have a
    near-tie at the k-th place (float32 noise on another device may order such experts either way)."""
    got, want, probs = got.cpu(), want.cpu(), probs.float().cpu()
    differ = (got.sort(-1).values != want.sort(-1).values).any(-1)
    if bool(differ.any()):
        k = want.shape[-1]
        top = probs.topk(min(k + 1, probs.shape[-1]), dim=-1).values
        gap = top[..., k - 1] - top[..., k]
        assert bool((gap[differ] < tie).all()), (
            f"choices differ without a near-tie at {differ.nonzero().tolist()}"
        )


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ in float64 on the CPU."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few documents of every domain of the shipped sample (tests/conftest.py's corpus)."""
    from moectl.data.sample import load_sample_corpus

    root = tmp_path_factory.mktemp("corpus")
    for split, docs in load_sample_corpus().items():
        keep, seen = [], {}
        for doc in docs:
            if seen.get(doc["domain"], 0) < (6 if split == "train" else 2):
                seen[doc["domain"]] = seen.get(doc["domain"], 0) + 1
                keep.append({**doc, "text": doc["text"][:3000]})
        (root / f"{split}.jsonl").write_text("\n".join(json.dumps(d) for d in keep))
    return root


# -- 1. bf16 autocast training: grouped experts, fused cross-entropy, fused AdamW ------------------------
def _train_model(seed: int = 0):
    from moectl.train.model import build_model
    from moectl.train.train_config import TrainConfig

    return build_model(TrainConfig.from_preset("tiny", out="x").model_kwargs(), 300, SPECIAL, seed)


def test_grouped_experts_under_bf16_autocast_match_float32_eager():
    """grouped_mm over bf16 casts of float32 master weights (grouped_experts.py) ≈ the float32 eager
    experts on the CPU, forward and gradients (bf16 tolerance); the gradients reach the fp32 masters."""
    from moectl.models.grouped_experts import grouped_experts_forward

    model = _train_model()
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(1)
    x = torch.randn(67, model.config.hidden_size, generator=g)
    idx = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(67)])
    w = torch.rand(67, 2, generator=g)
    model.set_experts_implementation("eager")
    ref = experts(x, idx, w)
    ref.square().sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in experts.named_parameters()}
    on_dev = _dev(experts)
    on_dev.zero_grad(set_to_none=True)
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        out = grouped_experts_forward(on_dev, x.to(DEV), idx.to(DEV), w.to(DEV))
    assert out.dtype == torch.float32 and out.device.type == DEV.type
    out.square().sum().backward()
    assert _rel_err(out, ref) < 2e-2
    for name, p in on_dev.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert _rel_err(p.grad, ref_grads[name]) < 5e-2, name


def test_fused_cross_entropy_on_device_equals_the_float64_reference():
    """linear_cross_entropy in row chunks on the device: loss and gradients = F.cross_entropy in float64
    (float32 precision); under bf16 autocast's compute dtype within bf16's."""
    from moectl.train.fused_ce import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(150, 32, dtype=torch.float64, generator=g)
    weight = torch.randn(300, 32, dtype=torch.float64, generator=g)
    targets = torch.randint(0, 300, (150,), generator=g)
    targets[[3, 17, 99]] = -100
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h64 @ w64.T, targets)
    (2.5 * ref).backward()
    for compute, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        h = hidden.float().to(DEV).requires_grad_()
        w = weight.float().to(DEV).requires_grad_()
        loss = linear_cross_entropy(h, w, targets.to(DEV), chunk=64, compute_dtype=compute)
        (2.5 * loss).backward()
        assert loss.device.type == DEV.type
        assert loss.item() == pytest.approx(ref.item(), rel=tol), compute
        assert _rel_err(h.grad, h64.grad) < 10 * tol, compute
        assert _rel_err(w.grad, w64.grad) < 10 * tol, compute


def test_fused_adamw_on_device_equals_the_cpu_step():
    """AdamW(fused=True) on the device (CUDA's fused kernel) = the CPU's fused step, several steps."""
    g = torch.Generator().manual_seed(3)
    start = [torch.randn(40, 24, generator=g), torch.randn(24, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) for p in start] for _ in range(4)]
    results = []
    for device in (torch.device("cpu"), DEV):
        params = [torch.nn.Parameter(p.clone().to(device)) for p in start]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
        for step in grads:
            for p, grad in zip(params, step, strict=True):
                p.grad = grad.to(device)
            opt.step()
        results.append([p.detach().cpu() for p in params])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_bf16_training_steps_on_device_match_cpu_float32_and_lower_the_loss(tmp_path, corpus):
    """The Trainer (accelerate bf16 autocast on the device it finds, grouped experts, fused CE, fused
    AdamW): step 0's cross-entropy = the float32 CPU loss of the same batch (bf16 tolerance); eight
    steps stay finite and lower it."""
    from moectl.train.loop import Trainer
    from moectl.train.objective import NextTokenLoss
    from moectl.train.train_config import TrainConfig

    if not CUDA and torch.cuda.is_available():
        pytest.skip("the Trainer trains on the GPU whenever one is visible")
    config = TrainConfig(
        out=str(tmp_path / "run"), corpus=str(corpus), seq_len=64, micro_batch=4, max_steps=8,
        warmup_steps=1, log_every=1, checkpoint_every=0, model=MICRO_MODEL, final_eval_batches=0, lr=3e-3,
    )  # fmt: skip
    assert config.bf16 and config.fused_ce and config.fused_adamw
    assert config.experts_implementation == "moectl_grouped"
    trainer = Trainer(config, progress=False)
    assert trainer.accelerator.device.type == DEV.type
    assert all(p.device.type == DEV.type for p in trainer.raw_model.parameters())
    reference = copy.deepcopy(trainer.raw_model).float().cpu()
    reference.set_experts_implementation("eager")
    ids = trainer._micro_batches(0)[0]["input_ids"]
    with torch.no_grad():
        want = float(NextTokenLoss(reference, fused=False)(ids))
    rows = [trainer.train_step(step) for step in range(8)]
    assert rows[0]["ce"] == pytest.approx(want, rel=3e-2)
    for row in rows:
        assert all(math.isfinite(row[k]) for k in ("loss", "ce", "lb", "z", "grad_norm")), row
    assert rows[-1]["ce"] < rows[0]["ce"] - 0.2, [r["ce"] for r in rows]
    assert all(p.dtype == torch.float32 for p in trainer.raw_model.parameters())  # masters stay fp32


def test_pretrain_speed_kernel_split_on_device(tmp_path, corpus):
    """``benchmarks/pretrain.py --speed``'s kernel split (train/speed.py): on CUDA the profiler's device
    time of the matmul kernels; the parts add up to the step and the MFU ceiling bounds the MFU."""
    from moectl.train.speed import measure_training
    from moectl.train.train_config import TrainConfig

    if not CUDA and torch.cuda.is_available():
        pytest.skip("the Trainer trains on the GPU whenever one is visible")
    config = TrainConfig(
        out=str(tmp_path / "run"), corpus=str(corpus), seq_len=64, micro_batch=2, max_steps=10,
        warmup_steps=1, checkpoint_every=100, log_every=1, model=MICRO_MODEL, final_eval_batches=1,
    )  # fmt: skip
    result = measure_training(config, steps=2, warmup=1, breakdown=True)
    k = result["kernels"]
    assert k["matmul_s"] > 0 and k["attention_s"] >= 0 and k["other_s"] >= 0, k
    assert k["matmul_s"] + k["attention_s"] + k["other_s"] == pytest.approx(k["step_s"])
    assert result["mfu_ceiling"] > result["mfu_bf16"] * result["step_s"] / k["step_s"] * 0.999
    assert result["matmul_flops"] > 0 and math.isfinite(result["tokens_per_s"])


# -- 2. trace recording: pinned non_blocking copies and events -------------------------------------------
def _recorded(model, ids: torch.Tensor, policy):
    from moectl.routing import route

    with torch.no_grad(), route(model, policy, record=True) as session:
        model(ids)  # a call of its own: one segment
        out = greedy(model, ids, 8)  # prefill + 7 decoding steps appended along time
    return out, session.trace


def test_trace_recorded_on_device_equals_the_cpu_trace(monkeypatch):
    """A trace recorded from the device (host copies through pinned buffers, complete after the events)
    = the CPU model's trace (tokens, valid, allowed exactly; probs within float32; chosen equal where
    no near-tie) and = the same run on the device with plain synchronous copies (within the float noise
    of CUDA's atomic adds in the eager experts: a copy read before it landed would be far off)."""
    import moectl.routing.trace as trace_module
    from moectl.routing import ExpertMask

    model = moectl.tiny("olmoe")
    info = moectl.inspect(model)
    mask = ExpertMask.from_lists(info, {1: [0, 2, 5, 6]})
    ids = torch.randint(3, 250, (3, 9), generator=torch.Generator().manual_seed(4))
    out_cpu, cpu = _recorded(model, ids, mask)
    on_dev = _dev(model)
    out_dev, dev = _recorded(on_dev, ids.to(DEV), mask)
    with monkeypatch.context() as m:
        m.setattr(trace_module, "_to_host", lambda tensors: [t.detach().cpu() for t in tensors])
        _, sync = _recorded(on_dev, ids.to(DEV), mask)
    assert torch.equal(out_dev.cpu(), out_cpu)
    assert dev.valid.device.type == "cpu" and torch.equal(dev.valid, cpu.valid)
    assert torch.equal(dev.prompt_len, cpu.prompt_len)
    assert sorted(dev.allowed) == [1] and torch.equal(dev.allowed[1], cpu.allowed[1])
    assert sorted(dev.chosen) == sorted(cpu.chosen) == list(range(info.num_moe_layers))
    for layer in cpu.chosen:
        assert dev.chosen[layer].device.type == "cpu"
        assert dev.chosen[layer].shape == cpu.chosen[layer].shape == sync.chosen[layer].shape
        torch.testing.assert_close(dev.probs[layer], sync.probs[layer], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(dev.probs[layer].float(), cpu.probs[layer].float(), atol=1e-5, rtol=1e-4)
        valid = cpu.valid
        _same_choices(dev.chosen[layer][valid], sync.chosen[layer][valid], sync.probs[layer][valid])
        _same_choices(dev.chosen[layer][valid], cpu.chosen[layer][valid], cpu.probs[layer][valid])
        assert bool((dev.chosen[layer][~valid] == -1).all())  # padding after the shorter segment
    assert torch.equal(dev.valid, sync.valid)


# -- 3. offloading: side-stream loads from pinned memory, prefetch, event-timed forwards ------------------
COUNTS = ("loads", "bytes_moved", "hits", "misses", "prefetch_loads", "prefetch_hits", "prefetch_wasted")


@pytest.mark.parametrize("store", ["host", "disk"])
def test_offloaded_generation_on_device_equals_the_resident_model(store, tmp_path):
    """Greedy tokens under a budget (async loads + prefetch; on CUDA the defaults: the cuda-stream
    loader on a side stream) = the resident model's on the device; the synchronous loader moves the same
    experts; counters consistent, stall within load time, forwards timed; weights restored after."""
    from moectl.offload import offload

    model = _dev(moectl.tiny("olmoe"))
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = prompt().to(DEV)
    reference = greedy(model, ids, 16)
    totals, events = {}, {}
    for async_loads in (False, True):
        with offload(
            model, 5, "option:3", store=store, store_dir=tmp_path / str(async_loads),
            async_loads=async_loads, prefetch=True,
        ) as rt:  # fmt: skip
            expected = ("cuda-stream" if CUDA else "thread") if async_loads else "sync"
            assert rt.loader_name == expected and rt.prefetch
            if CUDA and async_loads:
                assert all(r.loader.stream != torch.cuda.current_stream() for r in rt.resident_sets)
                assert all(s.device.type == "cuda" for r in rt.resident_sets for s in r.slots.values())
            out = greedy(model, ids, 16)
            totals[async_loads], events[async_loads] = rt.totals(), rt.events()
        assert torch.equal(out, reference), async_loads
        t = totals[async_loads]
        assert t["loads"] > 0 and t["hits"] > 0 and t["misses"] > 0 and t["compute_s"] > 0
        assert t["prefetch_hits"] + t["prefetch_wasted"] + t["prefetch_unused"] == t["prefetch_loads"]
        assert t["load_s"] > 0 and 0 <= t["stall_s"] <= t["load_s"] * (1 + 1e-6) + 1e-9
        if not async_loads:
            assert t["stall_s"] == pytest.approx(t["load_s"])
    assert {k: totals[False][k] for k in COUNTS} == {k: totals[True][k] for k in COUNTS}
    assert events[False] == events[True] and totals[True]["prefetch_loads"] > 0
    for name, p in model.named_parameters():
        assert p.device.type == DEV.type and torch.equal(p, original[name]), name


@cuda_only
def test_cuda_defaults_are_async_loads_with_prefetch_from_pinned_host_memory():
    """On CUDA ``offload`` defaults to the cuda-stream loader and prefetch; the host store is pinned."""
    from moectl.offload import offload

    model = _dev(moectl.tiny("olmoe"))
    ids = prompt().to(DEV)
    reference = greedy(model, ids, 8)
    with offload(model, 4, "lru", store="host") as rt:
        assert rt.async_loads and rt.prefetch and rt.loader_name == "cuda-stream"
        out = greedy(model, ids, 8)
        totals = rt.totals()
    assert torch.equal(out, reference)
    assert totals["loads"] > 0 and totals["compute_s"] > 0


# -- 4. int8 resident slots -----------------------------------------------------------------------------
def _dequantised_copy(model):
    """``model`` with every expert weight replaced by its int8 round trip (tests/test_serve_int8.py)."""
    from moectl.offload.int8 import dequantize_rows, quantize_rows

    model = copy.deepcopy(model)
    with torch.no_grad():
        for layer in moectl.inspect(model).layers:
            for p in layer.block.experts.parameters(recurse=False):
                if p.dim() == 3:
                    p.copy_(dequantize_rows(*quantize_rows(p)))
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "width"), [(1, 64), (3, 2048), (5, 48), (40, 64)])
def test_int8_linear_on_device_equals_the_dequantised_product(dtype, rows, width):
    from moectl.offload.int8 import dequantize_rows, int8_linear, quantize_rows

    g = torch.Generator().manual_seed(width + rows)
    x = torch.randn(rows, width, generator=g).to(dtype)
    q, scale = quantize_rows(torch.randn(96, width, generator=g).to(dtype))
    out = int8_linear(x.to(DEV), q.to(DEV), scale.to(DEV))
    reference = x.double() @ dequantize_rows(q.double(), scale.double()).T
    magnitude = x.double().abs() @ dequantize_rows(q.double(), scale.double()).abs().T
    assert out.dtype == dtype and out.device.type == DEV.type
    eps = torch.finfo(dtype).eps
    assert ((out.cpu().double() - reference).abs() <= 4 * eps * magnitude + 1e-6).all()


@pytest.mark.parametrize(("family", "budget", "length"), [("olmoe", 3, 6), ("qwen2_moe", 2, 24)])
def test_int8_slots_on_device_compute_the_dequantised_model(family, budget, length):
    """int8 slots on the device (grouped forward; a prefill wider than the budget: the eager loop) give
    the tokens and logits of the model whose expert weights were quantised and dequantised."""
    from moectl.offload import OffloadConfig, offload

    cpu_model = moectl.tiny(family)
    reference_model = _dequantised_copy(cpu_model).to(DEV)
    model = _dev(cpu_model)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = prompt(3, length=length).to(DEV)
    reference = greedy(reference_model, ids)
    with torch.no_grad():
        reference_logits = reference_model(reference).logits
    with offload(model, OffloadConfig(budget=budget, store="host", slot_dtype="int8")) as rt:
        tokens = greedy(model, ids)
        with torch.no_grad():
            logits = model(reference).logits
        int8 = [t for r in rt.resident_sets for t in r.slots.values() if t.dtype == torch.int8]
        assert int8 and all(t.device.type == DEV.type for t in int8)
    assert torch.equal(tokens, reference)
    torch.testing.assert_close(logits, reference_logits, rtol=1e-4, atol=1e-4)
    for name, p in model.named_parameters():
        assert torch.equal(p, original[name]), name


# -- 5. ShardReader into device slots; a lazy checkpoint served on the device ----------------------------
SHAPE = "shape:olmoe-1b-7b@2~w64"  # 2 MoE layers, 64 experts, top-8, full vocabulary, narrow


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from moectl.models.shapes import make_checkpoint

    out = tmp_path_factory.mktemp("cuda-shards") / "olmoe"
    make_checkpoint(SHAPE, out, max_shard_bytes=2_000_000)
    return out


def test_shard_reader_fills_device_slots_in_place(ckpt):
    """read_expert into slots on the device (same dtype, float32: cast on the way) = the CPU read."""
    from moectl.models.lazy import checkpoint_reader

    reader = checkpoint_reader(ckpt)
    try:
        want = reader.read_expert(1, 37)
        for dtype in (None, torch.float32):
            slot = reader.empty_expert(1, dtype=dtype, device=DEV)
            pointers = {k: t.data_ptr() for k, t in slot.items()}
            got = reader.read_expert(1, 37, out=slot)
            assert all(got[k] is slot[k] and slot[k].data_ptr() == pointers[k] for k in slot)
            for name, tensor in want.items():
                assert slot[name].device.type == DEV.type
                assert torch.equal(slot[name].cpu(), tensor.to(slot[name].dtype)), (name, dtype)
        name = next(n for n in reader.map.sources if not reader.is_expert(n))  # a dense tensor
        plain = reader.read_tensor(name)
        out = torch.empty(plain.shape, dtype=plain.dtype, device=DEV)
        reader.read_tensor(name, out=out)
        assert torch.equal(out.cpu(), plain)
    finally:
        reader.close()


@pytest.mark.parametrize(("budget", "async_loads"), [(8, False), (12, None)])
def test_lazy_checkpoint_served_on_device_equals_the_loaded_model(ckpt, budget, async_loads):
    """Experts never loaded (meta), read from the shards into device slots on demand = the whole model
    loaded on the device; only the loaded experts were read."""
    from moectl.models.lazy import load_skeleton
    from moectl.models.load_lazy import load_lazy
    from moectl.offload import OffloadConfig, offload

    ids = torch.randint(3, 250, (1, 7), generator=torch.Generator().manual_seed(1))
    full, _ = load_skeleton(ckpt, load_experts=True, device=DEV)
    full.set_experts_implementation("eager")
    reference = greedy(full, ids.to(DEV), n=6)
    del full
    model, _, reader = load_lazy(ckpt, device=DEV.type)
    model.set_experts_implementation("eager")
    try:
        assert all(p.is_meta for n, p in model.named_parameters() if ".experts." in n)
        assert all(p.device.type == DEV.type for n, p in model.named_parameters() if ".experts." not in n)
        before = reader.stats.bytes
        with offload(model, OffloadConfig(budget, "lru", async_loads=async_loads), reader=reader) as rt:
            assert rt.store_kind == "checkpoint" and rt.lazy
            out = greedy(model, ids.to(DEV), n=6)
            totals = rt.totals()
        assert torch.equal(out, reference)
        assert reader.stats.bytes - before == totals["loads"] * totals["expert_bytes"][0]
    finally:
        reader.close()


# -- 6. RoE span scoring and the roe verbs on the device ---------------------------------------------
def _roe_batch():
    from moectl.models.load import ByteTokenizer
    from moectl.roe.score import pad_left, scored_request

    tok = ByteTokenizer()
    texts = ["The quick brown fox jumps.", "Hello there", "Experts route."]
    seqs = [scored_request(tok, "", t, 512) for t in texts] + [scored_request(tok, "Q: hi", " A: yes", 512)]
    return pad_left(seqs, 0, torch.device("cpu"))


@pytest.mark.parametrize("aggregation", ["prob_mean", "logprob_mean"])
def test_roe_token_logprobs_on_device_equal_the_cpu(aggregation):
    """Parallel (two-forward) and stepwise RoE scoring on the device = parallel scoring on the CPU."""
    from moectl.models.load import load_model
    from moectl.roe import RoEConfig, token_logprobs

    model, _ = load_model("tiny:olmoe")
    ids, mask, scored = _roe_batch()
    config = RoEConfig(K=4, tau=0.5, seed=2, aggregation=aggregation)
    want = token_logprobs(model, ids, mask, scored, config, method="parallel")
    on_dev = _dev(model)
    for method in ("parallel", "stepwise"):
        got = token_logprobs(on_dev, ids.to(DEV), mask.to(DEV), scored.to(DEV), config, method=method)
        assert got.device.type == DEV.type
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=0)


def test_roe_score_and_choices_on_device_equal_the_cpu():
    """score(): perplexity and multiple-choice predictions the same on the device as on the CPU."""
    from moectl.models.load import load_model
    from moectl.roe import RoEConfig, score
    from moectl.roe.score_data import ChoiceItem, LMItem

    model, tok = load_model("tiny:olmoe")
    config = RoEConfig(K=4, tau=0.3, seed=1)
    items = [LMItem("", t) for t in ("The quick brown fox.", "Hello there.", "abc abc abc")]
    choices = [ChoiceItem("The answer is", [" yes", " no", " maybe"], 0), ChoiceItem("2+2=", ["4", "5"], 0)]
    on_dev = _dev(model)
    for data in (items, choices):
        want, got = score(model, tok, data, config), score(on_dev, tok, data, config)
        assert got.tokens == want.tokens
        if data is items:
            assert got.ppl == pytest.approx(want.ppl, rel=1e-4)
        else:
            assert got.predictions == want.predictions


def test_roe_verbs_with_device(tmp_path):
    """``moectl roe score --device`` = ``--device cpu``; ``roe bench --device`` measures (CUDA: memory by
    torch.cuda.max_memory_allocated)."""
    from typer.testing import CliRunner

    from moectl.cli import app

    val = tmp_path / "val.jsonl"
    val.write_text("\n".join(json.dumps({"text": t}) for t in ["The quick brown fox.", "Hello there."]))
    reports = {}
    for device in ("cpu", DEV.type):
        out = tmp_path / f"{device}.json"
        args = ["roe", "score", "tiny:olmoe", "--k", "4", "--tau", "0.5", "--data", str(val)]
        result = CliRunner().invoke(app, [*args, "--device", device, "--json", str(out)])
        assert result.exit_code == 0, result.output
        reports[device] = json.loads(out.read_text())["results"]
    for name, row in reports["cpu"].items():
        assert reports[DEV.type][name]["ppl"] == pytest.approx(row["ppl"], rel=1e-4), name
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        app,
        [
            "roe", "bench", "tiny:olmoe", "--k", "1,4", "--variants", "clean", "--prompt-tokens", "16",
            "--new-tokens", "3", "--repeats", "1", "--device", DEV.type, "--json", str(out),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    bench = json.loads(out.read_text())
    assert DEV.type in json.dumps(bench)
    assert all(r["kv_cache_bytes"] > 0 for r in bench["rows"])
    if CUDA:
        assert "max_memory_allocated" in json.dumps(bench)


# -- 7. options (controller) training on the device ------------------------------------------------------
def _betas(model, info, controller, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    from moectl.options.policy import ControllerPolicy

    policy = ControllerPolicy(controller, record=True)
    with torch.no_grad(), moectl.route(model, policy, info=info):
        model(input_ids=ids)
    return {layer: r.beta.detach().float().cpu() for layer, r in policy.layer_records().items()}


def test_options_training_steps_on_device(tmp_path):
    """Two options-training steps on the device (rollouts, teacher, LoRA + router, controller): finite
    statistics, the controller on the device and moved; then the trained controller and model give the
    same switch probabilities on the device as copies of them on the CPU."""
    from moectl.models.load import load_model
    from moectl.options.trainer import OptionsConfig, OptionsTrainer

    model, tok = load_model("tiny:olmoe", device=DEV.type)
    cfg = OptionsConfig(
        k_hat=4, eta=0.5, steps=2, batch_size=2, max_new_tokens=6, lora_r=4, lora_alpha=4, save_every=100
    )
    prompts = ["hello world", "the cat sat on the", "def f(x):", "Once upon a time"]
    trainer = OptionsTrainer(model, tok, prompts, cfg, tmp_path)
    assert all(p.device.type == DEV.type for p in trainer.controller.parameters())
    before = {n: p.detach().clone() for n, p in trainer.controller.named_parameters()}
    rows = [trainer.train_step() for _ in range(cfg.steps)]
    for row in rows:
        for key in ("controller_loss", "reward", "switch_rate", "switch_prob_mean"):
            assert key in row and math.isfinite(float(row[key])), (key, row)
    moved = [n for n, p in trainer.controller.named_parameters() if not torch.equal(p, before[n])]
    assert moved
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    got = _betas(trainer.model, trainer.info, trainer.controller, ids.to(DEV))
    cpu_model, cpu_ctrl = copy.deepcopy(trainer.model).cpu(), copy.deepcopy(trainer.controller).cpu()
    want = _betas(cpu_model, moectl.inspect(cpu_model), cpu_ctrl, ids)
    assert sorted(got) == sorted(want)
    for layer in want:  # float32 on an H200 against the CPU: up to 7e-3 apart on this tiny model before
        # any training as after it (the device copy against the device: 0), measured 2026-11-27
        torch.testing.assert_close(got[layer], want[layer], atol=1e-2, rtol=0)


# -- 8. the engine on the device ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded():
    model, tok, info = moectl.load("tiny:olmoe", dtype="float32", device=DEV.type)
    assert next(model.parameters()).device.type == DEV.type
    return model, tok, info


def _offline(model, tok, prompt_text: str, n: int, policies=None) -> tuple[list[int], float]:
    """Greedy ``model.generate`` on the device under ``policies``: tokens and switch rate."""
    from moectl.routing import route

    with torch.no_grad(), route(model, policies or [], record=True) as session:
        enc = {k: v.to(DEV) for k, v in tok([prompt_text], return_tensors="pt").items()}
        out = model.generate(
            **enc, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None
        )
    return out[0, enc["input_ids"].shape[1] :].tolist(), moectl.switch_rate(session.trace).mean


def test_engine_batches_on_device_equal_solo_generate_as_rows_join_and_leave(loaded):
    """Six prompts of different lengths through batches of 2 and 4 (rows joining and leaving: KV rows
    concatenated and dropped on the device) = ``model.generate`` of each alone on the device; a batch
    of 4 = one request at a time."""
    from moectl.engine import Engine, EngineConfig, SamplingParams

    model, tok, _ = loaded
    prompts = [*PROMPTS, "x" * 40]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    solo = [_offline(model, tok, p, 12)[0] for p in prompts]
    for max_batch in (2, 4):
        engine = Engine(model, tok, EngineConfig(max_batch=max_batch))
        got = engine.generate(prompts, params)
        assert [c.token_ids for c in got] == solo, max_batch
        assert all(c.finish_reason == "length" for c in got)
        assert engine.stats()["prefills"] == len(prompts)
    one = Engine(model, tok, EngineConfig(max_batch=1))
    assert [one.generate([p], params)[0].token_ids for p in prompts[:3]] == solo[:3]


@pytest.mark.parametrize(
    ("name", "spec"), [("mask", MASK), ("gumbel", {"type": "gumbel", "tau": 1.0, "seed": 5})]
)
def test_engine_rows_on_device_route_as_they_would_alone(loaded, name, spec):
    """Rows of one batch with a routing, another and none: each = its solo ``model.generate`` under it."""
    from moectl.engine import Engine, EngineConfig, SamplingParams

    model, tok, _ = loaded
    engine = Engine(model, tok, EngineConfig(max_batch=4), routings={name: spec, "other": MASK})
    params = SamplingParams(max_tokens=10, ignore_eos=True, seed=5)
    tokens, final, ids = {}, {}, []

    def on_event(e):
        tokens.setdefault(e.request_id, []).extend(e.token_ids)
        if e.finish_reason:
            final[e.request_id] = e

    with engine:
        for i, text in enumerate(PROMPTS[:4]):
            routing = [name, None, name, "other"][i]
            ids.append((engine.submit(text, params, routing, on_event), text, routing))
        while len(final) < len(ids):
            engine.step()
    specs = {name: spec, "other": MASK, None: None}
    for rid, text, routing in ids:
        solo, rate = _offline(model, tok, text, 10, specs[routing])
        assert tokens[rid] == solo, (routing, text)
        if name != "mask" and routing == name:
            assert final[rid].info["switch_rate"] == pytest.approx(rate)


@pytest.mark.parametrize("opaque", [False, True])
def test_engine_decodes_through_cuda_graphs_as_it_does_lean(loaded, opaque, monkeypatch):
    """The step over static buffers replayed as CUDA graphs (``moectl.lm.graph_decode``; on the CPU
    its uncaptured twin) = the lean forward: rows joining and leaving in batches of 3, a masked row
    among them; every decoding step through the graphs, several buckets captured. ``opaque``: the
    experts through ``moectl::routed_experts`` (large experts: grouped products whose counts take no
    host read), else gathered."""
    from moectl.engine import Engine, EngineConfig, SamplingParams

    if opaque:
        monkeypatch.setattr("moectl.lm.step_ops.KERNEL_BYTES", 0)
    model, tok, _ = loaded
    prompts = [*PROMPTS, "x" * 40]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    routing = [None, "mask", None, None, None][: len(prompts)]
    lean = Engine(model, tok, EngineConfig(max_batch=3), routings={"mask": MASK})
    want = [lean.generate([p], params, r)[0].token_ids for p, r in zip(prompts, routing, strict=False)]
    engine = Engine(model, tok, EngineConfig(max_batch=3, compile_decode=True, graph_decode=True),
                    routings={"mask": MASK})  # fmt: skip
    tokens: dict[str, list[int]] = {}
    with engine:
        ids = [engine.submit(p, params, r, lambda e: tokens.setdefault(e.request_id, []).extend(e.token_ids))
               for p, r in zip(prompts, routing, strict=False)]  # fmt: skip
        while engine.stats()["running"] or engine.stats()["waiting"]:
            engine.step()
        forward = engine.stats()["decode_forward"]
    assert [tokens[i] for i in ids] == want
    graphs = engine.runner.compiled
    assert graphs is not None and graphs.captured == CUDA, forward["path"]
    assert forward["compiled"] > 0 and not forward.get("slow"), forward
    assert len(graphs._graphs) > 1


def test_engine_controller_rows_and_sampling_on_device(loaded):
    """A controller routing (each request forks it) batched = solo; seeded sampling batched = solo."""
    from moectl.engine import Engine, EngineConfig, SamplingParams

    model, tok, info = loaded
    controller = moectl.options.build_controller(info, k_hat=4).to(DEV)
    policy = moectl.options.ControllerPolicy(controller, seed=0)
    engine = Engine(model, tok, EngineConfig(max_batch=3), routings={"ctrl": policy})
    got = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=10, ignore_eos=True, seed=7), "ctrl")
    for text, completion in zip(PROMPTS[:3], got, strict=True):
        assert completion.token_ids == _offline(model, tok, text, 10, [policy.fork(7)])[0], text
    engine = Engine(model, tok, EngineConfig(max_batch=4))
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    batched = [c.token_ids for c in engine.generate(PROMPTS[:4], params)]
    assert batched == [engine.generate([p], params)[0].token_ids for p in PROMPTS[:4]]


def test_engine_offloaded_on_device_equals_the_resident_model(loaded):
    """An offloaded engine batch on the device (budget 4 of 8) = the resident engine; loads = misses."""
    from moectl.engine import Engine, EngineConfig, SamplingParams
    from moectl.offload.offload_config import OffloadConfig

    model, tok, _ = loaded
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = [c.token_ids for c in Engine(model, tok).generate(PROMPTS[:4], params)]
    config = EngineConfig(max_batch=4, offload=OffloadConfig(budget=4, store="host", prefetch=False))
    engine = Engine(model, tok, config)
    with engine:
        got = [c.token_ids for c in engine.generate(PROMPTS[:4], params)]
        stats = engine.stats()["offload"]
    assert got == plain
    assert stats["hits"] + stats["misses"] > 0 and stats["loads"] == stats["misses"]
    assert all(p.device.type == DEV.type for p in model.parameters())  # restored on close


# -- 9. moectl serve --device ---------------------------------------------------------------------------
def test_serve_on_device_answers_a_completion_and_a_streamed_chat(loaded):
    """``moectl serve tiny:olmoe --device DEV`` (a subprocess, as tests/test_server_openai.py): a greedy
    completion = offline ``model.generate`` on the device; a streamed chat's chunks = the whole chat =
    the offline plain transcript's greedy text; four concurrent requests = their solo outputs."""
    for module in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx"):
        pytest.importorskip(module)
    from concurrent.futures import ThreadPoolExecutor

    from _server_helpers import Server
    from moectl.server.prompts import plain_chat

    model, tok, _ = loaded

    def offline(text: str, n: int) -> str:
        ids = torch.tensor([tok.encode(text)], device=DEV)
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                pad_token_id=0, eos_token_id=2,
            )  # fmt: skip
        return tok.decode(out[0, ids.shape[1] :].tolist())

    server = Server("--dtype", "float32", "--device", DEV.type, "--max-batch", "4")
    try:
        client = server.client()
        out = client.completions.create(model="tiny:olmoe", prompt="The expert", max_tokens=20, temperature=0)
        assert out.choices[0].text == offline("The expert", 20)
        messages = [{"role": "user", "content": "Stream this"}]
        whole = client.chat.completions.create(
            model="tiny:olmoe", messages=messages, max_tokens=16, temperature=0
        )
        assert whole.choices[0].message.content == offline(plain_chat(messages), 16)
        chunks = list(
            client.chat.completions.create(
                model="tiny:olmoe", messages=messages, max_tokens=16, temperature=0, stream=True
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        prompts = [f"prompt number {i}: " + "xyz" * (i + 1) for i in range(4)]

        def ask(text: str) -> str:
            reply = client.completions.create(model="tiny:olmoe", prompt=text, max_tokens=12, temperature=0)
            return reply.choices[0].text

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(ask, prompts)) == [offline(p, 12) for p in prompts]
    finally:
        code = server.stop()
    assert code == 0


# -- 10. --device-map -----------------------------------------------------------------------------------
def _routed(model, ids: torch.Tensor, policies):
    with torch.no_grad(), moectl.route(model, policies, record=True) as session:
        logits = model(input_ids=ids).logits
    return logits.float().cpu(), session.trace


def _device_map_checks(mapped, plain, info) -> None:
    """``mapped`` routes like ``plain`` (CPU) under a mask and under a controller; traces equal."""
    from moectl.options.controller import build_controller
    from moectl.options.policy import ControllerPolicy
    from moectl.routing import ExpertMask

    ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = ExpertMask({i: torch.tensor([True] * 4 + [False] * 4) for i in range(2)})
    controller = build_controller(info, 4)
    first = mapped.get_input_embeddings().weight.device
    cases = [
        (mask, mask),
        (
            ControllerPolicy(controller, mode="greedy"),
            ControllerPolicy(copy.deepcopy(controller).to(first), mode="greedy"),
        ),
    ]
    for want_policy, got_policy in cases:
        want, a = _routed(plain, ids, want_policy)
        got, b = _routed(mapped, ids.to(first), got_policy)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert sorted(a.chosen) == sorted(b.chosen)
        for layer, chosen in a.chosen.items():
            _same_choices(b.chosen[layer], chosen, a.probs[layer])


def test_device_map_auto_routes_like_the_plain_model():
    """``--device-map auto`` (accelerate's placement over the visible devices: the GPU here) with a
    mask and a controller: logits and traces = the plain CPU model's."""
    from moectl.models.load import load_model

    if not CUDA and torch.cuda.is_available():
        pytest.skip("a GPU is visible: auto would place the model there")
    plain, _ = load_model("tiny:olmoe")
    mapped, _ = load_model("tiny:olmoe", device="auto")
    placed = set(mapped.hf_device_map.values())
    assert placed <= ({0, "cuda:0", "cuda"} if CUDA else {"cpu"}), placed
    _device_map_checks(mapped, plain, moectl.inspect(plain))


@cuda_only
def test_device_map_split_between_the_gpu_and_the_cpu_routes_like_the_plain_model():
    """A device map that leaves later layers on the CPU (what ``--device-map auto`` gives a model larger
    than the GPU; accelerate streams those weights in): logits and traces = the plain CPU model's."""
    from accelerate import dispatch_model

    plain = moectl.tiny("olmoe")
    info = moectl.inspect(plain)
    layers = len(plain.model.layers)
    placement = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": "cpu", "lm_head": "cpu"}
    placement |= {f"model.layers.{i}": 0 if i < layers // 2 + 1 else "cpu" for i in range(layers)}
    assert {0, "cpu"} <= set(placement.values())
    mapped = dispatch_model(copy.deepcopy(plain), placement)
    _device_map_checks(mapped, plain, info)
