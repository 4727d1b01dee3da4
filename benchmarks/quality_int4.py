"""Quality of the weight-only schemes on the real SmolLM2-135M-Instruct: perplexity and teacher-forced top-1
agreement with bf16 for int8 and int4 (g32, g64, g128), and the native Q4_1 import against the dequantized logits.

    python benchmarks/quality_int4.py [--text FILE] [--tokens 1024]

The demo checkpoint comes from a Q4_1 GGUF (scripts/demo_model.py), so its projections are exactly 4-bit
representable in groups of 32. A group size that does not divide a layer's inputs (SmolLM2's 576 features and
g128) is reported as such, not silently changed. Runs on the CPU.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from redline.checkpoint import read_checkpoint_info
from redline.quantize import load_model, quantize_
from redline.tokenizer import load_tokenizer

# The text scored when --text is not given: the project's README, real English prose with code.
DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "README.md"


@torch.no_grad()
def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits (T, vocab) in fp32 for one sequence of ids (T,)."""
    model.setup_caches(1, ids.numel())
    return model(ids[None], torch.arange(ids.numel())).float()[0]


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return torch.exp(torch.nn.functional.cross_entropy(logits[:-1], ids[1:])).item()


def main(argv: list[str] | None = None) -> int:
    from redline.scripts.demo_model import demo_checkpoint

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    p.add_argument("--tokens", type=int, default=1024)
    ns = p.parse_args(argv)
    fp32 = demo_checkpoint()
    native = demo_checkpoint(int4=True)
    tokenizer = load_tokenizer(fp32)
    ids = torch.tensor(tokenizer.encode(ns.text.read_text())[: ns.tokens])
    info = read_checkpoint_info(fp32)
    reference = logits_of(load_model(info, "cpu", torch.float32), ids)
    native_logits = logits_of(load_model(read_checkpoint_info(native), "cpu", torch.float32), ids)
    print(f"native Q4_1 import vs dequantized fp32 logits: max |diff| {(native_logits - reference).abs().max():.2e}"
          f" over {ids.numel()} tokens")
    bf16 = logits_of(load_model(info, "cpu", torch.bfloat16), ids)
    top1 = bf16.argmax(-1)
    rows = [("bf16", perplexity(bf16, ids), 1.0)]
    for mode, group in (("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)):
        label = mode if group is None else f"int4 g{group}"
        model = load_model(info, "cpu", torch.bfloat16)
        try:
            quantize_(model, mode, group)
        except ValueError as exc:
            rows.append((label, float("nan"), float("nan")))
            print(f"{label}: {exc}")
            continue
        logits = logits_of(model, ids)
        rows.append((label, perplexity(logits, ids), (logits.argmax(-1) == top1).float().mean().item()))
    print(f"\n{ids.numel()} tokens of {ns.text.name}\n\n| weights | perplexity | top-1 agreement with bf16 |\n| --- | --- | --- |")
    for label, ppl, agree in rows:
        print(f"| {label} | {ppl:.3f} | {agree:.1%} |" if ppl == ppl else f"| {label} | n/a | n/a |")
    return 0


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.benchmarks.quality_int4 import main as package_main

    sys.exit(package_main())
