"""A runner from a checkpoint or from random weights of a registry model, with a log of what start-up does.

LLM.from_config (generate.py) and the engine core's process (engine/process.py) both load through here, so a
model loads the same way wherever it runs."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from redline.runner.runner import Runner, sync


def load_checkpoint_model(info: Any, device: torch.device, config: Any, world: Any = None,
                          log: Callable[[str], None] | None = None) -> torch.nn.Module:
    """The checkpoint's model on device (this rank's slices under tensor parallelism), quantized as config asks."""
    from redline import tensor_parallel
    from redline.checkpoint import dtype_from_name
    from redline.quantize import load_model

    dtype = dtype_from_name(config.dtype) if config.dtype is not None else None
    begin = time.perf_counter()
    if world is None:
        model = load_model(info, device, dtype)
    else:  # this rank's slices only; quantize= then quantizes each rank's slices (per-channel scales per slice)
        model = tensor_parallel.load_sharded_model(info, world, dtype)
    if log is not None:
        sync(device)
        seconds = time.perf_counter() - begin
        size = weight_bytes(model) / 1e9
        log(f"loaded {size:.3g} GB of weights in {seconds:.1f} s ({size / max(seconds, 1e-9):.3g} GB/s)")
    if config.quantize is not None:
        from redline.quantize import parse_quant_spec, quantize_

        if info.scheme != "none":
            raise ValueError(f"{info.path} is already quantized ({info.scheme}); drop quantize=")
        quantize_(model, *parse_quant_spec(config.quantize))
    if world is not None:
        tensor_parallel.apply_tensor_parallel(model, world)
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def load_runner(source: Any, log: Callable[[str], None]) -> Runner:
    """The runner of a ModelSource (engine/process.py): a checkpoint's model, or a registry model with random
    weights; kernels and compile as on any LLM of the device."""
    from redline.checkpoint import read_checkpoint_info
    from redline.options import EngineConfig

    from redline import tensor_parallel

    config = EngineConfig(device=source.device, dtype=source.dtype, compile=source.compile, quantize=source.quantize,
                          threads=source.threads)
    world = tensor_parallel.start(source.device)  # a rank of tensor parallel: None on one process
    device = config.torch_device() if world is None else world.device
    config.set_threads(device)
    if source.random_weights is not None:
        model = random_model(source.random_weights, device, source.dtype, source.quantize, log, world)
    else:
        info = read_checkpoint_info(source.checkpoint_path)
        log(f"loading {info.path} onto {device}")
        model = load_checkpoint_model(info, device, config, world, log=log)
    compile = config.compile if config.compile is not None else device.type == "cuda"
    begin = time.perf_counter()
    runner = Runner(model, device, compile, tokenizer_vocab=source.tokenizer_vocab)
    log(f"kernels {'on' if runner.kernels else 'off'}, fused decode {'on' if runner.fuse else 'off'}, "
        f"compile {'on' if compile else 'off'} ({time.perf_counter() - begin:.1f} s)")
    return runner


def random_model(name: str, device: torch.device, dtype: str | None, quantize: str | None,
                 log: Callable[[str], None], world: Any = None) -> torch.nn.Module:
    """A registry model (model.py's ModelArgs.from_name) with random weights of its real shapes, for benchmarks;
    with a tensor-parallel world, this rank's slices (its own random weights)."""
    from redline.benchmarks.bench_model import build_random_model
    from redline.checkpoint import dtype_from_name
    from redline.model import ModelArgs
    from redline.quantize import parse_quant_spec

    quant, group = parse_quant_spec(quantize) if quantize else ("none", None)
    begin = time.perf_counter()
    if world is None:
        model = build_random_model(ModelArgs.from_name(name), device, dtype_from_name(dtype or "bfloat16"), quant,
                                   group_size=group or 128)
    else:
        from redline.benchmarks.bench_tp import build_random_tp_model

        model = build_random_tp_model(ModelArgs.from_name(name), world, dtype_from_name(dtype or "bfloat16"), quant,
                                      seed=0, group_size=group or 128)
    sync(device)
    log(f"built {name} with random weights ({weight_bytes(model) / 1e9:.3g} GB, {quant}) in "
        f"{time.perf_counter() - begin:.1f} s")
    return model
