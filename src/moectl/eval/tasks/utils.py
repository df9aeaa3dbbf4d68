"""Functions named by the task YAMLs (``!function utils.NAME``); written for moectl.

HellaSwag and WinoGrande prompts follow the standard lm-eval definitions; GSM8K and MATH scoring
call moectl's own extraction and equivalence code so that the harness and moectl agree. HumanEval
and MBPP are scored by executing the completion against the problem's tests (moectl.eval.code_exec).
"""

from __future__ import annotations

import re
from typing import Any

from moectl.eval.code_exec import require_allowed, run_program
from moectl.eval.gsm8k import exact_match
from moectl.eval.math_equiv import extract_math_answer, is_equiv


def _clean_hellaswag(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag_process_docs(dataset: Any) -> Any:
    """Add ``query`` (activity label + context), ``choices`` (cleaned endings) and ``gold``."""

    def one(doc: dict) -> dict:
        context = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {
            "query": _clean_hellaswag(doc["activity_label"] + ": " + context),
            "choices": [_clean_hellaswag(ending) for ending in doc["endings"]],
            "gold": int(doc["label"]),
        }

    return dataset.map(one)


def winogrande_doc_to_text(doc: dict) -> int:
    """Index of the correct option: the contexts differ per option (partial scoring)."""
    return {"1": 0, "2": 1}[str(doc["answer"])]


def winogrande_doc_to_target(doc: dict) -> str:
    """The sentence after the blank, shared by both options."""
    blank = doc["sentence"].index("_") + 1
    return " " + doc["sentence"][blank:].strip()


def winogrande_doc_to_choice(doc: dict) -> list[str]:
    """The sentence up to the blank, completed with each option."""
    blank = doc["sentence"].index("_")
    return [doc["sentence"][:blank] + doc[option] for option in ("option1", "option2")]


def gsm8k_process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """Exact match of the generation: strict ("The answer is N") and flexible (last number)."""
    match = exact_match(results[0], doc["answer"])
    return {"exact_match": float(match["strict"]), "exact_match_flexible": float(match["flexible"])}


def math_process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """MATH equivalence of the generation's final answer with the reference ``answer``."""
    return {"exact_match": float(is_equiv(extract_math_answer(results[0]), doc["answer"]))}


def code_exec_process_docs(dataset: Any) -> Any:
    """Refuse when the task is loaded (before any generation) unless code execution is opted into."""
    require_allowed()
    return dataset


def humaneval_program(doc: dict, completion: str) -> str:
    """Prompt + completion + the problem's ``test`` + ``check(entry_point)`` (Chen et al. 2021)."""
    return f"{doc['prompt']}{completion}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def humaneval_process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """pass@1 of the greedy completion: 1.0 when the program runs to its end (``check`` returned) and exits 0."""
    return {"pass_at_1": float(run_program(humaneval_program(doc, results[0])).passed)}


def mbpp_program(doc: dict, completion: str) -> str:
    """Completion (cut at ``[DONE]``), then ``test_setup_code`` and the three asserts (Austin et al. 2021)."""
    code = completion.split("[DONE]")[0]
    tests = "\n".join(doc["test_list"])
    return f"{code}\n\n{doc.get('test_setup_code') or ''}\n{tests}\n"


def mbpp_process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """pass@1 of the greedy completion: 1.0 when the program runs to its end (every assert held); an
    ``exit()`` before the asserts is a failure."""
    return {"pass_at_1": float(run_program(mbpp_program(doc, results[0])).passed)}
