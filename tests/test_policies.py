"""One policy format: to_dict / from_dict / save for every policy, ``load_policy`` for every file moectl
ever wrote, and every verb that takes a policy taking the same files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import moectl
from conftest import random_ids
from moectl.ensemble.roe_config import RoEConfig, save_profile
from moectl.models.load import load_model
from moectl.offload.residency import ControllerResidency, LRUPolicy, OptionPolicy, StaticPolicy, parse_policy
from moectl.options.controller import build_controller
from moectl.options.policy import ControllerPolicy
from moectl.options.random_options import RandomOptions
from moectl.routing import DocumentPool, ExpertMask, GumbelTopK, load_policy, policy_types, save_policy
from moectl.subsets.files import save_subset

runner = CliRunner()
KEEP = {"0": [0, 1, 2, 3], "1": [2, 3, 4, 5], "2": [4, 5, 6, 7]}  # tiny OLMoE: 3 MoE layers, 8 experts


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run folder of `moectl options train` (final/, checkpoints/), one step on tiny OLMoE."""
    from moectl.options.trainer import OptionsConfig, train_options

    out = tmp_path_factory.mktemp("ctrl") / "run"
    model, tok = load_model("tiny:olmoe")
    cfg = OptionsConfig(k_hat=4, steps=1, batch_size=2, max_new_tokens=4, lora_r=4, lora_alpha=4)
    train_options(model, tok, ["hello there", "a cat"], cfg, out, progress=False)
    return out


def _write(path, data):
    path.write_text(json.dumps(data))
    return path


def _lists(mask: ExpertMask) -> dict[str, list[int]]:
    return {str(k): v for k, v in mask.expert_lists().items()}


# -- every policy is a config -------------------------------------------------------------------
def test_every_policy_round_trips_through_dict_and_file(olmoe, tmp_path):
    info = moectl.inspect(olmoe)
    policies = [
        ExpertMask.from_lists(info, {0: [0, 1, 2, 3]}, renorm="stock"),
        ExpertMask({1: torch.tensor([[1, 1, 0, 0, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0]])}),
        DocumentPool(4, mode="full"),
        GumbelTopK(0.3, seed=7),
        GumbelTopK([0.0, 0.2, 0.4], seed=1),
        GumbelTopK({1: 0.5}),
        RoEConfig(K=4, tau=[0.0, 0.3, 0.1], aggregation="logprob_mean", cache="separate", seed=3),
        RandomOptions(4, seed=2),
        LRUPolicy(),
        OptionPolicy(4),
        StaticPolicy({0: [0, 1], 2: [6, 7]}),
    ]
    for i, policy in enumerate(policies):
        data = policy.to_dict()
        assert data["type"] == policy.policy_type and data["format_version"] == 1
        assert data["type"] in policy_types()
        json.dumps(data)  # JSON-ready
        again = load_policy(data, info)
        assert type(again) is type(policy) and again.to_dict() == data
        path = policy.save(tmp_path / f"p{i}.json")
        assert load_policy(path, info).to_dict() == data
    composed = save_policy(tmp_path / "list.json", policies[2:4])
    loaded = load_policy(composed, olmoe)
    assert [type(p) for p in loaded] == [DocumentPool, GumbelTopK]
    mask = load_policy({"type": "expert_mask", "experts": {"0": [0, 1]}, "num_experts": 8})  # no model
    assert mask.masks[0].tolist() == [True, True] + [False] * 6


def test_controller_policy_saves_a_folder_and_a_reference(olmoe, tmp_path):
    info = moectl.inspect(olmoe)
    policy = ControllerPolicy(build_controller(info, 4), mode="greedy", seed=5)
    with pytest.raises(ValueError, match="never saved"):
        policy.to_dict()
    folder = policy.save(tmp_path / "ctrl")
    assert (folder / "controller.json").exists() and (folder / "policy.json").exists()
    ref = policy.save(tmp_path / "refs" / "ctrl.json")
    assert json.loads(ref.read_text())["path"] == "../ctrl"  # relative to the file's folder
    for spec in (folder, ref, f"controller:{folder}", str(folder)):
        loaded = load_policy(spec, info)  # a bare controller (no adapters, no routers): no model needed
        assert isinstance(loaded, ControllerPolicy) and (loaded.mode, loaded.seed) == ("greedy", 5)
        assert loaded.path.resolve() == folder.resolve()
    policy.controller.save(tmp_path / "bare")  # OptionController.save: no policy.json, no adapters
    assert load_policy(tmp_path / "bare", info).to_dict()["mode"] == "sample"
    residency = ControllerResidency.from_dict(policy.to_dict(), info)
    assert residency.k_hat == 4 and residency.to_dict()["type"] == "controller"


