"""kernels/moe.py: the reference against a per-token loop, the op's dispatch and validation, the configs, the
expert-sorted layout, KernelMoE, the Triton kernels against the reference in Triton's interpreter (a child process,
as tests/test_kernels_interpreter.py runs them), and on a GPU (real Qwen3-MoE and Mixtral shapes)."""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from redline import kernels, model
from redline.kernels import configs
from redline.kernels import moe
from redline.kernels.device import target_caps
from redline.quantize import (Int4MoEFeedForward, Int8MoEFeedForward, dequantize_experts_int4, quantize_experts_int4,
                              quantize_experts_int8)

from conftest import captured_graph, interpreted_errors_of

ROOT = Path(__file__).resolve().parents[1]
INTERPRETER_TOLERANCE = {"float32": 1e-5, "float16": 2e-3}


def moe_inputs(n_tokens, n_experts, top_k, dim, hidden, dtype=torch.float32, device="cpu", seed=0,
               ids_dtype=torch.int64):
    """x (T, dim), w13 (E, 2I, dim), w2 (E, dim, I) scaled to unit-size outputs, and routing where expert 0 is
    chosen by every token (first choice), the last expert by none, the others at random without repeats."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, dim, generator=gen)
    w13 = torch.randn(n_experts, 2 * hidden, dim, generator=gen) / math.sqrt(dim)
    w2 = torch.randn(n_experts, dim, hidden, generator=gen) / math.sqrt(hidden)
    others = [torch.randperm(n_experts - 2, generator=gen)[:top_k - 1] + 1 for _ in range(n_tokens)]
    ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64), o]) for o in others]) if n_tokens else \
        torch.zeros(0, top_k, dtype=torch.int64)
    weights = torch.rand(n_tokens, top_k, generator=gen)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return (x.to(dtype).to(device), w13.to(dtype).to(device), w2.to(dtype).to(device), ids.to(ids_dtype).to(device),
            weights.to(device))


def int8_experts(w13, w2):
    """(w13 int8, w2 int8, w13_scales, w2_scales) of float experts, as quantize.py stores them."""
    (q13, s13), (q2, s2) = quantize_experts_int8(w13.float()), quantize_experts_int8(w2.float())
    return q13, q2, s13, s2


def int4_experts(w13, w2, group_size=32):
    """(w13 uint8, w2 uint8, w13_scales, w2_scales) of float experts in quantize.py's int4 layout."""
    (q13, s13), (q2, s2) = quantize_experts_int4(w13.float(), group_size), quantize_experts_int4(w2.float(), group_size)
    return q13, q2, s13, s2


def per_token_loop(x, w13, w2, ids, weights, gelu):
    """Each token through each of its experts one at a time, in float64."""
    hidden = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate = w13[e, :hidden].double() @ xt
            up = w13[e, hidden:].double() @ xt
            if gelu:
                act = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
            else:
                act = gate / (1 + torch.exp(-gate))
            out[t] += float(weights[t, j]) * (w2[e].double() @ (act * up))
    return out


def rel_err(got, want) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-6)).item()


# --- the reference ---


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_reference_matches_per_token_loop_in_float64(gelu, ids_dtype):
    x, w13, w2, ids, weights = moe_inputs(7, 6, 2, 32, 24, dtype=torch.float64, ids_dtype=ids_dtype)
    got = moe.moe_experts_reference(x, w13, w2, ids, weights, gelu)
    assert got.dtype == torch.float64
    assert rel_err(got, per_token_loop(x, w13, w2, ids, weights, gelu)) <= 1e-6


def test_reference_chunks_tokens_like_one_pass(monkeypatch):
    args = moe_inputs(9, 5, 3, 16, 8)
    whole = moe.moe_experts_reference(*args)
    monkeypatch.setattr(moe, "REFERENCE_CHUNK_ELEMENTS", 1)  # one token per step
    assert torch.allclose(moe.moe_experts_reference(*args), whole, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_low_precision_accumulates_in_fp32(dtype):
    x, w13, w2, ids, weights = moe_inputs(5, 4, 2, 64, 32, dtype=dtype)
    got = moe.moe_experts_reference(x, w13, w2, ids, weights)
    assert got.dtype == dtype
    assert rel_err(got, per_token_loop(x, w13, w2, ids, weights, False)) <= 1e-2


@pytest.mark.parametrize("gelu", [False, True])
def test_reference_of_int8_experts_is_the_float_reference_of_their_dequantized_weights(gelu):
    x, w13, w2, ids, weights = moe_inputs(6, 5, 2, 32, 24)
    q13, q2, s13, s2 = int8_experts(w13, w2)
    got = moe.moe_experts_reference(x, q13, q2, ids, weights, gelu, s13, s2)
    want = moe.moe_experts_reference(x, q13.float() * s13.unsqueeze(-1), q2.float() * s2.unsqueeze(-1), ids, weights,
                                     gelu)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-6)
    assert rel_err(got, moe.moe_experts_reference(x, w13, w2, ids, weights, gelu)) <= 2e-2  # int8's own error


