"""Convert a Hugging Face checkpoint folder into one Redline .safetensors file (Llama, Mistral, Qwen2/3, Gemma 2/3,
Phi-3, OLMo 2, Granite, Mixtral, Qwen3-MoE), and for the multimodal ones (Gemma 3 4B-27B, Qwen2.5-VL) their vision
tower into a second file beside it (NAME.vision.safetensors, vision.py).

python scripts/convert_hf_checkpoint.py --checkpoint_dir checkpoints/ORG/NAME [--out FILE] [--dtype bfloat16]

A 4-bit checkpoint (quantization_config: AWQ, GPTQ or compressed-tensors pack-quantized) becomes an int4 Redline
checkpoint, its codes and scales repacked as they are (scripts/hf_int4.py says what is kept exactly); --dtype is then
the dtype of the tensors that stay float (embedding, norms, routers, a float output head).
FP8 checkpoints convert as stored, never dequantized: transformers' `quant_method: "fp8"` with `weight_block_size`
[128, 128] (e4m3 weights and their `weight_scale_inv` per 128 x 128 block, as Qwen3-8B-FP8) and compressed-tensors'
`float-quantized` format (e4m3 weights and a `weight_scale` per output channel, per tensor, or per 128 x 128 block, as
the *-FP8-dynamic checkpoints). They become Redline's fp8 scheme (quantize.py): q/k/v and gate/up fuse with their
scales; a static `input_scale` is dropped (Redline quantizes activations per token on the fly).
"""
from __future__ import annotations

import json
import pickle
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from redline.checkpoint import (CheckpointInfo, OneLineArgumentParser, check_checkpoint_output, check_context,
                                check_layer_count, dtype_from_name, model_shapes, is_redline_file, progress, run_cli,
                                save_checkpoint, write_atomically, write_safetensors)
from redline.model import ModelArgs
from redline.outputs import check_inside, check_output
from redline.quantize import FP8_BLOCK, FP8_DTYPE, fp8_block_scales_shape, fp8_metadata, quantized_linear_names
from redline.scripts.hf_config import (MULTIMODAL_TEXT_FAMILIES, args_from_hf_config, hf_family,
                                      vision_args_from_hf_config)
from redline.scripts.hf_int4 import (Int4Source, fold_act_order, int4_source, read_int4_modules, redline_group_size,
                                     redline_parts, side_quantization_config)
from redline.tokenizer import copy_tokenizer_files, tokenizer_files_to_copy
from redline.vision import VisionArgs, is_vision_file, vision_path, vision_tower

DEFAULT_OUT_NAME = "model.redline.safetensors"
# HF buffers that are recomputed, not weights.
IGNORED_HF_TENSORS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# HF layer tensor -> (Redline tensor, its index among the parts fused into it, or None).
LAYER_PARTS = {
    "self_attn.q_proj.weight": ("attention.wqkv.weight", 0),
    "self_attn.k_proj.weight": ("attention.wqkv.weight", 1),
    "self_attn.v_proj.weight": ("attention.wqkv.weight", 2),
    "self_attn.qkv_proj.weight": ("attention.wqkv.weight", None),  # Phi-3: already fused, in q, k, v order
    "self_attn.o_proj.weight": ("attention.wo.weight", None),
    "self_attn.q_proj.bias": ("attention.wqkv_bias", 0),
    "self_attn.k_proj.bias": ("attention.wqkv_bias", 1),
    "self_attn.v_proj.bias": ("attention.wqkv_bias", 2),
    "self_attn.o_proj.bias": ("attention.wo_bias", None),
    "self_attn.q_norm.weight": ("attention.q_norm.weight", None),
    "self_attn.k_norm.weight": ("attention.k_norm.weight", None),
    "mlp.gate_proj.weight": ("feed_forward.w13.weight", 0),
    "mlp.up_proj.weight": ("feed_forward.w13.weight", 1),
    "mlp.gate_up_proj.weight": ("feed_forward.w13.weight", None),  # Phi-3: already fused, gate first
    "mlp.down_proj.weight": ("feed_forward.w2.weight", None),
    "input_layernorm.weight": ("attention_norm.weight", None),
    "post_attention_layernorm.weight": ("ffn_norm.weight", None),  # Llama's name for the feed-forward's input norm
    "pre_feedforward_layernorm.weight": ("ffn_norm.weight", None),
    "post_feedforward_layernorm.weight": ("post_ffn_norm.weight", None),
    # Mixture of experts: the router, and experts already stacked (E, 2I, dim) gate first and (E, dim, I), as
    # transformers 5 holds them in memory (files store them per expert, EXPERT_TENSOR).
    "block_sparse_moe.gate.weight": ("feed_forward.gate.weight", None),  # Mixtral
    "mlp.gate.weight": ("feed_forward.gate.weight", None),
    "mlp.experts.gate_up_proj": ("feed_forward.w13", None),
    "mlp.experts.down_proj": ("feed_forward.w2", None),
}
# One expert's projection: Mixtral's w1 (gate), w3 (up), w2 (down); Qwen3-MoE's gate_proj, up_proj, down_proj.
EXPERT_TENSOR = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
EXPERT_PARTS = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1), "up_proj": ("w13", 1),
                "w2": ("w2", 0), "down_proj": ("w2", 0)}
