"""Triton kernels for a mixture-of-experts layer: each token through its top-k experts, reading only those experts.

Expert e holds w13[e] (2I, dim): its I gate rows, then its I up rows, and w2[e] (dim, I). For token t and its
chosen experts e_j = topk_ids[t, j] the layer computes sum_j topk_weights[t, j] * w2[e_j] @ h_tj, with
h_tj = act(w13[e_j, :I] @ x[t]) * (w13[e_j, I:] @ x[t]) and act silu, or gelu (tanh approximation). Each (token,
chosen expert) is a "pair", numbered t * k + j. Two ways, both in two kernels, fp32 accumulation:

`moe_gemv` (a few tokens: decode) reads each pair's expert rows as a matrix-vector product:

- `_gate_up_gemv_kernel`, grid (pairs, I / BLOCK_N): BLOCK_N gate rows and the matching up rows of the pair's expert
  against x[t], fp32 accumulator tiles reduced once at the end; stores h (pairs, I) in fp32;
- `_down_gemv_kernel`, grid (T, dim / BLOCK_N): one program owns a tile of token t's output and loops over its k
  experts (w2[e_j] rows against h_tj, scaled by the routing weight), so the sum over j is deterministic and the
  output is written once, in x's dtype.

`moe_grouped` (more tokens: batches, prefill) groups the pairs by expert so that a tile of rows choosing the same
expert reads that expert's weight tile once:

- `expert_blocks` sorts the pairs by expert on the device (a stable argsort, per-expert counts and offsets by
  searchsorted and cumsum: no host synchronisation) into a padded layout where each expert's rows start at a
  multiple of BLOCK_M; padding rows hold the sentinel `pairs`. Its size is fixed by the shapes: pairs plus
  BLOCK_M - 1 padding rows for each expert that can be chosen (min(E, pairs)), so it is CUDA-graph capturable;
- `_grouped_gate_up_kernel`, grid (padded blocks, I / BLOCK_N): gathers the block's x rows, tl.dot against the
  expert's gate and up tiles, stores h (pairs, I) in x's dtype (the second dot's operand);
- `_grouped_down_kernel`, grid (padded blocks, dim / BLOCK_N): h rows against w2[e], scaled by each row's routing
  weight, stored as fp32 partials (pairs, dim); torch sums each token's k partials (deterministic).
  Blocks past the last expert's rows exit at once.

int8 experts (w13 and w2 int8, one fp32 scale per expert and output row) take the same four kernels with SCALED:
the GEMVs convert each byte in registers and scale each row's sum once; the grouped kernels convert the int8 tiles
to x's dtype (exact) for the tensor cores and scale the accumulator's columns once.

int4 experts (quantize.py's int4 layout per expert row: w13 uint8 (E, 2I, dim/2) and w2 uint8 (E, dim, I/2), each
byte two consecutive inputs, the even one in the low nibble, with fp16 [scale, offset] per row and group) have GEMV
kernels of their own (`_gate_up_gemv_int4_kernel`, `_down_gemv_int4_kernel`): a step of BLOCK_K inputs lies in one
group, its nibbles are multiplied by the even and the odd inputs, then scaled and offset once for the step. Their
grouped kernels (`_grouped_gate_up_int4_kernel`, `_grouped_down_int4_kernel`, bf16 and fp16 activations) unpack a
step's tile (one group) in registers, dequantize it to x's dtype and feed the tensor cores.

The router's softmax and top-k (`moe_route`, one `_route_kernel` program per token): the row of E logits in
registers (padded to a power of two), softmax in fp32, then k rounds of argmax, each masking the expert it chose
(ties go to the lowest expert index), optionally renormalized over the k chosen; weights fp32 and ids int64 (T, k),
in descending order of probability.

Configs come from configs.py (moe_gemv_config, fitted_moe_dot_config); only kernels/moe.py imports this module,
lazily. The caller validates shapes; expert ids must lie in [0, E) (not checked: that would read the device).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .configs import MoeDotConfig, MoeGemvConfig, fitted_moe_dot_config, moe_gemv_config
from .device import device_caps
from .triton_common import GELU_TANH_SCALE

# Experts per warp of the routing kernel: 8 fp32 logits a lane on 32-lane warps, few enough to stay in registers.
ROUTE_EXPERTS_PER_WARP = 256
# The routing kernel's most warps: a row is small work, and each more warp adds shared-memory steps to the k argmax
# reductions; 4 warps hold kernels.moe's largest E (ROUTE_MAX_EXPERTS = 1024) at 8 logits a lane.
ROUTE_MAX_WARPS = 4


@triton.jit
def _activation(g, GELU: tl.constexpr):
    """silu(g), or gelu(g) with the tanh approximation (0.5 (1 + tanh u) == sigmoid(2u)); g fp32."""
    if GELU:
        z = GELU_TANH_SCALE * (g + 0.044715 * g * g * g)
    else:
        z = g
    return g / (1.0 + tl.exp(-z))


# --- few tokens: matrix-vector products per (token, expert) pair ---


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr, w13_ptr, s13_ptr, ids_ptr, h_ptr, stride_xt, stride_we, stride_wn,
    DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, GELU: tl.constexpr, SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)  # t * TOP_K + j
    t = pair // TOP_K
    e = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) rows of the gate (and the up) half
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < HIDDEN
    gate_rows = w13_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    up_rows = gate_rows + HIDDEN * stride_wn
    x_row = x_ptr + t * stride_xt + offs_k
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, DIM, BLOCK_K):
        k_ok = k0 + offs_k < DIM
        w_ok = n_ok[:, None] & k_ok[None, :]
        xk = tl.load(x_row + k0, mask=k_ok, other=0.0).to(tl.float32)[None, :]  # (1, BLOCK_K)
        acc_g += tl.load(gate_rows + k0, mask=w_ok, other=0.0).to(tl.float32) * xk
        acc_u += tl.load(up_rows + k0, mask=w_ok, other=0.0).to(tl.float32) * xk
    gate, up = tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)  # (BLOCK_N,) each
    if SCALED:  # int8 experts: each output row's scale, applied once to its sum
        gate *= tl.load(s13_ptr + e * 2 * HIDDEN + offs_n, mask=n_ok, other=0.0)
        up *= tl.load(s13_ptr + e * 2 * HIDDEN + HIDDEN + offs_n, mask=n_ok, other=0.0)
    h = _activation(gate, GELU) * up
    tl.store(h_ptr + pair * HIDDEN + offs_n, h, mask=n_ok)


@triton.jit
def _down_gemv_kernel(
    h_ptr, w2_ptr, s2_ptr, ids_ptr, weights_ptr, out_ptr, stride_we, stride_wn, stride_ot,
    DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, SCALED: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) output features
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < DIM
    out = tl.zeros([BLOCK_N], tl.float32)
    for j in range(TOP_K):  # this program owns the tile: the sum over the experts is in a fixed order
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair).to(tl.int64)
        rows = w2_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        h_row = h_ptr + pair * HIDDEN + offs_k
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            k_ok = k0 + offs_k < HIDDEN
            hk = tl.load(h_row + k0, mask=k_ok, other=0.0)[None, :]  # (1, BLOCK_K) fp32
            acc += tl.load(rows + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32) * hk
        down = tl.sum(acc, axis=1)  # (BLOCK_N,)
        if SCALED:
            down *= tl.load(s2_ptr + e * DIM + offs_n, mask=n_ok, other=0.0)
        out += tl.load(weights_ptr + pair) * down
    tl.store(out_ptr + t * stride_ot + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _int4_step(rows, scales, k0, x_even, x_odd, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, n_ok):
    """One step of BLOCK_K inputs (within one group) of int4 rows: (BLOCK_N, BLOCK_K / 2) fp32 products. rows:
    pointers to the rows' packed bytes at input 0; scales: pointers to the rows' [scale, offset] pairs; x_even,
    x_odd: (1, BLOCK_K / 2) fp32 inputs k0 + 2j and k0 + 2j + 1 (the low and the high nibble of byte j)."""
    packed = tl.load(rows + k0 // 2, mask=n_ok[:, None], other=0).to(tl.int32)  # (BLOCK_N, BLOCK_K / 2)
    low, high = (packed & 0xF).to(tl.float32), (packed >> 4).to(tl.float32)
    group = scales + 2 * (k0 // GROUP)
    scale = tl.load(group, mask=n_ok, other=0.0).to(tl.float32)[:, None]  # (BLOCK_N, 1)
    offset = tl.load(group + 1, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    return (low * x_even + high * x_odd) * scale + offset * (x_even + x_odd)


@triton.jit
def _gate_up_gemv_int4_kernel(
    x_ptr, w13_ptr, s13_ptr, ids_ptr, h_ptr, stride_xt, stride_we, stride_wn, stride_se, stride_sn,
    DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, GELU: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """_gate_up_gemv_kernel for int4 experts: w13 uint8 (E, 2I, dim / 2), s13 fp16 (E, 2I, dim / GROUP, 2); BLOCK_K
    divides GROUP (a step never straddles two groups) and GROUP divides DIM."""
    pair = tl.program_id(0).to(tl.int64)  # t * TOP_K + j
    t = pair // TOP_K
    e = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) rows of the gate (and the up) half
    offs_j = tl.arange(0, BLOCK_K // 2)  # bytes of a step
    n_ok = offs_n < HIDDEN
    gate_rows = w13_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_j[None, :]
    up_rows = gate_rows + HIDDEN * stride_wn
    gate_scales = s13_ptr + e * stride_se + offs_n.to(tl.int64) * stride_sn  # (BLOCK_N,)
    up_scales = gate_scales + HIDDEN * stride_sn
    x_row = x_ptr + t * stride_xt + 2 * offs_j
    acc_g = tl.zeros([BLOCK_N, BLOCK_K // 2], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K // 2], tl.float32)
    for k0 in range(0, DIM, BLOCK_K):
        x_even = tl.load(x_row + k0).to(tl.float32)[None, :]  # (1, BLOCK_K / 2)
        x_odd = tl.load(x_row + k0 + 1).to(tl.float32)[None, :]
        acc_g += _int4_step(gate_rows, gate_scales, k0, x_even, x_odd, GROUP, BLOCK_K, n_ok)
        acc_u += _int4_step(up_rows, up_scales, k0, x_even, x_odd, GROUP, BLOCK_K, n_ok)
    h = _activation(tl.sum(acc_g, axis=1), GELU) * tl.sum(acc_u, axis=1)
    tl.store(h_ptr + pair * HIDDEN + offs_n, h, mask=n_ok)


@triton.jit
def _down_gemv_int4_kernel(
    h_ptr, w2_ptr, s2_ptr, ids_ptr, weights_ptr, out_ptr, stride_we, stride_wn, stride_se, stride_sn, stride_ot,
    DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """_down_gemv_kernel for int4 experts: w2 uint8 (E, dim, I / 2), s2 fp16 (E, dim, I / GROUP, 2)."""
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) output features
    offs_j = tl.arange(0, BLOCK_K // 2)
    n_ok = offs_n < DIM
    out = tl.zeros([BLOCK_N], tl.float32)
    for j in range(TOP_K):  # this program owns the tile: the sum over the experts is in a fixed order
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair).to(tl.int64)
        rows = w2_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_j[None, :]
        row_scales = s2_ptr + e * stride_se + offs_n.to(tl.int64) * stride_sn
        h_row = h_ptr + pair * HIDDEN + 2 * offs_j
        acc = tl.zeros([BLOCK_N, BLOCK_K // 2], tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            h_even = tl.load(h_row + k0)[None, :]  # (1, BLOCK_K / 2) fp32
            h_odd = tl.load(h_row + k0 + 1)[None, :]
            acc += _int4_step(rows, row_scales, k0, h_even, h_odd, GROUP, BLOCK_K, n_ok)
        out += tl.load(weights_ptr + pair) * tl.sum(acc, axis=1)
    tl.store(out_ptr + t * stride_ot + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


# --- more tokens: grouped by expert, tensor-core tiles ---


@triton.jit
def _block_rows(block_expert_ptr, pairs_ptr, n_pairs, BLOCK_M: tl.constexpr):
    """This program's block of the expert-sorted layout: its expert (N_EXPERTS past the last expert's rows), its
    pair numbers (BLOCK_M,), and which of them are real rows (padding rows hold n_pairs)."""
    blk = tl.program_id(0)
    e = tl.load(block_expert_ptr + blk).to(tl.int64)
    pair = tl.load(pairs_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # (BLOCK_M,)
    return e, pair, pair < n_pairs


@triton.jit
def _grouped_gate_up_kernel(
    x_ptr, w13_ptr, s13_ptr, pairs_ptr, block_expert_ptr, h_ptr, n_pairs, stride_xt, stride_we, stride_wn,
    DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, N_EXPERTS: tl.constexpr, GELU: tl.constexpr,
    SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    e, pair, row_ok = _block_rows(block_expert_ptr, pairs_ptr, n_pairs, BLOCK_M)
    if e < N_EXPERTS:  # else a block past the last expert's rows
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_ok = offs_n < HIDDEN
        x_rows = x_ptr + (pair // TOP_K)[:, None] * stride_xt + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
        gate_rows = w13_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        up_rows = gate_rows + HIDDEN * stride_wn  # (BLOCK_N, BLOCK_K)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, DIM, BLOCK_K):
            k_ok = (k0 + offs_k < DIM)[None, :]
            xk = tl.load(x_rows + k0, mask=row_ok[:, None] & k_ok, other=0.0)
            wg = tl.load(gate_rows + k0, mask=n_ok[:, None] & k_ok, other=0).to(xk.dtype)  # int8 values are exact
            wu = tl.load(up_rows + k0, mask=n_ok[:, None] & k_ok, other=0).to(xk.dtype)
            acc_g = tl.dot(xk, tl.trans(wg), acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(xk, tl.trans(wu), acc_u, input_precision=DOT_PRECISION)
        if SCALED:  # int8 experts: each output column's scale, applied once to its sums
            acc_g *= tl.load(s13_ptr + e * 2 * HIDDEN + offs_n, mask=n_ok, other=0.0)[None, :]
            acc_u *= tl.load(s13_ptr + e * 2 * HIDDEN + HIDDEN + offs_n, mask=n_ok, other=0.0)[None, :]
        h = _activation(acc_g, GELU) * acc_u  # (BLOCK_M, BLOCK_N)
        tl.store(h_ptr + pair[:, None] * HIDDEN + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _grouped_down_kernel(
    h_ptr, w2_ptr, s2_ptr, pairs_ptr, block_expert_ptr, weights_ptr, partial_ptr, n_pairs, stride_we, stride_wn,
    DIM: tl.constexpr, HIDDEN: tl.constexpr, N_EXPERTS: tl.constexpr, SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    e, pair, row_ok = _block_rows(block_expert_ptr, pairs_ptr, n_pairs, BLOCK_M)
    if e < N_EXPERTS:  # else a block past the last expert's rows
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
        offs_k = tl.arange(0, BLOCK_K)
        n_ok = offs_n < DIM
        h_rows = h_ptr + pair[:, None] * HIDDEN + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
        w_rows = w2_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            k_ok = (k0 + offs_k < HIDDEN)[None, :]
            hk = tl.load(h_rows + k0, mask=row_ok[:, None] & k_ok, other=0.0)
            w = tl.load(w_rows + k0, mask=n_ok[:, None] & k_ok, other=0).to(hk.dtype)
            acc = tl.dot(hk, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if SCALED:
            acc *= tl.load(s2_ptr + e * DIM + offs_n, mask=n_ok, other=0.0)[None, :]
        routing = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)  # (BLOCK_M,) fp32
        tl.store(partial_ptr + pair[:, None] * DIM + offs_n[None, :], acc * routing[:, None],
                 mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _int4_tile(rows, scales, k0, n_ok, GROUP: tl.constexpr, dtype: tl.constexpr):
    """A (BLOCK_N, BLOCK_K) weight tile of int4 rows at inputs k0.. (within one group), dequantized to dtype for the
    tensor cores: rows point at the rows' packed bytes (BLOCK_N, BLOCK_K / 2), scales at their [scale, offset]
    pairs (BLOCK_N,)."""
    packed = tl.load(rows + k0 // 2, mask=n_ok[:, None], other=0).to(tl.int32)  # (BLOCK_N, BLOCK_K / 2)
    codes = tl.interleave(packed & 0xF, packed >> 4).to(tl.float32)  # (BLOCK_N, BLOCK_K): input 2j, then 2j + 1
    group = scales + 2 * (k0 // GROUP)
    scale = tl.load(group, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    offset = tl.load(group + 1, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    return (codes * scale + offset).to(dtype)


@triton.jit
def _grouped_gate_up_int4_kernel(
    x_ptr, w13_ptr, s13_ptr, pairs_ptr, block_expert_ptr, h_ptr, n_pairs, stride_xt, stride_we, stride_wn,
    stride_se, stride_sn,
    DIM: tl.constexpr, HIDDEN: tl.constexpr, TOP_K: tl.constexpr, N_EXPERTS: tl.constexpr, GELU: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """_grouped_gate_up_kernel for int4 experts (w13 uint8 (E, 2I, dim / 2), s13 fp16 (E, 2I, dim / GROUP, 2)):
    each step's weight tiles dequantized in registers; BLOCK_K divides GROUP, GROUP divides DIM."""
    e, pair, row_ok = _block_rows(block_expert_ptr, pairs_ptr, n_pairs, BLOCK_M)
    if e < N_EXPERTS:  # else a block past the last expert's rows
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        offs_j = tl.arange(0, BLOCK_K // 2)
        n_ok = offs_n < HIDDEN
        x_rows = x_ptr + (pair // TOP_K)[:, None] * stride_xt + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
        gate_rows = w13_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_j[None, :]
        up_rows = gate_rows + HIDDEN * stride_wn  # (BLOCK_N, BLOCK_K / 2)
        gate_scales = s13_ptr + e * stride_se + offs_n.to(tl.int64) * stride_sn  # (BLOCK_N,)
        up_scales = gate_scales + HIDDEN * stride_sn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, DIM, BLOCK_K):
            xk = tl.load(x_rows + k0, mask=row_ok[:, None], other=0.0)
            wg = _int4_tile(gate_rows, gate_scales, k0, n_ok, GROUP, xk.dtype)
            wu = _int4_tile(up_rows, up_scales, k0, n_ok, GROUP, xk.dtype)
            acc_g = tl.dot(xk, tl.trans(wg), acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(xk, tl.trans(wu), acc_u, input_precision=DOT_PRECISION)
        h = _activation(acc_g, GELU) * acc_u  # (BLOCK_M, BLOCK_N)
        tl.store(h_ptr + pair[:, None] * HIDDEN + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _grouped_down_int4_kernel(
    h_ptr, w2_ptr, s2_ptr, pairs_ptr, block_expert_ptr, weights_ptr, partial_ptr, n_pairs, stride_we, stride_wn,
    stride_se, stride_sn,
    DIM: tl.constexpr, HIDDEN: tl.constexpr, N_EXPERTS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """_grouped_down_kernel for int4 experts (w2 uint8 (E, dim, I / 2), s2 fp16 (E, dim, I / GROUP, 2))."""
    e, pair, row_ok = _block_rows(block_expert_ptr, pairs_ptr, n_pairs, BLOCK_M)
    if e < N_EXPERTS:  # else a block past the last expert's rows
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
        offs_k = tl.arange(0, BLOCK_K)
        offs_j = tl.arange(0, BLOCK_K // 2)
        n_ok = offs_n < DIM
        h_rows = h_ptr + pair[:, None] * HIDDEN + offs_k[None, :]  # (BLOCK_M, BLOCK_K)
        w_rows = w2_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_j[None, :]
        row_scales = s2_ptr + e * stride_se + offs_n.to(tl.int64) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            hk = tl.load(h_rows + k0, mask=row_ok[:, None], other=0.0)
            w = _int4_tile(w_rows, row_scales, k0, n_ok, GROUP, hk.dtype)
            acc = tl.dot(hk, tl.trans(w), acc, input_precision=DOT_PRECISION)
        routing = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)  # (BLOCK_M,) fp32
        tl.store(partial_ptr + pair[:, None] * DIM + offs_n[None, :], acc * routing[:, None],
                 mask=row_ok[:, None] & n_ok[None, :])


# --- routing: softmax and top-k per token ---


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, stride_lt,
    N_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Token t's k largest softmax probabilities over its E logits, largest first (ties: the lowest expert), and
    their experts; divided by their sum when RENORMALIZE. BLOCK_E >= N_EXPERTS, BLOCK_K >= TOP_K."""
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < N_EXPERTS
    logits = tl.load(logits_ptr + t * stride_lt + offs_e, mask=e_ok, other=-float("inf")).to(tl.float32)
    shifted = tl.exp(logits - tl.max(logits, axis=0))  # (BLOCK_E,) 0 in the padding
    probs = shifted / tl.sum(shifted, axis=0)
    probs = tl.where(e_ok, probs, -1.0)  # the padding loses even to an expert whose probability underflowed to 0
    offs_k = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for j in tl.static_range(TOP_K):
        best, e = tl.max(probs, axis=0, return_indices=True, return_indices_tie_break_left=True)
        weights = tl.where(offs_k == j, best, weights)
        ids = tl.where(offs_k == j, e, ids)
        probs = tl.where(offs_e == e, -2.0, probs)  # chosen: below every expert and the padding
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)  # slots past TOP_K hold 0
    k_ok = offs_k < TOP_K
    tl.store(weights_ptr + t * TOP_K + offs_k, weights, mask=k_ok)
    tl.store(ids_ptr + t * TOP_K + offs_k, ids.to(tl.int64), mask=k_ok)


# --- launchers ---


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the launchers allocate (the tests fill them with NaN to check the kernels overwrite them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _device_context(t: torch.Tensor):
    """Launch on t's GPU (Triton uses the current device); the nullcontext serves Triton's CPU interpreter."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t itself where its last dim has unit stride (the kernels index rows by their strides), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def dot_precision(dtype: torch.dtype, caps) -> str:
    """tf32 where the operands are 16-bit anyway and the GPU takes it, else full fp32 (ieee) dots."""
    return "tf32" if dtype != torch.float32 and caps.supports_tf32 else "ieee"


def _scale_args(scales: tuple | None, placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(w13_scales, w2_scales, True) for int8 experts; otherwise a placeholder pointer for both (never read) and
    False."""
    if scales is None or scales[0] is None:
        return placeholder, placeholder, False
    return scales[0].contiguous(), scales[1].contiguous(), True


def padded_rows(n_pairs: int, n_experts: int, block_m: int) -> int:
    """Rows of the expert-sorted layout: every pair, plus up to block_m - 1 padding rows for each expert that can be
    chosen (at most min(E, pairs) are), rounded up to whole blocks."""
    rows = n_pairs + min(n_experts, n_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def expert_blocks(topk_ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert, each expert's rows padded to whole blocks of block_m, computed on the device:
    (pairs (P,) int32: pair numbers t * k + j, the sentinel T * k in padding rows; block_expert (P / block_m,) int32:
    the expert of each block, n_experts for blocks past the last expert's rows). P = padded_rows(T * k, ...)."""
    flat = topk_ids.reshape(-1).long()  # (T k,) the expert of each pair
    n_pairs = flat.numel()
    device = flat.device
    order = torch.argsort(flat, stable=True)  # (T k,) pair numbers grouped by expert, in pair order within one
    sorted_ids = flat[order]  # (T k,) ascending
    experts = torch.arange(n_experts, device=device)  # (E,)
    starts = torch.searchsorted(sorted_ids, experts)  # (E,) first sorted slot of each expert
    counts = torch.searchsorted(sorted_ids, experts, right=True) - starts  # (E,)
    padded_ends = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)  # (E,) end row of each expert
    padded_starts = padded_ends - (counts + block_m - 1) // block_m * block_m
    rank = torch.arange(n_pairs, device=device) - starts[sorted_ids]  # (T k,) place among its expert's pairs
    dest = padded_starts[sorted_ids] + rank  # (T k,) row of each sorted pair in the padded layout
    rows = padded_rows(n_pairs, n_experts, block_m)
    pairs = torch.full((rows,), n_pairs, dtype=torch.int32, device=device).scatter_(0, dest, order.int())
    block_starts = torch.arange(0, rows, block_m, device=device)  # (P / block_m,)
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True, out_int32=True)
    return pairs, block_expert


def moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
             topk_weights: torch.Tensor, gelu: bool, config: MoeGemvConfig | None = None,
             down_config: MoeGemvConfig | None = None, scales: tuple | None = None) -> torch.Tensor:
    """The layer for few tokens by the GEMV kernels; x (T, dim), w13 (E, 2I, dim), w2 (E, dim, I), topk_ids and
    topk_weights (T, k). Returns (T, dim) in x's dtype. config / down_config: the first / second kernel's
    (default: configs.moe_gemv_config). Registers only: the tiles take no shared memory (one pipeline stage).
    scales: (w13_scales (E, 2I), w2_scales (E, dim)) fp32 for int8 experts, else None or (None, None)."""
    n_tokens, dim = x.shape
    top_k = topk_ids.shape[1]
    int4 = w13.dtype == torch.uint8
    hidden = w2.shape[2] * (2 if int4 else 1)
    config = config or moe_gemv_config(hidden, dim, x.element_size())
    down_config = down_config or moe_gemv_config(dim, hidden, x.element_size())
    x, w13, w2 = _unit_stride(x), _unit_stride(w13), _unit_stride(w2)
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    s13, s2, scaled = _scale_args(scales, weights)
    out = _empty((n_tokens, dim), x.dtype, x.device)  # (T, dim)
    if out.numel() == 0:
        return out
    h = _empty((n_tokens * top_k, hidden), torch.float32, x.device)  # (T k, I) act(gate) * up per pair
    if int4:
        _int4_gemv(x, w13, w2, s13, s2, ids, weights, h, out, gelu, config, down_config)
        return out
    with _device_context(x):
        _gate_up_gemv_kernel[(n_tokens * top_k, triton.cdiv(hidden, config.block_n))](
            x, w13, s13, ids, h, x.stride(0), w13.stride(0), w13.stride(1),
            DIM=dim, HIDDEN=hidden, TOP_K=top_k, GELU=gelu, SCALED=scaled, BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            num_warps=config.num_warps, num_stages=1,
        )
        _down_gemv_kernel[(n_tokens, triton.cdiv(dim, down_config.block_n))](
            h, w2, s2, ids, weights, out, w2.stride(0), w2.stride(1), out.stride(0),
            DIM=dim, HIDDEN=hidden, TOP_K=top_k, SCALED=scaled, BLOCK_N=down_config.block_n,
            BLOCK_K=down_config.block_k,
            num_warps=down_config.num_warps, num_stages=1,
        )
    return out


def _int4_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, s13: torch.Tensor, s2: torch.Tensor,
               ids: torch.Tensor, weights: torch.Tensor, h: torch.Tensor, out: torch.Tensor, gelu: bool,
               config: MoeGemvConfig, down_config: MoeGemvConfig) -> None:
    """moe_gemv's two launches for int4 experts, writing h and out; each step's inputs stay within one group."""
    n_tokens, dim = x.shape
    top_k, hidden = ids.shape[1], h.shape[1]
    group = dim // s13.shape[2]
    with _device_context(x):
        _gate_up_gemv_int4_kernel[(n_tokens * top_k, triton.cdiv(hidden, config.block_n))](
            x, w13, s13, ids, h, x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
            DIM=dim, HIDDEN=hidden, TOP_K=top_k, GELU=gelu, GROUP=group, BLOCK_N=config.block_n,
            BLOCK_K=min(config.block_k, group), num_warps=config.num_warps, num_stages=1,
        )
        _down_gemv_int4_kernel[(n_tokens, triton.cdiv(dim, down_config.block_n))](
            h, w2, s2, ids, weights, out, w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), out.stride(0),
            DIM=dim, HIDDEN=hidden, TOP_K=top_k, GROUP=group, BLOCK_N=down_config.block_n,
            BLOCK_K=min(down_config.block_k, group), num_warps=down_config.num_warps, num_stages=1,
        )


