"""``moectl export gguf``: the file llama.cpp's own GGUF reader sees holds the model, named and
shaped as llama.cpp's loaders ask, with the checkpoint's values; bad input is refused cleanly."""

from __future__ import annotations

import json
import shutil

import gguf
import pytest
import regex
import torch
from tokenizers import Tokenizer, decoders
from typer.testing import CliRunner

import moectl
from _gguf_helpers import VOCAB, read, saved, values
from moectl.cli import app
from moectl.data.tokenizer_train import default_tokenizer_dir
from moectl.export import write_gguf
from moectl.export.gguf_vocab import GPT2_REGEX, pre_tokenizer
from moectl.subsets import export_subset
from moectl.subsets.files import save_subset

runner = CliRunner()


def expected_qwen2_moe(model, keep=None) -> dict[str, torch.Tensor]:
    """What llama.cpp's qwen2moe loader reads, written out by hand from the HF weights."""
    sd = model.state_dict()
    inter = model.config.moe_intermediate_size
    out = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output.weight": sd["lm_head.weight"],
        "output_norm.weight": sd["model.norm.weight"],
    }
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}."
        ids = list(range(model.config.num_experts)) if keep is None else keep[i]
        gate_up = sd[p + "mlp.experts.gate_up_proj"][ids]
        out |= {
            f"blk.{i}.attn_norm.weight": sd[p + "input_layernorm.weight"],
            f"blk.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
            f"blk.{i}.attn_output.weight": sd[p + "self_attn.o_proj.weight"],
            f"blk.{i}.ffn_gate_inp.weight": sd[p + "mlp.gate.weight"][ids],
            f"blk.{i}.ffn_gate_exps.weight": gate_up[:, :inter],
            f"blk.{i}.ffn_up_exps.weight": gate_up[:, inter:],
            f"blk.{i}.ffn_down_exps.weight": sd[p + "mlp.experts.down_proj"][ids],
            f"blk.{i}.ffn_gate_inp_shexp.weight": sd[p + "mlp.shared_expert_gate.weight"][0],
            f"blk.{i}.ffn_gate_shexp.weight": sd[p + "mlp.shared_expert.gate_proj.weight"],
            f"blk.{i}.ffn_up_shexp.weight": sd[p + "mlp.shared_expert.up_proj.weight"],
            f"blk.{i}.ffn_down_shexp.weight": sd[p + "mlp.shared_expert.down_proj.weight"],
        }
        for x in "qkv":
            out[f"blk.{i}.attn_{x}.weight"] = sd[p + f"self_attn.{x}_proj.weight"]
            out[f"blk.{i}.attn_{x}.bias"] = sd[p + f"self_attn.{x}_proj.bias"]
    return out


def assert_tensors(tensors, expected, matrix_type):
    assert set(tensors) == set(expected)
    for name, want in expected.items():
        t = tensors[name]
        assert tuple(int(d) for d in t.shape) == tuple(reversed(want.shape)), name  # ggml's ne order
        one_d_or_router = want.dim() == 1 or "ffn_gate_inp." in name
        assert t.tensor_type == (gguf.GGMLQuantizationType.F32 if one_d_or_router else matrix_type), name
        torch.testing.assert_close(values(t), want.float(), rtol=0, atol=0, msg=name)


def test_qwen2_moe_is_written_as_llama_cpp_reads_it(tmp_path):
    model = saved(tmp_path / "m")
    report = write_gguf(tmp_path / "m", tmp_path / "m.gguf")
    reader, tensors = read(tmp_path / "m.gguf")

    assert reader.fields["general.architecture"].contents() == "qwen2moe"
    assert_tensors(tensors, expected_qwen2_moe(model), gguf.GGMLQuantizationType.F32)
    assert report["untied_output"] and report["outtype"] == "f32"
    cfg = model.config
    assert reader.fields["qwen2moe.expert_count"].contents() == cfg.num_experts
    assert reader.fields["qwen2moe.expert_used_count"].contents() == cfg.num_experts_per_tok
    assert reader.fields["qwen2moe.expert_feed_forward_length"].contents() == cfg.moe_intermediate_size
    assert (
        reader.fields["qwen2moe.expert_shared_feed_forward_length"].contents()
        == cfg.shared_expert_intermediate_size
    )
    assert reader.fields["qwen2moe.attention.head_count_kv"].contents() == cfg.num_key_value_heads
    assert reader.fields["qwen2moe.block_count"].contents() == cfg.num_hidden_layers
    assert not list(tmp_path.glob(".*.tmp")), "no temporary file left behind"


