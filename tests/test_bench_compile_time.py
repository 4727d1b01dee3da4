"""benchmarks/bench_compile_time.py: the child command and how a child's failure is reported."""
from __future__ import annotations

import os
import sys

from redline.benchmarks import bench, bench_compile_time


def test_probe_command_runs_bench_as_a_child_with_the_measured_settings():
    cfg = bench.parse_args(["--model", "debug-tiny", "--device", "cpu", "--prompt-lengths", "8,4",
                            "--probe-new-tokens", "3", "--seed", "7"])
    cmd = bench_compile_time.probe_command(cfg, "debug-tiny", "int8", 123.5)
    assert cmd[:3] == [sys.executable, str(bench_compile_time.BENCH_SCRIPT), "--ttft-probe"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--model"] == "debug-tiny" and flags["--quant"] == "int8"
    assert flags["--prompt-lengths"] == "4" and flags["--new-tokens"] == "3" and flags["--seed"] == "7"
    assert float(flags["--start-time"]) == 123.5
    assert cmd[-1] == "--no-compile"  # the CPU does not compile unless asked
    # The child parses the same command line (what it would run, minus the interpreter and script).
    child = bench.parse_args(cmd[2:])
    assert child.ttft_probe and child.start_time == 123.5 and child.models == ("debug-tiny",)


def test_a_failing_child_is_a_failed_probe_with_its_last_error_line(tmp_path):
    cfg = bench.parse_args(["--model", "debug-tiny", "--device", "cpu", "--prompt-lengths", "4"])
    broken = tmp_path / "redline"  # found on PYTHONPATH before the installed package: the child's imports fail
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('a broken redline package')\n")
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(tmp_path)}
    result = bench_compile_time.run_probe(cfg, "debug-tiny", "none", env)
    assert not result.ok and result.first_token_s is None and result.wall_s > 0
    assert result.error == "exit 1: ImportError: a broken redline package"
