"""The attention calls scripts/check_targets.py records on each target, on meta tensors through the launchers the
ops call: decode attention over the static cache and the prefill rope kernel (attention_calls); the paged kernels
(the decode kernel also in its fused qkv form) for every page size, decode batch, block-table capacity and prefill
layout (paged_attention_calls).

Kept apart from check_targets.py (which imports it and hands in its shapes) so that module stays within one readable
file; nothing here compiles. `record` is check_targets' launch recorder: its `call` names the call being made.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

from redline.kernels import paged_attention
from redline.model import FP8_KV_DTYPE

PAGE_SIZES = (8, 16, 32, 64, 128)  # the page sizes the kernels take (paged_attention.MIN_PAGE_SIZE..MAX_PAGE_SIZE)
# Prefill layouts: (sequences, flattened query tokens); the kernels' constexprs do not depend on them, but their
# integer arguments' specialization does (1, divisible by 16 or not).
PREFILL_LAYOUTS = ((1, 1), (1, 512), (3, 100), (64, 2048), (256, 4096))
SMALL_POOL_PAGES = 64


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=dtype)


def attention_calls(record, models: Iterable, dtypes: Iterable[torch.dtype], decode_batches: Iterable[int],
                    cache_lengths: Iterable[int], max_prompt: int) -> list[str]:
    """Decode attention (rotated q, and the fused qkv form) and the prefill rope kernel on every model shape; returns
    the calls that take the reference because no configuration fits."""
    from redline.kernels import attention, triton_attention

    fallbacks = []
    cache_lengths = tuple(cache_lengths)
    for model, dtype in itertools.product(models, dtypes):
        h, hkv, d = model.n_heads, model.n_kv_heads, model.head_dim
        rope = _meta(max(cache_lengths), 2, d // 2, dtype=torch.float32)
        for batch, seq_len in itertools.product(decode_batches, cache_lengths):
            record.call = f"{model.name} attention {str(dtype)[6:]} batch={batch} cache={seq_len}"
            cache = _meta(batch, hkv, seq_len, d, dtype=dtype)
            if attention.attention_kernel_config(batch, h, cache) is None:
                fallbacks.append(record.call)
                continue
            pos = _meta(1, dtype=torch.int64)
            triton_attention.decode_attention(_meta(batch, h, 1, d, dtype=dtype), cache, cache, pos)
            triton_attention.decode_attention_qkv(_meta(batch, 1, (h + 2 * hkv) * d, dtype=dtype), cache, cache,
                                                  rope, pos)
        for length in sorted({2 ** i for i in range(12)} | {2 ** i + 1 for i in range(11)} | {max_prompt}):
            record.call = f"{model.name} prefill rope {str(dtype)[6:]} tokens={length}"
            cache = _meta(1, hkv, max_prompt, d, dtype=dtype)
            triton_attention.prefill_rope_cache(_meta(1, length, (h + 2 * hkv) * d, dtype=dtype), cache, cache,
                                                rope[:length])
        # Partial rotary (Phi-3's 3/4 of each head) adds one variant of the fused decode and the prefill rope
        # kernels, whose configs do not depend on it: one cache length and one prompt length compile it.
        partial = _meta(max(cache_lengths), 2, 3 * d // 8, dtype=torch.float32)
        record.call = f"{model.name} attention partial rotary {str(dtype)[6:]}"
        cache = _meta(1, hkv, max(cache_lengths), d, dtype=dtype)
        if attention.attention_kernel_config(1, h, cache) is not None:
            triton_attention.decode_attention_qkv(_meta(1, 1, (h + 2 * hkv) * d, dtype=dtype), cache, cache, partial,
                                                  _meta(1, dtype=torch.int64))
            # Qwen3's per-head q/k norms in the fused decode's kernel are one more variant of it.
            record.call = f"{model.name} attention q/k norms {str(dtype)[6:]}"
            norm = _meta(d, dtype=dtype)
            triton_attention.decode_attention_qkv(_meta(1, 1, (h + 2 * hkv) * d, dtype=dtype), cache, cache, rope,
                                                  _meta(1, dtype=torch.int64), qk_norms=(norm, norm, 1e-6))
            # A sliding-window layer's decode (Gemma 3, Phi-3-mini) is one more variant of both kernels (of the fused
            # decode's with Gemma's attention scale).
            record.call = f"{model.name} attention window fused {str(dtype)[6:]}"
            triton_attention.decode_attention_qkv(_meta(1, 1, (h + 2 * hkv) * d, dtype=dtype), cache, cache, rope,
                                                  _meta(1, dtype=torch.int64), window=1024, scale=0.1)
            record.call = f"{model.name} attention window {str(dtype)[6:]}"
            triton_attention.decode_attention(_meta(1, h, 1, d, dtype=dtype), cache, cache, _meta(1, dtype=torch.int64),
                                              window=1024)
        cache = _meta(1, hkv, max_prompt, d, dtype=dtype)
        triton_attention.prefill_rope_cache(_meta(1, max_prompt, (h + 2 * hkv) * d, dtype=dtype), cache, cache,
                                            partial[:max_prompt])
    return fallbacks


def _pools(page_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A page pool past 32-bit offsets (an engine's, sized from GPU memory: AMD compiles such tensors apart) and a
    small one (a test's)."""
    page_bytes = page_size * n_kv_heads * head_dim * dtype.itemsize
    return tuple(_meta(pages, page_size, n_kv_heads, head_dim, dtype=dtype)
                 for pages in (2**31 // page_bytes + 1, SMALL_POOL_PAGES))


def paged_attention_calls(record, models: Iterable, dtypes: Iterable[torch.dtype], decode_batches: Iterable[int],
                          cache_lengths: Iterable[int], fp8_cache: bool = False) -> list[str]:
    """Run the paged launchers (decode from q and from the raw qkv, prefill) on meta tensors for every model shape
    (objects with name, n_heads, n_kv_heads and head_dim), dtype, page size, decode batch and key capacity (block
    table width x page size), and prefill layout, on a large pool (a small one for batch 1 and the prefills), setting
    record.call before each; returns the calls that take the reference (no kernel or no config fits). fp8_cache: the
    pools hold e4m3 codes with their per-head scales (the kernels' KV_FP8 variants; targets with FP8 only)."""
    from redline.kernels import triton_paged_attention as tpa

    fallbacks = []
    cache_lengths = tuple(cache_lengths)
    for model, dtype, page_size in itertools.product(models, dtypes, PAGE_SIZES):
        h, hkv, d = model.n_heads, model.n_kv_heads, model.head_dim
        label = f"{model.name} paged {str(dtype)[6:]}{' fp8-cache' if fp8_cache else ''} page={page_size}"
        large, small = _pools(page_size, hkv, d, FP8_KV_DTYPE if fp8_cache else dtype)
        scale = _meta(hkv, dtype=torch.float32)  # (Hkv,) one per KV head
        scales = {"k_scale": scale, "v_scale": scale} if fp8_cache else {}
        for batch, keys, pool in itertools.product(decode_batches, cache_lengths, (large, small)):
            if pool is small and batch != 1:
                continue
            record.call = f"{label} decode batch={batch} keys={keys} pool={pool.shape[0]}"
            q = _meta(batch, h, d, dtype=dtype)
            tables = _meta(batch, max(keys // page_size, 1), dtype=torch.int32)
            config = paged_attention.paged_decode_config(q, pool, pool, tables)
            if config is None:
                fallbacks.append(record.call)
                continue
            lens = _meta(batch, dtype=torch.int32)
            qkv = _meta(batch, (h + 2 * hkv) * d, dtype=dtype)  # the fused decode's form: the same configs
            rope, partial = (_meta(batch, 2, half, dtype=torch.float32) for half in (d // 2, 3 * d // 8))
            tpa.paged_decode_attention(q, pool, pool, tables, lens, 0.1, config, **scales)
            tpa.paged_decode_attention_qkv(qkv, pool, pool, rope, tables, lens, 0.1, config, **scales)
            if keys == max(cache_lengths):  # one more variant of each config: a sliding-window layer's decode, and the
                # fused form's per-head q/k norms (Qwen3) and partial rotary (Phi-3's 3/4 of each head)
                record.call += " window, q/k norms, partial rotary"
                tpa.paged_decode_attention(q, pool, pool, tables, lens, 0.1, config, window=1024, **scales)
                tpa.paged_decode_attention_qkv(qkv, pool, pool, rope, tables, lens, 0.1, config, window=1024,
                                               **scales)
                norm = _meta(d, dtype=dtype)
                tpa.paged_decode_attention_qkv(qkv, pool, pool, rope, tables, lens, 0.1, config, q_norm=norm,
                                               k_norm=norm, norm_eps=1e-6, **scales)
                tpa.paged_decode_attention_qkv(qkv, pool, pool, partial, tables, lens, 0.1, config, **scales)
        for (seqs, tokens), pool in itertools.product(PREFILL_LAYOUTS, (large, small)):
            record.call = f"{label} prefill sequences={seqs} tokens={tokens} pool={pool.shape[0]}"
            q = _meta(tokens, h, d, dtype=dtype)
            config = paged_attention.paged_prefill_config(q, pool, pool)
            if config is None:
                fallbacks.append(record.call)
                continue
            tables = _meta(seqs, max(cache_lengths) // page_size, dtype=torch.int32)
            for window in (0, 1024):  # full layers and sliding-window ones
                tpa.paged_prefill_attention(q, pool, pool, tables, _meta(seqs + 1, dtype=torch.int32),
                                            _meta(seqs, dtype=torch.int32), 0.1, config, window, **scales)
    return fallbacks