# Where norms sit on the sub-layers' outputs (Gemma, OLMo 2), post_attention_layernorm is the attention's output norm.
POST_NORM_PARTS = {"post_attention_layernorm.weight": ("post_attention_norm.weight", None)}
TOP_LEVEL = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "output.weight"}
FUSED_PARTS = {"attention.wqkv.weight": 3, "attention.wqkv_bias": 3, "feed_forward.w13.weight": 2}
# Gemma3ForConditionalGeneration, Qwen2_5_VLForConditionalGeneration: the language model's prefixes (transformers
# 5, then 4) and the vision parts, which convert_vision_tower writes to a file of their own.
MULTIMODAL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                       "language_model.lm_head.": "lm_head."}
VISION_TENSORS = re.compile(r"(model\.)?(vision_tower|multi_modal_projector|visual)\..+")


def layer_parts(args: ModelArgs) -> dict[str, tuple[str, int | None]]:
    """The layer tensors a model of args reads from an HF checkpoint."""
    return {**LAYER_PARTS, **POST_NORM_PARTS} if args.norm_placement != "pre" else LAYER_PARTS


def language_model_tensors(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A multimodal checkpoint's text tensors under the causal LM's names; the vision tower's are dropped."""
    out = {}
    for name, tensor in hf.items():
        if VISION_TENSORS.fullmatch(name):
            continue
        for prefix, replacement in MULTIMODAL_PREFIXES.items():
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                break
        out[name] = tensor
    return out


@dataclass(frozen=True)
class ConvertArgs:
    checkpoint_dir: Path
    out: Path
    dtype: torch.dtype
    overwrite: bool = False


def read_hf_config(checkpoint_dir: Path) -> ModelArgs:
    return args_from_hf_config(read_hf_config_json(checkpoint_dir))


def read_hf_config_json(checkpoint_dir: Path) -> dict:
    config_path = checkpoint_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found; download the model first (scripts/download.py)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config_path} is not valid JSON ({exc}); re-download it") from None
    except RecursionError:
        raise ValueError(f"{config_path} nests its JSON too deeply to be a model config; re-download it") from None
    except OSError as exc:
        raise ValueError(f"cannot read {config_path} ({exc.strerror}); check its permissions") from None
    return config


def hf_weight_files(checkpoint_dir: Path) -> list[Path]:
    """Safetensors shards if present, else pytorch_model*.bin shards."""
    for pattern in ("model*.safetensors", "pytorch_model*.bin"):
        # Skip hidden temp files and an earlier conversion's output, which may sit in the same folder.
        files = sorted(p for p in checkpoint_dir.glob(pattern)
                       if not p.name.startswith(".") and not is_redline_file(p) and not is_vision_file(p))
        if files:
            return files
    raise FileNotFoundError(
        f"no weights in {checkpoint_dir}: expected model*.safetensors or pytorch_model*.bin; download them first"
    )


def read_hf_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        if path.suffix == ".safetensors":
            try:
                with safe_open(str(path), "pt") as f:
                    shard = {name: f.get_tensor(name) for name in f.keys()}
            except (SafetensorError, OSError, ValueError) as exc:
                raise ValueError(f"cannot read {path} ({exc}); the file is truncated or corrupt, re-download it") from None
        else:
            shard = read_torch_file(path)
        clash = set(shard) & set(tensors)
        if clash:
            raise ValueError(f"tensor {sorted(clash)[0]} appears in more than one shard ({path.name})")
        tensors.update(shard)
    return tensors


