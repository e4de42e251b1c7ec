"""How many worker processes ``kvkeeper serve`` starts by default: the usable cores, a
container's CPU limit included (cgroup v2 and v1 files, written here as the kernel shows them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from proxy.workers import MAX_DEFAULT_WORKERS, cpu_quota, worker_count


def _v2(root: Path, text: str) -> Path:
    (root / "cpu.max").write_text(text)
    return root


def _v1(root: Path, quota: int, period: int = 100000) -> Path:
    (root / "cpu").mkdir()
    (root / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    return root


def test_cgroup_v2_limit_and_unlimited(tmp_path: Path) -> None:
    assert cpu_quota(_v2(tmp_path, "150000 100000\n")) == 1.5
    assert cpu_quota(_v2(tmp_path, "max 100000\n")) is None


def test_cgroup_v1_limit_and_unlimited(tmp_path: Path) -> None:
    assert cpu_quota(_v1(tmp_path, 50000)) == 0.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(tmp_path) is None


def test_no_cgroup_files_mean_no_limit(tmp_path: Path) -> None:
    assert cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("garbage")
    assert cpu_quota(tmp_path) is None


def test_a_container_limit_caps_the_default(tmp_path: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    unlimited = worker_count(None, tmp_path)
    assert unlimited == max(1, min(cores, MAX_DEFAULT_WORKERS))
    # half a CPU still gets one worker; 1.5 CPUs round up to two (no more than the cores)
    assert worker_count(None, _v2(tmp_path, "50000 100000")) == 1
    assert worker_count(None, _v2(tmp_path, "150000 100000")) == min(2, unlimited)
    assert worker_count(None, _v2(tmp_path, "3200000 100000")) == unlimited


@pytest.mark.parametrize("asked", [1, 3, 8])
def test_an_asked_count_wins_over_any_limit(tmp_path: Path, asked: int) -> None:
    assert worker_count(asked, _v2(tmp_path, "50000 100000")) == asked
