"""lm.lm_head: the LM head on a few positions at a time, each chunk reduced before the next exists."""

from __future__ import annotations

import math

import pytest
import torch

from moectl.eval.token_scores import head_scores
from moectl.lm.lm_head import add_log_probs, head_chunks, head_rows, target_logprobs


class CountingHead:
    """A linear head [H → V] that counts its calls and the largest chunk it saw, and checks that at
    most one chunk's logits are alive when it is called (the chunks' contract)."""

    def __init__(self, hidden: int = 6, vocab: int = 11) -> None:
        self.weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        self.calls = 0
        self.largest = 0
        self.alive: list = []

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        import weakref

        live = [r for r in self.alive if r() is not None]
        assert not live, "the previous chunk's logits are still alive"
        self.calls += 1
        self.largest = max(self.largest, h.shape[:-1].numel())
        out = h.to(self.weight.dtype) @ self.weight.T
        self.alive = [weakref.ref(out)]
        return out


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("rows", [1, 3, 7, 100])
def test_chunks_cover_every_position_once(dim: int, rows: int) -> None:
    hidden = torch.randn(5, 7, 6, dtype=torch.float64)
    head = CountingHead()
    full = hidden @ head.weight.T
    seen = torch.zeros(hidden.shape[dim], dtype=torch.long)
    for span, logits in head_chunks(head, hidden, rows, dim=dim):
        torch.testing.assert_close(logits, full[span] if dim == 0 else full[:, span])
        seen[span] += 1
        del logits
    assert seen.tolist() == [1] * hidden.shape[dim]
    assert head.calls == math.ceil(hidden.shape[dim] / rows)


def test_reductions_match_the_whole_distribution() -> None:
    """target_logprobs, add_log_probs and head_scores equal log_softmax of the full logits, chunked
    at 2 positions per head call (the one-chunk-alive contract checked by the head)."""
    torch.manual_seed(1)
    head = CountingHead()
    hidden = torch.randn(9, 6, dtype=torch.float64)
    targets = torch.randint(0, 11, (9,))
    full = torch.log_softmax(hidden @ head.weight.T, -1)
    want = full.gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(target_logprobs(head, hidden, targets, 2), want)
    lp, greedy = head_scores(head, hidden[:, None], targets, 2)
    torch.testing.assert_close(lp, want)
    assert greedy.tolist() == (full.argmax(-1) == targets).tolist()
    assert head.largest == 2

    two = torch.randn(9, 2, 6, dtype=torch.float64)  # K = 2 copies, averaged in probability space
    mixed = torch.logsumexp(torch.log_softmax(two @ head.weight.T, -1), dim=1) - math.log(2)
    lp2, greedy2 = head_scores(head, two, targets, 4)  # 4 rows = 2 positions of 2 copies per call
    torch.testing.assert_close(lp2, mixed.gather(-1, targets[:, None]).squeeze(-1))
    assert greedy2.tolist() == (mixed.argmax(-1) == targets).tolist()

    assert head.largest == 4
    head.largest = 0
    batch = hidden.view(3, 3, 6)
    acc = add_log_probs(head, batch, None, "prob_mean", 3)  # 1 position of 3 rows per call
    acc = add_log_probs(head, batch, acc, "prob_mean", 3)
    torch.testing.assert_close(acc, full.view(3, 3, -1) + math.log(2))
    assert head.largest == 3


def test_head_rows_fit_the_budget() -> None:
    assert head_rows(50_304) == (1 << 27) // (12 * 50_304)
    assert head_rows(10**9) == 1  # never zero
