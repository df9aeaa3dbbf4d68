"""Quantized checkpoints (issue 40 item 2): ``moectl checkpoint quantize`` writes once, ``moectl.load`` reads.

- round trip: the checkpoint loads with every tensor equal to quantize-at-load's and the same logits,
  exactly (tiny models of several families, int4 and int8, both scopes; the reference model);
- the int4 codes are stored portably (two codes a byte, row-major), read back the same whether this
  machine's packed layout is known or only the kernel can read it;
- ``quantize=`` on a quantized checkpoint: its own scheme a no-op, another one a one-line ConfigError;
- the command line: a summary and ``--json``, exit code 2 and one line for bad input, an existing
  ``--out`` refused unless ``--overwrite``, nothing half-written after an error or Ctrl-C;
- a damaged checkpoint is refused naming what is wrong; offloading refuses a quantized checkpoint.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import moectl
from moectl.cli import app
from moectl.errors import ConfigError, FileFormatError, OutputExistsError
from moectl.quant import int4_groups, portable_int4, quantized_scheme, save_quantized
from moectl.quant.checkpoint_format import FORMAT_VERSION, QUANT_METHOD
from moectl.quant.quantize_checkpoint import quantize_checkpoint

REFERENCE = "models/moectl-small-standard"
runner = CliRunner()


def _ids(batch: int = 2, length: int = 20) -> torch.Tensor:
    return torch.randint(3, 259, (batch, length), generator=torch.Generator().manual_seed(0))


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def reference_int4(tmp_path_factory):
    out = tmp_path_factory.mktemp("ck") / "small-int4"
    quantize_checkpoint(REFERENCE, out, "int4")
    return out


# -- round trip ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "family,scheme,scope",
    [("olmoe", "int4", "experts"), ("qwen2_moe", "int4", "all"), ("mixtral", "int8", "experts"),
     ("qwen3_moe", "int8", "all"), ("deepseek_v3", "int4", "experts"), ("emo", "int4", "experts")],
)  # fmt: skip
@torch.no_grad()
def test_tiny_checkpoint_loads_as_quantize_at_load(tmp_path, family, scheme, scope):
    """Exact: the same tensors and, in the same attention implementation, the same logits (the tiny
    models run eager attention, a checkpoint loads with transformers' default, sdpa)."""
    out = tmp_path / "ck"
    summary = quantize_checkpoint(f"tiny:{family}", out, scheme, scope=scope)
    assert summary["bytes_after"] < summary["bytes_before"]
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION, "scheme": scheme,
        "group_size": 64 if scheme == "int4" else None, "scope": scope,
    }  # fmt: skip
    at_load = moectl.load(f"tiny:{family}", quantize=scheme, scope=scope)
    loaded = moectl.load(out)
    assert quantized_scheme(loaded.model) == scheme and _same_state(at_load.model, loaded.model)
    assert isinstance(loaded.tokenizer, type(at_load.tokenizer))  # the byte tokenizer: no files of its own
    loaded.model.set_attn_implementation("eager")
    assert torch.equal(loaded.model(_ids()).logits, at_load.model(_ids()).logits)


@torch.no_grad()
def test_reference_model_round_trip_is_exact(reference_int4, tmp_path):
    """The shipped model: its tokenizer copied, the folder 40 % of the bf16 weights, the logits of
    the loaded checkpoint equal (bit for bit) to those of quantize-at-load, int4 and int8 scope all."""
    at_load = moectl.load(REFERENCE, quantize="int4")
    loaded = moectl.load(reference_int4)
    text = "The history of the city of Rome is long"
    ids = at_load.tokenizer([text], return_tensors="pt")["input_ids"]
    assert torch.equal(loaded.tokenizer([text], return_tensors="pt")["input_ids"], ids)
    assert torch.equal(loaded.model(ids).logits, at_load.model(ids).logits)
    assert (reference_int4 / "tokenizer.json").read_bytes() == (
        Path(REFERENCE) / "tokenizer.json"
    ).read_bytes()
    on_disk = sum(p.stat().st_size for p in reference_int4.glob("*.safetensors"))
    assert on_disk < 0.45 * (Path(REFERENCE) / "model.safetensors").stat().st_size
    quantize_checkpoint(REFERENCE, tmp_path / "int8", "int8", scope="all")
    int8 = moectl.load(REFERENCE, quantize="int8", scope="all")
    assert torch.equal(moectl.load(tmp_path / "int8").model(ids).logits, int8.model(ids).logits)


