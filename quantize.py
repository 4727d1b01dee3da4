"""Weight-only int8 quantization: a CLI that writes a new checkpoint, a module swap, and the loader's structure.

python quantize.py --checkpoint_path IN --mode int8 [--out FILE]

Scheme "int8": every linear layer's weight becomes int8 with one fp32 scale per output channel
(symmetric, scale = max|w| / 127). The token embedding stays in the checkpoint's float dtype, and so does
the output projection when it is tied to the embedding. The checkpoint's metadata says all of this.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from checkpoint import (CheckpointInfo, load_tensors, model_state_dict, read_checkpoint_info, resolve_checkpoint_path,
                        save_checkpoint)
from model import Transformer

QUANT_MODES = ("int8",)
INT8_MAX = 127
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


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8. weight (N, K) float -> (int8 (N, K), fp32 scales (N,))."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # (N,)
    q = torch.round(w / scales.unsqueeze(1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def quantization_metadata(mode: str, tie_word_embeddings: bool) -> dict[str, Any]:
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; choose one of: {', '.join(QUANT_MODES)}")
    kept = ["tok_embeddings"] + (["output (tied to tok_embeddings)"] if tie_word_embeddings else [])
    return {"scheme": mode, "granularity": "per-output-channel", "scale_dtype": "float32", "not_quantized": kept}


def quantized_linear_names(n_layer: int, tie_word_embeddings: bool) -> list[str]:
    names = [f"layers.{i}.{part}" for i in range(n_layer) for part in QUANTIZED_LINEARS]
    return names if tie_word_embeddings else names + ["output"]


def quantize_state_dict(tensors: dict[str, Tensor], n_layer: int, tie_word_embeddings: bool) -> dict[str, Tensor]:
    out = dict(tensors)
    for name in quantized_linear_names(n_layer, tie_word_embeddings):
        weight = out.pop(f"{name}.weight")
        out[f"{name}.weight"], out[f"{name}.scales"] = quantize_int8(weight)
    return out


def _swap_linears(model: nn.Module, build: Any) -> None:
    tied = model.args.tie_word_embeddings
    for name in quantized_linear_names(model.args.n_layer, tied):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, build(getattr(parent, child)))


def prepare_quantized_structure(model: nn.Module, quantization: dict[str, Any]) -> None:
    """Give a (meta-device) model the module structure that a checkpoint's quantization needs."""
    scheme = quantization.get("scheme", "none")
    if scheme == "none":
        return
    if scheme != "int8":
        raise ValueError(f"checkpoint uses quantization {scheme!r}, which this Redline cannot load; upgrade Redline")
    _swap_linears(model, lambda lin: Int8Linear(lin.in_features, lin.out_features, device=lin.weight.device))


def model_quantization(model: nn.Module) -> str:
    """The scheme the model runs in now: "int8" once quantized (from its checkpoint or in memory), else "none"."""
    return "int8" if any(isinstance(m, Int8Linear) for m in model.modules()) else "none"


@torch.no_grad()
def quantize_(model: nn.Module, mode: str) -> nn.Module:
    """Quantize a loaded model in place (used by `LLM.load(path, quantize="int8")`)."""
    quantization_metadata(mode, model.args.tie_word_embeddings)  # validates the mode
    if model_quantization(model) != "none":
        raise ValueError("the model is already quantized; load the unquantized checkpoint to quantize it")

    def build(lin: nn.Linear) -> Int8Linear:
        q = Int8Linear(lin.in_features, lin.out_features, device=lin.weight.device)
        q.weight, q.scales = quantize_int8(lin.weight)
        return q

    _swap_linears(model, build)
    return model


def load_model(info: CheckpointInfo, device: torch.device | str, dtype: torch.dtype | None = None) -> Transformer:
    """Build the model that the checkpoint describes, with its quantization's module structure, and load its
    weights (no extra copies, no guessing)."""
    dtype = dtype or info.dtype
    with torch.device("meta"):
        model = Transformer(info.args)
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
        if tensor.is_floating_point() and not name.endswith(".scales"):
            tensors[name] = tensor.to(dtype)
    model.load_state_dict(tensors, strict=False, assign=True)
    if info.args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.rope = torch.empty(0, device=device)
    return model.eval()


@dataclass(frozen=True)
class QuantizeArgs:
    checkpoint_path: Path
    mode: str
    out: Path | None


def quantize_checkpoint(checkpoint_path: str | Path, mode: str, out: str | Path | None = None) -> Path:
    info = read_checkpoint_info(checkpoint_path)
    if info.scheme != "none":
        raise ValueError(f"{info.path} is already quantized ({info.scheme}); quantize the unquantized checkpoint")
    quantization = quantization_metadata(mode, info.args.tie_word_embeddings)
    out_path = Path(out) if out is not None else info.path.with_name(f"{info.path.name.split('.')[0]}.{mode}.safetensors")
    if out_path.resolve() == info.path.resolve():
        raise ValueError(f"--out {out_path} would overwrite the input; choose another file name")
    tensors = quantize_state_dict(load_tensors(info), info.args.n_layer, info.args.tie_word_embeddings)
    new_info = CheckpointInfo(path=out_path, args=info.args, dtype=info.dtype, quantization=quantization)
    return save_checkpoint(out_path, tensors, new_info)


def parse_args(argv: list[str] | None) -> QuantizeArgs:
    parser = argparse.ArgumentParser(description="Write a weight-only quantized copy of a Redline checkpoint.")
    parser.add_argument("--checkpoint_path", type=Path, required=True, help="Redline checkpoint file or its folder")
    parser.add_argument("--mode", required=True, help=f"quantization mode: {', '.join(QUANT_MODES)}")
    parser.add_argument("--out", type=Path, default=None, help="output file (default: beside the input, NAME.MODE.safetensors)")
    ns = parser.parse_args(argv)
    if ns.mode not in QUANT_MODES:
        raise ValueError(f"unknown --mode {ns.mode!r}; choose one of: {', '.join(QUANT_MODES)}")
    return QuantizeArgs(checkpoint_path=ns.checkpoint_path, mode=ns.mode, out=ns.out)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
        before = resolve_checkpoint_path(cfg.checkpoint_path).stat().st_size
        path = quantize_checkpoint(cfg.checkpoint_path, cfg.mode, cfg.out)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    after = path.stat().st_size
    print(f"{path}\nsize: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB ({after / before:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
