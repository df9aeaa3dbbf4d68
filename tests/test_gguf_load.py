"""``moectl.load("x.gguf")`` (issue 40 item 3): a GGUF file through transformers' GGUF loader.

- an F32 GGUF of a tiny model (``moectl export gguf``) loads to the source model's logits (max abs
  difference at most 1e-5 of the largest logit: the weights are the same floats), with the file's
  own tokenizer giving the checkpoint's token ids, for both supported families;
- ``quantize=`` re-quantizes it to moectl's int4 exactly as the checkpoint itself is quantized;
- a Q8_0 file (made here with the ``gguf`` package's own quantizer, no llama.cpp needed) loads
  dequantized, bfloat16 by default, within KL 1e-4 per token of the source (measured: 3e-6 to 9e-6;
  two tiny models of different seeds: 0.025); with llama.cpp installed, its own quantizer's Q4_K_M
  file loads within 1e-3 (measured 5e-5; skipped where llama-cpp-python is absent);
- a missing file, a file that is not GGUF, a truncated one and a family moectl does not load from
  GGUF are refused in one line naming what is supported (``moectl inspect``: exit code 2).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFValueType
from typer.testing import CliRunner

import moectl
from _gguf_helpers import saved
from moectl.cli import app
from moectl.errors import FileFormatError, MoectlFileError, UnsupportedModelError
from moectl.export import write_gguf
from moectl.quant import QuantizedExperts, quantized_scheme

runner = CliRunner()
TEXT = "The quick brown fox jumps over the lazy dog; 3x + 7 = 22.\n  Ça coûte 12,50 €"
IDS = torch.tensor([[5, 17, 300, 1200, 7000, 42, 99, 8100, 3, 650, 2048, 11]])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """family -> (source model, its folder, its F32 GGUF)."""
    out = {}
    for family in ("qwen2_moe", "qwen3_moe"):
        root = tmp_path_factory.mktemp(family)
        model = saved(root / "m", family)
        write_gguf(root / "m", root / "m.gguf", outtype="f32")
        out[family] = (model, root / "m", root / "m.gguf")
    return out


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits[0].float()


def _kl_per_token(ref: torch.Tensor, got: torch.Tensor) -> float:
    p, q = ref.log_softmax(-1), got.log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_f32_gguf_gives_the_source_logits_and_tokens(exported, family):
    source, folder, path = exported[family]
    model, tok, info = moectl.load(str(path))
    assert info.model_type == family and len(info.layers) == source.config.num_hidden_layers
    assert model.dtype == torch.float32  # auto: an all-F32 file stays float32
    want, got = _logits(source), _logits(model)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    folder_tok = moectl.load(str(folder)).tokenizer
    assert tok(TEXT)["input_ids"] == folder_tok(TEXT)["input_ids"] and tok.padding_side == "left"


def test_quantize_at_load_matches_the_checkpoint_quantized(exported):
    _, folder, path = exported["qwen2_moe"]
    from_gguf = moectl.load(str(path), quantize="int4", group_size=32).model
    from_folder = moectl.load(str(folder), dtype="float32", quantize="int4", group_size=32).model
    assert quantized_scheme(from_gguf) == "int4"
    assert any(isinstance(m, QuantizedExperts) for m in from_gguf.modules())
    assert torch.equal(_logits(from_gguf), _logits(from_folder))


def _requantize(src, out, qtype=GGMLQuantizationType.Q8_0) -> None:
    """``src`` rewritten with every matrix in ``qtype`` (gguf-py's own quantizer; the rest as is)."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if data.ndim >= 2 and t.tensor_type == GGMLQuantizationType.F32 and data.shape[-1] % 32 == 0:
            writer.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_quantized_gguf_loads_dequantized_and_requantizes(exported, tmp_path):
    source, _, path = exported["qwen2_moe"]
    _requantize(path, tmp_path / "q8.gguf")
    assert "Q8_0" in {t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "q8.gguf").tensors}
    model, _, _ = moectl.load(str(tmp_path / "q8.gguf"))
    assert model.dtype == torch.bfloat16  # auto: a quantized file unpacks to bfloat16
    want = _logits(source)
    assert _kl_per_token(want, _logits(model)) < 1e-4
    int8 = moectl.load(str(tmp_path / "q8.gguf"), quantize="int8").model
    assert quantized_scheme(int8) == "int8"
    assert _kl_per_token(want, _logits(int8)) < 1e-4


