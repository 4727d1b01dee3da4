"""scripts/check_targets.py: what the dispatcher chooses for each named target, and the cross-compiled checks.

The captures run the real launchers on meta tensors (nothing compiles); a few small kernels are compiled for an
NVIDIA and an AMD target on the CPU, including the two failures the checker exists to catch.
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("redline_check_targets", ROOT / "scripts" / "check_targets.py")
ct = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ct  # dataclasses look the module up while the class is built
_spec.loader.exec_module(ct)

DEMO = (ct.MODELS[0],)  # the demo model's shapes keep the captures fast


@pytest.fixture(scope="module")
def launches():
    """target -> (configurations, fallback calls) for the demo model's shapes."""
    return {t: ct.target_launches(t, 2000 + i, DEMO) for i, t in enumerate(("sm90", "gfx90a", "gfx942"))}


def _find(launches, kernel, *parts):
    return [x for x in launches if x.kernel.endswith(kernel) and all(p in x.summary for p in parts)]


def test_each_target_gets_the_paths_it_supports(launches):
    sm90, gfx90a, gfx942 = (launches[t][0] for t in ("sm90", "gfx90a", "gfx942"))
    # tf32 dots only where the backend accepts them; bf16/fp16 attention uses them on NVIDIA and gfx942
    assert _find(sm90, "_split_kernel", "(bf16", "DOT_PRECISION=tf32")
    assert _find(gfx942, "_split_kernel", "(bf16", "DOT_PRECISION=tf32")
    assert not _find(gfx90a, "_split_kernel", "DOT_PRECISION=tf32")
    # PDL and the inline-PTX int8 conversion are NVIDIA features
    assert _find(sm90, "_gemv_kernel", "USE_PDL=True") and _find(sm90, "_gemv_kernel", "INT8_MODE=2")
    for amd in (gfx90a, gfx942):
        assert not _find(amd, "", "USE_PDL=True") and not _find(amd, "", "INT8_MODE=2")
    kinds = {x.kernel.rsplit(".", 1)[1] for x in gfx90a}
    assert kinds == {"_gemv_kernel", "_small_m_dot_kernel", "_int4_dot_kernel", "_split_kernel", "_combine_kernel",
                     "_prefill_rope_cache_kernel"}
    # the int4 tensor-core kernel converts nibbles with inline PTX on NVIDIA only
    assert _find(sm90, "_int4_dot_kernel", "PTX=True") and not _find(sm90, "_int4_dot_kernel", "PTX=False")
    assert not _find(gfx90a, "_int4_dot_kernel", "PTX=True")


@pytest.mark.parametrize("target", ["sm90", "gfx90a", "gfx942"])
def test_chosen_configs_are_within_the_targets_shared_memory(launches, target):
    chosen, fallbacks = launches[target]
    caps = ct.target_caps(target)
    sized = [(x, ct._estimate(x, caps)) for x in chosen]
    sized = [(x, est) for x, est in sized if est is not None]
    assert len(sized) > 20
    assert all(est <= caps.shared_memory_per_block for _, est in sized), [x.summary for x, _ in sized]
    assert fallbacks == []


def test_compiles_for_nvidia_and_amd_within_limits(launches):
    for i, target in enumerate(("sm90", "gfx90a")):
        combine = _find(launches[target][0], "_combine_kernel")[0]
        result = ct.check_launch(target, combine, 3000 + i)
        assert result.ok, ct.format_result(result)
        assert 0 <= result.shared <= ct.target_caps(target).shared_memory_per_block
        assert ("regs/thread" if target == "sm90" else "VGPRs") in result.detail


def _capture(target: str, caps, call, device_index: int) -> list:
    """The configurations `call` launches with target's Triton driver while the kernels see `caps`."""
    from triton import knobs

    from kernels.device import simulated

    record = ct._Recorder()
    with ct.active_driver(ct.target_driver(ct.target_caps(target), device_index)), simulated(caps):
        knobs.runtime.jit_cache_hook = record
        try:
            call()
        finally:
            knobs.runtime.jit_cache_hook = None
    return list(record.launches.values())


def test_reports_the_failures_it_exists_to_catch():
    from kernels import configs, triton_attention, triton_linear

    bf16 = ct.torch.bfloat16
    # attention that asks for tf32 dots (as if gfx90a were a gfx942): Triton's AMD backend refuses them
    cache = ct._meta(1, 8, 1024, 128, dtype=bf16)
    (tf32,) = [x for x in _capture("gfx90a", ct.target_caps("gfx942"), lambda: triton_attention.decode_attention(
        ct._meta(1, 32, 1, 128, dtype=bf16), cache, cache, ct._meta(1, dtype=ct.torch.int64)), 3100)
        if x.kernel.endswith("_split_kernel")]
    assert "DOT_PRECISION=tf32" in tf32.summary
    refused = ct.check_launch("gfx90a", tf32, 3100)
    assert not refused.ok and "compile error" in refused.detail
    assert ct.format_result(refused).startswith("FAIL gfx90a")
    # an H200 tensor-core config (7B bf16 wo at 8 rows: 72 KiB) over AMD's 64 KiB of LDS
    (h200_config,) = _capture("gfx90a", ct.target_caps("gfx90a"), lambda: triton_linear.small_m_dot(
        ct._meta(8, 4096, dtype=bf16), ct._meta(4096, 4096, dtype=bf16), config=configs.dot_config(4096, 4096, 2, 8)),
        3200)
    over = ct.check_launch("gfx90a", h200_config, 3200)
    assert not over.ok and over.shared > 65536 and "> 65536 B" in ct.format_result(over)


def test_bad_targets_exit_2_with_one_line(capsys):
    assert ct.main(["--targets", "sm80,gfx9000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown target 'gfx9000'" in err and "gfx90a" in err
    assert ct.main(["--targets", ","]) == 2
    assert ct.main(["--jobs", "0"]) == 2


def test_caps_for_a_custom_limit_are_checked():
    tiny = replace(ct.target_caps("sm80"), shared_memory_per_block=1024)
    assert ct.configs.fitted_dot_config(4096, 4096, 2, 2, 8, tiny) is None
