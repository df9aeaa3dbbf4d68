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
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
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
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's setting for the process wins over the sample
    assert threads.pick_threads() == 2 and threads.pick_threads(3) == 3


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux only")
def test_idle_cpus_is_within_the_affinity():
    idle = threads.idle_cpus(0.05)
    assert idle is not None and 0.0 <= idle <= len(os.sched_getaffinity(0)) + 1e-6


def test_the_governor_follows_other_processes_load(monkeypatch):
    """Other processes' CPU = all busy time minus this process's; the rest is used, at least 1."""
    monkeypatch.setattr(threads, "usable_cpus", lambda: 4)
    applied = []
    gov = threads.ThreadGovernor(interval_s=0.0, apply=applied.append)
    assert gov.others_busy((0.0, 10.0, 1.0), (2.0, 16.0, 3.0)) == 2.0  # 6 s busy, 2 s ours, over 2 s
    assert gov.others_busy((0.0, 10.0, 1.0), (2.0, 11.0, 3.0)) == 0.0  # never negative
    samples = iter([(10.0, 100.0, 0.0), (20.0, 130.0, 0.0), (30.0, 130.0, 0.0)])
    monkeypatch.setattr(gov, "_sample", lambda: next(samples))
    gov._last, gov.current = (0.0, 100.0, 0.0), 4
    assert gov.update() is None  # nobody else busy: keeps 4
    assert gov.update() == 1  # 30 s of others' CPU over 10 s = 3 CPUs busy: 1 left
    assert gov.update() == 4 and applied == [1, 4]


def test_the_governor_picks_only_among_its_choices(monkeypatch):
    """With a compiled step the counts are those its graphs were built for: the largest that fits."""
    monkeypatch.setattr(threads, "usable_cpus", lambda: 4)
    applied = []
    gov = threads.ThreadGovernor(interval_s=0.0, apply=applied.append, choices=(4, 1))
    samples = iter([(10.0, 110.0, 0.0), (20.0, 130.0, 0.0), (30.0, 130.0, 0.0)])
    monkeypatch.setattr(gov, "_sample", lambda: next(samples))
    gov._last, gov.current = (0.0, 100.0, 0.0), 4
    assert gov.update() == 1  # 1 CPU busy elsewhere: 3 wanted, 3 is not a choice, 1 is
    assert gov.update() is None  # 2 busy: 2 wanted, still 1
    assert gov.update() == 4 and applied == [1, 4]