def read_torch_file(path: Path) -> dict[str, torch.Tensor]:
    """A pytorch_model*.bin state dict, unpickled with weights_only=True (tensors only, never arbitrary objects).
    Zip-format files are memory-mapped; the legacy (pre-1.6) format cannot be, so it is read into memory."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "not a tensor file"
        raise ValueError(f"{path} holds more than plain tensors, so it is not loaded (weights_only=True refused it: "
                         f"{reason[:200]}); use the model's safetensors weights") from None
    except Exception as exc:  # torch raises several types for a truncated or corrupt file
        raise ValueError(f"cannot read {path} ({type(exc).__name__}); the file is truncated or corrupt, re-download "
                         f"it") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ValueError(f"{path} is not a state dict of named tensors; use the model's safetensors weights")
    return state


def hf_shape(name: str, args: ModelArgs) -> tuple[int, ...]:
    """The shape config.json implies for one HF tensor (checked before fusing, so a mis-split q/k/v or gate/up
    whose concatenation has the right size is still caught)."""
    target, index = hf_target(name, args)
    shape = model_shapes(args)[target]
    if index is None:
        return shape
    sizes = {3: [args.q_size, args.kv_size, args.kv_size], 2: [args.intermediate_size] * 2}
    return (sizes[FUSED_PARTS[target.split(".", 2)[-1]]][index], *shape[1:])


def hf_target(name: str, args: ModelArgs) -> tuple[str, int | None]:
    """The Redline tensor an HF tensor goes into, and its index among the fused parts (None: the whole tensor)."""
    if name in TOP_LEVEL:
        return TOP_LEVEL[name], None
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    parts = layer_parts(args)
    if not match or match.group(2) not in parts:
        raise ValueError(f"unexpected tensor {name} in the HF checkpoint; it is not a weight of this architecture")
    layer = int(match.group(1))
    if layer >= args.n_layer:
        raise ValueError(f"tensor {name} belongs to layer {layer}, but config.json has {args.n_layer} layers")
    local, index = parts[match.group(2)]
    target = f"layers.{layer}.{local}"
    if target not in model_shapes(args):
        raise ValueError(f"tensor {name} is not used by this config (it has no {local.split('.')[-2]}); the weights "
                         f"do not belong to this config")
    return target, index


def check_hf_tensor(name: str, tensor: torch.Tensor, args: ModelArgs) -> None:
    expected = hf_shape(name, args)
    if tuple(tensor.shape) != expected:
        raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, but config.json implies {expected}; the "
                         f"weights do not belong to this config")
    if not tensor.is_floating_point():
        raise ValueError(f"tensor {name} is {tensor.dtype}, not floating point; Redline converts unquantized HF weights")


def map_hf_tensors(hf: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Rename HF tensors to Redline names and fuse qkv and gate/up. Every tensor must be accounted for."""
    parts: dict[str, list[torch.Tensor | None]] = {}
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    for name, tensor in hf.items():
        if IGNORED_HF_TENSORS.fullmatch(name):
            continue
        if EXPERT_TENSOR.fullmatch(name):
            target, key = expert_target(name, tensor, args)
            if key in experts.setdefault(target, {}):
                raise ValueError(f"tensor {name} duplicates another tensor of the HF checkpoint ({target}); remove one")
            experts[target][key] = tensor
            continue
        target, index = hf_target(name, args)
        check_hf_tensor(name, tensor, args)
        if target in out or (index is None and target in parts):
            raise ValueError(f"tensor {name} duplicates another tensor of the HF checkpoint ({target}); remove one")
        if index is None:
            out[target] = tensor
        else:
            parts.setdefault(target, [None] * FUSED_PARTS[target.split(".", 2)[2]])[index] = tensor
    for target, pieces in parts.items():
        if any(p is None for p in pieces):
            absent = [hf for hf, p in zip(hf_names(target), pieces) if p is None]
            raise ValueError(f"tensor {absent[0]} is missing from the HF checkpoint")
        out[target] = torch.cat(pieces, dim=0)
    for target, pieces in experts.items():
        if target in out:
            raise ValueError(f"the HF checkpoint holds {target} both stacked and per expert; remove one")
        out[target] = stacked_experts(target, pieces, args)
    if args.tie_word_embeddings:
        out.pop("output.weight", None)  # stored once, as the embedding
    return out


def expert_target(name: str, tensor: torch.Tensor, args: ModelArgs) -> tuple[str, tuple[int, int]]:
    """The stacked Redline tensor (w13 or w2) one expert's projection goes into, and its (expert, part) key; the
    tensor's shape is checked against config.json first."""
    layer, expert, proj = EXPERT_TENSOR.fullmatch(name).groups()
    layer, expert = int(layer), int(expert)
    if proj not in EXPERT_PARTS:
        raise ValueError(f"unexpected tensor {name} in the HF checkpoint; it is not a weight of this architecture")
    if layer >= args.n_layer or not args.sparse(layer) or expert >= args.n_experts:
        raise ValueError(f"tensor {name} names an expert that config.json does not have (layer {layer}, expert "
                         f"{expert}); the weights do not belong to this config")
    local, part = EXPERT_PARTS[proj]
    dim, hidden = args.dim, args.moe_intermediate_size
    expected = (hidden, dim) if local == "w13" else (dim, hidden)
    if tuple(tensor.shape) != expected or not tensor.is_floating_point():
        raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)} ({tensor.dtype}), but config.json implies "
                         f"{expected} floats; the weights do not belong to this config")
    return f"layers.{layer}.feed_forward.{local}", (expert, part)


