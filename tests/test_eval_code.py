"""Execution-based code evaluation: the sandboxed runner, pass@k, and the HumanEval/MBPP tasks.

HumanEval (Chen et al. 2021) and MBPP (Austin et al. 2021) count a completion as correct when the
program it forms with the problem's tests runs to its end. Hand-written fixtures always run; the real
converted sets are checked when present in the eval cache.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from _eval_data import write_set
from moectl.eval.code_exec import (
    ENV_VAR,
    CodeExecutionNotAllowedError,
    check_code_tasks,
    code_exec_allowed,
    code_exec_tasks,
    mean_pass_at_k,
    pass_at_k,
    run_program,
)
from moectl.eval.sandbox_check import sandbox_processes
from moectl.eval.set_cache import evals_dir
from moectl.eval.tasks.utils import (
    humaneval_process_results,
    humaneval_program,
    mbpp_process_results,
    mbpp_program,
)

HUMANEVAL_ROWS = [
    {
        "task_id": "Fixture/0",
        "prompt": 'def add(a: int, b: int) -> int:\n    """Return the sum of a and b.\n    >>> add(2, 3)\n    5\n    """\n',
        "canonical_solution": "    return a + b\n",
        "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
        "entry_point": "add",
    },
    {
        "task_id": "Fixture/1",
        "prompt": 'def reverse(s: str) -> str:\n    """Reverse the string s.\n    >>> reverse("ab")\n    \'ba\'\n    """\n',
        "canonical_solution": "    return s[::-1]\n",
        "test": "def check(candidate):\n    assert candidate('abc') == 'cba'\n    assert candidate('') == ''\n",
        "entry_point": "reverse",
    },
    {
        "task_id": "Fixture/2",
        "prompt": 'def count_vowels(s: str) -> int:\n    """Number of vowels (aeiou) in s.\n    >>> count_vowels("moe")\n    2\n    """\n',
        "canonical_solution": "    return sum(ch in 'aeiou' for ch in s)\n",
        "test": "def check(candidate):\n    assert candidate('moe') == 2\n    assert candidate('xyz') == 0\n",
        "entry_point": "count_vowels",
    },
]
MBPP_ROWS = [
    {
        "task_id": 1001,
        "text": "Write a function to square every number in a list.",
        "code": "def square_all(xs):\r\n  return [x * x for x in xs]",
        "test_list": [
            "assert square_all([1, 2]) == [1, 4]",
            "assert square_all([]) == []",
            "assert square_all([-3]) == [9]",
        ],
        "test_setup_code": "",
        "challenge_test_list": [],
    },
    {
        "task_id": 1002,
        "text": "Write a function to get the value of a node.",
        "code": "class Node:\n    def __init__(self, v):\n        self.v = v\ndef value(node):\n    return node.v",
        "test_list": ["assert value(a) == 1", "assert value(b) == 2", "assert value(Node(3)) == 3"],
        "test_setup_code": "a = Node(1)\nb = Node(2)",
        "challenge_test_list": [],
    },
]


@pytest.fixture
def allowed(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")


# -- the runner ------------------------------------------------------------------------------------
def test_correct_wrong_raising_programs(allowed):
    ok = run_program("def f(x):\n    return x + 1\nassert f(1) == 2\nprint('noise')\n")
    assert ok.passed and ok.status == "passed"
    wrong = run_program("def f(x):\n    return x\nassert f(1) == 2\n")
    assert not wrong.passed and wrong.status == "failed" and "AssertionError" in wrong.stderr
    raises = run_program("raise ValueError('boom')\n")
    assert raises.status == "error" and "ValueError: boom" in raises.stderr
    syntax = run_program("def f(:\n")
    assert syntax.status == "error" and "SyntaxError" in syntax.stderr


def test_infinite_loop_times_out(allowed):
    start = time.monotonic()
    result = run_program("while True:\n    pass\n", timeout=1)
    assert result.status == "timeout" and not result.passed
    assert time.monotonic() - start < 5


def test_resource_limits(allowed):
    bomb = run_program("x = bytearray(3 * 1024**3)\n", memory_bytes=512 * 1024**2)
    assert bomb.status == "error" and "MemoryError" in bomb.stderr
    big_file = run_program("open('f', 'wb').write(b'x' * 2**21)\n", file_bytes=2**20)
    assert not big_file.passed


def test_isolated_process(allowed, monkeypatch):
    monkeypatch.setenv("MOECTL_TEST_SECRET", "s3cret")
    program = (
        "import os, sys\n"
        "assert 'MOECTL_TEST_SECRET' not in os.environ\n"
        "assert sys.flags.isolated\n"
        "assert sys.stdin.read() == ''\n"
        "assert sorted(os.listdir('.')) == ['program.py']\n"
    )
    assert run_program(program).passed


def test_leftover_children_are_killed(allowed):
    marker = f"moectl-test-{uuid.uuid4().hex}"
    program = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)  # {marker}'])\n"
    )
    assert sandbox_processes(marker) == []
    assert run_program(program).passed
    assert sandbox_processes(marker) == [], "the child was killed"