def moe_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, gelu: bool, config: MoeDotConfig | None = None,
                scales: tuple | None = None) -> torch.Tensor:
    """The layer for more tokens by the grouped kernels (shapes and scales as moe_gemv; int8 weight tiles are
    converted to x's dtype for the tensor cores). Returns (T, dim) in x's dtype."""
    n_tokens, dim = x.shape
    n_experts, top_k = w13.shape[0], topk_ids.shape[1]
    hidden = w2.shape[2] * (2 if w13.dtype == torch.uint8 else 1)
    n_pairs = n_tokens * top_k
    caps = device_caps(x.device)
    config = config or fitted_moe_dot_config(n_pairs, n_experts, x.element_size(), caps)
    if config is None:  # kernels.moe checks first and takes the reference
        raise ValueError("no grouped MoE config fits this GPU's shared memory")
    x, w13, w2 = _unit_stride(x), _unit_stride(w13), _unit_stride(w2)
    if n_pairs == 0 or dim == 0:
        return _empty((n_tokens, dim), x.dtype, x.device).zero_()
    pairs, block_expert = expert_blocks(topk_ids, n_experts, config.block_m)
    weights = topk_weights.contiguous()
    s13, s2, scaled = _scale_args(scales, weights)
    h = _empty((n_pairs, hidden), x.dtype, x.device)  # (T k, I): the second kernel's tl.dot operand
    partial = _empty((n_pairs, dim), torch.float32, x.device)  # (T k, dim) each pair's weighted output
    precision = dot_precision(x.dtype, caps)
    n_blocks = block_expert.shape[0]
    if w13.dtype == torch.uint8:
        _int4_grouped(x, w13, w2, s13, s2, pairs, block_expert, weights, h, partial, gelu, config, precision)
        return partial.view(n_tokens, top_k, dim).sum(dim=1).to(x.dtype)
    with _device_context(x):
        _grouped_gate_up_kernel[(n_blocks, triton.cdiv(hidden, config.block_n))](
            x, w13, s13, pairs, block_expert, h, n_pairs, x.stride(0), w13.stride(0), w13.stride(1),
            DIM=dim, HIDDEN=hidden, TOP_K=top_k, N_EXPERTS=n_experts, GELU=gelu, SCALED=scaled,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, DOT_PRECISION=precision,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        _grouped_down_kernel[(n_blocks, triton.cdiv(dim, config.block_n))](
            h, w2, s2, pairs, block_expert, weights, partial, n_pairs, w2.stride(0), w2.stride(1),
            DIM=dim, HIDDEN=hidden, N_EXPERTS=n_experts, SCALED=scaled, BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, DOT_PRECISION=precision, num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    return partial.view(n_tokens, top_k, dim).sum(dim=1).to(x.dtype)  # (T, dim), the k partials in a fixed order


def _int4_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, s13: torch.Tensor, s2: torch.Tensor,
                  pairs: torch.Tensor, block_expert: torch.Tensor, weights: torch.Tensor, h: torch.Tensor,
                  partial: torch.Tensor, gelu: bool, config: MoeDotConfig, precision: str) -> None:
    """moe_grouped's two launches for int4 experts, writing h and partial; a step's inputs stay within one group."""
    dim, hidden, n_pairs = x.shape[1], h.shape[1], h.shape[0]
    group = dim // s13.shape[2]
    block_k = min(config.block_k, group)
    n_blocks = block_expert.shape[0]
    with _device_context(x):
        _grouped_gate_up_int4_kernel[(n_blocks, triton.cdiv(hidden, config.block_n))](
            x, w13, s13, pairs, block_expert, h, n_pairs, x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0),
            s13.stride(1), DIM=dim, HIDDEN=hidden, TOP_K=n_pairs // x.shape[0], N_EXPERTS=w13.shape[0], GELU=gelu,
            GROUP=group, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, DOT_PRECISION=precision,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        _grouped_down_int4_kernel[(n_blocks, triton.cdiv(dim, config.block_n))](
            h, w2, s2, pairs, block_expert, weights, partial, n_pairs, w2.stride(0), w2.stride(1), s2.stride(0),
            s2.stride(1), DIM=dim, HIDDEN=hidden, N_EXPERTS=w13.shape[0], GROUP=group, BLOCK_M=config.block_m,
            BLOCK_N=config.block_n, BLOCK_K=block_k, DOT_PRECISION=precision, num_warps=config.num_warps,
            num_stages=config.num_stages,
        )


def route_num_warps(n_experts: int) -> int:
    """Warps of the routing kernel: one per ROUTE_EXPERTS_PER_WARP experts (at least one, so up to that many experts
    its k reductions stay within a warp), at most ROUTE_MAX_WARPS."""
    return max(1, min(ROUTE_MAX_WARPS, triton.next_power_of_2(n_experts) // ROUTE_EXPERTS_PER_WARP))


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice per token by _route_kernel: logits (T, E) bf16/fp16/fp32 -> weights (T, k) fp32 (the
    softmax probabilities, divided by their sum when renormalize) and ids (T, k) int64, largest first."""
    n_tokens, n_experts = logits.shape
    logits = _unit_stride(logits)
    weights = _empty((n_tokens, top_k), torch.float32, logits.device)  # (T, k)
    ids = _empty((n_tokens, top_k), torch.int64, logits.device)  # (T, k)
    if n_tokens == 0:
        return weights, ids
    with _device_context(logits):
        _route_kernel[(n_tokens,)](
            logits, weights, ids, logits.stride(0),
            N_EXPERTS=n_experts, TOP_K=top_k, RENORMALIZE=renormalize,
            BLOCK_E=triton.next_power_of_2(n_experts), BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=route_num_warps(n_experts), num_stages=1,
        )
    return weights, ids
