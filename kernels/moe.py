"""A mixture-of-experts layer's experts as one op, with a plain-PyTorch reference, and the module that calls it.

    torch.ops.redline.moe_experts(x, w13, w2, topk_ids, topk_weights, gelu=False, w13_scales=None,
                                  w2_scales=None)  -> (T, dim)

x (T, dim) bf16/fp16/fp32; w13 (E, 2I, dim) in x's dtype, expert e's gate projection in rows 0..I-1 and its up
projection in rows I..2I-1; w2 (E, dim, I); topk_ids (T, k) int64 or int32, each in [0, E); topk_weights (T, k)
fp32. Token t's output is sum_j topk_weights[t, j] * w2[e] @ (act(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])) with
e = topk_ids[t, j] and act silu, or gelu with the tanh approximation when gelu=True (GeGLU experts), accumulated in
fp32 and returned in x's dtype. int8 experts (quantize.Int8MoEFeedForward): w13 and w2 int8 with w13_scales (E, 2I)
and w2_scales (E, dim) fp32, one per expert and output row; expert e's weights are then w13[e] * w13_scales[e, :, None]
and w2[e] * w2_scales[e, :, None], and the kernels convert the int8 rows in registers (they read a byte a weight).
int4 experts (quantize.Int4MoEFeedForward): w13 uint8 (E, 2I, dim/2) and w2 uint8 (E, dim, I/2) in quantize.py's
int4 layout per row, w13_scales fp16 (E, 2I, dim/G, 2) and w2_scales fp16 (E, dim, I/G, 2) its [scale, offset] per
row and group of G inputs (one G for both); their kernels read half a byte a weight and dequantize in registers.

On a CUDA/HIP device with Triton, for weights with unit stride along their rows, the op runs the kernels of
triton_moe.py, which read only the chosen experts' weights: up to configs.MOE_GEMV_MAX_TOKENS tokens the GEMV
kernels (each (token, expert) pair reads its expert's rows), more tokens the grouped tensor-core kernels (the pairs
sorted by expert on the device, each expert's weight tiles read once per tile of its rows), where a config fits the
GPU's shared memory (configs.fitted_moe_dot_config, fitted to device.DeviceCaps). Elsewhere (the CPU, no config)
the reference below runs. Neither reads a tensor on the host and every shape follows from the input shapes, so the
op is CUDA-graph capturable; it is opaque to torch.compile (custom_op + register_fake).

    torch.ops.redline.moe_route(logits, top_k, renormalize)  -> weights (T, k) fp32, ids (T, k) int64

is the router's choice, model.MoEFeedForward.route after the gate linear: softmax in fp32 over logits (T, E)
bf16/fp16/fp32, the top_k probabilities (largest first) and their experts, divided by their sum when renormalize. On
a CUDA/HIP device with Triton and E <= ROUTE_MAX_EXPERTS it is one kernel (triton_moe.moe_route), elsewhere
moe_route_reference; capturable and opaque to torch.compile like moe_experts.

KernelMoE is model.MoEFeedForward with its routing and its experts on these ops, KernelInt8MoE and KernelInt4MoE the
same for int8 and int4 experts; kernels.use_kernels swaps them in. On the CPU, kernels.use_cpu_kernels swaps in
CpuMoE, CpuInt8MoE and CpuInt4MoE instead, which run only the chosen experts, on their stored weights (the op
redline::moe_experts_cpu, opaque to torch.compile, around moe_experts_cpu: cpu_linear's int8 / int4 GEMVs for a few
tokens, each expert once over its tokens for more; F.linear on float experts).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from redline.model import MoEFeedForward
from redline.quantize import Int4MoEFeedForward, Int8MoEFeedForward, dequantize_experts_int4

from .configs import MOE_GEMV_MAX_TOKENS, MoeDotConfig, fitted_moe_dot_config
from .device import device_caps, triton_importable
from .linear import FLOAT_DTYPES

ID_DTYPES = (torch.int64, torch.int32)
# Elements of gathered expert weights the reference holds at once: it takes this many tokens' experts per step, so
# a long batch on the fallback path does not gather every token's k experts at once.
REFERENCE_CHUNK_ELEMENTS = 1 << 24
# Experts up to which redline::moe_route runs its kernel: it holds a token's whole row of logits in registers (8 a
# lane over triton_moe.ROUTE_MAX_WARPS warps at this size), and no released MoE model has more experts.
ROUTE_MAX_EXPERTS = 1024
# Tokens up to which the CPU runs each (token, chosen expert) pair on its own (cpu_linear's int8 / int4 GEMVs, or
# F.linear on a float expert's rows); more are grouped by expert.
CPU_LOOP_TOKENS = 8


@functools.cache
def triton_moe():
    """kernels.triton_moe, imported on first use (it imports triton)."""
    from . import triton_moe as module

    return module


# --- dispatch ---


def kernel_supported(x: Tensor, w13: Tensor, w2: Tensor) -> bool:
    """The Triton kernels take these tensors: on a CUDA/HIP device, weights with unit stride along their rows,
    Triton importable."""
    return x.is_cuda and w13.stride(-1) == 1 and w2.stride(-1) == 1 and triton_importable()


def uses_gemv(x: Tensor) -> bool:
    """Whether the op takes the GEMV kernels (few tokens) rather than the grouped ones."""
    return x.shape[0] <= MOE_GEMV_MAX_TOKENS


def grouped_config(x: Tensor, w13: Tensor, topk_ids: Tensor) -> MoeDotConfig | None:
    """The grouped kernels' config on x's GPU, or None where none fits its shared memory (the op then runs the
    reference). int8 experts under fp32 activations have none: converting their tiles for fp32 dots takes shared
    memory beyond the configs' estimate (cross-compiled for sm80-sm90), and fp32 activations are a CPU setting; int4
    experts under fp32 activations have none either, for the same reason."""
    if w13.dtype in (torch.int8, torch.uint8) and x.dtype == torch.float32:
        return None
    return fitted_moe_dot_config(topk_ids.numel(), w13.shape[0], x.element_size(), device_caps(x.device))


def route_kernel_supported(logits: Tensor) -> bool:
    """The routing kernel takes these logits: on a CUDA/HIP device, at most ROUTE_MAX_EXPERTS experts, Triton
    importable."""
    return logits.is_cuda and logits.shape[1] <= ROUTE_MAX_EXPERTS and triton_importable()


# --- reference (plain PyTorch, fp32) ---


def moe_route_reference(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """model.MoEFeedForward.route's choice from logits (T, E): softmax in fp32, torch.topk (sorted), optionally
    divided by the chosen probabilities' sum; weights (T, k) fp32 and ids (T, k) int64."""
    probs = logits.float().softmax(dim=-1)  # (T, E)
    weights, ids = probs.topk(top_k, dim=-1)  # (T, k) each, largest first
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.contiguous(), ids.contiguous()


