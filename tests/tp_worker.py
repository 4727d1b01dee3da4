"""One rank of the tensor-parallel CPU test, launched by torchrun (tests/test_tensor_parallel.py).

    torchrun --nproc_per_node 2 tests/tp_worker.py OUT_DIR PROMPT CHECKPOINT...

For each checkpoint, writes OUT_DIR/<i>-rank<r>.pt: the float32 logits of a prefill and a few decode steps, the greedy
tokens of LLM.generate, and the tokens of an unseeded sampled generation (which every rank must agree on). Then runs
generate.py's CLI on the first checkpoint: only rank 0 may print its text.

    torchrun --nproc_per_node 2 tests/tp_worker.py --fused OUT_DIR CHECKPOINT   # GPUs: fused against unfused decode
    torchrun --nproc_per_node 2 tests/tp_worker.py --gpu-greedy OUT_DIR PROMPT CHECKPOINT...  # GPUs: greedy tokens
    torchrun --nproc_per_node 2 tests/tp_worker.py --logits OUT_DIR CHECKPOINT...  # CPU: logits only (no tokenizer)
    torchrun --nproc_per_node 2 tests/tp_worker.py --launch-check OUT_DIR  # CPU: import path, bench.py's rank device
    torchrun --nproc_per_node 2 tests/tp_worker.py --engine OUT_DIR CHECKPOINT cpu|cuda  # the batching engine
    torchrun --nnodes 2 --nproc_per_node 1 ... tests/tp_worker.py --greedy OUT_DIR PROMPT CHECKPOINT  # one per node
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

# The fixed token ids whose logits are compared: a 5-token prefill, then one token per step.
LOGIT_IDS = [1, 17, 42, 99, 7, 250, 3, 64, 128, 11]
PROMPT_TOKENS = 5
# Tokens each generation makes.
NEW_TOKENS = 12
# Tokens of the GPU greedy comparison: long enough to pass several CUDA-graph replays of the decode step.
GPU_NEW_TOKENS = 48


def logits(model: torch.nn.Module) -> torch.Tensor:
    """(1, len(LOGIT_IDS), vocab) float32 logits: one prefill, then single-token steps, on a fresh cache."""
    ids = torch.tensor([LOGIT_IDS])
    model.setup_caches(1, 64)
    with torch.inference_mode():
        steps = [model(ids[:, :PROMPT_TOKENS], torch.arange(PROMPT_TOKENS))]
        steps += [model(ids[:, p:p + 1], torch.tensor([p])) for p in range(PROMPT_TOKENS, ids.shape[1])]
    return torch.cat(steps, dim=1).float()


def run(out_dir: Path, prompt: str, checkpoints: list[str]) -> int:
    from redline import generate

    rank = int(os.environ.get("RANK", "0"))
    for i, path in enumerate(checkpoints):
        llm = generate.LLM.load(path, device="cpu", compile=False)
        result = {
            "logits": logits(llm.model),
            "greedy": llm.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=0).token_ids,
            "sampled": llm.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=50).token_ids,
            "local_heads": llm.model.args.n_head,
            "fused": fused_and_unfused(path, "cpu")["fused"],
        }
        torch.save(result, out_dir / f"{i}-rank{rank}.pt")
    return generate.main(["--checkpoint_path", checkpoints[0], "--prompt", prompt, "--temperature", "0",
                          "--max_new_tokens", str(NEW_TOKENS), "--device", "cpu", "--no-compile"])


def fused_and_unfused(path: str, device: str) -> dict[str, torch.Tensor]:
    """This rank's float32 logits of single-token steps (after a prefill) through the fused TP decode and through the
    unfused TP model, both on the kernel modules (their PyTorch references on the CPU)."""
    from redline import tensor_parallel
    from redline.checkpoint import read_checkpoint_info
    from redline.kernels import FusedDecode, use_kernels

    world = tensor_parallel.start(device)
    model = tensor_parallel.load_sharded_model(read_checkpoint_info(path), world)
    step = FusedDecode(use_kernels(tensor_parallel.apply_tensor_parallel(model, world)))
    assert step.parallel
    ids = torch.tensor([LOGIT_IDS], device=world.device)
    out = {}
    for kind, call in (("fused", step), ("unfused", model)):
        model.setup_caches(1, 64)
        with torch.inference_mode():
            model(ids[:, :PROMPT_TOKENS], torch.arange(PROMPT_TOKENS, device=world.device))
            steps = [call(ids[:, p:p + 1], torch.tensor([p], device=world.device))
                     for p in range(PROMPT_TOKENS, ids.shape[1])]
        out[kind] = torch.cat(steps, dim=1).float().cpu()
    return out


def fused_check(out_dir: Path, path: str) -> int:
    """On GPUs: fused_and_unfused, written to OUT_DIR/fused-rank<r>.pt and OUT_DIR/unfused-rank<r>.pt."""
    rank = int(os.environ.get("RANK", "0"))
    for kind, tensor in fused_and_unfused(path, "cuda").items():
        torch.save(tensor, out_dir / f"{kind}-rank{rank}.pt")
    return 0


def gpu_greedy(out_dir: Path, prompt: str, checkpoints: list[str]) -> int:
    """On GPUs, the engine as users run it (compiled, CUDA graphs, fused decode, the all-reduce REDLINE_ALL_REDUCE
    names): OUT_DIR/gpu-<i>-rank<r>.pt holds the greedy tokens of each checkpoint."""
    from redline import generate

    rank = int(os.environ.get("RANK", "0"))
    for i, path in enumerate(checkpoints):
        llm = generate.LLM.load(path, device="cuda")
        tokens = llm.generate(prompt, max_new_tokens=GPU_NEW_TOKENS, temperature=0, ignore_eos=True).token_ids
        torch.save(tokens, out_dir / f"gpu-{i}-rank{rank}.pt")
    return 0


def logits_only(out_dir: Path, checkpoints: list[str]) -> int:
    """OUT_DIR/logits-<i>-rank<r>.pt: each checkpoint's float32 logits through this rank's sharded model."""
    from redline import tensor_parallel
    from redline.checkpoint import read_checkpoint_info

    world = tensor_parallel.start("cpu")
    for i, path in enumerate(checkpoints):
        model = tensor_parallel.load_sharded_model(read_checkpoint_info(path), world, torch.float32)
        torch.save(logits(tensor_parallel.apply_tensor_parallel(model, world)),
                   out_dir / f"logits-{i}-rank{world.rank}.pt")
    return 0


def launch_check(out_dir: Path) -> int:
    """OUT_DIR/launch-rank<r>.pt: where this rank imported redline from, and the device benchmarks/bench.py's
    `--tp 2 --device cuda` gives it. The ranks are told they see two GPUs (a CPU machine has none) and talk over
    gloo; what runs for real is the path from the flag to the rank's device (parse_args, then start_ranks)."""
    import torch.distributed as dist

    import redline
    from redline.benchmarks.bench import parse_args, start_ranks

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 2
    torch.cuda.set_device = lambda device: None
    dist.init_process_group("gloo")  # tensor_parallel.start joins a group already made (NCCL would need the GPUs)
    try:
        cfg, world = start_ranks(parse_args(["--tp", "2", "--model", "debug-tiny", "--device", "cuda"]))
        result = {"redline": redline.__file__, "device": cfg.device, "world": str(world.device)}
    except ValueError as exc:
        result = {"redline": redline.__file__, "error": str(exc)}
    torch.save(result, out_dir / f"launch-rank{dist.get_rank()}.pt")
    dist.destroy_process_group()
    return 0