def stacked_experts(target: str, pieces: dict[tuple[int, int], torch.Tensor], args: ModelArgs) -> torch.Tensor:
    """Every expert's projection stacked (E, 2I, dim) for w13 (gate rows, then up rows) or (E, dim, I) for w2."""
    n_parts = 2 if target.endswith("w13") else 1
    expected = args.n_experts * n_parts
    if len(pieces) != expected:  # every key is in range (expert_target), so some are missing; the first is found
        # within len(pieces) + 1 keys, however many experts config.json declares
        expert, part = next(key for key in ((e, p) for e in range(args.n_experts) for p in range(n_parts))
                            if key not in pieces)
        raise ValueError(f"expert {expert} of layer {target.split('.')[1]} lacks its {target.rsplit('.', 1)[1]} part "
                         f"{part} in the HF checkpoint ({expected - len(pieces)} missing); the files are incomplete")
    return torch.stack([torch.cat([pieces[e, p] for p in range(n_parts)]) for e in range(args.n_experts)])


def hf_names(target: str) -> list[str]:
    """The HF tensor names that make up one Redline tensor, in fusion order."""
    for hf, redline in TOP_LEVEL.items():
        if redline == target:
            return [hf]
    layer, local = re.fullmatch(r"layers\.(\d+)\.(.+)", target).groups()
    parts = sorted((index or 0, part) for part, (name, index) in {**LAYER_PARTS, **POST_NORM_PARTS}.items()
                   if name == local)
    parts = [p for p in parts if p[1] not in ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")] or parts
    return [f"model.layers.{layer}.{part}" for _, part in parts] or [target]


def check_shapes(tensors: dict[str, torch.Tensor], args: ModelArgs) -> None:
    expected = model_shapes(args)
    missing = sorted(set(expected) - set(tensors), key=_natural_key)
    if missing:
        names = hf_names(missing[0])
        raise ValueError(f"tensor {names[0]} is missing from the HF checkpoint ({len(missing)} Redline tensors incomplete)")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"tensor {name} has shape {tuple(tensors[name].shape)}, but config.json implies {shape}")


def _natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def checkpoint_folder(checkpoint_dir: Path) -> Path:
    try:
        exists, is_dir = checkpoint_dir.exists(), checkpoint_dir.is_dir()
    except OSError as exc:
        raise ValueError(f"cannot read {checkpoint_dir} ({exc.strerror}); check its permissions") from None
    if not exists:
        raise FileNotFoundError(f"checkpoint directory {checkpoint_dir} does not exist; download the model first")
    if not is_dir:
        raise ValueError(f"--checkpoint_dir {checkpoint_dir} is not a folder; pass the HF model folder (config.json "
                         f"and weights)")
    return checkpoint_dir


def convert_hf_checkpoint(checkpoint_dir: str | Path, out: str | Path | None = None,
                          dtype: torch.dtype | str = torch.bfloat16, overwrite: bool = False) -> Path:
    """Write one Redline checkpoint from an HF folder. Everything is checked before the output is written (the
    tokenizer files to copy beside an --out elsewhere included), and the output may never be one of the files read;
    an earlier Redline checkpoint there is replaced only with `overwrite`."""
    checkpoint_dir = checkpoint_folder(Path(checkpoint_dir))
    dtype = dtype_from_name(dtype)
    config = read_hf_config_json(checkpoint_dir)
    args = args_from_hf_config(config)
    check_context(args.block_size, f"{checkpoint_dir / 'config.json'} (max_position_embeddings)", "fix the config")
    files = hf_weight_files(checkpoint_dir)
    out_path = Path(out) if out is not None else checkpoint_dir / DEFAULT_OUT_NAME
    inputs = [check_inside(p, checkpoint_dir) for p in [checkpoint_dir / "config.json", *files]]  # no symlink out
    check_checkpoint_output(out_path, inputs, overwrite)
    tokenizer_files_to_copy(checkpoint_dir, out_path.parent, overwrite, inputs)
    fp8 = hf_fp8_format(config)  # FP8 (below), else a 4-bit source, else unquantized
    side = side_quantization_config(checkpoint_dir) if "quantization_config" not in config else None
    source = None if fp8 is not None else int4_source(
        {**config, "quantization_config": side} if side is not None else config)  # before reading
    vision = read_vision_config(checkpoint_dir, config)
    if vision is not None:
        check_output(vision_path(out_path), inputs, "--out", overwrite=overwrite, replaceable=is_vision_file,
                     kind="Redline vision file")
    hf = read_hf_tensors(files)
    tower = vision_tensors(hf, vision) if vision is not None else None  # checked now, written after the text model
    if hf_family(config) in MULTIMODAL_TEXT_FAMILIES:
        hf = language_model_tensors(hf)
    check_layer_count(hf, args.n_layer, "config.json")  # before anything builds or loops over the declared layers
    if source is None and any(name.endswith((".qweight", ".weight_packed")) for name in hf):
        raise ValueError(f"the weights in {checkpoint_dir} are 4-bit, but config.json has no quantization_config "
                         f"(nor is there a quantize_config.json); re-download the model's config files")
    if source is not None:
        tensors, quantization = int4_checkpoint_tensors(hf, args, source, dtype)
        path = save_checkpoint(out_path, tensors, CheckpointInfo(path=out_path, args=args, dtype=dtype,
                                                                 quantization=quantization))
        if tower is not None:  # the tower of a 4-bit multimodal checkpoint stays float
            write_vision_file(vision_path(out_path), vision, tower, dtype)
        return path
    hf, fp8_scales = split_fp8_scales(hf) if fp8 is not None else (hf, {})
    tensors = map_hf_tensors(hf, args)
    check_shapes(tensors, args)
    tensors = {name: t if t.dtype == FP8_DTYPE else t.to(dtype)
               for name, t in progress(tensors.items(), len(tensors), "converting")}
    quantization = {"scheme": "none"}
    if fp8 is not None:
        quantization = add_fp8_scales(tensors, fp8_scales, fp8, args)
    info = CheckpointInfo(path=out_path, args=args, dtype=dtype, quantization=quantization)
    path = save_checkpoint(out_path, tensors, info)
    if tower is not None:
        write_vision_file(vision_path(out_path), vision, tower, dtype)
    return path