@pytest.mark.parametrize("gelu", [False, True])
def test_reference_of_int4_experts_is_the_float_reference_of_their_dequantized_weights(gelu):
    x, w13, w2, ids, weights = moe_inputs(6, 5, 2, 64, 32)
    q13, q2, s13, s2 = int4_experts(w13, w2)
    got = moe.moe_experts_reference(x, q13, q2, ids, weights, gelu, s13, s2)
    want = moe.moe_experts_reference(x, dequantize_experts_int4(q13, s13), dequantize_experts_int4(q2, s2), ids,
                                     weights, gelu)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-6)
    # int4 in groups of 32 through both projections: the largest error, over the largest output, measured 0.16-0.17
    assert 1e-3 < rel_err(got, moe.moe_experts_reference(x, w13, w2, ids, weights, gelu)) <= 0.25


# --- the op on the CPU: dispatch, validation, torch.compile ---


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n_tokens", [0, 1, 6])
def test_op_runs_the_reference_on_cpu(dtype, n_tokens):
    args = moe_inputs(n_tokens, 4, 2, 32, 16, dtype=dtype)
    assert not moe.kernel_supported(*args[:3])
    got = torch.ops.redline.moe_experts(*args, gelu=True)
    assert got.shape == (n_tokens, 32) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, moe.moe_experts_reference(*args, gelu=True))


def _args(**change):
    x, w13, w2, ids, weights = moe_inputs(3, 4, 2, 16, 8)
    args = dict(x=x, w13=w13, w2=w2, topk_ids=ids, topk_weights=weights)
    args.update(change)
    return args


