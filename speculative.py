"""Speculative decoding: a draft proposes up to k tokens, the target model checks them all in one forward pass.

    llm.generate(prompt, draft="prompt_lookup", speculate_k=5)    # copy from the context
    llm.generate(prompt, draft=LLM.load(small_path), speculate_k=5)  # a smaller model sharing the tokenizer
    llm.generate(prompt, draft=ReplayDraft(known_ids))             # any speculative.Draft

A verify step feeds [last, d1..dk] at positions p..p+k and reads the target's k+1 predictions at once: the
weights are read once for k+1 rows. Rejected positions cost nothing later: the static cache is written in place at
input_pos, so the next step simply overwrites them. Greedy decoding accepts the drafted tokens that equal the
target's argmax, so the output is the plain greedy output. Sampling uses rejection sampling: d_i is accepted with
probability min(1, p(d_i) / q(d_i)), a rejection resamples from the normalized max(p - q, 0), and a bonus token
is drawn from p when all k pass; p and q both carry temperature, top-k and top-p, and a deterministic draft has
q = one-hot. Each position's token then has the distribution plain sampling gives it.

Every random number is counter-based (sampling.exponential_noise): position j's acceptance test, resample and
draft sample each use their own stream keyed by (seed, j), and a position's numbers decide at most one kept token.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from redline.options import GenerationOptions
from redline.sampling import (SamplingParams, as_int64, exponential_noise, mix64, nucleus_keep_mask,
                              refuse_penalized)

# Added to the seed (then hashed) to key the acceptance tests' and the draft model's own noise: streams apart
# from the target's sampling noise, so no random number is used for two decisions.
ACCEPT_SALT = as_int64(0xA5A5_0F0F_1234_5678)
DRAFT_SALT = as_int64(0x5A5A_F0F0_8765_4321)
# The longest n-gram prompt lookup matches first; longer ones are rarely found, shorter ones often mislead.
DEFAULT_MAX_NGRAM = 3
# The cost gate's prior: a match length nobody has tried yet counts as this many proposals with half accepted.
GATE_PRIOR_PROPOSALS = 2
# A match length the gate turned down is verified again after this many refusals, so its record stays current.
GATE_RETRY_AFTER = 8
# Timed calls of each step when the gate measures their costs (median taken); each is one graph replay.
COST_SAMPLES = 7


# ---------------------------------------------------------------------------------------------------------------------
# Pure step functions (compiled once per k; no host syncs).


def filtered_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """logits (R, V) -> (R, V) fp32: the distribution sampling.sample draws from (temperature, top-k, top-p)."""
    scaled = logits.float() / temperature.clamp_min(1e-5)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # (R, V)
    probs = torch.softmax(sorted_logits, dim=-1)
    probs = probs * nucleus_keep_mask(probs, top_k, top_p)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def salted(seed: Tensor, salt: int) -> Tensor:
    """A seed for a noise stream apart from the one `seed` keys."""
    return mix64(seed + salt)


def accepted_run(drafts: Tensor, accept: Tensor, choice: Tensor) -> Tensor:
    """drafts (k,), accept (k,) bool, choice (k+1,) -> (k+2,): [n, d1..dn, choice[n], unused...], n the leading
    accepted count; the one host read of a step."""
    k = drafts.shape[0]
    n = accept.long().cumprod(0).sum()  # ()
    index = torch.arange(k + 1, device=drafts.device)  # (k+1,)
    tokens = torch.where(index < n, torch.cat([drafts, drafts[:1]]), choice)  # (k+1,)
    return torch.cat([n.view(1), tokens])


def unpack_step(step: Tensor) -> tuple[Tensor, Tensor]:
    """step (k+2,) = [last, d1..dk, count] (one host-to-device copy per verify step) -> ids (1, k+1), count (1,)."""
    return step[:-1].view(1, -1), step[-1:]


def full_step(k: int, device: torch.device) -> Tensor:
    """A step (k+2,) of k drafts, all token 0, counted in full: what compiling and timing a verify step feed it."""
    step = torch.zeros(k + 2, dtype=torch.long, device=device)
    step[-1] = k
    return step


def verify_greedy(model: torch.nn.Module, step: Tensor, input_pos: Tensor, vocab_bias: Tensor | None) -> Tensor:
    """step (k+2,) = [last, d1..dk, count]: ids [last, d1..dk] at input_pos (k+1,), count the real drafts (the rest
    is padding). A draft is accepted while it equals the target's argmax; the token after them is the argmax there."""
    ids, count = unpack_step(step)
    logits = model(ids, input_pos)[0]  # (k+1, V)
    if vocab_bias is not None:
        logits = logits + vocab_bias
    best = logits.argmax(dim=-1)  # (k+1,)
    drafts = ids[0, 1:]  # (k,)
    valid = torch.arange(drafts.shape[0], device=ids.device) < count  # (k,)
    return accepted_run(drafts, valid & (best[:-1] == drafts), best)


