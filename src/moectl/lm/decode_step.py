"""One decoding step of a MoE decoder as plain tensor code: what ``torch.compile`` captures whole.

:func:`decode_step` computes, for one new token per row, what the model's own forward computes
(issue 39 item 3): embedding, rotary position, per layer the input norm, q/k/v projections
(+ bias, + query/key norm, + clip), attention over the row's cache with the call's padding mask,
the output projection, the post-attention norm, the router's logits, the family's selection rule
(``adapters/rules.py``: the same ``RouterRule.select`` the routing hooks use, with an expert
mask's allowed experts where rows have one), the chosen experts' products and the shared expert;
then the final norm and the LM head. It takes the weights as tensors (:class:`StepWeights`), so
the whole step is one graph with no module calls, hooks or host syncs, and returns the experts it
chose, [L, B, k], for the caller's switch counts. Norms and the rotary embedding are the model's
own modules (pure tensor code, inlined by the compiler), so their numbers are the model's.

The experts' products gather the chosen experts' weights ([B, k, 2I, H]) and contract them with
the rows: no per-expert Python loop, no data-dependent shapes. Large experts (``experts_op``) are
one opaque call per layer instead, the eager engine's grouped products, which copy no weights;
large projections are the eager product too (``step_ops``: inductor's own loop is slower there). Deviation from the model's forward:
the k experts' outputs are summed in one reduction rather than added one expert at a time, so in
bf16 the sums differ by rounding (tokens and log-probabilities equal within bf16's rounding:
``tests/test_compiled_decode.py``); in float32 they agree to ~1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moectl.adapters.rules import RouterRule
from moectl.lm.step_modules import ModuleCall
from moectl.lm.step_ops import large

Weight = Tensor | ModuleCall  # a projection's weight, or a quantized layer the step calls as it is (``step_modules``)


@dataclass
class LayerWeights:
    """One decoder layer's tensors (and its norms' modules) for :func:`decode_step`."""

    input_norm: nn.Module
    post_norm: nn.Module
    q: Weight
    k: Weight
    v: Weight
    o: Weight
    q_bias: Tensor | None
    k_bias: Tensor | None
    v_bias: Tensor | None
    o_bias: Tensor | None
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    scaling: float
    # MoE layers: router [E, H], the family's rule, experts gate_up [E, 2I, H], down [E, H, I]
    router: Tensor | None = None
    router_bias: Tensor | None = None  # a score-correction bias (``rule.select``'s bias)
    rule: RouterRule | None = None
    gate_up: Tensor | None = None
    down: Tensor | None = None
    # a shared expert (Qwen2-MoE): gate, up, down [.., H] and its sigmoid gate [1, H]
    shared: tuple[Weight, Weight, Weight] | None = None
    shared_gate: Weight | None = None
    # a dense MLP layer (Qwen2-MoE's mlp_only_layers): gate, up, down
    dense: tuple[Weight, Weight, Weight] | None = None
    moe_index: int | None = None  # this layer's index among the MoE layers
    kernel_experts: bool = False  # the experts through ``moectl::routed_experts`` (large experts)
    experts_call: ModuleCall | None = None  # quantized experts, called as they are (``step_modules``)


@dataclass
class StepWeights:
    """The whole model's tensors for :func:`decode_step` (views of the model's own: nothing copied)."""

    embed: Tensor
    rotary: nn.Module
    norm: nn.Module
    lm_head: Weight
    lm_head_bias: Tensor | None
    layers: list[LayerWeights]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: str | None  # None, "flat" (over the projection's output) or "head" (per head)
    clip: float | None
    top_k: int
    dtype: torch.dtype
    num_experts: int = 0  # the widest MoE layer's experts (ω's width)


SMALL_PRODUCTS = "sum"  # small weights' products when compiled: "sum" (``_linear``) or "product"


def sums_for(rows: int, threads: int) -> bool:
    """Whether the compiled step takes small weights' products as sums (``_linear``): everywhere but
    several rows on one thread, where the generated loops compute per row what a BLAS product
    shares (the step alone, reference model, one thread, ``benchmarks/compiled_step_products.py``:
    8 rows 6.57 ms with sums, 4.68 with products; one row 1.47 against 2.61; two threads 8 rows 3.44
    against 3.83). Through the engine, 8 prompts on one thread, the two were within the noise
    between processes (870-1110 tok/s either way). The choice is part of the
    step's graph class (rows > 1, thread count), and ``moectl serve`` builds the graphs of every
    thread count its loop may use before serving (``Engine._warm_up``), so a re-pick of its threads
    under load compiles nothing. ``SMALL_PRODUCTS`` = "product" keeps the BLAS calls everywhere (its
    benchmark)."""
    return SMALL_PRODUCTS == "sum" and not (rows > 1 and threads == 1)


ATTENTION = "sums"  # one query's attention when compiled: "sums" (``_attend``) or "sdpa" (aten's kernel)


def _attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """``F.scaled_dot_product_attention`` of one query per row; compiled, as sums the compiler fuses.

    q [B, Hq, 1, D], keys / values [B, Hkv, T, D] (Hq a multiple of Hkv: grouped queries), mask
    [B, 1, 1, T] bool. Compiled, the scores and the weighted values are written as multiply-and-sum
    over float32 (as aten's CPU flash kernel accumulates), masked columns -inf before the softmax:
    inductor fuses them into a layer's loops, where aten's kernel costs ~40 us a call whatever the
    length (its blocking and buffers are sized for many queries). Eager, aten's kernel."""
    if ATTENTION != "sums" or not torch.compiler.is_compiling():
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=keys.shape[1] != q.shape[1])  # fmt: skip
    b, heads, _, d = q.shape
    kv_heads, t = keys.shape[1], keys.shape[2]
    qg = q.reshape(b, kv_heads, heads // kv_heads, 1, d).float()  # [B, Hkv, g, 1, D]
    scores = (qg * keys[:, :, None].float()).sum(-1) * scale  # [B, Hkv, g, T]
    scores = scores.masked_fill(~mask.reshape(b, 1, 1, t), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = (p[..., None] * values[:, :, None].float()).sum(-2)  # [B, Hkv, g, D]
    return out.reshape(b, heads, 1, d).to(q.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _linear(x: Tensor, weight: Weight, bias: Tensor | None = None, sums: bool = False) -> Tensor:
    """``F.linear``; for a large weight the eager product, opaque to the compiler (``step_ops``).

    Compiled with ``sums``, a small weight's product is written as a multiply-and-sum, which
    inductor fuses into the layer's generated loops (products and sum in float32, rounded once:
    ``F.linear``'s numbers within rounding) instead of calling the BLAS product: at a few rows that
    call costs 15-25 us whatever the size (oneDNN's bf16 product of a [1, 256] x [256, 32] is 18 us
    on this CPU), and the reference model's step made 48 of them, 1.5 of its 2.3 ms. The compiled
    step alone, reference model, training paused (``benchmarks/compiled_step_products.py``, load
    1.5): one row 2.36 -> 1.14 ms with two threads, 2.66 -> 1.39 with one; 8 rows 3.83 -> 3.44 with
    two threads but 5.62 -> 6.51 with one (the generated loops then compute per row what the
    product shares; ``sums_for`` keeps the products there). Eager (the step's CPU twin),
    ``F.linear`` as the model computes it. A :class:`ModuleCall` is the quantized layer's own forward
    (its bias included), one opaque call."""
    if isinstance(weight, ModuleCall):
        return torch.ops.moectl.module_linear(x, weight.key, weight.out_features)
    if large(weight):
        return torch.ops.moectl.linear(x, weight, bias)
    if not sums or not torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    y = (x.unsqueeze(-2) * weight).sum(-1)
    return y if bias is None else y + bias


def _glu(x: Tensor, gate: Weight, up: Weight, down: Weight, sums: bool) -> Tensor:
    return _linear(F.silu(_linear(x, gate, None, sums)) * _linear(x, up, None, sums), down, None, sums)


def _experts(w: LayerWeights, x: Tensor, weights: Tensor, idx: Tensor) -> Tensor:
    """Σ_j weights[:, j] · expert_{idx[:, j]}(x) over the k chosen experts of each row [B, H]."""
    if w.experts_call is not None:
        return torch.ops.moectl.module_experts(x, idx, weights, w.experts_call.key)
    assert w.gate_up is not None and w.down is not None
    if w.kernel_experts:
        return torch.ops.moectl.routed_experts(x, idx, weights, w.gate_up, w.down)
    y = torch.einsum("bkoh,bh->bko", w.gate_up[idx], x)  # [B, k, 2I]
    gate, up = y.chunk(2, dim=-1)
    out = torch.einsum("bkhi,bki->bkh", w.down[idx], F.silu(gate) * up)  # [B, k, H]
    return (out * weights.to(out.dtype)[..., None]).sum(1)


def _omega(chosen: Tensor, num_experts: int) -> Tensor:
    """ω [B, L, E] bool: the experts each row activated at each MoE layer (``chosen`` [L, B, k]),
    what the engine's switch counts compare from step to step (``engine.rows.SwitchMeter.end``)."""
    experts = chosen.permute(1, 0, 2)
    return torch.zeros(*experts.shape[:2], num_experts, dtype=torch.bool, device=chosen.device).scatter_(
        2, experts, True
    )


def _argmax(logits: Tensor) -> Tensor:
    """``logits.argmax(-1)`` (the first index of the largest) as two reductions the compiler
    vectorises, a max and a min of indices: inductor's own argmax is a scalar loop, 25 us over a
    vocabulary of 8192 on this CPU."""
    top = logits.amax(-1, keepdim=True)
    index = torch.arange(logits.shape[-1], device=logits.device)
    first = torch.where(logits == top, index, logits.shape[-1]).amin(-1)
    return first.clamp(max=logits.shape[-1] - 1)  # NaN logits: still a token id


def decode_step(
    sw: StepWeights,
    ids: Tensor,
    positions: Tensor,
    valid: Tensor,
    keys: list[Tensor],
    values: list[Tensor],
    allowed: list[Tensor | None] | None = None,
    renorm: str = "pruned",
    sums: bool = False,
    column: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Logits [B, V] after one token per row (its keys and values written into the caches' buffers
    in place), the experts chosen [L, B, k], the same as ω [B, L, E] bool (``num_experts`` wide, for the switch counts) and each row's greedy
    token [B] (the logits' argmax, fused into the step: a bf16 argmax over the
    vocabulary is ~30 us eager on this CPU, a sizeable part of a small model's step).

    ``ids`` [B] the rows' last tokens; ``positions`` [B] their positions; ``valid`` [B, T + 1] bool,
    the rows' real columns after this token (left padding False); ``keys`` / ``values`` per layer
    [B, kv heads, C, D] buffers of C > T + 1 columns, the first T the cache: the step writes column T
    and attends over the first T + 1 (no copy of the cache at each step: ``moectl.lm.kv_buffers``).
    ``allowed``: per MoE layer None (every row routed as the model routes it) or [B, E] bool, the experts each row may take there (an expert mask's rows, all True for the
    others), selected as the routing hooks do with ``renorm`` (``RouterRule.select``). Routings whose
    choice changes from token to token (noise, pools, controllers, replay) are not taken here: the
    engine decodes those steps through the hooks (``moectl.engine.model_runner``).

    ``column`` (a one-element tensor; ``moectl.lm.graph_decode``'s static buffers): the step writes
    the new keys and values at that column, not at T, and attends over all C columns of the buffers,
    ``valid`` [B, C] masking those past each row's end: no size of the step depends on the cache's
    length, so one CUDA graph serves every length up to C.
    """
    b = ids.shape[0]
    h = F.embedding(ids[:, None], sw.embed)  # [B, 1, H]
    cos, sin = sw.rotary(h, positions[:, None])
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, 1, D]
    mask = valid[:, None, None, :]
    t = valid.shape[1] - 1  # the cache's columns before this token: the new one is written at t
    chosen: list[Tensor] = []
    heads, kv_heads, d = sw.num_heads, sw.num_kv_heads, sw.head_dim
    for i, w in enumerate(sw.layers):
        x = w.input_norm(h)
        q, k, v = _linear(x, w.q, w.q_bias, sums), _linear(x, w.k, w.k_bias, sums), _linear(x, w.v, w.v_bias, sums)
        if sw.qk_norm == "flat":
            assert w.q_norm is not None and w.k_norm is not None
            q, k = w.q_norm(q), w.k_norm(k)
        if sw.clip is not None:
            q, k, v = q.clamp(-sw.clip, sw.clip), k.clamp(-sw.clip, sw.clip), v.clamp(-sw.clip, sw.clip)
        q, k, v = q.view(b, 1, heads, d), k.view(b, 1, kv_heads, d), v.view(b, 1, kv_heads, d)
        if sw.qk_norm == "head":
            assert w.q_norm is not None and w.k_norm is not None
            q, k = w.q_norm(q), w.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if column is None:
            keys[i].narrow(2, t, 1).copy_(k)  # in place, at column T of the buffer (``lm/kv_buffers``)
            values[i].narrow(2, t, 1).copy_(v)
            keys_i, values_i = keys[i].narrow(2, 0, t + 1), values[i].narrow(2, 0, t + 1)
        else:  # static buffers: at the column the tensor names, attention over every column, masked
            keys[i].index_copy_(2, column, k)
            values[i].index_copy_(2, column, v)
            keys_i, values_i = keys[i], values[i]
        out = _attend(q, keys_i, values_i, mask, w.scaling)
        h = h + _linear(out.transpose(1, 2).reshape(b, 1, heads * d), w.o, w.o_bias, sums)
        x = w.post_norm(h)[:, 0]  # [B, H]
        if w.dense is not None:
            h = h + _glu(x, *w.dense, sums)[:, None]
            continue
        assert w.router is not None and w.rule is not None and w.moe_index is not None
        logits = _linear(x, w.router, None, sums)
        experts_mask = None if allowed is None else allowed[w.moe_index]
        if experts_mask is None:
            weights, idx = w.rule.select(logits, w.router_bias)
        else:
            weights, idx = w.rule.select(logits, w.router_bias, experts_mask, None, renorm)  # type: ignore[arg-type]
        chosen.append(idx)
        y = _experts(w, x, weights.to(sw.dtype), idx)
        if w.shared is not None:
            shared = _glu(x, *w.shared, sums)
            if w.shared_gate is not None:
                shared = torch.sigmoid(_linear(x, w.shared_gate, None, sums)) * shared
            y = y + shared
        h = h + y[:, None]
    logits = _linear(sw.norm(h)[:, 0], sw.lm_head, sw.lm_head_bias, sums)
    experts = torch.stack(chosen)  # [L, B, k]
    return logits, experts, _argmax(logits), _omega(experts, sw.num_experts)
