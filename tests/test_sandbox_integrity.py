"""Scoring integrity and the per-program memory bound of the code sandbox (issue #42, items 4 and 5).

#42.5: before this change a completion could score ``passed`` with a wrong answer by writing the
nonce it found in the bootstrap's frames, or by returning ``class E(int)`` whose ``__eq__`` always
agrees; now the checks run in the harness, outside the program's process, on plain values only.
#42.4: ``RLIMIT_AS`` was per process, so three children each under it took three times the bound;
now one cgroup (or processes x address space) bounds the program's processes together.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import moectl.eval.sandbox as sandbox
import moectl.eval.sandbox_bootstrap as bootstrap
from moectl.errors import ConfigError
from moectl.eval import sandbox_cgroup
from moectl.eval.code_exec import run_program, run_tests, solution_names
from moectl.eval.sandbox import containment
from moectl.eval.sandbox_check import HONEST, INTEGRITY, children_holding, probe
from moectl.eval.tasks.utils import humaneval_process_results, mbpp_score

ADD = {
    "task_id": "Fixture/add",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return the sum of a and b."""\n',
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}
NONCE_FROM_THE_FRAMES = (  # the completion of #42.5
    "    import sys, os\n"
    "    f = sys._getframe()\n"
    "    while f is not None:\n"
    "        if 'nonce' in f.f_locals and 'result_fd' in f.f_locals:\n"
    "            os.write(f.f_locals['result_fd'], f.f_locals['nonce'])\n"
    "            os._exit(0)\n"
    "        f = f.f_back\n"
    "    return a - b\n"
)
EQ_ALWAYS_TRUE = "    class E(int):\n        __eq__ = lambda s, o: True\n    return E(a - b)\n"
BOUND = 400 * 1024**2
EACH = 200 * 1024**2  # one child fits the bound, three together do not
CHILDREN_OVER_THE_BOUND = children_holding(EACH)


@pytest.fixture
def allowed(monkeypatch):
    monkeypatch.setenv("MOECTL_ALLOW_CODE_EXEC", "1")


@pytest.fixture
def no_cgroup(monkeypatch):
    """The rlimit bound: no cgroup plan, containment probed again (and forgotten afterwards)."""
    monkeypatch.setattr(sandbox, "cgroup_plan", lambda: None)
    containment.cache_clear()
    yield
    containment.cache_clear()


# -- #42.5: a wrong answer cannot score "passed" ---------------------------------------------------
def test_the_nonce_from_the_frames_is_not_a_pass(allowed):
    assert humaneval_process_results(ADD, [NONCE_FROM_THE_FRAMES]) == {"pass_at_1": 0.0}
    result = run_tests(ADD["prompt"] + NONCE_FROM_THE_FRAMES, ADD["test"] + "check(add)\n", names=["add"])
    assert result.status == "failed" and "AssertionError" in result.stderr  # no nonce there: a - b is wrong


def test_eq_that_always_agrees_is_not_a_pass(allowed):
    assert humaneval_process_results(ADD, [EQ_ALWAYS_TRUE]) == {"pass_at_1": 0.0}
    result = run_tests(ADD["prompt"] + EQ_ALWAYS_TRUE, ADD["test"] + "check(add)\n", names=["add"])
    assert (
        result.status == "failed"
        and "not a plain value" in result.stderr
        and "type add.<locals>.E>" in result.stderr
    )


def test_right_answers_still_pass(allowed):
    assert humaneval_process_results(ADD, ["    return a + b\n"]) == {"pass_at_1": 1.0}
    assert humaneval_process_results(ADD, ["    return a - b\n"]) == {"pass_at_1": 0.0}
    tests = "assert tally('abca') == {'a': 2, 'b': 1, 'c': 1}\nassert first(pairs()) == (1, 2)\n"
    solution = (  # a Counter compares as the dict it is; objects may be passed back, not compared
        "import collections\ndef tally(s):\n    return collections.Counter(s)\n"
        "class Pairs:\n    items = [(1, 2)]\ndef pairs():\n    return Pairs()\ndef first(p):\n    return p.items[0]\n"
    )
    assert run_tests(solution, tests).passed
    assert not run_tests(solution.replace("Counter(s)", "Counter(s + 'a')"), tests).passed


