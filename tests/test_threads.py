"""Thread counts from the CPUs a process may use and that are idle."""

from __future__ import annotations

import os

import pytest

from moectl import threads


def test_cgroup_quota_reads_v2_and_v1(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads.cgroup_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert threads.cgroup_quota(tmp_path) == 0.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    assert threads.cgroup_quota(tmp_path) is None


def test_usable_cpus_are_capped_by_the_quota(monkeypatch):
    monkeypatch.setattr(threads, "_affinity", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(threads, "cgroup_quota", lambda: 1.5)
    assert threads.usable_cpus() == 2
    monkeypatch.setattr(threads, "cgroup_quota", lambda: None)
    assert threads.usable_cpus() == 4


def test_pick_threads_takes_idle_cpus_and_a_request_wins(monkeypatch):
    monkeypatch.setattr(threads, "usable_cpus", lambda: 4)
    monkeypatch.setattr(threads, "idle_cpus", lambda sample_s=0.25: 1.2)
    assert threads.pick_threads() == 1
    monkeypatch.setattr(threads, "idle_cpus", lambda sample_s=0.25: 0.0)
    assert threads.pick_threads() == 1  # never zero
    monkeypatch.setattr(threads, "idle_cpus", lambda sample_s=0.25: 3.8)
    assert threads.pick_threads() == 4
    assert threads.pick_threads(3) == 3
    with pytest.raises(ValueError, match="--threads"):
        threads.pick_threads(0)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux only")
def test_idle_cpus_is_within_the_affinity():
    idle = threads.idle_cpus(0.05)
    assert idle is not None and 0.0 <= idle <= len(os.sched_getaffinity(0)) + 1e-6
