"""speculative.py: greedy equality with every draft source, the sampled distribution, stops, EOS, the context
limit, bad inputs and the CLI flags."""
from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest
import scipy.stats
import torch

from redline.checkpoint import read_checkpoint_info
from redline.generate import LLM, main
from redline.model import ModelArgs, Transformer
from redline.quantize import load_model
from redline import speculative
from redline.speculative import CostGate, Draft, PromptLookupDraft, ReplayDraft, filtered_probs
from conftest import GPU_TEST_KV_TOKENS

# Greedy equality is checked on these prompts: repetitive text (prompt lookup finds matches), code, and raw ids.
PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. The quick brown",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n", "héllo wörld, ça va? héllo",
           [5, 17, 99, 3, 5, 17], [1, 40, 41, 42, 43, 40, 41], [7] * 12, [300, 12, 250, 8, 99, 12]]
# False-alarm rate of the distribution tests: a correct sampler fails a fixed-seed check one time in a thousand.
FALSE_ALARM = 1e-3
# Samples per distribution test: with top_k=3 and temperature 2 every (t0, t1, t2) cell expects dozens.
SAMPLES = 1000


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny models' many small matmuls run fastest on one thread (several contend on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llm(tiny_llm_checkpoint):
    return LLM.load(tiny_llm_checkpoint[0], device="cpu")


@pytest.fixture(scope="module")
def same_draft(tiny_llm_checkpoint):
    return LLM.load(tiny_llm_checkpoint[0], device="cpu")


def noisy_llm(path, scale: float, seed: int = 0, **kwargs) -> LLM:
    """The checkpoint with Gaussian noise (scale x each matrix's std) added: a draft that agrees only sometimes."""
    draft = LLM.load(path, **{"device": "cpu", **kwargs})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen).to(p.device) * p.std() * scale)
    return draft


@pytest.fixture(scope="module")
def noisy_draft(tiny_llm_checkpoint):
    return noisy_llm(tiny_llm_checkpoint[0], 0.1)  # about half its drafts are accepted


def greedy(llm, prompt, n=40, **kwargs):
    return llm.generate(prompt, max_new_tokens=n, ignore_eos=True, **kwargs)


# -- greedy equality ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["prompt_lookup", "same", "noisy", "replay"])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_greedy_output_equals_plain_greedy(llm, same_draft, noisy_draft, source, k):
    accepted = proposed = 0
    for prompt in PROMPTS:
        plain = greedy(llm, prompt)
        draft = {"prompt_lookup": "prompt_lookup", "same": same_draft, "noisy": noisy_draft,
                 "replay": ReplayDraft(plain.token_ids)}[source]
        spec = greedy(llm, prompt, draft=draft, speculate_k=k)
        assert spec.token_ids == plain.token_ids, (source, k, prompt)
        assert spec.text == plain.text and spec.finish_reason == plain.finish_reason
        assert 0 <= spec.stats.mean_accepted <= k
        accepted += spec.stats.mean_accepted
        proposed += spec.stats.acceptance_rate
    if source in ("same", "replay"):  # a draft that is always right
        assert proposed == len(PROMPTS)
    elif source == "noisy":  # partly right: both the accepted and the rejected paths ran
        assert 0 < proposed < len(PROMPTS)
    else:
        assert accepted > 0  # the repetitive prompts gave prompt lookup matches that were kept


def test_stats_count_accepted_tokens(llm):
    plain = greedy(llm, PROMPTS[0], n=33)
    assert plain.stats.mean_accepted is None and plain.stats.acceptance_rate is None
    spec = greedy(llm, PROMPTS[0], n=33, draft=ReplayDraft(plain.token_ids), speculate_k=8)
    # 32 tokens after the prefill's: three steps of 8 drafts + 1, then 4 drafts + 1 (capped by max_new_tokens).
    assert spec.stats.acceptance_rate == 1.0 and spec.stats.mean_accepted == pytest.approx((8 + 8 + 8 + 4) / 4)
    assert spec.stats.new_tokens == 33 and spec.stats.decode_tok_s > 0
    assert spec.stats.verify_steps == 4 and spec.stats.plain_steps == 0
    assert "accepted per step" in spec.stats.summary()
    assert plain.stats.verify_steps is None and plain.stats.plain_steps is None


