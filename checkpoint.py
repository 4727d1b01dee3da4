"""Redline's checkpoint format: one .safetensors file whose metadata says what it is.

Metadata keys (all strings, as safetensors requires):
  redline_format   format version
  config           ModelArgs as JSON
  dtype            dtype of the floating-point weights
  quantization     JSON: {"scheme": "none"} or {"scheme": "int8", ...}
Nothing is ever guessed from the file name.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model import ModelArgs, Transformer

FORMAT_VERSION = 1
CHECKPOINT_SUFFIX = ".safetensors"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"unsupported dtype {name}; choose one of {', '.join(DTYPES)}")
        return name
    key = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CheckpointInfo:
    """What a Redline checkpoint's metadata says about it."""

    path: Path
    args: ModelArgs
    dtype: torch.dtype
    quantization: dict[str, Any] = field(default_factory=lambda: {"scheme": "none"})
    format_version: int = FORMAT_VERSION

    @property
    def scheme(self) -> str:
        return self.quantization["scheme"]

    def metadata(self) -> dict[str, str]:
        return {
            "redline_format": str(self.format_version),
            "config": json.dumps(self.args.to_dict()),
            "dtype": dtype_name(self.dtype),
            "quantization": json.dumps(self.quantization),
        }


def write_atomically(path: Path, write: Any) -> None:
    """Call write(tmp_path) on a temp file in the target folder, flush it to disk, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(path: str | os.PathLike, tensors: dict[str, torch.Tensor], info: CheckpointInfo) -> Path:
    path = Path(path)
    if path.suffix != CHECKPOINT_SUFFIX:
        raise ValueError(f"output file {path} must end with {CHECKPOINT_SUFFIX}")
    contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    write_atomically(path, lambda tmp: save_file(contiguous, str(tmp), metadata=info.metadata()))
    return path


def resolve_checkpoint_path(path: str | os.PathLike) -> Path:
    """A checkpoint file, or a folder that holds exactly one Redline checkpoint."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist; convert one with scripts/convert_hf_checkpoint.py")
    if path.is_file():
        return path
    candidates = [p for p in sorted(path.glob(f"*{CHECKPOINT_SUFFIX}")) if is_redline_file(p)]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise FileNotFoundError(
            f"no Redline checkpoint in {path}; run scripts/convert_hf_checkpoint.py --checkpoint_dir {path} first"
        )
    names = ", ".join(p.name for p in candidates)
    raise ValueError(f"{path} holds several Redline checkpoints ({names}); pass the file you want")


def is_redline_file(path: Path) -> bool:
    if path.suffix != CHECKPOINT_SUFFIX:
        return False
    try:
        with safe_open(str(path), "pt") as f:
            return "redline_format" in (f.metadata() or {})
    except (SafetensorError, OSError, ValueError):
        return False


def read_checkpoint_info(path: str | os.PathLike) -> CheckpointInfo:
    path = resolve_checkpoint_path(path)
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable safetensors file ({exc}); re-convert or re-download it") from None
    if "redline_format" not in meta:
        raise ValueError(f"{path} has no Redline metadata; convert it with scripts/convert_hf_checkpoint.py")
    version = int(meta["redline_format"])
    if version > FORMAT_VERSION:
        raise ValueError(f"{path} uses checkpoint format {version}, newer than this Redline ({FORMAT_VERSION}); upgrade")
    try:
        args = ModelArgs.from_dict(json.loads(meta["config"]))
        quantization = json.loads(meta.get("quantization", '{"scheme": "none"}'))
        dtype = dtype_from_name(meta["dtype"])
    except (KeyError, json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"{path} has malformed Redline metadata ({exc}); re-convert it") from None
    return CheckpointInfo(path=path, args=args, dtype=dtype, quantization=quantization, format_version=version)


def load_tensors(info: CheckpointInfo, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(info.path), "pt", device=str(device)) as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"cannot read the tensors of {info.path} ({exc}); the file may be truncated, re-convert it") from None


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of an unquantized Redline checkpoint and its shape."""
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, args.dim), "norm.weight": (args.dim,)}
    if not args.tie_word_embeddings:
        shapes["output.weight"] = (args.vocab_size, args.dim)
    for i in range(args.n_layer):
        p = f"layers.{i}."
        shapes[p + "attention_norm.weight"] = (args.dim,)
        shapes[p + "attention.wqkv.weight"] = (args.q_size + 2 * args.kv_size, args.dim)
        shapes[p + "attention.wo.weight"] = (args.dim, args.q_size)
        shapes[p + "ffn_norm.weight"] = (args.dim,)
        shapes[p + "feed_forward.w13.weight"] = (2 * args.intermediate_size, args.dim)
        shapes[p + "feed_forward.w2.weight"] = (args.dim, args.intermediate_size)
    return shapes


def model_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores (a tied output weight is stored once, as the embedding)."""
    state = model.state_dict()
    if model.args.tie_word_embeddings:
        state.pop("output.weight", None)
    return state