def test_mbpp_setup_objects_stay_in_the_program(allowed):
    """MBPP 367's setup builds trees of the solution's class: they stay in its process as handles."""
    doc = {
        "code": "class Node:\n    def __init__(self, v):\n        self.v = v\ndef value(node):\n    return node.v",
        "test_list": ["assert value(a) == 1", "assert value(Node(3)) == 3", "assert a != 1"],
        "test_setup_code": "a = Node(1)",
    }
    result_doc = dict(doc, test_list=doc["test_list"][:2])
    assert mbpp_score(result_doc, doc["code"])
    assert not mbpp_score(doc, doc["code"])  # comparing the handle `a` itself is refused: failed


def test_the_checks_time_out_inside_a_call(allowed):
    result = run_tests("def f():\n    while True:\n        pass\n", "assert f() == 1\n", timeout=1)
    assert result.status == "timeout" and not result.passed and "timed out after 1 s" in result.stderr


def test_integrity_programs_never_pass(allowed, capsys):
    """Every attack of moectl.eval.sandbox_check on the verdict fails; honest programs score right."""
    report = probe([h.name for h in INTEGRITY + HONEST])
    with capsys.disabled():
        print(
            f"\nintegrity: {report.tried} tried, {report.contained} contained, {len(report.fake_passes)} fake passes"
        )
    assert report.fake_passes == [] and report.breaches == {}
    assert report.tried == report.contained == len(INTEGRITY)
    assert report.honest_tried == report.honest_right == len(HONEST)
    assert report.statuses["__eq__ always true"] == report.statuses["the nonce from the frames"] == "failed"


def test_plain_values_cross_and_others_do_not():
    def other(value):
        return ["ref", 7, type(value).__name__]

    class E(int):
        pass

    value = {
        "a": [1, 2.5, -3j, None, True],
        (1, b"x"): {frozenset({2}), 3},
        "big": 10**400,
        "nan": float("inf"),
    }
    data = bootstrap.encode(value, other)
    assert bootstrap.decode(data, lambda *ref: pytest.fail("no refs")) == value
    assert bootstrap.encode([E(1), True], other) == ["list", [["ref", 7, "E"], True]]
    for bad in (["int", 5], ["nope", []], {"a": 1}, 5, ["dict", [["x"]]]):
        with pytest.raises((ValueError, TypeError)):
            bootstrap.decode(bad, lambda *ref: None)
    remote = bootstrap.Remote(None, 0, "result of type E")  # type: ignore[arg-type]
    for use in (
        lambda: remote == 5,
        lambda: bool(remote),
        lambda: hash(remote),
        lambda: remote - 1,
        lambda: remote.x,
    ):
        with pytest.raises(bootstrap.NotPlainError, match="not a plain value"):
            use()


def test_names_the_tests_take_from_the_solution():
    tests = "assert sum(10, 15) == 6\nassert helper(len([1])) == math.floor(2.5)\nx = 1\nassert x\n"
    assert solution_names(tests) == ["helper"]
    assert solution_names(tests, also={"sum"}) == ["sum", "helper"]
    assert solution_names("assert poly(f(1)) == 0\n", context="def poly(x):\n    return x\n") == ["f"]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: run_program("pass\n", timeout=0, allow=True), "timeout must be above 0 seconds, got 0"),
        (lambda: run_program("pass\n", memory_bytes=2**20, allow=True), "memory_bytes must be at least"),
        (
            lambda: run_program("pass\n", max_processes=0, allow=True),
            "max_processes must be at least 1, got 0",
        ),
        (lambda: run_tests("pass\n", "assert (\n", allow=True), "the tests do not parse: "),
        (lambda: run_tests("pass\n", "f()\n", names=["f()"], allow=True), "names must be Python identifiers"),
    ],
)
def test_bad_input_is_one_clear_line(call, message):
    with pytest.raises(ConfigError) as error:
        call()
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


