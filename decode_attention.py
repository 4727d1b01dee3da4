"""Decode attention (one query token per sequence against the static KV cache) as a custom op.

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

import math
from functools import lru_cache

import torch
from torch import Tensor

from kernels import triton_importable

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_POS_DTYPES = (torch.int32, torch.int64)
MIN_HEAD_DIM = 16  # the tensor-core path needs 16-wide tiles
MAX_HEAD_DIM = 256


@lru_cache(maxsize=None)
def _attention_module():
    """triton_attention, imported on first use (it imports triton)."""
    import triton_attention

    return triton_attention


def decode_attention_supported(q: Tensor, k_cache: Tensor) -> bool:
    """True when the op runs the Triton kernels: CUDA/HIP tensors of one float dtype, one query token,
    a power-of-two head_dim in [16, 256], and Triton importable."""
    if not (q.is_cuda and k_cache.is_cuda) or q.dim() != 4 or k_cache.dim() != 4:
        return False
    if q.dtype not in _FLOAT_DTYPES or k_cache.dtype != q.dtype or q.shape[2] != 1:
        return False
    head_dim = q.shape[-1]
    if head_dim != k_cache.shape[-1] or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        return False
    return head_dim & (head_dim - 1) == 0 and triton_importable()


# --- reference (plain PyTorch, fp32) ---


def decode_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor) -> Tensor:
    """The op computed in fp32 with PyTorch ops, returned in q.dtype; (B, H, 1, D)."""
    batch, n_heads, _, head_dim = q.shape
    n_kv_heads, seq_len = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv_heads
    valid = torch.arange(seq_len, device=q.device) <= input_pos  # (S,)
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


def _check_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor) -> None:
    name = "redline.decode_attention"
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
    if q.dtype not in _FLOAT_DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"{name}: q, k_cache and v_cache must share one dtype of bf16, fp16 or fp32, "
                         f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if input_pos.shape != (1,) or input_pos.dtype not in _POS_DTYPES:
        raise ValueError(f"{name}: input_pos must be a (1,) int32/int64 tensor, "
                         f"got shape {tuple(input_pos.shape)} of {input_pos.dtype}")
    devices = {q.device, k_cache.device, v_cache.device, input_pos.device}
    if len(devices) != 1:
        raise ValueError(f"{name}: all inputs must be on one device, got {sorted(map(str, devices))}")


# --- the custom op ---


@torch.library.custom_op("redline::decode_attention", mutates_args=())
def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(D)) v over keys 0..input_pos; q (B, H, 1, D), caches (B, Hkv, S, D)."""
    _check_decode_attention(q, k_cache, v_cache, input_pos)
    if decode_attention_supported(q, k_cache):
        return _attention_module().decode_attention(q, k_cache, v_cache, input_pos)
    return decode_attention_reference(q, k_cache, v_cache, input_pos).contiguous()


@decode_attention.register_fake
def _decode_attention_fake(q: Tensor, k_cache: Tensor, v_cache: Tensor, input_pos: Tensor) -> Tensor:
    _check_decode_attention(q, k_cache, v_cache, input_pos)
    return q.new_empty(q.shape)  # (B, H, 1, D), contiguous like the real output


def route_decode_attention_to_kernel(model: torch.nn.Module) -> int:
    """Make one-token attention steps of every model.Attention call this op; returns how many layers."""
    count = 0
    for module in model.modules():
        if hasattr(module, "decode_kernel") and hasattr(module, "kv_cache"):
            module.decode_kernel = True
            count += 1
    return count
