"""runner/runner.py: the compiled step's settings around each call."""
from __future__ import annotations

import torch

from redline.runner.runner import CompiledStep


def doubled_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return x.index_select(0, rows) * 2 + 1  # (R, D)


def test_a_step_dynamic_in_marked_sizes_never_turns_other_sizes_symbolic():
    """dynamic=None: the sizes the caller marks are symbolic, every other size stays static, a recompile included
    (dynamo's automatic dynamic shapes would turn a size that changed symbolic; with torch 2.11 such a symbol once
    broke a guard of the compiled prefill step). Three widths of x: three graphs, each right."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    step = CompiledStep(doubled_rows, torch.device("cpu"), graphs=False, dynamic=None)
    for rows, width in ((3, 4), (5, 6), (2, 8)):
        x = torch.randn(9, width)
        picked = torch.arange(rows)
        torch._dynamo.mark_dynamic(picked, 0)
        assert torch.equal(step(x, picked), x[:rows] * 2 + 1)
    assert counters["stats"]["unique_graphs"] == 3
