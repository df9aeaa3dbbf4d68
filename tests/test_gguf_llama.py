"""The exported GGUF runs in llama.cpp (through llama-cpp-python, ``pip install 'moectl[llama]'``):
same tokens as the transformers tokenizer, same logits as the transformers model. Skipped where
llama_cpp is not installed (it builds llama.cpp from source: kept out of the default CI)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from _gguf_helpers import saved
from moectl.export import write_gguf
from moectl.subsets.files import save_subset

llama_cpp = pytest.importorskip("llama_cpp")

TEXTS = [
    "The quick brown fox jumps over the lazy dog because",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Der schnelle braune Fuchs springt über   den Zaun; 3x + 7 = 22.\n\n  Ça coûte 12,50 €",
]


def _llama(path, logits_all=True):
    return llama_cpp.Llama(
        str(path), n_ctx=256, n_threads=1, n_batch=256, logits_all=logits_all, verbose=False
    )


@pytest.mark.parametrize(
    ("family", "subset", "overrides"),
    [
        ("qwen2_moe", False, {}),
        ("qwen2_moe", True, {}),
        ("olmoe", True, {"num_key_value_heads": 4}),  # llama.cpp's olmoe: no grouped-query attention
        ("qwen3_moe", False, {}),
    ],
)
@torch.no_grad()
def test_llama_cpp_tokenises_and_scores_like_transformers(tmp_path, family, subset, overrides):
    model = saved(tmp_path / "m", family, **overrides)
    keep = {0: [0, 2, 5, 7], 1: [1, 3, 4, 6], 2: [2, 3, 6, 7]}
    if subset:
        from moectl.subsets import export_subset

        save_subset(tmp_path / "s.json", keep)
        export_subset(model, keep, tmp_path / "sliced")
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tmp_path / "sliced").eval()
    write_gguf(tmp_path / "m", tmp_path / "m.gguf", subset=tmp_path / "s.json" if subset else None)
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    llm = _llama(tmp_path / "m.gguf")
    for text in TEXTS:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        assert llm.tokenize(text.encode(), add_bos=True, special=False) == ids
        llm.reset()
        llm.eval(ids)
        got = np.asarray(llm.scores[: len(ids)])
        want = model(torch.tensor([ids])).logits[0].numpy()
        scale = np.abs(want).max()
        assert np.abs(got - want).max() <= 1e-3 * scale, (np.abs(got - want).max(), scale)
    llm.close()
