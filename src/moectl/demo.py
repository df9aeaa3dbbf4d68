"""The routing core end to end on a model (``moectl demo``: a built-in tiny one, in seconds)."""

from __future__ import annotations

from pathlib import Path

import torch

from moectl.adapters.inspect import inspect
from moectl.adapters.selftest import self_test
from moectl.generate import generate_traced, load_prompts
from moectl.metrics.switch_rate import switch_rate
from moectl.routing import DocumentPool, ExpertMask, GumbelTopK, route


def _kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean per-token KL(p_ref || p) of next-token distributions."""
    ref = torch.log_softmax(ref_logits.float(), -1)
    new = torch.log_softmax(logits.float(), -1)
    return float((ref.exp() * (ref - new)).sum(-1).mean())


@torch.no_grad()
def run_demo(
    model, tokenizer, name: str, max_new_tokens: int = 48, out_dir: str | None = "out/demo", seed: int = 0
) -> dict:
    """Self-test, switch rates, an expert mask, Gumbel noise and a causal document pool on ``model``
    (called ``name`` in the result); writes TE-MoE Figure 2 to ``out_dir`` twice: the plain router
    (ω: k-hat = top-k, so ω is the activated experts) and under the causal document pool (ω: the
    pool it recorded, the experts a document may use). Returns a JSON-ready dict."""
    info = inspect(model)
    test = self_test(model, info)
    prompts = load_prompts(None)
    e, k = info.num_experts, info.top_k
    result: dict = {"model": name, "inspect": info.summary(), "self_test_passed": test.passed}

    _, plain = generate_traced(
        model, tokenizer, prompts, max_new_tokens, temperature=0.5, seed=seed, progress=True
    )
    result["switch_rate"] = {
        f"k_hat={kh}": switch_rate(plain, k_hat=kh).mean for kh in sorted({k, min(e, 2 * k), e // 2})
    }

    enc = tokenizer([p.text for p in prompts])
    ids, attn = enc["input_ids"].to(model.device), enc["attention_mask"].to(model.device)
    with route(model, record=True) as clean:
        ref = model(input_ids=ids, attention_mask=attn).logits
    assert clean.trace is not None
    half = ExpertMask.everywhere(info, range(e // 2))
    with route(model, half, record=True) as masked:
        logits = model(input_ids=ids, attention_mask=attn).logits
    assert masked.trace is not None
    inside = all(bool((masked.trace.chosen[layer] < e // 2).all()) for layer in masked.trace.chosen)
    result["mask_half_experts"] = {"chosen_inside_mask": inside, "kl_to_full": _kl(ref, logits)}

    with route(model, GumbelTopK(0.5, seed=seed), record=True) as noisy:
        logits = model(input_ids=ids, attention_mask=attn).logits
    assert noisy.trace is not None
    changed = torch.stack(
        [
            (noisy.trace.chosen[layer].sort(-1).values != clean.trace.chosen[layer].sort(-1).values).any(-1)
            for layer in range(info.num_moe_layers)
        ]
    )[:, clean.trace.valid]
    result["gumbel_tau_0.5"] = {
        "tokens_with_changed_experts": float(changed.float().mean()),
        "kl_to_full": _kl(ref, logits),
    }

    pool = DocumentPool(d=max(k, e // 2), mode="causal")
    _, pooled_trace = generate_traced(
        model, tokenizer, prompts, max_new_tokens, temperature=0.5, seed=seed, progress=False, policies=pool
    )
    result["document_pool_causal"] = {
        "d": pool.d,
        "switch_rate_k_hat=d": switch_rate(pooled_trace, k_hat=pool.d).mean,
        "chosen_inside_pool": all(
            bool(
                (
                    pooled_trace.allowed[layer].gather(-1, pooled_trace.chosen[layer].clamp(min=0))
                    | (pooled_trace.chosen[layer] < 0)
                ).all()
            )
            for layer in pooled_trace.chosen
        ),
    }
    if out_dir:
        from moectl.reporting.plots import plot_expert_activation  # matplotlib only when plotting

        label = f"prompt 0 ({prompts[0].category}): {prompts[0].text!r}"
        figure = plot_expert_activation(
            plain, Path(out_dir) / "expert_activation_layer0.png", k_hat=k, label=label, model=name
        )
        pooled = plot_expert_activation(
            pooled_trace, Path(out_dir) / "expert_activation_layer0_document_pool.png", label=label,
            title=f"Activated experts, MoE layer 0 (TE-MoE Fig. 2), {name}, causal document pool d={pool.d}",
        )  # fmt: skip
        result["plots"] = [str(figure), str(pooled)]
    return result
