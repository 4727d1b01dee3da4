"""The whole Llama-family transformer in one file, with the deltas of Qwen2/3, Gemma 2/3, Phi-3, OLMo 2, Granite and
the mixtures of experts (Mixtral, Qwen3-MoE) as data in ModelArgs.

Static KV cache (batch 1, copies of one prompt) or a paged one passed in per call (PagedContext: many sequences of
different lengths flattened into one row), rotary embeddings (Llama 3.1, linear and LongRoPE scaling, partial
rotary), grouped-query attention (biases, q/k norms, sliding windows, soft-capping), SwiGLU or GeGLU, pre-, sandwich
or post-norms.
Weights use Hugging Face's rotary layout (rotate-half), so converted checkpoints need no permutation.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from redline.model_registry import MODEL_REGISTRY
from redline.rope import (ROPE_TYPES, RopeScaling, apply_rope, mrope_table, rope_frequencies,  # noqa: F401
                          rope_table)

NORM_PLACEMENTS = ("pre", "sandwich", "post")
# The paged cache's element types: "auto" stores the activations' dtype, "fp8" e4m3 codes with a fixed scale per
# layer and KV head (docs/kv-cache-fp8.md says why).
KV_CACHE_DTYPES = ("auto", "fp8")
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # the largest finite e4m3 value: codes are clamped to it, so a cast never makes inf or nan
QK_NORMS = ("none", "head", "full")
ACTIVATIONS = ("silu", "gelu_tanh")


def check_kv_cache_dtype(name: str) -> None:
    """A ValueError in one line unless `name` is one of KV_CACHE_DTYPES."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


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
    # The families' deltas from Llama; the defaults are Llama's (scripts/hf_config.py sets them per architecture).
    qkv_bias: bool = False  # bias on the q, k and v projections (Qwen2)
    o_bias: bool = False  # bias on the output projection (attention_bias in Llama, Qwen3, Granite)
    qk_norm: str = "none"  # RMSNorm of q and k before rope: "head" over head_dim per head (Qwen3, Gemma 3), "full"
    # over the whole q or k width (OLMo 2)
    norm_offset: float = 0.0  # every RMSNorm scales by (norm_offset + w): 1.0 for Gemma
    norm_scale_fp32: bool = False  # the scale is applied in fp32, then rounded (Gemma, OLMo 2); Llama rounds first
    norm_placement: str = "pre"  # "pre": a norm on each sub-layer's input; "sandwich": on its input and its output
    # (Gemma 2/3); "post": on its output only (OLMo 2)
    activation: str = "silu"  # the feed-forward gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embedding_scale: float = 1.0  # embeddings times this, rounded to the activation dtype (Gemma: sqrt(dim); Granite)
    residual_scale: float = 1.0  # each sub-layer's output times this before the residual add (Granite)
    logits_divisor: float = 1.0  # logits divided by this (Granite's logits_scaling)
    attention_scale: float = 0.0  # scores times this; 0: head_dim ** -0.5
    attn_softcap: float = 0.0  # > 0: scores -> c * tanh(scores / c) before the mask (Gemma 2)
    final_softcap: float = 0.0  # > 0: logits -> c * tanh(logits / c) (Gemma 2)
    rotary_dim: int = 0  # rope on the first rotary_dim features of each head, the rest pass through; 0: head_dim
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window (a query sees the last w positions) or 0 (full
    # attention); empty: every layer full
    local_rope_base: float = 0.0  # > 0: the windowed layers' rope base, without scaling (Gemma 3); 0: one rope for all
    # Mixture of experts (Mixtral, Qwen3-MoE): n_experts SwiGLU experts of moe_intermediate_size (0: intermediate_size)
    n_experts: int = 0  # per sparse layer, n_experts_per_tok chosen per token; 0 experts: dense
    n_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the chosen experts' weights renormalized to sum to 1 (Mixtral; Qwen3-MoE's option)
    router_weights_rounded: bool = False  # those weights rounded to the activation dtype before use (Qwen3-MoE)
    moe_layers: tuple[bool, ...] = ()  # per layer: True where sparse, False where dense (intermediate_size); empty:
    # every layer sparse when n_experts > 0
    # Multimodal rope (Qwen2.5-VL): how many of the rotary_dim / 2 frequencies the t, h and w positions of an image
    # token turn, in that order (16, 24, 24); empty: one position per token. Text tokens need only the 1D table.
    mrope_sections: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Frozen dataclass: fill derived defaults through object.__setattr__.
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_head)
        if self.head_dim == 0 and self.n_head > 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_head)
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.rotary_dim == 0 and self.head_dim > 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        object.__setattr__(self, "layer_windows", tuple(self.layer_windows))
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        object.__setattr__(self, "mrope_sections", tuple(self.mrope_sections))
        if self.n_experts and not self.moe_intermediate_size:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        for name in ("dim", "n_layer", "n_head", "n_kv_heads", "head_dim", "intermediate_size", "vocab_size",
                     "block_size", "rotary_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelArgs.{name} must be a positive integer, got {value!r}")
        if self.n_head % self.n_kv_heads != 0:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_base <= 0 or self.norm_eps <= 0:
            raise ValueError("rope_base and norm_eps must be positive")
        self._check_deltas()

    def _check_deltas(self) -> None:
        for name in ("qkv_bias", "o_bias", "norm_scale_fp32", "norm_topk_prob", "router_weights_rounded"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelArgs.{name} must be true or false, got {getattr(self, name)!r}")
        for name, value, choices in (("qk_norm", self.qk_norm, QK_NORMS), ("activation", self.activation, ACTIVATIONS),
                                     ("norm_placement", self.norm_placement, NORM_PLACEMENTS)):
            if value not in choices:
                raise ValueError(f"ModelArgs.{name} must be one of {', '.join(choices)}, got {value!r}")
        for name in ("embedding_scale", "residual_scale", "logits_divisor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"ModelArgs.{name} must be a positive number, got {value!r}")
        for name in ("norm_offset", "attention_scale", "attn_softcap", "final_softcap", "local_rope_base"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"ModelArgs.{name} must be a number >= 0, got {value!r}")
        if self.rotary_dim % 2 != 0 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim must be even and at most head_dim ({self.head_dim}), got {self.rotary_dim}")
        windows = self.layer_windows
        if windows and (len(windows) != self.n_layer or not all(type(w) is int and w >= 0 for w in windows)):
            raise ValueError(f"layer_windows must hold one window >= 0 per layer ({self.n_layer}), got {windows}")
        self._check_experts()
        sections = self.mrope_sections
        if sections and (len(sections) != 3 or not all(type(n) is int and n >= 0 for n in sections)
                         or sum(sections) != self.rotary_dim // 2):
            raise ValueError(f"mrope_sections must be three counts (t, h, w) summing to rotary_dim / 2 = "
                             f"{self.rotary_dim // 2}, got {sections}")
        scaling = self.rope_scaling
        longrope = scaling is not None and scaling.rope_type == "longrope"
        if longrope and len(scaling.short_factor) != self.rotary_dim // 2:
            raise ValueError(f"longrope factors must number rotary_dim / 2 = {self.rotary_dim // 2}, got "
                             f"{len(scaling.short_factor)}")

    def _check_experts(self) -> None:
        sizes = (self.n_experts, self.n_experts_per_tok, self.moe_intermediate_size)
        if not all(type(v) is int and v >= 0 for v in sizes) or (self.n_experts and not 0 < sizes[1] <= sizes[0]):
            raise ValueError(f"n_experts, n_experts_per_tok (1..n_experts) and moe_intermediate_size must be integers, "
                             f"got {sizes}")
        if (not self.n_experts and any(sizes + self.moe_layers)) or self.moe_layers and (
                len(self.moe_layers) != self.n_layer or not all(type(m) is bool for m in self.moe_layers)):
            raise ValueError(f"moe_layers must hold one true/false per layer ({self.n_layer}) of a model with experts, "
                             f"got {self.moe_layers}")

    def sparse(self, layer: int) -> bool:
        """Whether the layer's feed-forward is the mixture of experts."""
        return self.n_experts > 0 and (not self.moe_layers or self.moe_layers[layer])

    @property
    def q_size(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def window(self, layer: int) -> int:
        """The layer's sliding window; 0: full attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

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
        """The shapes of a named model (model_registry.py)."""
        if name not in MODEL_REGISTRY:
            known = ", ".join(sorted(MODEL_REGISTRY))
            raise ValueError(f"unknown model name {name!r}; known names: {known}")
        return cls(**MODEL_REGISTRY[name])


def split_rotated_qkv(qkv: Tensor, rope: Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
                      qk_norm: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """The fused projection qkv (B, T, (H + 2 Hkv) D) -> q (B, T, H, D) and k (B, T, Hkv, D) rotated with rope
    (T, 2, Dr/2), and v (B, T, Hkv, D). qk_norm, when given, normalizes q and k (B, T, heads, D) before rope."""
    batch, length, _ = qkv.shape
    q, k, v = qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    q, k = q.view(batch, length, n_heads, head_dim), k.view(batch, length, n_kv_heads, head_dim)
    if qk_norm is not None:
        q, k = qk_norm(q, k)
    return apply_rope(q, rope), apply_rope(k, rope), v.view(batch, length, n_kv_heads, head_dim)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float = 0.0,
              softcap: float = 0.0) -> Tensor:
    """Softmax attention of q (B, H, T, D) over k, v (B, Hkv, S, D) -> (B, H, T, D). mask (1 or B, 1, T, S) bool,
    True where a query may attend; None: causal, the T queries being the keys' positions 0..T-1. scale 0: D ** -0.5.
    softcap c > 0: the scaled scores become c * tanh(scores / c) before the mask."""
    scale = scale or q.shape[-1] ** -0.5
    gqa = k.shape[1] != q.shape[1]
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=gqa)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, S, D)
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S)
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()  # (T, S)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
    return probs @ v


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0, scale_fp32: bool = False) -> Tensor:
    """Normalized in fp32, then scaled by (offset + weight): by default rounded to x's dtype before the scaling (HF's
    LlamaRMSNorm order); scale_fp32 scales in fp32 and rounds once (Gemma's and OLMo 2's order)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if scale_fp32:
        return (normed * (weight.float() + offset)).type_as(x)
    return (weight + offset if offset else weight) * normed.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0, scale_fp32: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.scale_fp32 = scale_fp32
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset, self.scale_fp32)


def model_norm(args: ModelArgs, dim: int | None = None) -> RMSNorm:
    """An RMSNorm of the model's kind over dim features (default: the model width)."""
    return RMSNorm(dim or args.dim, args.norm_eps, args.norm_offset, args.norm_scale_fp32)


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


def pool_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None) -> Tensor:
    """torch.zeros(shape), except on the CPU: there the memory is an anonymous mapping, whose pages the OS hands out
    zeroed when they are first written, so a page pool costs no time or memory until it fills (zeroing a 1.5 GB pool
    took 1-2 s of a CPU server's start)."""
    if device is not None and torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import mmap

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=dtype, count=math.prod(shape)).view(shape)


