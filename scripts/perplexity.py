"""Perplexity of a Redline checkpoint over local text files, in sliding windows.

python scripts/perplexity.py --checkpoint_path X --text FILE [FILE ...] [--max_seq_len 512] [--stride 256]

Each file is one document: BOS + text + EOS (as the demo model was trained). A window of max_seq_len tokens
moves by `stride`; each token is scored once, by the first window that sees it with the most context.
On the GPU the forward pass is compiled (one fixed window shape, so it compiles once).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from generate import LLM


@dataclass(frozen=True)
class PerplexityArgs:
    checkpoint_path: Path
    text: tuple[Path, ...]
    max_seq_len: int = 512
    stride: int | None = None
    device: str | None = None
    dtype: str | None = None
    quantize: str | None = None
    compile: bool | None = None
    json: Path | None = None

    def __post_init__(self) -> None:
        if self.max_seq_len < 2:
            raise ValueError(f"--max_seq_len must be at least 2, got {self.max_seq_len}")
        # A window's first token has no context inside it, so windows must overlap by at least one token.
        if self.stride is not None and not 1 <= self.stride < self.max_seq_len:
            raise ValueError(f"--stride must be between 1 and --max_seq_len - 1 ({self.max_seq_len - 1}), got {self.stride}")
        for path in self.text:
            if not path.is_file():
                raise FileNotFoundError(f"text file {path} does not exist")

    @property
    def window_stride(self) -> int:
        return self.stride if self.stride is not None else self.max_seq_len // 2


@dataclass(frozen=True)
class Perplexity:
    tokens: int
    nll: float  # summed negative log-likelihood, nats

    @property
    def value(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    def __add__(self, other: Perplexity) -> Perplexity:
        return Perplexity(self.tokens + other.tokens, self.nll + other.nll)


def scored_windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first_scored) per window: targets [first_scored, end) are counted, each exactly once."""
    spans, scored_until = [], 1  # the first token has nothing to be predicted from
    for start in range(0, n_tokens, stride):
        end = min(start + window, n_tokens)
        if end > scored_until:
            spans.append((start, end, scored_until))
            scored_until = end
        if end == n_tokens:
            break
    return spans


def document_perplexity(ids: list[int], window: int, stride: int,
                        logits_fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> Perplexity:
    total = Perplexity(0, 0.0)
    for start, end, first in scored_windows(len(ids), window, stride):
        chunk = torch.zeros(1, window, dtype=torch.long, device=device)  # fixed shape; padding is never scored
        chunk[0, : end - start] = torch.tensor(ids[start:end], device=device)
        logits = logits_fn(chunk).float()  # (1, window, V)
        targets = chunk[0, first - start:end - start]  # tokens first..end-1
        preds = logits[0, first - start - 1:end - start - 1]  # their predictions
        nll = F.cross_entropy(preds, targets, reduction="sum").item()
        total = total + Perplexity(end - first, nll)
    return total


def evaluate(llm: LLM, texts: Sequence[str], window: int, stride: int) -> list[Perplexity]:
    model = llm.model
    window = min(window, model.args.block_size)
    model.setup_caches(1, window)
    positions = torch.arange(window, device=llm.device)

    def forward(chunk: torch.Tensor) -> torch.Tensor:
        return model(chunk, positions)

    logits_fn = torch.compile(forward, fullgraph=True, dynamic=False) if llm.compile else forward
    tok = llm.tokenizer
    results = []
    with torch.inference_mode():
        for text in texts:
            ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(text) + list(tok.eos_ids[:1])
            results.append(document_perplexity(ids, window, stride, logits_fn, llm.device))
    return results


def parse_args(argv: Sequence[str] | None) -> PerplexityArgs:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint_path", type=Path, required=True)
    p.add_argument("--text", type=Path, nargs="+", required=True, help="text files, each scored as one document")
    p.add_argument("--max_seq_len", type=int, default=512)
    p.add_argument("--stride", type=int, default=None, help="window step (default: max_seq_len // 2)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantize", default=None, help="quantize on load (int8)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    ns = p.parse_args(argv)
    return PerplexityArgs(**{**vars(ns), "text": tuple(ns.text)})


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
        llm = LLM.load(cfg.checkpoint_path, device=cfg.device, dtype=cfg.dtype, compile=cfg.compile,
                       quantize=cfg.quantize)
        texts = [path.read_text(encoding="utf-8", errors="replace") for path in cfg.text]
        per_file = evaluate(llm, texts, cfg.max_seq_len, cfg.window_stride)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    total = sum(per_file, Perplexity(0, 0.0))
    for path, result in zip(cfg.text, per_file):
        print(f"{path}: {result.tokens} tokens, perplexity {result.value:.3f}")
    print(f"total: {total.tokens} tokens, perplexity {total.value:.4f}")
    if cfg.json is not None:
        record = {"checkpoint": str(llm.info.path), "quantization": llm.info.scheme,
                  "dtype": str(llm.model.cache_dtype), "max_seq_len": cfg.max_seq_len, "stride": cfg.window_stride,
                  "tokens": total.tokens, "perplexity": total.value,
                  "files": {str(p): asdict(r) | {"perplexity": r.value} for p, r in zip(cfg.text, per_file)}}
        cfg.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
