"""A Hugging Face fast tokenizer with the tiny models' byte ids, for harnesses that need one.

``moectl.models.load.ByteTokenizer`` maps UTF-8 byte b to id b + 3 (pad 0, bos 1, eos 2); lm-eval
needs a ``PreTrainedTokenizerFast``. This builds one with the same ids from the ``tokenizers``
library: a byte-level pre-tokenizer (each byte one symbol, no regex split) and a BPE model with
the 256 byte symbols and no merges, so ``encode`` gives exactly ``ByteTokenizer.encode``.
"""

from __future__ import annotations

from functools import cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@cache
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A fast tokenizer whose ids equal ``ByteTokenizer``'s: pad 0, bos 1, eos 2, byte b -> b + 3."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for b, symbol in enumerate(_bytes_to_unicode().values()):
        vocab[symbol] = b + len(SPECIALS)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=SPECIALS[0], bos_token=SPECIALS[1], eos_token=SPECIALS[2]
    )
    fast.padding_side = "left"
    return fast
