"""`moectl options train` on two processes (accelerate, gloo) is the one-process step on the whole batch.

One module-scoped launch: run A (one process, 3 steps) in this process, run B (two processes,
2 steps) launched, run C = B resumed on one process to step 3. Adam's state in a checkpoint
(exp_avg = 0.1·g after one step) holds the gradients, so they are compared directly.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from _distributed import check, launch
from moectl.cli import app

runner = CliRunner()
TRAIN = ["options", "train", "tiny:olmoe", "--k-hat", "4", "--batch-size", "4", "--max-new-tokens", "6",
         "--save-every", "1", "--lora-r", "4", "--seed", "3"]  # fmt: skip
CURVES = ("reward", "switch_rate", "switch_prob_mean", "switch_prob_p95", "value_loss", "teacher_ppl",
          "controller_loss", "intra_loss", "repetition_rate")  # fmt: skip


def _log(folder):
    return [json.loads(x) for x in (folder / "log.jsonl").read_text().splitlines() if x]


def _state(folder, step):
    return torch.load(folder / "checkpoints" / f"step-{step:06d}" / "trainer_state.pt", weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("options-dp")
    one = runner.invoke(app, [*TRAIN, "--steps", "3", "--out", str(root / "A")])
    assert one.exit_code == 0, one.output
    shutil.copytree(root / "A" / "checkpoints" / "step-000002", root / "A-step2")  # before keep=2 drops it
    check(launch([*TRAIN, "--steps", "2", "--out", "B", "--json", "B.json"], cwd=root))
    shutil.copytree(root / "B", root / "C")
    resumed = runner.invoke(app, [*TRAIN, "--steps", "3", "--out", str(root / "C")])
    assert resumed.exit_code == 0, resumed.output
    return root


def test_two_processes_log_the_one_process_steps(runs):
    a, b = _log(runs / "A"), _log(runs / "B")
    assert [r["step"] for r in b] == [1, 2] and json.loads((runs / "B.json").read_text())["log"] == b
    for ra, rb in zip(a[:2], b, strict=True):
        assert rb["tokens"] == ra["tokens"] and rb["switch_rate_per_layer"] == pytest.approx(
            ra["switch_rate_per_layer"], abs=1e-7
        )
        for key in CURVES:  # the same tokens, switches and losses, to the order of the reductions
            # (the losses are sums of terms of both signs, so their error is absolute: abs=1e-5)
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-5), key


def test_two_processes_sum_the_gradients_of_the_whole_batch(runs):
    """Adam's first and second moments after steps 1 and 2: the all-reduced gradients are the one-process ones."""
    a = torch.load(runs / "A-step2" / "trainer_state.pt", weights_only=False)
    b = _state(runs / "B", 2)
    assert b["world_size"] == 2 and a["world_size"] == 1
    for opt in ("opt_ctrl", "opt_intra"):
        sa, sb = a[opt]["state"], b[opt]["state"]
        assert sa.keys() == sb.keys()  # a parameter without a gradient anywhere is skipped in both
        for moment in ("exp_avg", "exp_avg_sq"):
            # float32 gradients are sums of terms of both signs at the scale of the group's largest; a
            # tensor 10^4 times smaller than that (a LoRA factor early on: 7.5e-7 against 8.2e-3) is
            # rounded at the group's scale, not its own (it differed by 1.1e-3 of its own max on an
            # AMD EPYC, 2.6e-7 of the group's), so its floor is 1e-3 of the group's largest
            floor = 1e-3 * max(float(sa[k][moment].abs().max()) for k in sa)
            for k in sa:
                x, y = sa[k][moment], sb[k][moment]
                scale = max(float(x.abs().max()), floor) + 1e-12
                assert float((x - y).abs().max()) <= 1e-3 * scale, (opt, k, moment)


def test_a_checkpoint_of_two_processes_resumes_on_one(runs):
    a, c = _log(runs / "A"), _log(runs / "C")
    assert [r["step"] for r in c] == [1, 2, 3]
    assert c[:2] == _log(runs / "B")  # the resumed run keeps B's lines and appends step 3
    for key in CURVES:
        assert c[2][key] == pytest.approx(a[2][key], rel=1e-3, abs=1e-5), key
    assert (runs / "C" / "final" / "controller.safetensors").exists()


def test_split_rollouts_draw_what_the_whole_batch_draws():
    """Row-keyed draws: rolling out rows 0–1 and 2–3 apart gives the rows of one 4-row rollout."""
    import moectl
    from moectl.lm.padding import left_pad
    from moectl.options.controller import build_controller
    from moectl.options.policy import ControllerPolicy
    from moectl.options.rollout import rollout
    from moectl.options.row_noise import row_codes

    model = moectl.tiny("olmoe")
    info = moectl.inspect(model)
    ctrl = build_controller(info, 4)
    with torch.no_grad():
        for layer in ctrl.layers:
            layer.termination[-1].bias.fill_(0.0)  # β ≈ 1/2: switches happen
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15]]
    codes = row_codes(0, 7, torch.arange(4))

    def roll(rows):
        ids, attn = left_pad([prompts[i] for i in rows], 0)
        return rollout(model, info, ControllerPolicy(ctrl), ids, attn, 8, tau=0.3, codes=codes[rows])

    whole, first, second = roll([0, 1, 2, 3]), roll([0, 1]), roll([2, 3])
    assert torch.equal(torch.cat([first.actions, second.actions]), whole.actions)
    assert torch.allclose(torch.cat([first.rewards, second.rewards]), whole.rewards, atol=1e-5)
    for layer, rec in whole.records.items():
        # positions differ by the padding width; the generated steps line up at the end
        s = whole.actions.shape[1]
        parts = [r.records[layer].switch[:, -s:] for r in (first, second)]
        assert torch.equal(torch.cat(parts), rec.switch[:, -s:]), layer
    assert bool(torch.cat([r.switch for r in whole.records.values()]).any())


def test_a_batch_that_does_not_split_is_refused_before_loading(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = [
        "options",
        "train",
        "tiny:no-such-family",
        "--k-hat",
        "4",
        "--batch-size",
        "3",
        "--out",
        str(tmp_path),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    line = " ".join(result.output.split())  # one message (rich wraps it at the console's width)
    assert (
        line.startswith("error:")
        and line.count("error") == 1
        and "--batch-size 3" in line
        and "multiple of 2" in line
    ), line


def test_a_checkpoint_of_other_settings_is_refused_before_loading(runs):
    result = runner.invoke(
        app, ["options", "train", "tiny:no-such-family", "--k-hat", "6", "--batch-size", "4", "--seed", "3",
              "--max-new-tokens", "6", "--lora-r", "4", "--out", str(runs / "A")],
    )  # fmt: skip
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "k_hat 4 → 6" in text and "new --out" in text, text
