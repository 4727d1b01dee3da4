"""kernels/triton_int4_dot.py and its config table: the int4 tensor-core kernel for 2-256 rows of x.

The kernel itself runs in Triton's interpreter in tests/test_kernels_interpreter.py (fp16 and fp32, whose tl.dot the
interpreter computes correctly); here: the config table on every target, the shared-memory estimate against Triton's
compiled kernels, the op's routing, and on a GPU the kernel (with its inline-PTX conversion) in bf16, fp16 and fp32
against the reference on random, odd and 7B shapes.

The bound the GPU tests hold the kernel to: max |y - y_ref| <= (2**-8 + 1e-4) * max |y_ref| in bf16 (one rounding of y
to bf16, at most 2**-8 of |y|, plus the order of fp32 sums; y_ref = x @ dequantize_int4(w).T in fp32), 2**-11 + 1e-4
in fp16, 1e-4 in fp32. The kernel applies each group's scale and offset to the group's exact fp32 dot, so nothing else
is allowed for.
"""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from redline.kernels import configs, linear
from redline.kernels.configs import Int4DotConfig, fitted_int4_dot_config, int4_dot_config, int4_dot_smem_bytes
from redline.kernels.device import DEFAULT_TARGETS, simulated, target_caps
from redline.quantize import dequantize_int4, quantize_int4

# (N, K) of the projections of Llama-2-7B, Llama-3-8B and Llama-3-70B (fused qkv, wo, fused gate/up, w2, head).
SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (32000, 4096), (6144, 4096), (28672, 4096),
          (4096, 14336), (128256, 4096), (10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)]
ROWS = [2, 3, 4, 8, 16, 17, 32, 33, 64, 65, 128, 256]
GROUP_SIZES = [32, 64, 128, 256]
# Relative error bounds against the fp32 reference: one rounding of y to x's dtype, plus the order of fp32 sums.
GPU_TOLERANCE = {torch.bfloat16: 2 ** -8 + 1e-4, torch.float16: 2 ** -11 + 1e-4, torch.float32: 1e-4}


def test_table_fits_every_target_and_bounds_the_k_step():
    for target, (n, k), g, m, x_bytes in itertools.product(DEFAULT_TARGETS, SHAPES, GROUP_SIZES, ROWS, (2, 4)):
        caps = target_caps(target)
        cfg = fitted_int4_dot_config(n, k, g, x_bytes, m, caps)
        assert cfg is not None, (target, n, k, g, m, x_bytes)
        block_m = configs.dot_block_m(cfg, m)
        assert int4_dot_smem_bytes(block_m, cfg.block_n, cfg.block_k, cfg.num_stages, x_bytes, g, cfg.swap,
                                   caps) <= caps.shared_memory_per_block
        assert cfg.block_k <= configs.INT4_DOT_GROUPS_PER_STEP * g
        assert not (cfg.swap and g < 64)  # 16-byte sub-blocks lose the weight tile's register layout with swap
        if caps.vendor == "amd":  # what Triton 3.6 compiled for AMD without failures or spills
            assert cfg.num_stages <= 3 and cfg.block_n <= 64 and cfg.block_k <= 2 * g
        assert block_m == (64 if m > 32 else 32 if m > 16 else 16)
    # every H100/H200 choice for 16-bit x is the table's, unshrunk
    for (n, k), g, m in itertools.product(SHAPES, GROUP_SIZES, ROWS):
        assert fitted_int4_dot_config(n, k, g, 2, m, target_caps("sm90")) == int4_dot_config(n, k, g, m)


def test_no_config_where_nothing_fits():
    tiny = replace(target_caps("sm80"), shared_memory_per_block=2048)
    assert fitted_int4_dot_config(4096, 4096, 128, 2, 8, tiny) is None
    x = torch.empty(8, 4096, dtype=torch.bfloat16)
    w, sz = torch.empty(4096, 2048, dtype=torch.uint8), torch.empty(4096, 32, 2, dtype=torch.float16)
    with simulated(tiny):
        assert linear._int4_dot_config(x, w, sz) is None  # the op then dequantizes for cuBLAS
    with simulated(target_caps("sm90")):
        assert linear._int4_dot_config(x, w, sz) == int4_dot_config(4096, 4096, 128, 8)


def test_config_validation():
    with pytest.raises(ValueError, match="block_k"):
        Int4DotConfig(64, 24, 4, 3, swap=True)
    assert replace(Int4DotConfig(64, 256, 4, 4, swap=True), num_stages=2).swap  # shrinking keeps swap


def test_block_k_divides_k():
    tk = pytest.importorskip("redline.kernels.triton_int4_dot")
    assert tk.block_k_for(256, 4096) == 256
    assert tk.block_k_for(256, 11008) == 256  # 43 * 256
    assert tk.block_k_for(256, 4160) == 64  # 65 * 64
    assert tk.block_k_for(512, 96) == 32


def test_int4_dot_rejects_bad_weights():
    tk = pytest.importorskip("redline.kernels.triton_int4_dot")
    w, sz = quantize_int4(torch.randn(8, 128), 32)
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="do not fit K=128"):
        tk.int4_dot(x, w[:, :-1], sz)
    with pytest.raises(ValueError, match="do not fit K=128"):
        tk.int4_dot(x, w, sz.float())
    with pytest.raises(ValueError, match="power-of-two group size"):
        tk.int4_dot(torch.randn(2, 96), quantize_int4(torch.randn(8, 96), 32)[0], torch.zeros(8, 2, 2).half())


