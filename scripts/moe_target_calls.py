"""The mixture-of-experts calls scripts/check_targets.py records on each target, on meta tensors through the
launchers redline::moe_experts calls (kernels/triton_moe.py): the GEMV kernels for a few tokens, the grouped
kernels for more, for each MoE model shape, dtype, token count, activation and expert-id dtype, and the router's
softmax and top-k kernel (redline::moe_route) for each expert count, k, token count, dtype and renormalization
(moe_calls); and the shared memory the dispatcher assumed for a grouped kernel's compiled configuration
(grouped_moe_smem).

Kept apart from check_targets.py (which imports it) so that module stays within one readable file; nothing here
compiles. `record` is check_targets' launch recorder: its `call` names the call being made.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from redline.kernels import configs, moe
from redline.kernels.device import DeviceCaps


@dataclass(frozen=True)
class MoeShape:
    """The expert shapes of one MoE model."""

    name: str
    dim: int
    n_experts: int
    top_k: int
    hidden: int  # I, each expert's intermediate width


MOE_MODELS = (
    MoeShape("olmoe-1b-7b", 2048, 64, 8, 1024),
    MoeShape("qwen3-30b-a3b", 2048, 128, 8, 768),
    MoeShape("mixtral-8x7b", 4096, 8, 2, 14336),
)
# Tokens per call: the GEMV kernels up to kernels.configs.MOE_GEMV_MAX_TOKENS, then batches and prompts whose rows
# per expert give each grouped tile height (configs.moe_block_m).
MOE_TOKENS = (1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
ID_DTYPES = (torch.int64, torch.int32)
INT4_GROUP = 128  # quantize.py's default group size, which divides every shape above
# The router's calls: expert counts of Mixtral (8), OLMoE (64) and Qwen3-MoE (128), with k of 2 (Mixtral) and 8 (the
# others), over decode, batch and prompt token counts (these change only the grid, so they compile alike).
ROUTE_EXPERTS = (8, 64, 128)
ROUTE_TOP_K = (2, 8)
ROUTE_TOKENS = (1, 4, 256, 4096)


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=dtype)


def moe_calls(record, models: Iterable[MoeShape], dtypes: Iterable[torch.dtype],
              tokens: Iterable[int] = MOE_TOKENS) -> list[str]:
    """Run the op's launcher for every model shape, dtype, token count, activation (silu, gelu) and expert-id dtype
    (int64, int32; the grouped kernels read the sorted layout's int32 instead), then with int8 experts (silu, int64
    ids; bf16 and fp16 activations) and int4 experts in groups of INT4_GROUP (silu, int64 ids; under fp32 activations
    only the GEMVs: the grouped path takes the reference there by design), with the path and config the op would
    choose, setting record.call before each, then route_calls; returns the calls that take the reference (no config
    fits)."""
    from redline.kernels import triton_moe

    dtypes = tuple(dtypes)
    fallbacks = []
    for shape, dtype, n_tokens in itertools.product(models, dtypes, tokens):
        x = _meta(n_tokens, shape.dim, dtype=dtype)
        w13 = _meta(shape.n_experts, 2 * shape.hidden, shape.dim, dtype=dtype)
        w2 = _meta(shape.n_experts, shape.dim, shape.hidden, dtype=dtype)
        weights = _meta(n_tokens, shape.top_k, dtype=torch.float32)
        label = f"{shape.name} moe {str(dtype)[6:]} tokens={n_tokens}"
        gemv = moe.uses_gemv(x)
        int8 = (_meta(*w13.shape, dtype=torch.int8), _meta(*w2.shape, dtype=torch.int8),
                (_meta(*w13.shape[:2], dtype=torch.float32), _meta(*w2.shape[:2], dtype=torch.float32)))
        variants = [(gelu, id_dtype, None) for gelu in (False, True) for id_dtype in ID_DTYPES[:2 if gemv else 1]]
        int4 = (_meta(shape.n_experts, 2 * shape.hidden, shape.dim // 2, dtype=torch.uint8),
                _meta(shape.n_experts, shape.dim, shape.hidden // 2, dtype=torch.uint8),
                (_meta(shape.n_experts, 2 * shape.hidden, shape.dim // INT4_GROUP, 2, dtype=torch.float16),
                 _meta(shape.n_experts, shape.dim, shape.hidden // INT4_GROUP, 2, dtype=torch.float16)))
        # int8 experts under fp32 activations take the reference by design (moe.grouped_config): a CPU setting
        quantized_variants = [(False, torch.int64, int8)] if dtype != torch.float32 else []
        quantized_variants += [(False, torch.int64, int4)] if gemv or dtype != torch.float32 else []
        for gelu, id_dtype, quantized in variants + quantized_variants:
            kind = "" if quantized is None else " int8 experts" if quantized is int8 else " int4 experts"
            record.call = f"{label}{kind} gelu={gelu} ids={str(id_dtype)[6:]}"
            ids = _meta(n_tokens, shape.top_k, dtype=id_dtype)
            up, down, scales = quantized or (w13, w2, None)
            if gemv:
                triton_moe.moe_gemv(x, up, down, ids, weights, gelu, scales=scales)
                continue
            config = moe.grouped_config(x, up, ids)
            if config is None:
                fallbacks.append(record.call)
                continue
            triton_moe.moe_grouped(x, up, down, ids, weights, gelu, config, scales=scales)
    route_calls(record, dtypes)
    return fallbacks


def route_calls(record, dtypes: Iterable[torch.dtype]) -> None:
    """Run redline::moe_route's launcher for every expert count, k (k <= E), token count, logits dtype and
    renormalization, setting record.call before each (every E here is within moe.ROUTE_MAX_EXPERTS: none takes the
    reference)."""
    from redline.kernels import triton_moe

    for n_experts, top_k, n_tokens, dtype, renormalize in itertools.product(
            ROUTE_EXPERTS, ROUTE_TOP_K, ROUTE_TOKENS, dtypes, (False, True)):
        if top_k <= n_experts:
            record.call = f"route {str(dtype)[6:]} experts={n_experts} k={top_k} tokens={n_tokens} renorm={renormalize}"
            triton_moe.moe_route(_meta(n_tokens, n_experts, dtype=dtype), top_k, renormalize)


def grouped_moe_smem(kernel: str, constexprs: dict, options: dict, elt_bytes: int, caps: DeviceCaps) -> int:
    """The shared memory configs.moe_dot_smem_bytes estimates for a grouped kernel's configuration (kernel: its
    name; constexprs and options: its specialization's), with two weight tiles in the gate/up kernel, one in the
    down kernel (int4 tiles count as converted to x's dtype)."""
    cfg = configs.MoeDotConfig(constexprs["BLOCK_M"], constexprs["BLOCK_N"], constexprs["BLOCK_K"],
                               options["num_warps"], options["num_stages"])
    return configs.moe_dot_smem_bytes(cfg, elt_bytes, 2 if kernel.startswith("_grouped_gate_up") else 1, caps)
