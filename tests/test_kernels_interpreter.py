"""The Triton kernels themselves, run on the CPU by Triton's interpreter and compared with their references.

TRITON_INTERPRET=1 must be set before Triton is imported, and other test modules may import Triton first, so the
kernels run in one child process (this file run as a script, `python tests/test_kernels_interpreter.py`, with the
variable set): it runs every case and prints one JSON line of the largest errors, and each test checks its case.
The interpreter's tl.dot multiplies bf16 operands as raw bits, so the tensor-core kernels are checked in fp16 and
fp32 here; the GEMV and the rope kernel (no tl.dot) also run in bf16. Shapes are small to keep the child fast.
The int4 tensor-core kernel runs its portable nibble conversion here (the interpreter runs no inline PTX).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import interpreted_errors_of

ROOT = Path(__file__).resolve().parents[1]
# Error bounds against the fp32 references: the kernels accumulate in fp32 and round once to the output dtype.
TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 2e-2}

# Rows of x in the int4 tensor-core cases: 2 and 3 (tiles of 16 rows, mostly padding), 17, 64 (one tile of 32 / 64
# rows), 130 (three tiles of 64).
INT4_DOT_ROWS = (2, 3, 17, 64, 130)

# (name, dtype): every case the child runs.
CASES = [
    *[(f"gemv_{v}", d) for v in ("plain", "odd_k", "norm", "swiglu", "geglu", "residual")
      for d in ("float32", "bfloat16")],
    ("gemv_int8", "float16"), ("gemv_int8_odd_k", "float32"),
    *[(f"dot_{m}", d) for m in (2, 17, 70) for d in ("float32", "float16")],
    ("dot_int8", "float16"),
    *[(f"int4dot_{m}", d) for m in INT4_DOT_ROWS for d in ("float32", "float16")],
    *[(f"attention_{v}", d) for v in ("split", "single", "mha", "qkv", "qkv7", "qkvpartial", "qkvnorm", "qkvwindow",
                                       "window", "windowsingle") for d in ("float32", "float16")],
    ("rope_prefill", "bfloat16"), ("rope_prefill", "float32"), ("rope_partial", "float32"),
    # FP8 weights: the GEMV (per-channel and 128 x 128 block scales, fused SwiGLU), the per-token quantizer (exact
    # codes: 0 error) and the W8A8 tensor-core kernel (fp8 x fp8 dots; fp16 / fp32 outputs)
    *[(f"fp8gemv_{v}", d) for v in ("channel", "channel_bytes", "block", "block_odd_k", "block_swiglu") for d in ("float32", "bfloat16")],
    *[(f"fp8quant_{m}", d) for m in (2, 70) for d in ("float32", "float16")],
    *[(f"fp8dot_{s}{m}", d) for s in ("channel", "block") for m in (2, 17, 70) for d in ("float32", "float16")],
]


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


def _rope_table(seq_len: int, head_dim: int) -> torch.Tensor:
    """A cos/sin table (S, 2, D/2) fp32 in the model's layout, base 10000 (head_dim: the rotated features)."""
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (D/2,)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (S, D/2)
    return torch.stack([angles.cos(), angles.sin()], dim=1)


def _gemv_case(variant: str, dtype: torch.dtype) -> float:
    from redline.kernels import configs, linear
    from redline.kernels import triton_linear as tk

    k = 100 if variant in ("odd_k", "int8_odd_k") else 256
    n = 48
    x = torch.randn(1, k, dtype=dtype)
    if variant.startswith("int8"):
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scales = torch.rand(n, dtype=dtype) / 50
        got = tk.gemv(x, w, scales, pdl=False, int8_mode=1, config=configs.GemvConfig(2, 64, 2, 1, True))
        return _rel_err(got, linear.int8_linear_reference(x, w, scales))
    gated = variant in ("swiglu", "geglu")
    w = torch.randn(2 * n if gated else n, k, dtype=dtype) / k ** 0.5
    # small blocks (the interpreter runs each program in Python), both pipeline depths, with and without RED
    chosen = {"plain": configs.GemvConfig(1, 64, 2, 2, False), "residual": configs.GemvConfig(4, 32, 2, 1, True)}
    norm = torch.rand(k, dtype=dtype) + 0.5 if variant in ("norm", "swiglu") else None
    if variant == "geglu":  # Gemma's norm: 1 + w, kept in fp32
        norm = torch.rand(k) + 0.5
    residual = torch.randn(n, dtype=dtype) if variant == "residual" else None
    got = tk.gemv(x, w, pdl=False, int8_mode=1, norm_weight=norm, eps=1e-5, residual=residual,
                  swiglu=gated, gelu=variant == "geglu",
                  config=chosen.get(variant, configs.GemvConfig(2, 64, 2, 2, True)))
    want = linear.fused_linear_reference(x, w, None, norm, 1e-5, residual, gated, gelu=variant == "geglu")
    return _rel_err(got, want)


