"""Held-out quality of a routing policy: the chunked per-token KL is the whole-batch one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moectl.adapters.inspect import inspect
from moectl.models.load import load_model
from moectl.options.evaluate import _batch, heldout_quality, token_kl
from moectl.options.random_options import RandomOptions
from moectl.options.rollout import positions
from moectl.routing import route


def _reference(
    teacher_logits: torch.Tensor, student_logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unchunked computation: two [B, T, V] float32 log-softmaxes at once."""
    lt = F.log_softmax(teacher_logits.float(), -1)
    ls = F.log_softmax(student_logits.float(), -1)
    kl = (lt.exp() * (lt - ls)).sum(-1)
    target = targets[..., None]
    return kl, lt.gather(-1, target).squeeze(-1), ls.gather(-1, target).squeeze(-1)


def _random_logits(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher and student logits as the [:, :-1] views the evaluation takes, and their targets."""
    generator = torch.Generator().manual_seed(0)
    rows, length, vocab = 3, 11, 53
    teacher = (3 * torch.randn(rows, length, vocab, generator=generator)).to(dtype)
    student = (3 * torch.randn(rows, length, vocab, generator=generator)).to(dtype)
    targets = torch.randint(0, vocab, (rows, length - 1), generator=generator)
    return teacher[:, :-1], student[:, :-1], targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 4, 128])
def test_chunked_kl_equals_the_whole_batch_computation(dtype, chunk):
    teacher, student, targets = _random_logits(dtype)
    got = token_kl(teacher, student, targets, chunk=chunk)
    for value, expected in zip(got, _reference(teacher, student, targets), strict=True):
        assert value.dtype == torch.float32 and value.shape == targets.shape
        torch.testing.assert_close(value, expected, rtol=1.3e-6, atol=1e-5)


def test_a_tiny_chunk_gives_the_same_numbers_as_a_large_one():
    teacher, student, targets = _random_logits(torch.float32)
    small = token_kl(teacher, student, targets, chunk=1)
    large = token_kl(teacher, student, targets, chunk=10_000)
    assert all(torch.equal(a, b) for a, b in zip(small, large, strict=True))


def test_chunk_must_be_positive():
    teacher, student, targets = _random_logits(torch.float32)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        token_kl(teacher, student, targets, chunk=0)


def test_heldout_quality_is_the_whole_batch_computation():
    """KL, perplexities and token counts of a random-options policy match the unchunked reference."""
    model, tokenizer = load_model("tiny:olmoe")
    info = inspect(model)
    texts = ["hello world, the cat sat on the mat", "def f(x): return x + 1", "a", "Once upon a time there"]

    def policies() -> list:
        return [RandomOptions(2, seed=0)]

    got = heldout_quality(model, info, tokenizer, {"d": texts}, policies, max_length=16, batch_size=3)
    kl_docs, nll_s, nll_t, count = [], 0.0, 0.0, 0
    with torch.no_grad():
        for start in range(0, len(texts), 3):
            ids, attn = _batch(tokenizer, texts[start : start + 3], 16, torch.device("cpu"))
            kwargs = {"input_ids": ids, "attention_mask": attn, "position_ids": positions(attn)}
            teacher_logits = model(**kwargs).logits[:, :-1]
            with route(model, policies(), info=info):
                student_logits = model(**kwargs).logits[:, :-1]
            kl, lp_t, lp_s = _reference(teacher_logits, student_logits, ids[:, 1:])
            pair = (attn[:, :-1] & attn[:, 1:]).float()
            kl_docs += ((kl * pair).sum(1) / pair.sum(1).clamp(min=1)).tolist()
            nll_s -= float((lp_s * pair).sum())
            nll_t -= float((lp_t * pair).sum())
            count += int(pair.sum())
    row = got["domains"]["d"]
    assert row["tokens"] == count and row["documents"] == len(texts)
    assert row["kl"] == pytest.approx(sum(kl_docs) / len(kl_docs), rel=1e-5, abs=1e-7) and row["kl"] > 0
    assert row["ppl"] == pytest.approx(math.exp(nll_s / count), rel=1e-5)
    assert row["teacher_ppl"] == pytest.approx(math.exp(nll_t / count), rel=1e-5)
