"""RoE inside the evaluation harness: `moectl eval --roe` scores and generates with the RoE ensemble.

The harness's RoE log-likelihoods must be RoE's own (the clean-cache definition, RoE §2.3), the
same whatever batch or padding lm-eval gives a request; with tau = 0 RoE is the plain model; RoE
generation through lm-eval decodes what ``moectl.roe.generate`` decodes.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from _eval_data import tiny_eval_env
from moectl.cli import app
from moectl.ensemble.roe_config import RoEConfig
from moectl.ensemble.roe_config import parse_roe_spec as roe_config
from moectl.eval.eval_tokenizer import byte_tokenizer
from moectl.eval.forward import BatchRouting, static_plan, to_left_padding
from moectl.eval.lm_backend import MoectlLM
from moectl.eval.lm_tasks import run_lm_eval
from moectl.roe.parallel import RoEScoringInputs, _stepwise_log_probs, ensemble_log_probs
from moectl.roe.score import token_logprobs_parallel

runner = CliRunner()
NOISY = RoEConfig(K=3, tau=1.0, seed=7)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    yield from tiny_eval_env(tmp_path_factory)


def _lls(raw: dict, task: str = "arc_easy") -> torch.Tensor:
    samples = sorted(raw["samples"][task], key=lambda s: s["doc_id"])
    return torch.tensor([[resp[0][0] for resp in s["resps"]] for s in samples], dtype=torch.float64)


def test_to_left_padding_round_trips_rows_padded_on_either_side():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    ids = torch.arange(20).view(4, 5) * mask
    there, back = to_left_padding(mask)
    left = ids.gather(1, there)
    assert mask.gather(1, there).tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1], [1] * 5]
    assert left[0, 2:].tolist() == [0, 1, 2] and left[2, 3:].tolist() == [11, 12]
    assert torch.equal(left.gather(1, back), ids)
    with pytest.raises(ValueError, match="contiguous"):
        to_left_padding(torch.tensor([[1, 0, 1]]))


def test_full_distributions_agree_with_token_scores_and_the_stepwise_definition(env):
    _, model, info = env
    torch.manual_seed(0)
    ids = torch.randint(3, 259, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    for config in (NOISY, NOISY.with_(aggregation="logprob_mean")):
        full = ensemble_log_probs(RoEScoringInputs(model, ids, mask, config, info))
        assert full.shape == (2, 9, 259)
        torch.testing.assert_close(full.exp().sum(-1)[mask.bool()], torch.ones(15), atol=1e-4, rtol=0)
        gathered = full[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]
        per_token = token_logprobs_parallel(model, ids, mask, config, info)[:, 1:]
        torch.testing.assert_close(gathered, per_token, atol=1e-4, rtol=0)
        stepwise = _stepwise_log_probs(RoEScoringInputs(model, ids, mask, config, info))
        real = mask.bool()
        torch.testing.assert_close(full[real], stepwise[real], atol=1e-4, rtol=0)


def test_harness_scores_with_roe_independently_of_batching(env):
    cache, model, _ = env
    plain = run_lm_eval(MoectlLM(model, byte_tokenizer(), batch_size=8), ["arc_easy"], cache, log_samples=True)
    clean_lm = MoectlLM(model, byte_tokenizer(), plan=static_plan(roe=NOISY.with_(tau=0.0)), batch_size=8)
    clean = run_lm_eval(clean_lm, ["arc_easy"], cache, log_samples=True)
    torch.testing.assert_close(_lls(clean), _lls(plain), atol=1e-4, rtol=0)  # tau = 0: the plain model
    lms = [MoectlLM(model, byte_tokenizer(), plan=static_plan(roe=NOISY), batch_size=bs) for bs in (8, 1)]
    runs = [run_lm_eval(lm, ["arc_easy"], cache, log_samples=True) for lm in lms]
    torch.testing.assert_close(_lls(runs[0]), _lls(runs[1]), atol=1e-4, rtol=0)
    assert not torch.allclose(_lls(runs[0]), _lls(plain), atol=1e-3), "the Gumbel noise is active"


def test_harness_generates_what_roe_generate_decodes(env):
    from moectl.roe.roe_generate import generate

    cache, model, _ = env
    lm = MoectlLM(model, byte_tokenizer(), plan=static_plan(roe=NOISY), batch_size=2)
    raw = run_lm_eval(lm, ["gsm8k"], cache, num_fewshot=0, log_samples=True, gen_kwargs={"max_gen_toks": 6})
    samples = sorted(raw["samples"]["gsm8k"], key=lambda s: s["doc_id"])
    prompts = [s["arguments"][0][0] for s in samples]
    until = samples[0]["arguments"][0][1]["until"]
    direct = generate(model, byte_tokenizer(), prompts, NOISY, max_new_tokens=6, stop=until, batch_size=2)
    assert [s["resps"][0][0] for s in samples] == [g.text for g in direct]


def test_plan_refuses_repeats_with_roe():
    with pytest.raises(ValueError, match="not both"):
        BatchRouting([], repeats=2, roe=NOISY)


def test_roe_spec_parsing(tmp_path):
    assert roe_config("K=4,tau=0.5", seed=3) == RoEConfig(K=4, tau=0.5, seed=3)
    assert roe_config("K=2,tau=0.1/0.2,aggregation=logprob_mean", 0).tau == [0.1, 0.2]
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"tau": [0.3, 0.4], "K": 8}))
    assert roe_config(str(profile), 0) == RoEConfig(K=8, tau=[0.3, 0.4])
    assert roe_config(f"{profile},K=4", 0).K == 4
    with pytest.raises(FileNotFoundError, match="neither a tau profile"):
        roe_config("missing.json", 0)
    with pytest.raises(ValueError, match="cannot read 'bogus'"):
        roe_config("K=2,bogus", 0)


def test_eval_cli_with_roe(env, tmp_path):
    cache, _, _ = env
    out = tmp_path / "roe.json"
    args = ["eval", "tiny:olmoe", "--tasks", "arc_easy", "--cache", str(cache), "--limit", "3"]
    result = runner.invoke(app, [*args, "--roe", "K=2,tau=0.5", "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["routing"]["label"] == "roe-K2" and doc["routing"]["roe"]["K"] == 2
    assert doc["routing"]["roe"]["tau"] == [0.5] * len(doc["routing"]["roe"]["tau"])
    assert doc["tasks"]["arc_easy"]["n"] == 3 and 0 <= doc["tasks"]["arc_easy"]["metrics"]["acc"]["value"] <= 1
    result = runner.invoke(app, [*args, "--roe", "K=0,tau=1"])
    assert result.exit_code == 2 and "K (routing samples per token) must be an integer >= 1" in result.output
