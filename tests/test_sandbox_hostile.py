"""Hostile programs through the scoring sandbox (issues #29.4, #42.4-5): each one contained.

Contained means: not scored as passed, no breach reported by the program, its processes within the
memory bound, no process left running, no file created outside the sandbox, nothing reached the
evaluator's sockets (moectl.eval.sandbox_check); the integrity programs (#42.5) never pass and the
honest ones score right.
Under the previous sandbox (bfe2b37's code_exec: a ``python -I`` child with ``setrlimit`` in
``preexec_fn`` and a process-group kill) 3 of the 14 attacks that were safe to try there were
contained (the fork bombs and the evaluator-signalling program were not run: they would have hit it).
"""

from __future__ import annotations

import os
import resource
import subprocess
import threading
import uuid
import warnings
from pathlib import Path

import pytest

import moectl.eval.sandbox as sandbox
from moectl.eval.code_exec import check_code_tasks, run_program
from moectl.eval.sandbox import SandboxUnavailableError, SandboxWarning, containment
from moectl.eval.sandbox_cgroup import fallback_limits
from moectl.eval.sandbox_check import HONEST, HOSTILE, probe, sandbox_processes


@pytest.fixture
def fresh_containment():
    """Forget the probed containment before and after (the tests change what is available)."""
    containment.cache_clear()
    yield
    containment.cache_clear()


def test_hostile_programs_are_contained(capsys):
    if containment().mode != "namespace":
        pytest.skip(f"namespaces unavailable here: {containment().missing}")
    report = probe()
    with capsys.disabled():
        print(
            f"\nhostile programs: {report.tried} tried, {report.contained} contained, "
            f"{len(report.fake_passes)} fake passes, skipped {report.skipped}"
        )
    assert report.breaches == {} and report.fake_passes == []
    assert (
        report.tried == len(HOSTILE) - len(HONEST) - len(report.skipped) and report.contained == report.tried
    )
    assert report.honest_tried == report.honest_right == len(HONEST)
    assert report.statuses["children over the memory bound"] != "passed"
    if os.geteuid() == 0:  # root here: the fork bombs ran as uid 65534 under RLIMIT_NPROC
        assert report.skipped == {}
    assert sandbox_processes() == []


def test_limits_inside_and_no_preexec_fn(monkeypatch):
    """The child sets its own limits (``preexec_fn`` is unsafe in a threaded evaluator)."""
    started = []
    real = subprocess.Popen

    def spy(*args, **kwargs):
        started.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(sandbox.subprocess, "Popen", spy)
    space = 300 * 2**20 if containment().cgroup is not None else fallback_limits(300 * 2**20, 64)[1]
    program = (
        "import os, resource as r\n"
        f"assert r.getrlimit(r.RLIMIT_AS)[0] == {space}\n"
        "assert r.getrlimit(r.RLIMIT_FSIZE)[0] == 2**20\n"
        "assert r.getrlimit(r.RLIMIT_CORE)[0] == 0\n"
        "assert r.getrlimit(r.RLIMIT_NOFILE)[0] == 64\n"
        "assert r.getrlimit(r.RLIMIT_CPU)[0] == 4\n"
        "assert r.getrlimit(r.RLIMIT_NPROC)[0] != r.RLIM_INFINITY\n"
        f"assert (os.getuid() != 0) == {containment().uid is not None}\n"
    )
    result = run_program(program, timeout=2, memory_bytes=300 * 2**20, file_bytes=2**20, allow=True)
    assert result.passed, result.stderr
    assert started and all(kwargs.get("preexec_fn") is None for kwargs in started)
    assert resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY  # the evaluator's untouched


def test_runs_from_threads():
    outcomes: dict[int, bool] = {}

    def one(i: int) -> None:
        outcomes[i] = run_program(f"assert {i} % 2 == 0\n", allow=True).passed

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes == {i: i % 2 == 0 for i in range(6)}


def test_basic_mode_still_kills_escapees(monkeypatch, fresh_containment):
    """Without namespaces the bootstrap is a subreaper: a ``setsid`` grandchild dies with the run."""
    monkeypatch.setenv(sandbox.MODE_VAR, "basic")
    assert containment().mode == "basic"
    marker = f"moectl-test-{uuid.uuid4().hex}"
    child = f"import os, time\\nos.setsid()\\nif os.fork():\\n    os._exit(0)\\ntime.sleep(60)  # {marker}\\n"
    program = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', '{child}'])\ntime.sleep(0.3)\n"
    assert run_program(program, allow=True).passed
    assert sandbox_processes(marker) == []
    for cheat in ("import sys; sys.exit(0)", "import os; os._exit(0)", "exit()"):
        assert not run_program(f"{cheat}\nassert False\n", allow=True).passed, cheat
    refused = run_program("import socket\nsocket.create_connection(('127.0.0.1', 9))\n", allow=True)
    assert refused.status == "error" and "network access is disabled" in refused.stderr


def test_falls_back_with_a_warning(monkeypatch, fresh_containment):
    monkeypatch.delenv(sandbox.MODE_VAR, raising=False)
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.warns(SandboxWarning, match="basic mode: `unshare` \\(util-linux\\) is not installed"):
        assert containment().mode == "basic"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_program("pass\n", allow=True).passed  # warned once, not per program
    containment.cache_clear()
    monkeypatch.setenv(sandbox.MODE_VAR, "namespace")
    with pytest.raises(SandboxUnavailableError, match="MOECTL_SANDBOX=namespace but `unshare`"):
        containment()


def test_bad_mode_fails_before_the_run(monkeypatch, fresh_containment):
    monkeypatch.setenv(sandbox.MODE_VAR, "docker")
    with pytest.raises(
        ValueError, match="MOECTL_SANDBOX='docker': allowed values are auto, namespace, basic"
    ):
        check_code_tasks(["humaneval"], allow=True)


def test_nothing_left_in_the_temp_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    assert run_program("open('x', 'w').write('y')\n", allow=True).passed
    assert list(Path(tmp_path).iterdir()) == []


def test_a_python_installation_under_tmp_is_contained(monkeypatch, fresh_containment):
    """A venv under /tmp (fresh-check's) is bound into the new root below /tmp, so the root's /tmp
    exists before the bootstrap links /tmp to /sandbox: that link failed (FileExistsError) and the
    namespace mode was lost for the whole run."""
    import tempfile

    if containment().mode != "namespace":
        pytest.skip(f"namespaces unavailable here: {containment().missing}")
    containment.cache_clear()
    under_tmp = tempfile.mkdtemp(dir="/tmp")
    os.chmod(under_tmp, 0o755)
    bind_paths = sandbox._bind_paths
    monkeypatch.setattr(sandbox, "_bind_paths", lambda: [*bind_paths(), under_tmp])
    try:
        assert containment().mode == "namespace", containment().missing
        assert run_program("import os\nassert os.getcwd() == '/sandbox'\n", allow=True).passed
    finally:
        os.rmdir(under_tmp)