def quantized_target(name: str, args: ModelArgs) -> bool:
    """Whether the HF weight `name` goes into a linear that Redline's int4 checkpoint holds in int4: a projection
    inside the blocks or an expert (the output head is int4 only where the file has it so)."""
    from redline.quantize import QUANTIZED_LINEARS

    if EXPERT_TENSOR.fullmatch(name):
        return True
    if name in TOP_LEVEL or not name.endswith(".weight"):
        return False
    target, _ = hf_target(name, args)
    return target.split(".", 2)[-1].removesuffix(".weight") in QUANTIZED_LINEARS


def int4_checkpoint_tensors(hf: dict[str, torch.Tensor], args: ModelArgs, source: Int4Source,
                            dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
    """The int4 checkpoint's tensors and quantization metadata from a 4-bit HF checkpoint: every 4-bit module
    repacked (act-order folded), a projection the file keeps float quantized to int4 from its values (listed in the
    metadata), the rest in `dtype`."""
    from redline.quantize import quantization_metadata, quantize_int4

    modules, floats = read_int4_modules(hf, source)
    if not modules:
        raise ValueError(f"config.json declares {source.method} quantization, but the weights hold no 4-bit "
                         f"module; the checkpoint is damaged")
    for name in modules:
        if not (quantized_target(f"{name}.weight", args) or (name == "lm_head" and not args.tie_word_embeddings)):
            raise ValueError(f"module {name} is 4-bit in the checkpoint, but Redline keeps it float (routers, a "
                             f"tied head); convert an unquantized copy of the model")
    folded = fold_act_order(modules, floats)
    group = redline_group_size(modules)
    for name, module in modules.items():
        if module.bias is not None:
            floats[f"{name}.bias"] = module.bias
    floats = {name: t for name, t in floats.items() if not dropped_zero_bias(name, t, args)}
    parts = {f"{name}.weight": redline_parts(module, group) for name, module in modules.items()}
    requantized = [name for name in floats if not IGNORED_HF_TENSORS.fullmatch(name) and quantized_target(name, args)]
    for name in requantized:
        parts[name] = quantize_int4(floats.pop(name).float(), group)
    if args.tie_word_embeddings:
        parts.pop("lm_head.weight", None)
    float_tensors = map_hf_tensors(floats, args)
    int4_tensors = map_int4_parts(parts, args)
    stubs = {name: torch.empty(*packed.shape[:-1], 2 * packed.shape[-1], device="meta")
             for name, (packed, _) in int4_tensors.items()}
    check_shapes({**float_tensors, **stubs}, args)
    out = {name: t.to(dtype) for name, t in float_tensors.items()}
    for name, (packed, scales) in int4_tensors.items():
        out[name] = packed
        out[name.removesuffix(".weight") + ".scales" if name.endswith(".weight") else f"{name}_scales"] = scales
    quantization = quantization_metadata("int4", args.tie_word_embeddings, group)
    quantization["source"] = source.describe
    quantization["kept_exactly"] = ("codes and scales; zero points as offset -scale * zero, exact for symmetric "
                                    "files, else rounded once to fp16")
    if "output.weight" in out and "output.scales" not in out:
        quantization["not_quantized"].append("output (float in the source checkpoint)")
    if args.n_experts:
        quantization["experts"] = "int4, each expert's rows in the int4 layout (w13_scales, w2_scales)"
        quantization["not_quantized"].append("feed_forward.gate (the expert routers)")
    if folded:
        quantization["act_order_folded"] = folded
    if requantized:
        quantization["quantized_from_float"] = requantized
    rounded = {name: m.rounded_scales for name, m in modules.items() if m.rounded_scales}
    if rounded:
        quantization["scales_rounded_to_fp16"] = rounded
    return out, quantization


def dropped_zero_bias(name: str, tensor: torch.Tensor, args: ModelArgs) -> bool:
    """An all-zero bias of a projection that this architecture has without one (some 4-bit writers store them)."""
    if not name.endswith(".bias") or bool(tensor.any()):
        return False
    try:
        hf_target(name, args)
    except ValueError:
        return True
    return False


def map_int4_parts(parts: dict[str, tuple[torch.Tensor, torch.Tensor]],
                   args: ModelArgs) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """map_hf_tensors for int4 (packed (N, K/2), scales (N, K/G, 2)) pairs: renamed, q/k/v and gate/up fused along
    their rows, experts stacked; each HF weight's shape is checked against config.json first."""
    fused: dict[str, list] = {}
    experts: dict[str, dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]] = {}
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, pair in parts.items():
        stub = torch.empty(pair[0].shape[0], 2 * pair[0].shape[1], device="meta")  # the float weight's shape
        if EXPERT_TENSOR.fullmatch(name):
            target, key = expert_target(name, stub, args)
            if key in experts.setdefault(target, {}):
                raise ValueError(f"tensor {name} duplicates another tensor of the HF checkpoint ({target}); remove one")
            experts[target][key] = pair
            continue
        target, index = hf_target(name, args)
        check_hf_tensor(name, stub, args)
        if target in out or (index is None and target in fused):
            raise ValueError(f"tensor {name} duplicates another tensor of the HF checkpoint ({target}); remove one")
        if index is None:
            out[target] = pair
        else:
            fused.setdefault(target, [None] * FUSED_PARTS[target.split(".", 2)[2]])[index] = pair
    for target, pieces in fused.items():
        if any(p is None for p in pieces):
            absent = [hf for hf, p in zip(hf_names(target), pieces) if p is None]
            raise ValueError(f"tensor {absent[0]} is missing from the HF checkpoint")
        out[target] = tuple(torch.cat([p[i] for p in pieces], dim=0) for i in range(2))
    for target, pieces in experts.items():
        out[target] = tuple(stacked_experts(target, {key: p[i] for key, p in pieces.items()}, args) for i in range(2))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The vision tower of a multimodal checkpoint (vision.py): its own file, written after the language model's.