def verify_sampled(model: torch.nn.Module, step: Tensor, input_pos: Tensor, vocab_bias: Tensor | None,
                   q: Tensor | None, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor) -> Tensor:
    """Rejection sampling of step (k+2,) = [last, d1..dk, count] against the target's filtered p. q (k, V) is the
    draft's distribution of each d_i; None means a deterministic draft (q one-hot)."""
    ids, count = unpack_step(step)
    logits = model(ids, input_pos)[0]  # (k+1, V)
    if vocab_bias is not None:
        logits = logits + vocab_bias
    vocab = logits.shape[-1]
    p = filtered_probs(logits, temperature, top_k, top_p)  # (k+1, V)
    drafts = ids[0, 1:]  # (k,)
    valid = torch.arange(drafts.shape[0], device=ids.device) < count  # (k,)
    if q is None:
        q = F.one_hot(drafts, vocab).float()  # (k, V)
    q = torch.cat([q * valid[:, None], q.new_zeros(1, vocab)])  # (k+1, V): padding and the bonus row have no draft
    decided = input_pos + 1  # (k+1,) the position whose token each row decides
    uniform = torch.exp(-exponential_noise(salted(seed, ACCEPT_SALT), decided, 1, 1)).view(-1)[:-1]  # (k,)
    p_d = p[:-1].gather(1, drafts[:, None]).squeeze(1)  # (k,)
    q_d = q[:-1].gather(1, drafts[:, None]).squeeze(1)
    accept = valid & (uniform * q_d < p_d)  # u < p/q without a division
    residual = (p - q).clamp_min(0)  # (k+1, V)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    choice = torch.argmax(residual / exponential_noise(seed, decided, 1, vocab), dim=-1)  # (k+1,)
    return accepted_run(drafts, accept, choice)


def draft_sample_step(model: torch.nn.Module, token: Tensor, input_pos: Tensor, vocab_bias: Tensor | None,
                      temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor) -> tuple[Tensor, Tensor]:
    """token (1, 1) at input_pos (1,) -> (next token (1, 1), the filtered distribution q it was drawn from (1, V))."""
    logits = model(token, input_pos)[:, -1]  # (1, V)
    if vocab_bias is not None:
        logits = logits + vocab_bias
    q = filtered_probs(logits, temperature, top_k, top_p)  # (1, V)
    noise = exponential_noise(seed, input_pos + 1, 1, q.shape[-1])  # (1, V)
    return torch.argmax(q / noise, dim=-1, keepdim=True), q


# ---------------------------------------------------------------------------------------------------------------------
# Drafts.


@dataclass(frozen=True)
class Proposal:
    """Drafted tokens: `ids` on the host (a draft that proposes on the host) or `tokens` (1, count) on the target's
    device (a model draft), the count, q (count, V) or None, and `key`: what the draft's hit rate depends on (prompt
    lookup: the matched n-gram's length), or None when the engine should not gate the proposal on cost."""
    count: int
    ids: tuple[int, ...] = ()
    tokens: Tensor | None = None
    q: Tensor | None = None
    key: int | None = None


