"""redline::moe_route (kernels/moe.py): its reference against model.MoEFeedForward.route, validation, opcheck and
torch.compile on the CPU, the kernel modules' route(), the Triton kernel against the reference in Triton's
interpreter (a child process, as tests/test_kernels_moe.py runs its kernels), and on a GPU (eager and CUDA graphs)."""
from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from redline import model
from redline.kernels import moe
from redline.quantize import Int4MoEFeedForward, Int8MoEFeedForward

from conftest import captured_graph, interpreted_errors_of

ROOT = Path(__file__).resolve().parents[1]
# Weights may differ from the reference's by fp32 rounding (exp, the sum, the division): a few ulps of 1.
WEIGHT_TOLERANCE = 1e-6
# Logits of 16-bit dtypes are spaced by this much down from 0: the largest 256 are exact (and distinct) in bf16, the
# largest 2048 in fp16, so none of the chosen experts ties and torch.topk's order is the only right one.
DISTINCT_STEP = 1 / 16

# name: (tokens, experts, k, renormalize, logits dtype, strided: a column slice of a wider tensor). Experts that are
# not a power of two (padded in the kernel), k = 1, k = E, no tokens and the most experts the kernel takes included.
ROUTE_CASES = {
    "qwen3_decode": (1, 128, 8, True, "float32", False),
    "qwen3_batch": (5, 128, 8, False, "bfloat16", True),
    "mixtral": (7, 8, 2, True, "float16", False),
    "sixty": (3, 60, 4, True, "float32", True),
    "top1": (4, 6, 1, False, "float32", False),
    "top1_renorm": (2, 6, 1, True, "bfloat16", False),
    "odd_experts": (2, 200, 8, False, "bfloat16", False),
    "all_chosen": (3, 64, 64, True, "float32", False),
    "no_tokens": (0, 16, 2, True, "float32", False),
    "widest": (9, moe.ROUTE_MAX_EXPERTS, 8, True, "float16", False),
}


def route_logits(n_tokens, n_experts, dtype, seed=0, device="cpu", strided=False):
    """Router logits (T, E) without ties among the largest: fp32 at random, 16-bit ones a shuffle of 0, -DISTINCT_STEP,
    -2 DISTINCT_STEP, ...; strided: a view of every other column of a (T, 2E) tensor."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        logits = torch.randn(n_tokens, n_experts, generator=gen) * 3
    else:
        rows = [torch.randperm(n_experts, generator=gen) for _ in range(n_tokens)]
        logits = (torch.stack(rows) if rows else torch.zeros(0, n_experts)) * -DISTINCT_STEP
    logits = logits.to(dtype).to(device)
    return torch.stack([logits, logits], dim=-1).flatten(1)[:, ::2] if strided else logits


def route_error(got: tuple, want: tuple) -> float:
    """inf where the ids differ (or their dtype or shape, or any weight is NaN), else the largest weight
    difference."""
    (weights, ids), (want_weights, want_ids) = got, want
    if ids.dtype != torch.int64 or weights.dtype != torch.float32 or not torch.equal(ids, want_ids):
        return float("inf")
    if weights.shape != want_weights.shape or torch.isnan(weights).any():
        return float("inf")
    return (weights - want_weights).abs().max().item() if weights.numel() else 0.0


class OpsCalled(TorchDispatchMode):
    """Records the ops dispatched within it (custom ops included) in .ops."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_route_error_flags_wrong_ids():
    logits = route_logits(3, 8, torch.float32)
    weights, ids = moe.moe_route_reference(logits, 2, True)
    assert route_error((weights, ids), (weights, ids)) == 0.0
    assert route_error((weights, ids.flip(-1)), (weights, ids)) == float("inf")  # right experts, wrong order
    assert route_error((weights, (ids + 1) % 8), (weights, ids)) == float("inf")
    assert route_error((weights, ids.int()), (weights, ids)) == float("inf")