def _dot_case(variant: str, dtype: torch.dtype) -> float:
    from redline.kernels import configs, linear
    from redline.kernels import triton_linear as tk

    m = 5 if variant == "int8" else int(variant)
    n, k = 96, 160  # K not a multiple of the 128-wide blocks below: the masked path
    x = torch.randn(m, k, dtype=dtype)
    config = configs.DotConfig(32, 128, 4, 2)  # small tiles: the interpreter runs each program in Python
    if variant == "int8":
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        scales = torch.rand(n, dtype=dtype) / 50
        return _rel_err(tk.small_m_dot(x, w, scales, config=config), linear.int8_linear_reference(x, w, scales))
    w = torch.randn(n, k, dtype=dtype) / k ** 0.5
    return _rel_err(tk.small_m_dot(x, w, config=config), linear.linear_reference(x, w))


def _int4_dot_case(m: int, dtype: torch.dtype) -> float:
    """The int4 tensor-core kernel against int4_linear_reference: odd N, group sizes 32-256, swapped and not, K steps
    shorter than a group, several groups per step, a K that the config's step does not divide, x at an odd offset
    (copied for the kernel's 32-bit reads) and a weight with a row stride past K/2."""
    from redline.kernels import configs, linear
    from redline.kernels.triton_int4_dot import int4_dot
    from redline.quantize import quantize_int4

    n, k, group_size, config = {
        2: (33, 256, 64, configs.Int4DotConfig(16, 128, 4, 2)),
        3: (40, 192, 32, configs.Int4DotConfig(32, 128, 4, 2, swap=True)),  # K=192: 64-input steps
        17: (24, 256, 128, configs.Int4DotConfig(16, 64, 4, 2)),  # two steps per group
        64: (17, 128, 32, configs.Int4DotConfig(32, 128, 4, 1, swap=True)),  # four groups per step
        130: (20, 256, 256, configs.Int4DotConfig(16, 256, 4, 2, block_m=64)),
    }[m]
    w, scales = quantize_int4(torch.randn(n, k), group_size)
    if m == 17:
        w = torch.cat([w, torch.zeros(n, 16, dtype=torch.uint8)], dim=1)[:, :k // 2]
    x = torch.randn(m, k + 1, dtype=dtype)[:, 1:] if m == 3 else torch.randn(m, k, dtype=dtype)
    return _rel_err(int4_dot(x, w, scales, config=config), linear.int4_linear_reference(x, w, scales))


def _attention_case(variant: str, dtype: torch.dtype) -> float:
    from redline.kernels import attention as da
    from redline.kernels import configs
    from redline.kernels import triton_attention as ta

    # qkv7: seven query heads per KV head (Qwen2.5-7B's 28:4), not a power of two
    n_heads, n_kv_heads = {"mha": (4, 4), "qkv7": (14, 2)}.get(variant, (8, 2))
    batch, seq_len, head_dim, pos = 2, 80, 32, 70
    config = configs.AttentionConfig(num_splits=1 if variant.endswith("single") else 3, block_s=16)
    k_cache = torch.randn(batch, n_kv_heads, seq_len, head_dim, dtype=dtype)  # (B, Hkv, S, D)
    v_cache = torch.randn(batch, n_kv_heads, seq_len, head_dim, dtype=dtype)
    k_cache[:, :, pos + 1:] = float("nan")  # past input_pos: never read
    v_cache[:, :, pos + 1:] = float("nan")
    input_pos = torch.tensor([pos])
    if variant.startswith("qkv"):
        # qkvpartial: the first 24 of 32 features rotate (Phi-3's partial rotary), a width that is no power of two
        rope = _rope_table(seq_len, 24 if variant == "qkvpartial" else head_dim)
        qkv = torch.randn(batch, 1, (n_heads + 2 * n_kv_heads) * head_dim, dtype=dtype)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        # qkvnorm: Qwen3's per-head q/k norms in the kernel, weights far from 1, rows far from unit scale
        norms = (torch.randn(head_dim, dtype=dtype) * 0.5 + 1, torch.randn(head_dim, dtype=dtype) * 0.5 + 1, 1e-6)
        if variant == "qkvnorm":
            qkv = qkv * 3
        norms = norms if variant == "qkvnorm" else None
        window = 22 if variant == "qkvwindow" else 0  # a sliding-window layer (Gemma 3) in the fused kernel
        want = da.decode_attention_qkv_reference(qkv, k_ref, v_ref, rope, input_pos, *(norms or (None, None, 0.0)),
                                                 window)
        if window:
            k_cache[:, :, :pos + 1 - window] = float("nan")  # before the window: never read
            v_cache[:, :, :pos + 1 - window] = float("nan")
        got = ta.decode_attention_qkv(qkv, k_cache, v_cache, rope, input_pos, config=config, qk_norms=norms,
                                      window=window)
        cache_err = max(_rel_err(k_cache[:, :, pos], k_ref[:, :, pos]), _rel_err(v_cache[:, :, pos], v_ref[:, :, pos]))
        return max(_rel_err(got, want), cache_err)
    q = torch.randn(batch, n_heads, 1, head_dim, dtype=dtype)  # (B, H, 1, D)
    window = 22 if variant.startswith("window") else 0  # keys 49..70: from inside the fourth block of 16
    if window:
        want = da.decode_attention_reference(q, k_cache, v_cache, input_pos, window)
        k_cache[:, :, :pos + 1 - window] = float("nan")  # before the window: never read
        v_cache[:, :, :pos + 1 - window] = float("nan")
        return _rel_err(ta.decode_attention(q, k_cache, v_cache, input_pos, config=config, window=window), want)
    got = ta.decode_attention(q, k_cache, v_cache, input_pos, config=config)
    return _rel_err(got, da.decode_attention_reference(q, k_cache, v_cache, input_pos))


def _rope_case(variant: str, dtype: torch.dtype) -> float:
    from redline.kernels import attention as da
    from redline.kernels import triton_attention as ta

    batch, length, n_heads, n_kv_heads, head_dim = 2, 37, 4, 2, 32
    rope = _rope_table(length, 24 if variant == "partial" else head_dim)  # (T, 2, R/2)
    qkv = torch.randn(batch, length, (n_heads + 2 * n_kv_heads) * head_dim, dtype=dtype)
    caches = [torch.zeros(batch, n_kv_heads, 48, head_dim, dtype=dtype) for _ in range(4)]  # (B, Hkv, S, D)
    got = ta.prefill_rope_cache(qkv, caches[0], caches[1], rope)
    want = da.prefill_rope_cache_reference(qkv, caches[2], caches[3], rope)
    return max(_rel_err(got, want), _rel_err(caches[0], caches[2]), _rel_err(caches[1], caches[3]))


def _fp8_gemv_case(variant: str, dtype: torch.dtype) -> float:
    from redline.kernels import configs, linear
    from redline.kernels import triton_linear as tk
    from redline.quantize import quantize_fp8

    # K a multiple of 4: the weights are read as int32 words; 302: one byte at a time
    k = 300 if variant.endswith("odd_k") else 302 if variant.endswith("bytes") else 256
    swiglu = variant.endswith("swiglu")
    weight, scales = quantize_fp8(torch.randn(256 if swiglu else 136, k) / k ** 0.5,
                                  block_scales=variant.startswith("block"))
    every_code = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)  # subnormals and +-448 included
    weight[:, :256] = every_code[every_code.float().isfinite()].repeat(2)[:256]
    x = torch.randn(1, k, dtype=dtype)
    norm = torch.rand(k, dtype=dtype) + 0.5 if swiglu else None
    got = tk.gemv(x, weight, scales, pdl=False, int8_mode=1, norm_weight=norm, eps=1e-5, swiglu=swiglu,
                  config=configs.GemvConfig(4, 64, 2, 2, True) if swiglu else configs.GemvConfig(2, 128, 2, 2, True))
    return _rel_err(got, linear.fused_linear_reference(x, weight, scales, norm, 1e-5, None, swiglu))


