"""benchmarks/bench_sampling_params.py runs end to end on the CPU and prints one line per configuration."""
from __future__ import annotations

from redline.benchmarks import bench_sampling_params as bench


def test_prints_the_median_step_of_each_configuration(capsys):
    assert bench.main(["--batch", "2", "--tokens", "4", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tiny on cpu, batch 2, 4 tokens, 1 rounds (eager)")
    assert [line.split()[0] for line in lines[1:]] == ["plain", "one", "all"]
    assert all("median decode step" in line and float(line.split("step")[1].split()[0]) > 0 for line in lines[1:])


def test_plain_only_runs_the_plain_batch_alone(capsys):
    assert bench.main(["--batch", "2", "--tokens", "3", "--rounds", "1", "--plain_only"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].split()[0] == "plain"
