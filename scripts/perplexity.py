"""Perplexity of a Redline checkpoint over local text files, in sliding windows.

python scripts/perplexity.py --checkpoint_path X --text FILE [FILE ...] [--max_seq_len 512] [--stride 256]

Each file is one document: the ids the tokenizer gives for its text (BOS by the tokenizer's own rule), then EOS. A window of max_seq_len tokens
(at most the model's context; default 512 or the context if shorter) moves by `stride`; every token after the
first is scored exactly once, by the first window that sees it with the most context.
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
from typing import Any

import torch
import torch.nn.functional as F

from redline.checkpoint import OneLineArgumentParser, checkpoint_inputs, run_cli, write_atomically
from redline.outputs import check_output
from redline.generate import LLM


# The default window: long enough for a stable estimate, short enough for a quick CPU run of a small model.
DEFAULT_WINDOW = 512


@dataclass(frozen=True)
class PerplexityArgs:
    checkpoint_path: Path
    text: tuple[Path, ...]
    max_seq_len: int | None = None  # None: DEFAULT_WINDOW, or the model's context if that is shorter
    stride: int | None = None
    device: str | None = None
    dtype: str | None = None
    quantize: str | None = None
    compile: bool | None = None
    json: Path | None = None
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"--max_seq_len must be at least 2, got {self.max_seq_len}")
        if self.stride is not None and self.stride < 1:
            raise ValueError(f"--stride must be at least 1, got {self.stride}")
        if self.max_seq_len is not None and self.stride is not None:
            window_and_stride(self.max_seq_len, self.stride, self.max_seq_len)
        for path in self.text:
            if path.is_dir():
                raise ValueError(f"--text {path} is a folder; pass the text files inside it")
            if not path.is_file():
                raise FileNotFoundError(f"text file {path} does not exist")
        if self.json is not None:
            check_output(self.json, [*self.text, *checkpoint_inputs(self.checkpoint_path)], "--json",
                         overwrite=self.overwrite, replaceable=is_perplexity_record, kind="perplexity record")


def is_perplexity_record(path: Path) -> bool:
    """Whether `path` holds a record this script wrote (an earlier --json), which --overwrite may replace."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(record, dict) and {"checkpoint", "perplexity", "files"} <= set(record)


def window_and_stride(max_seq_len: int | None, stride: int | None, context: int) -> tuple[int, int]:
    """The window and step to score with: the window never exceeds the model's context, and consecutive windows
    overlap (a window's first token has no context inside it)."""
    window = min(DEFAULT_WINDOW, context) if max_seq_len is None else max_seq_len
    if window > context:
        raise ValueError(f"--max_seq_len {window} is longer than the model's context ({context} tokens); "
                         f"pass --max_seq_len {context} or less")
    if window < 2:
        raise ValueError(f"a window needs at least 2 tokens, but the model's context is {context}")
    stride = window // 2 if stride is None else stride
    if not 1 <= stride < window:
        raise ValueError(f"--stride must be between 1 and the window - 1 ({window - 1}), got {stride}")
    return window, stride


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
    if not 1 <= stride < window:
        raise ValueError(f"stride {stride} must be at least 1 and below the window ({window})")
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


def document_ids(tok: Any, text: str) -> list[int]:
    """The ids scored for one document: exactly what the tokenizer gives for the text (BOS by its own rule, as
    transformers' tokenizer gives them), then EOS unless the tokenizer already ended with it."""
    ids = tok.encode(text)
    eos = list(tok.eos_ids[:1])
    return ids if eos and ids[-1:] == eos else ids + eos


def evaluate(llm: LLM, texts: Sequence[str], window: int, stride: int) -> list[Perplexity]:
    model = llm.model
    window, stride = window_and_stride(window, stride, model.args.block_size)
    model.setup_caches(1, window)
    positions = torch.arange(window, device=llm.device)

    def forward(chunk: torch.Tensor) -> torch.Tensor:
        return model(chunk, positions)

    logits_fn = torch.compile(forward, fullgraph=True, dynamic=False) if llm.compile else forward
    tok = llm.tokenizer
    results = []
    with torch.inference_mode():
        for text in texts:
            ids = document_ids(tok, text)
            results.append(document_perplexity(ids, window, stride, logits_fn, llm.device))
    return results


def parse_args(argv: Sequence[str] | None) -> PerplexityArgs:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint_path", type=Path, required=True, help="Redline checkpoint file or its folder")
    p.add_argument("--text", type=Path, nargs="+", required=True, help="text files, each scored as one document")
    p.add_argument("--max_seq_len", type=int, default=None,
                   help=f"window length; None means {DEFAULT_WINDOW}, or the model's context if shorter")
    p.add_argument("--stride", type=int, default=None, help="window step; None means window // 2")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N; None means cuda when available")
    p.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32; None means the checkpoint's")
    p.add_argument("--quantize", default=None, help="quantize on load: int8, int4 or int4-gG; None means as stored")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the forward pass; None means on for GPU, off for CPU")
    p.add_argument("--json", type=Path, default=None,
                   help="also write the results here (checked before the run); None means no file")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier --json record of this script")
    ns = p.parse_args(argv)
    return PerplexityArgs(**{**vars(ns), "text": tuple(ns.text)})


def read_texts(paths: Sequence[Path]) -> list[str]:
    texts = []
    for path in paths:
        try:
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
        except OSError as exc:
            raise ValueError(f"cannot read --text {path} ({exc.strerror}); check its permissions") from None
    return texts


def run(cfg: PerplexityArgs) -> int:
    texts = read_texts(cfg.text)
    llm = LLM.load(cfg.checkpoint_path, device=cfg.device, dtype=cfg.dtype, compile=cfg.compile, quantize=cfg.quantize)
    window, stride = window_and_stride(cfg.max_seq_len, cfg.stride, llm.model.args.block_size)
    per_file = evaluate(llm, texts, window, stride)
    total = sum(per_file, Perplexity(0, 0.0))
    if cfg.json is not None:
        record = {"checkpoint": str(llm.info.path), "quantization": llm.info.scheme,
                  "dtype": str(llm.model.cache_dtype), "max_seq_len": window, "stride": stride,
                  "tokens": total.tokens, "perplexity": total.value,
                  "files": {str(p): asdict(r) | {"perplexity": r.value} for p, r in zip(cfg.text, per_file)}}
        write_atomically(cfg.json, lambda tmp: tmp.write_text(json.dumps(record, indent=2), encoding="utf-8"))
    for path, result in zip(cfg.text, per_file):
        print(f"{path}: {result.tokens} tokens, perplexity {result.value:.3f}")
    print(f"total: {total.tokens} tokens, perplexity {total.value:.4f}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(lambda: run(parse_args(argv)))


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.scripts.perplexity import main as package_main

    sys.exit(package_main())