@pytest.mark.parametrize("prompt", PROMPTS[1:4])
def test_step_counts_add_up_to_the_tokens(llm, noisy_draft, prompt):
    """The prefill's token, 1 + accepted per verify step, 1 per plain step: what benchmarks/speculative_projection.py
    builds its model on."""
    # Prompt lookup ungated: the cost gate's decisions follow timings, and this test counts steps, not timings.
    for draft in (PromptLookupDraft(gated=False), noisy_draft):
        stats = greedy(llm, prompt, draft=draft, speculate_k=4).stats
        accepted = stats.mean_accepted * stats.verify_steps
        assert accepted == pytest.approx(round(accepted))
        assert 1 + stats.verify_steps + round(accepted) + stats.plain_steps == stats.new_tokens
        assert stats.verify_steps > 0


def test_compiled_speculation_equals_plain_greedy(tiny_llm_checkpoint, llm):
    target = LLM.load(tiny_llm_checkpoint[0], device="cpu", compile=True)
    draft = noisy_llm(tiny_llm_checkpoint[0], 0.1, compile=True)
    first = greedy(target, PROMPTS[1], draft=draft, speculate_k=4)
    assert first.token_ids == greedy(llm, PROMPTS[1]).token_ids and first.stats.compile_s > 0
    with torch._dynamo.config.patch(error_on_recompile=True):  # every later step replays the same graphs
        for prompt in PROMPTS[2:5]:
            spec = greedy(target, prompt, draft=draft, speculate_k=4)
            assert spec.token_ids == greedy(llm, prompt).token_ids and spec.stats.compile_s == 0
            assert greedy(target, prompt, draft="prompt_lookup", speculate_k=4).token_ids == spec.token_ids


@pytest.mark.gpu
def test_gpu_speculation_equals_plain_greedy(tiny_llm_checkpoint):
    """On the GPU, float32 with the kernels: the compiled verify graph (tensor-core kernel for k+1 rows, SDPA) keeps
    plain greedy output with every draft source; in bf16 the multi-row kernels round differently from the batch-1
    GEMV, so only float32 promises token equality."""
    target = LLM.load(tiny_llm_checkpoint[0], device="cuda", dtype="float32", compile=True,
                      max_kv_tokens=GPU_TEST_KV_TOKENS)
    draft = noisy_llm(tiny_llm_checkpoint[0], 0.1, device="cuda", dtype="float32", compile=True)
    for prompt in PROMPTS[:4]:
        plain = greedy(target, prompt)
        for source in ("prompt_lookup", draft, ReplayDraft(plain.token_ids)):
            spec = greedy(target, prompt, draft=source, speculate_k=4)
            assert spec.token_ids == plain.token_ids, (prompt, source)
        assert spec.stats.acceptance_rate == 1.0  # the replay draft: every proposal kept


# -- the cost gate -----------------------------------------------------------------------------------------------------


def test_cost_gate_refuses_a_match_length_that_does_not_pay_and_retries_it():
    gate = CostGate(ratio=3.0)
    assert gate.worth(1, 8)  # prior: half of 8 kept, 1 + 4 >= 3
    for _ in range(6):
        gate.kept(1, 0)
    # (0 + 2 * 4) / (6 + 2) = 1 expected: 1 + 1 < 3
    refusals = [gate.worth(1, 8) for _ in range(speculative.GATE_RETRY_AFTER + 1)]
    assert refusals == [False] * speculative.GATE_RETRY_AFTER + [True]
    assert gate.worth(3, 8)  # another match length has its own record
    # A kind that keeps one of its four drafts pays where a verify step costs about one decode step, not at 3.
    cheap, costly = CostGate(ratio=1.05), CostGate(ratio=3.0)
    for g in (cheap, costly):
        for _ in range(20):
            g.kept(1, 1)
    assert cheap.worth(1, 4) and not costly.worth(1, 4)


def test_gated_prompt_lookup_keeps_greedy_output_and_skips_costly_proposals(llm, monkeypatch):
    prompt = PROMPTS[2]
    plain = greedy(llm, prompt)
    free = greedy(llm, prompt, draft=PromptLookupDraft(gated=False), speculate_k=4)
    monkeypatch.setattr(speculative.Speculator, "_cost_ratio", lambda self, args: 50.0)
    llm.runner.forget_costs()
    gated = greedy(llm, prompt, draft="prompt_lookup", speculate_k=4)
    llm.runner.forget_costs()
    assert gated.token_ids == free.token_ids == plain.token_ids
    # At 50x a decode step no kind pays: only the first proposal of each match length and the retries are verified.
    assert gated.stats.verify_steps < free.stats.verify_steps
    assert gated.stats.plain_steps > free.stats.plain_steps
    assert PromptLookupDraft(gated=False).proposal([1, 2, 1], 2, 10, torch.device("cpu")).key is None