def greedy(out_dir: Path, prompt: str, path: str) -> int:
    """OUT_DIR/greedy-rank<r>.pt: LLM.generate's greedy tokens on the CPU (a launch over several nodes), and the
    world this rank saw (rank, world size, local rank, local world size)."""
    from redline import generate

    llm = generate.LLM.load(path, device="cpu", compile=False)
    tokens = llm.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True).token_ids
    world = [int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")]
    torch.save({"tokens": tokens, "world": world, "local_heads": llm.model.args.n_head},
               out_dir / f"greedy-rank{world[0]}.pt")
    return 0


# The batching engine's test: prompts of these lengths (token ids), decoded together in a pool too small for all of
# them (so some are preempted and recomputed), greedy and one seeded sampled request.
ENGINE_PROMPT_LENGTHS = (20, 9, 31, 14, 25)
ENGINE_NEW_TOKENS = 24
ENGINE_KV_TOKENS = 96
ENGINE_PAGE_SIZE = 4


def engine_requests(vocab: int) -> list[tuple[list[int], dict]]:
    """(prompt ids, GenerationOptions fields) of the engine test: every prompt greedy, the first again sampled."""
    prompts = [[(7 * i + 31 * n + 3) % vocab for i in range(n)] for n in ENGINE_PROMPT_LENGTHS]
    greedy = {"max_new_tokens": ENGINE_NEW_TOKENS, "ignore_eos": True}
    return [(p, greedy) for p in prompts] + [(prompts[0], {**greedy, "temperature": 0.9, "top_k": 40, "seed": 5})]


def engine_tokens(llm, compiled: bool) -> tuple[list[list[int]], int]:
    """The engine's tokens for engine_requests, all submitted at once, and its preemptions. Rank 0 runs them; every
    other rank follows its steps (and returns nothing)."""
    from redline import tensor_parallel
    from redline.engine import Engine
    from redline.options import GenerationOptions

    engine = Engine(llm, max_kv_tokens=ENGINE_KV_TOKENS, page_size=ENGINE_PAGE_SIZE)
    if not tensor_parallel.is_main_process():
        engine.follow()
        return [], 0
    if compiled:
        engine.capture_graphs(64)
    handles = [engine.add_request(ids, GenerationOptions(**options))
               for ids, options in engine_requests(llm.model.args.vocab_size)]
    tokens = [h.result(timeout=300).token_ids for h in handles]
    preemptions = engine.stats().preemptions
    engine.shutdown()
    return tokens, preemptions


def engine_check(out_dir: Path, path: str, device: str) -> int:
    """OUT_DIR/engine-rank0.pt: the tokens and preemptions of engine_tokens over this launch's ranks (on GPUs
    compiled, with the decode graphs)."""
    from redline import generate

    compiled = device == "cuda"
    llm = generate.LLM.load(path, device=device, compile=compiled)
    tokens, preemptions = engine_tokens(llm, compiled)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"tokens": tokens, "preemptions": preemptions, "local_kv_heads": llm.model.args.n_kv_heads},
                   out_dir / "engine-rank0.pt")
    return 0


def main(argv: list[str]) -> int:
    if argv[0] == "--engine":
        return engine_check(Path(argv[1]), argv[2], argv[3])
    if argv[0] == "--launch-check":
        return launch_check(Path(argv[1]))
    if argv[0] == "--greedy":
        return greedy(Path(argv[1]), argv[2], argv[3])
    if argv[0] == "--logits":
        return logits_only(Path(argv[1]), argv[2:])
    if argv[0] == "--fused":
        return fused_check(Path(argv[1]), argv[2])
    if argv[0] == "--gpu-greedy":
        return gpu_greedy(Path(argv[1]), argv[2], argv[3:])
    return run(Path(argv[0]), argv[1], argv[2:])


if __name__ == "__main__":
    from redline import tensor_parallel

    try:
        code = main(sys.argv[1:])
    finally:
        tensor_parallel.stop()
    # Every result is on disk: leave without the interpreter's teardown, in which gloo's worker threads sometimes
    # still hold tensors and abort the rank ("terminate called without an active exception") after a clean run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
