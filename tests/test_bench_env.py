"""benchmarks/bench_env.py: the environment record and the read-bandwidth measurement."""
from __future__ import annotations

import pytest
import torch

from redline.benchmarks import bench_env


def test_environment_records_the_command_and_both_gpu_toolkit_versions():
    env = bench_env.environment(torch.device("cpu"), ["--model", "debug-tiny", "--prompt-lengths", "4,8"])
    assert env["command"] == "python benchmarks/bench.py --model debug-tiny --prompt-lengths 4,8"
    assert env["argv"] == ["--model", "debug-tiny", "--prompt-lengths", "4,8"]
    assert env["torch_version"] == torch.__version__ and env["device_type"] == "cpu"
    assert env["cuda_version"] == torch.version.cuda and env["hip_version"] == torch.version.hip
    assert "cuda_version" in env and "hip_version" in env  # present (None) on builds without that toolkit
    assert env["git_commit"] is None or len(env["git_commit"].removesuffix("-dirty")) >= 7


@pytest.mark.gpu
def test_read_bandwidth_gives_one_positive_figure_per_repeat():
    runs = bench_env.measure_read_bandwidth(torch.device("cuda"), 0.25, repeats=3)
    assert len(runs) == 3 and all(r > 0 for r in runs)


def test_the_commit_can_be_named_from_outside(monkeypatch):
    from redline.benchmarks import bench_env

    monkeypatch.setenv("REDLINE_GIT_COMMIT", "abc1234")  # a copied checkout whose git metadata is stale
    assert bench_env._git_commit() == "abc1234"
    monkeypatch.delenv("REDLINE_GIT_COMMIT")
    commit = bench_env._git_commit()
    assert commit is None or len(commit.removesuffix("-dirty")) >= 7

