#!/usr/bin/env python3
"""Real acceptance of speculative decoding on a real model and input-grounded tasks: rewrite a given piece of code,
answer from a given passage, summarize one. Each task is run greedily through the chat template in the same
process: plain, with prompt lookup, and with each --drafts entry, a draft that is the same model quantized on load
(by default int8, and int4 with the largest group size of 128, 64, 32 that divides every layer's inputs: 64 for
SmolLM2-135M). The table shows the mean accepted drafts per verify step, the acceptance rate and decode tok/s
against plain decoding.

    python benchmarks/bench_prompt_lookup.py [--checkpoint_path PATH] [--device cuda]
        [--dtype bfloat16] [--max_new_tokens 256] [--speculate_k 8] [--runs 3] [--drafts int8,int4,int4-g32]
        [--tasks code_edit,summarize] [--json FILE]
    python benchmarks/bench_prompt_lookup.py --device cpu --max_new_tokens 32 --runs 1  # small

--checkpoint_path takes a Redline checkpoint (file or folder) or a .gguf file; a GGUF is converted once, dequantized
to float32, into the folder NAME-float32 beside it (scripts/convert_gguf.py, which needs the gguf package; where it
is missing, convert elsewhere and pass the folder). Without it the demo model (SmolLM2-135M-Instruct,
scripts/demo_model.py) is fetched once. Replies end at EOS as in real use. decode tok/s counts accepted tokens
(tokens after the first over the time after the first, median of --runs after one warm-up); "same" says whether
the greedy output equals the plain output. Each record also counts the verify steps and the plain decode steps of
its first run: benchmarks/speculative_projection.py turns them, with a 7B model's measured step costs, into the 7B
speedup. A source that fails is recorded under "errors" and the others still run (exit code 1).
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from redline.options import MAX_SPECULATE_K
from redline.quantize import parse_quant_spec

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
# The quantized drafts of the same model measured by default.
DEFAULT_DRAFTS = ("int8", "int4")


@dataclass(frozen=True)
class TaskRecord:
    task: str
    source: str  # "plain", "prompt_lookup" or "<quantization>_draft" (e.g. "int8_draft", "int4-g64_draft")
    new_tokens: int
    decode_tok_s: float  # median of --runs
    speedup: float  # over plain decoding of the same task in the same run
    mean_accepted: float | None
    acceptance_rate: float | None
    same_output: bool  # the greedy tokens equal plain decoding's
    verify_steps: int | None = None  # of the first timed run
    plain_steps: int | None = None  # one-token decode steps of the first timed run (nothing drafted, or the end)
    draft_quantize: str | None = None  # a draft model's quantization, group size included ("int4-g64")


@dataclass(frozen=True)
class LookupBenchConfig:
    checkpoint_path: Path | None = None
    device: str | None = None
    dtype: str | None = None
    max_new_tokens: int = 256
    speculate_k: int = 8
    runs: int = 3
    compile: bool | None = None
    drafts: tuple[str, ...] = DEFAULT_DRAFTS  # quantize-on-load specs of the same model (quantize.parse_quant_spec)
    json_path: Path | None = None
    tasks: tuple[str, ...] = ()  # names of TASKS to run; () = all

    def __post_init__(self) -> None:
        if self.max_new_tokens < 2:
            raise ValueError(f"--max_new_tokens must be >= 2 (decode speed needs two), got {self.max_new_tokens}")
        if not 1 <= self.speculate_k <= MAX_SPECULATE_K:
            raise ValueError(f"--speculate_k must be in 1..{MAX_SPECULATE_K}, got {self.speculate_k}")
        if self.runs < 1:
            raise ValueError(f"--runs must be a positive integer, got {self.runs}")
        for spec in self.drafts:
            try:
                parse_quant_spec(spec)
            except ValueError as exc:
                raise ValueError(f"--drafts: {exc}") from None
        if len(set(self.drafts)) != len(self.drafts):
            raise ValueError(f"--drafts names a quantization twice: {','.join(self.drafts)}")
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown --tasks {', '.join(unknown)}; choose from {', '.join(TASKS)}")
        if self.checkpoint_path is not None and not self.checkpoint_path.exists():
            raise FileNotFoundError(f"--checkpoint_path {self.checkpoint_path} does not exist; convert a checkpoint "
                                    "first, or leave it out to use the demo model")


def timed_chat(llm: Any, messages: list[dict[str, str]], cfg: LookupBenchConfig, **speculation: Any) -> list[Any]:
    """--runs greedy replies after one warm-up (which compiles); the results, in order."""
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, **speculation)  # ends at EOS, as a real reply does
    llm.chat(messages, **kwargs)
    return [llm.chat(messages, **kwargs) for _ in range(cfg.runs)]


def draft_label(llm: Any) -> str:
    """The quantization an engine runs: "int8", "int4-gG" or "none"."""
    from redline.quantize import Int4Linear, model_quantization

    scheme = model_quantization(llm.model)
    if scheme != "int4":
        return scheme
    return f"int4-g{next(m for m in llm.model.modules() if isinstance(m, Int4Linear)).group_size}"


def source_record(task: str, source: str, runs: list[Any], plain: list[Any], base: float,
                  draft_quantize: str | None = None) -> TaskRecord:
    rate = statistics.median(r.stats.decode_tok_s for r in runs)
    stats = runs[0].stats
    return TaskRecord(task, source, len(runs[0].token_ids), rate, rate / base if base else 0.0, stats.mean_accepted,
                      stats.acceptance_rate, runs[0].token_ids == plain[0].token_ids, stats.verify_steps,
                      stats.plain_steps, draft_quantize)


def bench_tasks(llm: Any, drafts: dict[str, Any], cfg: LookupBenchConfig, tasks: dict[str, str] | None = None,
                errors: list[dict[str, str]] | None = None, log: Any = None) -> list[TaskRecord]:
    """Every task (default: TASKS) plain, with prompt lookup and with each draft LLM of `drafts` (label -> LLM). A
    source that raises is appended to `errors` (when given) and skipped; without `errors` it raises."""
    records = []
    tasks = TASKS if tasks is None else tasks
    log = log or (lambda message: None)
    sources = [("prompt_lookup", "prompt_lookup", None)] + [(f"{label}_draft", draft, label)
                                                            for label, draft in drafts.items()]
    for name, message in tasks.items():
        messages = [{"role": "user", "content": message}]
        log(f"{name}: plain")
        plain = timed_chat(llm, messages, cfg)
        base = statistics.median(r.stats.decode_tok_s for r in plain)
        records.append(TaskRecord(name, "plain", len(plain[0].token_ids), base, 1.0, None, None, True))
        for source, value, label in sources:
            log(f"{name}: {source}")
            try:
                runs = timed_chat(llm, messages, cfg, draft=value, speculate_k=cfg.speculate_k)
            except Exception as exc:  # one failing source (a kernel, a compile) must not lose the others
                if errors is None:
                    raise
                traceback.print_exc(file=sys.stderr)
                errors.append({"what": f"{name} {source}", "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                continue
            records.append(source_record(name, source, runs, plain, base, label))
    return records


def format_records(records: Sequence[TaskRecord], k: int, errors: Sequence[dict[str, str]] = ()) -> str:
    lines = [f"Speculative decoding on input-grounded tasks (k = {k}, greedy, decode tok/s counts accepted tokens)",
             f"{'task':<12} {'source':<16} {'tokens':>6} {'tok/s':>9} {'speedup':>8} {'accepted':>9} {'rate':>6} "
             f"{'verify':>6} {'plain':>6} same"]
    for r in records:
        accepted = f"{r.mean_accepted:.2f}" if r.mean_accepted is not None else "-"
        rate = f"{r.acceptance_rate:.0%}" if r.acceptance_rate is not None else "-"
        steps = [str(v) if v is not None else "-" for v in (r.verify_steps, r.plain_steps)]
        lines.append(f"{r.task:<12} {r.source:<16} {r.new_tokens:>6} {r.decode_tok_s:>9.1f} {r.speedup:>7.2f}x "
                     f"{accepted:>9} {rate:>6} {steps[0]:>6} {steps[1]:>6} {'yes' if r.same_output else 'NO'}")
    for source in dict.fromkeys(r.source for r in records if r.source != "plain"):
        mine = [r for r in records if r.source == source]
        lines.append(f"mean over tasks, {source}: speedup {statistics.mean(r.speedup for r in mine):.2f}x, "
                     f"accepted {statistics.mean(r.mean_accepted or 0.0 for r in mine):.2f} per step, "
                     f"rate {statistics.mean(r.acceptance_rate or 0.0 for r in mine):.0%}")
    lines += [f"FAILED {e['what']}: {e['error']}" for e in errors]
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> LookupBenchConfig:
    from redline.checkpoint import OneLineArgumentParser

    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint_path", type=Path, default=None,
                   help="a chat model: Redline checkpoint or .gguf (default: the demo SmolLM2)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default: the checkpoint's)")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--speculate_k", type=int, default=8)
    p.add_argument("--runs", type=int, default=3, help="timed replies per task and source (median reported)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the steps (default: on for the GPU, off for the CPU)")
    p.add_argument("--drafts", default=",".join(DEFAULT_DRAFTS),
                   help="comma-separated quantized drafts of the same model: int8, int4, int4-gG (G: group size)")
    p.add_argument("--no-draft-model", dest="draft_model", action="store_false", help="no draft model at all")
    p.add_argument("--json", dest="json_path", type=Path, default=None, help="write the records here")
    p.add_argument("--tasks", default="", help=f"comma-separated tasks to run (default: all of {', '.join(TASKS)})")
    ns = p.parse_args(list(argv))
    drafts = tuple(d.strip() for d in ns.drafts.split(",") if d.strip()) if ns.draft_model else ()
    tasks = tuple(t.strip() for t in ns.tasks.split(",") if t.strip())
    return LookupBenchConfig(ns.checkpoint_path, ns.device, ns.dtype, ns.max_new_tokens, ns.speculate_k, ns.runs,
                             ns.compile, drafts, ns.json_path, tasks)


def converted_gguf(path: Path) -> Path:
    """The float32 Redline checkpoint of a GGUF file, in NAME-float32 beside it, converted when absent or older."""
    out = path.parent / f"{path.stem}-float32" / "model.safetensors"
    if out.is_file() and (out.parent / "tokenizer_config.json").is_file() and \
            out.stat().st_mtime >= path.stat().st_mtime:
        return out
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"{path} is a GGUF file, and reading one needs the gguf package (pip install gguf); or "
                         f"convert it where gguf is installed (scripts/convert_gguf.py --gguf FILE --dequantize "
                         f"--dtype float32 --out DIR/model.safetensors) and pass DIR")
    from redline.scripts.convert_gguf import convert_gguf

    return convert_gguf(path, out, "float32", dequantize=True)


def checkpoint_for(cfg: LookupBenchConfig) -> Path:
    """--checkpoint_path as a Redline checkpoint (a GGUF converted once), or the demo model."""
    if cfg.checkpoint_path is None:
        from redline.scripts.demo_model import demo_checkpoint

        return demo_checkpoint()
    if cfg.checkpoint_path.is_file() and cfg.checkpoint_path.suffix.lower() == ".gguf":
        return converted_gguf(cfg.checkpoint_path)
    return cfg.checkpoint_path


def run(cfg: LookupBenchConfig, log: Any = None) -> tuple[list[TaskRecord], dict[str, Any]]:
    from redline.generate import LLM

    path = checkpoint_for(cfg)
    llm = LLM.load(path, device=cfg.device, dtype=cfg.dtype, compile=cfg.compile)
    drafts = {}
    for spec in cfg.drafts:  # a group size that does not divide the model is a one-line error here, before timing
        draft = LLM.load(path, device=cfg.device, dtype=cfg.dtype, compile=cfg.compile, quantize=spec)
        drafts[draft_label(draft)] = draft
    errors: list[dict[str, str]] = []
    tasks = {name: TASKS[name] for name in cfg.tasks} if cfg.tasks else None
    records = bench_tasks(llm, drafts, cfg, tasks, errors, log)
    return records, {"checkpoint": str(path), "device": str(llm.device), "dtype": str(llm.model.cache_dtype),
                     "speculate_k": cfg.speculate_k, "max_new_tokens": cfg.max_new_tokens, "runs": cfg.runs,
                     "drafts": list(drafts), "errors": errors, "gate_cost_ratio": gate_cost_ratio(llm)}


def gate_cost_ratio(llm: Any) -> float | None:
    """The verify/decode step cost ratio prompt lookup's cost gate measured (the last one), or None."""
    ratios = list(llm.runner.costs.values())
    return ratios[-1] if ratios else None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse_args(sys.argv[1:] if argv is None else argv)
        records, about = run(cfg, log=lambda message: print(message, file=sys.stderr, flush=True))
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_records(records, cfg.speculate_k, about["errors"]))
    if about["gate_cost_ratio"] is not None:
        print(f"prompt lookup's cost gate: a verify step measured {about['gate_cost_ratio']:.2f} decode steps, so a "
              f"match length is verified while its proposals keep {about['gate_cost_ratio'] - 1:.2f} drafts or more")
    if cfg.json_path is not None:
        from redline.benchmarks.bench_report import write_json

        write_json({**about, "records": [asdict(r) for r in records]}, cfg.json_path)
        print(f"\nJSON written to {cfg.json_path}")
    return 1 if about["errors"] else 0


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.benchmarks.bench_prompt_lookup import main as package_main

    sys.exit(package_main())