class Draft:
    """Proposes up to k tokens to follow a context. Subclass it and implement `propose`; the engine calls
    `start` once per generation and `accepted(n)` after each verify step (n of the proposed tokens were kept).
    A draft with `gated` set gives each proposal a `proposal_key`, and the engine cost-gates it: see CostGate."""

    gated = False  # whether the engine may skip this draft's proposals that do not pay (CostGate)

    def prepare(self, prompt_len: int, max_new_tokens: int, k: int, sampled: bool) -> float:
        """Before a generation's timings start: compile what it needs; returns the seconds that took."""
        return 0.0

    def start(self, prompt_ids: list[int], sampling: tuple[Tensor, ...]) -> None:
        """A generation begins (sampling: the target's (temperature, top_k, top_p, seed) tensors, () if greedy)."""

    def propose(self, context: list[int], k: int) -> Sequence[int]:
        """Up to k token ids to follow `context` (prompt and generated ids); may be empty."""
        raise NotImplementedError

    def accepted(self, n: int) -> None:
        """n of the last proposal's tokens were accepted."""

    def room(self) -> int | None:
        """The positions this draft can hold (a model's cache), or None for no limit."""
        return None

    def proposal(self, context: list[int], k: int, vocab: int, device: torch.device) -> Proposal:
        ids = tuple(int(t) for t in self.propose(context, k))
        if len(ids) > k or any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"{type(self).__name__}.propose returned {list(ids[:k + 1])}; it must return at most "
                             f"{k} token ids in 0..{vocab - 1}")
        return Proposal(len(ids), ids, key=self.proposal_key())

    def proposal_key(self) -> int | None:
        """What the last proposal's hit rate depends on, for the engine's cost gate; None: never gated."""
        return None


class PromptLookupDraft(Draft):
    """Matches the context's last n-gram (n = max_ngram down to 1) to its most recent earlier occurrence and
    proposes the tokens that followed it. An index of every n-gram's latest start is kept up to date as the
    context grows, so a proposal costs O(max_ngram), not a scan of the context."""

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, gated: bool = True) -> None:
        if not isinstance(max_ngram, int) or max_ngram < 1:
            raise ValueError(f"max_ngram must be an integer >= 1, got {max_ngram!r}")
        self.max_ngram = max_ngram
        self.gated = gated  # let the engine skip proposals of match lengths that have not paid off
        self._starts: dict[tuple[int, ...], int] = {}  # n-gram -> its latest start that has a token after it
        self._indexed = 0  # context tokens indexed so far
        self._match = 0  # the last proposal's matched n-gram length

    def start(self, prompt_ids: list[int], sampling: tuple[Tensor, ...]) -> None:
        self._starts, self._indexed = {}, 0

    def _index(self, context: list[int]) -> None:
        for end in range(max(self._indexed, 1), len(context)):  # context[end] follows the n-grams ending before it
            for n in range(1, min(self.max_ngram, end) + 1):
                self._starts[tuple(context[end - n:end])] = end - n
        self._indexed = len(context)

    def propose(self, context: list[int], k: int) -> list[int]:
        if len(context) < self._indexed:  # a different (shorter) context: index it afresh
            self._starts, self._indexed = {}, 0
        self._index(context)
        for n in range(min(self.max_ngram, len(context) - 1), 0, -1):
            begin = self._starts.get(tuple(context[-n:]))
            if begin is not None:
                self._match = n
                return context[begin + n:begin + n + k]
        return []

    def proposal_key(self) -> int | None:
        return self._match if self.gated else None


class ReplayDraft(Draft):
    """Proposes a known continuation of the prompt (for tests and the benchmark's ceiling): the next tokens of
    `continuation` while the generated text still follows it, nothing once it has left it."""

    def __init__(self, continuation: Sequence[int]) -> None:
        self.continuation = [int(t) for t in continuation]
        self._prompt_len = 0

    def start(self, prompt_ids: list[int], sampling: tuple[Tensor, ...]) -> None:
        self._prompt_len = len(prompt_ids)

    def propose(self, context: list[int], k: int) -> list[int]:
        done = len(context) - self._prompt_len
        if context[self._prompt_len:] != self.continuation[:done]:
            return []
        return self.continuation[done:done + k]


