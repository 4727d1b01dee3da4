"""One rank of the tensor-parallel CPU test, launched by torchrun (tests/test_tensor_parallel.py).

    torchrun --nproc_per_node 2 tests/tp_worker.py OUT_DIR PROMPT CHECKPOINT...

For each checkpoint, writes OUT_DIR/<i>-rank<r>.pt: the float32 logits of a prefill and a few decode steps, the greedy
tokens of LLM.generate, and the tokens of an unseeded sampled generation (which every rank must agree on). Then runs
generate.py's CLI on the first checkpoint: only rank 0 may print its text.

    torchrun --nproc_per_node 2 tests/tp_worker.py --fused OUT_DIR CHECKPOINT   # GPUs: fused against unfused decode
    torchrun --nproc_per_node 2 tests/tp_worker.py --gpu-greedy OUT_DIR PROMPT CHECKPOINT...  # GPUs: greedy tokens
    torchrun --nproc_per_node 2 tests/tp_worker.py --logits OUT_DIR CHECKPOINT...  # CPU: logits only (no tokenizer)
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


def main(argv: list[str]) -> int:
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
