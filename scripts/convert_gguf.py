"""Convert a GGUF file (llama.cpp, Ollama) of a supported model into one Redline .safetensors file (architectures
llama (Mixtral's too), qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3, olmo2, granite),
with its tokenizer, chat template and generation config written beside it.

python scripts/convert_gguf.py --gguf FILE.gguf [--out FILE] [--dtype bfloat16|float16|float32] [--dequantize]
                               [--overwrite]

Quantized tensors are read as (codes, scales, mins) blocks first. By default, when the projections inside the
blocks are Q4_0/Q4_1, the checkpoint is int4 with group size 32 and no loss (quantize.py's layout): GGUF's 32-value
blocks are Redline's groups, Q4_1's d * q + m keeps scale d and offset m, Q4_0's d * (q - 8) becomes scale d and
offset -8d (both fp16, exactly). An output head of another type (llama.cpp writes Q6_K there) stays float; a
projection of another type is quantized to int4 g32 from its dequantized values (the metadata lists those).
Everything else, and every tensor with --dequantize, is dequantized to --dtype; so is every tensor of a mixture of
experts (its Q4 blocks are not kept as int4 experts yet: quantize.py --mode int4 or int8 quantizes the converted file).
"""
from __future__ import annotations


import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from redline.checkpoint import (CheckpointInfo, OneLineArgumentParser, check_checkpoint_output, check_layer_count,
                                dtype_from_name, model_shapes, progress, run_cli, save_checkpoint)
from redline.model import ModelArgs, RopeScaling
from redline.outputs import side_files_to_write
from redline.scripts import gguf_metadata
from redline.scripts.gguf_tokenizer import tokenizer_files, write_tokenizer_files
from redline.tokenizer import TOKENIZER_SIDE_FILES

# Block sizes (values per block) and bytes per block of the types whose blocks this file unpacks itself.
BLOCK_VALUES = 32
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
# Types read through gguf's own dequantizer (plain floats and the K-quants).
GGUF_DEQUANTIZED = ("F32", "F16", "BF16", "Q4_K", "Q6_K")
SUPPORTED_TYPES = tuple(BLOCK_BYTES) + GGUF_DEQUANTIZED
TOP_LEVEL = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
             "output.weight": "output.weight"}
LAYER_PARTS = {
    "attn_q.weight": ("attention.wqkv.weight", 0),
    "attn_k.weight": ("attention.wqkv.weight", 1),
    "attn_v.weight": ("attention.wqkv.weight", 2),
    "attn_output.weight": ("attention.wo.weight", None),
    "ffn_gate.weight": ("feed_forward.w13.weight", 0),
    "ffn_up.weight": ("feed_forward.w13.weight", 1),
    "ffn_down.weight": ("feed_forward.w2.weight", None),
    "attn_norm.weight": ("attention_norm.weight", None),
    "ffn_norm.weight": ("ffn_norm.weight", None),
    "attn_q.bias": ("attention.wqkv_bias", 0),
    "attn_k.bias": ("attention.wqkv_bias", 1),
    "attn_v.bias": ("attention.wqkv_bias", 2),
    "attn_output.bias": ("attention.wo_bias", None),
    "attn_q_norm.weight": ("attention.q_norm.weight", None),
    "attn_k_norm.weight": ("attention.k_norm.weight", None),
    "post_attention_norm.weight": ("post_attention_norm.weight", None),
    "post_ffw_norm.weight": ("post_ffn_norm.weight", None),
    "attn_qkv.weight": ("attention.wqkv.weight", None),  # phi3: q, k and v fused
    # Mixture of experts: the router and the stacked experts, (E, I, dim) gate and up, (E, dim, I) down.
    "ffn_gate_inp.weight": ("feed_forward.gate.weight", None),
    "ffn_gate_exps.weight": ("feed_forward.w13", 0),
    "ffn_up_exps.weight": ("feed_forward.w13", 1),
    "ffn_down_exps.weight": ("feed_forward.w2", None),
}
# phi3 stores gate and up fused, gate first, under ffn_up.
PHI3_PARTS = {**LAYER_PARTS, "ffn_up.weight": ("feed_forward.w13.weight", None)}
FUSED_PARTS = {"attention.wqkv.weight": 3, "attention.wqkv_bias": 3, "feed_forward.w13.weight": 2,
               "feed_forward.w13": 2}
