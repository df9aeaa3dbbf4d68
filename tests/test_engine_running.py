"""The running batch owns its rows' tensors, and the sampler's tensors are built when the batch
changes, not at every step (issue #39's floor): each piece against the per-step computation it
replaces, and the engine built on them against itself."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

import moectl
from moectl.engine import Engine, EngineConfig, SamplingParams
from moectl.engine import sampling_batch as sb
from moectl.engine.running import RunningBatch
from moectl.engine.sampling import choose_tokens
from moectl.engine.sampling_batch import SamplingBatch


def params(i: int) -> SamplingParams:
    return SamplingParams(temperature=[0.0, 0.7, 1.3][i % 3], top_p=[1.0, 0.9][i % 2], top_k=i % 4, min_p=0.02 * (i % 2))


def per_step(logits: torch.Tensor, ps: list[SamplingParams], keys: list[int], steps: list[int]) -> torch.Tensor:
    """What the engine computed at every step before: the tensors from the requests' fields."""
    return choose_tokens(
        logits.float(), torch.tensor([p.temperature for p in ps]), torch.tensor([p.top_p for p in ps]),
        torch.tensor(keys), torch.tensor(steps), top_k=torch.tensor([p.top_k for p in ps]),
        min_p=torch.tensor([p.min_p for p in ps]),
    )  # fmt: skip


def test_a_sampling_batch_kept_across_steps_chooses_as_one_built_each_step():
    torch.manual_seed(0)
    ps, keys, steps = [params(i) for i in range(6)], [11 * i + 3 for i in range(6)], [0, 4, 1, 0, 9, 2]
    batch = SamplingBatch.of(ps, keys, steps, "cpu")
    for step in range(5):
        logits = torch.randn(6, 50)
        assert torch.equal(batch.choose(logits), per_step(logits, ps, keys, [s + step for s in steps]))
        batch.advance()
    kept = [0, 2, 5]
    batch = batch.keep(torch.tensor(kept), [ps[i] for i in kept])
    joined = batch.join(SamplingBatch.of([ps[1]], [keys[1]], [0], "cpu"))
    logits = torch.randn(4, 50)
    expected = per_step(logits, [ps[i] for i in [*kept, 1]], [keys[i] for i in [*kept, 1]],
                        [steps[0] + 5, steps[2] + 5, steps[5] + 5, 0])  # fmt: skip
    assert torch.equal(joined.choose(logits), expected)


def test_an_all_greedy_batch_is_an_argmax():
    batch = SamplingBatch.of([SamplingParams(temperature=0.0)] * 3, [1, 2, 3], [0, 0, 0], "cpu")
    logits = torch.randn(3, 20)
    assert batch.greedy and torch.equal(batch.choose(logits), logits.argmax(-1))


@dataclass
class Req:
    copies: int
    seen: int
    params: SamplingParams
    switches: int = 0


def test_rows_join_and_leave_together():
    """Requests of 1, 2 and 1 copies: every per-row tensor keeps the rows of the requests still in."""
    batch = RunningBatch(torch.device("cpu"))
    reqs = [Req(1, 3, params(0)), Req(2, 5, params(1)), Req(1, 2, params(2))]
    rows = 4
    mask = torch.ones(rows, 6, dtype=torch.long)
    prev = torch.arange(rows, dtype=torch.float)[:, None, None].expand(rows, 2, 3).clone()
    switches = torch.tensor([[1, 0], [2, 2], [0, 3], [4, 4]])
    cache = DynamicCache()
    cache.update(torch.arange(rows, dtype=torch.float)[:, None, None, None].expand(rows, 1, 6, 2).clone(),
                 torch.zeros(rows, 1, 6, 2), 0)  # fmt: skip
    first = batch.join(reqs, cache, mask, prev, switches, torch.tensor([10, 20, 21, 30]),
                       SamplingBatch.of([r.params for r in reqs], [1, 2, 3], [0, 0, 0], "cpu"))  # fmt: skip
    assert first == 0 and batch.rows == 4 and batch.positions.tolist() == [[3], [5], [5], [2]]
    batch.advance(batch.cache, torch.ones(rows, 7, dtype=torch.bool), torch.tensor([11, 22, 23, 31]))
    assert batch.positions.tolist() == [[4], [6], [6], [3]] and [r.seen for r in reqs] == [4, 6, 3]
    assert batch.sampling.steps.tolist() == [1, 1, 1]
    done = batch.drop({1})
    assert done == [reqs[1]] and reqs[1].switches == 2 + 2 + 0 + 3  # its two rows' counts
    assert batch.last.tolist() == [11, 31] and batch.positions.tolist() == [[4], [3]]
    assert batch.prev[:, 0, 0].tolist() == [0.0, 3.0] and batch.switches.tolist() == [[1, 0], [4, 4]]
    assert batch.valid.shape == (2, 7) and batch.sampling.keys.tolist() == [1, 3]
    assert batch.cache.layers[0].keys[:, 0, 0, 0].tolist() == [0.0, 3.0]
    assert batch.drop({0, 1}) == [reqs[0], reqs[2]] and not batch and batch.last is None


def test_the_engine_builds_sampling_tensors_per_join_not_per_step(monkeypatch):
    model, tok, _ = moectl.load("tiny:olmoe", dtype="float32")
    built: list[int] = []
    of = SamplingBatch.of.__func__

    def counting(cls, ps, keys, steps, device):
        built.append(len(ps))
        return of(cls, ps, keys, steps, device)

    monkeypatch.setattr(sb.SamplingBatch, "of", classmethod(counting))
    engine = Engine(model, tok, EngineConfig(max_batch=4, log_forwards=True))
    prompts = ["Hello", "The cat", "One two three", "x"]
    done = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True))
    decodes = sum(1 for kind, _ in engine.forward_log if kind == "decode")
    prefills = sum(1 for kind, _ in engine.forward_log if kind == "prefill")
    assert all(len(c.token_ids) == 24 for c in done)
    assert decodes >= 23 and len(built) == prefills  # one build per join, none per decoding step
