"""benchmarks/gpu_run.sh and benchmarks/gpu_side_by_side.sh, the scripts behind BENCHMARKS.md's GPU runs, on the CPU:
their syntax, and the side-by-side driver's logs, exit statuses, test shards and archive (with parts that fail at
once, so nothing needs a GPU)."""
from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("benchmarks/gpu_run.sh", "benchmarks/gpu_side_by_side.sh")


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_scripts_parse(script):
    subprocess.run(["bash", "-n", script], cwd=ROOT, check=True)


def side_by_side(tmp_path: Path, *groups: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "RESULTS": str(tmp_path / "run"), "SECONDS_LEFT": "60", "WHEELS_INSTALLED": "1"}
    return subprocess.run(["bash", "benchmarks/gpu_side_by_side.sh", *groups], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_each_group_gets_its_log_status_and_share_and_one_archive_holds_them(tmp_path):
    done = side_by_side(tmp_path, "0:no-such-part", "1,2:no-such-part@1/2,other-part")
    assert done.returncode == 0, done.stderr
    run = tmp_path / "run"
    logs = {p.name: p.read_text() for p in run.glob("*.log")}
    assert set(logs) == {"gpu0-no-such-part.log", "gpu12-no-such-part1of2.log", "gpu12-other-part.log"}
    for name, text in logs.items():
        assert "unknown part" in text and "exit status 2" in text, name
    with tarfile.open(tmp_path / "run.tar.gz") as archive:
        names = archive.getnames()
    assert {f"run/{name}" for name in logs} <= set(names)


def test_an_argument_without_gpus_is_refused_in_one_line(tmp_path):
    done = side_by_side(tmp_path, "tests")
    assert done.returncode == 2
    assert done.stderr.strip() == "bad argument 'tests': use GPUS:PART[,PART...]"


def test_the_tests_part_takes_its_share_of_the_files_test_files_names(tmp_path):
    """gpu_run.sh tests with TEST_FILES and TEST_SHARD=1/2: one pytest process for the second of three files (a
    stand-in python3 prints what it was asked to run)."""
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "ran $*"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin", "RESULTS": str(tmp_path / "run"), "WHEELS_INSTALLED": "1",
           "TEST_FILES": "tests/test_a.py tests/test_b.py tests/test_c.py", "TEST_SHARD": "1/2"}
    done = subprocess.run(["bash", "benchmarks/gpu_run.sh", "tests"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    ran = [line for line in done.stdout.splitlines() if line.startswith("ran -m pytest")]
    assert len(ran) == 1 and ran[0].endswith(" tests/test_b.py"), done.stdout