@pytest.mark.parametrize("change,match", [
    (dict(x=torch.randn(3, 1, 16)), "x must be \\(T, dim\\)"),
    (dict(w13=torch.randn(4, 15, 16)), "must be \\(E, 2I, dim\\)"),
    (dict(x=torch.randn(3, 8)), "must have dim=16"),
    (dict(w13=torch.randn(0, 16, 16), w2=torch.randn(0, 16, 8)), "at least one expert"),
    (dict(x=torch.randn(3, 16).half()), "one dtype"),
    (dict(topk_ids=torch.zeros(3, 2, dtype=torch.int16)), "topk_ids must be int64 or int32"),
    (dict(topk_ids=torch.zeros(4, 2, dtype=torch.int64)), "with T=3"),
    (dict(topk_ids=torch.zeros(3, 5, dtype=torch.int64), topk_weights=torch.rand(3, 5)), "must be in 1..E=4"),
    (dict(topk_weights=torch.rand(3, 2).half()), "topk_weights must be fp32"),
    (dict(topk_weights=torch.rand(3, 3)), "topk_weights must be fp32 of topk_ids' shape"),
    (dict(topk_weights=torch.rand(3, 2, device="meta")), "one device"),
])
def test_validation_errors(change, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.redline.moe_experts(*_args(**change).values())


def _int8_args(**change):
    args = _args()
    args["w13"], args["w2"], args["w13_scales"], args["w2_scales"] = int8_experts(args["w13"], args["w2"])
    args.update(change)
    return args


@pytest.mark.parametrize("change,match", [
    (dict(w2_scales=None), "need both w13_scales and w2_scales"),
    (dict(w13=torch.randn(4, 16, 16)), "w13 and w2 must be int8"),
    (dict(w13_scales=torch.rand(4, 8)), r"w13_scales must be fp32 of shape \(4, 16\)"),
    (dict(w2_scales=torch.rand(4, 16).half()), "w2_scales must be fp32"),
    (dict(w2_scales=torch.rand(4, 16, device="meta")), "one device"),
])
def test_int8_validation_errors(change, match):
    args = _int8_args(**change)
    with pytest.raises(ValueError, match=match):
        torch.ops.redline.moe_experts(*list(args.values())[:5], False, args["w13_scales"], args["w2_scales"])


def _int4_args(**change):
    args = dict(zip(("x", "w13", "w2", "topk_ids", "topk_weights"), moe_inputs(3, 4, 2, 64, 32)))
    args["w13"], args["w2"], args["w13_scales"], args["w2_scales"] = int4_experts(args["w13"], args["w2"])
    args.update(change)
    return args


@pytest.mark.parametrize("change,match", [
    (dict(w2_scales=None), "int4 experts need w13 and w2 uint8 with w13_scales and w2_scales"),
    (dict(w2=torch.zeros(4, 64, 16, dtype=torch.int8)), "int4 experts need w13 and w2 uint8"),
    (dict(w13=torch.zeros(4, 64, 64, dtype=torch.uint8)), r"must be \(E, 2I, dim/2\)"),
    (dict(x=torch.randn(3, 32)), "with dim=64"),
    (dict(w13_scales=torch.zeros(4, 64, 2, 2)), "one group size G"),  # groups of 32 in w13, of 16 in w2: not one
    (dict(w2_scales=torch.zeros(4, 64, 2, 2, dtype=torch.float16)), "one group size G"),  # groups of 16 in w2
    (dict(w13_scales=torch.zeros(4, 64, 2, 2, dtype=torch.float16).float()), "must be fp16"),
    (dict(w13_scales=torch.zeros(4, 64, 4, 2, dtype=torch.float16),
          w2_scales=torch.zeros(4, 64, 2, 2, dtype=torch.float16)), "a power of two >= 32"),  # groups of 16
    (dict(topk_weights=torch.rand(3, 2, device="meta")), "one device"),
])
def test_int4_validation_errors(change, match):
    args = _int4_args(**change)
    with pytest.raises(ValueError, match=match):
        torch.ops.redline.moe_experts(*list(args.values())[:5], False, args["w13_scales"], args["w2_scales"])


def test_op_runs_the_int4_reference_on_cpu_and_passes_opcheck():
    args = _int4_args()
    scales = (args["w13_scales"], args["w2_scales"])
    got = torch.ops.redline.moe_experts(*list(args.values())[:5], True, *scales)
    assert torch.equal(got, moe.moe_experts_reference(*list(args.values())[:5], True, *scales))
    torch.library.opcheck(torch.ops.redline.moe_experts.default, tuple(args.values())[:5],
                          {"gelu": False, "w13_scales": scales[0], "w2_scales": scales[1]})


def test_op_runs_the_int8_reference_on_cpu():
    args = _int8_args()
    got = torch.ops.redline.moe_experts(*list(args.values())[:5], True, args["w13_scales"], args["w2_scales"])
    assert torch.equal(got, moe.moe_experts_reference(*list(args.values())[:5], True, args["w13_scales"],
                                                      args["w2_scales"]))


def test_opcheck_cpu():
    for gelu in (False, True):
        torch.library.opcheck(torch.ops.redline.moe_experts.default, moe_inputs(5, 4, 2, 16, 8), {"gelu": gelu})
    x, w13, w2, ids, weights = moe_inputs(5, 4, 2, 16, 8)
    q13, q2, s13, s2 = int8_experts(w13, w2)
    torch.library.opcheck(torch.ops.redline.moe_experts.default, (x, q13, q2, ids, weights),
                          {"w13_scales": s13, "w2_scales": s2})


def test_torch_compile_fullgraph_cpu():
    x, w13, w2, ids, weights = moe_inputs(4, 4, 2, 16, 8)

    @torch.compile(fullgraph=True, backend="eager")
    def step(x, w13, w2, ids, weights):
        return torch.ops.redline.moe_experts(x * 2, w13, w2, ids, weights, True) + 1

    want = moe.moe_experts_reference(x * 2, w13, w2, ids, weights, True) + 1
    assert torch.equal(step(x, w13, w2, ids, weights), want)


# --- the configs ---


@pytest.mark.parametrize("target", ["sm80", "sm86", "sm89", "sm90", "gfx90a", "gfx942", "gfx1100"])
@pytest.mark.parametrize("pairs,experts", [(5 * 8, 128), (4096 * 8, 128), (64 * 2, 8), (4096 * 2, 8)])
@pytest.mark.parametrize("elt_bytes", [2, 4])
def test_grouped_config_fits_every_target(target, pairs, experts, elt_bytes):
    caps = target_caps(target)
    cfg = configs.fitted_moe_dot_config(pairs, experts, elt_bytes, caps)
    assert cfg is not None and cfg.block_m == configs.moe_block_m(pairs, experts)
    assert configs.moe_dot_smem_bytes(cfg, elt_bytes, 2, caps) <= caps.shared_memory_per_block


def test_grouped_config_none_when_nothing_fits():
    tiny = configs.DeviceCaps("nvidia", "sm80", 2048, 32, 108, True, False, True)
    assert configs.fitted_moe_dot_config(1000, 8, 2, tiny) is None
    assert configs.fitted_moe_dot_config(1000, 8, 2, configs.DeviceCaps("cpu", "cpu", 0, 1, 0, False, False,
                                                                        False)) is None


def test_block_m_follows_the_rows_per_expert():
    assert configs.moe_block_m(5 * 8, 128) == 16  # a few tokens over many experts: little padding
    assert configs.moe_block_m(40 * 2, 8) == 16
    assert configs.moe_block_m(100 * 2, 8) == 32
    assert configs.moe_block_m(4096 * 8, 128) == configs.MOE_MAX_BLOCK_M


def test_gemv_config_clamps_to_small_shapes():
    assert configs.moe_gemv_config(768, 2048, 2) == configs.MoeGemvConfig(4, 1024, 4)
    assert configs.moe_gemv_config(2, 40, 4) == configs.MoeGemvConfig(2, 64, 2)


def test_config_validation():
    with pytest.raises(ValueError, match="power of two >= 16"):
        configs.MoeDotConfig(16, 48, 32)
    with pytest.raises(ValueError, match="power of two"):
        configs.MoeGemvConfig(3, 64)


# --- the expert-sorted layout (torch ops on the device; needs triton_moe's module only) ---


@pytest.mark.parametrize("n_tokens,n_experts,block_m", [(1, 4, 16), (17, 6, 16), (40, 8, 32), (3, 128, 16)])
def test_expert_blocks_group_every_pair_once(n_tokens, n_experts, block_m):
    pytest.importorskip("triton")
    from redline.kernels import triton_moe as tm

    top_k = 2
    _, _, _, ids, _ = moe_inputs(n_tokens, n_experts, top_k, 8, 8)
    pairs, block_expert = tm.expert_blocks(ids, n_experts, block_m)
    n_pairs = n_tokens * top_k
    assert pairs.shape == (tm.padded_rows(n_pairs, n_experts, block_m),) and pairs.dtype == torch.int32
    assert block_expert.shape == (pairs.shape[0] // block_m,) and block_expert.dtype == torch.int32
    real = pairs[pairs < n_pairs]
    assert sorted(real.tolist()) == list(range(n_pairs))  # each pair once, the rest the sentinel
    assert (pairs[pairs >= n_pairs] == n_pairs).all()
    flat = ids.reshape(-1)
    for b, e in enumerate(block_expert.tolist()):
        rows = pairs[b * block_m:(b + 1) * block_m]
        rows = rows[rows < n_pairs].long()
        if e == n_experts:
            assert rows.numel() == 0  # past the last expert's rows
        else:
            assert rows.numel() > 0 and (flat[rows] == e).all()
            assert rows.tolist() == sorted(rows.tolist())  # pair order within an expert (a stable sort)
    assert n_experts - 1 not in block_expert.tolist()  # the expert no token chose has no block


# --- KernelMoE ---


TINY_MOE_ARGS = dict(dim=16, n_layer=1, n_head=2, intermediate_size=32, vocab_size=64, n_experts=4,
                     n_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True)


def tiny_moe_layer() -> model.MoEFeedForward:
    """A model.MoEFeedForward of 4 experts (top 2, renormalized) over 16 features, random weights."""
    layer = model.MoEFeedForward(model.ModelArgs(**TINY_MOE_ARGS))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) / 4)
    return layer