@pytest.mark.parametrize("n,n_pad", [(40, 48), (140, 144)])  # a part block; two blocks of 64 and a part
def test_int4_codes_are_portable(monkeypatch, n, n_pad):
    """Stored codes: ``code[2j] | code[2j+1] << 4``, row-major. Packed for the kernel by the inverse of
    this machine's layout, or (layout not known) by the packing op: both give the op's bytes; read
    back through ``unpack_codes`` or through the kernel itself: the same portable bytes."""
    w = torch.randn(3, n, 96, generator=torch.Generator().manual_seed(1))
    weights = moectl.quant.Int4Weights(w, 32)
    k_pad = 96
    portable = portable_int4.to_portable(weights.packed, weights.group, n_pad, k_pad)
    codes = int4_groups.unpack_codes(weights.packed[1])
    assert portable.shape == (3, n_pad, k_pad // 2) and portable.dtype == torch.uint8
    assert torch.equal(portable[1], codes[:, 0::2] | (codes[:, 1::2] << 4))
    assert torch.equal(portable_int4.to_kernel(portable), weights.packed)  # AVX-512: the inverse
    monkeypatch.setattr(int4_groups, "layout_known", lambda n, k: False)
    assert torch.equal(portable_int4.to_portable(weights.packed, weights.group, n_pad, k_pad), portable)
    assert torch.equal(portable_int4.to_kernel(portable), weights.packed)


# -- quantize= on a quantized checkpoint --------------------------------------------------------
def test_quantize_again_is_a_no_op_or_refused(reference_int4):
    same = moectl.load(reference_int4, quantize="int4")
    assert _same_state(same.model, moectl.load(reference_int4).model)
    with pytest.raises(ConfigError, match=r"quantized already \(int4.*cannot be quantized to int8"):
        moectl.load(reference_int4, quantize="int8")
    with pytest.raises(ConfigError, match="groups of 64 already: group size 128"):
        moectl.load(reference_int4, quantize="int4", group_size=128)
    with pytest.raises(ConfigError, match="quantized already"):
        moectl.quant.quantize_model(same.model, "int4")


# -- the command line ---------------------------------------------------------------------------
def _quantize(*args: str):
    return runner.invoke(app, ["checkpoint", "quantize", *args])


@torch.no_grad()
def test_cli_writes_a_summary_json_and_shards(tmp_path):
    """A summary, ``--json``, Hugging Face's shards and index under ``--max-shard-gb`` (100 kB here),
    which load as quantize-at-load does; nothing left beside ``--out``."""
    out, report = tmp_path / "ck", tmp_path / "ck.json"
    result = _quantize("tiny:qwen2_moe", "--out", str(out), "--quantize", "int4", "--group-size", "32",
                       "--scope", "all", "--max-shard-gb", "0.0001", "--json", str(report))  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(report.read_text())
    assert summary["quantization_config"]["group_size"] == 32 and summary["quantize"]["scope"] == "all"
    assert summary["bytes_after"] == sum(p.stat().st_size for p in out.iterdir())
    assert "bytes before" in result.output and "bytes after" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ck.json"]  # no temporary or lock left
    assert (
        len(list(out.glob("model-*-of-*.safetensors"))) > 1
        and (out / "model.safetensors.index.json").is_file()
    )
    at_load = moectl.load("tiny:qwen2_moe", quantize="int4", group_size=32, scope="all")
    assert _same_state(moectl.load(out).model, at_load.model)


def test_cli_bad_input_exits_2_with_one_line(tmp_path, reference_int4):
    out = tmp_path / "ck"
    (tmp_path / "file").write_text("x")
    cases = [
        (["tiny:olmoe", "--out", str(out), "--quantize", "int3"], "--quantize must be one of int8, int4"),
        (["tiny:olmoe", "--out", str(out), "--quantize", "int4", "--group-size", "100"], "32, 64, 128, 256"),
        (["tiny:olmoe", "--out", str(out), "--quantize", "int4", "--scope", "attn"], "experts, all"),
        (["tiny:olmoe", "--out", str(tmp_path / "file"), "--quantize", "int4"], "is a file"),
        ([str(reference_int4), "--out", str(out), "--quantize", "int4"], "quantized checkpoint already"),
        ([REFERENCE, "--out", REFERENCE, "--quantize", "int8", "--overwrite"], "is MODEL itself"),
        (["tiny:gpt_oss", "--out", str(out), "--quantize", "int4"], "does not support GptOssExperts"),
        (["tiny:olmoe", "--out", str(out)], "Missing option '--quantize'"),
    ]
    for args, message in cases:
        result = _quantize(*args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and result.output.count("error:") == 1, (args, result.output)
    assert not out.exists()


def test_existing_out_is_refused_unless_overwrite(tmp_path):
    out = tmp_path / "ck"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    refused = _quantize("tiny:olmoe", "--out", str(out), "--quantize", "int8")
    assert refused.exit_code == 2 and "exists and is not empty: pass --overwrite" in refused.output
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    replaced = _quantize("tiny:olmoe", "--out", str(out), "--quantize", "int8", "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert not (out / "keep.txt").exists() and moectl.load(out).model is not None


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_an_error_midway_leaves_nothing_half_written(tmp_path, monkeypatch, error):
    """The weights written, then the tokenizer step fails (a full disk) or Ctrl-C: ``--out`` is as it
    was (absent; or, with --overwrite, the previous folder), and no temporary folder is left."""
    saving = importlib.import_module("moectl.quant.save_quantized")  # the module, not the function

    def fail(*_):
        raise error

    monkeypatch.setattr(saving, "_write_tokenizer", fail)
    with pytest.raises(type(error)):
        quantize_checkpoint("tiny:olmoe", tmp_path / "new", "int4")
    assert list(tmp_path.iterdir()) == []
    old = tmp_path / "old"
    old.mkdir()
    (old / "keep.txt").write_text("mine")
    result = _quantize("tiny:olmoe", "--out", str(old), "--quantize", "int4", "--overwrite")
    assert result.exit_code == (130 if isinstance(error, KeyboardInterrupt) else 2), result.output
    assert (
        "interrupted: nothing written" if isinstance(error, KeyboardInterrupt) else "error:"
    ) in result.output
    assert [p.name for p in tmp_path.iterdir()] == ["old"] and [p.name for p in old.iterdir()] == ["keep.txt"]


def test_save_needs_a_quantized_model_and_refuses_a_full_folder(tmp_path):
    model = moectl.load("tiny:olmoe").model
    with pytest.raises(ConfigError, match="needs a quantized model"):
        save_quantized(model, tmp_path / "x", group_size=None, scope="experts")
    moectl.quant.quantize_model(model, "int8")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a").write_text("a")
    with pytest.raises(OutputExistsError):
        save_quantized(model, tmp_path / "full", group_size=None, scope="experts")


# -- damaged checkpoints, offloading ------------------------------------------------------------
def test_a_damaged_checkpoint_is_refused_naming_the_problem(tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "ck"
    quantize_checkpoint("tiny:olmoe", out, "int4")
    tensors = load_file(out / "model.safetensors")
    key = "model.layers.1.mlp.experts.down.scale_zero"
    save_file({k: v for k, v in tensors.items() if k != key}, out / "model.safetensors")
    with pytest.raises(FileFormatError, match=f"lacks tensor {key}"):
        moectl.load(out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["format_version"] = 2
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileFormatError, match="format_version 2; this moectl reads version 1"):
        moectl.load(out)


def test_offloading_serves_a_quantized_checkpoint_from_its_quantized_bytes(reference_int4, tmp_path):
    """Issue 40 item 2: the store reads the checkpoint's int4 experts (tests/test_quantized_offload.py)."""
    out = tmp_path / "r.json"
    args = ["serve-offload", str(reference_int4), "--max-new-tokens", "2", "--json", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["store"] == "checkpoint"
