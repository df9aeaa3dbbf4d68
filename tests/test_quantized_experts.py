"""Quantized experts at load (issue 40 item 1): int8 per output channel, int4 group-wise, PyTorch's kernels.

- the formats: a weight comes back within half a quantisation step (int8: of its row, int4: of its
  group), shapes the int4 kernel does not take are padded, and the kernel's product equals the
  dequantised weight's, for few rows (the kernel) and many (a dequantised GEMM);
- a quantized model of each family computes what the same model with the dequantised weights
  computes (tight), and stays close to the unquantized model (next-token KL below a stated bound);
- routing acts unchanged: under an expert mask the quantized experts run only allowed experts, and
  a layer whose router input is unquantized chooses exactly the unquantized model's experts;
- the engine generates from a quantized model (model.generate's greedy tokens, and a batch with a
  long prompt); the command line takes ``--quantize`` and refuses a bad value with exit code 2.
"""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

import moectl
from moectl.cli import app
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.errors import ConfigError
from moectl.lm.lm_head import vocab_size
from moectl.offload.int8 import quantize_rows
from moectl.quant import QuantizedExperts, QuantizedLinear, quantize_model, quantized_scheme
from moectl.quant import int4_groups as int4
from moectl.routing import ExpertMask, route

FAMILIES = ("olmoe", "qwen2_moe", "qwen3_moe", "mixtral")
KL_BOUND = {"int8": 1e-4, "int4": 5e-3}  # mean next-token KL (nats) to the float32 tiny model, experts scope
runner = CliRunner()
int4_dequantize = int4.dequantize


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@functools.cache
def _tiny(family: str):
    return moectl.load(f"tiny:{family}", dtype="float32")


def _ids(batch: int = 2, length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 259, (batch, length), generator=_gen(seed))


