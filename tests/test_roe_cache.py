"""The clean cache holds one sequence's keys and values whatever K is (RoE §2.3); separate caches grow with K."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

import moectl
from moectl.ensemble.cache_size import cache_bytes, cache_tokens
from moectl.roe import Ensemble, RoEConfig
from moectl.routing.kv_cache import cache_out

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _model(family: str):
    if family == "gpt_oss":  # a sliding window of 8 so that short prompts cross it
        return moectl.tiny(family, sliding_window=8)
    return moectl.tiny(family)


def _prompt(length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 256, (2, length), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids)


@torch.no_grad()
def _plain_cache(model, ids, mask, tokens: torch.Tensor):
    """The plain model's cache after the prompt and the given continuation [B, n] (last token not fed)."""
    full = torch.cat([ids, tokens[:, :-1]], 1)
    out = model(input_ids=full, attention_mask=torch.ones_like(full), use_cache=True)
    return cache_out(out)


def _logical_bytes(cache) -> int:
    """Bytes of the keys/values as tensors (what the cache exposes), ignoring the buffers behind views."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def _decode(model, ids, mask, n: int, config: RoEConfig):
    tokens = []
    ens = Ensemble(model, config)
    with ens:
        out = ens.start(ids, mask)
        for step in range(n):
            tokens.append(out.logprobs.argmax(-1))
            if step < n - 1:
                out = ens.step(tokens[-1])
    return ens.variant.cache, torch.stack(tokens, 1)


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3", "gpt_oss"])
def test_clean_cache_holds_one_sequence_whatever_k(family):
    model = _model(family)
    ids, mask = _prompt(12)
    sizes = {}
    for k in (1, 4, 16):
        cache, tokens = _decode(model, ids, mask, 6, RoEConfig(K=k, tau=0.5))
        plain = _plain_cache(model, ids, mask, tokens)
        sizes[k] = cache_bytes(cache)  # storages actually held, views' buffers included
        assert _logical_bytes(cache) == _logical_bytes(plain), f"K={k}: not one sequence's keys and values"
        assert sizes[k] <= cache_bytes(plain), f"K={k}: the clean cache holds more memory than one sequence's"
        if family != "gpt_oss":  # no sliding views: every byte held is a key or value of the clean sequence
            assert sizes[k] == _logical_bytes(cache)
        assert cache_tokens(cache) == ids.shape[1] + 5
        for mine, ref in zip(cache.layers, plain.layers, strict=True):
            assert mine.keys.shape == ref.keys.shape  # batch B, not B·K
            # what was appended is exactly the clean path's keys/values, i.e. the plain model's
            torch.testing.assert_close(mine.keys, ref.keys, atol=2e-5, rtol=0)
            torch.testing.assert_close(mine.values, ref.values, atol=2e-5, rtol=0)
    assert sizes[1] == sizes[4] == sizes[16]


def test_sliding_layers_keep_their_window():
    model = _model("gpt_oss")
    ids, mask = _prompt(12)
    cache, _ = _decode(model, ids, mask, 4, RoEConfig(K=8, tau=0.5))
    window = model.config.sliding_window
    for layer in cache.layers:
        expected = window - 1 if isinstance(layer, DynamicSlidingWindowLayer) else ids.shape[1] + 3
        assert layer.keys.shape[-2] == expected


def test_hybrid_recurrent_states_are_the_clean_path():
    """Qwen3-Next: linear-attention conv/recurrent states after RoE decoding equal the plain model's."""
    model = _model("qwen3_next")
    ids, mask = _prompt(10)
    cache, tokens = _decode(model, ids, mask, 5, RoEConfig(K=6, tau=0.5))
    plain = _plain_cache(model, ids, mask, tokens)
    assert cache_bytes(cache) == cache_bytes(plain)
    checked = 0
    for mine, ref in zip(cache.layers, plain.layers, strict=True):
        if isinstance(mine, LinearAttentionCacheLayerMixin):
            torch.testing.assert_close(mine.conv_states[0], ref.conv_states[0], atol=2e-5, rtol=0)
            torch.testing.assert_close(mine.recurrent_states[0], ref.recurrent_states[0], atol=2e-5, rtol=0)
            assert mine.recurrent_states[0].shape[0] == ids.shape[0]
            checked += 1
        else:
            torch.testing.assert_close(mine.keys, ref.keys, atol=2e-5, rtol=0)
    assert checked == 3


def test_separate_caches_grow_linearly_with_k():
    model = _model("olmoe")
    ids, mask = _prompt(12)
    one = cache_bytes(_decode(model, ids, mask, 4, RoEConfig(K=1, tau=0.5, cache="separate"))[0])
    for k in (2, 8):
        cache, _ = _decode(model, ids, mask, 4, RoEConfig(K=k, tau=0.5, cache="separate"))
        assert cache_bytes(cache) == k * one
    assert _decode(model, ids, mask, 3, RoEConfig(K=4, cache="none"))[0] is None


def test_cache_bytes_counts_storages_not_views():
    from transformers import DynamicCache

    t = torch.zeros(4, 10)
    cache = DynamicCache()
    cache.update(t[None, None, :, :2].clone(), t[None, None, :, :2].clone(), 0)
    assert cache_bytes(cache) == 2 * 4 * 2 * 4
    cache.layers[0].keys = cache.layers[0].keys[..., :1, :]  # a view pins the whole buffer
    assert cache_bytes(cache) == 2 * 4 * 2 * 4


def test_a_clean_step_does_not_materialise_k_copies_of_the_prefix():
    """Peak tensor memory of decoding (profiler allocator events) barely moves with K for the clean
    cache: attention reads the prefix once for all K queries. K copies (an expanded [B·K] batch)
    would add K × the prefix per layer; separate caches hold K caches."""
    from moectl.roe.bench import peak_tensor_bytes

    model = _model("olmoe")
    ids, mask = _prompt(200)

    def decode_peak(config: RoEConfig) -> tuple[int, int]:
        with Ensemble(model, config) as ens:
            out = ens.start(ids, mask)

            def steps() -> None:
                nonlocal out
                for _ in range(3):
                    out = ens.step(out.logprobs.argmax(-1))

            return peak_tensor_bytes(steps, ids.device), cache_bytes(ens.variant.cache)

    one, kv = decode_peak(RoEConfig(K=1, tau=0.5))
    many, _ = decode_peak(RoEConfig(K=32, tau=0.5))
    separate, _ = decode_peak(RoEConfig(K=32, tau=0.5, cache="separate"))
    prefix_per_layer = kv // len(model.model.layers)
    assert many - one < 8 * prefix_per_layer  # K = 32 copies would be 31 × prefix_per_layer more
    assert separate > 10 * many