# -- prompt lookup and replay ------------------------------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_longest_latest_match():
    draft = PromptLookupDraft(max_ngram=3)
    draft.start([], ())
    assert draft.propose([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    assert draft.propose([1, 2, 3, 4, 9, 1, 2, 3, 4], 2) == [9, 1]  # the index grows with the context
    draft.start([], ())
    # "5 3" occurs once (followed by 7); "3" alone last occurred followed by 8: the longer match wins.
    assert draft.propose([5, 3, 7, 3, 8, 5, 3], 2) == [7, 3]
    assert draft.propose([5, 3, 7, 3, 8, 5, 3, 6, 3], 2) == [6, 3]  # "6 3" unseen, "3" last followed by 6
    draft.start([], ())
    assert draft.propose([1, 2, 3], 4) == [] and draft.propose([4], 2) == []


def test_replay_draft_stops_once_the_output_leaves_it():
    draft = ReplayDraft([10, 11, 12, 13])
    draft.start([1, 2], ())
    assert draft.propose([1, 2, 10], 2) == [11, 12]
    assert draft.propose([1, 2, 10, 11, 12, 13], 2) == []
    assert draft.propose([1, 2, 10, 99], 2) == []


# -- sampling ----------------------------------------------------------------------------------------------------------


class ArgmaxDraft(Draft):
    """Deterministic (q one-hot): proposes another engine's greedy continuation, which the target accepts often."""

    def __init__(self, helper: LLM) -> None:
        self.helper = helper

    def propose(self, context, k):
        return self.helper.generate(context, max_new_tokens=k, ignore_eos=True).token_ids


def exact_joint(model: Transformer, prompt: list[int], depth: int, **sampling) -> dict[tuple[int, ...], float]:
    """P(t0..t{depth-1}) of plain sampling, from the model's own filtered distributions."""
    settings = [torch.tensor(float(sampling["temperature"])), torch.tensor(sampling["top_k"]), torch.tensor(2.0)]
    model.setup_caches(1, 64)
    out = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, mass in out.items():
            ids = prompt + list(prefix)
            logits = model(torch.tensor([ids]), torch.arange(len(ids)))[:, -1]  # (1, V)
            probs = filtered_probs(logits, *settings)[0]
            for t in probs.nonzero().view(-1).tolist():
                nxt[prefix + (t,)] = mass * probs[t].item()
        out = nxt
    return out


def fits(counts: Counter, expected: dict, n: int) -> bool:
    """Whether n samples' counts pass Pearson's chi-square test against the probabilities at FALSE_ALARM (cells
    expecting under 5 are pooled into one); a sample the probabilities rule out fails it."""
    if not set(counts) <= set(expected):
        return False
    total = sum(expected.values())
    observed, wanted, pooled = [], [], [0, 0.0]
    for cell, prob in expected.items():
        e = prob / total * n
        target = (observed, wanted) if e >= 5 else None
        if target is None:
            pooled[0] += counts.get(cell, 0)
            pooled[1] += e
        else:
            observed.append(counts.get(cell, 0))
            wanted.append(e)
    if pooled[1] > 0:
        observed.append(pooled[0])
        wanted.append(pooled[1])
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, wanted))
    return float(scipy.stats.chi2.sf(statistic, len(observed) - 1)) > FALSE_ALARM


@pytest.mark.parametrize("source", ["deterministic", "draft_model"])
def test_sampled_distribution_equals_plain_sampling(tiny_llm_checkpoint, llm, source):
    path = tiny_llm_checkpoint[0]
    prompt = [1, 40, 41, 42, 40]
    sampling = dict(temperature=2.0, top_k=3)
    draft_llm = noisy_llm(path, 0.1)
    draft = ArgmaxDraft(LLM.load(path, device="cpu")) if source == "deterministic" else draft_llm
    counts: Counter = Counter()
    accepted = 0.0
    for seed in range(SAMPLES):
        result = llm.generate(prompt, max_new_tokens=4, ignore_eos=True, seed=seed, draft=draft, speculate_k=2,
                              **sampling)
        counts[tuple(result.token_ids[:3])] += 1
        accepted += result.stats.acceptance_rate
    reference = load_model(read_checkpoint_info(path), torch.device("cpu"))
    expected = exact_joint(reference, prompt, 3, **sampling)
    assert fits(counts, expected, SAMPLES)
    assert 0.1 < accepted / SAMPLES < 0.95  # drafts were both kept and rejected
    # The test can fail: the draft model's own distribution is told apart from the target's.
    if source == "draft_model":
        assert not fits(counts, exact_joint(draft_llm.model, prompt, 3, **sampling), SAMPLES)


