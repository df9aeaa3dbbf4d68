"""Functions named by the task YAMLs (``!function utils.NAME``); written for moectl.

HellaSwag and WinoGrande prompts follow the standard lm-eval definitions; GSM8K and MATH scoring
call moectl's own extraction and equivalence code so that the harness and moectl agree. HumanEval
and MBPP are scored by executing the completion against the problem's tests (moectl.eval.code_exec):
the completion runs in the sandboxed process, the tests outside it (``run_tests``), so a completion
cannot forge its own pass.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from moectl.eval.code_exec import require_allowed, run_tests, solution_names
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
    """Prompt + completion + the problem's ``test`` + ``check(entry_point)`` (Chen et al. 2021), as one
    program: what HumanEval's own harness runs; moectl scores the parts apart (:func:`humaneval_score`)."""
    return f"{doc['prompt']}{completion}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"


def humaneval_score(doc: dict, completion: str) -> bool:
    """Whether ``check(entry_point)`` holds: prompt + completion run in the sandboxed process, the test
    (with the prompt again, for its helper functions, e.g. ``poly`` of HumanEval/32) in the harness."""
    tests = f"{doc['test']}\n\ncheck({doc['entry_point']})\n"
    return run_tests(
        doc["prompt"] + completion, tests, context=doc["prompt"], names=[doc["entry_point"]]
    ).passed


def humaneval_process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """pass@1 of the greedy completion: 1.0 when ``check(entry_point)`` ran to its end in the harness."""
    return {"pass_at_1": float(humaneval_score(doc, results[0]))}


def mbpp_program(doc: dict, completion: str) -> str:
    """Completion (cut at ``[DONE]``), then ``test_setup_code`` and the three asserts (Austin et al. 2021)."""
    code = completion.split("[DONE]")[0]
    tests = "\n".join(doc["test_list"])
    return f"{code}\n\n{doc.get('test_setup_code') or ''}\n{tests}\n"


def mbpp_score(doc: dict, completion: str) -> bool:
    """Whether the three asserts hold: the completion (cut at ``[DONE]``) and ``test_setup_code``, which
    builds objects of the solution's classes (task 367), run in the sandboxed process; the asserts in
    the harness, calling the names they read from the solution (also those the reference ``code``
    defines at top level: task 126's function is named ``sum``)."""
    solution = f"{completion.split('[DONE]')[0]}\n\n{doc.get('test_setup_code') or ''}\n"
    tests = "\n".join(doc["test_list"]) + "\n"
    return run_tests(
        solution, tests, names=solution_names(tests, also=_top_level_names(doc.get("code", "")))
    ).passed


def _top_level_names(code: str) -> set[str]:
    """Functions and classes a reference solution defines at top level (none when it does not parse)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)}


def mbpp_process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """pass@1 of the greedy completion: 1.0 when every assert held in the harness; an ``exit()`` before
    them is a failure."""
    return {"pass_at_1": float(mbpp_score(doc, results[0]))}