def test_newer_versions_unknown_types_and_bad_fields_are_refused(olmoe):
    info = moectl.inspect(olmoe)
    with pytest.raises(ValueError, match="format_version 2 was written by a newer moectl"):
        load_policy({"type": "gumbel", "format_version": 2, "tau": 0.1}, info)
    with pytest.raises(ValueError, match=r"unknown policy type 'mask'; allowed: .*expert_mask"):
        load_policy({"type": "mask"}, info)
    with pytest.raises(ValueError, match="exactly one of 'experts'"):
        load_policy({"type": "expert_mask", "experts": {"0": [0, 1]}, "everywhere": [0, 1]}, info)
    with pytest.raises(ValueError, match=r"out of range; valid ids are 0\.\.7"):
        load_policy({"type": "expert_mask", "experts": {"0": [0, 9]}}, info)
    with pytest.raises(ValueError, match="needs 'd'"):
        load_policy({"type": "document_pool"}, info)
    with pytest.raises(ValueError, match="pass the model"):
        load_policy({"type": "expert_mask", "experts": {"0": [0, 1]}})
    with pytest.raises(ValueError, match='needs a "type"'):
        load_policy({"foo": 1}, info)
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        load_policy("fifo")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_policy("nope/policy.json")


# -- files earlier versions wrote ---------------------------------------------------------------
def test_every_older_file_form_loads(olmoe, tmp_path):
    info = moectl.inspect(olmoe)
    calibration = {"data": "math.jsonl", "documents": 5, "tokens": 80}
    old_forms = {
        # save_subset before the type existed (`subset select --out`, `baselines --out`)
        "subset_file": {"model": "tiny:olmoe", "method": "router", "keep": KEEP, "calibration": calibration},
        # `moectl subset select --json`
        "select_json": {
            "model": "tiny:olmoe",
            "method": "router",
            "keep": KEEP,
            "calibration": {},
            "out": "x",
        },
        # `moectl baselines --json` of a fixed baseline
        "baselines_json": {
            "model": "tiny:olmoe",
            "method": "frequency",
            "k_hat": 4,
            "num_experts": 8,
            "top_k": 2,
            "per_token": False,
            "keep": KEEP,
            "seed": 0,
            "calibration": {},
        },
        # `serve-offload --policy static:FILE` files: a bare mapping, or under "subsets"
        "serve_bare": KEEP,
        "serve_subsets": {"subsets": KEEP},
        # eval --policy files before format_version
        "eval_policy": {"type": "expert_mask", "experts": KEEP, "renorm": "pruned"},
    }
    for name, data in old_forms.items():
        mask = load_policy(_write(tmp_path / f"{name}.json", data), olmoe)
        assert isinstance(mask, ExpertMask) and _lists(mask) == KEEP, name
    assert load_policy(tmp_path / "subset_file.json", info).meta["calibration"] == calibration
    everywhere = load_policy(
        _write(tmp_path / "e.json", {"type": "expert_mask", "everywhere": [0, 1, 2, 3]}), info
    )
    assert _lists(everywhere) == {str(i): [0, 1, 2, 3] for i in range(3)}
    old_list = [
        {"type": "document_pool", "d": 4, "mode": "causal"},
        {"type": "gumbel", "tau": {"1": 0.3}, "seed": 2},
    ]
    pool, gumbel = load_policy(_write(tmp_path / "list.json", old_list), info)
    assert (pool.d, pool.mode, gumbel.tau_spec, gumbel.seed) == (4, "causal", {1: 0.3}, 2)
    # `moectl baselines --method random --json`: no fixed mask, a fresh random k-hat set per token
    random = {
        "model": "tiny:olmoe",
        "method": "random",
        "k_hat": 4,
        "keep": None,
        "seed": 3,
        "per_token": True,
    }
    policy = load_policy(_write(tmp_path / "random.json", random), info)
    assert isinstance(policy, RandomOptions) and (policy.k_hat, policy.seed) == (4, 3)
    # the new save_subset output is an expert_mask file with provenance, still keyed "keep"
    new = json.loads(save_subset(tmp_path / "new.subset.json", {int(k): v for k, v in KEEP.items()},
                                 model="tiny:olmoe", method="router").read_text())  # fmt: skip
    assert (new["type"], new["format_version"], new["keep"]) == ("expert_mask", 1, KEEP)
    assert _lists(load_policy(tmp_path / "new.subset.json", info)) == KEEP