def test_seeded_speculative_sampling_is_reproducible(llm, noisy_draft):
    kwargs = dict(max_new_tokens=24, temperature=1.0, top_k=50, top_p=0.9, ignore_eos=True, speculate_k=3)
    a = llm.generate("import os", seed=5, draft=noisy_draft, **kwargs)
    assert a.token_ids == llm.generate("import os", seed=5, draft=noisy_draft, **kwargs).token_ids
    assert a.token_ids != llm.generate("import os", seed=6, draft=noisy_draft, **kwargs).token_ids


# -- stops, EOS and the context ----------------------------------------------------------------------------------------


class EosTokenizer:
    """The fixture tokenizer with `eos` as its only end-of-sequence id."""

    def __init__(self, inner, eos: int) -> None:
        self.inner, self.eos_ids, self.bos_id, self.vocab_size = inner, (eos,), inner.bos_id, inner.vocab_size

    def encode(self, text):
        return self.inner.encode(text)

    def decode(self, ids):
        return self.inner.decode(ids)


def test_eos_inside_an_accepted_run_ends_the_generation(llm, tiny_llm_checkpoint):
    prompt = PROMPTS[0]
    full = greedy(llm, prompt).token_ids
    eos = full[9]
    model = load_model(read_checkpoint_info(tiny_llm_checkpoint[0]), torch.device("cpu"))
    target = LLM(model, EosTokenizer(llm.tokenizer, eos), "cpu", compile=False)
    plain = target.generate(prompt, max_new_tokens=40)
    spec = target.generate(prompt, max_new_tokens=40, draft=ReplayDraft(full), speculate_k=8)
    assert plain.finish_reason == spec.finish_reason == "eos"
    assert spec.token_ids == plain.token_ids == full[:full.index(eos)] and spec.text == plain.text


def test_stop_string_inside_an_accepted_run(llm):
    prompt = PROMPTS[1]
    full = greedy(llm, prompt)
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    plain = greedy(llm, prompt, stop=stop)
    pieces = []
    with llm.stream(prompt, max_new_tokens=40, ignore_eos=True, stop=stop, draft=ReplayDraft(full.token_ids),
                    speculate_k=8) as stream:
        pieces = list(stream)
    spec = stream.result
    assert plain.finish_reason == spec.finish_reason == "stop" and spec.text == plain.text == "".join(pieces)
    assert stop not in spec.text


@pytest.mark.parametrize("source", ["prompt_lookup", "noisy"])
def test_the_context_limit_is_kept(llm, noisy_draft, source):
    context = llm.model.args.block_size
    prompt = ([40, 41, 42, 43] * context)[:context - 10]
    plain = llm.generate(prompt, max_new_tokens=50, ignore_eos=True)
    draft = "prompt_lookup" if source == "prompt_lookup" else noisy_draft
    spec = llm.generate(prompt, max_new_tokens=50, ignore_eos=True, draft=draft, speculate_k=8)
    assert len(spec.token_ids) == 10 and spec.token_ids == plain.token_ids


def test_chat_with_a_draft_equals_chat_without(tiny_llm_checkpoint, chat_tokenizer):
    model = load_model(read_checkpoint_info(tiny_llm_checkpoint[0]), torch.device("cpu"))
    chat = LLM(model, chat_tokenizer, "cpu", compile=False)
    messages = [{"role": "user", "content": "The quick brown fox. The quick brown fox."}]
    plain = chat.chat(messages, max_new_tokens=20, ignore_eos=True)
    assert chat.chat(messages, max_new_tokens=20, ignore_eos=True, draft="prompt_lookup").token_ids == plain.token_ids


def test_trace_names_the_draft_and_verify_steps(llm, tmp_path):
    trace = tmp_path / "spec.json.gz"
    result = llm.generate(PROMPTS[1], max_new_tokens=24, ignore_eos=True, draft=PromptLookupDraft(gated=False),
                          profile=trace)  # ungated, so a verify step happens whatever the machine's timings
    data = json.loads(gzip.decompress(trace.read_bytes()))
    names = {e.get("name") for e in data["traceEvents"]}
    assert {"redline.draft_step", "redline.verify_step", "redline.decode_step"} <= names
    assert data["redline"]["stats"]["mean_accepted"] == result.stats.mean_accepted