class ModelDraft(Draft):
    """Another Redline LLM (same tokenizer) drafts greedily, or samples from its own filtered q. Its static cache
    is kept in step with the target: a verify step that keeps n of k drafts leaves positions up to p + n valid,
    and the next proposal first feeds whatever the cache lacks (the last draft, when all k were kept)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._sampling: tuple[Tensor, ...] = ()
        self._valid = 0  # context positions whose cache entries hold the right tokens
        self._written = (0, 0)  # (first position, count) of the last proposal's cache writes

    def room(self) -> int:
        return self.llm.runner.cache_length

    def _step(self, token: Tensor, position: int) -> tuple[Tensor, Tensor | None]:
        """One draft decode step (its own compiled graph): token (1, 1) -> (next (1, 1), q (1, V) or None)."""
        runner = self.llm.runner
        input_pos = self._positions[position:position + 1]  # (1,)
        if not self._sampling:
            return runner.decode(token, input_pos, ()).clone(), None
        runner.mark_step()
        out = runner.step("draft", draft_sample_step)(runner.step_model, token, input_pos, runner.vocab_bias,
                                                      *self._sampling)
        return out[0].clone(), out[1].clone()  # out of the CUDA graph's pool before the next replay

    def prepare(self, prompt_len: int, max_new_tokens: int, k: int, sampled: bool) -> float:
        """The draft's cache (k positions beyond the target's last) and graphs: greedy decode and prefill, and the
        sampled step when sampling."""
        runner = self.llm.runner
        seconds = runner.prepare(1, prompt_len, max_new_tokens + k, SamplingParams())
        key = ("draft", *runner.cache_key())
        if not sampled or runner.is_warm(key):
            return seconds
        sampling = SamplingParams(1.0, seed=0).tensors(runner.vocab_size, runner.device)  # as the target's
        with torch.inference_mode():
            self._positions = torch.arange(runner.cache_length, device=runner.device)  # (S,)
            self._sampling = (*sampling[:3], salted(sampling[3], DRAFT_SALT))
            token = torch.zeros(1, 1, dtype=torch.long, device=runner.device)
        return seconds + runner.warm_up(key, lambda: self._step(token, 0))

    def start(self, prompt_ids: list[int], sampling: tuple[Tensor, ...]) -> None:
        """Prefills the prompt into the draft's cache."""
        runner = self.llm.runner
        self._sampling = (*sampling[:3], salted(sampling[3], DRAFT_SALT)) if sampling else ()
        with torch.inference_mode():
            self._positions = torch.arange(runner.cache_length, device=runner.device)  # (S,)
            runner.prefill(runner.prefill_inputs([prompt_ids]), ())
        self._valid = len(prompt_ids)

    def proposal(self, context: list[int], k: int, vocab: int, device: torch.device) -> Proposal:
        start = len(context) - 1  # the last token's position
        for position in range(self._valid, start):  # catch up: normally none, or the last draft when all passed
            self._step(torch.tensor([[context[position]]], device=device), position)
        token = torch.tensor([[context[-1]]], device=device)  # (1, 1)
        tokens, qs = [], []
        for i in range(k):
            token, q = self._step(token, start + i)
            tokens.append(token)
            qs.append(q)
        self._written = (start, k)
        q = torch.cat(qs) if self._sampling else None  # (k, V)
        return Proposal(k, tokens=torch.cat(tokens, dim=1), q=q)  # tokens (1, k)

    def accepted(self, n: int) -> None:
        start, k = self._written
        self._valid = start + min(n + 1, k)


# ---------------------------------------------------------------------------------------------------------------------
# Checks and resolution of the `draft` option.

_TOKENIZER_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its fingerprint


def tokenizer_fingerprint(tokenizer: Any) -> tuple:
    """What makes two tokenizers interchangeable: kind, special ids and the text of every id."""
    if tokenizer not in _TOKENIZER_FINGERPRINTS:
        pieces = hash(tuple(tokenizer.decode([i]) for i in range(tokenizer.vocab_size)))
        _TOKENIZER_FINGERPRINTS[tokenizer] = (type(tokenizer).__name__, tokenizer.vocab_size, tokenizer.bos_id,
                                              tuple(tokenizer.eos_ids), pieces)
    return _TOKENIZER_FINGERPRINTS[tokenizer]