def test_old_and_new_roe_profiles_load(tmp_path):
    tau = [0.0, 0.25, 0.0]
    old = {"format": "moectl-roe-profile/1", "tau": tau, "K": 3, "aggregation": "prob_mean",
           "objective": "ppl", "seed": 5, "history": []}  # fmt: skip
    config = load_policy(_write(tmp_path / "old.json", old))
    assert isinstance(config, RoEConfig) and (config.K, config.tau, config.seed) == (3, tau, 0)
    assert RoEConfig.from_profile(tmp_path / "old.json") == config
    assert load_policy(_write(tmp_path / "bare.json", {"tau": {"1": 0.2}})).taus(3) == [0.0, 0.2, 0.0]
    path = save_profile(tmp_path / "new.json", tau, K=3, aggregation="prob_mean", seed=5, objective="ppl")
    data = json.loads(path.read_text())
    assert (data["type"], data["format_version"]) == ("roe", 1) and "format" not in data
    new = RoEConfig.from_profile(path)
    assert (new.K, new.tau, new.seed) == (3, tau, 5)  # a versioned profile carries its seed
    assert new.meta["objective"] == "ppl" and new.to_dict()["objective"] == "ppl"
    with pytest.raises(ValueError, match="unknown profile format"):
        load_policy({"format": "other/2", "tau": 0.1})


def test_exported_subset_folder_and_controller_runs_load(tmp_path, trained):
    from moectl.subsets.export import export_subset

    model, _ = load_model("tiny:olmoe")
    export_subset(model, {int(k): v for k, v in KEEP.items()}, tmp_path / "math-4")
    mask = load_policy(tmp_path / "math-4", model)  # its moectl_subset.json: the mask on the full model
    assert isinstance(mask, ExpertMask) and _lists(mask) == KEEP
    for spec in (trained, trained / "final", f"controller:{trained}"):
        fresh, _ = load_model("tiny:olmoe")
        before = fresh.model.layers[0].mlp.gate.weight.clone()
        policy = load_policy(spec, fresh)
        assert isinstance(policy, ControllerPolicy) and policy.controller.k_hat == 4
        assert policy.path == trained / "final" and policy.options["k_hat"] == 4
        assert not torch.equal(fresh.model.layers[0].mlp.gate.weight, before)  # trained routers merged in
        merged = fresh.model.layers[0].self_attn.q_proj.weight.clone()
        again = load_policy(spec, fresh)  # the same folder on the same model: merged once only
        assert again.controller.k_hat == 4 and torch.equal(
            fresh.model.layers[0].self_attn.q_proj.weight, merged
        )
    later = load_policy(trained)  # without a model: the trained weights merge in at the first route()
    fresh, _ = load_model("tiny:olmoe")
    before = fresh.model.layers[0].mlp.gate.weight.clone()
    with moectl.route(fresh, later):
        assert not torch.equal(fresh.model.layers[0].mlp.gate.weight, before)
    reference, _ = load_model("tiny:olmoe")
    load_policy(trained, reference)
    assert torch.equal(fresh.model.layers[0].mlp.gate.weight, reference.model.layers[0].mlp.gate.weight)
    q = [m.model.layers[0].self_attn.q_proj.weight for m in (fresh, reference)]
    assert torch.equal(*q)  # the LoRA adapters merged once, as with the model given
    with pytest.raises(ValueError, match="not a controller folder"):
        load_policy(f"controller:{tmp_path / 'math-4'}")


# -- every place that takes a policy ------------------------------------------------------------
@torch.no_grad()
def test_route_takes_files_dicts_strings_and_residency_policies(olmoe, tmp_path):
    subset = save_subset(tmp_path / "math.subset.json", {int(k): v for k, v in KEEP.items()})
    ids = random_ids()
    with moectl.route(olmoe, ExpertMask.from_lists(moectl.inspect(olmoe), KEEP), record=True) as ref:
        expected = olmoe(ids).logits
    for spec in (subset, str(subset), f"static:{subset}", json.loads(subset.read_text()), [str(subset)]):
        with moectl.route(olmoe, spec, record=True) as session:
            assert torch.equal(olmoe(ids).logits, expected)
        assert torch.equal(session.trace.allowed[0], ref.trace.allowed[0])
    with moectl.route(olmoe, ["option:4", "lru"], record=True) as plain:
        olmoe(ids)
    assert plain.trace.allowed == {}
    with pytest.raises(ValueError, match="ensemble of K routings"):
        moectl.route(olmoe, RoEConfig(K=2, tau=0.1))


def test_serve_offload_takes_a_subset_file(tmp_path):
    from moectl.cli.serve_offload import serve_app

    subset = save_subset(
        tmp_path / "math.subset.json", {int(k): v for k, v in KEEP.items()}, model="tiny:olmoe"
    )
    assert parse_policy(f"static:{subset}").subsets == {int(k): v for k, v in KEEP.items()}
    model, _ = load_model("tiny:olmoe")
    assert isinstance(parse_policy(subset, model), StaticPolicy) and isinstance(
        parse_policy("option:4"), OptionPolicy
    )
    with pytest.raises(ValueError, match="one residency policy"):
        parse_policy({"type": "gumbel", "tau": 0.1})
    for spec in (f"static:{subset}", str(subset)):
        out = tmp_path / "serve.json"
        args = [
            "--tiny",
            "olmoe",
            "--budget",
            "4",
            "--policy",
            spec,
            "--max-new-tokens",
            "2",
            "--json",
            str(out),
        ]
        result = runner.invoke(serve_app, args)
        assert result.exit_code == 0, result.output
        data = json.loads(out.read_text())
        assert data["policy"] == "static" and data["decode_loads"] == 0