def test_llama_cpp_q4_k_m_loads(exported, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    import ctypes

    source, _, path = exported["qwen3_moe"]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 1
    out = tmp_path / "q4km.gguf"
    assert llama_cpp.llama_model_quantize(str(path).encode(), str(out).encode(), ctypes.byref(params)) == 0
    model = moectl.load(str(out), quantize="int4", group_size=32).model
    assert _kl_per_token(_logits(source), _logits(model)) < 1e-3  # Q4_K / Q5_0 / Q6_K, then moectl int4


def _header_only(path, arch: str, **values: int) -> None:
    """A GGUF holding only metadata: ``general.architecture`` and ``{arch}.KEY`` integers."""
    writer = gguf.GGUFWriter(path, arch)
    for key, value in values.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_bad_files_are_refused_naming_what_is_supported(exported, tmp_path):
    with pytest.raises(MoectlFileError, match="no such GGUF file"):
        moectl.load(str(tmp_path / "missing.gguf"))
    (tmp_path / "text.gguf").write_text("not a model\n")
    with pytest.raises(FileFormatError, match="not a GGUF file"):
        moectl.load(str(tmp_path / "text.gguf"))
    (tmp_path / "cut.gguf").write_bytes(exported["qwen2_moe"][2].read_bytes()[:300])
    with pytest.raises(FileFormatError, match="truncated or damaged"):
        moectl.load(str(tmp_path / "cut.gguf"))
    _header_only(tmp_path / "dense.gguf", "llama", block_count=2)
    with pytest.raises(UnsupportedModelError, match=r"not a Mixture-of-Experts.*qwen2moe.*qwen3moe"):
        moectl.load(str(tmp_path / "dense.gguf"))
    _header_only(tmp_path / "mixtral.gguf", "llama", expert_count=8)
    with pytest.raises(UnsupportedModelError, match=r"Mixtral.*dense Llama"):
        moectl.load(str(tmp_path / "mixtral.gguf"))
    _header_only(tmp_path / "olmoe.gguf", "olmoe", expert_count=8)
    with pytest.raises(UnsupportedModelError, match=r"'olmoe'.*no GGUF loader"):
        moectl.load(str(tmp_path / "olmoe.gguf"))


def test_cli_loads_a_gguf_and_refuses_a_bad_one_in_one_line(exported, tmp_path):
    result = runner.invoke(app, ["inspect", str(exported["qwen3_moe"][2])])
    assert result.exit_code == 0 and "qwen3_moe" in result.output
    _header_only(tmp_path / "mixtral.gguf", "llama", expert_count=8)
    result = runner.invoke(app, ["inspect", str(tmp_path / "mixtral.gguf")])
    assert result.exit_code == 2
    assert result.output.startswith("error:") and "moectl loads GGUF files of qwen2moe" in result.output
    assert "Traceback" not in result.output


def test_dtype_asked_for_is_the_dtype_loaded(exported):
    model = moectl.load(str(exported["qwen2_moe"][2]), dtype="bfloat16").model
    assert model.dtype == torch.bfloat16
    assert (
        F.cosine_similarity(_logits(model).flatten(), _logits(exported["qwen2_moe"][0]).flatten(), dim=0)
        > 0.999
    )


def test_a_gguf_is_served_offloaded_through_a_quantized_checkpoint(exported, tmp_path):
    """The GGUF a user has, offloaded (issue 40 item 3): ``moectl checkpoint quantize`` writes it as a
    quantized checkpoint once; loaded from there, offloading reads the quantized experts' bytes and
    computes what the model loaded whole computes."""
    from moectl.offload import offload
    from moectl.quant import quantize_checkpoint

    _, _, path = exported["qwen2_moe"]
    quantize_checkpoint(str(path), tmp_path / "q", "int8")
    model = moectl.load(str(tmp_path / "q")).model
    assert quantized_scheme(model) == "int8"
    whole = _logits(model)
    assert _kl_per_token(_logits(moectl.load(str(path), quantize="int8").model), whole) < 1e-6
    with offload(model, budget=2) as rt:
        offloaded = _logits(model)
        assert rt.totals()["misses"] > 0
    assert torch.equal(offloaded, whole)