def _fp8_quant_case(m: int, dtype: torch.dtype) -> float:
    from redline.kernels import triton_fp8
    from redline.quantize import quantize_activations_fp8

    x = torch.randn(m, 1100, dtype=dtype) * torch.rand(m, 1, dtype=dtype) * 10  # K past one 1024-input block
    x[0, :5] = torch.tensor([0.0, 1e-9, -3e4, 2e-3, 7.0], dtype=dtype)
    codes, scales = triton_fp8.quantize_rows(x)
    want_codes, want_scales = quantize_activations_fp8(x)
    return max(_rel_err(codes.float(), want_codes.float()), _rel_err(scales, want_scales.squeeze(1)))


def _fp8_dot_case(variant: str, dtype: torch.dtype) -> float:
    from redline.kernels import configs, triton_fp8
    from redline.quantize import fp8_linear_reference, quantize_fp8

    block, m = variant.startswith("block"), int(variant.removeprefix("block").removeprefix("channel"))
    k, n = (300, 136) if m == 17 else (256, 200)  # K and N not multiples of the tiles or the 128-input blocks
    weight, scales = quantize_fp8(torch.randn(n, k) / k ** 0.5, block_scales=block)
    x = torch.randn(m, k, dtype=dtype)
    codes, row_scales = triton_fp8.quantize_rows(x)
    out = torch.empty(m, n, dtype=dtype)
    triton_fp8.fp8_dot(codes, row_scales, weight, scales, out, config=configs.Fp8DotConfig(16, 32, 64, 4, 2))
    return _rel_err(out, fp8_linear_reference(x, weight, scales))


