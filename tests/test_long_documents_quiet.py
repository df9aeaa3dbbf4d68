"""Documents longer than the tokenizer's ``model_max_length`` are expected where moectl cuts or
windows them itself: no "Token indices sequence length is longer than …" warning (issue 15, noise)."""

from __future__ import annotations

import logging

from transformers import AutoTokenizer

from moectl.data.tokenizer_train import default_tokenizer_dir
from moectl.models.tokens import encode
from moectl.subsets.calibrate import tokenize


class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_long_documents_are_tokenised_without_the_max_length_warning():
    tokenizer = AutoTokenizer.from_pretrained(default_tokenizer_dir())
    long = "the quick brown fox jumps over the lazy dog " * (tokenizer.model_max_length // 4)
    recorder = _Recorder()
    hf_logger = logging.getLogger("transformers")  # transformers' root logger (it does not propagate)
    hf_logger.addHandler(recorder)
    try:
        ids = encode(tokenizer, long)
        batch = tokenize(tokenizer, [long, "short"], max_length=32)
        # control, on a fresh instance (transformers warns once per instance): the warning is heard
        AutoTokenizer.from_pretrained(default_tokenizer_dir()).encode(long)
    finally:
        hf_logger.removeHandler(recorder)
    assert len(ids) > tokenizer.model_max_length  # the document really is longer
    assert batch["input_ids"].shape == (2, 32)
    warned = [m for m in recorder.messages if "longer than the specified maximum" in m]
    assert len(warned) == 1  # only the plain encode's