# -- bad inputs --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(draft="prompt_lookup", speculate_k=0), "speculate_k"), (dict(draft="prompt_lookup", speculate_k=64), "1..63"),
    (dict(draft="prompt_lookup", speculate_k=2.0), "speculate_k"), (dict(speculate_k=4), "needs a draft"),
    (dict(draft="ngram"), "unknown draft"),
])
def test_bad_speculation_options_are_refused(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("abc", max_new_tokens=2, **kwargs)


class ShiftedTokenizer(EosTokenizer):
    """Same size and special ids, other text per id: another tokenizer."""

    def decode(self, ids):
        return self.inner.decode([(i + 1) % self.vocab_size for i in ids])


def test_bad_drafts_are_refused_in_one_line(llm, tiny_llm_checkpoint):
    args = llm.model.args
    other_vocab = LLM(Transformer(ModelArgs(**{**args.to_dict(), "vocab_size": args.vocab_size + 8})), llm.tokenizer,
                      "cpu", compile=False)
    model = load_model(read_checkpoint_info(tiny_llm_checkpoint[0]), torch.device("cpu"))
    other_tokenizer = LLM(model, ShiftedTokenizer(llm.tokenizer, 2), "cpu", compile=False)
    elsewhere = LLM(Transformer(args).to("meta"), llm.tokenizer, "meta", compile=False)
    for draft, message in [(llm, "another LLM"), (other_vocab, "vocabulary"), (other_tokenizer, "tokenizer"),
                           (elsewhere, "device"), (object(), "draft must be")]:
        with pytest.raises(ValueError, match=message) as info:
            llm.stream("abc", max_new_tokens=4, draft=draft)
        assert "\n" not in str(info.value)


def test_a_draft_proposing_bad_ids_is_refused(llm):
    class Bad(Draft):
        def propose(self, context, k):
            return [llm.model.args.vocab_size] * k

    with pytest.raises(ValueError, match="Bad.propose"):
        greedy(llm, "abc", draft=Bad(), speculate_k=2)


# -- the CLI -----------------------------------------------------------------------------------------------------------


def cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_speculation_flags(capsys, tiny_llm_checkpoint):
    path = str(tiny_llm_checkpoint[0])
    base = ["--checkpoint_path", path, "--prompt", PROMPTS[1], "--temperature", "0", "--max_new_tokens", "16",
            "--device", "cpu"]
    code, plain, _ = cli(capsys, *base)
    assert code == 0
    code, out, err = cli(capsys, *base, "--prompt_lookup", "--speculate_k", "4")
    assert code == 0 and out == plain and "accepted per step" in err
    for spec in ("int8", "int4", "int4-g32"):  # plain int4: the largest group size that divides the tiny model
        code, out, err = cli(capsys, *base, "--draft_checkpoint_path", path, "--draft_quantize", spec)
        assert code == 0 and out == plain and "accepted per step" in err, spec


@pytest.mark.parametrize("flags, message", [
    (["--prompt_lookup", "--draft_checkpoint_path", "x"], "pick one"), (["--draft_quantize", "int8"], "add --draft"),
    (["--speculate_k", "3"], "needs a draft"), (["--prompt_lookup", "--speculate_k", "99"], "1..63"),
    (["--draft_checkpoint_path", "x", "--draft_quantize", "int3"], "draft_quantize"),
    (["--draft_checkpoint_path", "x", "--draft_quantize", "int4-g48"], "power of two"),
    (["--prompt_lookup", "--speculate_k", "0"], "1..63"), (["--quantize", "int4-g"], "unknown quantization"),
])
def test_cli_bad_speculation_flags(capsys, tiny_llm_checkpoint, flags, message):
    code, _, err = cli(capsys, "--checkpoint_path", str(tiny_llm_checkpoint[0]), "--prompt", "a", *flags)
    assert code == 2 and message in err and err.count("\n") == 1


def test_cli_draft_group_size_that_does_not_divide_is_one_line(capsys, tiny_llm_checkpoint):
    path = str(tiny_llm_checkpoint[0])
    code, _, err = cli(capsys, "--checkpoint_path", path, "--prompt", "a", "--device", "cpu",
                       "--draft_checkpoint_path", path, "--draft_quantize", "int4-g128")
    assert code == 2 and "does not divide a layer's 64 inputs" in err and err.count("\n") == 1