# llama.cpp stores Llama 3.1 rope scaling as per-frequency factors; these are the parameters Meta's models use.
LLAMA3_ROPE_CANDIDATES = ({"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},)
IGNORED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# The GGUF types whose blocks are Redline int4 groups as they are.
NATIVE_INT4_TYPES = ("Q4_0", "Q4_1")
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3", "olmo2", "granite")
# The architectures whose blocks may hold experts (llama: Mixtral).
MOE_ARCHITECTURES = ("llama", "qwen3moe")
# llama.cpp interleaves the rotary halves of q and k rows only for these; the others keep HF's layout.
PERMUTED_ROPE_ARCHITECTURES = ("llama", "granite")
# Gemma: the norms' stored weights are 1 + w (llama.cpp adds the 1), so they scale by w as stored, in fp32.
GEMMA_NORMS = dict(norm_offset=0.0, norm_scale_fp32=True, norm_placement="sandwich", activation="gelu_tanh")


@dataclass(frozen=True)
class GGUFConvertArgs:
    gguf: Path
    out: Path
    dtype: torch.dtype
    dequantize: bool = False
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.out.suffix != ".safetensors":
            raise ValueError(f"--out {self.out} must end with .safetensors")
        check_checkpoint_output(self.out, [self.gguf], self.overwrite)


@dataclass(frozen=True)
class QuantBlocks:
    """A block-quantized matrix split into its parts; value = scale * q (+ min), per block of 32 values."""

    qtype: str
    packed: np.ndarray  # (rows, blocks, 32) uint8 codes (Q4: 0..15; Q8_0: int8 stored as uint8)
    scales: np.ndarray  # (rows, blocks) float16
    mins: np.ndarray | None  # (rows, blocks) float16 for Q4_1, None otherwise


def read_gguf(path: Path) -> Any:
    """A GGUFReader for `path`; one-line errors for a missing, truncated or foreign file."""
    import gguf

    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist; download it first")
    try:  # every declared count bounded by the file's size, before the gguf reader loops over one
        gguf_metadata.check_header(path)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    try:
        with warnings.catch_warnings(), np.errstate(over="ignore"):  # a wrapped offset is reported below, in one line
            warnings.simplefilter("ignore", RuntimeWarning)
            reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, IndexError or struct errors on damaged files
        raise ValueError(f"{path} is truncated or not a GGUF file ({type(exc).__name__}: {exc}); re-download it") from None
    gguf_metadata.check_tensor_layout(reader, path)
    return reader


def field_value(reader: Any, key: str, default: Any = None) -> Any:
    return gguf_metadata.field(reader, key, default)


def model_args(reader: Any, rope_freqs: np.ndarray | None) -> ModelArgs:
    arch = architecture(reader)

    def get(key: str, default: Any = None) -> Any:
        value = field_value(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"the GGUF metadata lacks {arch}.{key}; the file is incomplete")
        return value

    n_head = int(get("attention.head_count"))
    dim = int(get("embedding_length"))
    # phi3's rope.dimension_count is its rotary width, not the head's.
    rotary = dim // n_head if arch == "phi3" else get("rope.dimension_count", dim // n_head)
    head_dim = int(field_value(reader, f"{arch}.attention.key_length", 0) or rotary)
    tensor_names = {t.name for t in reader.tensors}
    vocab = field_value(reader, f"{arch}.vocab_size") or len(field_value(reader, "tokenizer.ggml.tokens", []))
    scaling_type = field_value(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", None) and (arch, scaling_type) not in (("gemma3", "linear"), ("phi3", "longrope")):
        raise ValueError(f"unsupported rope scaling {scaling_type!r} in the GGUF metadata of a {arch!r} model")
    base = float(get("rope.freq_base", 10000.0))
    n_layer = int(get("block_count"))
    check_layer_count(tensor_names, n_layer, "the GGUF metadata")  # before anything loops over the declared layers
    deltas = family_deltas(reader, arch, get, dim=dim, n_head=n_head, head_dim=head_dim, n_layer=n_layer)
    deltas.update(expert_deltas(reader, arch, tensor_names, n_layer, int(get("feed_forward_length"))))
    # Biases are where the file has them (qwen2 always; attention_bias models of the other families).
    deltas.update(qkv_bias="blk.0.attn_q.bias" in tensor_names, o_bias="blk.0.attn_output.bias" in tensor_names)
    if rope_freqs is not None:
        if arch not in PERMUTED_ROPE_ARCHITECTURES:
            raise ValueError(f"the GGUF file of a {arch!r} model has a rope_freqs tensor, which Redline does not "
                             f"implement for it")
        deltas["rope_scaling"] = llama3_scaling(rope_freqs, base, head_dim)
    return ModelArgs(
        **deltas, dim=dim, n_layer=n_layer, n_head=n_head,
        n_kv_heads=int(get("attention.head_count_kv", n_head)), head_dim=head_dim,
        intermediate_size=int(get("feed_forward_length")), vocab_size=int(vocab),
        block_size=int(get("context_length", 2048)), rope_base=base,
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensor_names,
    )


def architecture(reader: Any) -> str:
    arch = field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; Redline converts {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def family_deltas(reader: Any, arch: str, get: Any, dim: int, n_head: int, head_dim: int,
                  n_layer: int) -> dict[str, Any]:
    """The ModelArgs fields in which the architecture differs from Llama, from its GGUF metadata (and llama.cpp's
    fixed choices where the metadata is silent: Gemma's layer patterns, local rope base and attention scale)."""
    key = lambda name, default=None: field_value(reader, f"{arch}.{name}", default)  # noqa: E731
    if arch == "llama":
        return {}
    if arch == "qwen2":  # q/k/v biases, read off the tensors; llama.cpp keeps no sliding window for qwen2
        return {}
    if arch in ("qwen3", "qwen3moe"):
        return dict(qk_norm="head")
    if arch == "olmo2":
        return dict(norm_placement="post", qk_norm="full", norm_scale_fp32=True)
    if arch == "granite":
        return dict(embedding_scale=float(key("embedding_scale", 1.0)),
                    residual_scale=float(key("residual_scale", 1.0)), attention_scale=float(key("attention.scale", 0.0)), logits_divisor=float(key("logit_scale", 1.0)))
    if arch == "phi3":
        return phi3_deltas(reader, key, head_dim, n_layer)
    # gemma2, gemma3: the 27B models scale attention by (dim / n_head) ** -0.5, the others by head_dim ** -0.5.
    big = n_layer == (46 if arch == "gemma2" else 62)
    deltas = dict(GEMMA_NORMS, embedding_scale=dim ** 0.5, attention_scale=float(key(
        "attention.scale", (dim // n_head if big else head_dim) ** -0.5)),
        layer_windows=gemma_windows(reader, arch, n_layer, int(get("attention.sliding_window"))),
        final_softcap=float(key("final_logit_softcapping", 0.0) or 0.0))
    if arch == "gemma2":
        return dict(deltas, attn_softcap=float(key("attn_logit_softcapping", 0.0) or 0.0))
    factor = key("rope.scaling.factor")
    return dict(deltas, qk_norm="head", local_rope_base=float(key("rope.freq_base_swa", 10000.0)),
                rope_scaling=RopeScaling(rope_type="linear", factor=float(factor)) if factor else None)


def expert_deltas(reader: Any, arch: str, tensor_names: set[str], n_layer: int, ffn: int) -> dict[str, Any]:
    """The mixture of experts from the metadata (expert_count and expert_used_count; the experts' width from
    expert_feed_forward_length, else feed_forward_length as Mixtral's files have it) and, per layer, whether the block
    holds a router. The renormalization is llama.cpp's fixed choice (always, unless expert_weights_norm says otherwise
    for qwen3moe); Qwen3-MoE rounds the weights to the activation dtype, Mixtral does not."""
    key = lambda name, default=None: field_value(reader, f"{arch}.{name}", default)  # noqa: E731
    n_experts = int(key("expert_count", 0) or 0)
    sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(n_layer))
    if not n_experts:
        if any(sparse):
            raise ValueError(f"the GGUF file has expert routers (ffn_gate_inp) but no {arch}.expert_count; it is "
                             f"incomplete")
        return {}
    if arch not in MOE_ARCHITECTURES:
        raise ValueError(f"the GGUF metadata of a {arch!r} model declares experts, which Redline does not implement "
                         f"for it (only {', '.join(MOE_ARCHITECTURES)})")
    if int(key("expert_gating_func", 1) or 1) != 1:
        raise ValueError(f"the GGUF file routes experts with {arch}.expert_gating_func {key('expert_gating_func')} "
                         f"(Redline implements the softmax, 1)")
    used = key("expert_used_count")
    if used is None:
        raise ValueError(f"the GGUF metadata lacks {arch}.expert_used_count; the file is incomplete")
    qwen = arch == "qwen3moe"
    return dict(n_experts=n_experts, n_experts_per_tok=int(used),
                moe_intermediate_size=int(key("expert_feed_forward_length", ffn)),
                norm_topk_prob=bool(key("expert_weights_norm", True)) if qwen else True,
                router_weights_rounded=qwen, moe_layers=() if all(sparse) else sparse)


def gemma_windows(reader: Any, arch: str, n_layer: int, window: int) -> tuple[int, ...]:
    """Gemma's per-layer windows: the file's sliding_window_pattern (every n-th layer global, or one flag per layer)
    when present, else llama.cpp's fixed pattern (every 2nd layer global for gemma2, every 6th for gemma3)."""
    pattern = field_value(reader, f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):
        if len(pattern) != n_layer:
            raise ValueError(f"{arch}.attention.sliding_window_pattern lists {len(pattern)} layers, not {n_layer}")
        return tuple(window if flag else 0 for flag in pattern)
    return tuple(0 if (i + 1) % int(pattern) == 0 else window for i in range(n_layer))


def phi3_deltas(reader: Any, key: Any, head_dim: int, n_layer: int) -> dict[str, Any]:
    """Partial rotary, LongRoPE from the rope_factors_short/long tensors, and the window on every layer."""
    rotary_dim = int(key("rope.dimension_count", head_dim))
    factors = {t.name: tensor_to_float(t).reshape(-1) for t in reader.tensors if t.name.startswith("rope_factors_")}
    deltas: dict[str, Any] = dict(rotary_dim=rotary_dim)
    if factors:
        if set(factors) != {"rope_factors_long.weight", "rope_factors_short.weight"}:
            raise ValueError("the GGUF file has only one of rope_factors_long and rope_factors_short; it is incomplete")
        deltas["rope_scaling"] = RopeScaling(
            rope_type="longrope", original_max_position_embeddings=int(key("rope.scaling.original_context_length")),
            attention_factor=float(key("rope.scaling.attn_factor", 1.0)),
            short_factor=tuple(factors["rope_factors_short.weight"].tolist()),
            long_factor=tuple(factors["rope_factors_long.weight"].tolist()))
    window = int(key("attention.sliding_window", 0) or 0)
    context = int(key("context_length", 0) or 0)
    if window and window < context:
        deltas["layer_windows"] = (window,) * n_layer
    return deltas


def llama3_scaling(rope_freqs: np.ndarray, base: float, head_dim: int) -> RopeScaling:
    """The Llama 3.1 rope scaling whose per-frequency factors equal the file's rope_freqs tensor."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(rope_freqs.max())
    for candidate in LLAMA3_ROPE_CANDIDATES:
        scaling = RopeScaling(factor=factor, **candidate)
        if np.allclose(llama3_factors(freqs, scaling), rope_freqs, rtol=1e-4):
            return scaling
    raise ValueError("the GGUF's rope_freqs tensor matches no known Llama 3 rope scaling; this model is unsupported")


def llama3_factors(freqs: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Per-frequency wavelength multipliers of Llama 3.1 scaling, as llama.cpp stores them."""
    wavelen = 2 * np.pi / freqs
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    mid = 1.0 / ((1 - smooth) / s.factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, s.factor, mid))


def split_blocks(data: np.ndarray, qtype: str, rows: int, cols: int) -> QuantBlocks:
    """The (packed, scales, mins) parts of a Q8_0/Q4_0/Q4_1 matrix stored as `data` (rows, bytes per row)."""
    if cols % BLOCK_VALUES:
        raise ValueError(f"a {qtype} row of {cols} values is not a whole number of {BLOCK_VALUES}-value blocks")
    blocks = data.reshape(rows, cols // BLOCK_VALUES, BLOCK_BYTES[qtype])  # (rows, blocks, bytes per block)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # (rows, blocks)
    if qtype == "Q8_0":
        return QuantBlocks(qtype, blocks[..., 2:].copy(), scales, None)
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0] if qtype == "Q4_1" else None
    nibbles = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]  # (rows, blocks, 16)
    packed = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # (rows, blocks, 32): low halves first
    return QuantBlocks(qtype, packed, scales, mins)


def dequantize_blocks(q: QuantBlocks) -> np.ndarray:
    """The float32 matrix (rows, cols) that `q` encodes."""
    scales = q.scales.astype(np.float32)[..., None]  # (rows, blocks, 1)
    if q.qtype == "Q8_0":
        values = q.packed.view(np.int8).astype(np.float32) * scales
    elif q.qtype == "Q4_0":
        values = (q.packed.astype(np.float32) - 8.0) * scales
    else:
        values = q.packed.astype(np.float32) * scales + q.mins.astype(np.float32)[..., None]
    return values.reshape(values.shape[0], -1)


def tensor_to_int4(t: Any) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_0/Q4_1 matrix as Redline int4 parts with group size 32: codes uint8 (rows, cols) in 0..15 and
    fp16 (rows, cols / 32, 2) [scale, offset], value = scale * q + offset exactly as gguf dequantizes it."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    rows = int(np.prod(shape[:-1]))
    q = split_blocks(np.asarray(t.data), t.tensor_type.name, rows, shape[-1])
    if q.mins is not None:
        offsets = q.mins
    else:
        with np.errstate(over="ignore"):
            offsets = (q.scales * np.float16(-8.0)).astype(np.float16)  # exact: a power-of-two multiple
        if not np.isfinite(offsets).all():
            raise ValueError(f"tensor {t.name} has a Q4_0 scale above 8188, whose offset -8d overflows fp16; "
                             f"convert with --dequantize")
    return q.packed.reshape(rows, shape[-1]), np.stack([q.scales, offsets], axis=-1)


def tensor_to_float(t: Any) -> np.ndarray:
    """A GGUF tensor as float32, shaped (rows, cols) as PyTorch orders it (GGUF lists dims innermost first)."""
    import gguf

    qtype = t.tensor_type.name
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"tensor {t.name} has GGUF type {qtype}, which Redline cannot read ({', '.join(SUPPORTED_TYPES)})")
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if qtype in BLOCK_BYTES:
        rows = int(np.prod(shape[:-1]))
        out = dequantize_blocks(split_blocks(np.asarray(t.data), qtype, rows, shape[-1]))
    else:
        out = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    return out.reshape(shape)


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order for attn_q/attn_k: it interleaves each head's two rotary halves, while HF
    (and Redline) keep them as two contiguous halves (rotate-half)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def native_int4_targets(reader: Any, args: ModelArgs) -> set[str]:
    """The Redline linear weights whose every GGUF source is Q4_0/Q4_1 (empty unless every projection inside the
    blocks has at least one such source, so that the checkpoint can be int4)."""
    from redline.quantize import quantized_linear_names

    kinds: dict[str, set[str]] = {}
    for t in reader.tensors:
        match = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if t.name == "output.weight":
            target = "output.weight"
        elif match and match.group(2) in LAYER_PARTS:
            target = f"layers.{match.group(1)}.{LAYER_PARTS[match.group(2)][0]}"
        else:
            continue
        kinds.setdefault(target, set()).add(t.tensor_type.name)
    native = {name for name, types in kinds.items() if types <= set(NATIVE_INT4_TYPES)}
    blocks = [f"{name}.weight" for name in quantized_linear_names(args.n_layer, True)]
    return native if any(name in native for name in blocks) else set()


def redline_tensors(reader: Any, args: ModelArgs, native: set[str] = frozenset()) -> dict[str, Any]:
    """Every GGUF tensor under its Redline name, q/k unpermuted (llama, granite), qkv and gate/up fused: float32
    tensors, and for the targets in `native` (codes, scales) int4 parts (tensor_to_int4)."""
    arch = architecture(reader)
    layer_parts = PHI3_PARTS if arch == "phi3" else LAYER_PARTS
    permuted = arch in PERMUTED_ROPE_ARCHITECTURES
    parts: dict[str, list[Any]] = {}
    out: dict[str, Any] = {}
    for t in progress(reader.tensors, len(reader.tensors), "converting"):
        if t.name in IGNORED_TENSORS:
            continue
        if t.name in TOP_LEVEL:
            target, index, local = TOP_LEVEL[t.name], None, t.name
        else:
            match = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
            if not match or match.group(2) not in layer_parts or int(match.group(1)) >= args.n_layer:
                raise ValueError(f"unexpected tensor {t.name} in the GGUF file; it is not a {arch} weight")
            local = match.group(2)
            name, index = layer_parts[local]
            target = f"layers.{match.group(1)}.{name}"
        check_gguf_shape(t, target, index, args)
        heads = args.n_head if local == "attn_q.weight" else args.n_kv_heads if local == "attn_k.weight" else 0
        heads = heads if permuted else 0
        if target in native:
            w = tuple(unpermute_rope_rows(a, heads) if heads else a for a in tensor_to_int4(t))
        else:
            w = tensor_to_float(t)
            w = unpermute_rope_rows(w, heads) if heads else w
        if index is None:
            out[target] = w if target in native else torch.from_numpy(np.array(w, dtype=np.float32))
        else:
            parts.setdefault(target, [None] * FUSED_PARTS[target.split(".", 2)[2]])[index] = w
        if index is None and target in parts or index is not None and target in out:
            raise ValueError(f"tensor {t.name} duplicates another tensor of the GGUF file ({target})")
    for target, pieces in parts.items():
        if any(p is None for p in pieces):
            raise ValueError(f"the GGUF file lacks part of {target}; the file is incomplete")
        if target in native:
            out[target] = tuple(np.concatenate([p[i] for p in pieces], axis=0) for i in range(2))
        else:  # stacked experts (E, rows, cols) join along their rows
            out[target] = torch.from_numpy(np.concatenate(pieces, axis=pieces[0].ndim - 2))
    if args.tie_word_embeddings:
        out.pop("output.weight", None)
    return out


def gguf_shape(target: str, index: int | None, args: ModelArgs) -> tuple[int, ...]:
    """The shape the metadata implies for the GGUF tensor that goes into the Redline tensor `target` (whole, or its
    index-th fused part along the rows: q, k or v; gate or up, of every expert for stacked experts)."""
    if target == "output.weight":  # stored once as the embedding when tied, so absent from the model's shapes
        return (args.vocab_size, args.dim)
    shape = model_shapes(args).get(target)
    if shape is None:
        raise ValueError(f"the GGUF file holds {target}, which this model's metadata does not use; the file is "
                         f"damaged or its metadata is wrong")
    if index is None:
        return shape
    axis = max(len(shape) - 2, 0)  # the rows: dim 0 of a matrix or bias, dim 1 of stacked experts (E, rows, cols)
    sizes = [args.q_size, args.kv_size, args.kv_size] if FUSED_PARTS[target.split(".", 2)[2]] == 3 else \
        [shape[axis] // 2] * 2
    return (*shape[:axis], sizes[index], *shape[axis + 1:])


def check_gguf_shape(t: Any, target: str, index: int | None, args: ModelArgs) -> None:
    """Refuse a tensor whose shape disagrees with the metadata before its data is read or reshaped."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    expected = gguf_shape(target, index, args)
    if shape != expected:
        raise ValueError(f"tensor {t.name} has shape {shape}, but the GGUF metadata implies {expected}; the file is "
                         f"damaged")


def check_shapes(tensors: dict[str, Any], args: ModelArgs) -> None:
    expected = model_shapes(args)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"the GGUF file lacks tensor {missing[0]} ({len(missing)} missing); the file is incomplete")
    for name, shape in expected.items():
        got = tensors[name][0].shape if isinstance(tensors[name], tuple) else tensors[name].shape
        if tuple(got) != shape:
            raise ValueError(f"tensor {name} has shape {tuple(got)}, but the metadata implies {shape}")


def int4_checkpoint_tensors(tensors: dict[str, Any], args: ModelArgs,
                            dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The int4 g32 checkpoint's tensors and quantization metadata: native parts packed as they are, other block
    projections quantized from float, an output head of another type kept float, the rest in `dtype`."""
    from redline.quantize import pack_int4, quantization_metadata, quantize_int4, quantized_linear_names

    quantization = quantization_metadata("int4", args.tie_word_embeddings, 32)
    out: dict[str, torch.Tensor] = {}
    requantized = []
    linears = {f"{name}.weight" for name in quantized_linear_names(args.n_layer, args.tie_word_embeddings)}
    for name, t in tensors.items():
        scales_name = name.removesuffix(".weight") + ".scales"
        if isinstance(t, tuple):
            out[name] = pack_int4(torch.from_numpy(np.ascontiguousarray(t[0])))
            out[scales_name] = torch.from_numpy(np.ascontiguousarray(t[1]))
        elif name in linears and name != "output.weight":
            out[name], out[scales_name] = quantize_int4(t, 32)
            requantized.append(name.removesuffix(".weight"))
        else:
            out[name] = t.to(dtype)
    if "output.weight" in out and "output.scales" not in out:
        quantization["not_quantized"].append("output (not Q4_0/Q4_1 in the GGUF file)")
    if requantized:
        quantization["quantized_from_float"] = requantized
    return out, quantization


def convert_gguf(gguf_path: str | Path, out: str | Path | None = None, dtype: torch.dtype | str = torch.bfloat16,
                 dequantize: bool = False, overwrite: bool = False) -> Path:
    """Write the Redline checkpoint (and tokenizer files beside it) for a GGUF file; returns the checkpoint.
    Everything is checked before anything is written: an existing checkpoint at `out` is replaced, and another
    model's tokenizer files beside it are replaced or removed, only with `overwrite`."""
    gguf_path = Path(gguf_path)
    out_path = Path(out) if out is not None else gguf_path.with_suffix(".redline.safetensors")
    cfg = GGUFConvertArgs(gguf=gguf_path, out=out_path, dtype=dtype_from_name(dtype), dequantize=dequantize,
                          overwrite=overwrite)
    reader = read_gguf(cfg.gguf)
    rope = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope is not None and len(rope.shape) != 1:
        raise ValueError(f"rope_freqs.weight has {len(rope.shape)} dimensions, not 1; the file is damaged")
    args = model_args(reader, tensor_to_float(rope) if rope is not None else None)
    tokenizer = tokenizer_files(reader)  # built before anything is written, so a bad tokenizer leaves no files
    side_files_to_write(tokenizer, cfg.out.parent, [cfg.gguf], cfg.overwrite,
                        exclusive=TOKENIZER_SIDE_FILES if tokenizer else ())
    native = set() if cfg.dequantize or args.n_experts else native_int4_targets(reader, args)
    tensors = redline_tensors(reader, args, native)
    check_shapes(tensors, args)
    tensors, quantization = int4_checkpoint_tensors(tensors, args, cfg.dtype) if native else (
        {name: t.to(cfg.dtype) for name, t in tensors.items()}, {"scheme": "none"})
    info = CheckpointInfo(path=cfg.out, args=args, dtype=cfg.dtype, quantization=quantization)
    path = save_checkpoint(cfg.out, tensors, info)
    write_tokenizer_files(tokenizer, cfg.out.parent, cfg.overwrite)
    return path


def parse_args(argv: list[str] | None) -> GGUFConvertArgs:
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, required=True, help="the .gguf file to convert (one of the architectures above)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output .safetensors file, the tokenizer files are written beside it; None means beside "
                             "the input, NAME.redline.safetensors")
    parser.add_argument("--dtype", default="bfloat16",
                        help="bfloat16 | float16 | float32: the dtype of every tensor that is not int4")
    parser.add_argument("--dequantize", action="store_true",
                        help="dequantize every quantized tensor to --dtype; without it Q4_0/Q4_1 projections stay int4 "
                             "(group size 32, no loss)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier Redline checkpoint at --out, and another model's tokenizer files "
                             "beside it")
    ns = parser.parse_args(argv)
    out = ns.out if ns.out is not None else ns.gguf.with_suffix(".redline.safetensors")
    return GGUFConvertArgs(gguf=ns.gguf, out=out, dtype=dtype_from_name(ns.dtype), dequantize=ns.dequantize,
                           overwrite=ns.overwrite)


def main(argv: list[str] | None = None) -> int:
    def body() -> int:
        cfg = parse_args(argv)
        print(convert_gguf(cfg.gguf, cfg.out, cfg.dtype, cfg.dequantize, cfg.overwrite))
        return 0

    return run_cli(body, interrupted="interrupted; nothing was written")


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.scripts.convert_gguf import main as package_main

    sys.exit(package_main())
