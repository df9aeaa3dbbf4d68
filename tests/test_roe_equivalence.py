"""RoE decoding against its definitions: tau = 0 is the plain model; the clean cache is the clean-prefix recompute."""

from __future__ import annotations

import functools

import pytest
import torch

import moectl
from moectl.roe import Ensemble, RoEConfig
from moectl.routing.kv_cache import cache_out, with_cache

REQUIRED = ("olmoe", "qwen3_moe", "mixtral", "deepseek_v3", "qwen3_next")


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _model(family: str, **overrides):
    return moectl.tiny(family, **overrides)


def _batch(length: int = 10, pad: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded prompts: row 1 has ``pad`` padding tokens."""
    ids = torch.randint(3, 256, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :pad], mask[1, :pad] = 0, 0
    return ids, mask


@torch.no_grad()
def plain_greedy(model, ids, mask, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain model's greedy tokens [B, n] and log-probs [B, n, V], decoded with transformers' own cache."""
    position = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True)
    cache, tokens, logps = cache_out(out), [], []
    for _ in range(n):
        logp = torch.log_softmax(out.logits[:, -1].float(), -1)
        token = logp.argmax(-1)
        tokens.append(token)
        logps.append(logp)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        position = position[:, -1:] + 1
        out = model(
            input_ids=token[:, None], attention_mask=mask, position_ids=position, **with_cache(cache)
        )
    return torch.stack(tokens, 1), torch.stack(logps, 1)


def roe_greedy(model, ids, mask, n: int, config: RoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """RoE greedy tokens [B, n] and aggregated log-probs [B, n, V]."""
    tokens, logps = [], []
    with Ensemble(model, config) as ens:
        out = ens.start(ids, mask)
        for step in range(n):
            token = out.logprobs.argmax(-1)
            tokens.append(token)
            logps.append(out.logprobs)
            if step < n - 1:
                out = ens.step(token)
    return torch.stack(tokens, 1), torch.stack(logps, 1)


@pytest.mark.parametrize("family", REQUIRED)
@pytest.mark.parametrize("cache", ["clean", "separate", "none"])
def test_tau_zero_is_the_plain_model(family, cache):
    model = _model(family)
    ids, mask = _batch()
    want_tokens, want_logp = plain_greedy(model, ids, mask, 6)
    for k in (1, 3):
        tokens, logp = roe_greedy(model, ids, mask, 6, RoEConfig(K=k, tau=0.0, cache=cache))
        assert torch.equal(tokens, want_tokens), f"{family} {cache} K={k}"
        torch.testing.assert_close(logp, want_logp, atol=2e-5, rtol=0)


def test_tau_zero_matches_transformers_generate():
    model = _model("olmoe")
    ids, mask = _batch()
    want = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=[]
    )[:, ids.shape[1] :]
    tokens, _ = roe_greedy(model, ids, mask, 8, RoEConfig(K=4, tau=0.0))
    assert torch.equal(tokens, want)


@pytest.mark.parametrize("family", moectl.FAMILIES)
def test_clean_cache_is_the_clean_prefix_recompute(family):
    """Paper definition (§2.3): every sample sees the clean history, noisy routing for the current token only.

    The no-cache variant recomputes each sample from scratch with exactly that; with the same
    (sample, position)-keyed Gumbel draws the clean cache must give the same tokens and log-probs.
    """
    model = _model(family)
    ids, mask = _batch(length=8)
    config = RoEConfig(K=4, tau=0.5, seed=3)
    clean_tokens, clean_logp = roe_greedy(model, ids, mask, 5, config)
    ref_tokens, ref_logp = roe_greedy(model, ids, mask, 5, config.with_(cache="none"))
    assert torch.equal(clean_tokens, ref_tokens)
    torch.testing.assert_close(clean_logp, ref_logp, atol=2e-5, rtol=0)
    _, plain_logp = plain_greedy(model, ids, mask, 5)
    assert (clean_logp - plain_logp).abs().max() > 1e-3, "tau = 0.5 should change the distribution"


