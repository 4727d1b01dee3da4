"""The fused batch-1 decode GEMV calls scripts/check_targets.py records on each target, on meta tensors through the
launchers kernels.linear.fused_linear calls: each projection's fused forms (FUSED_GEMVS), and Gemma's forms (a norm
computed in the kernel with fp32 1 + w weights; GeGLU for the gate/up projection).

Kept apart from check_targets.py (which imports it and hands in the weights) so that module stays within one
readable file; nothing here compiles. `record` is check_targets' launch recorder: its `call` names the call being
made.
"""
from __future__ import annotations

import itertools

import torch

# Fused batch-1 decode GEMVs (kernels.fused_decode): (projection, norm: 0 none / 1 computed / 2 handed on, swiglu,
# residual with a sum of squares out).
FUSED_GEMVS = (("wqkv", 1, False, False), ("wqkv", 2, False, False), ("wo", 0, False, True),
               ("w13", 2, True, False), ("w2", 0, False, True), ("output", 2, False, False))
NORM_SUM_LANES = 32  # kernels.fused_decode.NORM_SUM_LANES


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=dtype)


def fused_gemv_calls(record, label: str, gemv, w: torch.Tensor, scales: torch.Tensor | None, n: int, k: int,
                     x_dtype: torch.dtype, projection: str) -> None:
    """One row of x through `gemv` (triton_linear.gemv, or triton_int4.gemv_int4) in each fused form of this
    projection, with the arguments kernels.linear.fused_linear passes; a normed form also in Gemma's form."""
    lanes = _meta(NORM_SUM_LANES, dtype=torch.float32)
    fused = [f for f in FUSED_GEMVS if f[0] == projection]
    for (_, norm, swiglu, residual), gemma in itertools.product(fused, (False, True)):
        if gemma and not norm:
            continue
        record.call = f"{label} fused norm={norm}{' gemma' if gemma else ''}"
        out_n = n // 2 if swiglu else n
        gemv(_meta(1, k, dtype=x_dtype), w, scales, _meta(1, out_n, dtype=x_dtype),
             norm_weight=_meta(k, dtype=torch.float32 if gemma else x_dtype) if norm else None, eps=1e-5,
             residual=_meta(out_n, dtype=x_dtype) if residual else None, swiglu=swiglu,
             sq_in=lanes if norm == 2 and not gemma else None, sq_out=lanes if residual else None,
             gelu=gemma and swiglu)
