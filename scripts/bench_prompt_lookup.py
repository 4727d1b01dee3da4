#!/usr/bin/env python3
"""Real acceptance of speculative decoding on a real model and input-grounded tasks: rewrite a given piece of code,
answer from a given passage, summarize one. Each task is run greedily through the chat template three ways in
the same process: plain, with prompt lookup, and with an int8 draft of the same model; the table shows the mean
accepted drafts per verify step, the acceptance rate and decode tok/s against plain decoding.

    PYTHONPATH=$PWD python scripts/bench_prompt_lookup.py [--checkpoint_path PATH] [--device cuda]
        [--dtype bfloat16] [--max_new_tokens 256] [--speculate_k 8] [--runs 3] [--json FILE]
    PYTHONPATH=$PWD python scripts/bench_prompt_lookup.py --device cpu --max_new_tokens 32 --runs 1  # small

Without --checkpoint_path the demo model (SmolLM2-135M-Instruct, scripts/demo_model.py) is fetched once.
Replies end at EOS as in real use. decode tok/s counts accepted tokens (tokens after the first over the time after
the first, median of --runs after one warm-up); "same" says whether the greedy output equals the plain output.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from options import MAX_SPECULATE_K

_CODE = '''def moving_average(values, window):
    result = []
    for i in range(len(values)):
        start = max(0, i - window + 1)
        chunk = values[start:i + 1]
        result.append(sum(chunk) / len(chunk))
    return result


def normalize(values):
    low = min(values)
    high = max(values)
    return [(v - low) / (high - low) for v in values]
'''
_PASSAGE = ("The Amazon rainforest covers about 5.5 million square kilometres across nine countries, with 60 percent "
            "of it in Brazil. It holds an estimated 390 billion trees of 16,000 species. The river that drains it, "
            "the Amazon, carries more water than the next seven largest rivers combined and discharges about 20 "
            "percent of the fresh water that flows into the world's oceans. Deforestation peaked in 2004, when "
            "27,000 square kilometres were cleared, and fell by about 80 percent over the following decade.")
# name -> the user's message: each asks for an answer built from text the prompt itself contains.
TASKS = {
    "code_edit": "Rename the function moving_average to rolling_mean and add a docstring to each function. "
                 "Return the whole file.\n\n" + _CODE,
    "passage_qa": "Answer from the passage only, quoting it where you can: how much fresh water does the Amazon "
                  "discharge into the oceans, and when did deforestation peak?\n\n" + _PASSAGE,
    "summarize": "Summarize this passage in three sentences, keeping its numbers.\n\n" + _PASSAGE,
}


@dataclass(frozen=True)
class TaskRecord:
    task: str
    source: str  # "plain", "prompt_lookup" or "int8_draft"
    new_tokens: int
    decode_tok_s: float  # median of --runs
    speedup: float  # over plain decoding of the same task in the same run
    mean_accepted: float | None
    acceptance_rate: float | None
    same_output: bool  # the greedy tokens equal plain decoding's


@dataclass(frozen=True)
class LookupBenchConfig:
    checkpoint_path: Path | None = None
    device: str | None = None
    dtype: str | None = None
    max_new_tokens: int = 256
    speculate_k: int = 8
    runs: int = 3
    compile: bool | None = None
    draft_model: bool = True
    json_path: Path | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 2:
            raise ValueError(f"--max_new_tokens must be >= 2 (decode speed needs two), got {self.max_new_tokens}")
        if not 1 <= self.speculate_k <= MAX_SPECULATE_K:
            raise ValueError(f"--speculate_k must be in 1..{MAX_SPECULATE_K}, got {self.speculate_k}")
        if self.runs < 1:
            raise ValueError(f"--runs must be a positive integer, got {self.runs}")
        if self.checkpoint_path is not None and not self.checkpoint_path.exists():
            raise FileNotFoundError(f"--checkpoint_path {self.checkpoint_path} does not exist; convert a checkpoint "
                                    "first, or leave it out to use the demo model")


def timed_chat(llm: Any, messages: list[dict[str, str]], cfg: LookupBenchConfig, **speculation: Any) -> list[Any]:
    """--runs greedy replies after one warm-up (which compiles); the results, in order."""
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, **speculation)  # ends at EOS, as a real reply does
    llm.chat(messages, **kwargs)
    return [llm.chat(messages, **kwargs) for _ in range(cfg.runs)]


def bench_tasks(llm: Any, draft: Any, cfg: LookupBenchConfig,
                tasks: dict[str, str] | None = None) -> list[TaskRecord]:
    """Every task (default: TASKS) plain, with prompt lookup and (when `draft` is an LLM) with the draft model."""
    records = []
    tasks = TASKS if tasks is None else tasks
    sources = [("prompt_lookup", "prompt_lookup")] + ([("int8_draft", draft)] if draft is not None else [])
    for name, message in tasks.items():
        messages = [{"role": "user", "content": message}]
        plain = timed_chat(llm, messages, cfg)
        base = statistics.median(r.stats.decode_tok_s for r in plain)
        records.append(TaskRecord(name, "plain", len(plain[0].token_ids), base, 1.0, None, None, True))
        for source, value in sources:
            runs = timed_chat(llm, messages, cfg, draft=value, speculate_k=cfg.speculate_k)
            rate = statistics.median(r.stats.decode_tok_s for r in runs)
            stats = runs[0].stats
            records.append(TaskRecord(name, source, len(runs[0].token_ids), rate, rate / base if base else 0.0,
                                      stats.mean_accepted, stats.acceptance_rate,
                                      runs[0].token_ids == plain[0].token_ids))
    return records


def format_records(records: Sequence[TaskRecord], k: int) -> str:
    lines = [f"Speculative decoding on input-grounded tasks (k = {k}, greedy, decode tok/s counts accepted tokens)",
             f"{'task':<12} {'source':<14} {'tokens':>6} {'tok/s':>9} {'speedup':>8} {'accepted':>9} {'rate':>6} same"]
    for r in records:
        accepted = f"{r.mean_accepted:.2f}" if r.mean_accepted is not None else "-"
        rate = f"{r.acceptance_rate:.0%}" if r.acceptance_rate is not None else "-"
        lines.append(f"{r.task:<12} {r.source:<14} {r.new_tokens:>6} {r.decode_tok_s:>9.1f} {r.speedup:>7.2f}x "
                     f"{accepted:>9} {rate:>6} {'yes' if r.same_output else 'NO'}")
    for source in ("prompt_lookup", "int8_draft"):
        mine = [r for r in records if r.source == source]
        if mine:
            lines.append(f"mean over tasks, {source}: speedup {statistics.mean(r.speedup for r in mine):.2f}x, "
                         f"accepted {statistics.mean(r.mean_accepted or 0.0 for r in mine):.2f} per step, "
                         f"rate {statistics.mean(r.acceptance_rate or 0.0 for r in mine):.0%}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> LookupBenchConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint_path", type=Path, default=None, help="a chat model (default: the demo SmolLM2)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default: the checkpoint's)")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--speculate_k", type=int, default=8)
    p.add_argument("--runs", type=int, default=3, help="timed replies per task and source (median reported)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the steps (default: on for the GPU, off for the CPU)")
    p.add_argument("--no-draft-model", dest="draft_model", action="store_false", help="skip the int8 draft")
    p.add_argument("--json", dest="json_path", type=Path, default=None, help="write the records here")
    ns = p.parse_args(list(argv))
    return LookupBenchConfig(**vars(ns))


def run(cfg: LookupBenchConfig) -> tuple[list[TaskRecord], dict[str, Any]]:
    from generate import LLM
    from scripts.demo_model import demo_checkpoint

    path = cfg.checkpoint_path or demo_checkpoint()
    llm = LLM.load(path, device=cfg.device, dtype=cfg.dtype, compile=cfg.compile)
    draft = LLM.load(path, device=cfg.device, dtype=cfg.dtype, compile=cfg.compile, quantize="int8") \
        if cfg.draft_model else None
    records = bench_tasks(llm, draft, cfg)
    return records, {"checkpoint": str(path), "device": str(llm.device), "speculate_k": cfg.speculate_k,
                     "max_new_tokens": cfg.max_new_tokens, "runs": cfg.runs}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse_args(sys.argv[1:] if argv is None else argv)
        records, about = run(cfg)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_records(records, cfg.speculate_k))
    if cfg.json_path is not None:
        from scripts.bench_report import write_json

        write_json({**about, "records": [asdict(r) for r in records]}, cfg.json_path)
        print(f"\nJSON written to {cfg.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