@pytest.mark.parametrize(
    ("family", "window"), [("gpt_oss", "sliding_window"), ("llama4_text", "attention_chunk_size")]
)
def test_clean_cache_across_sliding_window_and_chunks(family, window):
    """gpt-oss (sliding window) and Llama-4 (attention chunks), shrunk to 8 tokens: decode past them."""
    model = _model(family, **{window: 8})
    ids, mask = _batch(length=12, pad=5)
    config = RoEConfig(K=3, tau=0.5, seed=1)
    tokens, logp = roe_greedy(model, ids, mask, 10, config)
    ref_tokens, ref_logp = roe_greedy(model, ids, mask, 10, config.with_(cache="none"))
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logp, ref_logp, atol=2e-5, rtol=0)
    plain_tokens, _ = plain_greedy(model, ids, mask, 10)
    zero_tokens, _ = roe_greedy(model, ids, mask, 10, config.with_(tau=0.0))
    assert torch.equal(zero_tokens, plain_tokens)


@pytest.mark.parametrize("family", ["olmoe", "qwen3_next"])
def test_a_prompt_decodes_the_same_alone_or_in_a_padded_batch(family):
    """Noise is keyed by (sample, position id), so batching with padding changes nothing."""
    model = _model(family)
    ids, mask = _batch(length=9, pad=4)
    config = RoEConfig(K=4, tau=0.4, seed=5)
    batch_tokens, batch_logp = roe_greedy(model, ids, mask, 5, config)
    alone_tokens, alone_logp = roe_greedy(model, ids[1:, 4:], mask[1:, 4:], 5, config)
    assert torch.equal(batch_tokens[1:], alone_tokens)
    torch.testing.assert_close(batch_logp[1:], alone_logp, atol=2e-5, rtol=0)


def test_one_token_prompt():
    """No prefix to cache: the first step runs on an empty clean cache."""
    model = _model("qwen3_next")
    ids, mask = torch.tensor([[65]]), torch.tensor([[1]])
    config = RoEConfig(K=3, tau=0.5)
    tokens, logp = roe_greedy(model, ids, mask, 4, config)
    ref_tokens, ref_logp = roe_greedy(model, ids, mask, 4, config.with_(cache="none"))
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logp, ref_logp, atol=2e-5, rtol=0)


def test_samples_differ_and_sample_zero_is_clean():
    model = _model("olmoe")
    ids, mask = _batch()
    with Ensemble(model, RoEConfig(K=6, tau=0.5)) as ens:
        out = ens.start(ids, mask)
    plain = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits[
        :, -1
    ]
    torch.testing.assert_close(out.sample_logits[:, 0], plain, atol=2e-5, rtol=0)
    spread = (out.sample_logits[:, 1:] - out.sample_logits[:, :1]).abs().amax(-1)  # [B, K-1]
    assert (spread > 1e-4).float().mean() > 0.5, (
        "most noisy samples should route differently from the clean one"
    )


@pytest.mark.parametrize("family", ["olmoe", "qwen3_next"])
def test_sdpa_attention(family):
    """The explicit shared-prefix masks also drive torch's scaled_dot_product_attention."""
    model = moectl.tiny(family)
    model.set_attn_implementation("sdpa")
    ids, mask = _batch(length=10, pad=4)
    plain_tokens, plain_logp = plain_greedy(model, ids, mask, 5)
    tokens, logp = roe_greedy(model, ids, mask, 5, RoEConfig(K=3, tau=0.0))
    assert torch.equal(tokens, plain_tokens)
    torch.testing.assert_close(logp, plain_logp, atol=2e-5, rtol=0)
    config = RoEConfig(K=3, tau=0.5)
    tokens, logp = roe_greedy(model, ids, mask, 5, config)
    ref_tokens, ref_logp = roe_greedy(model, ids, mask, 5, config.with_(cache="none"))
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logp, ref_logp, atol=2e-5, rtol=0)