# HF vision tensor prefixes -> the tower's own names (vision.Gemma3Vision, vision.QwenVision).
VISION_PREFIXES = {"model.vision_tower.": "vision_tower.", "vision_tower.": "vision_tower.",
                   "model.multi_modal_projector.": "multi_modal_projector.",
                   "multi_modal_projector.": "multi_modal_projector.", "model.visual.": "", "visual.": ""}
# SigLIP's attention-pooling head, which Gemma 3 does not use (it reads the last hidden states).
UNUSED_VISION_TENSORS = re.compile(r"vision_tower\.head\..+")


def read_vision_config(checkpoint_dir: Path, config: dict) -> VisionArgs | None:
    """The tower's VisionArgs from config.json, preprocessor_config.json (if present) and the tokenizer's "\n\n"
    token (if tokenizer.json is present); None for a text-only family."""
    if hf_family(config) not in MULTIMODAL_TEXT_FAMILIES:
        return None
    processor_path = checkpoint_dir / "preprocessor_config.json"
    processor = None
    if processor_path.is_file():
        try:
            processor = json.loads(processor_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{processor_path} is not valid JSON ({exc}); re-download it") from None
    return vision_args_from_hf_config(config, processor, newline_token(checkpoint_dir))


def newline_token(checkpoint_dir: Path) -> int | None:
    """The id of "\n\n" in the folder's tokenizer.json vocabulary, or None."""
    path = checkpoint_dir / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        vocab = json.loads(path.read_text(encoding="utf-8")).get("model", {}).get("vocab", {})
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None
    token = vocab.get("\n\n") if isinstance(vocab, dict) else None
    return token if type(token) is int else None


def vision_tensors(hf: dict[str, torch.Tensor], args: VisionArgs) -> dict[str, torch.Tensor]:
    """The HF checkpoint's vision tensors under the tower's names, every one of them checked against the tower."""
    out = {}
    for name, tensor in hf.items():
        prefix = next((p for p in VISION_PREFIXES if name.startswith(p)), None)
        if prefix is None or not VISION_TENSORS.fullmatch(name):
            continue
        local = VISION_PREFIXES[prefix] + name[len(prefix):]
        if UNUSED_VISION_TENSORS.fullmatch(local):
            continue
        if local == "patch_embed.proj.weight":  # Qwen's Conv3d with stride = kernel: a matrix over flat patches
            local, tensor = "patch_embed.weight", tensor.flatten(1)
        out[local] = tensor
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in vision_tower(args).state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(out)), sorted(set(out) - set(expected))
    if missing or unexpected:
        raise ValueError(f"the vision tower's tensors do not match config.json's vision_config (missing "
                         f"{missing[:3]}, unexpected {unexpected[:3]}); the weights do not belong to this config")
    for name, shape in expected.items():
        if tuple(out[name].shape) != shape or not out[name].is_floating_point():
            raise ValueError(f"vision tensor {name} has shape {tuple(out[name].shape)} ({out[name].dtype}), but "
                             f"config.json implies {shape} floats; the weights do not belong to this config")
    return out