def check_draft_llm(target: Any, draft: Any) -> None:
    """A draft LLM must be another engine on the same device with the same vocabulary and tokenizer."""
    if draft is target:
        raise ValueError("the draft must be another LLM than the target (load the checkpoint a second time)")
    if draft.device != target.device:
        raise ValueError(f"the draft model is on {draft.device} but the target is on {target.device}; load both on "
                         "the same device")
    if draft.model.args.vocab_size != target.model.args.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.model.args.vocab_size}) differs from the target's "
                         f"({target.model.args.vocab_size}); use a draft that shares the target's tokenizer")
    if (draft.tokenizer is None) != (target.tokenizer is None) or (
            draft.tokenizer is not None and tokenizer_fingerprint(draft.tokenizer) !=
            tokenizer_fingerprint(target.tokenizer)):
        raise ValueError("the draft model's tokenizer differs from the target's; use a draft that shares it")


def make_draft(target: Any, draft: Any) -> Draft:
    """The Draft for GenerationOptions.draft: "prompt_lookup", an LLM, or a Draft."""
    if isinstance(draft, str) and draft == "prompt_lookup":
        return PromptLookupDraft()
    if isinstance(draft, type(target)):
        check_draft_llm(target, draft)
        return ModelDraft(draft)
    if isinstance(draft, Draft):
        return draft
    raise ValueError(f"draft must be 'prompt_lookup', an LLM or a speculative.Draft, got {type(draft).__name__}")


def check_cli_draft(prompt_lookup: bool, draft_path: Any, draft_quantize: str | None) -> None:
    """The CLI's speculation flags: one draft source; --draft_quantize (int8, int4, int4-gG) only with a draft
    model."""
    from redline.quantize import parse_quant_spec

    if prompt_lookup and draft_path is not None:
        raise ValueError("--prompt_lookup and --draft_checkpoint_path are two draft sources; pick one")
    if draft_quantize is not None and draft_path is None:
        raise ValueError("--draft_quantize quantizes the draft model; add --draft_checkpoint_path")
    if draft_quantize is not None:
        try:
            parse_quant_spec(draft_quantize)
        except ValueError as exc:
            raise ValueError(f"--draft_quantize: {exc}") from None


# ---------------------------------------------------------------------------------------------------------------------
# The speculative token loop.


