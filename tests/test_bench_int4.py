"""benchmarks/bench_int4.py: its arguments (the benchmark itself needs a CUDA GPU)."""
from __future__ import annotations

import pytest

from redline.benchmarks import bench_int4


@pytest.mark.parametrize("args,message", [
    (["--rows", "4,x"], "--rows takes the int4 tensor-core kernel's rows, 2-256"),
    (["--rows", "1,16"], "--rows takes the int4 tensor-core kernel's rows, 2-256"),
    (["--rows", ","], "--rows takes"),
    (["--rows", "4", "--groupsize", "48"], "--groupsize takes powers of two >= 32"),
])
def test_bad_rows_and_group_sizes_are_one_line_errors(args, message, capsys):
    assert bench_int4.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_parse_ints():
    assert bench_int4.parse_ints("4,16, 64") == [4, 16, 64]
    assert bench_int4.parse_ints("4,sixteen") == []
