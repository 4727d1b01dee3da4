"""Quantization (int8 and int4 weight-only, fp8 weights and activations): a CLI that writes a new checkpoint, the
module swap, the loader's structure.

python quantize.py --checkpoint_path IN --mode int8|int4|fp8 [--groupsize 32|64|128|256] [--out FILE]

Quantizing on load (`LLM.load(path, quantize=...)`, generate.py's --quantize and --draft_quantize) takes "int8",
"int4", "int4-gG" (G the group size) or "fp8"; plain "int4" picks the group size by auto_group_size.

Scheme "int8": every linear layer's weight becomes int8 with one fp32 scale per output channel
(symmetric, scale = max|w| / 127).
Scheme "int4": asymmetric 4-bit in groups of `group_size` consecutive inputs: w = scale * q + offset, q in 0..15,
one (scale, offset) pair per (output row, group), both fp16. fp16 holds GGUF's fp16 block scales and mins
exactly (so Q4_0/Q4_1 files load with no loss), has 3 more mantissa bits than bf16, and costs half of fp32's bytes.
Layout INT4_LAYOUT: `weight` is uint8 (N, K/2), input k of a row in byte k // 2, the even k in the low nibble, so
each 32-bit word holds 8 consecutive inputs (the GPU kernel reads one word per 8 weights); `scales` is fp16
(N, K/group_size, 2) holding [scale, offset] side by side (one 32-bit load per group).
The token embedding stays in the checkpoint's float dtype, and so does the output projection when it is tied to the
embedding. The checkpoint's metadata says all of this.
A mixture of experts (Mixtral, Qwen3-MoE) quantizes its stacked experts too: int8 with one fp32 scale per expert and
output row (Int8MoEFeedForward), int4 with each expert's rows in the layout above (Int4MoEFeedForward: w13 and w2
uint8 (E, N, K/2), their scales fp16 (E, N, K/group_size, 2)); its routers stay float.
"""
from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from redline.checkpoint import (CheckpointInfo, check_checkpoint_output, checkpoint_inputs, load_tensors, meta_model,
                                model_state_dict, read_checkpoint_info, resolve_checkpoint_path, run_cli, save_checkpoint)
from redline.model import ModelArgs, MoEFeedForward, Transformer
from redline.tokenizer import copy_tokenizer_files, tokenizer_files_to_copy
from redline.vision import check_vision_copy, copy_vision_file

QUANT_MODES = ("int8", "int4", "fp8")
INT8_MAX = 127
# FP8 weights and activations: OCP e4m3 ("fn": no infinities, largest finite value 448); casting past it gives NaN,
# so values are clamped first. Block-scaled weights use the Hub's 128 x 128 blocks (the only block size taken).
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_BLOCK = 128
INT4_MAX = 15
# The int4 group size when none is given and it divides every layer's inputs: the common choice of gpt-fast, torchao
# and GPTQ checkpoints (auto_group_size goes down from it).
DEFAULT_GROUP_SIZE = 128
# The smallest int4 group: the GPU kernel takes 32 inputs (four 32-bit words) of a row under one (scale, offset).
MIN_GROUP_SIZE = 32
# The name of the packed int4 layout described above; the metadata records it so that a later layout cannot be misread.
INT4_LAYOUT = "k-pairs-low-nibble-first/scale-offset-fp16/v1"
# Which weights are quantized: every projection inside the blocks, plus the untied output head.
QUANTIZED_LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")


class Int8Linear(nn.Module):
    """y = (x @ W_int8^T) * scales in plain PyTorch (kernels.use_kernels swaps in the GPU kernel's version)."""

    def __init__(self, in_features: int, out_features: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))  # (N, K)
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.float32, device=device))  # (N,)

    def forward(self, x: Tensor) -> Tensor:
        # The product is rounded to x.dtype, then scaled in fp32 and rounded once more (as the GPU kernels' cuBLAS
        # path for long prompts does).
        return (F.linear(x, self.weight.to(x.dtype)) * self.scales).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def fp8_block_scales_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """The (ceil(N/128), ceil(K/128)) shape of a block-scaled FP8 weight's scales."""
    return -(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK)