def test_bf16_checkpoints_stay_bf16_bit_for_bit(tmp_path):
    model = saved(tmp_path / "m", dtype=torch.bfloat16)
    write_gguf(tmp_path / "m", tmp_path / "m.gguf")
    _, tensors = read(tmp_path / "m.gguf")
    assert_tensors(tensors, expected_qwen2_moe(model), gguf.GGMLQuantizationType.BF16)


def test_outtype_f16_rounds_matrices_only(tmp_path):
    model = saved(tmp_path / "m")
    write_gguf(tmp_path / "m", tmp_path / "m.gguf", outtype="f16")
    _, tensors = read(tmp_path / "m.gguf")
    want = model.state_dict()["model.layers.0.mlp.shared_expert.up_proj.weight"]
    assert tensors["blk.0.ffn_up_shexp.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    torch.testing.assert_close(
        values(tensors["blk.0.ffn_up_shexp.weight"]), want.half().float(), rtol=0, atol=0
    )
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_a_subset_equals_the_exported_subset_checkpoint(tmp_path):
    model = saved(tmp_path / "m")
    keep = {0: [0, 2, 5, 7], 1: [1, 3, 4, 6], 2: [2, 3, 6, 7]}
    save_subset(tmp_path / "s.json", keep, model="m")
    report = write_gguf(tmp_path / "m", tmp_path / "direct.gguf", subset=tmp_path / "s.json")
    export_subset(model, keep, tmp_path / "sliced")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_tokenizer_dir() / name, tmp_path / "sliced" / name)
    write_gguf(tmp_path / "sliced", tmp_path / "sliced.gguf")

    direct_reader, direct = read(tmp_path / "direct.gguf")
    _, sliced = read(tmp_path / "sliced.gguf")
    assert report["experts"] == 4 and report["experts_source"] == 8
    assert direct_reader.fields["qwen2moe.expert_count"].contents() == 4
    assert_tensors(direct, expected_qwen2_moe(model, keep), gguf.GGMLQuantizationType.F32)
    assert set(direct) == set(sliced)
    for name in direct:
        torch.testing.assert_close(values(direct[name]), values(sliced[name]), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("family", "arch", "overrides", "has_output"),
    [
        ("olmoe", "olmoe", {"num_key_value_heads": 4}, True),  # tied: untied copy written
        ("qwen3_moe", "qwen3moe", {}, False),  # tied: llama.cpp falls back to token_embd itself
        ("qwen3_moe", "qwen3moe", {"tie_word_embeddings": False}, True),
    ],
)
def test_olmoe_and_qwen3_moe_use_their_architectures_tensors(tmp_path, family, arch, overrides, has_output):
    model = saved(tmp_path / "m", family, **overrides)
    write_gguf(tmp_path / "m", tmp_path / "m.gguf")
    reader, tensors = read(tmp_path / "m.gguf")
    assert reader.fields["general.architecture"].contents() == arch
    kinds = gguf.MODEL_TENSORS[{v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]]
    allowed = {
        gguf.TENSOR_NAMES[t].format(bid=i) for t in kinds for i in range(model.config.num_hidden_layers)
    }
    assert {name.rsplit(".", 1)[0] for name in tensors} <= allowed
    assert ("output.weight" in tensors) == has_output
    sd = model.state_dict()
    inter = sd["model.layers.1.mlp.experts.down_proj"].shape[-1]
    gate_up = sd["model.layers.1.mlp.experts.gate_up_proj"]
    torch.testing.assert_close(
        values(tensors["blk.1.ffn_up_exps.weight"]), gate_up[:, inter:], rtol=0, atol=0
    )
    torch.testing.assert_close(
        values(tensors["blk.1.attn_k_norm.weight"]), sd["model.layers.1.self_attn.k_norm.weight"]
    )
    if has_output:
        torch.testing.assert_close(values(tensors["output.weight"]), sd["lm_head.weight"], rtol=0, atol=0)


def test_the_tokenizer_is_written_with_its_pre_tokenizer_and_special_tokens(tmp_path):
    saved(tmp_path / "m")
    report = write_gguf(tmp_path / "m", tmp_path / "m.gguf")
    reader, _ = read(tmp_path / "m.gguf")
    data = json.loads((default_tokenizer_dir() / "tokenizer.json").read_text())
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert reader.fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert len(tokens) == VOCAB
    assert all(tokens[i] == t for t, i in data["model"]["vocab"].items())
    assert [types[i] for i in (0, 1, 2)] == [gguf.TokenType.CONTROL] * 3  # <|bos|> <|eos|> <|pad|>
    assert types[100] == gguf.TokenType.NORMAL
    assert len(reader.fields["tokenizer.ggml.merges"].contents()) == len(data["model"]["merges"])
    assert reader.fields["tokenizer.ggml.bos_token_id"].contents() == 0
    assert reader.fields["tokenizer.ggml.eos_token_id"].contents() == 1
    assert reader.fields["tokenizer.ggml.add_bos_token"].contents() is False  # moectl's tokenizer adds none
    assert report["tokenizer"]["pre"] == "gpt-2"