def test_exit_before_the_tests_is_not_a_pass(allowed):
    """#29.3: exit status 0 alone is not success; the program must reach its end."""
    for cheat in ("import sys; sys.exit(0)", "exit()", "quit()", "import os; os._exit(0)", "raise SystemExit"):
        result = run_program(f"{cheat}\nassert False\n")
        assert not result.passed and result.status == "error", cheat
        assert "before the end of the program" in result.stderr or "before its end" in result.stderr, cheat
    atexit = run_program("import atexit, os\natexit.register(os._exit, 0)\nassert False\n")
    assert atexit.status == "failed" and not atexit.passed
    assert run_program("import sys\nassert True\nsys.stdout.flush()\n").passed
    # a completion that exits inside the function: check() never finishes
    doc = HUMANEVAL_ROWS[0]
    assert humaneval_process_results(doc, ["    import sys\n    sys.exit(0)\n"]) == {"pass_at_1": 0.0}
    assert humaneval_process_results(doc, ["    import os\n    os._exit(0)\n"]) == {"pass_at_1": 0.0}
    # MBPP: exit() before the asserts
    assert mbpp_process_results(MBPP_ROWS[0], ["def square_all(xs):\n  return xs\nexit()\n[DONE]"]) == {"pass_at_1": 0.0}
    assert mbpp_process_results(MBPP_ROWS[0], ["import sys\nsys.exit(0)\n[DONE]"]) == {"pass_at_1": 0.0}


def test_refuses_without_opt_in(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(CodeExecutionNotAllowedError, match=ENV_VAR):
        run_program("pass\n")
    with pytest.raises(PermissionError, match="--allow-code-exec"):
        humaneval_process_results(HUMANEVAL_ROWS[0], ["    return a + b\n"])
    assert run_program("pass\n", allow=True).passed
    with code_exec_allowed():
        assert run_program("pass\n").passed
    with pytest.raises(CodeExecutionNotAllowedError):
        run_program("pass\n")  # the context manager restored the environment
    with code_exec_allowed(False), pytest.raises(CodeExecutionNotAllowedError):
        run_program("pass\n")
    assert code_exec_tasks(["gsm8k", "mbpp", "mc9", "humaneval"]) == ["mbpp", "humaneval"]
    check_code_tasks(["gsm8k", "mc9"])  # nothing executes code: no opt-in needed
    with pytest.raises(CodeExecutionNotAllowedError):
        check_code_tasks(["gsm8k", "humaneval"])
    check_code_tasks(["humaneval"], allow=True)
    monkeypatch.setenv(ENV_VAR, "1")
    with pytest.raises(CodeExecutionNotAllowedError):
        run_program("pass\n", allow=False)  # an explicit argument wins


def test_pass_at_k_known_values():
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 8) == 1.0  # fewer than k failures: some k-subset always passes
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    assert mean_pass_at_k([10, 10], [3, 0], 1) == pytest.approx(0.15)
    with pytest.raises(ValueError):
        pass_at_k(5, 6, 1)
    with pytest.raises(ValueError):
        pass_at_k(5, 2, 6)


# -- building and scoring programs -------------------------------------------------------------------
def test_fixture_problems_score(allowed):
    for doc in HUMANEVAL_ROWS:
        assert humaneval_process_results(doc, [doc["canonical_solution"]]) == {"pass_at_1": 1.0}
        assert humaneval_process_results(doc, [""]) == {"pass_at_1": 0.0}
        assert humaneval_process_results(doc, ["    return None\n"]) == {"pass_at_1": 0.0}
    for doc in MBPP_ROWS:
        assert mbpp_process_results(doc, [doc["code"] + "\n[DONE]\nignored"]) == {"pass_at_1": 1.0}
        assert mbpp_process_results(doc, [""]) == {"pass_at_1": 0.0}
    program = humaneval_program(HUMANEVAL_ROWS[0], "    return a + b\n")
    assert program.startswith(HUMANEVAL_ROWS[0]["prompt"] + "    return a + b\n")
    assert program.rstrip().endswith("check(add)")
    assert "[DONE]" not in mbpp_program(MBPP_ROWS[0], "x = 1\n[DONE]\ny = 2")


def _real_rows(name: str, n: int) -> list[dict[str, Any]]:
    path = evals_dir() / name / "test.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not fetched (`moectl data fetch-evals --sets {name}`)")
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for _, line in zip(range(n), handle, strict=False)]


def test_real_humaneval_canonical_solutions_pass(allowed):
    for doc in _real_rows("humaneval", 5):
        assert humaneval_process_results(doc, [doc["canonical_solution"]])["pass_at_1"] == 1.0, doc["task_id"]
        assert humaneval_process_results(doc, [""])["pass_at_1"] == 0.0, doc["task_id"]