class Fp8Linear(nn.Module):
    """W8A8 FP8: weight float8_e4m3fn (N, K), scales fp32 (N,) per output channel or (ceil(N/128), ceil(K/128)) per
    128 x 128 block; the forward is fp8_linear_reference in plain PyTorch (kernels.use_kernels swaps in the GPU op)."""

    def __init__(self, in_features: int, out_features: int, block_scales: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.block_scales = block_scales
        shape = fp8_block_scales_shape(out_features, in_features) if block_scales else (out_features,)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device))  # (N, K)
        self.register_buffer("scales", torch.empty(shape, dtype=torch.float32, device=device))  # (N,) or (N/128, K/128)

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear_reference(x, self.weight, self.scales)

    def extra_repr(self) -> str:
        scales = "128x128 blocks" if self.block_scales else "per-channel"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 {scales}"


def quantize_fp8(weight: Tensor, block_scales: bool = False) -> tuple[Tensor, Tensor]:
    """weight (N, K) float -> (float8_e4m3fn (N, K), fp32 scales): scale = max|w| / 448 per output channel (N,), or per
    128 x 128 block (ceil(N/128), ceil(K/128)) with block_scales; w / scale rounds to the nearest e4m3 value."""
    w = weight.float()
    n, k = w.shape
    if not block_scales:
        scales = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # (N,)
        return (w / scales.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales
    bn, bk = fp8_block_scales_shape(n, k)
    padded = F.pad(w, (0, bk * FP8_BLOCK - k, 0, bn * FP8_BLOCK - n)).view(bn, FP8_BLOCK, bk, FP8_BLOCK)
    scales = (padded.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # (N/128, K/128)
    return (w / expand_block_scales(scales, n, k)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def expand_block_scales(scales: Tensor, n: int, k: int) -> Tensor:
    """(ceil(N/128), ceil(K/128)) block scales -> the (N, K) fp32 scale of every weight."""
    return scales.float().repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]


def dequantize_fp8(weight: Tensor, scales: Tensor) -> Tensor:
    """float8_e4m3fn (N, K) and its scales ((N,) or 128 x 128 blocks) -> the fp32 (N, K) weight (exact products)."""
    if scales.dim() == 1:
        return weight.float() * scales.float().unsqueeze(1)
    return weight.float() * expand_block_scales(scales, *weight.shape)


def quantize_activations_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token dynamic quantization: x (..., K) float -> (float8_e4m3fn (..., K), fp32 scales (..., 1)), one
    scale = max|x_row| / 448 per row (an all-zero row gets the smallest normal scale and stays zero)."""
    xf = x.float()
    scales = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # (..., 1)
    return (xf / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def fp8_linear_reference(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """The W8A8 product in fp32, returned in x.dtype: x (..., K) quantized per token when it has two or more rows (a
    single row is used as it is), times the dequantized FP8 weight (N, K)."""
    xf = x.float()
    if x.numel() != x.shape[-1]:
        codes, row_scales = quantize_activations_fp8(x)
        xf = codes.float() * row_scales
    return F.linear(xf, dequantize_fp8(weight, scales)).to(x.dtype)


class Int8MoEFeedForward(MoEFeedForward):
    """model.MoEFeedForward with int8 experts: w13 (E, 2I, dim) and w2 (E, dim, I) int8, one fp32 scale per expert and
    output row (w13_scales (E, 2I), w2_scales (E, dim)); the experts that run are dequantized to the router's dtype (the
    activations'). The router stays a float linear."""

    def __init__(self, args: ModelArgs, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        with torch.device("meta"):
            super().__init__(args)
        n, hidden, dim = args.n_experts, args.moe_intermediate_size, args.dim
        self.gate = nn.Linear(dim, n, bias=False, device=device, dtype=dtype)  # the router, in the activations' dtype
        del self.w13, self.w2
        for name, shape in (("w13", (n, 2 * hidden, dim)), ("w2", (n, dim, hidden))):
            self.register_buffer(name, torch.empty(shape, dtype=torch.int8, device=device))  # (E, N, K)
            self.register_buffer(f"{name}_scales", torch.empty(shape[:2], dtype=torch.float32, device=device))  # (E, N)

    def expert_weights(self, ids: Tensor | int) -> tuple[Tensor, Tensor]:
        dtype = self.gate.weight.dtype
        return tuple((getattr(self, name)[ids].float() * getattr(self, f"{name}_scales")[ids].unsqueeze(-1)).to(dtype)
                     for name in ("w13", "w2"))  # (..., N, K) each


def quantize_experts_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Stacked experts (E, N, K) float -> (int8 (E, N, K), fp32 scales (E, N)): quantize_int8 per expert and row."""
    q, scales = quantize_int8(weight.reshape(-1, weight.shape[-1]))
    return q.view(weight.shape), scales.view(weight.shape[:2])


class Int4MoEFeedForward(MoEFeedForward):
    """model.MoEFeedForward with int4 experts: each expert's w13 (2I, dim) and w2 (dim, I) in Int4Linear's layout,
    stacked: w13 uint8 (E, 2I, dim/2) with w13_scales fp16 (E, 2I, dim/G, 2), w2 uint8 (E, dim, I/2) with w2_scales
    fp16 (E, dim, I/G, 2); the experts that run are dequantized (in fp32, rounded to the router's dtype). The router
    stays a float linear."""

    def __init__(self, args: ModelArgs, group_size: int, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        with torch.device("meta"):
            super().__init__(args)
        n, hidden, dim = args.n_experts, args.moe_intermediate_size, args.dim
        for k in (dim, hidden):
            check_group_size(group_size, k)
        self.group_size = group_size
        self.gate = nn.Linear(dim, n, bias=False, device=device, dtype=dtype)  # the router, in the activations' dtype
        del self.w13, self.w2
        for name, (rows, k) in (("w13", (2 * hidden, dim)), ("w2", (dim, hidden))):
            self.register_buffer(name, torch.empty(n, rows, k // 2, dtype=torch.uint8, device=device))  # (E, N, K/2)
            self.register_buffer(f"{name}_scales", torch.empty(n, rows, k // group_size, 2, dtype=torch.float16,
                                                               device=device))  # (E, N, K/G, 2)

    def expert_weights(self, ids: Tensor | int) -> tuple[Tensor, Tensor]:
        dtype = self.gate.weight.dtype
        return tuple(dequantize_experts_int4(getattr(self, name)[ids], getattr(self, f"{name}_scales")[ids]).to(dtype)
                     for name in ("w13", "w2"))  # (..., N, K) each


def quantize_experts_int4(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Stacked experts (E, N, K) float -> (uint8 (E, N, K/2), fp16 (E, N, K/G, 2)): quantize_int4 per expert row."""
    packed, scales = quantize_int4(weight.reshape(-1, weight.shape[-1]), group_size)
    return packed.view(*weight.shape[:2], -1), scales.view(*weight.shape[:2], *scales.shape[1:])


def dequantize_experts_int4(packed: Tensor, scales: Tensor) -> Tensor:
    """uint8 (..., N, K/2) and fp16 (..., N, K/G, 2) -> the fp32 (..., N, K) weights (dequantize_int4 per row)."""
    front = packed.shape[:-1]
    return dequantize_int4(packed.reshape(-1, packed.shape[-1]), scales.reshape(-1, *scales.shape[-2:])).view(
        *front, -1)


def sparse_layers(args: ModelArgs) -> tuple[bool, ...]:
    """Per layer, whether it holds experts."""
    return tuple(args.sparse(i) for i in range(args.n_layer))


class Int4Linear(nn.Module):
    """y = x @ dequantize_int4(weight, scales).T in plain PyTorch (kernels.use_kernels swaps in the GPU kernel's
    version). weight: uint8 (N, K/2) packed nibbles; scales: fp16 (N, K/group_size, 2) [scale, offset]."""

    def __init__(self, in_features: int, out_features: int, group_size: int = DEFAULT_GROUP_SIZE,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        check_group_size(group_size, in_features)
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8,
                                                   device=device))  # (N, K/2)
        self.register_buffer("scales", torch.empty(out_features, in_features // group_size, 2, dtype=torch.float16,
                                                   device=device))  # (N, K/G, 2)

    def forward(self, x: Tensor) -> Tensor:
        # The weight is dequantized in fp32 and rounded to x.dtype (as the GPU path for long prompts does).
        return F.linear(x, dequantize_int4(self.weight, self.scales).to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group_size={self.group_size}"


def check_group_size(group_size: int, in_features: int) -> None:
    """A clean error unless group_size is a power of two >= MIN_GROUP_SIZE that divides in_features."""
    if not isinstance(group_size, int) or group_size < MIN_GROUP_SIZE or group_size & (group_size - 1):
        raise ValueError(f"int4 group size must be a power of two of at least {MIN_GROUP_SIZE} (32, 64, 128, 256), "
                         f"got {group_size!r}")
    if in_features % group_size:
        raise ValueError(f"int4 group size {group_size} does not divide a layer's {in_features} inputs; "
                         f"choose a smaller group size")


def auto_group_size(in_features: Iterable[int]) -> int:
    """The largest power of two from DEFAULT_GROUP_SIZE down to MIN_GROUP_SIZE that divides every layer's inputs
    (128 for Llama-2/3; 64 for SmolLM2-135M, whose 576 features 128 does not divide)."""
    sizes = sorted(set(in_features))
    group_size = DEFAULT_GROUP_SIZE
    while group_size >= MIN_GROUP_SIZE:
        if all(k % group_size == 0 for k in sizes):
            return group_size
        group_size //= 2
    raise ValueError(f"no int4 group size of at least {MIN_GROUP_SIZE} divides every layer's inputs {sizes}; "
                     f"use int8 for this model")


def model_input_features(args: ModelArgs) -> list[int]:
    """The input features of the quantized linears: dim (wqkv, w13, an untied head), q_size (wo), intermediate (w2),
    and the experts' intermediate size (their w2) in a mixture of experts."""
    dense = any(not args.sparse(i) for i in range(args.n_layer))
    return [args.dim, args.q_size] + ([args.intermediate_size] if dense else []) + (
        [args.moe_intermediate_size] if args.n_experts else [])


def parse_quant_spec(spec: str) -> tuple[str, int | None]:
    """A quantize-on-load spec: "int8" -> ("int8", None), "int4" -> ("int4", None) (group size chosen per model),
    "int4-g64" -> ("int4", 64). Anything else is a one-line error."""
    mode, _, group = spec.partition("-g") if isinstance(spec, str) else ("", "", "")
    if mode not in QUANT_MODES or (group and (mode != "int4" or not group.isdigit())) or spec.endswith("-g"):
        raise ValueError(f"unknown quantization {spec!r}; choose int8, int4, fp8 or int4-gG with G a group size "
                         f"(int4-g32, int4-g64, int4-g128, int4-g256)")
    if not group:
        return mode, None
    check_group_size(int(group), int(group))
    return mode, int(group)


def pack_int4(q: Tensor) -> Tensor:
    """(N, K) codes 0..15 -> uint8 (N, K/2): input 2i in the low nibble of byte i, 2i + 1 in the high one."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 (N, K/2) -> uint8 codes (N, K), the inverse of pack_int4."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(packed: Tensor, scales: Tensor) -> Tensor:
    """The fp32 (N, K) matrix scale * q + offset (computed in fp32: one exact product, one rounded add)."""
    n, groups = scales.shape[0], scales.shape[1]
    q = unpack_int4(packed).view(n, groups, -1).float()  # (N, K/G, G)
    s = scales.float()  # (N, K/G, 2)
    return (q * s[..., :1] + s[..., 1:]).view(n, -1)


def quantize_int4(weight: Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> tuple[Tensor, Tensor]:
    """Asymmetric group-wise int4 (min/max per group). weight (N, K) float -> (uint8 (N, K/2), fp16 (N, K/G, 2)).
    The codes are rounded against the fp16-rounded scale and offset, the values the kernels use."""
    n, k = weight.shape
    check_group_size(group_size, k)
    w = weight.float().view(n, k // group_size, group_size)  # (N, K/G, G)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # (N, K/G)
    scale = ((hi - lo) / INT4_MAX).to(torch.float16)
    offset = lo.to(torch.float16)
    if not (torch.isfinite(scale).all() and torch.isfinite(offset).all()):
        raise ValueError("a weight group's range exceeds fp16 (|w| > 65504); this checkpoint cannot be int4-quantized")
    s = scale.float().unsqueeze(-1)
    q = torch.where(s > 0, torch.round((w - offset.float().unsqueeze(-1)) / s.clamp(min=torch.finfo(torch.float32).tiny)),
                    torch.zeros_like(w))
    q = q.clamp(0, INT4_MAX).view(n, k)
    return pack_int4(q), torch.stack((scale, offset), dim=-1)


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8. weight (N, K) float -> (int8 (N, K), fp32 scales (N,))."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # (N,)
    q = torch.round(w / scales.unsqueeze(1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def quantization_metadata(mode: str, tie_word_embeddings: bool, group_size: int | None = None) -> dict[str, Any]:
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; choose one of: {', '.join(QUANT_MODES)}")
    kept = ["tok_embeddings"] + (["output (tied to tok_embeddings)"] if tie_word_embeddings else [])
    if mode in ("int8", "fp8") and group_size is not None:
        raise ValueError(f"{mode} is per output channel; --groupsize applies to int4 only")
    if mode == "int8":
        return {"scheme": mode, "granularity": "per-output-channel", "scale_dtype": "float32", "not_quantized": kept}
    if mode == "fp8":
        return fp8_metadata(block_scales=False, not_quantized=kept)
    group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    check_group_size(group_size, group_size)
    return {"scheme": mode, "granularity": "per-group", "group_size": group_size, "layout": INT4_LAYOUT,
            "zero_point": "offset (w = scale * q + offset, q in 0..15)", "scale_dtype": "float16",
            "not_quantized": kept}


def fp8_metadata(block_scales: bool, not_quantized: list[str]) -> dict[str, Any]:
    """The metadata of an FP8 checkpoint: per-output-channel (quantize.py) or 128 x 128 block weight scales (the
    Hub's block-wise checkpoints, scripts/convert_hf_checkpoint.py)."""
    granularity = {"granularity": "block", "block_size": [FP8_BLOCK, FP8_BLOCK]} if block_scales else {
        "granularity": "per-output-channel"}
    return {"scheme": "fp8", "format": "float8_e4m3fn", **granularity, "scale_dtype": "float32",
            "activations": "dynamic per-token e4m3 for two or more rows; one row unquantized",
            "not_quantized": not_quantized}


def quantized_linear_names(n_layer: int, tie_word_embeddings: bool, sparse: tuple[bool, ...] = ()) -> list[str]:
    """The quantized linears; `sparse` (per layer) marks the layers whose feed-forward is experts, not linears."""
    names = [f"layers.{i}.{part}" for i in range(n_layer) for part in QUANTIZED_LINEARS
             if not (sparse and sparse[i] and part.startswith("feed_forward."))]
    return names if tie_word_embeddings else names + ["output"]


def quantize_state_dict(tensors: dict[str, Tensor], n_layer: int, tie_word_embeddings: bool, mode: str = "int8",
                        group_size: int = DEFAULT_GROUP_SIZE, sparse: tuple[bool, ...] = ()) -> dict[str, Tensor]:
    from redline.checkpoint import progress

    out = dict(tensors)
    experts = [f"layers.{i}.feed_forward.{part}" for i, s in enumerate(sparse) if s for part in ("w13", "w2")]
    names = quantized_linear_names(n_layer, tie_word_embeddings, sparse)
    if mode == "int4":
        for name in names:  # every layer checked before any work
            check_group_size(group_size, out[f"{name}.weight"].shape[1])
        for name in experts:
            check_group_size(group_size, out[name].shape[-1])
    for name in experts:
        if mode == "int4":
            out[name], out[f"{name}_scales"] = quantize_experts_int4(out.pop(name), group_size)
        else:
            out[name], out[f"{name}_scales"] = quantize_experts_int8(out.pop(name))
    if mode == "fp8" and experts:
        raise ValueError(FP8_EXPERTS_REFUSAL)
    for name in progress(names, len(names), "quantizing"):
        weight = out.pop(f"{name}.weight")
        if mode == "fp8":
            out[f"{name}.weight"], out[f"{name}.scales"] = quantize_fp8(weight)
        elif mode == "int4":
            out[f"{name}.weight"], out[f"{name}.scales"] = quantize_int4(weight, group_size)
        else:
            out[f"{name}.weight"], out[f"{name}.scales"] = quantize_int8(weight)
    return out


# Mixtures of experts have no FP8 path yet: their experts would need FP8 grouped kernels.
FP8_EXPERTS_REFUSAL = "fp8 does not quantize mixture-of-experts models yet; use int8 or int4"


def _swap_linears(model: nn.Module, build: Any, float_head: bool = False) -> None:
    """Replace each quantized linear by build(linear); float_head keeps an untied output head as it is."""
    tied = model.args.tie_word_embeddings
    for name in quantized_linear_names(model.args.n_layer, tied or float_head, sparse_layers(model.args)):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, build(getattr(parent, child)))


def prepare_quantized_structure(model: nn.Module, quantization: dict[str, Any]) -> None:
    """Give a (meta-device) model the module structure that a checkpoint's quantization needs."""
    scheme = quantization.get("scheme", "none")
    if scheme == "none":
        return
    if scheme == "int4":
        if quantization.get("layout") != INT4_LAYOUT:
            raise ValueError(f"checkpoint uses int4 layout {quantization.get('layout')!r}, which this Redline cannot "
                             f"load ({INT4_LAYOUT}); upgrade Redline or re-quantize")
        group_size = quantization.get("group_size")
        float_head = any(kept.startswith("output") for kept in quantization.get("not_quantized", []))
        _swap_linears(model, lambda lin: Int4Linear(lin.in_features, lin.out_features, group_size,
                                                    device=lin.weight.device), float_head)
        _swap_experts(model, lambda ffn: Int4MoEFeedForward(model.args, group_size, ffn.gate.weight.device,
                                                            ffn.gate.weight.dtype))
        return
    if scheme == "fp8":
        _prepare_fp8_structure(model, quantization)
        return
    if scheme != "int8":
        raise ValueError(f"checkpoint uses quantization {scheme!r}, which this Redline cannot load; upgrade Redline")
    _swap_linears(model, lambda lin: Int8Linear(lin.in_features, lin.out_features, device=lin.weight.device))
    _swap_experts(model, lambda ffn: Int8MoEFeedForward(model.args, ffn.gate.weight.device, ffn.gate.weight.dtype))


def _prepare_fp8_structure(model: nn.Module, quantization: dict[str, Any]) -> None:
    """Fp8Linear modules of the checkpoint's granularity (an output head listed as not quantized stays float)."""
    granularity = quantization.get("granularity")
    if granularity not in ("per-output-channel", "block") or (
            granularity == "block" and quantization.get("block_size") != [FP8_BLOCK, FP8_BLOCK]):
        raise ValueError(f"checkpoint uses fp8 scales {granularity!r} {quantization.get('block_size', '')}, which this "
                         f"Redline cannot load (per-output-channel, or block {[FP8_BLOCK, FP8_BLOCK]}); re-convert it")
    if any(sparse_layers(model.args)):
        raise ValueError(FP8_EXPERTS_REFUSAL)
    float_head = any(kept.startswith("output") for kept in quantization.get("not_quantized", []))
    _swap_linears(model, lambda lin: Fp8Linear(lin.in_features, lin.out_features, granularity == "block",
                                               device=lin.weight.device), float_head)


def _swap_experts(model: nn.Module, build: Any) -> None:
    """Replace each layer's MoEFeedForward by build(it)."""
    for layer in model.layers:
        if isinstance(layer.feed_forward, MoEFeedForward):
            layer.feed_forward = build(layer.feed_forward)


def model_quantization(model: nn.Module) -> str:
    """The scheme the model runs in now: "int8" or "int4" once quantized (from its checkpoint or in memory),
    else "none"."""
    for module in model.modules():
        if isinstance(module, Int8Linear):
            return "int8"
        if isinstance(module, Int4Linear):
            return "int4"
        if isinstance(module, Fp8Linear):
            return "fp8"
    return "none"


@torch.no_grad()
def quantize_(model: nn.Module, mode: str, group_size: int | None = None) -> nn.Module:
    """Quantize a loaded model in place (used by `LLM.load(path, quantize="int8" | "int4" | "int4-gG" | "fp8")`);
    group_size: int4 only, auto_group_size of the model's layers when None. Every layer is checked before any is
    changed."""
    quantization_metadata(mode, model.args.tie_word_embeddings, group_size)  # validates the mode and group size
    if model_quantization(model) != "none":
        raise ValueError("the model is already quantized; load the unquantized checkpoint to quantize it")
    names = quantized_linear_names(model.args.n_layer, model.args.tie_word_embeddings, sparse_layers(model.args))
    if mode == "fp8" and model.args.n_experts:
        raise ValueError(FP8_EXPERTS_REFUSAL)
    if mode == "int4":
        inputs = [model.get_submodule(name).in_features for name in names]
        inputs += [model.args.dim, model.args.moe_intermediate_size] if model.args.n_experts else []
        group_size = auto_group_size(inputs) if group_size is None else group_size
        for k in inputs:
            check_group_size(group_size, k)

    def build(lin: nn.Linear) -> nn.Module:
        if mode == "fp8":
            q = Fp8Linear(lin.in_features, lin.out_features, device=lin.weight.device)
            q.weight, q.scales = quantize_fp8(lin.weight)
            return q
        if mode == "int4":
            q = Int4Linear(lin.in_features, lin.out_features, group_size, device=lin.weight.device)
            q.weight, q.scales = quantize_int4(lin.weight, group_size)
            return q
        q = Int8Linear(lin.in_features, lin.out_features, device=lin.weight.device)
        q.weight, q.scales = quantize_int8(lin.weight)
        return q

    def build_experts(ffn: MoEFeedForward) -> MoEFeedForward:
        if mode == "int4":
            q = Int4MoEFeedForward(model.args, group_size, device=ffn.gate.weight.device)
            q.gate = ffn.gate
            q.w13, q.w13_scales = quantize_experts_int4(ffn.w13, group_size)
            q.w2, q.w2_scales = quantize_experts_int4(ffn.w2, group_size)
            return q
        q = Int8MoEFeedForward(model.args, device=ffn.gate.weight.device)
        q.gate = ffn.gate
        q.w13, q.w13_scales = quantize_experts_int8(ffn.w13)
        q.w2, q.w2_scales = quantize_experts_int8(ffn.w2)
        return q

    _swap_linears(model, build)
    _swap_experts(model, build_experts)
    return model


def load_model(info: CheckpointInfo, device: torch.device | str, dtype: torch.dtype | None = None) -> Transformer:
    """Build the model that the checkpoint describes, with its quantization's module structure, and load its
    weights (no extra copies, no guessing)."""
    dtype = dtype or info.dtype
    model = meta_model(info.args)
    prepare_quantized_structure(model, info.quantization)
    tensors = load_tensors(info, device)
    own = model_state_dict(model)
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"{info.path} does not match its own config: missing {missing[:3]}, unexpected {unexpected[:3]}; re-convert it"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(f"{info.path}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}")
        if tensor.is_floating_point() and tensor.dtype != FP8_DTYPE and not name.endswith((".scales", "_scales")):
            tensors[name] = tensor.to(dtype)
    model.load_state_dict(tensors, strict=False, assign=True)
    if info.args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.rope = torch.empty(0, device=device)
    model.rope_local = torch.empty(0, device=device)
    return model.eval()


@dataclass(frozen=True)
class QuantizeArgs:
    checkpoint_path: Path
    mode: str
    out: Path | None
    group_size: int | None = None  # int4 only
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.mode not in QUANT_MODES:
            raise ValueError(f"unknown --mode {self.mode!r}; choose one of: {', '.join(QUANT_MODES)}")
        if self.group_size is not None and self.mode != "int4":
            raise ValueError("--groupsize applies to --mode int4 only; drop it")
        if self.group_size is not None:
            check_group_size(self.group_size, self.group_size)


def default_quantized_path(path: Path, suffix: str) -> Path:
    """NAME.MODE.safetensors beside the input (the whole name, so that two inputs never share an output)."""
    return path.with_name(f"{path.name.removesuffix('.safetensors')}.{suffix}.safetensors")


def quantize_checkpoint(checkpoint_path: str | Path, mode: str, out: str | Path | None = None,
                        group_size: int | None = None, overwrite: bool = False) -> Path:
    """Write a quantized copy of an unquantized checkpoint; the input is never overwritten, an earlier quantized
    file only with `overwrite`. The tokenizer files to copy beside an --out elsewhere are checked first too."""
    info = read_checkpoint_info(checkpoint_path)
    if info.scheme != "none":
        raise ValueError(f"{info.path} is already quantized ({info.scheme}); quantize the unquantized checkpoint")
    if mode == "int4" and group_size is None:
        group_size = auto_group_size(model_input_features(info.args))
    quantization = quantization_metadata(mode, info.args.tie_word_embeddings, group_size)
    if info.args.n_experts and mode == "fp8":
        raise ValueError(FP8_EXPERTS_REFUSAL)
    if info.args.n_experts:
        quantization["experts"] = ("int8, one fp32 scale per expert and output row (w13_scales, w2_scales)"
                                   if mode == "int8" else "int4, each expert's rows in the int4 layout (w13_scales, "
                                   "w2_scales: (E, N, K/group_size, 2))")
        quantization["not_quantized"].append("feed_forward.gate (the expert routers)")
    suffix = f"int4-g{quantization['group_size']}" if mode == "int4" else mode
    out_path = Path(out) if out is not None else default_quantized_path(info.path, suffix)
    check_checkpoint_output(out_path, checkpoint_inputs(info.path), overwrite)
    tower = check_vision_copy(info.path, out_path, overwrite)  # a multimodal checkpoint's tower goes along
    tokenizer_files_to_copy(info.path.parent, out_path.parent, overwrite, [info.path])
    tensors = quantize_state_dict(load_tensors(info), info.args.n_layer, info.args.tie_word_embeddings, mode,
                                  quantization.get("group_size", DEFAULT_GROUP_SIZE), sparse_layers(info.args))
    new_info = CheckpointInfo(path=out_path, args=info.args, dtype=info.dtype, quantization=quantization)
    path = save_checkpoint(out_path, tensors, new_info)
    if tower is not None:
        copy_vision_file(info.path, out_path)
    return path


def parse_args(argv: list[str] | None) -> QuantizeArgs:
    from redline.checkpoint import OneLineArgumentParser

    parser = OneLineArgumentParser(description="Write a quantized copy of a Redline checkpoint (int8 and int4 weight-only, "
                                               "fp8 weights and activations).")
    parser.add_argument("--checkpoint_path", type=Path, required=True, help="Redline checkpoint file or its folder")
    parser.add_argument("--mode", required=True, help=f"quantization mode: {', '.join(QUANT_MODES)}")
    parser.add_argument("--groupsize", type=int, default=None,
                        help=f"int4: inputs per (scale, offset) group, a power of two >= 32; None means the largest "
                             f"up to {DEFAULT_GROUP_SIZE} that divides every layer's inputs")
    parser.add_argument("--out", type=Path, default=None,
                        help="output file; None means beside the input, NAME.MODE.safetensors")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier Redline checkpoint at the output (and different tokenizer files beside it)")
    ns = parser.parse_args(argv)
    return QuantizeArgs(checkpoint_path=ns.checkpoint_path, mode=ns.mode, out=ns.out, group_size=ns.groupsize,
                        overwrite=ns.overwrite)


def main(argv: list[str] | None = None) -> int:
    def body() -> int:
        cfg = parse_args(argv)
        source = resolve_checkpoint_path(cfg.checkpoint_path)
        before = source.stat().st_size
        path = quantize_checkpoint(source, cfg.mode, cfg.out, cfg.group_size, cfg.overwrite)
        copy_tokenizer_files(source.parent, path.parent, cfg.overwrite, [source])
        after = path.stat().st_size
        print(f"{path}\nsize: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB ({after / before:.1%})")
        return 0

    return run_cli(body, interrupted="interrupted; nothing was written")


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.quantize import main as package_main

    sys.exit(package_main())
