"""Rotary position embeddings: the scaling variants (Llama 3.1, linear, LongRoPE), the cos/sin table and the
rotate-half rotation; model.py re-exports these."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from redline.model import ModelArgs

ROPE_TYPES = ("llama3", "linear", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """Rope frequency scaling. "llama3": Llama 3.1's frequency-dependent scaling; "linear": every frequency divided by
    `factor` (Gemma 3's global layers); "longrope": frequencies divided per dimension by `short_factor`, or by
    `long_factor` when the cache is longer than `original_max_position_embeddings`, cos and sin times
    `attention_factor` (Phi-3)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):
            object.__setattr__(self, name, tuple(float(f) for f in getattr(self, name)))
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unknown rope scaling type {self.rope_type!r}; known: {', '.join(ROPE_TYPES)}")
        if self.factor <= 0 or self.low_freq_factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(f"invalid rope scaling {self}: factors and original length must be positive")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"invalid llama3 rope scaling {self}: high_freq_factor must exceed low_freq_factor")
        if self.rope_type == "longrope":
            factors = self.short_factor + self.long_factor
            if not self.short_factor or len(self.short_factor) != len(self.long_factor) or min(factors) <= 0:
                raise ValueError("longrope scaling needs positive short_factor and long_factor lists of one length")
            if not (math.isfinite(self.attention_factor) and self.attention_factor > 0):
                raise ValueError(f"longrope attention_factor must be a positive number, got {self.attention_factor}")


def rope_frequencies(args: ModelArgs, local: bool = False, seq_len: int = 0) -> Tensor:
    """Inverse frequencies (rotary_dim / 2,), scaled as configured; local: those of the windowed layers.
    LongRoPE picks its long factors when seq_len (the cache length) exceeds the original context."""
    own_base = local and args.local_rope_base > 0
    base = args.local_rope_base if own_base else args.rope_base
    dim = args.rotary_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))  # (Dr/2,)
    scaling = None if own_base else args.rope_scaling
    if scaling is None:
        return inv_freq.float()
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).float()
    if scaling.rope_type == "longrope":
        long = seq_len > scaling.original_max_position_embeddings
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float64)
        return (inv_freq / factors).float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, and the band between interpolated smoothly.
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


def rope_table(args: ModelArgs, seq_len: int, device: torch.device | None = None, local: bool = False) -> Tensor:
    """cos and sin for every position, in fp32: (seq_len, 2, rotary_dim // 2)."""
    inv_freq = rope_frequencies(args, local, seq_len).to(device)  # (Dr/2,)
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)  # (S,)
    angles = torch.outer(positions, inv_freq)  # (S, Dr/2)
    table = torch.stack([angles.cos(), angles.sin()], dim=1)  # (S, 2, Dr/2)
    scaling = args.rope_scaling
    if scaling is not None and scaling.rope_type == "longrope" and not (local and args.local_rope_base > 0):
        table = table * scaling.attention_factor
    return table


def mrope_table(args: ModelArgs, positions: Tensor) -> Tensor:
    """Multimodal rope (Qwen2.5-VL): each token has three positions (t, h, w) (3, T), and the rotary frequencies are
    split into args.mrope_sections runs, the first run turned by t, the second by h, the third by w. A text token's
    three positions are equal, so it gets the 1D table's row. Returns cos and sin (T, 2, Dr/2) fp32."""
    inv_freq = rope_frequencies(args).to(positions.device)  # (Dr/2,)
    sections = torch.tensor(args.mrope_sections, device=positions.device)
    axis = torch.repeat_interleave(torch.arange(3, device=positions.device), sections)  # (Dr/2,) 0: t, 1: h, 2: w
    angles = positions[axis].float().t() * inv_freq  # (T, Dr/2)
    return torch.stack([angles.cos(), angles.sin()], dim=1)  # (T, 2, Dr/2)


def apply_rope(x: Tensor, table: Tensor) -> Tensor:
    """Rotate-half rotary embedding. x (B, T, H, D), table (T, 2, Dr/2) fp32: the first Dr features of each head are
    rotated, the rest pass through (partial rotary)."""
    rotated = 2 * table.shape[-1]
    if rotated < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rotated], table), x[..., rotated:]], dim=-1)
    cos = table[:, 0].unsqueeze(1)  # (T, 1, D/2)
    sin = table[:, 1].unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, T, H, D/2) each
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.type_as(x)
