"""RoE refuses bad input with errors that say what was wrong and what is allowed."""

from __future__ import annotations

import functools
import json

import pytest
import torch

import moectl
from moectl.ensemble.roe_config import load_profile
from moectl.models.load import ByteTokenizer
from moectl.roe import Ensemble, RoEConfig, generate, score, tune
from moectl.roe.score_data import LMItem, load_items
from moectl.roe.tune import check_tuning


@functools.cache
def _model():
    return moectl.tiny("olmoe", vocab_size=ByteTokenizer.vocab_size)


@pytest.mark.parametrize("k", [0, -2, 1.5, True, "4"])
def test_k_must_be_a_positive_integer(k):
    with pytest.raises(ValueError, match=r"K \(routing samples per token\) must be an integer >= 1"):
        RoEConfig(K=k)


@pytest.mark.parametrize("tau", [-0.1, float("nan"), float("inf"), [0.1, -1.0, 0.0], {1: -0.5}, "hot"])
def test_tau_must_be_finite_and_non_negative(tau):
    with pytest.raises(ValueError, match="tau"):
        RoEConfig(tau=tau)


def test_tau_length_must_match_the_moe_layers():
    model = _model()
    with pytest.raises(ValueError, match="2 temperatures given, the model has 3 MoE layers"):
        Ensemble(model, RoEConfig(tau=[0.1, 0.2]))
    with pytest.raises(ValueError, match=r"tau given for MoE layers \[5\]; the model has MoE layers 0..2"):
        RoEConfig(tau={5: 0.1}).taus(3)
    assert RoEConfig(tau={1: 0.3}).taus(3) == [0.0, 0.3, 0.0]


def test_unknown_aggregation_and_cache():
    with pytest.raises(ValueError, match="aggregation must be one of prob_mean, logprob_mean"):
        RoEConfig(aggregation="mean")
    with pytest.raises(ValueError, match="cache must be one of clean, separate, none"):
        RoEConfig(cache="shared")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tau": -0.1}, "max_tau must be a finite number > 0"),
        ({"max_tau": 0.0}, "max_tau must be a finite number > 0"),
        ({"skip_layers": 2}, "leaves none of the model's 3 MoE layers to tune; use skip_layers <= 1"),
        ({"skip_layers": -1}, "skip_layers .* must be an integer >= 0"),
        ({"trials": 0}, r"trials \(the tuning budget\) must be an integer >= 1"),
        ({"objective": "bleu"}, "objective must be one of ppl, acc"),
        ({"K": 0}, r"K \(routing samples\) must be an integer >= 1"),
    ],
)
def test_tuning_arguments(kwargs, message):
    args = {"num_moe_layers": 3, "K": 4, "objective": "ppl", "trials": 5, "max_tau": 0.5, "skip_layers": 1}
    args["uniform"] = False
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        check_tuning(**args)


def test_tuning_objective_must_fit_the_data():
    with pytest.raises(ValueError, match="objective acc needs multiple-choice items"):
        tune(_model(), ByteTokenizer(), [LMItem("", "text")], K=2, objective="acc", trials=1, progress=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"adaptive_threshold": -1.0}, "entropy threshold must be >= 0"),
    ],
)
def test_decoding_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(_model(), ByteTokenizer(), "hi", RoEConfig(K=2), **kwargs)


def test_right_padding_is_refused():
    ids = torch.tensor([[5, 6, 0]])
    with Ensemble(_model(), RoEConfig(K=2)) as ens, pytest.raises(ValueError, match="left-padded"):
        ens.start(ids, torch.tensor([[1, 1, 0]]))


def test_attention_without_explicit_masks_is_refused():
    model = moectl.tiny("olmoe")
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match=r"attn_implementation 'flash_attention_2'.*eager.*sdpa"):
            Ensemble(model, RoEConfig(K=2))
    finally:
        model.config._attn_implementation = "eager"


def test_profiles_and_data_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="roe tune --out"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON tau profile"):
        load_profile(bad)
    bad.write_text(json.dumps({"taus": [0.1]}))
    with pytest.raises(ValueError, match="'tau' list"):
        load_profile(bad)
    bad.write_text(json.dumps({"tau": [0.1, -0.2]}))
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        RoEConfig.from_profile(bad)
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "ok"}\n{"question": "q"}\n')
    with pytest.raises(ValueError, match=r"data.jsonl:2: expected .*'text'.*got fields \['question'\]"):
        load_items(data)
    data.write_text('{"context": "c", "choices": ["a", "b"], "answer": 5}\n')
    with pytest.raises(ValueError, match=r"choice index 0\.\.1"):
        load_items(data)
    data.write_text('{"text": "a"}\n{"context": "c", "choices": ["a", "b"], "answer": 0}\n')
    with pytest.raises(ValueError, match="mixes item kinds"):
        score(_model(), ByteTokenizer(), data)


def test_recurrent_layers_without_the_linear_attention_cache_api_are_refused():
    """MiniMax's lightning attention keeps its own cache: the clean cache cannot run it per sample."""
    model = moectl.tiny("minimax", layer_types=["linear_attention", "full_attention", "full_attention"])
    with pytest.raises(
        NotImplementedError, match=r"decoder layers \[0\]; use cache='separate' or cache='none'"
    ):
        Ensemble(model, RoEConfig(K=2, tau=0.3))
    ids = torch.tensor([[5, 6, 7]])
    with Ensemble(model, RoEConfig(K=2, tau=0.3, cache="separate")) as ens:
        assert ens.start(ids).logprobs.shape == (1, model.config.vocab_size)