def test_real_mbpp_reference_code_passes(allowed):
    for doc in _real_rows("mbpp", 5):
        assert mbpp_process_results(doc, [doc["code"]])["pass_at_1"] == 1.0, doc["task_id"]
        assert mbpp_process_results(doc, ["def unrelated():\n    pass\n"])["pass_at_1"] == 0.0


# -- through lm-eval -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def code_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("evals")
    write_set(cache, "humaneval", "test", HUMANEVAL_ROWS)
    write_set(cache, "mbpp", "test", MBPP_ROWS)
    return cache


class _Oracle:
    """An lm-eval ``LM`` that answers each prompt with the reference solution it was built with."""

    def __new__(cls, answers: dict[str, str]):
        from lm_eval.api.model import LM

        class Oracle(LM):
            def __init__(self) -> None:
                super().__init__()
                self.contexts: list[str] = []

            def generate_until(self, requests):
                out = []
                for request in requests:
                    context = request.args[0]
                    self.contexts.append(context)
                    out.append(next(a for suffix, a in answers.items() if context.endswith(suffix)))
                return out

            def loglikelihood(self, requests):
                raise NotImplementedError

            def loglikelihood_rolling(self, requests):
                raise NotImplementedError

        return Oracle()


def test_reference_answers_score_one_through_lm_eval(allowed, code_cache):
    from moectl.eval.lm_tasks import run_lm_eval, tasks_from_lm_eval

    answers = {doc["prompt"]: doc["canonical_solution"] for doc in HUMANEVAL_ROWS}
    answers |= {doc["test_list"][2] + "\n[BEGIN]\n": doc["code"] + "\n" for doc in MBPP_ROWS}
    lm = _Oracle(answers)
    raw = run_lm_eval(lm, ["humaneval", "mbpp"], code_cache)
    entries = tasks_from_lm_eval(raw)
    assert entries["humaneval"]["metrics"]["pass_at_1"]["value"] == 1.0
    assert entries["mbpp"]["metrics"]["pass_at_1"]["value"] == 1.0
    # HumanEval is zero-shot on the bare prompt; MBPP is 3-shot in Austin et al.'s format
    humaneval = sorted(c for c in lm.contexts if not c.startswith("You are"))
    assert humaneval == sorted(doc["prompt"] for doc in HUMANEVAL_ROWS)
    mbpp = next(c for c in lm.contexts if "square_all" in c)
    assert mbpp.count("[BEGIN]\n") == 4 and mbpp.count("\n[DONE]\n\n") == 3
    assert mbpp.startswith(
        "You are an expert Python programmer, and here is your task: Write a function to find the similar elements"
    )
    assert mbpp.endswith(
        "You are an expert Python programmer, and here is your task: Write a function to square every number "
        "in a list. Your code should pass these tests:\n\n"
        + "\n".join(MBPP_ROWS[0]["test_list"])
        + "\n[BEGIN]\n"
    )


def test_refused_before_generation(monkeypatch, code_cache):
    from moectl.eval.lm_tasks import run_lm_eval

    monkeypatch.delenv(ENV_VAR, raising=False)
    lm = _Oracle({})
    with pytest.raises(CodeExecutionNotAllowedError):
        run_lm_eval(lm, ["humaneval"], code_cache)
    assert lm.contexts == []


def test_tiny_random_model_end_to_end(allowed, code_cache):
    import moectl
    from moectl.eval.eval_tokenizer import byte_tokenizer
    from moectl.eval.lm_backend import MoectlLM
    from moectl.eval.lm_tasks import run_lm_eval, tasks_from_lm_eval

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = moectl.tiny("olmoe", vocab_size=259)
        model.set_experts_implementation("eager")
        lm = MoectlLM(model, byte_tokenizer(), batch_size=3)
        raw = run_lm_eval(lm, ["humaneval"], code_cache, log_samples=True, gen_kwargs={"max_gen_toks": 12})
    finally:
        torch.set_num_threads(threads)
    assert raw["results"]["humaneval"]["pass_at_1,none"] == 0.0
    samples = sorted(raw["samples"]["humaneval"], key=lambda s: s["doc_id"])
    assert [s["arguments"][0][0] for s in samples] == [doc["prompt"] for doc in HUMANEVAL_ROWS]
    assert [s["pass_at_1"] for s in samples] == [0.0, 0.0, 0.0]
    entry = tasks_from_lm_eval(raw)["humaneval"]
    assert entry["n"] == 3 and entry["kind"] == "generate" and entry["split"] == "test"
    assert entry["primary"] == "pass_at_1"
    m = entry["metrics"]["pass_at_1"]
    assert m["value"] == 0.0 and m["ci_method"] == "wilson" and m["higher_is_better"] is True
    assert m["ci95"][0] == pytest.approx(0.0, abs=1e-12) and 0.0 < m["ci95"][1] < 1.0
