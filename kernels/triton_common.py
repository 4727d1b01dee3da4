"""What the Triton sources share: grid dependency control (PDL) and whether a launch asks for it, and the gated
activations of the GEMV epilogues.

Imports Triton: only the Triton launchers import this module, on the first GPU call.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from .device import DeviceCaps

try:  # Triton >= 3.3 exposes grid dependency control (PDL)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - old Triton: PDL is never requested then
    gdc_launch_dependents = gdc_wait = None


def pdl_default(caps: DeviceCaps) -> bool:
    """Programmatic dependent launch where the GPU supports it (NVIDIA sm90+) and Triton exposes it;
    REDLINE_PDL=0 turns it off for comparisons."""
    if os.environ.get("REDLINE_PDL", "1") == "0" or gdc_wait is None:
        return False
    return caps.supports_pdl


# 2 sqrt(2 / pi): gelu's tanh approximation as a sigmoid, since 0.5 (1 + tanh u) == sigmoid(2 u).
GELU_TANH_SCALE = tl.constexpr(1.5957691216057308)


@triton.jit
def gated(gate, up, GELU: tl.constexpr, out_ty: tl.constexpr):
    """act(gate) * up in fp32 with the unfused model's roundings to out_ty (the gate and up projections, act(gate)):
    act is silu (SwiGLU), or with GELU gelu's tanh approximation (GeGLU: Gemma)."""
    gate = gate.to(out_ty).to(tl.float32)
    if GELU:
        z = GELU_TANH_SCALE * (gate + 0.044715 * gate * gate * gate)
    else:
        z = gate
    act = (gate * tl.sigmoid(z)).to(out_ty).to(tl.float32)
    return act * up.to(out_ty).to(tl.float32)