def _kl(logits: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """KL(reference || logits) of the next-token distributions, per position."""
    ref, got = reference.float().log_softmax(-1), logits.float().log_softmax(-1)
    return (ref.exp() * (ref - got)).sum(-1)


# -- the formats --------------------------------------------------------------------------------
def test_int8_rows_come_back_within_half_a_step():
    w = torch.randn(48, 80, generator=_gen()) * torch.logspace(-3, 0, 48).unsqueeze(1)  # rows of any scale
    q = moectl.quant.Int8Weights(w)
    err = (q.dequantize(dtype=torch.float32) - w).abs()
    step = w.abs().amax(1, keepdim=True) / 127
    assert bool((err <= step / 2 * (1 + 1e-5)).all())
    assert q.codes.dtype == torch.int8 and q.nbytes() == 48 * 80 + 48 * 4


@pytest.mark.parametrize(
    "n,k,group,used",
    [(64, 256, 128, 128), (32, 96, 128, 32), (259, 64, 64, 64), (40, 40, 32, 32), (16, 128, 256, 128)],
)
def test_int4_groups_come_back_within_half_a_step(n, k, group, used):
    """Asymmetric groups: |w − w'| ≤ half a step (range / 15) of the weight's group; N padded to 16,
    K to the group, the group the largest allowed one ≤ the asked one that divides K."""
    w = torch.randn(n, k, generator=_gen(1)) + torch.linspace(-2, 2, n).unsqueeze(1)  # groups off zero
    packed, scale_zero, g = int4.quantize(w, group, torch.float32)
    assert g == used and packed.shape == (-(-n // 16) * 16, -(-k // g) * g // 2)
    back = int4.dequantize(packed, scale_zero, g, n, k, torch.float32)
    padded = F.pad(w, (0, packed.shape[1] * 2 - k)).view(n, -1, g)
    step = (padded.amax(-1) - padded.amin(-1)) / 15
    err = (back - w).abs()
    bound = (step / 2).repeat_interleave(g, 1)[:, :k] * (1 + 1e-4) + 1e-6
    assert bool((err <= bound).all()), float((err - bound).max())


def test_int4_dequantize_reads_the_kernels_own_layout():
    """What :func:`int4_groups.dequantize` reads from the packed bytes is what the kernel multiplies
    (its identity product), whatever layout the packing op uses on this machine."""
    w = torch.randn(80, 128, generator=_gen(2))
    packed, scale_zero, g = int4.quantize(w, 64, torch.float32)
    eye = torch.eye(128)
    by_kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, g, scale_zero).T[:80]
    assert torch.allclose(
        int4.dequantize(packed, scale_zero, g, 80, 128, torch.float32), by_kernel, atol=1e-6
    )


@pytest.mark.parametrize("rows", [1, 5, int4.INT4_KERNEL_MAX_ROWS + 36])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_product_is_the_dequantized_weights_product(rows, dtype):
    """Few rows run the kernel, many the dequantised GEMM: both give x @ w'.T (bf16: to its rounding)."""
    w = torch.randn(96, 256, generator=_gen(3)).to(dtype)
    q = moectl.quant.Int4Weights(w, 128)
    x = torch.randn(rows, 256, generator=_gen(4)).to(dtype)
    expected = x.float() @ q.dequantize(dtype=torch.float32).T
    got = q.linear(x).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_int8_product_is_the_dequantized_weights_product():
    w = torch.randn(3, 64, 96, generator=_gen(5)).to(torch.bfloat16)
    q = moectl.quant.Int8Weights(w)
    codes, scale = quantize_rows(w[1])
    assert torch.equal(q.codes[1], codes) and torch.equal(q.scale[1], scale)
    for rows in (1, 40):  # the kernel, then a dequantised product
        x = torch.randn(rows, 96, generator=_gen(6)).to(torch.bfloat16)
        expected = x.float() @ q.dequantize(1, torch.float32).T
        assert torch.allclose(
            q.linear(x, 1).float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item()
        )


# -- models -------------------------------------------------------------------------------------
def _dequantized_twin(original, quantized) -> torch.nn.Module:
    """``original`` with every weight ``quantized`` replaced set to its dequantised value."""
    twin = copy.deepcopy(original)
    for name, module in quantized.named_modules():
        if isinstance(module, QuantizedExperts):
            experts = twin.get_submodule(name)
            for e in range(module.num_experts):
                gate_up, down = module.dequantized(e)
                experts.gate_up_proj.data[e] = gate_up.to(experts.gate_up_proj.dtype)
                experts.down_proj.data[e] = down.to(experts.down_proj.dtype)
        elif isinstance(module, QuantizedLinear):
            twin.get_submodule(name).weight.data = module.dequantized()
    return twin


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_quantized_model_computes_its_dequantized_weights(family, scheme):
    """Tight: the quantized model's logits are the dequantised-weight model's (float32, only the
    order of sums differs). Loose: the next-token KL to the unquantized model is below KL_BOUND."""
    original, _, _ = _tiny(family)
    model = copy.deepcopy(original)
    summary = quantize_model(model, scheme)
    assert summary.experts_modules == 3 and quantized_scheme(model) == scheme
    assert summary.quantized_bytes_after < summary.quantized_bytes_before
    twin = _dequantized_twin(original, model)
    ids = _ids()
    logits, expected, reference = model(ids).logits, twin(ids).logits, original(ids).logits
    assert torch.allclose(logits, expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-4)
    assert not torch.equal(logits, reference)  # the weights did change
    assert _kl(logits, reference).mean() < KL_BOUND[scheme]


@torch.no_grad()
def test_scope_all_quantizes_every_linear_but_routers_and_gates():
    original, _, info = _tiny("qwen2_moe")
    model = copy.deepcopy(original)
    summary = quantize_model(model, "int4", group_size=64, scope="all")
    routers = [type(layer.router) for layer in moectl.inspect(model).layers]
    assert routers == [type(layer.router) for layer in info.layers]  # the routers are the model's own
    assert all(
        type(m) is not torch.nn.Linear or n.endswith("shared_expert_gate") for n, m in model.named_modules()
    )
    assert isinstance(model.lm_head, QuantizedLinear) and vocab_size(model) == original.lm_head.out_features
    assert summary.linear_modules == 3 * (4 + 3) + 1  # attention q/k/v/o, shared expert's 3, LM head
    kl = _kl(model(_ids()).logits, original(_ids()).logits).mean()
    assert kl < 4 * KL_BOUND["int4"]


@torch.no_grad()
def test_the_reference_model_at_int4_stays_close(tmp_path):
    """A model with learned bf16 weights: the int4 model's next-token KL on English text (this file's
    docstring) stays below 0.03 nats per token (measured 0.004 at group 64)."""
    model, tok, _ = moectl.load("models/moectl-small-standard")
    ids = torch.tensor([tok(__doc__)["input_ids"][:192]])
    reference = model(ids).logits
    summary = quantize_model(model, "int4")
    assert summary.model_bytes_after < 0.45 * summary.model_bytes_before
    assert _kl(model(ids).logits, reference).mean() < 0.03


# -- routing and generation ---------------------------------------------------------------------
@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
@torch.no_grad()
def test_an_expert_mask_acts_on_a_quantized_model(family):
    original, _, info = _tiny(family)
    model = copy.deepcopy(original)
    quantize_model(model, "int4")
    keep = {0: [1, 2, 5], 2: [0, 3, 4, 7]}
    ran: dict[int, list[torch.Tensor]] = {}
    qinfo = moectl.inspect(model)
    hooks = [
        layer.block.experts.register_forward_pre_hook(
            lambda m, args, i=layer.index: ran.setdefault(i, []).append(args[1].clone())
        )
        for layer in qinfo.layers
    ]
    ids = _ids()
    try:
        with route(model, ExpertMask.from_lists(qinfo, keep), record=True) as session:
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    for layer, allowed in keep.items():
        assert set(torch.cat(ran[layer]).unique().tolist()) <= set(allowed)  # what the experts ran
        assert set(session.trace.chosen[layer].unique().tolist()) <= set(allowed)  # what the trace says
    with route(original, ExpertMask.from_lists(info, keep), record=True) as plain:
        original(ids)
    assert torch.equal(session.trace.chosen[0], plain.trace.chosen[0])  # layer 0's router sees the same input


@torch.no_grad()
def test_the_engine_generates_from_a_quantized_model(monkeypatch):
    original, tok, _ = _tiny("olmoe")
    model = copy.deepcopy(original)
    quantize_model(model, "int4")
    prompt = "The history of the city of"
    got = Engine(model, tok, EngineConfig(max_batch=1)).generate(
        [prompt], SamplingParams(max_tokens=8, ignore_eos=True)
    )
    enc = tok([prompt], return_tensors="pt")
    out = model.generate(
        **enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None
    )
    assert got[0].token_ids == out[0, enc["input_ids"].shape[1] :].tolist()
    # a batch whose long prompt gives experts more rows than the kernel takes (the dequantised path)
    dequantized = []
    monkeypatch.setattr(int4, "dequantize", lambda *a: dequantized.append(a) or int4_dequantize(*a))
    prompts = ["def f(x):", "the long one " * 40, "a"]
    done = Engine(model, tok, EngineConfig(max_batch=3)).generate(
        prompts, SamplingParams(max_tokens=4, ignore_eos=True)
    )
    assert [c.error for c in done] == [None] * 3 and all(len(c.token_ids) == 4 for c in done)
    assert dequantized  # the long prompt's prefill took the dequantised path


# -- the API's and the command line's refusals ----------------------------------------------------
def test_bad_values_are_refused_naming_the_allowed_ones():
    with pytest.raises(ConfigError, match="int8, int4"):
        moectl.load("tiny:olmoe", quantize="int3")
    with pytest.raises(ConfigError, match="32, 64, 128, 256"):
        moectl.load("tiny:olmoe", quantize="int4", group_size=100)
    with pytest.raises(ConfigError, match="experts, all"):
        moectl.load("tiny:olmoe", quantize="int8", scope="attention")
    model, _, _ = moectl.load("tiny:mixtral", quantize="int8")
    with pytest.raises(ConfigError, match="quantized already"):
        quantize_model(model, "int4")
    with pytest.raises(ConfigError, match="bfloat16, float16 or float32"):
        quantize_model(moectl.load("tiny:olmoe", dtype="float64").model, "int4")


def test_cli_quantize_flag(tmp_path):
    out = tmp_path / "switch.json"
    args = [
        "switch-rate",
        "--tiny",
        "olmoe",
        "--max-new-tokens",
        "3",
        "--quantize",
        "int8",
        "--json",
        str(out),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["family"] == "olmoe"
    bad = runner.invoke(app, ["switch-rate", "--tiny", "olmoe", "--quantize", "fp4"])
    assert bad.exit_code == 2 and "--quantize must be one of int8, int4, got 'fp4'" in bad.output
    # with offloading the store holds the quantized experts (tests/test_quantized_offload.py)
    from moectl.offload.offload_config import OffloadConfig
    from moectl.server.serve_config import ServeConfig

    assert ServeConfig(model="tiny:olmoe", quantize="int4", offload=OffloadConfig(budget=0.5)).quantize == "int4"
    bad = runner.invoke(app, ["serve-offload", "--tiny", "olmoe", "--quantize", "fp4"])
    assert bad.exit_code == 2 and "--quantize must be one of" in bad.output
    for verb in (["roe", "generate"], ["roe", "score"], ["serve"], ["serve-offload"]):
        assert "--quantize" in runner.invoke(app, [*verb, "--help"]).output, verb


def test_eval_quantizes_at_load(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": t, "domain": "prose"}) + "\n" for t in ("A cat sat.", "Dogs run far."))
    )
    out = tmp_path / "eval.json"
    args = [
        "eval",
        "tiny:olmoe",
        "--perplexity",
        str(corpus),
        "--quantize",
        "int4",
        "--engine",
        "moectl",
        "--out",
        str(out),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert (
        doc["model"]["quantize"] == "int4"
        and doc["tasks"]["perplexity/all"]["metrics"]["perplexity"]["value"] > 1
    )


CONTROLLER = "models/moectl-small-standard-controller-k8-eta0.02"  # LoRA on attention and on the experts


@torch.no_grad()
def test_a_controller_merges_before_quantizing_and_not_after():
    """A controller's adapters merge into the unquantized weights (``quantize_loaded(merge_first=...)``:
    the int8 experts are the merged weights to within half a step); attaching one to a quantized
    model is refused, where PEFT would skip the quantized experts with a warning."""
    from moectl.loaded import quantize_loaded
    from moectl.options.policy import merged_controller
    from moectl.routing import load_policy

    merged, _, _ = moectl.load("models/moectl-small-standard")
    plain = merged.model.layers[0].mlp.experts.gate_up_proj[3].float().clone()
    load_policy(f"controller:{CONTROLLER}", merged)
    want = merged.model.layers[0].mlp.experts.gate_up_proj[3].float()
    model, _, _ = moectl.load("models/moectl-small-standard")
    quantize_loaded(model, "int8", merge_first=["option:4", f"controller:{CONTROLLER}"])
    assert merged_controller(model) is not None
    got = model.model.layers[0].mlp.experts.gate_up.dequantize(3, torch.float32)
    half_step = want.abs().amax(1, keepdim=True) / 254
    assert bool(((got - want).abs() <= half_step * 1.01 + 1e-3 * want.abs()).all())
    assert (want - plain).abs().max() > 4 * half_step.max()  # the adapters did change the weights
    quantized, _, _ = moectl.load("models/moectl-small-standard", quantize="int8")
    with pytest.raises(ConfigError, match="the model is int8: attach the controller before quantizing"):
        load_policy(f"controller:{CONTROLLER}", quantized)  # the policy loader's error around it