def run_case(name: str, dtype_name: str) -> float:
    """The largest relative error of one case against its reference."""
    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    kind, _, variant = name.partition("_")
    if kind == "gemv":
        return _gemv_case(variant, dtype)
    if kind == "dot":
        return _dot_case(variant, dtype)
    if kind == "int4dot":
        return _int4_dot_case(int(variant), dtype)
    if kind == "attention":
        return _attention_case(variant, dtype)
    if kind == "fp8gemv":
        return _fp8_gemv_case(variant, dtype)
    if kind == "fp8quant":
        return _fp8_quant_case(int(variant), dtype)
    if kind == "fp8dot":
        return _fp8_dot_case(variant, dtype)
    return _rope_case(variant, dtype)


@pytest.fixture(scope="module")
def interpreted_errors() -> dict[str, float]:
    return interpreted_errors_of(__file__, timeout=600, extra_env={"PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("name,dtype", CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_kernel_matches_reference_in_interpreter(interpreted_errors, name, dtype):
    err = interpreted_errors[f"{name}/{dtype}"]
    assert err <= TOLERANCE[dtype], f"{name} in {dtype}: relative error {err:.2e}"


def _allow_one_element_loop_bounds() -> None:
    """Triton 3.6's interpreter turns a scalar (a one-element array) into a loop bound with int(array), which NumPy
    2.4 refuses for arrays of one dimension; make that one conversion take the element (the child process only)."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the kernels run in Triton's interpreter)")
    _allow_one_element_loop_bounds()
    print(json.dumps({f"{name}/{dtype}": run_case(name, dtype) for name, dtype in CASES}))
