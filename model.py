"""The whole Llama-family transformer in one file.

Static KV cache, rotary embeddings (with Llama 3.1 scaling), grouped-query attention, SwiGLU.
Weights use Hugging Face's rotary layout (rotate-half), so converted checkpoints need no permutation.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 frequency-dependent rope scaling ("rope_type": "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.low_freq_factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(f"invalid llama3 rope scaling {self}: factors and original length must be positive")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"invalid llama3 rope scaling {self}: high_freq_factor must exceed low_freq_factor")


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layer: int = 32
    n_head: int = 32
    n_kv_heads: int = 0  # 0: same as n_head (plain multi-head attention)
    head_dim: int = 0  # 0: dim // n_head
    intermediate_size: int = 11008
    vocab_size: int = 32000
    block_size: int = 4096  # the model's context length
    rope_base: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        # Frozen dataclass: fill derived defaults through object.__setattr__.
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_head)
        if self.head_dim == 0 and self.n_head > 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_head)
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        for name in ("dim", "n_layer", "n_head", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelArgs.{name} must be a positive integer, got {value!r}")
        if self.n_head % self.n_kv_heads != 0:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_base <= 0 or self.norm_eps <= 0:
            raise ValueError("rope_base and norm_eps must be positive")

    @property
    def q_size(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelArgs fields {unknown}; the checkpoint was written by a newer Redline")
        return cls(**data)

    @classmethod
    def from_name(cls, name: str) -> ModelArgs:
        if name not in MODEL_REGISTRY:
            known = ", ".join(sorted(MODEL_REGISTRY))
            raise ValueError(f"unknown model name {name!r}; known names: {known}")
        return cls(**MODEL_REGISTRY[name])


_LLAMA31_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LLAMA32_SCALING = {**_LLAMA31_SCALING, "factor": 32.0}
_LLAMA3_COMMON = {"vocab_size": 128256, "rope_base": 500000.0, "n_kv_heads": 8}

MODEL_REGISTRY: dict[str, dict[str, Any]] = {
    "Llama-2-7B": dict(dim=4096, n_layer=32, n_head=32, intermediate_size=11008, block_size=4096),
    "Llama-2-13B": dict(dim=5120, n_layer=40, n_head=40, intermediate_size=13824, block_size=4096),
    "Llama-2-70B": dict(dim=8192, n_layer=80, n_head=64, n_kv_heads=8, intermediate_size=28672, block_size=4096),
    "CodeLlama-7B": dict(dim=4096, n_layer=32, n_head=32, intermediate_size=11008, vocab_size=32016,
                         block_size=16384, rope_base=1e6),
    "CodeLlama-34B": dict(dim=8192, n_layer=48, n_head=64, n_kv_heads=8, intermediate_size=22016,
                          block_size=16384, rope_base=1e6),
    "Mistral-7B": dict(dim=4096, n_layer=32, n_head=32, n_kv_heads=8, intermediate_size=14336, block_size=4096),
    "Llama-3-8B": dict(dim=4096, n_layer=32, n_head=32, intermediate_size=14336, block_size=8192, **_LLAMA3_COMMON),
    "Llama-3-70B": dict(dim=8192, n_layer=80, n_head=64, intermediate_size=28672, block_size=8192, **_LLAMA3_COMMON),
    "Llama-3.1-8B": dict(dim=4096, n_layer=32, n_head=32, intermediate_size=14336, block_size=131072,
                         rope_scaling=_LLAMA31_SCALING, **_LLAMA3_COMMON),
    "Llama-3.1-70B": dict(dim=8192, n_layer=80, n_head=64, intermediate_size=28672, block_size=131072,
                          rope_scaling=_LLAMA31_SCALING, **_LLAMA3_COMMON),
    "Llama-3.1-405B": dict(dim=16384, n_layer=126, n_head=128, intermediate_size=53248, block_size=131072,
                           rope_scaling=_LLAMA31_SCALING, **_LLAMA3_COMMON),
    "Llama-3.2-1B": dict(dim=2048, n_layer=16, n_head=32, head_dim=64, intermediate_size=8192, block_size=131072,
                         rope_scaling=_LLAMA32_SCALING, tie_word_embeddings=True, **_LLAMA3_COMMON),
    "Llama-3.2-3B": dict(dim=3072, n_layer=28, n_head=24, head_dim=128, intermediate_size=8192, block_size=131072,
                         rope_scaling=_LLAMA32_SCALING, tie_word_embeddings=True, **_LLAMA3_COMMON),
    "TinyLlama-1.1B": dict(dim=2048, n_layer=22, n_head=32, n_kv_heads=4, intermediate_size=5632, block_size=2048),
    # Tiny configs for tests and CPU smoke runs.
    "debug-tiny": dict(dim=64, n_layer=2, n_head=4, n_kv_heads=2, intermediate_size=160, vocab_size=512, block_size=256),
    "debug-tiny-llama3": dict(dim=64, n_layer=2, n_head=4, n_kv_heads=1, intermediate_size=160, vocab_size=512,
                              block_size=1024, rope_base=500000.0,
                              rope_scaling={**_LLAMA31_SCALING, "original_max_position_embeddings": 64}),
}


def rope_frequencies(args: ModelArgs) -> Tensor:
    """Inverse frequencies, with Llama 3.1 scaling when configured."""
    half = args.head_dim // 2
    inv_freq = 1.0 / (args.rope_base ** (torch.arange(0, half, dtype=torch.float64) * 2 / args.head_dim))  # (D/2,)
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq.float()
    # Long wavelengths are slowed by `factor`, short ones kept, and the band between interpolated smoothly.
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, blended)
    scaled = torch.where(wavelen < high_wavelen, inv_freq, scaled)
    return scaled.float()


def rope_table(args: ModelArgs, seq_len: int, device: torch.device | None = None) -> Tensor:
    """cos and sin for every position, in fp32: (seq_len, 2, head_dim // 2)."""
    inv_freq = rope_frequencies(args).to(device)  # (D/2,)
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)  # (S,)
    angles = torch.outer(positions, inv_freq)  # (S, D/2)
    return torch.stack([angles.cos(), angles.sin()], dim=1)  # (S, 2, D/2)


