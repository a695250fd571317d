"""How many threads the engines take (server/engine/threads.py): at most the container's CPU
limit. torch counts the cores the affinity mask allows, every core of the node in a pod, so a
pod limited to 4 CPUs on a 64-core node ran its forwards on 64 OpenMP threads in a 4-core quota
(throttled for most of each period, a known trap of torch in containers)."""

from __future__ import annotations

import pytest
import torch

from xlserve.server.engine import threads


def cgroup(root, v2: str | None = None, v1: tuple[str, str] | None = None, v1_directory: str = "cpu"):
    if v2 is not None:
        (root / "cpu.max").write_text(v2 + "\n")
    if v1 is not None:
        (root / v1_directory).mkdir()
        (root / v1_directory / "cpu.cfs_quota_us").write_text(v1[0] + "\n")
        (root / v1_directory / "cpu.cfs_period_us").write_text(v1[1] + "\n")
    return root


@pytest.mark.parametrize("v2, v1, cores", [
    ("400000 100000", None, 4),  # cgroup v2: a pod's limits.cpu 4
    ("250000 100000", None, 3),  # 2.5 cores: rounded up
    ("50000 100000", None, 1),  # half a core: at least one
    ("max 100000", None, None),  # no limit
    (None, ("200000", "100000"), 2),  # cgroup v1
    (None, ("-1", "100000"), None),  # v1 without a limit (this machine's)
    (None, None, None),  # no cgroup files at all
])
def test_the_cpu_limit_is_read_from_cgroup_v2_or_v1(tmp_path, v2, v1, cores):
    assert threads.cpu_quota_cores(cgroup(tmp_path, v2, v1)) == cores


def test_v1_under_its_combined_directory_name(tmp_path):
    assert threads.cpu_quota_cores(cgroup(tmp_path, v1=("300000", "100000"), v1_directory="cpu,cpuacct")) == 3


def test_the_engines_threads_stay_within_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)  # a 64-core node
    monkeypatch.setattr(threads, "CGROUP_ROOT", cgroup(tmp_path, "400000 100000"))
    assert threads.threads_per_engine(0, 0, 1) == (3, 4)  # the cores less one, and every core: of the 4
    assert threads.threads_per_engine(0, 0, 2) == (1, 2)  # shared by two models
    assert threads.threads_per_engine(8, 6, 1) == (8, 6)  # what the settings ask for, as they ask
    monkeypatch.setattr(threads, "CGROUP_ROOT", tmp_path / "none")
    assert threads.threads_per_engine(0, 0, 1) == (63, 64)  # no limit: every core torch sees
