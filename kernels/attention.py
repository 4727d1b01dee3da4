"""The attention ops (one decode token against the static KV cache; rope and cache write for a prefill) and
KernelAttention, the model.Attention that calls them.

    torch.ops.redline.decode_attention(q, k_cache, v_cache, input_pos)
        == softmax(q k^T / sqrt(D)) v over cache positions 0..input_pos, fp32 accumulation, in q.dtype

q (B, H, 1, D) is already rotated; k_cache, v_cache (B, Hkv, S, D) are the whole static cache, and
query head h reads KV head h // (H // Hkv) (grouped-query attention, as enable_gqa=True in
F.scaled_dot_product_attention). input_pos (1,) is a device tensor: it is never read on the host.
Cache positions past input_pos are never read, so whatever they hold cannot change the result.

On a CUDA/HIP device (decode_attention_supported) the op runs the flash-decoding kernels in
triton_attention.py, which read only the valid keys, each K/V byte once per KV group, with the key
range split over enough programs to fill the GPU. Elsewhere: the plain-PyTorch reference.

The op is opaque to torch.compile (custom_op + register_fake), so `fullgraph=True` traces through
it and `mode="reduce-overhead"` captures its kernels in the model's CUDA graph, where one capture
serves every position. Triton is imported lazily, on the first CUDA call.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from redline.model import Attention, PagedContext, rms_norm, split_rotated_qkv

from .configs import AttentionConfig, fitted_attention_config
from .device import device_caps, triton_importable
from .linear import FLOAT_DTYPES

_POS_DTYPES = (torch.int32, torch.int64)
MIN_HEAD_DIM = 16  # the tensor-core path needs 16-wide tiles
# The largest head_dim the kernels take, and the largest the GPU tests cover (Llama-family heads are 64-128 wide).
MAX_HEAD_DIM = 256


@functools.cache
def triton_attention():
    """kernels.triton_attention, imported on first use (it imports triton)."""
    from . import triton_attention as module

    return module


def decode_attention_supported(q: Tensor, k_cache: Tensor) -> bool:
    """True when the op runs the Triton kernels: CUDA/HIP tensors of one float dtype, one query token,
    a power-of-two head_dim in [16, 256], and Triton importable."""
    if q.dim() != 4 or k_cache.dim() != 4 or q.shape[2] != 1 or q.shape[-1] != k_cache.shape[-1]:
        return False
    return q.is_cuda and q.dtype == k_cache.dtype and _kernel_supported(k_cache) and \
        attention_kernel_config(q.shape[0], q.shape[1], k_cache) is not None


def attention_kernel_config(batch: int, n_heads: int, k_cache: Tensor) -> AttentionConfig | None:
    """The split kernel's config on the cache's GPU, or None where none fits its shared memory (the ops then
    run the reference)."""
    _, n_kv_heads, seq_len, head_dim = k_cache.shape
    return fitted_attention_config(batch, n_heads, n_kv_heads, seq_len, head_dim, k_cache.element_size(),
                                   device_caps(k_cache.device))


def _kernel_supported(k_cache: Tensor) -> bool:
    """The Triton kernels run for this cache: on a CUDA/HIP device, a float dtype, a power-of-two head_dim in
    [16, 256], Triton importable."""
    head_dim = k_cache.shape[-1]
    if not k_cache.is_cuda or k_cache.dtype not in FLOAT_DTYPES or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        return False
    return head_dim & (head_dim - 1) == 0 and triton_importable()


# --- reference (plain PyTorch, fp32) ---


def decode_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor,
                               window: int = 0) -> Tensor:
    """The op computed in fp32 with PyTorch ops, returned in q.dtype; (B, H, 1, D)."""
    batch, n_heads, _, head_dim = q.shape
    n_kv_heads, seq_len = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv_heads
    positions = torch.arange(seq_len, device=q.device)  # (S,)
    valid = positions <= input_pos  # (S,)
    if window:
        valid = valid & (positions > input_pos - window)
    # Zero the invalid positions rather than only masking the scores: 0 * NaN garbage would leak.
    keep = valid.view(1, 1, seq_len, 1)
    k = torch.where(keep, k_cache.float(), 0.0)  # (B, Hkv, S, D)
    v = torch.where(keep, v_cache.float(), 0.0)  # (B, Hkv, S, D)
    qg = q.float().reshape(batch, n_kv_heads, group, head_dim)  # (B, Hkv, G, D): head h -> KV head h // G
    scores = (qg @ k.transpose(-1, -2)) / math.sqrt(head_dim)  # (B, Hkv, G, S)
    scores = scores.masked_fill(~valid, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # (B, Hkv, G, D)
    return out.reshape(batch, n_heads, 1, head_dim).to(q.dtype)


# --- validation ---


def _check_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor, window: int = 0) -> None:
    name = "redline.decode_attention"
    if window < 0:
        raise ValueError(f"{name}: window must be 0 (none) or a positive number of keys, got {window}")
    if q.dim() != 4 or k_cache.dim() != 4:
        raise ValueError(f"{name}: q must be (B, H, 1, D) and k_cache (B, Hkv, S, D), "
                         f"got {tuple(q.shape)} and {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{name}: v_cache {tuple(v_cache.shape)} must have k_cache's shape {tuple(k_cache.shape)}")
    if q.shape[2] != 1:
        raise ValueError(f"{name}: q must hold one token per sequence (B, H, 1, D), got {tuple(q.shape)}; "
                         "use F.scaled_dot_product_attention for prefill")
    batch, n_heads, _, head_dim = q.shape
    if k_cache.shape[0] != batch or k_cache.shape[3] != head_dim:
        raise ValueError(f"{name}: k_cache {tuple(k_cache.shape)} must match q {tuple(q.shape)} in batch and head_dim")
    if k_cache.shape[1] == 0 or n_heads % k_cache.shape[1] != 0:
        raise ValueError(f"{name}: q's {n_heads} heads must be a multiple of the cache's {k_cache.shape[1]} KV heads")
    if k_cache.shape[2] == 0:
        raise ValueError(f"{name}: the KV cache has no positions; call setup_caches with max_seq_length > 0")
    if q.dtype not in FLOAT_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"{name}: q, k_cache and v_cache must share one dtype of bf16, fp16 or fp32, "
                         f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    _check_position_and_devices(name, input_pos, q, k_cache, v_cache)


def _check_position_and_devices(name: str, input_pos: Tensor, *tensors: Tensor) -> None:
    if input_pos.shape != (1,) or input_pos.dtype not in _POS_DTYPES:
        raise ValueError(f"{name}: input_pos must be a (1,) int32/int64 tensor, "
                         f"got shape {tuple(input_pos.shape)} of {input_pos.dtype}")
    _check_one_device(name, *tensors, input_pos)


def _check_one_device(name: str, *tensors: Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: all inputs must be on one device, got {sorted(map(str, devices))}")


def _qkv_heads(qkv: Tensor, k_cache: Tensor) -> tuple[int, int, int]:
    """(H, Hkv, D) of a fused qkv projection (..., (H + 2 Hkv) D) against its cache (B, Hkv, S, D)."""
    n_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    return qkv.shape[-1] // head_dim - 2 * n_kv_heads, n_kv_heads, head_dim


# --- the custom op ---


@torch.library.custom_op("redline::decode_attention", mutates_args=())
def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor, window: int = 0) -> Tensor:
    """softmax(q k^T / sqrt(D)) v over keys 0..input_pos (window > 0: the last `window` of them, a sliding-window
    layer's); q (B, H, 1, D), caches (B, Hkv, S, D)."""
    _check_decode_attention(q, k_cache, v_cache, input_pos, window)
    if decode_attention_supported(q, k_cache):
        return triton_attention().decode_attention(q, k_cache, v_cache, input_pos, window=window)
    return decode_attention_reference(q, k_cache, v_cache, input_pos, window).contiguous()


@decode_attention.register_fake
def _decode_attention_fake(q: Tensor, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor, window: int = 0) -> Tensor:
    _check_decode_attention(q, k_cache, v_cache, input_pos, window)
    return q.new_empty(q.shape)  # (B, H, 1, D), contiguous like the real output


def decode_attention_qkv_reference(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, rope: Tensor, input_pos: Tensor,
                                   q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                                   norm_eps: float = 0.0, window: int = 0, scale: float = 0.0) -> Tensor:
    """The unfused model's steps: split qkv, per-head RMS norms of q and k when given (model.rms_norm with the
    weights q_norm and k_norm (D,)), rope q and k (model.split_rotated_qkv), write k and v into the caches at
    input_pos, then decode attention (window > 0: over the last `window` keys; scale: the scores' factor, 0 for
    D ** -0.5, applied to q in fp32); returns (B, 1, H D)."""
    batch = qkv.shape[0]
    n_heads, n_kv_heads, head_dim = _qkv_heads(qkv, k_cache)
    normed = None if q_norm is None else (lambda q, k: (rms_norm(q, q_norm, norm_eps), rms_norm(k, k_norm, norm_eps)))
    q, k, v = split_rotated_qkv(qkv, rope[input_pos], n_heads, n_kv_heads, head_dim, normed)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # q (B, H, 1, D); k, v (B, Hkv, 1, D)
    k_cache.index_copy_(2, input_pos, k)
    v_cache.index_copy_(2, input_pos, v)
    if scale and scale != head_dim ** -0.5:  # the op scales by D ** -0.5: q carries the rest
        q = (q.float() * (scale * math.sqrt(head_dim))).to(q.dtype)
    out = torch.ops.redline.decode_attention(q, k_cache, v_cache, input_pos, window)  # (B, H, 1, D)
    return out.transpose(1, 2).reshape(batch, 1, n_heads * head_dim)


def check_head_norms(name: str, qkv: Tensor, q_norm: Tensor | None, k_norm: Tensor | None, norm_eps: float,
                     head_dim: int) -> None:
    """One-line errors for per-head q/k norm weights that an op taking qkv cannot use: both or neither, (D,) in
    qkv's dtype and device, a positive eps."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError(f"{name}: per-head norms need both q_norm and k_norm; pass both or neither")
    if q_norm is None:
        return
    for label, weight in (("q_norm", q_norm), ("k_norm", k_norm)):
        if weight.shape != (head_dim,) or weight.dtype != qkv.dtype or weight.device != qkv.device:
            raise ValueError(f"{name}: {label} must be ({head_dim},) of {qkv.dtype} on {qkv.device} (one weight a "
                             f"head feature), got {tuple(weight.shape)} of {weight.dtype} on {weight.device}")
    if not norm_eps > 0:
        raise ValueError(f"{name}: norm_eps must be positive with per-head norms, got {norm_eps}")


def _check_decode_attention_qkv(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, rope: Tensor, input_pos: Tensor,
                                q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                                norm_eps: float = 0.0, window: int = 0, scale: float = 0.0) -> None:
    name = "redline.decode_attention_qkv"
    if window < 0:
        raise ValueError(f"{name}: window must be 0 (none) or a positive number of keys, got {window}")
    if not (scale >= 0 and math.isfinite(scale)):
        raise ValueError(f"{name}: scale must be a finite factor > 0, or 0 for head_dim ** -0.5, got {scale}")
    check_head_norms(name, qkv, q_norm, k_norm, norm_eps, k_cache.shape[-1])
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{name}: k_cache and v_cache must be (B, Hkv, S, D) of one shape, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    batch, n_kv_heads, _, head_dim = k_cache.shape
    width = qkv.shape[-1]
    if qkv.dim() != 3 or qkv.shape[:2] != (batch, 1) or width % head_dim or width // head_dim <= 2 * n_kv_heads:
        raise ValueError(f"{name}: qkv must be (B, 1, (H + 2 Hkv) D) with H a multiple of Hkv={n_kv_heads} and "
                         f"D={head_dim}, got {tuple(qkv.shape)}")
    seq_len = k_cache.shape[2]
    if (head_dim % 2 or rope.dim() != 3 or rope.shape[1] != 2 or not 1 <= rope.shape[2] <= head_dim // 2
            or rope.shape[0] < seq_len or rope.dtype != torch.float32):
        raise ValueError(f"{name}: rope must be the fp32 cos/sin table (S, 2, R/2) of R <= {head_dim} rotated features "
                         f"with S >= the cache length {seq_len} (the kernel reads row input_pos), got "
                         f"{tuple(rope.shape)} of {rope.dtype}")
    if (width // head_dim - 2 * n_kv_heads) % n_kv_heads or qkv.dtype != k_cache.dtype:
        raise ValueError(f"{name}: qkv ({qkv.dtype}) must match the cache dtype ({k_cache.dtype}) and hold a "
                         f"multiple of {n_kv_heads} query heads")
    if qkv.dtype not in FLOAT_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{name}: qkv and the caches must share one dtype of bf16, fp16 or fp32")
    if k_cache.shape[2] == 0:
        raise ValueError(f"{name}: the KV cache has no positions; call setup_caches with max_seq_length > 0")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{name}: the caches must have unit stride along head_dim (they are written in place)")
    _check_position_and_devices(name, input_pos, qkv, k_cache, v_cache, rope)


@torch.library.custom_op("redline::decode_attention_qkv", mutates_args=("k_cache", "v_cache"))
def decode_attention_qkv(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, rope: Tensor, input_pos: Tensor,
                         q_norm: Tensor | None = None, k_norm: Tensor | None = None, norm_eps: float = 0.0,
                         window: int = 0, scale: float = 0.0) -> Tensor:
    """One decode token's attention from its raw qkv projection: rotates q and k with rope (the model's cos/sin
    table; row input_pos is read on the device, so no gather kernel runs before this op), writes k and v into the
    caches at input_pos, attends over keys 0..input_pos (window > 0: the last `window` of them, a sliding-window
    layer); (B, 1, H D). q_norm and k_norm (D,): per-head RMS norms (eps norm_eps) of q and k before rope, Qwen3's,
    in the same kernel. scale: the scores' factor (Gemma's query_pre_attn_scalar ** -0.5), 0 for D ** -0.5.
    On the GPU it is one kernel (two with a long cache: the split partials are combined)."""
    _check_decode_attention_qkv(qkv, k_cache, v_cache, rope, input_pos, q_norm, k_norm, norm_eps, window, scale)
    # (qkv's device and dtype match the cache's: checked above)
    n_heads = _qkv_heads(qkv, k_cache)[0]
    if _kernel_supported(k_cache) and attention_kernel_config(qkv.shape[0], n_heads, k_cache) is not None:
        norms = None if q_norm is None else (q_norm.contiguous(), k_norm.contiguous(), norm_eps)
        return triton_attention().decode_attention_qkv(qkv, k_cache, v_cache, rope, input_pos, qk_norms=norms,
                                                       window=window, scale=scale)
    return decode_attention_qkv_reference(qkv, k_cache, v_cache, rope, input_pos, q_norm, k_norm, norm_eps,
                                          window, scale).contiguous()


@decode_attention_qkv.register_fake
def _decode_attention_qkv_fake(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, rope: Tensor, input_pos: Tensor,
                               q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                               norm_eps: float = 0.0, window: int = 0, scale: float = 0.0) -> Tensor:
    _check_decode_attention_qkv(qkv, k_cache, v_cache, rope, input_pos, q_norm, k_norm, norm_eps, window, scale)
    batch, n_kv_heads, _, head_dim = k_cache.shape
    return qkv.new_empty((batch, 1, qkv.shape[-1] - 2 * n_kv_heads * head_dim))


# --- prefill from position 0: rope and cache write in one pass ---


def prefill_rope_cache_reference(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, rope: Tensor) -> Tensor:
    """The unfused model's steps: split qkv, rope q and k (model.split_rotated_qkv), write k and v into the caches at
    positions 0..T-1; returns the rotated queries (B, T, H, D)."""
    batch, length, _ = qkv.shape
    q, k, v = split_rotated_qkv(qkv, rope, *_qkv_heads(qkv, k_cache))  # (B, T, H or Hkv, D)
    k_cache[:batch, :, :length] = k.transpose(1, 2)
    v_cache[:batch, :, :length] = v.transpose(1, 2)
    return q


def _check_prefill_rope_cache(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, rope: Tensor) -> None:
    name = "redline.prefill_rope_cache"
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{name}: k_cache and v_cache must be (B, Hkv, S, D) of one shape, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    cache_batch, n_kv_heads, seq_len, head_dim = k_cache.shape
    if qkv.dim() != 3 or qkv.shape[-1] % head_dim or (qkv.shape[-1] // head_dim - 2 * n_kv_heads) <= 0 \
            or (qkv.shape[-1] // head_dim - 2 * n_kv_heads) % n_kv_heads:
        raise ValueError(f"{name}: qkv must be (B, T, (H + 2 Hkv) D) with H a multiple of Hkv={n_kv_heads} and "
                         f"D={head_dim}, got {tuple(qkv.shape)}")
    batch, length, _ = qkv.shape
    if batch > cache_batch or length > seq_len:
        raise ValueError(f"{name}: {batch} sequences of {length} tokens do not fit the cache {tuple(k_cache.shape)}; "
                         "call setup_caches with a larger max_batch_size or max_seq_length")
    if (head_dim % 2 or rope.dim() != 3 or rope.shape[:2] != (length, 2) or not 1 <= rope.shape[2] <= head_dim // 2
            or rope.dtype != torch.float32):
        raise ValueError(f"{name}: rope must be the ({length}, 2, R/2) fp32 cos/sin rows (R <= {head_dim}) of "
                         f"positions 0..{length - 1}, got {tuple(rope.shape)} of {rope.dtype}")
    if qkv.dtype not in FLOAT_DTYPES or k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise ValueError(f"{name}: qkv and the caches must share one dtype of bf16, fp16 or fp32, "
                         f"got {qkv.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if qkv.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{name}: qkv and the caches must have unit stride along the last dim")
    _check_one_device(name, qkv, k_cache, v_cache, rope)


@torch.library.custom_op("redline::prefill_rope_cache", mutates_args=("k_cache", "v_cache"))
def prefill_rope_cache(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, rope: Tensor) -> Tensor:
    """A prefill from position 0: qkv (B, T, (H + 2 Hkv) D) raw projections of positions 0..T-1, rope (T, 2, D/2)
    fp32. Rotates q and k (rope), writes k and v into the caches at positions 0..T-1, returns the rotated queries
    (B, T, H, D) contiguous. On the GPU it is one Triton kernel that reads qkv once."""
    _check_prefill_rope_cache(qkv, k_cache, v_cache, rope)
    if _kernel_supported(k_cache):
        return triton_attention().prefill_rope_cache(qkv, k_cache, v_cache, rope.contiguous())
    return prefill_rope_cache_reference(qkv, k_cache, v_cache, rope).contiguous()


@prefill_rope_cache.register_fake
def _prefill_rope_cache_fake(qkv: Tensor, k_cache: Tensor, v_cache: Tensor, rope: Tensor) -> Tensor:
    _check_prefill_rope_cache(qkv, k_cache, v_cache, rope)
    n_heads, _, head_dim = _qkv_heads(qkv, k_cache)
    return qkv.new_empty((*qkv.shape[:2], n_heads, head_dim))


# --- the module use_kernels swaps in ---


def head_norms(attn: Attention) -> tuple[Tensor, Tensor, float] | None:
    """The q and k norms' weights and eps where they are plain RMS norms over each head's features (Qwen3), which
    the attention kernels apply themselves; else None."""
    a = attn.args
    if attn.q_norm is None or a.qk_norm != "head" or a.norm_offset != 0.0 or a.norm_scale_fp32:
        return None
    return attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps


def paged_attention(attn: Attention, qkv: Tensor, rope: Tensor, context: PagedContext) -> Tensor:
    """The projections qkv (1, N, (H + 2 Hkv) D) of N decoding rows (a decode context: one token a sequence) -> their
    attention output (1, N, H D): q/k norms, rope (rope: the rows' (N, 2, Dr/2)), k and v written to each row's page
    slot, the paged decode attention. With the pool's kernel ops on, and q/k norms absent or plain per-head ones, all
    of it is one op (redline::paged_decode_attention_qkv); else the model's steps."""
    a = attn.args
    rows = qkv.shape[1]
    norms = head_norms(attn)
    # (a pool with the CPU's decode op alone, no prefill op, takes the model's steps, which end in that op)
    kernel_ops = context.kv.ops is not None and context.kv.ops[0] is not None
    if kernel_ops and not a.attn_softcap and (attn.q_norm is None or norms is not None):
        layer = context.layer
        out = torch.ops.redline.paged_decode_attention_qkv(
            qkv.reshape(rows, -1), context.kv.k[layer], context.kv.v[layer], rope, context.block_tables,
            context.seq_lens, a.attention_scale, attn.window, *(norms or (None, None, 0.0)),
            *context.kv.scales(layer))  # (N, H, D)
        return out.reshape(1, rows, a.q_size)
    q, k, v = split_rotated_qkv(qkv, rope, a.n_head, a.n_kv_heads, a.head_dim,
                                None if attn.q_norm is None else attn.normed_qk)  # (1, N, heads, D) each
    out = context.attend(q[0], k[0], v[0], a.attention_scale, attn.window, a.attn_softcap)  # (N, H, D)
    return out.reshape(1, rows, a.q_size)


def cpu_attention_fits(attention: Attention) -> bool:
    """Whether redline_cpu::decode_attention computes this layer's decode steps: plain softmax attention at the
    default scale (no logit soft-cap)."""
    a = attention.args
    return not a.attn_softcap and a.attention_scale in (0.0, a.head_dim ** -0.5)


class CpuAttention(Attention):
    """model.Attention on the CPU whose one-token steps on its own fp32 cache (generate's decode) run
    redline_cpu::decode_attention, which reads keys 0..position only (model.Attention's SDPA reads the whole cache
    under a mask: at a short context most of a step's attention time); every other call is model.Attention's."""

    def attend_cache(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
        if q.shape[2] != 1 or k.dtype != torch.float32:
            return super().attend_cache(q, k, v, mask, input_pos)
        # (the op is loaded: use_cpu_kernels built it before swapping this class in)
        return torch.ops.redline_cpu.decode_attention(q, k, v, input_pos, self.window)  # (B, H, 1, D)


class KernelAttention(Attention):
    """model.Attention whose one-token steps run redline::decode_attention (it reads only the valid cache
    positions: up to the token, and in a sliding-window layer only the last `window` of them), whose prefills
    from position 0 run redline::prefill_rope_cache (rope and cache write in one pass), and whose paged decode steps
    (the batching engine's) run paged_attention; every other call is the plain math."""

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor, input_pos: Tensor, from_start: bool = False,
                context: Any = None) -> Tensor:
        bsz, seqlen, _ = x.shape
        if context is not None and context.decode:  # the engine's decode rows: one op a layer with its kernels
            y = self.wo(paged_attention(self, self.qkv(x), rope, context))  # (1, N, dim)
            return y if self.wo_bias is None else y + self.wo_bias
        if context is not None or (not from_start and seqlen != 1):  # paged prefill is model.py's
            return super().forward(x, rope, mask, input_pos, from_start, context)
        a = self.args
        qkv = self.normed_qkv(self.qkv(x))  # (B, T, (H + 2 Hkv) D), with its bias and q/k norms
        cache = self.cache()
        if from_start:
            q = torch.ops.redline.prefill_rope_cache(qkv, cache.k, cache.v, rope).transpose(1, 2)  # (B, H, T, D)
            k, v = cache.k[:bsz, :, :seqlen], cache.v[:bsz, :, :seqlen]  # (B, Hkv, T, D)
            window_mask = mask[..., :seqlen] if self.window else None  # (1, 1, T, T): causal within the window
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask, is_causal=window_mask is None,
                                                 enable_gqa=a.n_kv_heads != a.n_head)  # (B, H, T, D)
        else:
            q, k, v = split_rotated_qkv(qkv, rope, a.n_head, a.n_kv_heads, a.head_dim)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # q (B, H, 1, D); k, v (B, Hkv, 1, D)
            k, v = cache.update(input_pos, k, v)  # (B, Hkv, S, D)
            out = torch.ops.redline.decode_attention(q, k, v, input_pos, self.window)  # (B, H, 1, D)
        return self.output(out)  # (B, T, dim), through wo and its bias
