"""runner/decode_graphs.py on the CPU: one compiled decode step serves every batch bucket and table width."""
from __future__ import annotations

import torch

from redline.benchmarks.bench_model import build_random_model
from redline.model import ModelArgs
from redline.runner import Runner
from redline.runner.paged import PagedModel


def test_one_compiled_cpu_decode_step_serves_every_bucket_and_width():
    """Rows and page widths are the step's dynamic sizes on the CPU as on a GPU: steps of 2-9 rows over tables of
    2-8 pages compile one graph, a one-row step one more (a graph per shape had a CPU server compile for most of a
    minute when a batch size first came). Tests of the engine check the compiled steps' tokens against eager ones."""
    from torch._dynamo.utils import counters

    args = ModelArgs.from_name("debug-tiny")
    model = build_random_model(args, torch.device("cpu"), torch.float32, "none", seed=1)
    paged = PagedModel(Runner(model, "cpu", compile=True), 200, 4, 199, compile_prefill=False, prefill_graphs=False,
                       max_rows=16)
    torch._dynamo.reset()
    counters.clear()
    for rows, context in ((2, 5), (3, 13), (5, 29), (9, 7), (1, 9), (4, 21)):
        per_row = context // 4 + 1
        pages = [list(range(r * per_row, (r + 1) * per_row)) for r in range(rows)]
        tokens = [(37 * r + 5) % args.vocab_size for r in range(rows)]
        assert paged.launch_decode(tokens, [context] * rows, pages, [(0.0, 1, 1.0, 0)] * rows)[0].shape == (rows,)
    assert counters["stats"]["unique_graphs"] == 2  # the dynamic step and the one-row one
