"""scripts/check_targets.py: what the dispatcher chooses for each named target, and the cross-compiled checks.

The captures run the real launchers on meta tensors (nothing compiles); a few small kernels are compiled for an
NVIDIA and an AMD target on the CPU, including the two failures the checker exists to catch. The whole check over
every default target runs once, as a slow test (about 20 minutes on 2 cores).
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

if os.environ.get("CI") == "true":
    import triton  # noqa: F401  (CI installs it: without it these tests fail rather than skip)
else:
    pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("redline_check_targets", ROOT / "scripts" / "check_targets.py")
ct = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ct  # dataclasses look the module up while the class is built
_spec.loader.exec_module(ct)
FUSED_GEMVS = importlib.import_module("redline.scripts.linear_target_calls").FUSED_GEMVS

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
    kinds = {x.kernel.rsplit(".", 1)[1] for x in gfx90a if not x.kernel.startswith("redline.kernels.triton_int4.")}
    assert kinds == {"_gemv_kernel", "_small_m_dot_kernel", "_int4_dot_kernel", "_split_kernel", "_combine_kernel",
                     "_prefill_rope_cache_kernel", "_paged_split_kernel", "_paged_combine_kernel",
                     "_paged_prefill_kernel", "_gate_up_gemv_kernel", "_down_gemv_kernel",
                     "_grouped_gate_up_kernel", "_grouped_down_kernel", "_gate_up_gemv_int4_kernel",
                     "_down_gemv_int4_kernel", "_grouped_gate_up_int4_kernel", "_grouped_down_int4_kernel",
                     "_route_kernel"}
    assert any(x.kernel.startswith("redline.kernels.triton_int4.") for x in gfx90a)
    # the int4 tensor-core kernel converts nibbles with inline PTX on NVIDIA only
    assert _find(sm90, "_int4_dot_kernel", "PTX=True") and not _find(sm90, "_int4_dot_kernel", "PTX=False")
    assert not _find(gfx90a, "_int4_dot_kernel", "PTX=True")
    # the paged kernels over an e4m3 KV cache on targets with FP8 only
    assert _find(sm90, "_paged_split_kernel", "fp8e4nv", "KV_FP8=True", "ROPE_QKV=True")
    assert _find(sm90, "_paged_prefill_kernel", "fp8e4nv", "KV_FP8=True")
    assert not any(_find(amd, "", "KV_FP8=True") for amd in (gfx90a, gfx942))


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


class _CallLog(ct._Recorder):
    """A recorder that also keeps every launch: (the call that made it, the kernel's module, its specialization)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str, str]] = []

    def __call__(self, **hook) -> bool:
        self.log.append((self.call, hook["fn"].jit_function.fn.__module__, hook["compile"]["specialization_data"]))
        return super().__call__(**hook)


def _capture(target: str, caps, call, device_index: int, record: ct._Recorder | None = None) -> list:
    """The configurations `call` launches with target's Triton driver while the kernels see `caps`."""
    from triton import knobs

    from redline.kernels.device import simulated

    record = record if record is not None else ct._Recorder()
    with ct.active_driver(ct.target_driver(ct.target_caps(target), device_index)), simulated(caps):
        knobs.runtime.jit_cache_hook = record
        try:
            call(record)
        finally:
            knobs.runtime.jit_cache_hook = None
    return list(record.launches.values())


def test_reports_the_failures_it_exists_to_catch():
    from redline.kernels import configs, triton_attention, triton_linear

    bf16 = ct.torch.bfloat16
    # attention that asks for tf32 dots (as if gfx90a were a gfx942): Triton's AMD backend refuses them
    cache = ct._meta(1, 8, 1024, 128, dtype=bf16)
    (tf32,) = [x for x in _capture("gfx90a", ct.target_caps("gfx942"), lambda _: triton_attention.decode_attention(
        ct._meta(1, 32, 1, 128, dtype=bf16), cache, cache, ct._meta(1, dtype=ct.torch.int64)), 3100)
        if x.kernel.endswith("_split_kernel")]
    assert "DOT_PRECISION=tf32" in tf32.summary
    refused = ct.check_launch("gfx90a", tf32, 3100)
    assert not refused.ok and "compile error" in refused.detail
    assert ct.format_result(refused).startswith("FAIL gfx90a")
    # an H200 tensor-core config (7B bf16 wo at 8 rows: 72 KiB) over AMD's 64 KiB of LDS
    (h200_config,) = _capture("gfx90a", ct.target_caps("gfx90a"), lambda _: triton_linear.small_m_dot(
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


def test_int4_is_captured_through_its_public_launcher():
    """Every int4 call of the linear ops (one row, plain and fused, each dtype and group size dividing K) reaches a
    kernel of kernels.triton_int4 through gemv_int4, whatever the kernel is called; more rows reach the int4
    tensor-core kernel (kernels.triton_int4_dot) and nothing else."""
    log = _CallLog()
    caps = ct.target_caps("gfx942")
    _capture("gfx942", caps, lambda record: ct._linear_calls(record, caps, DEMO), 3300, log)
    int4 = {call for call, module, _ in log.log if module == "redline.kernels.triton_int4"}
    model = DEMO[0]
    expected = set()
    for dtype, group, (proj, (_, k)) in itertools.product(("bfloat16", "float16", "float32"), ct.INT4_GROUP_SIZES,
                                                          model.projections().items()):
        if k % group == 0:
            label = f"{model.name} {proj} {dtype}xint4-g{group}"
            fused = [f for f in FUSED_GEMVS if f[0] == proj]
            expected |= {f"{label} rows=1"} | {f"{label} fused norm={f[1]}" for f in fused}
            expected |= {f"{label} fused norm={f[1]} gemma" for f in fused if f[1]}  # Gemma's forms (normed ones)
    assert int4 == expected
    assert {g for g in ct.INT4_GROUP_SIZES if any(f"int4-g{g} " in c for c in int4)} == set(ct.INT4_GROUP_SIZES)
    assert not any("int4" in call for call, module, _ in log.log
                   if module not in ("redline.kernels.triton_int4", "redline.kernels.triton_int4_dot"))
    assert any("int4" in call and "rows=2" in call for call, module, _ in log.log if module == "redline.kernels.triton_int4_dot")


def test_tensors_past_32_bit_offsets_are_their_own_configuration_on_amd():
    """AMD specializes a pointer on whether its tensor fits 32-bit offsets (buffer loads), so the 70B fp32 output
    head (4.2 GB) compiles apart from a smaller weight of the same config; NVIDIA does not."""
    from redline.kernels import triton_linear

    fp32 = ct.torch.float32

    def two_heads(_):
        for n, k in ((128256, 8192), (16384, 8192)):
            triton_linear.gemv(ct._meta(1, k, dtype=fp32), ct._meta(n, k, dtype=fp32))

    amd = _capture("gfx942", ct.target_caps("gfx942"), two_heads, 3400)
    assert len(amd) == 2 and sum("w_ptr 64-bit" in x.summary for x in amd) == 1
    nvidia = _capture("sm90", ct.target_caps("sm90"), two_heads, 3401)
    assert len(nvidia) == 1 and "64-bit" not in nvidia[0].summary


@pytest.mark.parametrize("target, device_index", [("sm80", 3500), ("gfx90a", 3501)])
def test_divisibility_variants_compiled_once_compile_alike(target, device_index):
    """ONE_DIVISIBILITY_ARGS: 24 and 32 rows (one tile config, M divisible by 16 or not) give the tensor-core kernel
    the same TTGIR but for that argument's attribute, and the same shared memory; 13 and 16 splits give the
    attention kernels the same code. The check compiles one variant of each."""
    from redline.kernels import triton_attention, triton_linear
    from redline.kernels.configs import AttentionConfig

    fp16 = ct.torch.float16
    cache = ct._meta(1, 2, 1024, 64, dtype=fp16)

    def launch_both(_):
        for m in (24, 32):
            triton_linear.small_m_dot(ct._meta(m, 576, dtype=fp16), ct._meta(576, 576, dtype=fp16))
        for splits in (13, 16):
            triton_attention.decode_attention(ct._meta(1, 8, 1, 64, dtype=fp16), cache, cache,
                                              ct._meta(1, dtype=ct.torch.int64), AttentionConfig(splits, 32))

    log = _CallLog()
    launches = _capture(target, ct.target_caps(target), launch_both, device_index, log)
    assert len(launches) == 3 and len(log.log) == 6 and not any("%16" in x.summary for x in launches)
    compiled: dict[str, list] = {}
    with ct.active_driver(ct.target_driver(ct.target_caps(target), device_index)):
        for _, _, spec in log.log:
            name = json.loads(spec)["name"]
            compiled.setdefault(name.rsplit(".", 1)[1], []).append(ct._jit_function(name).preload(spec))
    assert len({spec for _, _, spec in log.log}) == 6  # the variants are distinct to Triton
    dots = [(k.metadata.shared, re.sub(r" \{tt\.divisibility = 16 : i32\}", "", k.asm["ttgir"]))
            for k in compiled["_small_m_dot_kernel"]]
    assert dots[0] == dots[1]
    code = "ptx" if target.startswith("sm") else "amdgcn"
    for kernel in ("_split_kernel", "_combine_kernel"):
        first, second = compiled[kernel]
        assert first.asm[code] == second.asm[code] and first.metadata.shared == second.metadata.shared


def _compiled(target: str, device_index: int, log: "_CallLog") -> dict[str, list]:
    """Every launch in the log compiled for the target, by kernel name, in launch order."""
    compiled: dict[str, list] = {}
    with ct.active_driver(ct.target_driver(ct.target_caps(target), device_index)):
        for _, _, spec in log.log:
            name = json.loads(spec)["name"]
            compiled.setdefault(name.rsplit(".", 1)[1], []).append(ct._jit_function(name).preload(spec))
    return compiled


@pytest.mark.parametrize("target, device_index", [("sm90", 3700), ("gfx90a", 3701)])
def test_paged_variants_compiled_once_compile_alike(target, device_index):
    """The sizes the paged kernels do not specialize on (split count and key capacity 13/24 against 16/32; sequences
    3 against 16, with their binary-search steps) give one variant, and their page sizes (PAGE_SIZE, in
    SCALAR_CONSTEXPRS: 8 against 128) the same TTGIR but for the page size's constants, and the same shared memory."""
    from redline.kernels import triton_paged_attention as tpa
    from redline.kernels.configs import AttentionConfig, PagedPrefillConfig

    fp16, i32 = ct.torch.float16, ct.torch.int32

    def launch_all(_):
        for page, pages, splits in ((8, 3, 13), (8, 4, 16), (128, 4, 16)):
            pool = ct._meta(64, page, 2, 64, dtype=fp16)
            tpa.paged_decode_attention(ct._meta(2, 8, 64, dtype=fp16), pool, pool, ct._meta(2, pages, dtype=i32),
                                       ct._meta(2, dtype=i32), 0.1, AttentionConfig(splits, 32))
        for page, seqs in ((8, 3), (8, 16), (128, 16)):
            pool = ct._meta(64, page, 2, 64, dtype=fp16)
            tpa.paged_prefill_attention(ct._meta(100, 8, 64, dtype=fp16), pool, pool, ct._meta(seqs, 6, dtype=i32),
                                        ct._meta(seqs + 1, dtype=i32), ct._meta(seqs, dtype=i32), 0.1,
                                        PagedPrefillConfig(64, 32, 4, 2))

    log = _CallLog()
    launches = _capture(target, ct.target_caps(target), launch_all, device_index, log)
    # one variant a kernel and page size: the split and prefill kernels at pages of 8 and 128, the combine kernel once
    assert len(launches) == 3 and len({spec for _, _, spec in log.log}) == 5
    compiled = _compiled(target, device_index, log)
    code = "ptx" if target.startswith("sm") else "amdgcn"
    for kernel in ("_paged_split_kernel", "_paged_combine_kernel", "_paged_prefill_kernel"):
        first, second, other_page = compiled[kernel]
        assert first.asm[code] == second.asm[code] and first.metadata.shared == second.metadata.shared
        assert other_page.metadata.shared == second.metadata.shared
        assert re.sub(r"\d+", "N", other_page.asm["ttgir"]) == re.sub(r"\d+", "N", second.asm["ttgir"])


@pytest.mark.parametrize("target, device_index", [("sm90", 3900), ("gfx90a", 3901)])
def test_moe_pair_count_variants_compiled_once_compile_alike(target, device_index):
    """ONE_DIVISIBILITY_ARGS: the grouped MoE kernels' pair count n_pairs (24 against 32: 12 and 16 tokens, two
    experts each) gives the same TTGIR but for that argument's attribute, and the same shared memory."""
    from redline.kernels import triton_moe
    from redline.kernels.configs import MoeDotConfig

    fp16 = ct.torch.float16
    w13, w2 = ct._meta(8, 256, 128, dtype=fp16), ct._meta(8, 128, 128, dtype=fp16)

    def launch_both(_):
        for tokens in (12, 16):
            ids, weights = ct._meta(tokens, 2, dtype=ct.torch.int64), ct._meta(tokens, 2, dtype=ct.torch.float32)
            triton_moe.moe_grouped(ct._meta(tokens, 128, dtype=fp16), w13, w2, ids, weights, False,
                                   MoeDotConfig(16, 64, 64, 4, 3))

    log = _CallLog()
    launches = _capture(target, ct.target_caps(target), launch_both, device_index, log)
    assert len(launches) == 2 and len(log.log) == 4 and not any("%16" in x.summary for x in launches)
    assert len({spec for _, _, spec in log.log}) == 4  # the variants are distinct to Triton
    compiled = _compiled(target, device_index, log)
    for kernel in ("_grouped_gate_up_kernel", "_grouped_down_kernel"):
        first, second = ((k.metadata.shared, re.sub(r" \{tt\.divisibility = 16 : i32\}", "", k.asm["ttgir"]))
                         for k in compiled[kernel])
        assert first == second


def test_kernel_groups_limit_the_capture():
    paged = ct.target_launches("sm90", 3800, DEMO, ("paged",))[0]
    assert paged and all("_paged_" in x.kernel for x in paged)
    moe = ct.target_launches("gfx90a", 3801, DEMO, ("moe",))[0]
    assert moe and all(x.kernel.startswith("redline.kernels.triton_moe.") for x in moe)
    assert {x.kernel.rsplit(".", 1)[1] for x in moe} == {"_gate_up_gemv_kernel", "_down_gemv_kernel",
                                                         "_grouped_gate_up_kernel", "_grouped_down_kernel",
                                                         "_gate_up_gemv_int4_kernel", "_down_gemv_int4_kernel",
                                                         "_grouped_gate_up_int4_kernel", "_grouped_down_int4_kernel",
                                                         "_route_kernel"}
    assert ct.parse_args(["--kernels", "paged, attention"]).kernels == ("paged", "attention")
    assert ct.parse_args(["--kernels", "moe"]).kernels == ("moe",)
    assert ct.main(["--kernels", "paged,gemm"]) == 2


def test_sm8x_targets_share_the_first_targets_ir_and_assemble_their_own(tmp_path, monkeypatch):
    """A configuration sm80 and sm86 both choose is one task: sm86 runs Triton up to its TTGIR, finds it equal and
    assembles sm80's PTX with its own ptxas, which gives what a full sm86 compile gives; a TTGIR that differs from
    the reference's means a full compile."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a cached full sm86 compile would be taken as it is
    targets = ("sm80", "sm86")
    captured = [ct.target_launches(t, 3600 + i, DEMO)[0] for i, t in enumerate(targets)]
    task = next(t for t in ct._tasks(targets, captured) if len(t) == 2 and "_combine_kernel" in t[0][2].summary)
    (_, ref), (_, shared) = ct._check_task(task)
    assert ref.ok and shared.ok and "IR of sm80" in shared.detail and "IR of" not in ref.detail
    _, target, launch, index = task[1]
    full = ct.check_launch(target, launch, index + 50)
    assert full.detail == shared.detail.replace(" (IR of sm80)", "") and full.shared == shared.shared
    other = ct.Binary(0, 2, {"ttgir": "module {}", "ptx": ""})
    assert "IR of" not in ct.check_launch(target, launch, index, ("sm80", other)).detail


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("REDLINE_CHECK_TARGETS") not in ("1", "all"),
                    reason="the cross-compile check (--sample: about 10 minutes on 2 cores, CI runs it): "
                           "REDLINE_CHECK_TARGETS=1, or =all for every configuration (about an hour)")
def test_every_default_target_passes():
    """The check on every default target: CI's sample (scripts/check_targets.py --sample), or all of it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    sample = [] if os.environ["REDLINE_CHECK_TARGETS"] == "all" else ["--sample"]
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_targets.py"), "--failures-only", *sample],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=5400)
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-5000:]


def test_the_sample_keeps_the_largest_configuration_of_each_kind():
    """--sample keeps one task per kernel, pointer dtypes and IR family: the one sized largest; sm80 and sm86 share
    a family, gfx90a does not."""
    targets = ("sm80", "sm86", "gfx90a")
    captured = [ct.target_launches(t, 3700 + i, DEMO, ("linear",))[0] for i, t in enumerate(targets)]
    tasks = ct._tasks(targets, captured)
    kept = ct.sampled(tasks)
    assert 0 < len(kept) < len(tasks)

    def kind(task):
        _, target, launch, _ = task[0]
        family = "sm8x" if target.startswith("sm") else target
        return family, launch.kernel, re.match(r"\w+\(([^)]*)\)", launch.summary).group(1)

    assert len({kind(t) for t in kept}) == len(kept) == len({kind(t) for t in tasks})
    for task in kept:
        _, target, launch, _ = task[0]
        same = [t for t in tasks if kind(t) == kind(task)]
        largest = max(ct._estimate(t[0][2], ct.target_caps(t[0][1])) or 0 for t in same)
        assert (ct._estimate(launch, ct.target_caps(target)) or 0) == largest
    assert ct.parse_args(["--sample"]).sample and not ct.parse_args([]).sample