def apply_rope(x: Tensor, table: Tensor) -> Tensor:
    """Rotate-half rotary embedding. x (B, T, H, D), table (T, 2, D/2) fp32."""
    cos = table[:, 0].unsqueeze(1)  # (T, 1, D/2)
    sin = table[:, 1].unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, T, H, D/2) each
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.type_as(x)


def split_rotated_qkv(qkv: Tensor, rope: Tensor, n_heads: int, n_kv_heads: int,
                      head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """The fused projection qkv (B, T, (H + 2 Hkv) D) -> q (B, T, H, D) and k (B, T, Hkv, D) rotated with rope
    (T, 2, D/2), and v (B, T, Hkv, D)."""
    batch, length, _ = qkv.shape
    q, k, v = qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    q = apply_rope(q.view(batch, length, n_heads, head_dim), rope)
    k = apply_rope(k.view(batch, length, n_kv_heads, head_dim), rope)
    return q, k, v.view(batch, length, n_kv_heads, head_dim)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Normalized in fp32, rounded to x's dtype, then scaled (the order HF's LlamaRMSNorm uses)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class KVCache(nn.Module):
    """Static cache written in place at `input_pos`, so one captured graph serves every position."""

    def __init__(self, batch_size: int, n_kv_heads: int, seq_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | None) -> None:
        super().__init__()
        shape = (batch_size, n_kv_heads, seq_len, head_dim)  # (B, Hkv, S, D)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v (B, Hkv, T, D) written at positions input_pos (T,); returns the whole cache."""
        batch = k.shape[0]
        self.k[:batch].index_copy_(2, input_pos, k)
        self.v[:batch].index_copy_(2, input_pos, v)
        return self.k[:batch], self.v[:batch]

    def write_prefix(self, k: Tensor, v: Tensor) -> None:
        """k, v (B, Hkv, T, D) written at positions 0..T-1: a slice copy, which touches only those T rows
        (index_copy_ is compiled to a pass over the whole cache)."""
        batch, _, length, _ = k.shape
        self.k[:batch, :, :length] = k
        self.v[:batch, :, :length] = v


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.wqkv = nn.Linear(args.dim, args.q_size + 2 * args.kv_size, bias=False)
        self.wo = nn.Linear(args.q_size, args.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def cache(self) -> KVCache:
        if self.kv_cache is None:
            raise RuntimeError("call Transformer.setup_caches(max_batch_size, max_seq_length) before forward")
        return self.kv_cache

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor, input_pos: Tensor, from_start: bool = False) -> Tensor:
        a = self.args
        bsz, seqlen, _ = x.shape
        qkv = self.wqkv(x)  # (B, T, (H + 2 Hkv) D)
        cache = self.cache()
        gqa = a.n_kv_heads != a.n_head
        q, k, v = split_rotated_qkv(qkv, rope, a.n_head, a.n_kv_heads, a.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # q (B, H, T, D); k, v (B, Hkv, T, D)
        if from_start:  # positions 0..T-1: causal attention within the new keys, so SDPA may pick a fused kernel
            cache.write_prefix(k, v)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # (B, H, T, D)
        else:
            k, v = cache.update(input_pos, k, v)  # (B, Hkv, S, D)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, a.q_size))  # (B, T, dim)


class FeedForward(nn.Module):
    """SwiGLU with the gate and up projections fused into one matrix (w13)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.hidden = args.intermediate_size
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.hidden, dim=-1)  # (B, T, I) each
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor, input_pos: Tensor, from_start: bool = False) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask, input_pos, from_start)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch_size = 0
        self.max_seq_length = 0
        self.register_buffer("rope", torch.empty(0), persistent=False)  # (S, 2, D/2) fp32, filled by setup_caches

    def setup_caches(self, max_batch_size: int, max_seq_length: int) -> None:
        """Allocate the KV cache and rope table; the only place the cache is allocated."""
        if max_batch_size <= 0 or max_seq_length <= 0:
            raise ValueError("max_batch_size and max_seq_length must be positive")
        if max_seq_length > self.args.block_size:
            raise ValueError(
                f"max_seq_length {max_seq_length} exceeds the model's context of {self.args.block_size} tokens; "
                "use a shorter prompt or fewer new tokens"
            )
        weight = self.output.weight
        a = self.args
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, a.n_kv_heads, max_seq_length, a.head_dim,
                                               self.cache_dtype, weight.device)
        self.rope = rope_table(a, max_seq_length, weight.device)
        self.max_batch_size = max_batch_size
        self.max_seq_length = max_seq_length

    @property
    def cache_dtype(self) -> torch.dtype:
        """Activations run in the dtype of the norms (quantized weights are int8, so not those)."""
        return self.norm.weight.dtype

    def forward(self, idx: Tensor, input_pos: Tensor, logits_at: Tensor | None = None,
                from_start: bool = False) -> Tensor:
        """idx (B, T) token ids at positions input_pos (T,). Returns logits (B, T, vocab).

        logits_at (L,) picks the sequence indices whose logits are computed (B, L, vocab); prefill only needs one.
        from_start promises input_pos == arange(T) (a prefill), so attention needs only those T cache entries.
        """
        if self.max_seq_length == 0:
            raise RuntimeError("call setup_caches(max_batch_size, max_seq_length) before forward")
        x = self.tok_embeddings(idx)  # (B, T, dim)
        rope = self.rope[input_pos]  # (T, 2, D/2)
        # Each query attends to cached positions up to its own; built per call, so no (S, S) buffer.
        cache_pos = torch.arange(self.max_seq_length, device=idx.device)  # (S,)
        mask = (cache_pos.unsqueeze(0) <= input_pos.unsqueeze(1)).view(1, 1, -1, self.max_seq_length)  # (1, 1, T, S)
        for layer in self.layers:
            x = layer(x, rope, mask, input_pos, from_start)
        if logits_at is not None:
            x = x.index_select(1, logits_at)  # (B, L, dim)
        return self.output(self.norm(x))  # (B, T, vocab)
