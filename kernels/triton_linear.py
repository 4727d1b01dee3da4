"""Triton kernels for decode-sized linear layers: y = x @ W.T with W row-major (N, K).

At batch 1 a linear layer is a matrix-vector product (GEMV): each weight byte is read once and used
for one multiply-add, so the kernel is bound by memory bandwidth. `gemv` (one row of x):

- gives each program BLOCK_N whole rows of W and walks K in BLOCK_K steps, so every weight byte is
  read exactly once, with coalesced vector loads, and no cross-program reduction is needed (the
  shapes that matter have N >= 4096: thousands of programs without split-K);
- keeps an fp32 accumulator tile in the weight tile's register layout and reduces over K once at
  the end, so the loop is loads, converts and FMAs, with no shuffles and no shared memory
  (RED: each thread first sums its 8 contiguous products, for 8x fewer accumulator registers);
- software-pipelines the K loop DEPTH blocks deep: the raw weight block kb is loaded while block
  kb - DEPTH is converted and multiplied (raw bf16/int8 is compact in registers);
- dequantizes int8 weights in registers (no bf16 copy of the weight), with a bit trick instead of
  the slow int->float conversion, and applies the per-row scale once per output; FP8 (e4m3) weights
  the same way (one byte a weight, the hardware's e4m3 conversion), their scales per output row or per
  128 x 128 block (W_FP8, SCALE_BLOCK: each weight block is multiplied by its rows' scales of that K block);
- uses programmatic dependent launch (PDL, sm_90+): each program loads its first weight blocks
  before `griddepcontrol.wait`, so the kernel streams its constant weights while the kernel before
  it drains; x is read and y written only after the wait;
- fuses its decode neighbours on request (the batch-1 fused decode path): an RMSNorm of x in the
  prologue (1/rms applied to the finished dot products; the sum of squares either computed in the K
  loop or handed on by the kernel that wrote x), and either silu(gate) * up (each program pairs gate
  rows with their up rows) or a residual add, with its sum of squares for the next norm, in the epilogue.

`small_m_dot` (2 or more rows of x) runs the same product on the tensor cores, x padded to 16, 32 or 64
rows (up to 64 rows one tile of rows, so each weight byte is still read once; more rows take several
tiles, whose programs run next to each other so the weight tile comes from L2 after the first), with
Triton's software pipeliner keeping weight tiles in flight.

Configs come from the deterministic tables in configs.py (`gemv_config`, `fitted_dot_config`), never from
autotuning. Only kernels/linear.py imports this module, lazily, from the GPU implementation of its ops.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from .configs import DotConfig, GemvConfig, dot_block_m, fitted_dot_config, gemv_config
from .device import DeviceCaps, device_caps
from .triton_common import gated, gdc_launch_dependents, gdc_wait, pdl_default

# int8 -> fp32 conversion without I2F (a quarter of the FP32 rate on Hopper: it would cap an int8
# GEMV near the memory rate). For s in [-128, 127], the float whose bits are 0x4B000000 | (s + 128)
# is exactly 2**23 + 128 + s; subtracting 8388736.0 (2**23 + 128) leaves s. The weights are loaded
# as int32 words (4 int8 each, so the raw data kept in flight takes 1 register per 4 weights) and
# each word is expanded to 4 floats (INT8_MODE):
#   2: PTX: one xor (s + 128 == s ^ 0x80 per byte), then per byte one prmt (the byte under the
#      0x4B exponent) and one float subtract.
#   1: the same in Triton integer ops (portable: HIP).
INT8_MODE_DEFAULT = 2


@triton.jit
def _int8_words_to_f32(wq, INT8_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BLOCK_N, BLOCK_K // 4) int32 words (little-endian int8 x 4) -> (BLOCK_N, BLOCK_K) float32."""
    if INT8_MODE == 2:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t;
            xor.b32 t, $4, 0x80808080;
            prmt.b32 $0, t, 0x4B000000, 0x7440;
            prmt.b32 $1, t, 0x4B000000, 0x7441;
            prmt.b32 $2, t, 0x4B000000, 0x7442;
            prmt.b32 $3, t, 0x4B000000, 0x7443;
            sub.f32 $0, $0, 0f4B000080;
            sub.f32 $1, $1, 0f4B000080;
            sub.f32 $2, $2, 0f4B000080;
            sub.f32 $3, $3, 0f4B000080;
            }
            """,
            constraints="=r,=r,=r,=r,r",
            args=[wq],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        t = wq ^ -2139062144  # 0x80808080
        f0 = ((t & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        f1 = (((t >> 8) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        f2 = (((t >> 16) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        f3 = (((t >> 24) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    # join adds a last axis: f[..., i, j] = f_{2i+j}, so the reshape puts each word's 4 values in k order.
    f = tl.join(tl.join(f0, f2), tl.join(f1, f3))  # (BLOCK_N, BLOCK_K // 4, 2, 2)
    return tl.reshape(f, (BLOCK_N, BLOCK_K))


# e4m3 weights read as int32 words too (4 weights a register in flight, as int8; one byte a register made the FP8
# GEMV reach about two thirds of the int8 one's bandwidth). Each word becomes 4 floats (INT8_MODE again):
#   2: PTX: per 16-bit half one cvt.rn.f16x2.e4m3x2 (sm89+), then per value one cvt.f32.f16: exact.
#   1: Triton integer ops: an e4m3 byte s.eeee.mmm moved to the fp16 bits s.0eeee.mmm0000000 is the fp16 value
#      e4m3 * 2**-8 (normal and subnormal alike: both formats' subnormals scale the same way), so the fp16 -> fp32
#      conversion then times 256 is exact. (e4m3fn's NaN bytes would read as +-480; quantized weights hold none.)


@triton.jit
def _fp8_words_to_f32(wq, INT8_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BLOCK_N, BLOCK_K // 4) int32 words (little-endian e4m3 x 4) -> (BLOCK_N, BLOCK_K) float32."""
    if INT8_MODE == 2:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b16 lo, hi, a, b;
            .reg .b32 p, q;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 p, lo;
            cvt.rn.f16x2.e4m3x2 q, hi;
            mov.b32 {a, b}, p;
            cvt.f32.f16 $0, a;
            cvt.f32.f16 $1, b;
            mov.b32 {a, b}, q;
            cvt.f32.f16 $2, a;
            cvt.f32.f16 $3, b;
            }
            """,
            constraints="=r,=r,=r,=r,r",
            args=[wq],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        f0 = _e4m3_byte_to_f32(wq)
        f1 = _e4m3_byte_to_f32(wq >> 8)
        f2 = _e4m3_byte_to_f32(wq >> 16)
        f3 = _e4m3_byte_to_f32(wq >> 24)
    f = tl.join(tl.join(f0, f2), tl.join(f1, f3))  # (BLOCK_N, BLOCK_K // 4, 2, 2), as in _int8_words_to_f32
    return tl.reshape(f, (BLOCK_N, BLOCK_K))


@triton.jit
def _e4m3_byte_to_f32(t):
    """The e4m3 value of the low byte of int32 t, by the fp16 bit move above (exact)."""
    half = ((t & 0x80) << 8) | ((t & 0x7F) << 7)  # the fp16 bits of e4m3 * 2**-8
    return half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _weight_to_f32(w, W_INT8: tl.constexpr, WORDS: tl.constexpr, INT8_MODE: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_FP8: tl.constexpr = False):
    if W_FP8 and WORDS:
        return _fp8_words_to_f32(w, INT8_MODE, BLOCK_N, BLOCK_K)
    elif W_FP8:  # e4m3 bytes, loaded as uint8 (masked lanes read 0): the hardware's e4m3 conversion (sm89+)
        return w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif W_INT8 and WORDS:
        return _int8_words_to_f32(w, INT8_MODE, BLOCK_N, BLOCK_K)
    elif W_INT8:  # single bytes (K or the row stride not a multiple of 4): same trick, one per byte
        wi = w.to(tl.int32) + 0x4B000080
        return wi.to(tl.float32, bitcast=True) - 8388736.0
    else:
        return w.to(tl.float32)


@triton.jit
def _dot_part(acc, wf, x, RED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    if RED:  # sum each thread's 8 contiguous products first: 8x fewer accumulator registers
        return acc + tl.sum(tl.reshape(wf * x, (BLOCK_N, BLOCK_K // 8, 8)), axis=2)
    else:
        return acc + wf * x


@triton.jit
def _load(ptrs, k0, K, offs_k, MASK: tl.constexpr, WEIGHT: tl.constexpr, BYPASS_L1: tl.constexpr = False):
    # k0, K and offs_k count loaded elements (int32 words in the packed int8 weight path).
    # Weights are read once: evict_first keeps them from pushing x and y out of L2. BYPASS_L1 (int8 weights) loads
    # them past L1 instead (".cg"): in the 7B model 462.3 / 462.7 tok/s against 459.6-460.2; bf16 lost 0.6% that way.
    if MASK:
        if WEIGHT and BYPASS_L1:
            return tl.load(ptrs + k0, mask=(k0 + offs_k)[None, :] < K, other=0, cache_modifier=".cg")
        elif WEIGHT:
            return tl.load(ptrs + k0, mask=(k0 + offs_k)[None, :] < K, other=0, eviction_policy="evict_first")
        else:
            return tl.load(ptrs + k0, mask=(k0 + offs_k)[None, :] < K, other=0)
    else:
        if WEIGHT and BYPASS_L1:
            return tl.load(ptrs + k0, cache_modifier=".cg")
        elif WEIGHT:
            return tl.load(ptrs + k0, eviction_policy="evict_first")
        else:
            return tl.load(ptrs + k0)


@triton.jit
def _step(acc, ss, w, x_ptrs, g_ptrs, k0, K, offs_k, MASK: tl.constexpr, W_INT8: tl.constexpr,
          WORDS: tl.constexpr, INT8_MODE: tl.constexpr, RED: tl.constexpr, NORM: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, sb_ptrs=None, SCALE_BLOCK: tl.constexpr = False,
          W_FP8: tl.constexpr = False):
    """acc += (weight block w, converted to fp32) * x[k0 : k0 + BLOCK_K].

    NORM (1 or 2): x is the RMSNorm input: the block is multiplied by the norm weight g (fp32, unrounded)
    and, with NORM == 1, its squares are added to ss; the kernel applies 1/rms to the finished dot products.
    SCALE_BLOCK: the weights are scaled per 128 x 128 block: sb_ptrs (BLOCK_N, 1) point at each row's block
    row of scales, and every weight is multiplied by the scale of its K block (k // 128) before the dot.
    """
    x = _load(x_ptrs, k0, K, offs_k, MASK, False).to(tl.float32)
    if NORM == 1:
        ss += x * x
    if NORM > 0:
        x = x * _load(g_ptrs, k0, K, offs_k, MASK, False).to(tl.float32)
    wf = _weight_to_f32(w, W_INT8, WORDS, INT8_MODE, BLOCK_N, BLOCK_K, W_FP8)
    if SCALE_BLOCK:
        kb = (k0 + offs_k)[None, :]  # (1, BLOCK_K)
        if MASK:
            wf = wf * tl.load(sb_ptrs + kb // 128, mask=kb < K, other=0)
        else:
            wf = wf * tl.load(sb_ptrs + kb // 128)
    acc = _dot_part(acc, wf, x, RED, BLOCK_N, BLOCK_K)
    return acc, ss


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, g_ptr, r_ptr, sq_in_ptr, sq_out_ptr,
    N, K, stride_wn, eps, stride_sn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEPTH: tl.constexpr, RED: tl.constexpr,
    EVEN_K: tl.constexpr, NO_MASK: tl.constexpr,
    W_INT8: tl.constexpr, WORDS: tl.constexpr, INT8_MODE: tl.constexpr, USE_PDL: tl.constexpr,
    NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, GELU: tl.constexpr, SQ_OUT: tl.constexpr,
    SQ_LANES: tl.constexpr, W_FP8: tl.constexpr = False, SCALE_BLOCK: tl.constexpr = False,
):
    """y[n] = sum_k x[k] * w[n, k] (times s[n] when W_INT8 or W_FP8), fp32 accumulation, with optional fusions:

    W_FP8: w is float8_e4m3fn (passed as its uint8 bytes), scaled per row (s: (N,)) or, with SCALE_BLOCK, per 128 x 128 block (s: (ceil(N/128),
    ceil(K/128)) fp32, row stride stride_sn; each weight times its block's scale inside the K loop).

    NORM: x is replaced by RMSNorm(x) * g (g: (K,) norm weight, eps): 1: the sum of x**2 is computed in the
    same K loop; 2: it is the sum of the SQ_LANES floats at sq_in_ptr (the kernel that wrote x made it);
    SQ_OUT: each program adds the sum of its stored y**2 atomically to lane pid % SQ_LANES of sq_out_ptr
    (for the next kernel's NORM 2; spreading the adds over lanes keeps them from queueing on one address);
    SWIGLU: w is [gate; up] (2 * N rows) and y[n] = silu(gate[n]) * up[n] (N outputs; GELU: gelu's tanh
    approximation for silu, GeGLU);
    RESIDUAL: y[n] += r[n] (r: (N,)).
    Every product is rounded to y's dtype where the unfused model rounds it (the linear output, the
    silu, the residual sum); only the normalized input stays unrounded fp32.

    x: (K,) contiguous; w: (N or 2N, K), unit stride along K; y: (N,). K >= 1.
    EVEN_K: K % BLOCK_K == 0; NO_MASK: EVEN_K and K >= DEPTH * BLOCK_K (no block is partial);
    WORDS (int8 or fp8): K, stride_wn and w's address are multiples of 4, so w is read as int32 words.
    Grid: (cdiv(N, BLOCK_N),), or (cdiv(N, BLOCK_N // 2),) with SWIGLU.
    """
    PACK: tl.constexpr = 4 if ((W_INT8 or W_FP8) and WORDS) else 1  # weights per loaded element
    pid = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_N)
    if SWIGLU:
        # Rows [0, HALF) of the block are gate rows, [HALF, BLOCK_N) the matching up rows (N rows later).
        HALF: tl.constexpr = BLOCK_N // 2
        offs_n = pid * HALF + tl.arange(0, HALF)  # (HALF,) outputs
        rows = tl.minimum(pid * HALF + offs_b % HALF, N - 1) + (offs_b // HALF) * N  # (BLOCK_N,)
    else:
        offs_n = pid * BLOCK_N + offs_b
        # Clamp instead of masking: rows past N re-read row N-1 (in bounds); they are not stored.
        rows = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kw = tl.arange(0, BLOCK_K // PACK)
    if W_INT8 or W_FP8:
        # Show the compiler a contiguity of 8 bytes, not the whole block: each thread then loads
        # 8 weights (one 8-byte load), the register layout of the 16-bit x (8 per 16-byte load),
        # so the loop needs no layout conversion through shared memory.
        offs_kw = (offs_kw // (8 // PACK)) * (8 // PACK) + offs_kw % (8 // PACK)
    if PACK == 4:
        w_base = w_ptr.to(tl.pointer_type(tl.int32))
    else:
        w_base = w_ptr
    w_ptrs = w_base + rows.to(tl.int64)[:, None] * (stride_wn // PACK) + offs_kw[None, :]  # (BLOCK_N, BLOCK_K/PACK)
    x_ptrs = x_ptr + offs_k[None, :]  # (1, BLOCK_K)
    g_ptrs = g_ptr + offs_k[None, :]  # (1, BLOCK_K), read only with NORM
    sb_ptrs = s_ptr + (rows // 128)[:, None] * stride_sn  # (BLOCK_N, 1), read only with SCALE_BLOCK
    ROW_SCALE: tl.constexpr = W_INT8 or (W_FP8 and not SCALE_BLOCK)
    ONE_BYTE: tl.constexpr = W_INT8 or W_FP8
    KW = K // PACK
    BKW: tl.constexpr = BLOCK_K // PACK
    acc = tl.zeros((BLOCK_N, BLOCK_K // 8 if RED else BLOCK_K), dtype=tl.float32)
    ss = tl.zeros((1, BLOCK_K), dtype=tl.float32)  # NORM: per-lane sums of x**2
    nb = tl.cdiv(K, BLOCK_K)

    # Prologue: the first DEPTH weight blocks. They do not depend on the previous kernel, so with
    # PDL they stream in while it drains; x (and r) are read only after the wait.
    wa = _load(w_ptrs, 0, KW, offs_kw, not NO_MASK, True, ONE_BYTE)
    if DEPTH == 2:
        wb = _load(w_ptrs, BKW, KW, offs_kw, not NO_MASK, True, ONE_BYTE)
    if ROW_SCALE:  # constant, like the weights
        scale = tl.load(s_ptr + rows).to(tl.float32)  # (BLOCK_N,)
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    # The epilogue's inputs from the kernels before, loaded now so that their latency hides behind the K loop
    # rather than adding to each program's tail.
    if NORM == 2:
        sq_in = tl.sum(tl.load(sq_in_ptr + tl.arange(0, SQ_LANES)))
    if RESIDUAL:
        res = tl.load(r_ptr + offs_n, mask=offs_n < N, other=0).to(tl.float32)

    if DEPTH == 2:
        for kb in range(2, nb):
            wc = _load(w_ptrs, kb * BKW, KW, offs_kw, not EVEN_K, True, ONE_BYTE)
            # block kb - 2 < nb - 1 is a full block: no mask on x
            acc, ss = _step(acc, ss, wa, x_ptrs, g_ptrs, (kb - 2) * BLOCK_K, K, offs_k, False,
                            W_INT8, WORDS, INT8_MODE, RED, NORM, BLOCK_N, BLOCK_K, sb_ptrs, SCALE_BLOCK, W_FP8)
            wa = wb
            wb = wc
        ka = tl.maximum(nb - 2, 0) * BLOCK_K  # wa holds block max(nb-2, 0), wb the one after
        acc, ss = _step(acc, ss, wa, x_ptrs, g_ptrs, ka, K, offs_k, not NO_MASK,
                        W_INT8, WORDS, INT8_MODE, RED, NORM, BLOCK_N, BLOCK_K, sb_ptrs, SCALE_BLOCK, W_FP8)
        # (with one block, wb and x past K are masked to zeros, so this step adds nothing)
        acc, ss = _step(acc, ss, wb, x_ptrs, g_ptrs, ka + BLOCK_K, K, offs_k, not NO_MASK,
                        W_INT8, WORDS, INT8_MODE, RED, NORM, BLOCK_N, BLOCK_K, sb_ptrs, SCALE_BLOCK, W_FP8)
    else:
        for kb in range(1, nb):
            wc = _load(w_ptrs, kb * BKW, KW, offs_kw, not EVEN_K, True, ONE_BYTE)
            acc, ss = _step(acc, ss, wa, x_ptrs, g_ptrs, (kb - 1) * BLOCK_K, K, offs_k, False,
                            W_INT8, WORDS, INT8_MODE, RED, NORM, BLOCK_N, BLOCK_K, sb_ptrs, SCALE_BLOCK, W_FP8)
            wa = wc
        acc, ss = _step(acc, ss, wa, x_ptrs, g_ptrs, (nb - 1) * BLOCK_K, K, offs_k, not NO_MASK,
                        W_INT8, WORDS, INT8_MODE, RED, NORM, BLOCK_N, BLOCK_K, sb_ptrs, SCALE_BLOCK, W_FP8)

    out = tl.sum(acc, axis=1)  # (BLOCK_N,)
    if NORM == 1:
        out = out * tl.rsqrt(tl.sum(ss) / K + eps)
    if NORM == 2:
        out = out * tl.rsqrt(sq_in / K + eps)
    if ROW_SCALE:
        out = out * scale
    out_ty = y_ptr.dtype.element_ty
    if SWIGLU:
        gate, up = tl.split(tl.trans(tl.reshape(out, (2, HALF))))  # (HALF,) each
        out = gated(gate, up, GELU, out_ty)
    if RESIDUAL:
        out = out.to(out_ty).to(tl.float32) + res
    tl.store(y_ptr + offs_n, out.to(out_ty), mask=offs_n < N)
    if SQ_OUT:  # one fire-and-forget float add per program, spread over the kernel's lifetime
        y = tl.where(offs_n < N, out.to(out_ty).to(tl.float32), 0.0)
        tl.atomic_add(sq_out_ptr + pid % SQ_LANES, tl.sum(y * y), sem="relaxed")


@triton.jit
def _small_m_dot_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, W_INT8: tl.constexpr, IEEE: tl.constexpr,
):
    """y = x @ w.T (times s when W_INT8), fp32 accumulation, for the tile of rows program_id(0) of x and the
    tile of output columns program_id(1).

    x rows are padded to BLOCK_M with zeros (masked loads; clamping them to row M-1 instead was
    measured 10-40% slower at small M), so with one tile of rows each weight tile is read once and
    used for every row. The software pipeliner (num_stages) keeps weight tiles in flight through
    shared memory. x: (M, K), w: (N, K), unit stride along K; y: (M, N), unit stride along N.
    Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)): the row tiles that share a weight tile run next to each other, so
    with several row tiles the weight tile is read from HBM about once and from L2 after that.
    """
    pid = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)  # rows past N re-read row N-1; they are not stored
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m[:, None] < M
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # (BLOCK_N, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k0, mask=m_mask, other=0)
            w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        else:
            k_mask = (k0 + offs_k)[None, :] < K
            x = tl.load(x_ptrs + k0, mask=k_mask & m_mask, other=0)
            w = tl.load(w_ptrs + k0, mask=k_mask, other=0, eviction_policy="evict_first")
        if W_INT8:
            w = w.to(x.dtype)  # exact: |w| <= 128 fits bf16/fp16/fp32
        if IEEE:  # fp32 x: full-precision products, not tf32
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if W_INT8:
        acc = acc * tl.load(s_ptr + rows).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask & (offs_n[None, :] < N))


def int8_mode_default(caps: DeviceCaps) -> int:
    """INT8_MODE_DEFAULT where the kernels may carry inline PTX (NVIDIA), else the portable mode 1."""
    return INT8_MODE_DEFAULT if caps.inline_ptx else 1


def gemv(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None = None,
         out: torch.Tensor | None = None, config: GemvConfig | None = None,
         pdl: bool | None = None, int8_mode: int | None = None,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0,
         residual: torch.Tensor | None = None, swiglu: bool = False,
         sq_in: torch.Tensor | None = None, sq_out: torch.Tensor | None = None, gelu: bool = False,
         words: bool | None = None) -> torch.Tensor:
    """y = x @ w.T (times scales[n] for int8 or float8_e4m3fn w; a float8 w's scales may instead be 2-D, one per
    128 x 128 block) for one row of x, with the decode fusions:

    norm_weight: x is replaced by RMSNorm(x, norm_weight, eps) first, its sum of squares computed here or, when
    sq_in is given, the sum of sq_in; swiglu: w stacks the gate and up projections (2N rows) and
    y = silu(gate) * up (N outputs; with gelu, GeGLU: gelu's tanh approximation for silu); residual: y += residual
    (N,); sq_out: the sum of y**2 is added to it, spread over its elements. sq_in and sq_out are contiguous fp32
    lanes, a power of two of them, of one size.

    x: (1, K) or (K,) with unit stride along K; w: (N, K) with unit stride along K; scales: (N,)
    contiguous; norm_weight (K,) and residual (N,) contiguous. Returns (or fills `out`, contiguous)
    y of x's shape with K -> N, in x.dtype. `config`, `pdl`, `int8_mode` and `words` (False: an int8 or fp8 w read
    one byte at a time) override the defaults (benchmarks and tests use this).
    """
    k = x.shape[-1]
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    if x.numel() != k:
        raise ValueError(f"gemv takes one row of x, got shape {tuple(x.shape)}")
    if out is None:
        out = torch.empty((*x.shape[:-1], n), device=x.device, dtype=x.dtype)
    if n == 0:
        return out
    if k == 0:  # empty sums (a norm of nothing is undefined: the caller validates K > 0 for norms)
        out.zero_()
        if swiglu:
            return out  # silu(0) * 0
        return out.add_(residual.view_as(out)) if residual is not None else out
    cfg = config or gemv_config(w.shape[0], k, w.element_size(), fused_input=norm_weight is not None, swiglu=swiglu,
                                residual=residual is not None)
    w_fp8 = w.dtype == torch.float8_e4m3fn
    scale_block = w_fp8 and scales is not None and scales.dim() == 2
    if swiglu and cfg.block_n % 2:
        raise ValueError(f"a SwiGLU GEMV needs an even block_n (gate and up rows), got {cfg.block_n}")
    if pdl is None:
        pdl = pdl_default(device_caps(x.device))
    if int8_mode is None:
        int8_mode = int8_mode_default(device_caps(x.device))
    w_int8 = w.dtype == torch.int8
    words = (w_int8 or w_fp8) and k % 4 == 0 and w.stride(0) % 4 == 0 and w.data_ptr() % 4 == 0 and words is not False
    even_k = k % cfg.block_k == 0
    extra = {"launch_pdl": True} if pdl else {}
    rows_per_program = cfg.block_n // 2 if swiglu else cfg.block_n
    _gemv_kernel[(triton.cdiv(n, rows_per_program),)](
        x, w.view(torch.uint8) if w_fp8 else w, scales if w_int8 or w_fp8 else w, out,
        norm_weight if norm_weight is not None else x, residual if residual is not None else x,
        sq_in if sq_in is not None else out, sq_out if sq_out is not None else out,
        n, k, w.stride(0), eps, scales.stride(0) if scale_block else 0,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DEPTH=cfg.depth, RED=cfg.red,
        EVEN_K=even_k, NO_MASK=even_k and k >= cfg.depth * cfg.block_k,
        W_INT8=w_int8, WORDS=words, INT8_MODE=int8_mode, USE_PDL=pdl,
        NORM=0 if norm_weight is None else (2 if sq_in is not None else 1), RESIDUAL=residual is not None,
        SWIGLU=swiglu, GELU=gelu, SQ_OUT=sq_out is not None,
        SQ_LANES=(sq_in if sq_in is not None else sq_out).numel() if sq_in is not None or sq_out is not None else 1,
        W_FP8=w_fp8, SCALE_BLOCK=scale_block,
        num_warps=cfg.num_warps, num_stages=1, **extra,
    )
    return out


def small_m_dot(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None = None,
                out: torch.Tensor | None = None, config: DotConfig | None = None) -> torch.Tensor:
    """y = x @ w.T (times scales[n] for int8 w) on the tensor cores, x in tiles of rows.

    x: (M, K) with unit stride along K; w: (N, K) with unit stride along K; out: (M, N) contiguous.
    """
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if k == 0 or n == 0 or m == 0:
        return out.zero_()
    cfg = config or fitted_dot_config(n, k, w.element_size(), x.element_size(), m, device_caps(x.device))
    if cfg is None:  # kernels.linear checks first and takes cuBLAS/hipBLAS
        raise ValueError(f"no tensor-core config fits this GPU's shared memory for ({m}, {k}) x ({n}, {k}); "
                         "use F.linear")
    block_m = dot_block_m(cfg, m)
    w_int8 = w.dtype == torch.int8
    _small_m_dot_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, cfg.block_n))](
        x, w, scales if w_int8 else w, out,
        m, n, k,
        x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, W_INT8=w_int8, IEEE=x.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
