#!/usr/bin/env python3
"""The speedup measured acceptance gives a larger model: acceptance from benchmarks/bench_prompt_lookup.py (a real
model on input-grounded tasks) combined with the step costs of that larger model measured by benchmarks/bench.py
(verify steps for each k, decode steps of the model and of its quantized copies as drafts).

    python benchmarks/bench.py --model Llama-2-7B --quant none --speculate-k 1,2,3,4,5,6,7,8 --json spec-bf16.json
    python benchmarks/bench.py --model Llama-2-7B --quant int8 --speculate-k 1,2,3,4,5,6,7,8 --json spec-int8.json
    python benchmarks/bench.py --model Llama-2-7B --quant int8,int4 --json decode.json     # draft step costs
    python benchmarks/bench_prompt_lookup.py --json lookup.json
    python benchmarks/speculative_projection.py --spec spec-bf16.json,spec-int8.json,decode.json \\
        --acceptance lookup.json [--json FILE]

The model, per target quantization q (each one with verify steps in the --spec files), task and draft source, with
the lookup run's k:
- a verify step costs verify(q, k) plus the draft's work: k x decode(d) for a draft that is the model quantized to
  d (its own decode steps; the catch-up step after a fully accepted run, at most one per verify step, is left out),
  0 for prompt lookup (a host-side dictionary lookup). A plain decode step (nothing drafted, or the reply's end)
  costs decode(q).
- tokens: a verify step keeps its accepted drafts and the target's own next token, 1 + accepted; a plain step
  gives 1. With the lookup run's counts (V verify steps, P plain steps, mean accepted m):
      tokens per step = (V (1 + m) + P) / (V + P)
      cost per step   = (V (verify(q, k) + draft) + P decode(q)) / (V + P)
      projected tok/s = tokens per step / cost per step,   speedup = projected tok/s x decode(q)
  For reference the table also shows what an independent per-token acceptance a (the run's acceptance rate) would
  give a verify step of k drafts: (1 - a^(k+1)) / (1 - a) tokens. The measured counts are used for the speedup:
  acceptance is not independent from token to token, and prompt lookup often drafts fewer than k.
- decode(q) and verify(q, k) are the medians of bench.py --speculate-k (CUDA events around one CUDA-graph replay);
  a draft's decode(d) comes from its --speculate-k run or else from a plain bench.py run at batch 1
  (1 / decode tok/s, which also holds the host's per-token work).
The draft quantization's group size is the lookup run's (int4-g64 on SmolLM2-135M); the step cost is the bench's
(int4 at its --groupsize, 128 by default). A "check" line compares the replay-draft ceiling that bench.py measured
with what this model predicts for an always-right draft.
"""
from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from redline.checkpoint import OneLineArgumentParser


@dataclass(frozen=True)
class StepCosts:
    """One model's measured step costs in µs: decode per quantization, verify per (quantization, k)."""
    model: str
    decode_us: dict[str, float]
    verify_us: dict[tuple[str, int], float]
    ceilings: list[dict[str, Any]]


@dataclass(frozen=True)
class Projection:
    target: str  # the target's quantization: "none" (the dense dtype) or "int8"
    task: str
    source: str
    k: int
    tokens_per_step: float
    iid_tokens_per_verify: float | None  # (1 - a^(k+1)) / (1 - a) for the measured acceptance rate a
    cost_per_step_us: float
    projected_tok_s: float
    plain_tok_s: float
    speedup: float


def read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {what} {path} ({exc}); pass a JSON file written by --json") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object; pass a file written by --json")
    return data


def step_costs(reports: Sequence[dict[str, Any]], model: str | None) -> StepCosts:
    """The step costs of `model` (None: the only model in the reports) from bench.py reports."""
    spec = [r for report in reports for key in ("decode", "verify")
            for r in report.get("speculative", {}).get(key, [])]
    plain = [r for report in reports for r in report.get("records", [])
             if r.get("batch_size") == 1 and r.get("tp", 1) == 1 and r.get("decode_tok_s")]
    models = sorted({r["model"] for r in spec + plain})
    if model is None:
        if len(models) != 1:
            raise ValueError(f"the --spec files hold {len(models) or 'no'} models {models}; pick one with --model")
        model = models[0]
    if model not in models:
        raise ValueError(f"no step costs for {model} in the --spec files (they hold {models}); pass bench.py JSONs "
                         f"of it")
    decode: dict[str, list[float]] = {}
    verify: dict[tuple[str, int], list[float]] = {}
    for r in spec:
        if r["model"] == model:
            decode.setdefault(r["quant"], []).append(r["decode_us"])
            if "verify_us" in r:
                verify.setdefault((r["quant"], r["k"]), []).append(r["verify_us"])
    fallback: dict[str, list[float]] = {}  # a draft's cost where no --speculate-k run timed its decode step
    for r in plain:
        if r["model"] == model and r["quant"] not in decode:
            fallback.setdefault(r["quant"], []).append(1e6 / r["decode_tok_s"])
    decode_us = {q: statistics.median(v) for q, v in {**decode, **fallback}.items()}
    ceilings = [c for report in reports for c in report.get("speculative", {}).get("ceiling", [])
                if c["model"] == model]
    return StepCosts(model, decode_us, {key: statistics.median(v) for key, v in verify.items()}, ceilings)


def iid_tokens(rate: float | None, k: int) -> float | None:
    """Expected tokens of one verify step of k drafts when each is accepted with probability `rate` independently."""
    if rate is None:
        return None
    return k + 1.0 if rate >= 1.0 else (1 - rate ** (k + 1)) / (1 - rate)


def draft_mode(source: str) -> str | None:
    """"int4-g64_draft" -> "int4"; None for prompt lookup (no model)."""
    if not source.endswith("_draft"):
        return None
    return source.removesuffix("_draft").split("-g")[0]


