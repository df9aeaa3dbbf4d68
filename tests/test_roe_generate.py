"""RoE text generation: greedy, sampling, stop strings, EOS, streaming, batches with left padding."""

from __future__ import annotations

import functools

import pytest
import torch

from moectl.engine.engine import encode
from moectl.engine.sampling import choose_tokens
from moectl.ensemble.ensemble import Ensemble
from moectl.models.load import ByteTokenizer, load_model
from moectl.roe import GenerationStats, RoEConfig, generate

PROMPTS = ["The quick brown fox", "Hi", "Mixture of experts"]


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def _load(family: str = "olmoe"):
    return load_model(f"tiny:{family}")


def test_batch_equals_one_prompt_at_a_time():
    model, tokenizer = _load()
    config = RoEConfig(K=4, tau=0.4, seed=1)
    batched = generate(model, tokenizer, PROMPTS, config, max_new_tokens=8, ignore_eos=True)
    for prompt, out in zip(PROMPTS, batched, strict=True):
        (alone,) = generate(model, tokenizer, prompt, config, max_new_tokens=8, ignore_eos=True)
        assert out.token_ids == alone.token_ids
        assert out.text == alone.text and out.finish_reason == "length" and len(out.token_ids) == 8


def _ensemble_greedy(model, tokenizer, prompt: str, config: RoEConfig, n: int) -> list[int]:
    """The definition (what the earlier private loop ran for one prompt): an Ensemble of its own,
    greedy on the aggregated distribution."""
    ids = torch.tensor([encode(tokenizer, prompt)])
    tokens = []
    with Ensemble(model, config) as ens:
        out = ens.start(ids, torch.ones_like(ids))
        for i in range(n):
            tokens.append(int(out.logprobs.argmax(-1)))
            if i < n - 1:
                out = ens.step(out.logprobs.argmax(-1))
    return tokens


def test_rows_joining_the_running_batch_equal_their_own_ensemble():
    """batch_size=2 over five prompts of different lengths: rows join and leave the engine's ensemble
    as earlier ones finish; each equals an Ensemble of its own."""
    model, tokenizer = _load()
    config = RoEConfig(K=4, tau=0.4, seed=3)
    prompts = [*PROMPTS, "a", "Routing samples per token, averaged"]
    stats = GenerationStats()
    outs = generate(
        model, tokenizer, prompts, config, max_new_tokens=7, ignore_eos=True, batch_size=2, stats=stats
    )
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == _ensemble_greedy(model, tokenizer, prompt, config, 7), prompt
    assert stats.tokens == 5 * 7 and stats.sample_tokens == 4 * 5 * 7


def test_prompt_i_samples_with_seed_sample_seed_plus_i():
    model, tokenizer = _load()
    config = RoEConfig(K=3, tau=0.3)
    kw = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 1.0}
    together = generate(model, tokenizer, PROMPTS, config, sample_seed=11, **kw)
    for i, prompt in enumerate(PROMPTS):
        (alone,) = generate(model, tokenizer, prompt, config, sample_seed=11 + i, **kw)
        assert together[i].token_ids == alone.token_ids


def test_stop_string_cuts_the_text():
    model, tokenizer = _load()
    config = RoEConfig(K=3, tau=0.3)
    (free,) = generate(model, tokenizer, "Hello", config, max_new_tokens=24, ignore_eos=True)
    # an ASCII character first seen after the start (random weights also emit invalid UTF-8 bytes)
    stop = next(
        c
        for i, c in enumerate(free.text)
        if i > 0 and c.isascii() and c.isprintable() and free.text.index(c) == i
    )
    (cut,) = generate(
        model, tokenizer, "Hello", config, max_new_tokens=24, stop=["zz", stop], ignore_eos=True
    )
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    assert len(cut.token_ids) < len(free.token_ids)