# --- the reference and the op on the CPU ---


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("rounded", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_moe_route_is_model_route_on_cpu(renormalize, rounded, dtype):
    """KernelMoE.route (redline::moe_route) chooses the same experts with the same weights as MoEFeedForward.route
    on the same module, for every norm_topk_prob / router_weights_rounded setting."""
    torch.manual_seed(0)
    args = model.ModelArgs(dim=32, n_layer=1, n_head=4, intermediate_size=48, vocab_size=64, n_experts=12,
                           n_experts_per_tok=3, moe_intermediate_size=8, norm_topk_prob=renormalize,
                           router_weights_rounded=rounded)
    layer = model.MoEFeedForward(args).to(dtype)
    torch.nn.init.normal_(layer.gate.weight)
    kernel_layer = copy.deepcopy(layer)
    kernel_layer.__class__ = moe.KernelMoE
    x = torch.randn(9, 32).to(dtype)
    want_weights, want_ids = layer.route(x)
    with OpsCalled() as called:
        weights, ids = kernel_layer.route(x)
    assert torch.ops.redline.moe_route.default in called.ops
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64


@pytest.mark.parametrize("kernel_class,base", [(moe.KernelInt8MoE, Int8MoEFeedForward),
                                               (moe.KernelInt4MoE, Int4MoEFeedForward)])
def test_quantized_kernel_modules_route_through_the_op(kernel_class, base):
    args = model.ModelArgs(dim=64, n_layer=1, n_head=4, intermediate_size=48, vocab_size=64, n_experts=8,
                           n_experts_per_tok=2, moe_intermediate_size=32, router_weights_rounded=True)
    layer = base(args, dtype=torch.bfloat16) if base is Int8MoEFeedForward else base(args, 32, dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.gate.weight)
    x = torch.randn(5, 64).bfloat16()
    want_weights, want_ids = layer.route(x)
    layer.__class__ = kernel_class
    with OpsCalled() as called:
        weights, ids = layer.route(x)
    assert torch.ops.redline.moe_route.default in called.ops
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("renormalize", [False, True])
def test_op_runs_the_reference_on_cpu_and_passes_opcheck(dtype, renormalize):
    logits = route_logits(6, 10, dtype)
    assert not moe.route_kernel_supported(logits)
    weights, ids = torch.ops.redline.moe_route(logits, 3, renormalize)
    assert weights.shape == ids.shape == (6, 3) and weights.dtype == torch.float32 and ids.dtype == torch.int64
    want = logits.float().softmax(-1).topk(3)
    want_weights = want.values / want.values.sum(-1, keepdim=True) if renormalize else want.values
    assert torch.equal(ids, want.indices) and torch.equal(weights, want_weights)
    torch.library.opcheck(torch.ops.redline.moe_route.default, (logits, 3, renormalize))


@pytest.mark.parametrize("logits,top_k,match", [
    (torch.randn(8), 2, r"logits must be \(T, E\), got shape \(8,\)"),
    (torch.randn(2, 3, 8), 2, r"logits must be \(T, E\), got shape \(2, 3, 8\)"),
    (torch.randn(3, 8), 9, "top_k=9 must be in 1..E=8"),
    (torch.randn(3, 8), 0, "top_k=0 must be in 1..E=8"),
    (torch.zeros(3, 0), 1, "top_k=1 must be in 1..E=0"),
    (torch.zeros(3, 8, dtype=torch.int64), 2, "logits must be bf16, fp16 or fp32, got torch.int64"),
])
def test_validation_errors(logits, top_k, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.redline.moe_route(logits, top_k, True)
    with pytest.raises(ValueError, match=match):  # the fake (torch.compile, meta tensors) checks alike
        torch.ops.redline.moe_route(logits.to("meta"), top_k, True)


def test_torch_compile_fullgraph_cpu():
    logits = route_logits(4, 16, torch.float32)

    @torch.compile(fullgraph=True, backend="eager")
    def step(logits):
        weights, ids = torch.ops.redline.moe_route(logits * 2, 4, True)
        return weights + 1, ids

    weights, ids = step(logits)
    want_weights, want_ids = moe.moe_route_reference(logits * 2, 4, True)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights + 1)


# --- the Triton kernel in the interpreter ---


def run_interpreted_case(name: str) -> float:
    """route_error of the kernel against the reference for one ROUTE_CASES entry (under TRITON_INTERPRET=1), with
    the launcher's outputs filled with NaN and -1 first; "ties" and "underflow" check the kernel's own choice where
    torch.topk's order among equal probabilities is unspecified."""
    from redline.kernels import triton_moe as tm

    tm._empty = lambda shape, dtype, device: torch.full(shape, float("nan") if dtype.is_floating_point else -1,
                                                        dtype=dtype, device=device)
    if name == "ties":  # every expert alike: the lowest ids, in order, each 1 / k after renormalization
        got = tm.moe_route(torch.zeros(3, 12), 5, True)
        return route_error(got, (torch.full((3, 5), 0.2), torch.arange(5).expand(3, 5)))
    if name == "underflow":  # one expert takes all: the others' probabilities are 0, yet no padding id comes back
        logits = torch.full((2, 6), -200.0)
        logits[:, 3] = 100.0
        got = tm.moe_route(logits, 4, False)
        return route_error(got, (torch.tensor([[1.0, 0, 0, 0]] * 2), torch.tensor([[3, 0, 1, 2]] * 2)))
    n_tokens, n_experts, top_k, renormalize, dtype_name, strided = ROUTE_CASES[name]
    logits = route_logits(n_tokens, n_experts, getattr(torch, dtype_name), seed=n_experts, strided=strided)
    return route_error(tm.moe_route(logits, top_k, renormalize), moe.moe_route_reference(logits, top_k, renormalize))


INTERPRETER_CASES = [*ROUTE_CASES, "ties", "underflow"]


@pytest.fixture(scope="module")
def interpreted_errors() -> dict[str, float]:
    return interpreted_errors_of(__file__, timeout=600)


@pytest.mark.parametrize("name", INTERPRETER_CASES)
def test_kernel_matches_reference_in_interpreter(interpreted_errors, name):
    err = interpreted_errors[name]
    assert err <= WEIGHT_TOLERANCE, f"{name}: {'wrong ids' if err == float('inf') else f'weights off by {err:.2e}'}"


# --- on a GPU ---

GPU_SHAPES = ((128, 8), (8, 2), (60, 4), (moe.ROUTE_MAX_EXPERTS, 8))  # (E, k): Qwen3-MoE, Mixtral, odd, widest
GPU_TOKENS = (1, 7, 4096)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n_experts,top_k", GPU_SHAPES)
def test_gpu_kernel_matches_reference(n_experts, top_k, dtype):
    for n_tokens in GPU_TOKENS:
        logits = route_logits(n_tokens, n_experts, dtype, seed=n_tokens, device="cuda")
        assert moe.route_kernel_supported(logits)
        for renormalize in (False, True):
            got = torch.ops.redline.moe_route(logits, top_k, renormalize)
            want = moe.moe_route_reference(logits, top_k, renormalize)
            assert route_error(got, want) <= WEIGHT_TOLERANCE, (n_tokens, renormalize)


@pytest.mark.gpu
def test_gpu_kernel_with_ties_chooses_probabilities_as_topk_does():
    """bf16 router logits tie often; where they do, the kernel takes the lowest expert and torch.topk any: the
    chosen probabilities agree, and the ids are k distinct experts that carry them."""
    logits = (torch.randn(4096, 128, device="cuda") * 2).bfloat16()
    weights, ids = torch.ops.redline.moe_route(logits, 8, False)
    want_weights, _ = moe.moe_route_reference(logits, 8, False)
    assert (weights - want_weights).abs().max().item() <= WEIGHT_TOLERANCE
    probs = logits.float().softmax(-1)
    assert (probs.gather(1, ids) - weights).abs().max().item() <= WEIGHT_TOLERANCE
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens", [1, 64])
def test_gpu_cuda_graph_replay_with_changing_logits(n_tokens):
    logits = route_logits(n_tokens, 128, torch.bfloat16, device="cuda")

    graph, out = captured_graph(lambda: torch.ops.redline.moe_route(logits, 8, True))
    for seed in (1, 2, 3):
        logits.copy_(route_logits(n_tokens, 128, torch.bfloat16, seed=seed, device="cuda"))
        graph.replay()
        assert route_error(out, moe.moe_route_reference(logits, 8, True)) <= WEIGHT_TOLERANCE


@pytest.mark.gpu
def test_gpu_kernel_moe_route_is_model_route():
    torch.manual_seed(0)
    args = model.ModelArgs(dim=64, n_layer=1, n_head=4, intermediate_size=48, vocab_size=64, n_experts=128,
                           n_experts_per_tok=8, moe_intermediate_size=8, router_weights_rounded=True)
    layer = model.MoEFeedForward(args).cuda()
    kernel_layer = copy.deepcopy(layer)
    kernel_layer.__class__ = moe.KernelMoE
    x = torch.randn(33, 64, device="cuda")
    want_weights, want_ids = layer.route(x)
    weights, ids = kernel_layer.route(x)
    assert torch.equal(ids, want_ids) and (weights - want_weights).abs().max().item() <= WEIGHT_TOLERANCE


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the kernel runs in Triton's interpreter)")
    sys.path.insert(0, str(ROOT / "tests"))
    from test_kernels_interpreter import _allow_one_element_loop_bounds

    _allow_one_element_loop_bounds()
    print(json.dumps({name: run_interpreted_case(name) for name in INTERPRETER_CASES}))
