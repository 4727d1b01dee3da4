"""Redline's GPU fast paths, applied to a plain model.Transformer from outside.

    from redline import kernels
    if kernels.available():
        kernels.use_kernels(model)        # swaps linears and attention for the kernel modules, in place
        step = kernels.FusedDecode(model)  # batch-1 decode in five kernels per block; else model(...)

Every op is a torch.library custom op (torch.ops.redline.*) with a plain PyTorch reference, which the tests compare
against; importing this package registers them. On the CPU the float ops run their references and the quantized ones
a C++ GEMV (`use_cpu_kernels(model)`, which LLM applies to a CPU model; cpu_linear.py). Triton is imported only
when a GPU kernel first runs, so the package imports on a machine without Triton or a GPU.

    device.py          what the running GPU supports (DeviceCaps, device_caps; target_caps and simulated for
                       named targets such as "gfx90a", checked without the hardware)
    configs.py         the launch config tables (gemv_config, dot_config, attention_config), and the tensor-core
                       and attention choices fitted to the GPU's shared memory (fitted_dot_config, ...)
    linear.py          redline::linear, int8_linear, int4_linear, fp8_linear, fused_linear; KernelLinear,
                       KernelInt8Linear, KernelInt4Linear, KernelFp8Linear; exact_head_linear, ExactInt8Head;
                       use_cpu_kernels
    cpu_linear.py      the quantized ops on the CPU: cpu_gemv.cpp (int8 / int4 GEMV, built once per machine) for few
                       rows, dequantize-then-F.linear for more
    attention.py       redline::decode_attention, decode_attention_qkv, prefill_rope_cache; KernelAttention;
                       paged_attention (a paged decode step's attention, one op with the GPU kernels)
    paged_attention.py redline::paged_decode_attention, paged_decode_attention_qkv, paged_prefill_attention (a paged
                       KV cache)
    moe.py             redline::moe_experts (a mixture-of-experts layer's chosen experts), redline::moe_route (its
                       router's softmax and top-k); KernelMoE, KernelInt8MoE, KernelInt4MoE
    fused_decode.py    FusedDecode
    triton_linear.py, triton_int4.py, triton_int4_dot.py, triton_fp8.py, triton_attention.py, triton_paged_attention.py,
                       triton_moe.py, triton_common.py: the Triton sources and launchers
"""
from __future__ import annotations

import torch

from redline.model import Attention, MoEFeedForward, Transformer
from redline.quantize import Int4MoEFeedForward, Int8MoEFeedForward

from . import paged_attention  # noqa: F401  (registers torch.ops.redline.paged_*)
from .attention import KernelAttention
from .device import DeviceCaps, device_caps, fp8_refusal, triton_importable
from .fused_decode import FusedDecode, fused_decode_refusal
from .linear import KernelFp8Linear, KernelInt4Linear, KernelInt8Linear, KernelLinear, swap_linears, use_cpu_kernels
from .moe import KernelInt4MoE, KernelInt8MoE, KernelMoE  # (importing it registers torch.ops.redline.moe_experts)

__all__ = ["DeviceCaps", "FusedDecode", "fp8_refusal", "fused_decode_refusal", "kernel_attention_fits",
           "KernelAttention", "KernelFp8Linear", "KernelInt4Linear", "KernelInt8Linear", "KernelLinear", "available",
           "device_caps", "KernelInt4MoE", "KernelInt8MoE", "KernelMoE", "use_cpu_kernels", "use_kernels"]


def available() -> bool:
    """Whether the Triton kernels can run here: a CUDA/HIP GPU is visible and Triton is importable."""
    return torch.cuda.is_available() and triton_importable()


def use_kernels(model: Transformer) -> Transformer:
    """Swap the model's modules for the kernel ones, in place, and return it: float nn.Linear -> KernelLinear
    (redline::linear), quantize.Int8Linear -> KernelInt8Linear (redline::int8_linear), quantize.Int4Linear ->
    KernelInt4Linear (redline::int4_linear), quantize.Fp8Linear -> KernelFp8Linear (redline::fp8_linear), model.Attention -> KernelAttention (redline::decode_attention for
    one-token steps, redline::prefill_rope_cache for prefills from position 0, redline::paged_decode_attention_qkv
    for the engine's decode steps), model.MoEFeedForward -> KernelMoE, quantize.Int8MoEFeedForward -> KernelInt8MoE
    and quantize.Int4MoEFeedForward -> KernelInt4MoE (redline::moe_experts). Only classes change, so weights (and a tied output head) stay shared; applying it twice is a no-op. Where no kernel fits
    (the CPU, unsupported shapes) the ops run their PyTorch references."""
    swap_linears(model)
    for module in model.modules():
        if type(module) is Attention and kernel_attention_fits(module):
            module.__class__ = KernelAttention
        elif type(module) is MoEFeedForward:
            module.__class__ = KernelMoE
        elif type(module) is Int8MoEFeedForward:
            module.__class__ = KernelInt8MoE
        elif type(module) is Int4MoEFeedForward:
            module.__class__ = KernelInt4MoE
    return model


def kernel_attention_fits(attention: Attention) -> bool:
    """Whether the attention kernels compute this layer: plain softmax attention at the default scale (q/k norms
    run before the kernels, on the projection; partial rotary and sliding windows in them). A layer that does not
    fit keeps model.Attention (the explicit soft-capped math), with its projections still on the kernel linears."""
    a = attention.args
    return not a.attn_softcap and a.attention_scale in (0.0, a.head_dim ** -0.5)