def test_shared_memory_estimate_covers_compiled_kernels():
    """Triton's compiled kernels (sm90: wgmma with swap, and a 64-row x tile without; sm80: mma.sync) use no more
    shared memory than the estimate the table is fitted with, and spill nothing."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from redline.kernels.triton_int4_dot import _int4_dot_kernel

    signature = {"x_ptr": "*bf16", "w_ptr": "*u8", "sz_ptr": "*i32", "y_ptr": "*bf16", "M": "i32", "N": "i32",
                 "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "G": "constexpr",
                 "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "SWAP": "constexpr",
                 "PTX": "constexpr", "PACK": "constexpr"}
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 6, 7, 8, 9)}
    for arch, block_m, g, cfg in [(90, 16, 128, int4_dot_config(22016, 4096, 128, 4)),
                                  (90, 64, 128, int4_dot_config(4096, 4096, 128, 256)),
                                  (90, 64, 64, Int4DotConfig(64, 128, 4, 3)),
                                  (80, 16, 32, int4_dot_config(4096, 11008, 32, 16))]:
        constants = {"G": g, "BLOCK_M": block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "SWAP": cfg.swap,
                     "PTX": True, "PACK": 2 if cfg.swap else 4}
        kernel = triton.compile(ASTSource(_int4_dot_kernel, signature, constants, aligned),
                                target=GPUTarget("cuda", arch, 32),
                                options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        estimate = int4_dot_smem_bytes(block_m, cfg.block_n, cfg.block_k, cfg.num_stages, 2, g, cfg.swap,
                                       target_caps(f"sm{arch}"))
        assert kernel.metadata.shared <= estimate, (arch, cfg, kernel.metadata.shared, estimate)
        assert ".local" not in kernel.asm["ptx"] and "ld.local" not in kernel.asm["ptx"], (arch, cfg)


# --- on a GPU ---


def _rel_err(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> float:
    """max |y - x @ W.T| / max |x @ W.T|, the product in fp32 with W = dequantize_int4(w, sz)."""
    ref = F.linear(x.float(), dequantize_int4(w, sz))
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k,g", [(333, 4160, 64), (7, 32, 32), (1000, 96, 32), (130, 512, 256), (4099, 1024, 128)])
@pytest.mark.parametrize("m", [2, 17, 64, 130, 256])
def test_gpu_int4_dot_matches_reference(n, k, g, m, dtype):
    from redline.kernels.triton_int4_dot import int4_dot

    w, sz = quantize_int4(torch.randn(n, k, device="cuda") * 0.02, g)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    int4_dot(x, w, sz, out)
    assert _rel_err(out, x, w, sz) <= GPU_TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (32000, 4096)])
@pytest.mark.parametrize("g", [32, 128])
@pytest.mark.parametrize("m", [4, 16, 64, 256])
def test_gpu_int4_linear_7b_shapes(n, k, g, m):
    """The op on the 7B shapes in bf16: the tensor-core kernel (bit for bit what int4_dot gives) within the bound."""
    from redline.kernels.triton_int4_dot import int4_dot

    w, sz = quantize_int4(torch.randn(n, k, device="cuda") * 0.02, g)
    x = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.ops.redline.int4_linear(x, w, sz)
    assert torch.equal(y[0], int4_dot(x[0], w, sz))
    assert _rel_err(y[0], x[0], w, sz) <= GPU_TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("config", [Int4DotConfig(64, 256, 4, 4, 0, True), Int4DotConfig(128, 128, 8, 4, 0, True),
                                    Int4DotConfig(32, 256, 4, 4, 0, False), Int4DotConfig(64, 128, 4, 3, 64, True),
                                    Int4DotConfig(16, 64, 4, 2, 0, True), Int4DotConfig(64, 512, 4, 3, 0, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ptx", [True, False])
def test_gpu_int4_dot_configs_and_conversions(config, dtype, ptx):
    """Every tile form (swapped or not, 16-64 row tiles, the PTX and the plain nibble conversion) on a 7B shape."""
    from redline.kernels.triton_int4_dot import int4_dot

    w, sz = quantize_int4(torch.randn(4096, 4096, device="cuda") * 0.02, 64)
    x = torch.randn(40, 4096, device="cuda", dtype=dtype)
    y = int4_dot(x, w, sz, config=config, ptx=ptx and torch.version.hip is None)
    assert _rel_err(y, x, w, sz) <= GPU_TOLERANCE[dtype]


@pytest.mark.gpu
def test_gpu_int4_linear_takes_cublas_past_small_m_and_for_unaligned_x():
    w, sz = quantize_int4(torch.randn(512, 1024, device="cuda") * 0.02, 128)
    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    y = torch.ops.redline.int4_linear(x, w, sz)  # 300 rows: the weight dequantized to bf16 for cuBLAS
    assert _rel_err(y, x, w, sz) <= 1e-2
    odd = torch.randn(5, 1025, device="cuda", dtype=torch.bfloat16)[:, 1:]  # 2-byte offset: copied for 32-bit reads
    assert _rel_err(torch.ops.redline.int4_linear(odd, w, sz), odd, w, sz) <= GPU_TOLERANCE[torch.bfloat16]
