"""The int4 tensor-core kernel (2-256 rows of x): y = x @ W.T with W in quantize.py's packed int4 layout.

W is uint8 (N, K/2): byte b of a row holds input 2b in its low nibble and input 2b + 1 in its high nibble; `sz` is
fp16 (N, K/G, 2), read as one int32 per (row, group): the scale in the low half, the offset in the high half, so a
weight is scale * q + offset with q in 0..15. Like triton_linear.small_m_dot, x is padded to a tile of 16-64 rows so
that each weight byte is read once per tile of rows, and Triton's software pipeliner keeps tiles in flight.

Even and odd inputs. The two nibbles of a byte are inputs 2b and 2b + 1, so a tile in input order interleaves them;
unpacking 32-bit words into one (joins and a reshape) made Triton 3.6 pass the tile through shared memory on its way
to the tensor cores. Instead the kernel keeps the byte tile's shape and splits the product in two:
    x @ W.T = x[:, 0::2] @ W[:, 0::2].T + x[:, 1::2] @ W[:, 1::2].T,
where W[:, 0::2] is the low nibbles of the byte tile and W[:, 1::2] the high ones, and x[:, 0::2] / x[:, 1::2] are
the low / high halves of x read as int32 words (16-bit x; fp32 x is read with a stride of 2). Every step is then
elementwise on tiles of one shape, so the bytes go from shared memory straight into the MMA operand's registers.

Nibbles become 16-bit floats without integer-to-float conversions: a nibble ORed into the mantissa of a float with
a fixed exponent is the float BIAS + q, exactly (bf16: 0x4300 | q = 128 + q; fp16: 0x6400 | q = 1024 + q). On NVIDIA
one PTX block turns 4 packed bytes into 8 such values with one shift, 4 byte permutes and 4 AND-ORs (LOP3), two
values per 32-bit operation; elsewhere (and in Triton's interpreter) the same bits come from plain Triton integer
ops. fp32 x takes the fp32 form of the trick (2**23 + q, minus 2**23: q exactly) and BIAS 0.

Scales per group, exactly. The dot of each sub-block of SUB = min(BLOCK_K, G) inputs (one group or part of one) is
taken alone, in fp32, and then scaled:
    acc += scale * dot(x, BIAS + q) + (offset - BIAS * scale) * sum(x)        (per row of x, per output column)
The products x * (BIAS + q) of 16-bit x are exact in fp32 (at most 11 + 11 significant bits; fp32 x's products
round once, as the reference's do), so this equals the reference
x @ (scale * q + offset).T up to the order of fp32 sums: the BIAS * sum(x) that the second term removes costs
at most log2(BIAS / 8) of the sums' 24 bits (about 2**-20 in bf16, 2**-17 in fp16), far below the one rounding of
y to x's dtype. The alternative, dequantizing to the dot's dtype first, would round scale * q + offset (up to 15
significant bits) to bf16's 8 and change y by up to 2**-8 of each product; splitting the dot costs two FMAs per
output element per sub-block instead: 2 * BLOCK_M / SUB per weight (a quarter at G=128 with 16-row x tiles, one at
G=32, where this is the larger cost).

SWAP computes y.T = W @ x.T: the weight tile is the MMA's left operand, which Hopper's wgmma takes from registers
(64 weight rows per warp group), and x.T its right one, from shared memory; without SWAP the weight tile is the
right operand (on Hopper with 64-row x tiles that sends it through shared memory for wgmma; mma.sync elsewhere).

Configs come from configs.fitted_int4_dot_config. Only kernels/linear.py imports this module, lazily, from the GPU
implementation of redline::int4_linear.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import Int4DotConfig, dot_block_m, fitted_int4_dot_config
from .device import device_caps

# The smallest group (and the smallest K step): 32 inputs, 16 bytes of a weight row.
MIN_GROUP = 32


def _nibble_asm(magic: int, pack: int) -> str:
    """The PTX of _nibbles_ptx for `pack` bytes per register (2 or 4) and the exponent bits `magic` (bf16x2 or fp16x2)."""
    src = "$4" if pack == 4 else "$2"
    selectors = ("0x4140", "0x4342")[: pack // 2]  # bytes (0, 1) and (2, 3) of the register
    n = len(selectors)
    lines = ["{", ".reg .b32 t;", f"shr.b32 t, {src}, 4;"]
    lines += [f"prmt.b32 ${i}, {src}, 0, {sel};" for i, sel in enumerate(selectors)]
    lines += [f"prmt.b32 ${n + i}, t, 0, {sel};" for i, sel in enumerate(selectors)]
    lines += [f"lop3.b32 ${i}, ${i}, 0x000F000F, {magic:#010x}, 0xea;" for i in range(2 * n)]
    return "\n".join(lines + ["}"])


# 128 + q in bf16 (0x4300 | q) and 1024 + q in fp16 (0x6400 | q), two per 32-bit register.
_ASM_BF16_4 = tl.constexpr(_nibble_asm(0x43004300, 4))
_ASM_BF16_2 = tl.constexpr(_nibble_asm(0x43004300, 2))
_ASM_FP16_4 = tl.constexpr(_nibble_asm(0x64006400, 4))
_ASM_FP16_2 = tl.constexpr(_nibble_asm(0x64006400, 2))


@triton.jit
def _nibbles_ptx(b, DT: tl.constexpr, PACK: tl.constexpr):
    """(BIAS + low nibble, BIAS + high nibble) of each byte of the uint8 tile b, in DT (bf16/fp16), by PTX.

    PACK bytes arrive in one 32-bit register; prmt puts byte i of a pair in bits 0..7, byte i + 1 in bits 16..23,
    and one LOP3 keeps the low nibbles and ORs in the exponent: two values per operation. The high nibbles are the
    same after one shift right by 4 of the whole register."""
    if DT == tl.bfloat16:
        if PACK == 4:
            lo, hi = tl.inline_asm_elementwise(asm=_ASM_BF16_4, constraints="=r,=r,=r,=r,r", args=[b],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(asm=_ASM_BF16_2, constraints="=r,=r,r", args=[b],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
    else:
        if PACK == 4:
            lo, hi = tl.inline_asm_elementwise(asm=_ASM_FP16_4, constraints="=r,=r,=r,=r,r", args=[b],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            lo, hi = tl.inline_asm_elementwise(asm=_ASM_FP16_2, constraints="=r,=r,r", args=[b],
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    return lo, hi


@triton.jit
def _nibbles(b, DT: tl.constexpr, PTX: tl.constexpr, PACK: tl.constexpr):
    """The uint8 tile b as two tiles of DT: BIAS + its low nibbles and BIAS + its high nibbles (BIAS: 128 for bf16,
    1024 for fp16, 0 for fp32, where 2**23 + q is formed and 2**23 subtracted)."""
    if DT == tl.float32:
        lo = ((b & 0xF).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        hi = ((b >> 4).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    elif PTX:
        lo, hi = _nibbles_ptx(b, DT, PACK)
    else:
        magic: tl.constexpr = 0x4300 if DT == tl.bfloat16 else 0x6400
        lo = ((b & 0xF).to(tl.int16) | magic).to(DT, bitcast=True)
        hi = ((b >> 4).to(tl.int16) | magic).to(DT, bitcast=True)
    return lo, hi


@triton.jit
def _x_halves(x_ptrs, kh, mask, DT: tl.constexpr):
    """x[:, 0::2] and x[:, 1::2] of one sub-block (kh: its first pair): from int32 words for 16-bit x (the low half
    is the even input), from two strided loads for fp32 x."""
    if DT == tl.float32:
        xe = tl.load(x_ptrs + 2 * kh, mask=mask, other=0)
        xo = tl.load(x_ptrs + 2 * kh + 1, mask=mask, other=0)
    else:
        xw = tl.load(x_ptrs + kh, mask=mask, other=0)
        xe = (xw & 0xFFFF).to(tl.int16).to(DT, bitcast=True)
        xo = (xw >> 16).to(tl.int16).to(DT, bitcast=True)
    return xe, xo


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # fp32 x: full-precision products, not tf32
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _int4_dot_kernel(
    x_ptr, w_ptr, sz_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SWAP: tl.constexpr, PTX: tl.constexpr, PACK: tl.constexpr,
):
    """y = x @ (scale * q + offset).T, fp32 accumulation, for the tile of rows program_id(0) of x and the tile of
    output columns program_id(1).

    x: (M, K), unit stride along K (16-bit x: stride_xm even and x 4-byte aligned: read as int32 pairs);
    w: uint8 (N, K/2), unit stride along K; sz: int32 (N, K/G), contiguous; y: (M, N), unit stride along N.
    K % BLOCK_K == 0 and G divides K. Rows of x past M are zeros (masked loads); rows of w past N re-read row N-1
    and are not stored. Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)).
    """
    SUB: tl.constexpr = BLOCK_K if BLOCK_K < G else G  # inputs per scaled sub-block: one group or part of one
    HALF: tl.constexpr = SUB // 2  # bytes of a weight row (and x pairs) per sub-block
    DT: tl.constexpr = x_ptr.dtype.element_ty
    BIAS: tl.constexpr = 128.0 if DT == tl.bfloat16 else (1024.0 if DT == tl.float16 else 0.0)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_h = tl.arange(0, HALF)
    m_mask = offs_m[:, None] < M
    if DT == tl.float32:
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + 2 * offs_h[None, :]  # (BLOCK_M, HALF) even inputs
    else:
        x_ptrs = x_ptr.to(tl.pointer_type(tl.int32)) + offs_m[:, None] * (stride_xm // 2) + offs_h[None, :]
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_h[None, :]  # (BLOCK_N, HALF)
    KG = K // G
    sz_ptrs = sz_ptr + rows * KG  # (BLOCK_N,)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The (scale, offset) words are loaded one sub-block ahead: Triton's pipeliner leaves a 1-D load like this in
    # the loop, where its latency would stall every step.
    sz = tl.load(sz_ptrs)
    for k0 in range(0, K, BLOCK_K):
        for j in tl.static_range(BLOCK_K // SUB):
            kh = k0 // 2 + j * HALF  # first byte of the sub-block in a weight row
            b = tl.load(w_ptrs + kh, eviction_policy="evict_first")  # (BLOCK_N, HALF) uint8
            xe, xo = _x_halves(x_ptrs, kh, m_mask, DT)  # (BLOCK_M, HALF) each
            sz_next = tl.load(sz_ptrs + tl.minimum((2 * kh + SUB) // G, KG - 1))
            scale = (sz & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            shift = (sz >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) - BIAS * scale
            sz = sz_next
            xs = tl.sum(xe.to(tl.float32) + xo.to(tl.float32), axis=1)  # (BLOCK_M,) sum of x over the sub-block
            we, wo = _nibbles(b, DT, PTX, PACK)  # (BLOCK_N, HALF) each: BIAS + q of the even / odd inputs
            if SWAP:
                part = _dot(we, tl.trans(xe), None, DT == tl.float32)
                part = _dot(wo, tl.trans(xo), part, DT == tl.float32)  # (BLOCK_N, BLOCK_M)
                acc += part * scale[:, None]
                acc += shift[:, None] * xs[None, :]
            else:
                part = _dot(xe, tl.trans(we), None, DT == tl.float32)
                part = _dot(xo, tl.trans(wo), part, DT == tl.float32)  # (BLOCK_M, BLOCK_N)
                acc += part * scale[None, :]
                acc += xs[:, None] * shift[None, :]
    out_ty = y_ptr.dtype.element_ty
    if SWAP:
        y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]  # (BLOCK_N, BLOCK_M)
        tl.store(y_ptrs, acc.to(out_ty), mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))
    else:
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]  # (BLOCK_M, BLOCK_N)
        tl.store(y_ptrs, acc.to(out_ty), mask=m_mask & (offs_n[None, :] < N))


def block_k_for(block_k: int, k: int) -> int:
    """The largest power of two <= block_k that divides k (k a multiple of MIN_GROUP, so at least that)."""
    while k % block_k:
        block_k //= 2
    return block_k


def int4_dot(x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor, out: torch.Tensor | None = None,
             config: Int4DotConfig | None = None, ptx: bool | None = None) -> torch.Tensor:
    """y = x @ dequantize_int4(w, sz).T on the tensor cores, fp32 accumulation, in x.dtype.

    x: (M, K) bf16/fp16/fp32 with unit stride along K; w: uint8 (N, K/2) with unit stride along K; sz: fp16
    (N, K/G, 2), G a power of two >= 32 dividing K; out: (M, N) with unit stride along N. `config` and `ptx` (the
    inline-PTX nibble conversion, default: where the GPU takes PTX) override the defaults (benchmarks and tests).
    """
    m, k = x.shape
    n = w.shape[0]
    groups = sz.shape[1] if sz.dim() == 3 else 0
    if w.dtype != torch.uint8 or w.shape != (n, k // 2) or k % 2 or sz.shape != (n, groups, 2) or groups == 0 \
            or k % groups or sz.dtype != torch.float16:
        raise ValueError(f"int4_dot: weight {tuple(w.shape)} {w.dtype} / scales {tuple(sz.shape)} {sz.dtype} do not "
                         f"fit K={k}; pass quantize.quantize_int4's (uint8 (N, K/2), fp16 (N, K/G, 2))")
    group_size = k // groups
    if group_size < MIN_GROUP or group_size & (group_size - 1):
        raise ValueError(f"int4_dot needs a power-of-two group size >= {MIN_GROUP}, got {group_size}")
    if out is None:
        out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return out
    caps = device_caps(x.device)
    cfg = config or fitted_int4_dot_config(n, k, group_size, x.element_size(), m, caps)
    if cfg is None:  # kernels.linear checks first and dequantizes for cuBLAS/hipBLAS
        raise ValueError(f"no int4 tensor-core config fits this GPU's shared memory for ({m}, {k}) x ({n}, {k}); "
                         "use redline::int4_linear")
    if ptx is None:
        ptx = caps.inline_ptx
    # 16-bit x is read as int32 pairs: a row stride and an address that pairs and words allow.
    if x.stride(1) != 1 or (x.element_size() == 2 and (x.stride(0) % 2 or x.data_ptr() % 4)):
        x = x.clone(memory_format=torch.contiguous_format)
    if w.stride(1) != 1:
        w = w.contiguous()
    sz_words = sz.contiguous().view(torch.int32).view(n, groups)  # (N, K/G): scale | offset << 16
    block_m = dot_block_m(cfg, m)
    _int4_dot_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, cfg.block_n))](
        x, w, sz_words, out,
        m, n, k,
        x.stride(0), w.stride(0), out.stride(0),
        G=group_size, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k_for(cfg.block_k, k),
        SWAP=cfg.swap, PTX=ptx, PACK=2 if cfg.swap else 4,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
