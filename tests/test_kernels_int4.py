"""kernels/triton_int4.py and redline::int4_linear: the int4 GEMV against the reference (Triton's interpreter on
the CPU, the GPU when there is one), fused prologue and epilogue included."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from redline import kernels  # noqa: F401  (registers the ops)
from redline.kernels.linear import fused_linear_reference, int4_linear_reference
from redline.quantize import quantize_int4

ROOT = Path(__file__).resolve().parents[1]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")

# Runs in a subprocess with TRITON_INTERPRET=1. Triton 3.6's interpreter turns a runtime scalar into a 1-element
# array that numpy 2 refuses to index with; the shim gives loop bounds a plain int.
INTERPRETER_SCRIPT = textwrap.dedent("""
    import torch
    import triton.runtime.interpreter as interp
    patch = interp._patch_lang_tensor
    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    interp._patch_lang_tensor = patched
    from redline.kernels.configs import GemvConfig
    from redline.kernels.linear import fused_linear_reference, int4_linear_reference
    from redline.kernels.triton_int4 import gemv_int4
    from redline.quantize import quantize_int4
    torch.manual_seed(0)
    worst = 0.0
    cases = [(16, 256, 32, None), (10, 96, 32, GemvConfig(4, 64, 1, 2)), (24, 512, 128, GemvConfig(8, 128, 2, 1)),
             (8, 384, 128, GemvConfig(2, 256, 1, 2)), (6, 512, 256, GemvConfig(2, 128, 1, 2))]
    for n, k, g, cfg in cases:
        w, sz = quantize_int4(torch.randn(n, k), g)
        x = torch.randn(1, k)
        ref = int4_linear_reference(x, w, sz)
        worst = max(worst, ((gemv_int4(x, w, sz, config=cfg) - ref).abs().max() / ref.abs().max()).item())
    n, k = 12, 192
    w, sz = quantize_int4(torch.randn(2 * n, k), 64)
    x, g = torch.randn(1, k), torch.rand(k) + 0.5
    for swiglu in (True, False):
        rows = n if swiglu else 2 * n
        res = None if swiglu else torch.randn(1, rows)
        ref = fused_linear_reference(x, w, sz, g, 1e-5, res, swiglu)
        sq = torch.zeros(4)
        got = gemv_int4(x, w, sz, norm_weight=g, eps=1e-5, residual=None if res is None else res.view(-1),
                        swiglu=swiglu, sq_out=sq, config=GemvConfig(4, 64, 1, 2))
        worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
        worst = max(worst, abs(sq.sum().item() - ref.pow(2).sum().item()) / ref.pow(2).sum().item())
    print("WORST", worst)
""")


def test_int4_gemv_in_the_triton_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    worst = float(proc.stdout.split("WORST")[-1])
    assert worst < 1e-4  # fp32 activations: only the order of the fp32 sums and the bias removal differ


def test_int4_linear_op_cpu_and_fused_reference():
    w, sz = quantize_int4(torch.randn(48, 128), 32)
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    y = torch.ops.redline.int4_linear(x, w, sz)
    # The CPU GEMV sums in another order than the reference: equal to fp32 rounding, then one rounding to bf16.
    assert y.shape == (2, 3, 48)
    torch.testing.assert_close(y, int4_linear_reference(x, w, sz))
    g = torch.rand(128, dtype=torch.bfloat16) + 0.5
    out = torch.ops.redline.fused_linear(x[:1, :1], w, sz, g, 1e-5, None, True, None, -1, -1)
    assert torch.equal(out, fused_linear_reference(x[:1, :1], w, sz, g, 1e-5, None, True))


@pytest.mark.parametrize("change,match", [
    (lambda w, sz: (w.to(torch.int8), sz), "int8"),
    (lambda w, sz: (w[:, :-4], sz), "holds K"),
    (lambda w, sz: (w, sz.float()), "fp16"),
    (lambda w, sz: (w, sz[:, :3]), "group size"),
])
def test_int4_linear_validation(change, match):
    w, sz = quantize_int4(torch.randn(8, 128), 32)
    w, sz = change(w, sz)
    with pytest.raises(ValueError, match=match):
        torch.ops.redline.int4_linear(torch.randn(1, 128), w, sz)


def test_int4_linear_opcheck_cpu():
    w, sz = quantize_int4(torch.randn(16, 64), 32)
    torch.library.opcheck(torch.ops.redline.int4_linear, (torch.randn(2, 64), w, sz))


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n,k,g", [(12288, 4096, 128), (4096, 11008, 128), (22016, 4096, 32), (4096, 14336, 64),
                                   (32000, 4096, 256), (1000, 96, 32), (7, 32, 32), (333, 4160, 64)])
def test_gpu_int4_gemv_matches_reference(n, k, g):
    w, sz = quantize_int4(torch.randn(n, k, device="cuda") * 0.02, g)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = int4_linear_reference(x, w, sz).float()
    y = torch.ops.redline.int4_linear(x, w, sz).float()
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 1e-2  # one bf16 rounding of the output


def _x_of_kind(kind: str, k: int) -> torch.Tensor:
    """One row of x (1, K) bf16: normal, with two massive activations, tiny, or half of it zero."""
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    if kind == "massive":
        x[0, 5], x[0, k // 2] = 3000.0, -2500.0
    elif kind == "tiny":
        x = x * 1e-6
    elif kind == "half-zero":
        x[0, : k // 2] = 0
    return x


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("half2", [True, False])
@pytest.mark.parametrize("kind", ["normal", "massive", "tiny", "half-zero"])
@pytest.mark.parametrize("n,k,g", [(4096, 11008, 128), (1000, 96, 32), (333, 4160, 64)])
def test_gpu_int4_gemv_products_match_reference(half2, kind, n, k, g):
    """Both product forms (fp16x2 with x scaled per chunk, fp32) over the inputs that test the fp16 range: an
    overflow, an underflow or a bad scale would show as an error far above one bf16 rounding."""
    from redline.kernels.triton_int4 import gemv_int4

    if half2 and not torch.version.cuda:
        pytest.skip("the fp16x2 products are inline PTX (NVIDIA)")
    w, sz = quantize_int4(torch.randn(n, k, device="cuda") * 0.02, g)
    x = _x_of_kind(kind, k)
    ref = int4_linear_reference(x, w, sz).float()
    y = gemv_int4(x, w, sz, half2=half2).float()
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 1e-2
    x[0, 7] = float("nan")
    assert gemv_int4(x, w, sz, half2=half2).isnan().all()  # a NaN input is never hidden


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("swiglu", [True, False])
def test_gpu_fused_int4_matches_reference(swiglu):
    n, k = (11008, 4096) if swiglu else (4096, 4096)
    w, sz = quantize_int4(torch.randn(2 * n if swiglu else n, k, device="cuda") * 0.02, 128)
    x = torch.randn(1, 1, k, device="cuda", dtype=torch.bfloat16)
    g = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    res = None if swiglu else torch.randn(1, 1, n, device="cuda", dtype=torch.bfloat16)
    ref = fused_linear_reference(x, w, sz, g, 1e-5, res, swiglu).float()
    got = torch.ops.redline.fused_linear(x, w, sz, g, 1e-5, res, swiglu, None, -1, -1).float()
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 2e-2


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 16, 300])
def test_gpu_int4_rows_match_reference(m):
    w, sz = quantize_int4(torch.randn(512, 1024, device="cuda") * 0.02, 64)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    ref = int4_linear_reference(x, w, sz).float()
    y = torch.ops.redline.int4_linear(x, w, sz).float()
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 2e-2