@pytest.mark.parametrize("tokens", [1, 6])  # the gathered and the all-experts paths of MoEFeedForward
def test_use_kernels_swaps_moe_layers_for_kernel_moe(tokens):
    torch.manual_seed(0)
    layer = tiny_moe_layer()
    net = nn.Sequential(layer)
    x = torch.randn(1, tokens, 16)
    want = layer(x)
    kernels.use_kernels(net)
    assert type(layer) is moe.KernelMoE and type(layer.gate) is kernels.KernelLinear
    kernels.use_kernels(net)  # twice: a no-op
    assert type(layer) is moe.KernelMoE
    got = layer(x)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    weights, ids = layer.route(x.reshape(-1, 16))
    assert torch.equal(layer.experts(x.reshape(-1, 16), ids, weights),
                       moe.moe_experts_reference(x.reshape(-1, 16), layer.w13, layer.w2, ids, weights, False))


def tiny_layer(scheme: str) -> nn.Module:
    """A mixture of 4 experts (dim 64, I 32) with random float weights, or its int8 / int4 (group 32) form."""
    torch.manual_seed(0)
    args = model.ModelArgs(**{**TINY_MOE_ARGS, "dim": 64, "moe_intermediate_size": 32})
    layer = model.MoEFeedForward(args)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    if scheme == "float":
        return layer
    quantized = (Int8MoEFeedForward(args, dtype=torch.float32) if scheme == "int8"
                 else Int4MoEFeedForward(args, 32, dtype=torch.float32))
    with torch.no_grad():
        quantized.gate.weight.copy_(layer.gate.weight)
        experts = (int8_experts if scheme == "int8" else int4_experts)(layer.w13, layer.w2)
        quantized.w13, quantized.w2, quantized.w13_scales, quantized.w2_scales = experts
    return quantized


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_use_kernels_swaps_quantized_moe_layers_for_their_kernel_modules(scheme):
    layer = tiny_layer(scheme)
    x = torch.randn(1, 5, 64)
    want = layer(x)
    kernels.use_kernels(nn.Sequential(layer))
    assert type(layer) is (moe.KernelInt8MoE if scheme == "int8" else moe.KernelInt4MoE)
    assert torch.allclose(layer(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme", ["float", "int8", "int4"])
def test_use_cpu_kernels_runs_only_the_chosen_experts_on_their_stored_weights(scheme):
    """On the CPU the chosen experts run on their stored (int8 / int4 / float) weights, one (token, expert) pair at a
    time for a few tokens and grouped by expert for more, with the module's own results to fp32 rounding (int4: to
    the int4 kernel's int16 activation codes, 1e-4 relative)."""
    layer = tiny_layer(scheme)
    xs = [torch.randn(1, n, 64) for n in (1, 3, moe.CPU_LOOP_TOKENS + 5)]
    want = [layer(x) for x in xs]
    kernels.use_cpu_kernels(nn.Sequential(layer))
    assert type(layer).__name__ == {"float": "CpuMoE", "int8": "CpuInt8MoE", "int4": "CpuInt4MoE"}[scheme]

    def gathered(ids):  # model.py's path: copies of the experts' weights (every expert for more tokens)
        raise AssertionError("the CPU path gathered expert weights")

    layer.expert_weights = gathered
    tolerance = 1e-5 if scheme == "float" else 1e-4  # int8 and int4 work on x's int16 codes (cpu_linear)
    for x, w in zip(xs, want):
        assert torch.allclose(layer(x), w, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("scheme", ["float", "int8", "int4"])
def test_cpu_experts_op_compiles_in_one_graph_and_passes_opcheck(scheme):
    """The CPU modules' host loop sits inside redline::moe_experts_cpu, so a compiled decode step (fullgraph) traces
    through it."""
    layer = tiny_layer(scheme)
    kernels.use_cpu_kernels(nn.Sequential(layer))
    x = torch.randn(1, 3, 64)
    compiled = torch.compile(lambda t: layer(t) * 2, fullgraph=True)
    with torch.no_grad():  # as every decode step runs (the op has no backward)
        assert torch.allclose(compiled(x), layer(x) * 2, atol=1e-6, rtol=1e-6)
        weights, ids = layer.route(x.reshape(-1, 64))
    scales = (getattr(layer, "w13_scales", None), getattr(layer, "w2_scales", None))
    torch.library.opcheck(torch.ops.redline.moe_experts_cpu.default,
                          (x.reshape(-1, 64), layer.w13.detach(), layer.w2.detach(), ids, weights.float()),
                          {"gelu": False, "w13_scales": scales[0], "w2_scales": scales[1]})


# --- the Triton kernels in the interpreter ---

# (tokens, experts, dim, I, gelu) per token count: dims and widths that are not multiples of the tiles included.
INTERPRETER_SHAPES = {1: (4, 64, 32, False), 3: (8, 128, 96, True), 17: (6, 96, 48, False), 40: (8, 64, 64, True)}
INTERPRETER_CASES = [(f"{path}_{t}", d) for path in ("gemv", "grouped") for t in INTERPRETER_SHAPES
                     for d in ("float32", "float16")]
INTERPRETER_CASES += [(f"{path}_{t}", d) for path, t in (("gemv8", 3), ("grouped8", 40))  # int8 experts
                      for d in ("float32", "float16")]
INTERPRETER_CASES += [(f"{path}_{t}", d) for path, t in (("gemv4", 1), ("gemv4", 3), ("grouped4", 40))
                      for d in ("float32", "float16")]  # int4 experts, groups of 32


def run_interpreted_case(name: str, dtype_name: str) -> float:
    """The largest relative error of one path against the reference (run under TRITON_INTERPRET=1), with every
    buffer the launchers allocate filled with NaN first (inf when the output still holds one)."""
    from redline.kernels import triton_moe as tm

    dtype = getattr(torch, dtype_name)
    path, _, tokens = name.partition("_")
    n_tokens = int(tokens)
    n_experts, dim, hidden, gelu = INTERPRETER_SHAPES[n_tokens]
    x, w13, w2, ids, weights = moe_inputs(n_tokens, n_experts, 2, dim, hidden, dtype=dtype, seed=n_tokens,
                                          ids_dtype=torch.int32 if n_tokens == 17 else torch.int64)
    scales = (None, None)
    if path.endswith("8"):  # int8 experts with their row scales
        w13, w2, *scales = int8_experts(w13, w2)
    elif path.endswith("4"):  # int4 experts with their group scales
        w13, w2, *scales = int4_experts(w13, w2)
    args = (x, w13, w2, ids, weights)
    tm._empty = lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
    if path.startswith("gemv"):
        got = tm.moe_gemv(*args, gelu, configs.MoeGemvConfig(4, 32, 2), configs.MoeGemvConfig(8, 16, 2),
                          scales=tuple(scales))
    else:
        block_m = 32 if n_tokens == 40 else 16  # 40 tokens: tiles of 32 rows, partly padding
        got = tm.moe_grouped(*args, gelu, configs.MoeDotConfig(block_m, 32, 32, 2, 1), scales=tuple(scales))
    if torch.isnan(got).any():
        return float("inf")
    return rel_err(got, moe.moe_experts_reference(*args, gelu, *scales))


@pytest.fixture(scope="module")
def interpreted_errors() -> dict[str, float]:
    return interpreted_errors_of(__file__, timeout=900)


@pytest.mark.parametrize("name,dtype", INTERPRETER_CASES, ids=[f"{n}-{d}" for n, d in INTERPRETER_CASES])
def test_kernel_matches_reference_in_interpreter(interpreted_errors, name, dtype):
    err = interpreted_errors[f"{name}/{dtype}"]
    assert err <= INTERPRETER_TOLERANCE[dtype], f"{name} in {dtype}: relative error {err:.2e}"


# --- on a GPU ---

# (E, k, dim, I) of the real models
GPU_SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
GPU_TOKENS = (1, 3, 4, 5, 40, 300)  # the GEMV kernels up to MOE_GEMV_MAX_TOKENS, the grouped ones after


def _gpu_inputs(shape: str, n_tokens: int, seed: int = 0):
    """Real-size bf16 inputs on the GPU with random top-k routing (distinct experts per token)."""
    n_experts, top_k, dim, hidden = GPU_SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n_tokens, dim, device="cuda", generator=gen).bfloat16()
    w13 = (torch.randn(n_experts, 2 * hidden, dim, device="cuda", generator=gen) / math.sqrt(dim)).bfloat16()
    w2 = (torch.randn(n_experts, dim, hidden, device="cuda", generator=gen) / math.sqrt(hidden)).bfloat16()
    scores = torch.rand(n_tokens, n_experts, device="cuda", generator=gen)
    weights, ids = scores.softmax(dim=-1).topk(top_k, dim=-1)
    return x, w13, w2, ids, weights / weights.sum(dim=-1, keepdim=True)


def _fp32_reference(x, w13, w2, ids, weights, gelu=False):
    return moe.moe_experts_reference(x.float(), w13.float(), w2.float(), ids, weights, gelu)


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens", GPU_TOKENS)
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_bf16_matches_fp32_reference(shape, n_tokens):
    x, w13, w2, ids, weights = _gpu_inputs(shape, n_tokens)
    assert moe.kernel_supported(x, w13, w2)
    assert moe.uses_gemv(x) or moe.grouped_config(x, w13, ids) is not None
    for gelu in (False, True):
        got = torch.ops.redline.moe_experts(x, w13, w2, ids, weights, gelu)
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        assert rel_err(got, _fp32_reference(x, w13, w2, ids, weights, gelu)) <= 1e-2
    got32 = torch.ops.redline.moe_experts(x, w13, w2, ids.int(), weights)  # int32 ids
    assert rel_err(got32, _fp32_reference(x, w13, w2, ids, weights)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens", GPU_TOKENS)
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_int8_experts_match_fp32_reference(shape, n_tokens):
    x, w13, w2, ids, weights = _gpu_inputs(shape, n_tokens)
    q13, q2, s13, s2 = int8_experts(w13, w2)
    got = torch.ops.redline.moe_experts(x, q13, q2, ids, weights, False, s13, s2)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert rel_err(got, moe.moe_experts_reference(x.float(), q13, q2, ids, weights, False, s13, s2)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens", GPU_TOKENS)
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_int4_experts_match_fp32_reference(shape, n_tokens):
    x, w13, w2, ids, weights = _gpu_inputs(shape, n_tokens)
    q13, q2, s13, s2 = int4_experts(w13, w2, 128)
    got = torch.ops.redline.moe_experts(x, q13, q2, ids, weights, False, s13, s2)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert rel_err(got, moe.moe_experts_reference(x.float(), q13, q2, ids, weights, False, s13, s2)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_other_dtypes_match_reference(dtype):
    for n_tokens in (2, 33):
        x, w13, w2, ids, weights = moe_inputs(n_tokens, 8, 2, 256, 192, dtype=dtype, device="cuda")
        got = torch.ops.redline.moe_experts(x, w13, w2, ids, weights)
        assert rel_err(got, moe.moe_experts_reference(x, w13, w2, ids, weights)) <= \
            (1e-4 if dtype == torch.float32 else 3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens", [1, 64])
@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_gpu_cuda_graph_replay_with_changing_routing(shape, n_tokens):
    x, w13, w2, ids, weights = _gpu_inputs(shape, n_tokens)
    x, ids, weights = x.clone(), ids.clone(), weights.clone()

    graph, out = captured_graph(lambda: torch.ops.redline.moe_experts(x, w13, w2, ids, weights))
    for seed in (1, 2, 3):
        new_x, _, _, new_ids, new_weights = _gpu_inputs(shape, n_tokens, seed)
        if seed == 3:
            new_ids[:, 0] = 0  # every token on one expert
            new_ids[:, 1:] = torch.arange(1, ids.shape[1], device="cuda")
        x.copy_(new_x)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        assert rel_err(out, _fp32_reference(x, w13, w2, ids, weights)) <= 1e-2


@pytest.mark.gpu
def test_gpu_torch_compile_reduce_overhead():
    x, w13, w2, ids, weights = _gpu_inputs("qwen3-30b-a3b", 8)

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def step(x, ids, weights):
        return torch.ops.redline.moe_experts(x * 2, w13, w2, ids, weights) + 1

    for _ in range(3):  # warm-up, recording, replay
        got = step(x, ids, weights)
    assert rel_err(got, _fp32_reference(x * 2, w13, w2, ids, weights) + 1) <= 1e-2


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the kernels run in Triton's interpreter)")
    sys.path.insert(0, str(ROOT / "tests"))
    from test_kernels_interpreter import _allow_one_element_loop_bounds

    _allow_one_element_loop_bounds()
    print(json.dumps({f"{n}/{d}": run_interpreted_case(n, d) for n, d in INTERPRETER_CASES}))
