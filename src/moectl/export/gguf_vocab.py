"""A byte-level BPE tokenizer (a ``tokenizers`` ``tokenizer.json``) as GGUF tokenizer keys.

llama.cpp re-implements each tokenizer's pre-tokenizer (the regex that cuts text into words
before BPE merges) and picks it by the name in ``tokenizer.ggml.pre``. Its own converter finds
that name by hashing the token ids of a test string against a list of known tokenizers, so a
tokenizer it has not seen (moectl's own 8k BPE) is refused even when its pre-tokenizer is a
standard one. Here the name is chosen from what the pre-tokenizer *is* (:func:`pre_tokenizer`):

- ``ByteLevel`` with ``use_regex: true`` and no prefix space (moectl's tokenizer, GPT-2, OLMoE's)
  splits with the GPT-2 regex that ``tokenizers`` hard-codes in ``ByteLevel``::

      's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+

  llama.cpp's ``gpt-2`` type (``LLAMA_VOCAB_PRE_TYPE_GPT2``) splits with exactly this regex
  (``unicode_regex_split_custom_gpt2``, trailing ``\\s+`` included) and merges by rank, as
  ``tokenizers`` does with ``ignore_merges: false``; so ``gpt-2`` it is.
- ``Split`` on Qwen2's regex then ``ByteLevel(use_regex: false)`` -> ``qwen2``; on Llama 3's regex
  -> ``llama-bpe`` (which llama.cpp runs with ``ignore_merges``: the tokenizer must say the same).
  Deviation: Qwen's ``NFC`` normalizer is not applied by llama.cpp; text already in NFC (almost all
  text) tokenises identically.

Anything else is refused with the pre-tokenizer named. Special tokens (``added_tokens`` with
``special: true``) are ``CONTROL``, other added tokens ``USER_DEFINED``; ids the tokenizer does not
use up to the model's ``vocab_size`` are ``UNUSED`` padding (the embedding has those rows).
Whether BOS/EOS are added is measured by encoding a text with and without special tokens, not
guessed from the post-processor. Merges, special ids and a chat template are read by the ``gguf``
package's ``SpecialVocab``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from moectl.errors import ConfigError, FileFormatError

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Split regex -> (llama.cpp pre-tokenizer name, ignore_merges llama.cpp uses for it)
SPLIT_REGEXES = {QWEN2_REGEX: ("qwen2", False), LLAMA3_REGEX: ("llama-bpe", True)}
SUPPORTED = "ByteLevel(use_regex=true) [gpt-2], Split(Qwen2 regex)+ByteLevel [qwen2], Split(Llama-3 regex)+ByteLevel [llama-bpe]"


@dataclass
class Vocab:
    """What the GGUF file gets: tokens in id order, their types, the pre-tokenizer and special ids."""

    tokens: list[str]
    types: list[int]
    pre: str
    special: Any  # gguf.SpecialVocab: merges, special ids, add_bos/add_eos, chat template
    add: dict[str, bool] = field(default_factory=dict)

    def add_to(self, writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        self.special.add_special_token = dict(self.add)
        self.special.add_to_gguf(writer, quiet=True)

    def summary(self) -> dict[str, Any]:
        return {
            "tokens": len(self.tokens),
            "pre": self.pre,
            "merges": len(self.special.merges),
            "special_ids": dict(self.special.special_token_ids),
            **{f"add_{k}": v for k, v in self.add.items()},
        }


def pre_tokenizer(tokenizer_json: dict[str, Any]) -> str:
    """The llama.cpp ``tokenizer.ggml.pre`` name whose regex is this tokenizer's (module docstring)."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    model = tokenizer_json.get("model") or {}
    normalizer = tokenizer_json.get("normalizer")
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    name, ignore_merges = None, False
    if (
        kinds == ["ByteLevel"]
        and steps[0].get("use_regex", True)
        and not steps[0].get("add_prefix_space", False)
    ):
        name = "gpt-2"
    elif kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        if regex in SPLIT_REGEXES and steps[0].get("behavior") == "Isolated":
            name, ignore_merges = SPLIT_REGEXES[regex]
    if name is None:
        raise ConfigError(
            f"pre-tokenizer {json.dumps(pre)[:200]} has no llama.cpp equivalent; supported: {SUPPORTED}"
        )
    if bool(model.get("ignore_merges", False)) != ignore_merges:
        raise ConfigError(
            f"ignore_merges={model.get('ignore_merges', False)}, llama.cpp's {name!r} uses {ignore_merges}"
        )
    if normalizer is not None and not (name == "qwen2" and normalizer.get("type") == "NFC"):
        raise ConfigError(
            f"normalizer {normalizer.get('type')!r} is not applied by llama.cpp; only none (or NFC for qwen2)"
        )
    return name


def _tokenizer_json(folder: Path) -> dict[str, Any]:
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise ConfigError(f"{folder} has no tokenizer.json; pass --tokenizer DIR (a folder with one)")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise FileFormatError(f"{file}: not valid JSON ({err})") from None
    model = data.get("model") or {}
    if (
        model.get("type") != "BPE"
        or model.get("byte_fallback")
        or (data.get("decoder") or {}).get("type") != "ByteLevel"
    ):
        raise ConfigError(
            f"{file}: not a byte-level BPE tokenizer (model {model.get('type')!r}); only those are written"
        )
    return data


def _added_ids(folder: Path) -> dict[str, bool]:
    """Whether the tokenizer adds BOS / EOS, measured on a text (transformers' own tokenizer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    text = "Hello world"
    with_special = tok(text, add_special_tokens=True)["input_ids"]
    plain = tok(text, add_special_tokens=False)["input_ids"]
    extra = len(with_special) - len(plain)
    bos = extra > 0 and tok.bos_token_id is not None and with_special[0] == tok.bos_token_id
    eos = extra > 0 and tok.eos_token_id is not None and with_special[-1] == tok.eos_token_id
    return {"bos": bool(bos), "eos": bool(eos)}


def read_vocab(folder: str | Path, n_vocab: int) -> Vocab:
    """The tokenizer in ``folder`` for a model with ``n_vocab`` embedding rows; ``ValueError`` if
    llama.cpp could not reproduce it."""
    folder = Path(folder)
    data = _tokenizer_json(folder)
    pre = pre_tokenizer(data)
    by_id: dict[int, tuple[str, int]] = {
        i: (t, gguf.TokenType.NORMAL) for t, i in data["model"]["vocab"].items()
    }
    for added in data.get("added_tokens") or []:
        kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        by_id[int(added["id"])] = (added["content"], kind)
    if by_id and max(by_id) >= n_vocab:
        raise ConfigError(f"the tokenizer has token id {max(by_id)}, the model only {n_vocab} embedding rows")
    tokens, types = [], []
    for i in range(n_vocab):
        text, kind = by_id.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED))
        tokens.append(text)
        types.append(int(kind))
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab)
    if not special.merges:
        raise ConfigError(f"{folder / 'tokenizer.json'}: no BPE merges")
    return Vocab(tokens, types, pre, special, _added_ids(folder))