def test_eval_takes_a_subset_file_and_a_profile(tmp_path):
    from moectl.cli import app

    subset = save_subset(
        tmp_path / "math.subset.json", {int(k): v for k, v in KEEP.items()}, model="tiny:olmoe"
    )
    profile = save_profile(tmp_path / "profile.json", [0.0, 0.2, 0.0], K=2, aggregation="prob_mean")
    corpus = _write(tmp_path / "c.jsonl", {"text": "x = 1\ny = 2", "domain": "code"})
    for policy, label in ((subset, "math.subset"), (profile, "profile+roe-K2")):
        out = tmp_path / f"out-{label}.json"
        args = ["eval", "tiny:olmoe", "--perplexity", str(corpus), "--policy", str(policy), "--out", str(out)]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        doc = json.loads(out.read_text())
        assert doc["routing"]["label"] == label and doc["routing"]["policies"][0]["format_version"] == 1
    masked = json.loads((tmp_path / "out-math.subset.json").read_text())
    assert masked["routing"]["experts_allowed"] == 4 and masked["tasks"]["perplexity/all"]["switch_rate"]
    roe = json.loads((tmp_path / "out-profile+roe-K2.json").read_text())["routing"]["roe"]
    assert roe["K"] == 2 and roe["tau"] == [0.0, 0.2, 0.0]


def test_switch_rate_under_a_controller_reads_the_recorded_mask(tmp_path, trained):
    from moectl.cli import app

    model, tok = load_model("tiny:olmoe")
    policy = load_policy(trained)  # no model needed: route() merges the trained weights into it
    with moectl.route(model, policy, record=True) as session:
        from moectl.generate import Prompt, generate

        generate(model, tok, [Prompt("hello"), Prompt("the cat")], 6, 0.5, progress=False)
    report = moectl.switch_rate(session.trace)  # no source= needed: the controller's ω at every layer
    assert report.source == "allowed" and report.region == "generated"
    assert report.mean == moectl.switch_rate(session.trace, source="allowed").mean
    assert moectl.switch_rate(session.trace, k_hat=4).source == "router"
    out = tmp_path / "sr.json"
    args = [
        "switch-rate",
        "--tiny",
        "olmoe",
        "--policy",
        str(trained),
        "--max-new-tokens",
        "4",
        "--json",
        str(out),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert (
        data["source"] == "allowed" and data["policy"] == str(trained) and 0 <= data["overall"]["mean"] <= 1
    )
    result = runner.invoke(app, ["switch-rate", "--tiny", "olmoe", "--policy", "option:x"])
    assert result.exit_code == 2 and "integer k-hat" in result.output


@torch.no_grad()
def test_switch_rate_defaults_on_a_plain_forward(olmoe):
    with moectl.route(olmoe, record=True) as session:
        olmoe(random_ids(length=16))
    report = moectl.switch_rate(session.trace, k_hat=4)
    assert report.region == "all" and report.source == "router" and report.steps == 2 * 15 * 3
    with pytest.raises(ValueError, match="two consecutive measured positions"):
        moectl.switch_rate(session.trace, k_hat=4, region="generated")


# -- the notebook API ---------------------------------------------------------------------------
def test_load_and_roe_on_plain_strings_with_a_profile(tmp_path):
    model, tokenizer, info = moectl.load("tiny:olmoe")
    assert info.num_moe_layers == 3 and moectl.load("tiny:olmoe").info.top_k == 2
    profile = save_profile(tmp_path / "p.json", [0.0, 0.3, 0.0], K=2, aggregation="prob_mean")
    texts = ["The cat sat on the mat.", "def f(x): return x"]
    result = moectl.roe.score(model, tokenizer, texts, profile)
    items = [moectl.roe.score_data.LMItem("", t) for t in texts]
    assert result.ppl == moectl.roe.score(model, tokenizer, items, RoEConfig.from_profile(profile)).ppl
    outs = moectl.roe.generate(model, tokenizer, ["Hello"], str(profile), max_new_tokens=3)
    assert len(outs) == 1
    with pytest.raises(ValueError, match="expected a RoE config"):
        moectl.roe.score(model, tokenizer, texts, {"type": "gumbel", "tau": 0.1})


def test_import_moectl_stays_light():
    code = (
        "import sys, moectl; heavy = ('lm_eval', 'optuna', 'peft', 'matplotlib', 'accelerate', 'transformers');"
        "print([m for m in heavy if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