class PagedKVCache:
    """A pool of fixed-size pages that many sequences share: k and v, one (num_pages, page_size, Hkv, D) tensor
    per layer each, and the rope table of every position the model reads (block_size, 2, D/2) fp32. The engine owns
    it.

    dtype: the pages' element type; FP8_KV_DTYPE (e4m3) pages hold k / k_scale[layer] per KV head (and v likewise),
    where k_scale and v_scale are one (Hkv,) fp32 tensor per layer, fixed for the pool's life (1.0 until the owner
    calibrates them, before the first step): a token's stored bytes never depend on the rest of its batch.
    ops: (prefill, decode) attention functions with the signatures of paged_prefill_attention and
    paged_decode_attention (the GPU's redline:: kernels, or the CPU's decode kernel, set from outside); None, or
    None for one of them: those plain PyTorch references."""

    def __init__(self, args: ModelArgs, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | None, ops: tuple[Any, Any] | None = None) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"a paged KV cache needs positive num_pages and page_size, got {num_pages}, {page_size}")
        if args.rope_scaling is not None and args.rope_scaling.rope_type == "longrope":
            raise ValueError("the paged cache does not run LongRoPE models (their rope table depends on the sequence "
                             "length); use LLM.generate for Phi-3/Phi-4-mini")
        # One tensor per layer (not one (n_layer, ...) tensor): a compiled step then writes each layer's pages in
        # place, where a write into a slice of one big tensor made inductor copy the whole cache.
        shape = (num_pages, page_size, args.n_kv_heads, args.head_dim)
        self.k = [pool_zeros(shape, dtype, device) for _ in range(args.n_layer)]
        self.v = [pool_zeros(shape, dtype, device) for _ in range(args.n_layer)]
        self.fp8 = dtype == FP8_KV_DTYPE
        ones = [torch.ones(args.n_kv_heads, device=device) for _ in range(2 * args.n_layer)] if self.fp8 else None
        self.k_scale: list[Tensor] | None = ones[:args.n_layer] if ones else None  # per layer (Hkv,) fp32
        self.v_scale: list[Tensor] | None = ones[args.n_layer:] if ones else None
        self.rope = rope_table(args, args.block_size, device)  # (block_size, 2, Dr/2)
        local = args.local_rope_base > 0 and any(args.layer_windows)  # windowed layers' own rope base
        self.rope_local = rope_table(args, args.block_size, device, local=True) if local else self.rope[:0]
        self.num_pages, self.page_size = num_pages, page_size
        self.ops = ops
        self.args = args

    def scales(self, layer: int) -> tuple[Tensor, Tensor] | tuple[()]:
        """The layer's (k_scale, v_scale), (Hkv,) fp32 each, the attention ops' last two arguments; () for pages of
        the activations' dtype (the ops' calls then stay as they were)."""
        if self.k_scale is None:
            return ()
        return self.k_scale[layer], self.v_scale[layer]

    def set_scales(self, k_scale: Tensor, v_scale: Tensor) -> None:
        """Fix the fp8 pages' scales, (n_layer, Hkv) each, copied in place (captured graphs keep their addresses);
        call before any page is written."""
        if self.k_scale is None:
            raise ValueError("only an fp8 KV cache has scales")
        expected = (len(self.k_scale), self.k_scale[0].shape[0])
        if k_scale.shape != expected or v_scale.shape != expected:
            raise ValueError(f"KV scales must be (n_layer, n_kv_heads) = {expected}, got {tuple(k_scale.shape)} and "
                             f"{tuple(v_scale.shape)}")
        if not (torch.isfinite(k_scale).all() and torch.isfinite(v_scale).all() and (k_scale > 0).all()
                and (v_scale > 0).all()):
            raise ValueError("KV scales must be finite and positive")
        for layer, (ks, vs) in enumerate(zip(k_scale, v_scale)):
            self.k_scale[layer].copy_(ks)
            self.v_scale[layer].copy_(vs)


