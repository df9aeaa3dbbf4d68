"""benchmarks/serve_learned_policy.py end to end on a tiny model: four ``moectl serve`` configurations
(the model, an untrained controller, reroute:TOL, a subset made by ``moectl subset select``), eight
concurrent clients, each routing's switch rates and bytes per token in the JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import moectl
from moectl.options.controller import build_controller
from moectl.options.option_state import save_folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serve_learned_policy


def test_serve_learned_policy_on_a_tiny_model(tmp_path):
    model = moectl.tiny("olmoe")  # 8 experts, top-2, 3 MoE layers; the server's tiny:olmoe (seed 0)
    info = moectl.inspect(model)
    save_folder(tmp_path / "ctl", build_controller(info, 4), model, info, {"k_hat": 4})
    out = tmp_path / "result.json"
    doc = serve_learned_policy.main(
        ["--model", "tiny:olmoe", "--controller", str(tmp_path / "ctl"), "--budget", "4", "--quick",
         "--json", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    rows = {r["name"]: r for r in doc["rows"]}
    assert list(rows) == ["model", "controller", "reroute:0.1", "subset"]  # one row per routing
    assert doc["k_hat"] == 4 and doc["clients"] == 8 and doc["subset"]["made"]["keep"] == 4
    for row in rows.values():
        assert row["requests"] == 8 and row["switch_rate_reported"] == 8 and row["server_exit"] == 0
        assert all(r["completion_tokens"] == 8 for r in row["per_request"])  # ignore_eos: max_tokens each
        assert all(0.0 <= r["switch_rate"] <= 1.0 for r in row["per_request"])
        assert 0.0 <= row["switch_rate_mean"] <= 1.0 and row["bytes_per_token"] >= 0
        assert row["tokens_per_s"] > 0 and len(row["loadavg_before"]) == len(row["loadavg_after"]) == 3
    assert {r["routing"] for r in rows["controller"]["per_request"]} == {"controller"}
    assert {r["routing"] for r in rows["subset"]["per_request"]} == {"subset"}
    assert (
        "--residency" in rows["reroute:0.1"]["serve_flags"]
        and "reroute:0.1" in rows["reroute:0.1"]["serve_flags"]
    )
    # the subset keeps the budget's 4 experts: after the warm-up nothing loads; the model's routing does
    assert rows["subset"]["bytes_per_token"] == 0 and rows["subset"]["switch_rate_mean"] == 0
    assert rows["model"]["bytes_per_token"] > 0
    assert len({row["bytes_per_token"] for row in rows.values()}) > 1


def test_bad_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as err:
        serve_learned_policy.main(["--model", "tiny:olmoe", "--clients", "0"])
    assert err.value.code == 2 and "--clients" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        serve_learned_policy.main(["--model", "tiny:olmoe", "--controller", "/nonexistent"])
    assert err.value.code == 2 and "controller.json" in capsys.readouterr().err