def activation(gate: Tensor, gelu: bool) -> Tensor:
    """silu(gate), or gelu(gate) with the tanh approximation."""
    return F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)


def moe_experts_reference(x: Tensor, w13: Tensor, w2: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                          gelu: bool = False, w13_scales: Tensor | None = None,
                          w2_scales: Tensor | None = None) -> Tensor:
    """The op in fp32 with PyTorch ops: each token's k experts' weights gathered (a few tokens per step, int8 ones
    times their row scales, int4 ones dequantized), their gated MLPs of the token, weighted and summed; returned in
    x's dtype, (T, dim)."""
    n_tokens, dim = x.shape
    int4 = w13.dtype == torch.uint8
    top_k, hidden = topk_ids.shape[1], w2.shape[2] * (2 if int4 else 1)
    out = torch.zeros((n_tokens, dim), dtype=torch.float32, device=x.device)  # (T, dim)
    step = max(1, REFERENCE_CHUNK_ELEMENTS // max(top_k * 3 * hidden * dim, 1))
    for start in range(0, n_tokens, step):  # fixed by the shapes: no host sync
        rows = slice(start, start + step)
        ids = topk_ids[rows].long()  # (n, k)
        if int4:
            up_rows = dequantize_experts_int4(w13[ids], w13_scales[ids])  # (n, k, 2I, dim)
            down_rows = dequantize_experts_int4(w2[ids], w2_scales[ids])  # (n, k, dim, I)
        else:
            up_rows, down_rows = w13[ids].float(), w2[ids].float()  # (n, k, 2I, dim), (n, k, dim, I)
        if w13_scales is not None and not int4:
            up_rows = up_rows * w13_scales[ids].unsqueeze(-1)
            down_rows = down_rows * w2_scales[ids].unsqueeze(-1)
        gate_up = torch.einsum("nd,nkhd->nkh", x[rows].float(), up_rows)  # (n, k, 2I)
        h = activation(gate_up[..., :hidden], gelu) * gate_up[..., hidden:]  # (n, k, I)
        down = torch.einsum("nki,nkdi->nkd", h, down_rows)  # (n, k, dim)
        out[rows] = (down * topk_weights[rows].float().unsqueeze(-1)).sum(dim=1)
    return out.to(x.dtype)


def moe_experts_cpu(x: Tensor, w13: Tensor, w2: Tensor, topk_ids: Tensor, topk_weights: Tensor, gelu: bool = False,
                    w13_scales: Tensor | None = None, w2_scales: Tensor | None = None) -> Tensor:
    """The op on the CPU: each chosen expert through its own stored weights, with fp32 accumulation (the reference's
    arithmetic, to fp32 rounding); (T, dim) in x's dtype. Up to CPU_LOOP_TOKENS tokens one (token, expert) pair at a
    time (GEMVs); more, the tokens grouped by expert on the host, so each expert that some token chose runs once
    over its tokens (a prompt computes only its chosen experts)."""
    hidden = w2.shape[2] * (2 if w13.dtype == torch.uint8 else 1)
    out = torch.zeros(x.shape, dtype=torch.float32)  # (T, dim)
    routing = topk_weights.float()
    if x.shape[0] <= CPU_LOOP_TOKENS:
        groups = [(torch.tensor([t]), routing[t, j:j + 1], e) for t, experts in enumerate(topk_ids.tolist())
                  for j, e in enumerate(experts)]  # the host reads the routing: the CPU has no graph to keep
    else:
        flat = topk_ids.reshape(-1).long()  # (T k,)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
        pairs = order.split(counts)  # the (token, choice) pairs of each expert, in token order
        groups = [(p // topk_ids.shape[1], routing.reshape(-1)[p], e) for e, p in enumerate(pairs) if p.numel()]
    for tokens, weight, e in groups:
        gate_up = _expert_linear(x[tokens].float(), w13, w13_scales, e)  # (n, 2I)
        h = activation(gate_up[:, :hidden], gelu) * gate_up[:, hidden:]  # (n, I)
        out.index_add_(0, tokens, _expert_linear(h, w2, w2_scales, e) * weight.unsqueeze(1))
    return out.to(x.dtype)


def _expert_linear(x: Tensor, weight: Tensor, scales: Tensor | None, e: int) -> Tensor:
    """x (M, K) fp32 through expert e of stacked weights (E, N, K) (int8 with row scales, int4 with group scales, or
    float; bf16 and fp16 experts multiply in their own dtype, as model.py's experts do, with no fp32 copy of the
    expert): (M, N) fp32."""
    from .cpu_linear import int4_linear_cpu, int8_linear_cpu

    if weight.dtype == torch.int8:
        return int8_linear_cpu(x, weight[e], scales[e])
    if weight.dtype == torch.uint8:
        return int4_linear_cpu(x, weight[e], scales[e])
    return F.linear(x.to(weight.dtype), weight[e]).float()


# --- validation ---


def _check_moe(x: Tensor, w13: Tensor, w2: Tensor, topk_ids: Tensor, topk_weights: Tensor,
               w13_scales: Tensor | None = None, w2_scales: Tensor | None = None) -> None:
    name = "redline.moe_experts"
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"{name}: x must be (T, dim), w13 (E, 2I, dim) and w2 (E, dim, I), got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)} and {tuple(w2.shape)}")
    if w13.dtype == torch.uint8 or w2.dtype == torch.uint8:
        _check_int4(x, w13, w2, w13_scales, w2_scales)
        return _check_routing(x, w2.shape[0], topk_ids, topk_weights, w13, w2, w13_scales, w2_scales)
    n_experts, dim, hidden = w2.shape
    if w13.shape != (n_experts, 2 * hidden, dim) or x.shape[1] != dim:
        raise ValueError(f"{name}: w13 {tuple(w13.shape)} must be (E, 2I, dim) = {(n_experts, 2 * hidden, dim)} "
                         f"for w2 {tuple(w2.shape)} (E, dim, I), and x {tuple(x.shape)} must have dim={dim}")
    if n_experts == 0 or hidden == 0:
        raise ValueError(f"{name}: the layer needs at least one expert and I > 0, got w2 {tuple(w2.shape)}")
    if (w13_scales is None) != (w2_scales is None):
        raise ValueError(f"{name}: int8 experts need both w13_scales and w2_scales; give both or neither")
    if w13_scales is not None:
        if x.dtype not in FLOAT_DTYPES or w13.dtype != torch.int8 or w2.dtype != torch.int8:
            raise ValueError(f"{name}: with scales, w13 and w2 must be int8 and x bf16, fp16 or fp32, got "
                             f"{w13.dtype}, {w2.dtype} and {x.dtype}")
        for scales, weight, label in ((w13_scales, w13, "w13"), (w2_scales, w2, "w2")):
            if scales.shape != weight.shape[:2] or scales.dtype != torch.float32:
                raise ValueError(f"{name}: {label}_scales must be fp32 of shape {tuple(weight.shape[:2])} (one per "
                                 f"expert and output row), got {tuple(scales.shape)} of {scales.dtype}")
    elif x.dtype not in FLOAT_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"{name}: x, w13 and w2 must share one dtype of bf16, fp16 or fp32 (or int8 weights with "
                         f"scales), got {x.dtype}, {w13.dtype}, {w2.dtype}")
    _check_routing(x, n_experts, topk_ids, topk_weights, w13, w2, w13_scales, w2_scales)


def _check_int4(x: Tensor, w13: Tensor, w2: Tensor, w13_scales: Tensor | None, w2_scales: Tensor | None) -> None:
    """int4 experts: packed uint8 weights, fp16 [scale, offset] per row and group, one group size dividing both."""
    name = "redline.moe_experts"
    if w13.dtype != torch.uint8 or w2.dtype != torch.uint8 or w13_scales is None or w2_scales is None:
        raise ValueError(f"{name}: int4 experts need w13 and w2 uint8 with w13_scales and w2_scales, got "
                         f"{w13.dtype} and {w2.dtype}")
    n_experts, dim, hidden = w2.shape[0], w2.shape[1], 2 * w2.shape[2]
    if w13.shape != (n_experts, 2 * hidden, dim // 2) or x.shape[1] != dim or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: int4 w13 {tuple(w13.shape)} must be (E, 2I, dim/2) = "
                         f"{(n_experts, 2 * hidden, dim // 2)} for w2 {tuple(w2.shape)} (E, dim, I/2), and x "
                         f"{tuple(x.shape)} bf16, fp16 or fp32 with dim={dim}")
    if n_experts == 0 or hidden == 0:
        raise ValueError(f"{name}: the layer needs at least one expert and I > 0, got w2 {tuple(w2.shape)}")
    groups = (w13_scales.shape[2] if w13_scales.dim() == 4 else 0, w2_scales.shape[2] if w2_scales.dim() == 4 else 0)
    group = dim // groups[0] if groups[0] and dim % groups[0] == 0 else 0
    for scales, rows, k, label in ((w13_scales, 2 * hidden, dim, "w13"), (w2_scales, dim, hidden, "w2")):
        want = (n_experts, rows, k // group, 2) if group else None
        if (scales.dtype != torch.float16 or tuple(scales.shape) != want or group < 32 or group & (group - 1)
                or k % group):
            raise ValueError(f"{name}: int4 {label}_scales must be fp16 (E, N, K/G, 2) with one group size G (a "
                             f"power of two >= 32) dividing dim={dim} and I={hidden}, got {tuple(scales.shape)} of "
                             f"{scales.dtype}")


def _check_routing(x: Tensor, n_experts: int, topk_ids: Tensor, topk_weights: Tensor, *tensors: Tensor | None) -> None:
    name = "redline.moe_experts"
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.dtype not in ID_DTYPES:
        raise ValueError(f"{name}: topk_ids must be int64 or int32 of shape (T, k) with T={x.shape[0]}, "
                         f"got {tuple(topk_ids.shape)} of {topk_ids.dtype}")
    if not 1 <= topk_ids.shape[1] <= n_experts:
        raise ValueError(f"{name}: k={topk_ids.shape[1]} experts per token must be in 1..E={n_experts}")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise ValueError(f"{name}: topk_weights must be fp32 of topk_ids' shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)} of {topk_weights.dtype}")
    devices = {t.device for t in (x, topk_ids, topk_weights, *tensors) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"{name}: all inputs must be on one device, got {sorted(map(str, devices))}")


def _check_route(logits: Tensor, top_k: int) -> None:
    name = "redline.moe_route"
    if logits.dim() != 2:
        raise ValueError(f"{name}: logits must be (T, E), got shape {tuple(logits.shape)}; flatten the tokens first")
    if logits.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: logits must be bf16, fp16 or fp32, got {logits.dtype}; pass the router's output")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"{name}: top_k={top_k} must be in 1..E={logits.shape[1]}; choose fewer experts per token")


# --- the custom ops ---


@torch.library.custom_op("redline::moe_route", mutates_args=())
def moe_route(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """The top_k softmax probabilities of logits (T, E) and their experts, largest first, divided by their sum when
    renormalize: weights (T, k) fp32, ids (T, k) int64."""
    _check_route(logits, top_k)
    if route_kernel_supported(logits):
        return triton_moe().moe_route(logits, top_k, renormalize)
    return moe_route_reference(logits, top_k, renormalize)


@moe_route.register_fake
def _moe_route_fake(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    _check_route(logits, top_k)
    shape = (logits.shape[0], top_k)  # (T, k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)


@torch.library.custom_op("redline::moe_experts", mutates_args=())
def moe_experts(x: Tensor, w13: Tensor, w2: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                gelu: bool = False, w13_scales: Tensor | None = None, w2_scales: Tensor | None = None) -> Tensor:
    """sum_j topk_weights[t, j] * expert topk_ids[t, j]'s gated MLP of x[t]; x (T, dim) -> (T, dim)."""
    _check_moe(x, w13, w2, topk_ids, topk_weights, w13_scales, w2_scales)
    scales = (w13_scales, w2_scales)
    if kernel_supported(x, w13, w2):
        if uses_gemv(x):
            return triton_moe().moe_gemv(x, w13, w2, topk_ids, topk_weights, gelu, scales=scales)
        config = grouped_config(x, w13, topk_ids)
        if config is not None:
            return triton_moe().moe_grouped(x, w13, w2, topk_ids, topk_weights, gelu, config, scales=scales)
    return moe_experts_reference(x, w13, w2, topk_ids, topk_weights, gelu, *scales).contiguous()


@moe_experts.register_fake
def _moe_experts_fake(x: Tensor, w13: Tensor, w2: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                      gelu: bool = False, w13_scales: Tensor | None = None,
                      w2_scales: Tensor | None = None) -> Tensor:
    _check_moe(x, w13, w2, topk_ids, topk_weights, w13_scales, w2_scales)
    return x.new_empty(x.shape)  # (T, dim)


# --- the module use_kernels swaps in ---


class _KernelRoute:
    """The route() of the kernel modules: the router linear, then torch.ops.redline.moe_route; model.py's semantics
    (MoEFeedForward.route), weights rounded to x's dtype where the model's router rounds them."""

    def route(self, x2d: Tensor) -> tuple[Tensor, Tensor]:
        """x2d (T, dim) -> the chosen experts' weights (T, k) fp32 and ids (T, k) int64."""
        weights, ids = torch.ops.redline.moe_route(self.gate(x2d), self.top_k, self.norm_topk_prob)
        return (weights.to(x2d.dtype).float() if self.rounded else weights), ids


class KernelMoE(_KernelRoute, MoEFeedForward):
    """model.MoEFeedForward whose routing runs torch.ops.redline.moe_route and experts torch.ops.redline.moe_experts."""

    def experts(self, x2d: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """The weighted sum (T, dim) of the chosen experts' gated MLPs of x2d (T, dim), by the fused op; weights
        not in x's float dtype take MoEFeedForward's own path."""
        if self.w13.dtype != x2d.dtype or self.w2.dtype != x2d.dtype:
            return super().experts(x2d, topk_ids, topk_weights)
        return torch.ops.redline.moe_experts(x2d, self.w13, self.w2, topk_ids, topk_weights.float(), self.gelu)


class _QuantizedKernelExperts(_KernelRoute):
    """The route() and experts() of the quantized kernel modules: torch.ops.redline.moe_route, and
    torch.ops.redline.moe_experts with the experts' scales."""

    def experts(self, x2d: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """The weighted sum (T, dim) of the chosen quantized experts' gated MLPs of x2d (T, dim), by the fused op."""
        return torch.ops.redline.moe_experts(x2d, self.w13, self.w2, topk_ids, topk_weights.float(), self.gelu,
                                             self.w13_scales, self.w2_scales)


class KernelInt4MoE(_QuantizedKernelExperts, Int4MoEFeedForward):
    """quantize.Int4MoEFeedForward whose int4 experts run the op with their group scales (the kernels read half a
    byte a weight); the routing runs redline::moe_route."""


@torch.library.custom_op("redline::moe_experts_cpu", mutates_args=(), device_types="cpu")
def _moe_experts_cpu_op(x: Tensor, w13: Tensor, w2: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                        gelu: bool = False, w13_scales: Tensor | None = None,
                        w2_scales: Tensor | None = None) -> Tensor:
    """moe_experts_cpu as an op (its host loop is opaque to torch.compile); the arguments of redline::moe_experts."""
    _check_moe(x, w13, w2, topk_ids, topk_weights, w13_scales, w2_scales)
    return moe_experts_cpu(x, w13, w2, topk_ids, topk_weights, gelu, w13_scales, w2_scales)


@_moe_experts_cpu_op.register_fake
def _moe_experts_cpu_fake(x: Tensor, w13: Tensor, w2: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                          gelu: bool = False, w13_scales: Tensor | None = None,
                          w2_scales: Tensor | None = None) -> Tensor:
    return x.new_empty(x.shape)  # (T, dim)


class _CpuExperts:
    """The experts() of the CPU modules: redline::moe_experts_cpu (only the chosen experts run, on their stored
    weights)."""

    def experts(self, x2d: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        if x2d.device.type != "cpu":
            return super().experts(x2d, topk_ids, topk_weights)
        scales = (getattr(self, "w13_scales", None), getattr(self, "w2_scales", None))
        return torch.ops.redline.moe_experts_cpu(x2d, self.w13, self.w2, topk_ids, topk_weights.float(), self.gelu,
                                                 *scales)


class CpuMoE(_CpuExperts, MoEFeedForward):
    """model.MoEFeedForward with few tokens' experts run on their stored weights on the CPU."""


class CpuInt8MoE(_CpuExperts, Int8MoEFeedForward):
    """quantize.Int8MoEFeedForward with few tokens' experts on the CPU int8 GEMV."""


class CpuInt4MoE(_CpuExperts, Int4MoEFeedForward):
    """quantize.Int4MoEFeedForward with few tokens' experts on the CPU int4 GEMV."""


class KernelInt8MoE(_QuantizedKernelExperts, Int8MoEFeedForward):
    """quantize.Int8MoEFeedForward whose int8 experts run torch.ops.redline.moe_experts with their row scales (the
    kernels read a byte a weight); the routing runs redline::moe_route."""


def cpu_moe_class(module: torch.nn.Module) -> type:
    """The CPU module class for a mixture of experts (use_cpu_kernels), or the module's own class."""
    return {MoEFeedForward: CpuMoE, Int8MoEFeedForward: CpuInt8MoE, Int4MoEFeedForward: CpuInt4MoE}.get(
        type(module), type(module))