# -- #42.4: one memory bound for all the program's processes ---------------------------------------
def _held(stderr: str) -> int:
    found = re.search(r"HELD (\d+)", stderr)
    assert found, stderr
    return int(found.group(1))


def test_children_share_one_memory_bound(allowed):
    result = run_program(CHILDREN_OVER_THE_BOUND, memory_bytes=BOUND, timeout=10)
    assert result.passed, result.stderr
    assert _held(result.stderr) <= BOUND  # before: 3 x 200 MiB under a 400 MiB bound
    if containment().cgroup is not None:
        assert result.memory_peak is not None and result.memory_peak <= BOUND


def test_children_share_one_memory_bound_without_a_cgroup(allowed, no_cgroup):
    assert containment().cgroup is None
    result = run_program(CHILDREN_OVER_THE_BOUND, memory_bytes=BOUND, timeout=10)
    assert result.passed and _held(result.stderr) <= BOUND and result.memory_peak is None
    processes, space = sandbox_cgroup.fallback_limits(BOUND, 64)
    assert processes * space <= BOUND and processes == 3  # 400 MiB: three of at least 128 MiB
    limits = (
        "import resource as r\nprint('LIMITS', r.getrlimit(r.RLIMIT_AS)[0], file=__import__('sys').stderr)\n"
    )
    assert f"LIMITS {space}" in run_program(limits, memory_bytes=BOUND).stderr
    assert sandbox_cgroup.fallback_limits(64 * 1024**2, 64) == (1, 64 * 1024**2)
    assert sandbox_cgroup.fallback_limits(2 * 1024**3, 2) == (2, 1024**3)


def test_the_cgroup_is_removed_after_each_program(allowed):
    plan = containment().cgroup
    if plan is None:
        pytest.skip("no cgroup can be made here (not root, or no writable hierarchy)")
    before = {p for parent in plan.parents for p in parent.glob(f"{sandbox_cgroup.PREFIX}*")}
    assert run_program("import os\nif os.fork() == 0:\n    import time; time.sleep(60)\n").passed
    assert {p for parent in plan.parents for p in parent.glob(f"{sandbox_cgroup.PREFIX}*")} == before


def test_cgroup_plans_are_read_from_proc():
    own = sandbox_cgroup._own_cgroups(
        "12:pids:/a\n4:memory:/process_api/x\n1:name=systemd:/\n0::/user.slice/s1\n"
    )
    assert own["memory"] == "/process_api/x" and own["pids"] == "/a" and own[""] == "/user.slice/s1"
    mountinfo = (
        "30 25 0:26 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory\n"
        "31 25 0:27 /a /sys/fs/cgroup/pids rw,relatime shared:10 - cgroup cgroup rw,pids\n"
    )
    assert sandbox_cgroup._v1_parents(own, mountinfo) == (
        Path("/sys/fs/cgroup/memory/process_api/x"),
        Path("/sys/fs/cgroup/pids"),
    )
    assert sandbox_cgroup._v1_parents({"memory": "/x"}, mountinfo) is None


def test_cgroup_v2_parent(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    (tmp_path / "user.slice" / "s1").mkdir(parents=True)
    (tmp_path / "user.slice" / "cgroup.subtree_control").write_text("memory pids\n")
    assert sandbox_cgroup._v2_parent(tmp_path, {"": "/user.slice/s1"}) == tmp_path / "user.slice"
    (tmp_path / "cgroup.subtree_control").write_text("cpu\n")
    assert sandbox_cgroup._v2_parent(tmp_path, {"": "/"}) is None  # the root delegates no memory
    assert sandbox_cgroup._v2_parent(tmp_path, {"memory": "/"}) is None  # no v2 line: a v1 host
