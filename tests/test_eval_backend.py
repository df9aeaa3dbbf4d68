"""``lm_eval --model moectl``: registration, model_args, lm-eval's own entry points, same numbers as ``moectl eval``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _eval_data import small_cache
from moectl.eval import model_args as margs

GUMBEL = {"type": "gumbel", "tau": 1.0, "seed": 3}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """(eval cache, rendered task folder, a Gumbel policy file)."""
    from moectl.eval.lm_tasks import render_tasks

    root = tmp_path_factory.mktemp("backend")
    cache = small_cache(root / "evals")
    policy = root / "gumbel.json"
    policy.write_text(json.dumps(GUMBEL))
    return cache, render_tasks(cache, root / "tasks"), policy


def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_registration_after_and_before_lm_eval_and_import_stays_light():
    check = (
        "from lm_eval.api.registry import get_model; "
        "print(get_model('moectl').__name__, get_model('hf').__name__, get_model('dummy').__name__)"
    )
    light = "heavy = [m for m in ('lm_eval', 'transformers') if m in sys.modules]; print(heavy); "
    assert _python(f"import sys, moectl; {light}{check}").splitlines() == ["[]", "MoectlLM HFLM DummyLM"]
    assert _python(f"import lm_eval.api.registry, moectl; {check}") == "MoectlLM HFLM DummyLM"
    assert _python(f"import lm_eval, moectl.lm_eval; {check}") == "MoectlLM HFLM DummyLM"


def test_model_args_are_checked_and_roe_specs_kept_whole(tasks):
    args = margs.parse("pretrained=tiny:olmoe,roe=K=2,tau=0.5,cache=clean,seed=3,batch_size=4")
    assert args == {"pretrained": "tiny:olmoe", "roe": "K=2,tau=0.5,cache=clean", "seed": "3", "batch_size": "4"}
    assert margs.normalise(args, {"batch_size": 1, "device": "cpu", "max_batch_size": None}) == {
        "pretrained": "tiny:olmoe", "roe": "K=2,tau=0.5,cache=clean", "seed": 3, "batch_size": 4, "device": "cpu",
    }  # fmt: skip
    assert margs.parse("pretrained=x,roe=K=2;tau=0.5")["roe"] == "K=2,tau=0.5"
    assert margs.from_items([("pretrained", "x"), ("roe", "K=4"), ("tau", 0.3)])["roe"] == "K=4,tau=0.3"
    with pytest.raises(ValueError, match=r"unknown model_args key 'polcy'.*allowed: pretrained"):
        margs.parse("pretrained=tiny:olmoe,polcy=x.json")
    with pytest.raises(ValueError, match="RoE keys belong after roe="):
        margs.parse("pretrained=tiny:olmoe,tau=0.3")
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 'auto'"):
        margs.normalise({"pretrained": "tiny:olmoe", "batch_size": "auto"})
    with pytest.raises(ValueError, match="needs pretrained=MODEL"):
        margs.normalise({"policy": "x.json"})
    with pytest.raises(ValueError, match="dtype must be one of"):
        margs.normalise({"pretrained": "tiny:olmoe", "dtype": "fp8"})


def test_bad_policy_and_roe_are_named_before_the_model_loads(tasks, tmp_path):
    from moectl.eval.lm_backend import MoectlLM

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "gumbel"}))
    with pytest.raises(ValueError, match="gumbel policy needs 'tau'"):
        MoectlLM.create_from_arg_string(f"pretrained=tiny:olmoe,policy={bad},device=cpu")
    with pytest.raises(FileNotFoundError, match=r"missing\.json"):
        MoectlLM.create_from_arg_string("pretrained=tiny:olmoe,policy=missing.json,device=cpu")
    with pytest.raises(ValueError, match="cannot read 'bogus'"):
        MoectlLM.create_from_arg_obj({"pretrained": "tiny:olmoe", "roe": "K=2,bogus"})
    with pytest.raises(FileNotFoundError, match="not a controller folder"):
        MoectlLM.create_from_arg_obj({"pretrained": "tiny:olmoe", "controller": str(tmp_path)})


def _samples(raw: dict, task: str = "arc_easy") -> torch.Tensor:
    samples = sorted(raw["samples"][task], key=lambda s: s["doc_id"])
    return torch.tensor([[resp[0][0] for resp in s["resps"]] for s in samples], dtype=torch.float64)


def test_simple_evaluate_gives_the_numbers_of_moectl_eval(tasks, one_thread):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from moectl.eval.eval_run import EvalConfig, evaluate
    from moectl.eval.multiple_choice import evaluate_multiple_choice, mc_items
    from moectl.eval.policy_file import setup_routing
    from moectl.models.load import load_model

    cache, rendered, policy = tasks
    doc = evaluate(EvalConfig("tiny:olmoe", tasks=["arc_easy"], policy=policy, cache=cache, switch=False), progress=False)
    manager = TaskManager(include_path=str(rendered), include_defaults=False)
    raw = simple_evaluate(
        model="moectl",
        model_args=f"pretrained=tiny:olmoe,policy={policy},device=cpu",
        tasks=["arc_easy"],
        batch_size=3,
        task_manager=manager,
        log_samples=True,
    )
    for name in ("acc", "acc_norm"):
        assert raw["results"]["arc_easy"][f"{name},none"] == doc["tasks"]["arc_easy"]["metrics"][name]["value"]
    assert raw["config"]["moectl_routing"] == "gumbel"
    # request by request, the harness's log-likelihoods are moectl's own scorer's (engine "moectl")
    model, tokenizer = load_model("tiny:olmoe", device="cpu", seed=0)
    routing = setup_routing(model, str(policy), seed=1234)
    entry = evaluate_multiple_choice(
        model, tokenizer, mc_items("arc_easy", cache), routing.plan, routing.info, batch_size=8, progress=False
    )
    assert torch.equal(_samples(raw), torch.tensor(entry["per_item"]["logprobs"], dtype=torch.float64))
    plain = simple_evaluate(
        model="moectl", model_args="pretrained=tiny:olmoe,device=cpu", tasks=["arc_easy"], task_manager=manager,
        log_samples=True,
    )  # fmt: skip
    assert not torch.allclose(_samples(plain), _samples(raw)), "the policy is active"


def test_lm_evals_command_line_with_moectl_registered(tasks, tmp_path):
    _, rendered, policy = tasks
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "moectl.lm_eval", "--model", "moectl",
        "--model_args", f"pretrained=tiny:olmoe,policy={policy},roe=K=2,tau=0.5,device=cpu",
        "--tasks", "arc_easy", "--include_path", str(rendered), "--limit", "3", "--batch_size", "2",
        "--output_path", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = Path(out).rglob("results_*.json")
    results = json.loads(path.read_text())
    assert results["config"]["moectl_routing"] == "gumbel+roe-K2"
    assert results["n-samples"]["arc_easy"]["effective"] == 3
    assert 0.0 <= results["results"]["arc_easy"]["acc,none"] <= 1.0