def quantized_kv(x: Tensor, scale: Tensor) -> Tensor:
    """x (..., Hkv, D) as e4m3 codes of x / scale, scale (Hkv,) fp32 per KV head; clamped to +-448 first, so a value
    past the calibrated range saturates instead of becoming inf or nan."""
    return (x.float() / scale[:, None]).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantized_kv(codes: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Cached keys or values (..., Hkv, D) in dtype: e4m3 codes times their KV head's scale (Hkv,) in fp32, or
    (scale None) the cache's own values."""
    if scale is None:
        return codes.to(dtype)
    return (codes.float() * scale[:, None]).to(dtype)


def paged_prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, cu_seqlens_q: Tensor,
                            seq_lens: Tensor, scale: float,
                            host_lens: tuple[list[int], list[int]] | None = None,
                            singles: tuple[Tensor, Tensor] | None = None, window: int = 0,
                            softcap: float = 0.0,
                            spans: tuple[tuple[tuple[int, int], ...], ...] | None = None,
                            k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor:
    """Attention of the flattened queries q (T, H, D) of S sequences over their pages; the reference of
    redline::paged_prefill_attention. k_cache, v_cache (num_pages, page_size, Hkv, D); block_tables (S, max_pages),
    cu_seqlens_q (S + 1,) and seq_lens (S,) int32. Query j of sequence s sits at position seq_lens[s] - q_len + j
    and attends to keys 0..that position. Returns (T, H, D).

    host_lens: the query and key counts per sequence as lists, when the caller has them (else read from the
    device). Sequences with one query (decode rows) go through paged_decode_attention together, the others one by
    one; singles: those sequences' indices and their query rows (B,) each, when the caller has them on the device.
    window > 0: a query sees only the last `window` positions up to its own; softcap as in attention(). spans: per
    sequence, [start, end) position ranges whose queries see all their keys (an image's tokens, Gemma 3). k_scale,
    v_scale (Hkv,) fp32: the caches hold e4m3 codes, dequantized with them after the load."""
    q_lens, k_lens = host_lens if host_lens is not None else (cu_seqlens_q.diff().tolist(), seq_lens.tolist())
    page_size = k_cache.shape[1]
    out = torch.empty_like(q)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    if singles is None:
        single = [s for s, n in enumerate(q_lens) if n == 1]
        singles = (torch.tensor(single, device=q.device), torch.tensor([starts[s] for s in single], device=q.device))
    rows, tokens = singles  # (B,) each
    if rows.numel():
        out[tokens] = paged_decode_attention(q[tokens], k_cache, v_cache, block_tables[rows], seq_lens[rows], scale,
                                             window, softcap, k_scale, v_scale)
    for s, n_keys in enumerate(k_lens):
        begin, end = starts[s], starts[s + 1]
        if end - begin == 1:
            continue
        pages = block_tables[s, :-(-n_keys // page_size)].long()  # (P,)
        keys = dequantized_kv(k_cache[pages].flatten(0, 1)[:n_keys], k_scale, q.dtype).transpose(0, 1)  # (Hkv, K, D)
        values = dequantized_kv(v_cache[pages].flatten(0, 1)[:n_keys], v_scale, q.dtype).transpose(0, 1)
        q_pos = torch.arange(n_keys - (end - begin), n_keys, device=q.device)  # (Q,)
        key_pos = torch.arange(n_keys, device=q.device).unsqueeze(0)  # (1, K)
        mask = key_pos <= q_pos.unsqueeze(1)  # (Q, K)
        for first, last in spans[s] if spans is not None else ():  # an image's tokens see each other
            inside = (q_pos >= first) & (q_pos < last)  # (Q,)
            mask = mask | (inside.unsqueeze(1) & (key_pos >= first) & (key_pos < last))
        if window:
            mask = mask & (key_pos > q_pos.unsqueeze(1) - window)
        queries = q[begin:end].transpose(0, 1)  # (H, Q, D)
        attended = attention(queries.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), mask, scale,
                             softcap)  # (1, H, Q, D)
        out[begin:end] = attended[0].transpose(0, 1)
    return out


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                           scale: float, window: int = 0, softcap: float = 0.0, k_scale: Tensor | None = None,
                           v_scale: Tensor | None = None) -> Tensor:
    """One query per sequence, q (B, H, D), at position seq_lens[b] - 1; the reference of
    redline::paged_decode_attention. Every row's pages are gathered into one padded batch and masked past its
    length (and, with a window, before its last `window` keys): no host synchronisation, so a CUDA graph can hold
    it. k_scale, v_scale (Hkv,) fp32: e4m3 caches, dequantized after the load. Returns (B, H, D)."""
    batch, max_pages = block_tables.shape
    page_size = k_cache.shape[1]
    pages = block_tables.long()  # (B, P)
    keys = dequantized_kv(k_cache[pages].flatten(1, 2), k_scale, q.dtype).transpose(1, 2)  # (B, Hkv, P * page_size, D)
    values = dequantized_kv(v_cache[pages].flatten(1, 2), v_scale, q.dtype).transpose(1, 2)
    key_pos = torch.arange(max_pages * page_size, device=q.device)  # (P * page_size,)
    visible = key_pos < seq_lens.view(-1, 1)  # (B, P * page_size)
    if window:
        visible = visible & (key_pos >= seq_lens.view(-1, 1) - window)
    out = attention(q.unsqueeze(2), keys, values, visible.view(batch, 1, 1, -1), scale, softcap)  # (B, H, 1, D)
    return out.squeeze(2)


@dataclass
class PagedContext:
    """One step of a paged batch: N tokens of S sequences flattened into one row (prefill chunks and decode rows
    mixed), and where their keys and values live in the pool."""

    positions: Tensor  # (N,) each token's position in its own sequence
    slot_mapping: Tensor  # (N,) page * page_size + offset where each token's k and v are written
    block_tables: Tensor  # (S, max_pages) int32, each sequence's pages in order
    seq_lens: Tensor  # (S,) int32, keys of each sequence after this step
    cu_seqlens_q: Tensor  # (S + 1,) int32, where each sequence's tokens start in the row
    kv: PagedKVCache
    decode: bool = False  # every sequence has exactly one token in this step
    host_lens: tuple[list[int], list[int]] | None = None  # query and key counts per sequence, on the host
    singles: tuple[Tensor, Tensor] | None = None  # the one-query sequences and their rows (B,), on the device
    layer: int = 0  # the layer whose pages attend() uses; Transformer.forward sets it
    images: PagedImages | None = None  # the images of prompt chunks in this step (their embeddings, positions, mask)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float = 0.0, window: int = 0,
               softcap: float = 0.0) -> Tensor:
        """Write k, v (N, Hkv, D) into this layer's pages, then attend with q (N, H, D); returns (N, H, D). scale 0:
        D ** -0.5; a soft-cap runs the PyTorch references (the GPU kernels do not implement it)."""
        k_cache, v_cache = self.kv.k[self.layer], self.kv.v[self.layer]  # (num_pages, page_size, Hkv, D)
        scales = self.kv.scales(self.layer)  # e4m3 pages: (k_scale, v_scale), (Hkv,) fp32 each; else ()
        if scales:
            k, v = quantized_kv(k, scales[0]), quantized_kv(v, scales[1])
        page, offset = self.slot_mapping // self.kv.page_size, self.slot_mapping % self.kv.page_size  # (N,)
        k_cache.index_put_((page, offset), k)
        v_cache.index_put_((page, offset), v)
        scale = scale or q.shape[-1] ** -0.5
        spans = self.images.spans if self.images is not None else None
        prefill, decode = self.kv.ops if self.kv.ops is not None and not softcap and spans is None else (None, None)
        if self.decode and decode is not None:
            return decode(q, k_cache, v_cache, self.block_tables, self.seq_lens, scale, window, *scales)
        if not self.decode and prefill is not None:
            return prefill(q, k_cache, v_cache, self.block_tables, self.cu_seqlens_q, self.seq_lens, scale, window,
                           *scales)
        if self.decode:
            return paged_decode_attention(q, k_cache, v_cache, self.block_tables, self.seq_lens, scale, window,
                                          softcap, *scales)
        return paged_prefill_attention(q, k_cache, v_cache, self.block_tables, self.cu_seqlens_q, self.seq_lens,
                                       scale, self.host_lens, self.singles, window, softcap, spans, *scales)