def test_eos_finishes_a_row():
    model, _ = _load()
    tokenizer = ByteTokenizer()
    config = RoEConfig(K=3, tau=0.3)
    (free,) = generate(model, tokenizer, "Hello", config, max_new_tokens=6, ignore_eos=True)
    tokenizer.eos_token_id = free.token_ids[3]  # make the 4th generated token the end of sequence
    first = free.token_ids.index(tokenizer.eos_token_id)
    (out,) = generate(model, tokenizer, "Hello", config, max_new_tokens=6)
    assert out.finish_reason == "eos"
    assert out.token_ids == free.token_ids[: first + 1]


def test_streaming_pieces_add_up_to_the_text():
    model, tokenizer = _load()
    pieces: dict[int, list[str]] = {0: [], 1: []}
    outs = generate(
        model, tokenizer, ["Hello", "Hi"], RoEConfig(K=2, tau=0.3), max_new_tokens=10, ignore_eos=True,
        on_text=lambda row, piece: pieces[row].append(piece),
    )  # fmt: skip
    for row, out in enumerate(outs):
        assert "".join(pieces[row]) == out.text
        assert len(pieces[row]) >= 2


def test_sampling_is_seeded_and_top_p_tiny_is_greedy():
    model, tokenizer = _load()
    config = RoEConfig(K=3, tau=0.3)
    kw = {"max_new_tokens": 10, "ignore_eos": True}
    a = generate(model, tokenizer, PROMPTS, config, temperature=1.0, sample_seed=7, **kw)
    b = generate(model, tokenizer, PROMPTS, config, temperature=1.0, sample_seed=7, **kw)
    c = generate(model, tokenizer, PROMPTS, config, temperature=1.0, sample_seed=8, **kw)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    greedy = generate(model, tokenizer, PROMPTS, config, **kw)
    nucleus = generate(model, tokenizer, PROMPTS, config, temperature=1.0, top_p=1e-6, **kw)
    assert [o.token_ids for o in greedy] == [o.token_ids for o in nucleus]


def test_top_p_keeps_the_smallest_set_reaching_p():
    """generate samples with the engine's ``choose_tokens``: 300 keys (requests) draw within the nucleus."""
    logp = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(300, -1)
    keys, steps = torch.arange(300, dtype=torch.int64), torch.zeros(300, dtype=torch.int64)
    draws = choose_tokens(logp, torch.ones(300), torch.full((300,), 0.75), keys, steps)
    assert set(draws.tolist()) == {0, 1}  # 0.5 + 0.3 >= 0.75; 2 and 3 are cut
    assert set(choose_tokens(logp, torch.zeros(300), torch.ones(300), keys, steps).tolist()) == {0}


def test_stats_count_samples_and_forwards():
    model, tokenizer = _load()
    stats = GenerationStats()
    generate(
        model, tokenizer, PROMPTS[:2], RoEConfig(K=5, tau=0.3), max_new_tokens=4, ignore_eos=True, stats=stats
    )
    assert stats.steps == 4 and stats.forwards == 4 and stats.tokens == 8
    assert stats.sample_tokens == 5 * 8


def test_adaptive_generation_spends_fewer_samples():
    model, tokenizer = _load()
    config = RoEConfig(K=5, tau=0.3)
    always, never = GenerationStats(), GenerationStats()
    kw = {"max_new_tokens": 6, "ignore_eos": True}
    full = generate(model, tokenizer, PROMPTS, config, **kw)
    a = generate(model, tokenizer, PROMPTS, config, adaptive_threshold=0.0, stats=always, **kw)
    plain = generate(model, tokenizer, PROMPTS, config.with_(K=1), **kw)
    n = generate(model, tokenizer, PROMPTS, config, adaptive_threshold=1e9, stats=never, **kw)
    assert [o.token_ids for o in a] == [o.token_ids for o in full]
    assert [o.token_ids for o in n] == [o.token_ids for o in plain]
    assert always.sample_tokens == 5 * always.tokens and never.sample_tokens == never.tokens


@pytest.mark.parametrize("family", ["mixtral", "qwen3_next"])
def test_other_families_generate(family):
    model, tokenizer = _load(family)
    outs = generate(model, tokenizer, PROMPTS, RoEConfig(K=4, tau=0.3), max_new_tokens=5, ignore_eos=True)
    assert [len(o.token_ids) for o in outs] == [5, 5, 5]