def write_vision_file(path: Path, args: VisionArgs, tower: dict[str, torch.Tensor], dtype: torch.dtype) -> Path:
    """The tower's tensors (vision_tensors) in dtype with VisionArgs in the metadata, written atomically."""
    tensors = {name: t.to(dtype).contiguous() for name, t in tower.items()}
    meta = {"redline_vision": json.dumps(args.to_dict()), "dtype": str(dtype).removeprefix("torch.")}
    write_atomically(path, lambda tmp: write_safetensors(tmp, tensors, meta))
    return path


# --- FP8 checkpoints: e4m3 weights and their scales, kept as they are ---

# An FP8 weight's scale tensor beside it: transformers' block-wise fp8 ("weight_scale_inv": despite the name, the
# weight is codes * scale) and compressed-tensors ("weight_scale").
FP8_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
# Static activation scales, not used: activations are quantized per token on the fly.
FP8_DROPPED_SUFFIXES = (".input_scale",)


@dataclass(frozen=True)
class HfFp8Format:
    """An FP8 checkpoint's layout: where it comes from and whether its weight scales are 128 x 128 blocks (else one
    per output channel, or one per tensor, which becomes one per output channel)."""

    source: str  # "fp8" (transformers) or "compressed-tensors"
    block_scales: bool