def project(costs: StepCosts, lookup: dict[str, Any]) -> tuple[list[Projection], list[str]]:
    """One projection per target quantization x task x source, and notes on what could not be projected."""
    k = int(lookup["speculate_k"])
    out, notes = [], []
    targets = sorted({q for q, kk in costs.verify_us if kk == k})
    if not targets:
        have = sorted({kk for _, kk in costs.verify_us})
        raise ValueError(f"the lookup run used k = {k}, but the --spec files time verify steps only for k = {have}; "
                         f"run bench.py --speculate-k with {k}")
    for target in targets:
        decode, verify = costs.decode_us[target], costs.verify_us[(target, k)]
        for r in lookup.get("records", []):
            if r["source"] == "plain":
                continue
            mode = draft_mode(r["source"])
            if mode == target:
                continue  # a draft that is the target itself saves nothing
            if mode is not None and mode not in costs.decode_us:
                notes.append(f"{r['source']}: no decode step of {costs.model} {mode} in the --spec files; add a "
                             f"bench.py run with --quant {mode}")
                continue
            draft = 0.0 if mode is None else k * costs.decode_us[mode]
            verify_steps = r.get("verify_steps")
            plain_steps = r.get("plain_steps") or 0
            if verify_steps is None:  # an older lookup JSON: every step a verify step
                verify_steps, plain_steps = 1, 0
            steps = verify_steps + plain_steps
            if steps == 0:
                continue
            tokens = (verify_steps * (1 + (r["mean_accepted"] or 0.0)) + plain_steps) / steps
            cost = (verify_steps * (verify + draft) + plain_steps * decode) / steps
            rate = tokens / cost * 1e6
            out.append(Projection(target, r["task"], r["source"], k, tokens, iid_tokens(r.get("acceptance_rate"), k),
                                  cost, rate, 1e6 / decode, rate * decode / 1e6))
    return out, sorted(set(notes))


def ceiling_checks(costs: StepCosts) -> list[str]:
    """The measured replay-draft ceiling against this model's prediction for a draft that is always right."""
    lines = []
    for c in costs.ceilings:
        verify = costs.verify_us.get((c["quant"], c["k"]))
        if verify is None or c["quant"] not in costs.decode_us:
            continue
        predicted = (1 + c["mean_accepted"]) * costs.decode_us[c["quant"]] / verify
        lines.append(f"check: {c['model']} {c['quant']} k = {c['k']} replay ceiling measured {c['speedup']:.2f}x, "
                     f"this model predicts {predicted:.2f}x")
    return lines


def format_projections(costs: StepCosts, rows: Sequence[Projection], notes: Sequence[str]) -> str:
    lines = [f"Projected speculative speedup of {costs.model} (acceptance measured on the lookup run's model)",
             "decode µs per step: " + ", ".join(f"{q} {us:.0f}" for q, us in costs.decode_us.items()), "",
             f"{'target':<7} {'task':<12} {'source':<16} {'k':>2} {'tok/step':>8} {'iid':>6} {'µs/step':>8} "
             f"{'tok/s':>8} {'plain':>8} {'speedup':>8}"]
    for p in rows:
        iid = f"{p.iid_tokens_per_verify:.2f}" if p.iid_tokens_per_verify is not None else "-"
        lines.append(f"{p.target:<7} {p.task:<12} {p.source:<16} {p.k:>2} {p.tokens_per_step:>8.2f} {iid:>6} "
                     f"{p.cost_per_step_us:>8.0f} {p.projected_tok_s:>8.1f} {p.plain_tok_s:>8.1f} {p.speedup:>7.2f}x")
    for target, source in dict.fromkeys((p.target, p.source) for p in rows):
        mine = [p for p in rows if (p.target, p.source) == (target, source)]
        lines.append(f"mean over tasks, {target} target, {source}: {statistics.mean(p.speedup for p in mine):.2f}x")
    lines += ceiling_checks(costs) + [f"not projected: {n}" for n in notes]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", required=True, help="comma-separated bench.py JSON files (--speculate-k runs, and plain "
                                                 "runs for the drafts' decode steps)")
    p.add_argument("--acceptance", type=Path, required=True, help="the JSON of benchmarks/bench_prompt_lookup.py")
    p.add_argument("--model", default=None, help="the model of the --spec files to project (default: the only one)")
    p.add_argument("--json", dest="json_path", type=Path, default=None, help="write the projections here")
    try:
        ns = p.parse_args(sys.argv[1:] if argv is None else argv)
        reports = [read_json(Path(s.strip()), "--spec file") for s in ns.spec.split(",") if s.strip()]
        lookup = read_json(ns.acceptance, "--acceptance file")
        if "speculate_k" not in lookup or "records" not in lookup:
            raise ValueError(f"{ns.acceptance} is not a bench_prompt_lookup.py report; pass the file its --json wrote")
        costs = step_costs(reports, ns.model)
        rows, notes = project(costs, lookup)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyError as exc:
        print(f"error: a record in the JSON files lacks the field {exc}; pass files written by bench.py and "
              f"bench_prompt_lookup.py --json", file=sys.stderr)
        return 2
    print(format_projections(costs, rows, notes))
    if ns.json_path is not None:
        from redline.benchmarks.bench_report import write_json

        write_json({"model": costs.model, "decode_us": costs.decode_us, "projections": [asdict(r) for r in rows],
                    "notes": list(notes), "checks": ceiling_checks(costs)}, ns.json_path)
        print(f"\nJSON written to {ns.json_path}")
    return 0


if __name__ == "__main__":
    # Run the package's copy of this module, so the classes it defines are the ones every other module imports.
    from redline.benchmarks.speculative_projection import main as package_main

    sys.exit(package_main())