@dataclass(frozen=True)
class PagedImages:
    """The images of a paged step's prompt chunks (the engine builds it from each request's PromptImages): their
    embeddings replace the token embeddings of some rows of the step, Qwen2.5-VL's M-RoPE rows replace the rope of
    the prompt rows, and Gemma 3's image tokens see each other both ways. Steps with `spans` run model.py's
    reference attention, which takes the mask (the paged kernels are causal only)."""

    embeds: Tensor  # (M, dim) image token embeddings
    rows: Tensor  # (M,) the step's rows (of N) they go to
    rope_rows: Tensor | None = None  # (R,) rows whose rope is M-RoPE
    rope: Tensor | None = None  # (R, 2, Dr/2) fp32, those rows' M-RoPE tables
    spans: tuple[tuple[tuple[int, int], ...], ...] | None = None  # per sequence of the step: [start, end) positions
    # of each image whose tokens see each other (Gemma 3); None: causal everywhere


@dataclass(frozen=True)
class PromptImages:
    """What a prompt's images change in its prefill (vision.py builds it): their tokens' embeddings replace those of
    the image placeholder tokens, and, per family, their positions and attention differ from text's."""

    embeds: Tensor  # (N, dim) the image tokens' embeddings, in prompt order
    slots: Tensor  # (N,) the prompt indices whose token embeddings they replace
    rope_positions: Tensor | None = None  # (3, T) every prompt token's M-RoPE positions (t, h, w); None: 0..T-1
    groups: Tensor | None = None  # (T,) the image each prompt token belongs to, -1 for text: an image's tokens see
    # each other both ways (Gemma 3); None: causal everywhere

    def spliced(self, x: Tensor) -> Tensor:
        """Token embeddings x (B, T, dim) with the image slots replaced by the image embeddings."""
        embeds = self.embeds.to(x.dtype).unsqueeze(0).expand(x.shape[0], -1, -1)  # (B, N, dim)
        return x.index_copy(1, self.slots, embeds)

    def mask(self, causal: Tensor, length: int) -> Tensor:
        """causal (T, S) widened so that each image's tokens among the first T positions see each other."""
        if self.groups is None:
            return causal
        keys = self.groups.new_full((causal.shape[1],), -1)  # (S,)
        keys[:length] = self.groups
        same_image = (self.groups.unsqueeze(1) == keys.unsqueeze(0)) & (self.groups.unsqueeze(1) >= 0)  # (T, S)
        return causal | same_image


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, window: int = 0) -> None:
        super().__init__()
        self.args = args
        self.window = window  # 0: full attention
        self.wqkv = nn.Linear(args.dim, args.q_size + 2 * args.kv_size, bias=False)
        self.wo = nn.Linear(args.q_size, args.dim, bias=False)
        # Biases are kept apart from the linears, so quantized and kernel linears stay bias-free.
        self.wqkv_bias = nn.Parameter(torch.zeros(args.q_size + 2 * args.kv_size)) if args.qkv_bias else None
        self.wo_bias = nn.Parameter(torch.zeros(args.dim)) if args.o_bias else None
        per_head = args.qk_norm == "head"
        self.q_norm = None if args.qk_norm == "none" else model_norm(args, args.head_dim if per_head else args.q_size)
        self.k_norm = None if args.qk_norm == "none" else model_norm(args, args.head_dim if per_head else args.kv_size)
        self.kv_cache: KVCache | None = None

    def cache(self) -> KVCache:
        if self.kv_cache is None:
            raise RuntimeError("call Transformer.setup_caches(max_batch_size, max_seq_length) before forward")
        return self.kv_cache

    def qkv(self, x: Tensor) -> Tensor:
        """x (B, T, dim) -> the fused projection (B, T, (H + 2 Hkv) D), with its bias."""
        qkv = self.wqkv(x)
        return qkv if self.wqkv_bias is None else qkv + self.wqkv_bias

    def normed_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """q (B, T, H, D), k (B, T, Hkv, D) through the q/k norms: per head, or over all heads at once."""
        if self.args.qk_norm == "head":
            return self.q_norm(q), self.k_norm(k)
        return self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)

    def normed_qkv(self, qkv: Tensor) -> Tensor:
        """The fused projection (B, T, (H + 2 Hkv) D) with its q and k parts through the q/k norms (itself without
        them), for the kernels that rope and cache from qkv."""
        if self.q_norm is None:
            return qkv
        a = self.args
        batch, length, _ = qkv.shape
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = q.view(batch, length, a.n_head, a.head_dim)  # (B, T, H, D)
        k = k.view(batch, length, a.n_kv_heads, a.head_dim)  # (B, T, Hkv, D)
        q, k = self.normed_qk(q, k)
        return torch.cat([q.flatten(2), k.flatten(2), v], dim=-1)

    def output(self, out: Tensor) -> Tensor:
        """The attention output (B, H, T, D) -> (B, T, dim) through wo and its bias."""
        bsz, _, seqlen, _ = out.shape
        y = self.wo(out.transpose(1, 2).reshape(bsz, seqlen, self.args.q_size))
        return y if self.wo_bias is None else y + self.wo_bias

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor, input_pos: Tensor, from_start: bool = False,
                context: PagedContext | None = None) -> Tensor:
        a = self.args
        qkv = self.qkv(x)  # (B, T, (H + 2 Hkv) D)
        q, k, v = split_rotated_qkv(qkv, rope, a.n_head, a.n_kv_heads, a.head_dim,
                                    None if self.q_norm is None else self.normed_qk)
        if context is not None:  # paged: x is one row (1, N) of many sequences' tokens
            out = context.attend(q[0], k[0], v[0], a.attention_scale, self.window, a.attn_softcap)  # (N, H, D)
            return self.output(out.transpose(0, 1).unsqueeze(0))  # (1, N, dim)
        cache = self.cache()
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # q (B, H, T, D); k, v (B, Hkv, T, D)
        if from_start:  # positions 0..T-1: causal attention within the new keys, so SDPA may pick a fused kernel
            cache.write_prefix(k, v)
            window_mask = mask[..., :x.shape[1]] if self.window else None  # (1, 1, T, T)
            out = attention(q, k, v, window_mask, a.attention_scale, a.attn_softcap)  # (B, H, T, D)
        else:
            k, v = cache.update(input_pos, k, v)  # (B, Hkv, S, D)
            out = self.attend_cache(q, k, v, mask, input_pos)
        return self.output(out)  # (B, T, dim)

    def attend_cache(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
        """The new tokens' q (B, H, T, D) over the whole cache k, v (B, Hkv, S, D) under mask (1, 1, T, S), at
        positions input_pos (T,) -> (B, H, T, D). A kernel module may replace it (kernels.attention.CpuAttention)."""
        return attention(q, k, v, mask, self.args.attention_scale, self.args.attn_softcap)


class FeedForward(nn.Module):
    """SwiGLU (or GeGLU) with the gate and up projections fused into one matrix (w13)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.hidden = args.intermediate_size
        self.gelu = args.activation == "gelu_tanh"
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.hidden, dim=-1)  # (B, T, I) each
        return self.w2((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)


class MoEFeedForward(nn.Module):
    """A sparse mixture of SwiGLU experts (Mixtral, Qwen3-MoE): the router `gate` scores every expert per token, the
    top_k are run and their outputs summed with the routing weights. Expert e holds w13[e] (its gate rows, then its
    up rows) and w2[e] (down), as FeedForward's w13 and w2."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        n, hidden = args.n_experts, args.moe_intermediate_size
        self.n_experts, self.top_k, self.hidden, self.gelu = n, args.n_experts_per_tok, hidden, False
        self.norm_topk_prob, self.rounded = args.norm_topk_prob, args.router_weights_rounded
        self.gate = nn.Linear(args.dim, n, bias=False)  # the router
        self.w13 = nn.Parameter(torch.empty(n, 2 * hidden, args.dim))  # (E, 2I, dim)
        self.w2 = nn.Parameter(torch.empty(n, args.dim, hidden))  # (E, dim, I)

    def route(self, x2d: Tensor) -> tuple[Tensor, Tensor]:
        """x2d (T, dim) -> the chosen experts' weights (T, k) fp32 and ids (T, k): transformers' order of operations."""
        probs = self.gate(x2d).float().softmax(dim=-1)  # (T, E)
        weights, ids = probs.topk(self.top_k, dim=-1)  # (T, k) each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(x2d.dtype).float() if self.rounded else weights), ids

    def expert_weights(self, ids: Tensor | int) -> tuple[Tensor, Tensor]:
        """w13 and w2 of the experts `ids` (any index shape in front); quantized subclasses dequantize here."""
        return self.w13[ids], self.w2[ids]

    def experts(self, x2d: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """The weighted sum (T, dim) of the chosen experts' SwiGLU of x2d (T, dim). Few tokens (decode): the chosen
        experts' weights gathered per token; more: every expert over every token, weighted 0 where not chosen (added
        in expert order, as transformers does). No host synchronisation either way, so CUDA graphs can hold it."""
        tokens = x2d.shape[0]
        if tokens * self.top_k <= self.n_experts:
            w13, w2 = self.expert_weights(topk_ids)  # (T, k, 2I, dim), (T, k, dim, I)
            gate, up = torch.einsum("td,tkhd->tkh", x2d, w13).split(self.hidden, dim=-1)  # (T, k, I) each
            out = torch.einsum("tki,tkdi->tkd", F.silu(gate) * up, w2)  # (T, k, dim)
            return (out * topk_weights.unsqueeze(-1)).to(x2d.dtype).sum(dim=1)  # (T, dim)
        combine = x2d.new_zeros(tokens, self.n_experts, dtype=torch.float32).scatter_(1, topk_ids, topk_weights)
        out = torch.zeros_like(x2d)  # (T, dim)
        for e in range(self.n_experts):
            w13, w2 = self.expert_weights(e)  # (2I, dim), (dim, I)
            gate, up = F.linear(x2d, w13).split(self.hidden, dim=-1)  # (T, I) each
            out = out + (F.linear(F.silu(gate) * up, w2) * combine[:, e:e + 1]).to(x2d.dtype)
        return out

    def forward(self, x: Tensor) -> Tensor:
        x2d = x.reshape(-1, x.shape[-1])  # (B T, dim)
        return self.experts(x2d, *reversed(self.route(x2d))).view_as(x)


class TransformerBlock(nn.Module):
    """Attention then feed-forward, each added to the residual; norms on the sub-layers' inputs ("pre"), their
    outputs ("post") or both ("sandwich"), as args.norm_placement says."""

    def __init__(self, args: ModelArgs, window: int = 0, sparse: bool = False) -> None:
        super().__init__()
        pre, post = args.norm_placement != "post", args.norm_placement != "pre"
        self.residual_scale = args.residual_scale
        self.attention_norm = model_norm(args) if pre else None
        self.attention = Attention(args, window)
        self.post_attention_norm = model_norm(args) if post else None
        self.ffn_norm = model_norm(args) if pre else None
        self.feed_forward = MoEFeedForward(args) if sparse else FeedForward(args)
        self.post_ffn_norm = model_norm(args) if post else None

    def residual(self, x: Tensor, out: Tensor, post_norm: RMSNorm | None) -> Tensor:
        """x plus a sub-layer's output, normalized and scaled as configured."""
        out = out if post_norm is None else post_norm(out)
        return x + (out if self.residual_scale == 1.0 else out * self.residual_scale)

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor, input_pos: Tensor, from_start: bool = False,
                context: PagedContext | None = None) -> Tensor:
        a_in = x if self.attention_norm is None else self.attention_norm(x)
        h = self.residual(x, self.attention(a_in, rope, mask, input_pos, from_start, context),
                          self.post_attention_norm)
        f_in = h if self.ffn_norm is None else self.ffn_norm(h)
        return self.residual(h, self.feed_forward(f_in), self.post_ffn_norm)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, args.window(i), args.sparse(i))
                                    for i in range(args.n_layer))
        self.norm = model_norm(args)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch_size = 0
        self.max_seq_length = 0
        self.embedding_scale = 1.0  # args.embedding_scale rounded to the activation dtype, by setup_caches
        self.register_buffer("rope", torch.empty(0), persistent=False)  # (S, 2, Dr/2) fp32, filled by setup_caches
        # The windowed layers' own table when args.local_rope_base is set (Gemma 3), else empty.
        self.register_buffer("rope_local", torch.empty(0), persistent=False)

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
        local = a.local_rope_base > 0 and any(a.layer_windows)
        self.rope_local = rope_table(a, max_seq_length, weight.device, local=True) if local else self.rope[:0]
        # HF rounds the embedding scale to the weights' dtype (Gemma's normalizer).
        self.embedding_scale = torch.tensor(a.embedding_scale, dtype=self.cache_dtype).item()
        self.max_batch_size = max_batch_size
        self.max_seq_length = max_seq_length

    @property
    def cache_dtype(self) -> torch.dtype:
        """Activations run in the dtype of the norms (quantized weights are int8, so not those)."""
        return self.norm.weight.dtype

    def forward(self, idx: Tensor, input_pos: Tensor, logits_at: Tensor | None = None,
                from_start: bool = False, context: PagedContext | None = None,
                images: PromptImages | None = None) -> Tensor:
        """idx (B, T) token ids at positions input_pos (T,). Returns logits (B, T, vocab).

        logits_at (L,) picks the sequence indices whose logits are computed (B, L, vocab); prefill only needs one.
        from_start promises input_pos == arange(T) (a prefill), so attention needs only those T cache entries.
        context: the paged path instead of the static cache; idx (1, N) holds many sequences' tokens, input_pos is
        context.positions (N,), and each layer writes and reads its pages in context.kv.
        images: a prefill's images (from the start, unpadded): their embeddings, M-RoPE positions and attention.
        """
        if context is not None:
            return self.forward_paged(idx, context, logits_at)
        if self.max_seq_length == 0:
            raise RuntimeError("call setup_caches(max_batch_size, max_seq_length) before forward")
        x = self.tok_embeddings(idx)  # (B, T, dim)
        if self.embedding_scale != 1.0:
            x = x * self.embedding_scale
        if images is not None:
            x = images.spliced(x)
        mrope = images is not None and images.rope_positions is not None
        rope = mrope_table(self.args, images.rope_positions) if mrope else self.rope[input_pos]  # (T, 2, Dr/2)
        rope_local = self.rope_local[input_pos] if self.rope_local.numel() else rope
        # Each query attends to cached positions up to its own (and, in a windowed layer, within the window); built
        # per call, so no (S, S) buffer.
        cache_pos = torch.arange(self.max_seq_length, device=idx.device).unsqueeze(0)  # (1, S)
        mask = cache_pos <= input_pos.unsqueeze(1)  # (T, S)
        if images is not None and images.groups is not None:
            mask = images.mask(mask, idx.shape[1])
            from_start = False  # the images' keys after a query are seen too: the whole-cache path with this mask
        masks = {w: mask & (cache_pos > input_pos.unsqueeze(1) - w) for w in set(self.args.layer_windows) if w}
        masks[0] = mask
        for layer in self.layers:
            window = layer.attention.window
            x = layer(x, rope_local if window else rope, masks[window].view(1, 1, -1, self.max_seq_length),
                      input_pos, from_start)
        if logits_at is not None:
            x = x.index_select(1, logits_at)  # (B, L, dim)
        return self.logits(self.output(self.norm(x)))  # (B, T, vocab)

    def logits(self, logits: Tensor) -> Tensor:
        """The output head's values soft-capped and divided as configured (Gemma 2, Granite)."""
        a = self.args
        if a.final_softcap:
            logits = a.final_softcap * torch.tanh(logits / a.final_softcap)
        return logits if a.logits_divisor == 1.0 else logits / a.logits_divisor

    def forward_paged(self, idx: Tensor, context: PagedContext, logits_at: Tensor | None = None) -> Tensor:
        """idx (1, N) at context.positions (N,) -> logits (1, N or L, vocab); the static cache is not touched."""
        x = self.tok_embeddings(idx)  # (1, N, dim)
        if self.args.embedding_scale != 1.0:  # rounded to the activation dtype, as setup_caches does
            x = x * torch.tensor(self.args.embedding_scale, dtype=self.cache_dtype).item()
        rope = context.kv.rope[context.positions]  # (N, 2, Dr/2)
        rope_local = context.kv.rope_local[context.positions] if context.kv.rope_local.numel() else rope
        images = context.images
        if images is not None:
            x = x.index_copy(1, images.rows, images.embeds.to(x.dtype).unsqueeze(0))
            if images.rope is not None:
                rope = rope.index_copy(0, images.rope_rows, images.rope)
        for i, layer in enumerate(self.layers):
            context.layer = i
            x = layer(x, rope_local if layer.attention.window else rope, None, context.positions, False, context)
        if logits_at is not None:
            x = x.index_select(1, logits_at)  # (1, L, dim)
        return self.logits(self.output(self.norm(x)))  # (1, N, vocab)
