"""The CPU kernels' loops (kernels/cpu_gemv_simd.h) on each instruction set against fp64 sums and their portable path,
through tests/cpu_simd_check.cpp, a program without torch: natively for the x86 paths this CPU has, and for ARM NEON
built with an AArch64 cross-compiler and run under qemu's user-mode emulation (an x86 machine has no NEON; on an ARM
machine tests/test_kernels_cpu_linear.py runs the NEON path through torch as well). The kernel source itself is
compiled for AArch64 with torch's headers, so its ARM dispatch builds. In CI (CI=true) a missing cross-compiler or
qemu fails these tests rather than skipping them."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from redline.kernels import cpu_linear

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "cpu_simd_check.cpp"
CROSS = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
ARM_SYSROOT = "/usr/aarch64-linux-gnu"
# -DCHECK_SIMD level and the flags that enable it, per x86 instruction set.
X86_BUILDS = {"avx2": (1, ["-mavx2", "-mfma", "-mf16c"]),
              "avx512": (2, ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"])}


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name} is missing: apt-get install g++-aarch64-linux-gnu qemu-user"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def build(compiler: str, level: int, flags: list[str], out: Path) -> Path:
    cmd = [compiler, "-O2", "-std=c++17", f"-I{ROOT / 'kernels'}", f"-DCHECK_SIMD={level}", *flags, str(CHECK),
           "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def cases(stdout: str) -> dict[str, float]:
    """Each case's error, from the program's lines "<case> <error>[ FAIL]" (the last line is OK or FAILED)."""
    lines = stdout.strip().splitlines()
    assert lines and lines[-1] == "OK", stdout[-3000:]
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines[:-1]}


def assert_every_kernel_checked(results: dict[str, float]) -> None:
    kernels = {name.split(" ")[0] for name in results}
    assert {"int8_rows", "float_rows_fp32", "float_rows_fp16", "int8_group_rows_fp32_g16", "int8_group_rows_fp16_g32",
            "int8_code_rows_row_scales", "int8_code_rows_group_scales", "int4_rows", "attention_head",
            "int4_rows_vs_portable", "int8_rows_vs_portable", "int8_group_rows_fp16_g32_vs_portable"} <= kernels
    assert all(0 <= err < 5e-6 for err in results.values())


def test_the_neon_path_matches_fp64_and_the_portable_path_under_emulation(tmp_path):
    program = build(tool(CROSS), 3, [], tmp_path / "check_neon")
    done = subprocess.run([tool(QEMU), "-L", ARM_SYSROOT, str(program)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert_every_kernel_checked(cases(done.stdout))


@pytest.mark.parametrize("simd", sorted(X86_BUILDS))
def test_each_x86_path_passes_the_same_check(simd, tmp_path):
    """The check run natively on the x86 paths this CPU has: the program itself compared against kernels that the
    torch-side tests already cover."""
    if simd not in cpu_linear.available_simd():
        pytest.skip(f"this CPU lacks {simd}")
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    level, flags = X86_BUILDS[simd]
    program = build(compiler, level, flags, tmp_path / f"check_{simd}")
    done = subprocess.run([str(program)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    assert_every_kernel_checked(cases(done.stdout))


def test_the_kernel_source_builds_for_aarch64_with_its_neon_path(tmp_path):
    import torch
    from torch.utils.cpp_extension import include_paths

    compiler = tool(CROSS)
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    obj = tmp_path / "cpu_gemv.o"
    cmd = [compiler, "-c", "-fPIC", *cpu_linear.CFLAGS, abi, *(f"-I{p}" for p in include_paths()),
           str(cpu_linear.SOURCE), "-o", str(obj)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    symbols = subprocess.run([shutil.which("aarch64-linux-gnu-nm") or "nm", "-C", str(obj)], capture_output=True,
                             text=True, timeout=60).stdout
    assert "neon::int4_rows" in symbols and "neon::int8_code_rows" in symbols