@dataclass
class CostGate:
    """Verifies a gated proposal only when it is expected to pay. With r = (verify step time) / (decode step time),
    both measured on this engine, host round trip included, a proposal of a kind (its key) whose verify steps have
    kept a drafts on average yields 1 + a tokens for the cost of r plain steps, so below a = r - 1 one plain decode
    step is faster: a small model's verify step costs several decode steps, a 7B's barely more than one. Each kind
    starts from a prior of half its drafts kept, and a refused kind is retried now and then."""

    ratio: float
    record: dict[int, list[float]] = dataclasses.field(default_factory=dict)  # key -> [verified, kept, refusals]

    def worth(self, key: int, count: int) -> bool:
        entry = self.record.setdefault(key, [0.0, 0.0, 0.0])
        verified, kept, refused = entry
        expected = (kept + GATE_PRIOR_PROPOSALS * count / 2) / (verified + GATE_PRIOR_PROPOSALS)
        pays = 1 + expected >= self.ratio or refused >= GATE_RETRY_AFTER
        entry[2] = 0 if pays else refused + 1
        return pays

    def kept(self, key: int, n: int) -> None:
        entry = self.record.setdefault(key, [0.0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += n


class Speculator:
    """One speculative generation on `llm` (batch 1) with `draft` proposing up to k tokens per verify step. Has
    the runner's prepare / token_batches contract, but yields a run of accepted tokens per step."""

    def __init__(self, llm: Any, draft: Draft, k: int) -> None:
        self.llm, self.draft, self.k = llm, draft, k
        self.runner = llm.runner
        self.steps = self.accepted = self.proposed = 0  # verify steps, drafts kept, real drafts verified
        self.plain_steps = 0  # decode steps without a draft (nothing proposed, or too near the end)

    @classmethod
    def for_options(cls, llm: Any, options: GenerationOptions) -> Speculator | None:
        if options.draft is None:
            return None
        return cls(llm, make_draft(llm, options.draft), options.speculate_k)

    def stats(self) -> dict[str, float | None]:
        return {"mean_accepted": self.accepted / self.steps if self.steps else 0.0,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "verify_steps": self.steps, "plain_steps": self.plain_steps}

    def _verify(self, step: Tensor, positions: Tensor, proposal_q: Tensor | None,
                sampling: tuple[Tensor, ...]) -> Tensor:
        """step (k+2,) = [last, d1..dk, count] at positions (k+1,) -> [n, tokens...] (k+2,) on the device."""
        runner = self.runner
        runner.mark_step()
        if not sampling:
            return runner.step("verify_greedy", verify_greedy)(runner.model, step, positions, runner.vocab_bias)
        return runner.step("verify_sampled", verify_sampled)(runner.model, step, positions, runner.vocab_bias,
                                                             proposal_q, *sampling)

    def _cost_ratio(self, args: tuple[Tensor, ...]) -> float:
        """Verify step time over decode step time, each called and read back on the host as the loop does."""
        runner, k = self.runner, self.k
        with torch.inference_mode():
            positions = torch.arange(k + 1, device=runner.device)  # (k+1,) the prefill overwrites these entries
            step = full_step(k, runner.device)  # (k+2,)
            token = torch.zeros(1, 1, dtype=torch.long, device=runner.device)  # (1, 1)
            calls = {"decode": lambda: runner.decode(token, positions[:1], args).item(),
                     "verify": lambda: self._verify(step, positions, None, args).tolist()}
            seconds = {}
            for name, call in calls.items():
                call()
                samples = []
                for _ in range(COST_SAMPLES):
                    begin = time.perf_counter()
                    call()
                    samples.append(time.perf_counter() - begin)
                seconds[name] = statistics.median(samples)
        return seconds["verify"] / seconds["decode"]

    def _cost_key(self, args: tuple[Tensor, ...]) -> tuple | None:
        """Where the gate's cost ratio is kept (per k, sampling and cache), or None for a draft that is not gated."""
        if not self.draft.gated:
            return None
        return "cost", self.k, bool(args), *self.runner.cache_key()

    def _gate(self, args: tuple[Tensor, ...]) -> CostGate | None:
        """The cost gate for a gated draft, with the ratio prepare measured; None for a draft that is not gated."""
        key = self._cost_key(args)
        return None if key is None else CostGate(self.runner.measured(key, lambda: self._cost_ratio(args)))

    def prepare(self, batch: int, prompt_len: int, max_new_tokens: int, sampling: SamplingParams) -> float:
        """The runner's graphs, the verify graph for k, with k positions of slack in the cache, and the cost gate's
        ratio (outside every timing); seconds spent."""
        refuse_penalized(sampling)
        if batch != 1:
            raise ValueError("speculative decoding runs one sequence at a time (batch 1)")
        runner, k = self.runner, self.k
        total = prompt_len + runner.plan_lengths(prompt_len, max_new_tokens)
        runner.ensure_cache(1, min(total + k, runner.context_length))
        seconds = runner.prepare(1, prompt_len, max_new_tokens, sampling)
        args = runner.step_args(dataclasses.replace(sampling, seed=0))  # warm-ups leave the global RNG alone
        q_kind = bool(args) and isinstance(self.draft, ModelDraft)
        seconds += self.draft.prepare(prompt_len, max_new_tokens, k, bool(args))
        key = ("verify", k, bool(args), q_kind, *runner.cache_key())
        if not runner.is_warm(key):
            with torch.inference_mode():
                step = full_step(k, runner.device)  # (k+2,) [last, drafts, count]
                positions = torch.arange(k + 1, device=runner.device)
                q = torch.zeros(k, runner.vocab_size, device=runner.device) if q_kind else None
            seconds += runner.warm_up(key, lambda: self._verify(step, positions, q, args))
        cost_key = self._cost_key(args)
        if cost_key is not None and cost_key not in runner.costs:
            begin = time.perf_counter()
            runner.measured(cost_key, lambda: self._cost_ratio(args))
            seconds += time.perf_counter() - begin
        return seconds

    def token_batches(self, prompts: Tensor, max_new_tokens: int, sampling: SamplingParams,
                      recorder: Any = None) -> Iterator[tuple[list[int], float]]:
        """Yields (the tokens of this step: the prefill's one, then each verify step's accepted run plus the
        target's own next token, host time when they arrived less the profiler's own time)."""
        runner, k = self.runner, self.k
        # This run's counts (a profiled run's warm-up runs first).
        self.steps = self.accepted = self.proposed = self.plain_steps = 0
        prompt = [int(t) for t in prompts[0].tolist()]
        new_tokens = runner.plan_lengths(len(prompt), max_new_tokens)
        self.prepare(1, len(prompt), max_new_tokens, sampling)
        args = runner.step_args(sampling)
        region = recorder.region if recorder is not None else (lambda name: contextlib.nullcontext())
        vocab = runner.vocab_size
        room = min(runner.cache_length, self.draft.room() or runner.cache_length)
        lock = self.draft.llm.lock if isinstance(self.draft, ModelDraft) else None
        number = lock.acquire() if lock is not None else 0  # the draft engine is ours for the generation
        try:
            gate = self._gate(args)
            with torch.inference_mode():
                # [last, drafts, count] is written on the host and copied once per verify step.
                self._host_step = torch.zeros(k + 2, dtype=torch.long, pin_memory=runner.device.type == "cuda")
                self._device_step = torch.zeros(k + 2, dtype=torch.long, device=runner.device)
                positions = torch.arange(runner.cache_length, device=runner.device)  # (S,)
                with region("prefill"):
                    token = self._prefill(prompt, positions, args)
                paused = 0.0
                context = prompt + [token]
                yield [token], time.perf_counter()
                self.draft.start(prompt, args)  # after the first token: a draft's prefill counts as decode time
                while len(context) - len(prompt) < new_tokens:
                    if recorder is not None:
                        before = time.perf_counter()
                        recorder.step()
                        paused += time.perf_counter() - before
                    left = new_tokens - (len(context) - len(prompt))
                    start = len(context) - 1  # the last token's position, not in the cache yet
                    with region("decode_step"):
                        run = None
                        if left > 1 and start + k < room:
                            with region("draft_step"):
                                proposal = self.draft.proposal(context, min(k, left - 1), vocab, runner.device)
                            gated = gate is not None and proposal.key is not None
                            if proposal.count and (not gated or gate.worth(proposal.key, proposal.count)):
                                with region("verify_step"):
                                    run = self._verify_step(context[-1], proposal, positions[start:start + k + 1],
                                                            args)
                                if gated:
                                    gate.kept(proposal.key, len(run) - 1)
                        if run is None:  # nothing drafted, or too near the end: one plain decode step
                            run = self._decode_step(context[-1], positions[start:start + 1], args)
                            self.plain_steps += 1
                    context += run
                    yield run, time.perf_counter() - paused
        finally:
            if lock is not None:
                lock.release(number)

    def _prefill(self, prompt: list[int], positions: Tensor, args: tuple[Tensor, ...]) -> int:
        runner = self.runner
        return int(runner.prefill(runner.prefill_inputs([prompt]), args).item())

    def _decode_step(self, last: int, input_pos: Tensor, args: tuple[Tensor, ...]) -> list[int]:
        token = torch.tensor([[last]], device=self.runner.device)  # (1, 1)
        return [int(self.runner.decode(token, input_pos, args).item())]

    def _verify_step(self, last: int, proposal: Proposal, input_pos: Tensor, args: tuple[Tensor, ...]) -> list[int]:
        """Pads the proposal to k, verifies it in one pass, reads [n, tokens] once; returns the n kept drafts and
        the target's own token after them."""
        k, count = self.k, proposal.count
        host = self._host_step.numpy()  # (k+2,); the previous step's host read has finished with it
        host[:] = 0
        host[0], host[-1] = last, count
        host[1:1 + len(proposal.ids)] = proposal.ids
        step = self._device_step
        step.copy_(self._host_step, non_blocking=True)
        if proposal.tokens is not None:
            step[1:1 + count].copy_(proposal.tokens[0, :count])
        q = proposal.q
        if q is not None and q.shape[0] < k:
            q = torch.cat([q, q.new_zeros(k - q.shape[0], q.shape[1])])  # (k, V)
        packed = self._verify(step, input_pos, q, args).tolist()  # the step's one host read
        n = packed[0]
        self.draft.accepted(n)
        self.steps += 1
        self.accepted += n
        self.proposed += proposal.count
        return packed[1:n + 2]
