"""What penalties, a logit bias and min_p cost in the batching engine's decode steps, and that a batch without them
pays nothing (its steps run the plain step, as before they existed).

python -m redline.benchmarks.bench_sampling_params [--model tiny] [--device cpu] [--batch 8] [--tokens 48]
python -m redline.benchmarks.bench_sampling_params --model Qwen3-0.6B --device cuda --batch 32 --tokens 128

A registry name gets random weights (benchmarks/bench_model.py); `tiny` is a small Llama-shaped model with a
32k vocabulary (the penalty state is rows x vocabulary). Each round runs, alternately, a batch of --batch greedy
requests that use nothing (`plain`), the same batch where one request uses repetition, frequency and presence
penalties, a logit bias and min_p (`one penalized`), and the batch where every request does (`all penalized`);
the table gives the median decode step over the rounds, in ms. --plain_only runs the plain batch alone: the same
command on the code from before these settings existed gives the before/after comparison of a plain batch.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from typing import Any

import torch

TINY = dict(dim=256, n_layer=4, n_head=4, n_kv_heads=2, intermediate_size=704, vocab_size=32000, block_size=1024)
PENALIZED = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5, min_p=0.05,
                 logit_bias={11: 2.0, 12: -2.0})


def build_engine(model_name: str, device: torch.device, compile: bool, batch: int) -> Any:
    from redline.benchmarks.bench_model import build_random_model
    from redline.engine import Engine
    from redline.engine.core import EngineSettings
    from redline.model import ModelArgs
    from redline.runner.runner import Runner

    args = ModelArgs(**TINY) if model_name == "tiny" else ModelArgs.from_name(model_name)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = build_random_model(args, device, dtype, "none")
    runner = Runner(model, device, compile=compile)
    return Engine.of_runner(runner, EngineSettings(max_running=max(batch, 8), max_kv_tokens=batch * 256 + 512))


def decode_steps(engine: Any, prompts: list[list[int]], options: list[Any]) -> list[float]:
    """Seconds of each decode step (every row decoding) of these requests, run together."""
    seconds: list[float] = []

    def listen(chunks: list[Any], took: float) -> None:
        if all(c.length == 1 and c.start >= c.seq.prompt_len for c in chunks) and len(chunks) == len(prompts):
            seconds.append(took)

    engine.core.step_listener = listen
    with engine.paused():
        handles = [engine.add_request(p, o) for p, o in zip(prompts, options)]
    for handle in handles:
        handle.result(timeout=600)
    engine.core.step_listener = None
    return seconds


def main(argv: list[str] | None = None) -> int:
    from redline.options import GenerationOptions

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny or a registry name (random weights)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true", help="compiled decode steps (CUDA graphs on a GPU)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48, help="new tokens per request")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--plain_only", action="store_true", help="only the plain batch (runs on older code too)")
    ns = p.parse_args(argv)
    device = torch.device(ns.device)
    engine = build_engine(ns.model, device, ns.compile or device.type == "cuda", ns.batch)
    vocab = engine.limits.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (16 + i,), generator=g).tolist() for i in range(ns.batch)]
    plain = GenerationOptions(max_new_tokens=ns.tokens, ignore_eos=True)
    configs = {"plain": [plain] * ns.batch}
    if not ns.plain_only:
        penalized = GenerationOptions(max_new_tokens=ns.tokens, ignore_eos=True, **PENALIZED)
        configs["one penalized"] = [penalized] + [plain] * (ns.batch - 1)
        configs["all penalized"] = [penalized] * ns.batch
    with torch.inference_mode():
        for options in configs.values():  # warm-up: compiling and capturing stay out of the rounds
            decode_steps(engine, prompts, [dataclasses.replace(o, max_new_tokens=4) for o in options])
        steps: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(ns.rounds):
            for name, options in configs.items():
                steps[name].append(statistics.median(decode_steps(engine, prompts, options)))
    engine.shutdown()
    print(f"{ns.model} on {ns.device}, batch {ns.batch}, {ns.tokens} tokens, {ns.rounds} rounds "
          f"({'compiled' if ns.compile or device.type == 'cuda' else 'eager'}):")
    for name, values in steps.items():
        print(f"  {name:14s} median decode step {statistics.median(values) * 1e3:8.3f} ms  "
              f"(rounds: {', '.join(f'{v * 1e3:.3f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
