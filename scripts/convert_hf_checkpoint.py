"""Convert a Hugging Face Llama/Mistral checkpoint folder into one Redline .safetensors file.

python scripts/convert_hf_checkpoint.py --checkpoint_dir checkpoints/ORG/NAME [--out FILE] [--dtype bfloat16]
"""
from __future__ import annotations

import json
import pickle
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from redline.checkpoint import (CheckpointInfo, OneLineArgumentParser, check_checkpoint_output, dtype_from_name, expected_shapes,
                        is_redline_file, progress, run_cli, save_checkpoint)
from redline.model import ModelArgs
from redline.scripts.hf_config import args_from_hf_config
from redline.tokenizer import copy_tokenizer_files

DEFAULT_OUT_NAME = "model.redline.safetensors"
# HF buffers that are recomputed, not weights.
IGNORED_HF_TENSORS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
LAYER_PARTS = {
    "self_attn.q_proj.weight": ("attention.wqkv.weight", 0),
    "self_attn.k_proj.weight": ("attention.wqkv.weight", 1),
    "self_attn.v_proj.weight": ("attention.wqkv.weight", 2),
    "self_attn.o_proj.weight": ("attention.wo.weight", None),
    "mlp.gate_proj.weight": ("feed_forward.w13.weight", 0),
    "mlp.up_proj.weight": ("feed_forward.w13.weight", 1),
    "mlp.down_proj.weight": ("feed_forward.w2.weight", None),
    "input_layernorm.weight": ("attention_norm.weight", None),
    "post_attention_layernorm.weight": ("ffn_norm.weight", None),
}
TOP_LEVEL = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "output.weight"}
FUSED_PARTS = {"attention.wqkv.weight": 3, "feed_forward.w13.weight": 2}


@dataclass(frozen=True)
class ConvertArgs:
    checkpoint_dir: Path
    out: Path
    dtype: torch.dtype


def read_hf_config(checkpoint_dir: Path) -> ModelArgs:
    config_path = checkpoint_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found; download the model first (scripts/download.py)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config_path} is not valid JSON ({exc}); re-download it") from None
    except OSError as exc:
        raise ValueError(f"cannot read {config_path} ({exc.strerror}); check its permissions") from None
    return args_from_hf_config(config)


def hf_weight_files(checkpoint_dir: Path) -> list[Path]:
    """Safetensors shards if present, else pytorch_model*.bin shards."""
    for pattern in ("model*.safetensors", "pytorch_model*.bin"):
        # Skip hidden temp files and an earlier conversion's output, which may sit in the same folder.
        files = sorted(p for p in checkpoint_dir.glob(pattern) if not p.name.startswith(".") and not is_redline_file(p))
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
    part = re.sub(r"^model\.layers\.\d+\.", "", name)
    return {
        "model.embed_tokens.weight": (args.vocab_size, args.dim), "lm_head.weight": (args.vocab_size, args.dim),
        "model.norm.weight": (args.dim,), "input_layernorm.weight": (args.dim,),
        "post_attention_layernorm.weight": (args.dim,),
        "self_attn.q_proj.weight": (args.q_size, args.dim), "self_attn.k_proj.weight": (args.kv_size, args.dim),
        "self_attn.v_proj.weight": (args.kv_size, args.dim), "self_attn.o_proj.weight": (args.dim, args.q_size),
        "mlp.gate_proj.weight": (args.intermediate_size, args.dim), "mlp.up_proj.weight": (args.intermediate_size, args.dim),
        "mlp.down_proj.weight": (args.dim, args.intermediate_size),
    }[part]


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
    for name, tensor in hf.items():
        if IGNORED_HF_TENSORS.fullmatch(name):
            continue
        if name in TOP_LEVEL:
            target, index = TOP_LEVEL[name], None
        else:
            match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
            if not match or match.group(2) not in LAYER_PARTS:
                raise ValueError(f"unexpected tensor {name} in the HF checkpoint; it is not a Llama weight")
            layer, part = int(match.group(1)), match.group(2)
            if layer >= args.n_layer:
                raise ValueError(f"tensor {name} belongs to layer {layer}, but config.json has {args.n_layer} layers")
            local, index = LAYER_PARTS[part]
            target = f"layers.{layer}.{local}"
        check_hf_tensor(name, tensor, args)
        if index is None:
            out[target] = tensor
        else:
            parts.setdefault(target, [None] * FUSED_PARTS[target.split(".", 2)[2]])[index] = tensor
    for target, pieces in parts.items():
        if any(p is None for p in pieces):
            absent = [hf for hf, p in zip(hf_names(target), pieces) if p is None]
            raise ValueError(f"tensor {absent[0]} is missing from the HF checkpoint")
        out[target] = torch.cat(pieces, dim=0)
    if args.tie_word_embeddings:
        out.pop("output.weight", None)  # stored once, as the embedding
    return out


def hf_names(target: str) -> list[str]:
    """The HF tensor names that make up one Redline tensor, in fusion order."""
    for hf, redline in TOP_LEVEL.items():
        if redline == target:
            return [hf]
    layer, local = re.fullmatch(r"layers\.(\d+)\.(.+)", target).groups()
    parts = sorted((index or 0, part) for part, (name, index) in LAYER_PARTS.items() if name == local)
    return [f"model.layers.{layer}.{part}" for _, part in parts]


def check_shapes(tensors: dict[str, torch.Tensor], args: ModelArgs) -> None:
    expected = expected_shapes(args)
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
                          dtype: torch.dtype | str = torch.bfloat16) -> Path:
    """Write one Redline checkpoint from an HF folder. Everything is checked before the output is written, and the
    output may never be one of the files read."""
    checkpoint_dir = checkpoint_folder(Path(checkpoint_dir))
    dtype = dtype_from_name(dtype)
    args = read_hf_config(checkpoint_dir)
    files = hf_weight_files(checkpoint_dir)
    out_path = Path(out) if out is not None else checkpoint_dir / DEFAULT_OUT_NAME
    check_checkpoint_output(out_path, inputs=[checkpoint_dir / "config.json", *files])
    tensors = map_hf_tensors(read_hf_tensors(files), args)
    check_shapes(tensors, args)
    tensors = {name: t.to(dtype) for name, t in progress(tensors.items(), len(tensors), "converting")}
    info = CheckpointInfo(path=out_path, args=args, dtype=dtype)
    return save_checkpoint(out_path, tensors, info)


def parse_args(argv: list[str] | None) -> ConvertArgs:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint_dir", type=Path, required=True, help="HF checkpoint folder (config.json + weights)")
    parser.add_argument("--out", type=Path, default=None, help=f"output file (default: CHECKPOINT_DIR/{DEFAULT_OUT_NAME})")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32")
    ns = parser.parse_args(argv)
    out = ns.out if ns.out is not None else ns.checkpoint_dir / DEFAULT_OUT_NAME
    return ConvertArgs(checkpoint_dir=ns.checkpoint_dir, out=out, dtype=dtype_from_name(ns.dtype))


def main(argv: list[str] | None = None) -> int:
    def body() -> int:
        cfg = parse_args(argv)
        path = convert_hf_checkpoint(cfg.checkpoint_dir, cfg.out, cfg.dtype)
        copy_tokenizer_files(cfg.checkpoint_dir, path.parent)
        print(path)
        return 0

    return run_cli(body, interrupted="interrupted; nothing was written")


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.scripts.convert_hf_checkpoint import main as package_main

    sys.exit(package_main())
