"""The tensor-parallel parts of the benchmark (benchmarks/bench.py --tp N under torchrun): a rank's random-weight model,
built directly in its slice shapes (no full copy anywhere), and the time one decode token spends in all-reduces,
NCCL against the one-shot over symmetric memory, each a CUDA graph of just those all-reduces."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from redline import tensor_parallel
from redline.model import ModelArgs, Transformer
from redline.benchmarks.bench_model import build_random_model

# Replays of the all-reduce graph that are timed (after WARM_REPLAYS untimed ones); their mean is reported.
TIMED_REPLAYS = 50
WARM_REPLAYS = 5


def build_random_tp_model(args: ModelArgs, world: tensor_parallel.TPWorld, dtype: torch.dtype, quant: str,
                          seed: int, group_size: int = 128) -> Transformer:
    """This rank's model: random weights (seeded per rank) in the shapes of its slices, int8/int4 drawn directly
    in their quantized form (no float copy), with wo and w2 wrapped for the all-reduce the world names."""
    local = tensor_parallel.shard_args(args, world.world_size)
    model = build_random_model(local, world.device, dtype, quant, seed + world.rank, group_size)
    return tensor_parallel.apply_tensor_parallel(model, world)


def all_reduces_per_token(args: ModelArgs) -> int:
    """After attention and after the feed-forward, in every block."""
    return 2 * args.n_layer


def all_reduce_us_per_token(world: tensor_parallel.TPWorld, mode: str, hidden: tuple[int, ...], dtype: torch.dtype,
                            count: int) -> float:
    """Microseconds of one replay of a CUDA graph holding `count` chained all-reduces of a (hidden) tensor: the
    all-reduce time of one decode token. The graph is made by torch.compile as the decode step's is."""
    x = torch.zeros(hidden, dtype=dtype, device=world.device)  # zeros: the chained sums never overflow

    def chain(y: torch.Tensor) -> torch.Tensor:
        for _ in range(count):
            y = tensor_parallel.all_reduce(y, world.group_name, mode)
        return y

    step = torch.compile(chain, mode="reduce-overhead", fullgraph=True)
    with torch.inference_mode():
        for _ in range(3 + WARM_REPLAYS):  # compile, record, then replays
            torch.compiler.cudagraph_mark_step_begin()
            step(x)
        torch.cuda.synchronize(world.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(TIMED_REPLAYS):
            torch.compiler.cudagraph_mark_step_begin()
            step(x)
        end.record()
        end.synchronize()
    return start.elapsed_time(end) * 1e3 / TIMED_REPLAYS


def all_reduce_timings(world: tensor_parallel.TPWorld, args: ModelArgs, dtype: torch.dtype,
                       batch: int) -> dict[str, Any]:
    """NCCL and (where torch has it) one-shot all-reduce time per decode token, for a batch of hidden states; a
    mode that cannot run records its error instead. Every rank must call this (the all-reduces are collective)."""
    count = all_reduces_per_token(args)
    out: dict[str, Any] = {"all_reduces_per_token": count, "bytes_each": batch * args.dim * dtype.itemsize,
                           "us_per_token": {}, "errors": {}}
    if world.device.type != "cuda":
        out["errors"]["all"] = "timed only on GPUs"
        return out
    for mode in tensor_parallel.ALL_REDUCE_MODES:
        try:
            if mode == "oneshot":
                tensor_parallel.prepare_one_shot(dataclasses.replace(world, all_reduce=mode), dtype)
            out["us_per_token"][mode] = all_reduce_us_per_token(world, mode, (batch, 1, args.dim), dtype, count)
        except (ValueError, RuntimeError) as exc:
            out["errors"][mode] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        finally:
            torch._dynamo.reset()
    return out