def test_bytelevel_splits_with_the_gpt2_regex_llama_cpp_uses():
    """The ground for ``gpt-2``: tokenizers' ByteLevel pre-tokenizer cuts text exactly where the
    GPT-2 regex (llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT2) does."""
    tok = Tokenizer.from_file(str(default_tokenizer_dir() / "tokenizer.json"))
    byte_level = decoders.ByteLevel()  # byte-level symbols -> text
    texts = [
        "Hello world, it's 2024!  Two  spaces\tand a tab.\n\nNew paragraph   ",
        "def f(x):\n    return x**2  # squared\n",
        "Ça coûte 12,50 € — naïve Ünïcödé; 日本語のテキスト 123abc",
        "I'll say they've (won't) 'quoted' don't DON'T   \n  end",
    ]
    for text in texts:
        pieces = [byte_level.decode([p]) for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
        assert pieces == regex.findall(GPT2_REGEX, text)
    assert pre_tokenizer(json.loads((default_tokenizer_dir() / "tokenizer.json").read_text())) == "gpt-2"


def test_other_pre_tokenizers_are_named_or_refused():
    split = {
        "type": "Split",
        "pattern": {"Regex": moectl.export.gguf_vocab.QWEN2_REGEX},
        "behavior": "Isolated",
    }
    qwen = {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, {"type": "ByteLevel", "use_regex": False}]},
            "normalizer": {"type": "NFC"}, "model": {"type": "BPE"}}  # fmt: skip
    assert pre_tokenizer(qwen) == "qwen2"
    with pytest.raises(ValueError, match=r"no llama\.cpp equivalent"):
        pre_tokenizer({"pre_tokenizer": {"type": "Whitespace"}, "model": {"type": "BPE"}})
    with pytest.raises(ValueError, match="normalizer"):
        pre_tokenizer(
            {"pre_tokenizer": {"type": "ByteLevel"}, "normalizer": {"type": "Lowercase"}, "model": {}}
        )


def _one_line_error(result, *needles):
    """Exit 2 and one ``error:`` message (rich may wrap a long path over two screen lines)."""
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert text.startswith("error:") and text.count("error:") == 1 and "Traceback" not in text, result.output
    for needle in needles:
        assert needle in text


def test_bad_input_exits_2_in_one_line_and_writes_nothing(tmp_path):
    saved(tmp_path / "m")
    saved(tmp_path / "mix", "mixtral")
    saved(tmp_path / "norm", "qwen2_moe", norm_topk_prob=True)
    saved(tmp_path / "notok", tokenizer=False)
    (tmp_path / "out").mkdir()
    cases = [
        (["mix", "--out", "x.gguf"], ("'mixtral'", "supported: qwen2_moe, olmoe, qwen3_moe")),
        (["m", "--out", "out"], ("is a folder",)),
        (["norm", "--out", "x.gguf"], ("norm_topk_prob=True",)),
        (["notok", "--out", "x.gguf"], ("no tokenizer.json", "--tokenizer")),
        (["m", "--out", "x.gguf", "--outtype", "q4"], ("--outtype 'q4'", "auto, f32, f16, bf16")),
        (["missing", "--out", "x.gguf"], ("not a checkpoint folder",)),
    ]
    for args, needles in cases:
        args = [str(tmp_path / a) if i in (0, 2) else a for i, a in enumerate(args)]
        _one_line_error(runner.invoke(app, ["export", "gguf", *args]), *needles)
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob(".x.gguf.*"))

    ok = runner.invoke(app, ["export", "gguf", str(tmp_path / "notok"), "--out", str(tmp_path / "t.gguf"),
                             "--tokenizer", str(default_tokenizer_dir()), "--json", str(tmp_path / "r.json")])  # fmt: skip
    assert ok.exit_code == 0, ok.output
    assert json.loads((tmp_path / "r.json").read_text())["arch"] == "qwen2moe"
    again = runner.invoke(app, ["export", "gguf", str(tmp_path / "m"), "--out", str(tmp_path / "t.gguf")])
    _one_line_error(again, "already exists", "--overwrite")
