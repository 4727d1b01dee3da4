"""kernels/device.py: the one description of what the running GPU supports, and the package's lazy Triton import."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from redline import kernels
from redline.kernels import device
from redline.kernels.device import CPU_CAPS, DeviceCaps, device_caps

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_gpu(monkeypatch):
    """Make torch report one GPU with the given properties (and HIP version), with a fresh caps cache."""

    def install(props: SimpleNamespace, hip: str | None = None) -> None:
        device._gpu_caps.cache_clear()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
        monkeypatch.setattr(torch.version, "hip", hip)

    yield install
    device._gpu_caps.cache_clear()


def test_cpu_device_has_no_gpu_features():
    assert device_caps("cpu") == CPU_CAPS
    assert device_caps(torch.device("cpu")).vendor == "cpu"
    if not torch.cuda.is_available():
        assert device_caps() == CPU_CAPS


def test_hopper_supports_pdl_tf32_and_ptx(fake_gpu):
    fake_gpu(SimpleNamespace(major=9, minor=0, multi_processor_count=132, shared_memory_per_block_optin=232448,
                             warp_size=32))
    caps = device_caps()
    assert caps == DeviceCaps(vendor="nvidia", arch="sm90", shared_memory_per_block=232448, warp_size=32,
                              sm_count=132, supports_tf32=True, supports_pdl=True, inline_ptx=True, supports_fp8=True)
    assert device_caps(0) is caps and device_caps("cuda:0") is caps  # read once per device


def test_ampere_has_tf32_but_no_pdl_and_defaults_for_missing_fields(fake_gpu):
    fake_gpu(SimpleNamespace(major=8, minor=0, multi_processor_count=108))  # an older torch: no optin, no warp_size
    caps = device_caps()
    assert (caps.arch, caps.supports_tf32, caps.supports_pdl, caps.warp_size) == ("sm80", True, False, 32)
    assert not caps.supports_fp8  # FP8 tensor cores start at sm89
    assert caps.shared_memory_per_block == device.DEFAULT_SHARED_MEMORY_BYTES


def test_amd_reads_the_gcn_arch_and_wavefront(fake_gpu):
    fake_gpu(SimpleNamespace(major=9, minor=0, multi_processor_count=104, gcnArchName="gfx90a:sramecc+:xnack-",
                             shared_memory_per_block=65536, warp_size=64), hip="6.2")
    caps = device_caps()
    assert (caps.vendor, caps.arch, caps.warp_size, caps.sm_count) == ("amd", "gfx90a", 64, 104)
    assert not (caps.supports_pdl or caps.inline_ptx or caps.supports_tf32)


def test_caps_validation():
    with pytest.raises(ValueError, match="vendor"):
        DeviceCaps("intel", "x", 0, 32, 1, False, False, False)
    with pytest.raises(ValueError, match="NVIDIA"):
        DeviceCaps("amd", "gfx942", 65536, 64, 304, False, True, False)
    with pytest.raises(ValueError, match="warp size"):
        DeviceCaps("nvidia", "sm90", 1024, 0, 132, True, True, True)


def test_available_needs_a_gpu_and_triton(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not kernels.available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kernels.available() == device.triton_importable()


def test_importing_the_engine_imports_no_triton():
    """Triton is imported only when a GPU kernel first runs: importing the engine never loads it, and a CPU model
    step through the kernel modules never loads the Triton sources (torch itself may import Triton for its
    compiler when a mutating custom op first runs, so only the package's own modules are checked then)."""
    code = ("import sys, torch\nfrom redline import kernels, model, quantize, checkpoint, generate\n"
            "assert 'triton' not in sys.modules, 'importing the engine imported triton'\n"
            "m = kernels.use_kernels(model.Transformer(model.ModelArgs.from_name('debug-tiny')))\n"
            "m.setup_caches(1, 8)\n"
            "kernels.FusedDecode(m)(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]))\n"
            "m(torch.zeros(1, 3, dtype=torch.long), torch.arange(3), from_start=True)\n"
            "ours = sorted(k for k in sys.modules if k.startswith('redline.kernels.triton'))\n"
            "assert not ours, ours\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


@pytest.mark.gpu
def test_gpu_caps_match_torch():
    props = torch.cuda.get_device_properties(0)
    caps = device_caps(0)
    assert caps.sm_count == props.multi_processor_count
    assert caps.vendor == ("amd" if torch.version.hip else "nvidia")
    if caps.vendor == "nvidia":
        assert caps.arch == f"sm{props.major}{props.minor}"
        assert caps.supports_pdl == (props.major >= 9)


def test_named_targets_describe_their_gpus():
    from redline.kernels.device import DEFAULT_TARGETS, target_caps

    assert DEFAULT_TARGETS == ("sm80", "sm86", "sm89", "sm90", "gfx90a", "gfx942", "gfx1100")
    caps = {name: target_caps(name) for name in DEFAULT_TARGETS}
    assert {n for n, c in caps.items() if c.vendor == "amd"} == {"gfx90a", "gfx942", "gfx1100"}
    assert all(c.arch == n for n, c in caps.items())
    assert {n for n, c in caps.items() if c.supports_tf32} == {"sm80", "sm86", "sm89", "sm90", "gfx942"}
    assert {n for n, c in caps.items() if c.supports_pdl} == {"sm90"}
    assert caps["sm90"].shared_memory_per_block == 227 * 1024 and caps["sm89"].shared_memory_per_block == 99 * 1024
    assert all(caps[n].shared_memory_per_block == 64 * 1024 for n in ("gfx90a", "gfx942", "gfx1100"))
    assert caps["gfx90a"].warp_size == 64 and caps["gfx1100"].warp_size == 32
    with pytest.raises(ValueError, match="known targets: sm80"):
        target_caps("sm75")


def test_simulated_caps_apply_inside_the_block_only():
    from redline.kernels.device import simulated, target_caps

    before = device_caps()
    with simulated(target_caps("gfx90a")) as caps:
        assert device_caps() is caps and device_caps("cpu") is caps and device_caps(0) is caps
    assert device_caps() == before


def test_amd_tf32_only_on_gfx942(fake_gpu):
    fake_gpu(SimpleNamespace(major=9, minor=4, multi_processor_count=304, gcnArchName="gfx942:sramecc+:xnack-",
                             shared_memory_per_block=65536, warp_size=64), hip="6.2")
    assert device_caps().supports_tf32 and device_caps().arch == "gfx942"