def hf_fp8_format(config: dict) -> HfFp8Format | None:
    """The FP8 layout config.json's quantization_config declares, or None for an unquantized (or non-FP8) checkpoint.
    An FP8 variant Redline cannot hold as it is (other block sizes, other bit widths) is a one-line error."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("weight_block_size") != [FP8_BLOCK, FP8_BLOCK]:
            raise ValueError(f"this fp8 checkpoint has weight_block_size {q.get('weight_block_size')!r}; Redline "
                             f"converts block-wise fp8 with [{FP8_BLOCK}, {FP8_BLOCK}] blocks only")
        return HfFp8Format("fp8", block_scales=True)
    if method != "compressed-tensors" or q.get("format") != "float-quantized":
        return None
    kinds = {compressed_fp8_kind(name, group) for name, group in (q.get("config_groups") or {}).items()}
    if len(kinds) != 1:
        raise ValueError(f"this compressed-tensors checkpoint mixes FP8 weight strategies ({sorted(kinds)}) or has "
                         f"no config_groups; Redline converts one strategy for every linear layer")
    return HfFp8Format("compressed-tensors", block_scales=kinds.pop() == "block")


def compressed_fp8_kind(name: str, group: dict) -> str:
    """"block" or "channel" for one compressed-tensors config group's FP8 weights (a per-tensor scale counts as
    per-channel); anything else is refused."""
    weights = group.get("weights") or {} if isinstance(group, dict) else {}
    strategy = weights.get("strategy")
    if weights.get("num_bits") != 8 or weights.get("type") != "float" or not weights.get("symmetric", True):
        raise ValueError(f"compressed-tensors group {name!r} holds {weights.get('num_bits')}-bit "
                         f"{weights.get('type')} weights; Redline converts symmetric 8-bit float (FP8) weights")
    if strategy == "block" and weights.get("block_structure") == [FP8_BLOCK, FP8_BLOCK]:
        return "block"
    if strategy in ("channel", "tensor"):
        return "channel"
    raise ValueError(f"compressed-tensors group {name!r} scales its FP8 weights by {strategy!r} "
                     f"{weights.get('block_structure') or ''}; Redline converts per-channel, per-tensor or "
                     f"[{FP8_BLOCK}, {FP8_BLOCK}] block scales")


def split_fp8_scales(hf: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the weights and other tensors, {FP8 weight name: its scale tensor}); input scales are dropped. Every e4m3
    weight needs its scale and every scale its e4m3 weight."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in hf.items():
        if name.endswith(FP8_DROPPED_SUFFIXES):
            continue
        suffix = next((s for s in FP8_SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            weights[name] = tensor
        else:
            scales[name.removesuffix(suffix) + ".weight"] = tensor
    for name, tensor in weights.items():
        if tensor.dtype == FP8_DTYPE and name not in scales:
            raise ValueError(f"FP8 tensor {name} has no weight_scale beside it; the files are incomplete")
        if tensor.dtype not in (FP8_DTYPE, torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"tensor {name} is {tensor.dtype}; an FP8 checkpoint holds e4m3 weights and float tensors")
    for name in scales:
        if name not in weights or weights[name].dtype != FP8_DTYPE:
            raise ValueError(f"{name}'s scale has no float8_e4m3fn weight beside it; the files do not belong together")
    return weights, scales


def fp8_scales_of(name: str, weight_shape: tuple[int, int], scale: torch.Tensor, block_scales: bool) -> torch.Tensor:
    """One HF weight's scale as Redline holds it: fp32 (N,) per output channel (a per-tensor scale repeated), or the
    (ceil(N/128), ceil(K/128)) blocks; any other shape is a one-line error."""
    n, k = weight_shape
    scale = scale.float()
    if block_scales and tuple(scale.shape) == fp8_block_scales_shape(n, k):
        return scale
    if not block_scales and scale.numel() == n and scale.shape[0] == n:
        return scale.reshape(n)
    if not block_scales and scale.numel() == 1:
        return scale.reshape(1).expand(n).clone()
    want = fp8_block_scales_shape(n, k) if block_scales else (n, 1)
    raise ValueError(f"{name}'s scale has shape {tuple(scale.shape)}, expected {want} for its {(n, k)} weight; the "
                     f"files do not belong to their config")


def add_fp8_scales(tensors: dict[str, torch.Tensor], scales: dict[str, torch.Tensor], fmt: HfFp8Format,
                   args: ModelArgs) -> dict[str, Any]:
    """Put each Redline FP8 weight's scales beside it (fused as q/k/v and gate/up are) and return the checkpoint's
    quantization metadata. Every projection Redline quantizes must be FP8 (an untied output head may stay float)."""
    if args.n_experts:
        raise ValueError("Redline does not run FP8 mixture-of-experts models yet; convert an unquantized checkpoint")
    parts: dict[str, list[tuple[int, str, torch.Tensor]]] = {}  # Redline weight -> (fused index, HF name, scale)
    for name, scale in scales.items():
        target, index = hf_target(name, args)
        parts.setdefault(target, []).append((index or 0, name, scale))
    float_head = args.tie_word_embeddings or "output.weight" not in parts
    for name in quantized_linear_names(args.n_layer, float_head):
        target = f"{name}.weight"
        pieces = sorted(parts.pop(target, []), key=lambda piece: piece[0])
        if tensors[target].dtype != FP8_DTYPE or len(pieces) != FUSED_PARTS.get(target.split(".", 2)[-1], 1):
            raise ValueError(f"{hf_names(target)[0]} is not stored in FP8 in this checkpoint (not every part of "
                             f"{target} has e4m3 weights and scales); Redline's fp8 needs every projection in FP8")
        fused = []
        for i, (_, hf_name, scale) in enumerate(pieces):
            rows = hf_shape(hf_name, args)[0]
            if fmt.block_scales and rows % FP8_BLOCK and i < len(pieces) - 1:
                raise ValueError(f"{hf_name} has {rows} rows, not a multiple of {FP8_BLOCK}: its blocks cannot be "
                                 f"fused into {target}")
            fused.append(fp8_scales_of(hf_name, (rows, tensors[target].shape[1]), scale, fmt.block_scales))
        tensors[target.removesuffix(".weight") + ".scales"] = torch.cat(fused).contiguous()
    if parts:
        raise ValueError(f"{hf_names(next(iter(parts)))[0]} is stored in FP8, which Redline keeps float here; "
                         f"convert an unquantized checkpoint")
    kept = ["tok_embeddings"] + (["output (tied to tok_embeddings)"] if args.tie_word_embeddings else
                                 ["output"] if float_head else [])
    return fp8_metadata(fmt.block_scales, kept)


def parse_args(argv: list[str] | None) -> ConvertArgs:
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint_dir", type=Path, required=True, help="HF checkpoint folder (config.json + weights)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"output file; None means CHECKPOINT_DIR/{DEFAULT_OUT_NAME}")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier Redline checkpoint at --out (and different tokenizer files beside it)")
    ns = parser.parse_args(argv)
    out = ns.out if ns.out is not None else ns.checkpoint_dir / DEFAULT_OUT_NAME
    return ConvertArgs(checkpoint_dir=ns.checkpoint_dir, out=out, dtype=dtype_from_name(ns.dtype), overwrite=ns.overwrite)


def main(argv: list[str] | None = None) -> int:
    def body() -> int:
        cfg = parse_args(argv)
        path = convert_hf_checkpoint(cfg.checkpoint_dir, cfg.out, cfg.dtype, cfg.overwrite)
        copy_tokenizer_files(cfg.checkpoint_dir, path.parent, cfg.overwrite)
        print(path)
        return 0

    return run_cli(body, interrupted="interrupted; nothing was written")


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.scripts.convert_hf_checkpoint import main as package_main

    sys.exit(package_main())
