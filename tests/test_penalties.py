"""Penalties, logit bias, min_p, min_tokens and stop token ids through the engine: applied per row on the device, in
the engine's eager steps and in its decode graphs, against transformers' own logits processors."""
from __future__ import annotations

import pytest
import torch

from conftest import random_gpu_llm, token_prompts
from redline.engine import Engine
from redline.generate import GenerationOptions


def reference_greedy(hf_model, prompt: list[int], steps: int, processors) -> list[int]:
    """Greedy tokens of transformers' own model, each step's fp32 logits passed through `processors` (HF's logits
    processors, or plain functions of (ids (1, T), logits (1, V)))."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            logits = hf_model(ids).logits[:, -1].float()  # (1, V)
            for process in processors:
                logits = process(ids, logits)
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def openai_penalties(prompt_len: int, presence: float, frequency: float):
    """OpenAI's presence and frequency penalties over the generated tokens, in plain PyTorch."""
    def process(ids, logits):
        counts = torch.bincount(ids[0, prompt_len:], minlength=logits.shape[-1]).float()  # (V,)
        return logits - frequency * counts - presence * (counts > 0).float()
    return process


def test_penalties_and_bias_match_transformers_processors_batched_or_alone(llm, tiny_llm_checkpoint):
    """Greedy tokens with repetition_penalty, presence/frequency penalties and logit_bias equal a reference loop
    over the transformers model with HF's processors; in one batch with plain rows each row gets what it gets
    alone, and the plain rows are untouched."""
    from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor,
                                                        SequenceBiasLogitsProcessor)

    hf = tiny_llm_checkpoint[1]
    prompts = token_prompts(llm, 4, 8)
    n = 14
    bias = {int(prompts[2][0]): 7.5, 11: -100.0, 12: 3.0}
    cases = [dict(repetition_penalty=3.0), dict(presence_penalty=1.5, frequency_penalty=0.75), dict(logit_bias=bias),
             dict(repetition_penalty=0.5, frequency_penalty=-0.5)]
    refs = [[RepetitionPenaltyLogitsProcessor(3.0)],
            [openai_penalties(len(prompts[1]), 1.5, 0.75)],
            [SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})],
            [RepetitionPenaltyLogitsProcessor(0.5), openai_penalties(len(prompts[3]), 0.0, -0.5)]]
    want = [reference_greedy(hf, p, n, r) for p, r in zip(prompts, refs)]
    plain = [llm.generate(p, max_new_tokens=n, ignore_eos=True).token_ids for p in prompts]
    assert all(w != p for w, p in zip(want, plain))  # every setting changes the reply
    assert not set(want[0]) & set(prompts[0])  # a large repetition penalty never repeats a prompt token
    options = [GenerationOptions(max_new_tokens=n, ignore_eos=True, **c) for c in cases]
    alone_tokens = [llm.generate(p, o).token_ids for p, o in zip(prompts, options)]  # through the engine
    assert alone_tokens == want
    mixed = llm.generate_batch(prompts + prompts, options + [GenerationOptions(max_new_tokens=n, ignore_eos=True)] * 4)
    assert [r.token_ids for r in mixed] == want + plain


def test_min_p_keeps_only_tokens_near_the_most_likely(llm):
    """min_p=1 keeps only the most likely token: sampling at any temperature is then greedy; min_p=0.05 at a high
    temperature still samples other tokens."""
    prompt = token_prompts(llm, 1, 9)[0]
    greedy = llm.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids
    hot = dict(max_new_tokens=12, ignore_eos=True, temperature=5.0, seed=3)
    assert llm.generate(prompt, min_p=1.0, **hot).token_ids == greedy
    assert llm.generate(prompt, min_p=0.05, **hot).token_ids != greedy
    batch = llm.generate_batch([prompt] * 2, [GenerationOptions(min_p=1.0, **hot), GenerationOptions(**hot)])
    assert batch[0].token_ids == greedy and batch[1].token_ids == llm.generate(prompt, **hot).token_ids


def test_min_tokens_holds_eos_and_stop_token_ids_off(llm):
    """A reply forced to end at once (EOS biased up) has exactly min_tokens tokens before its EOS; a stop token id
    ends the reply with "stop", left out of the text unless include_stop_str_in_output."""
    eos = llm.tokenizer.eos_ids[0]
    prompt = token_prompts(llm, 1, 6)[0]
    forced = llm.generate(prompt, max_new_tokens=20, logit_bias={eos: 100})
    assert forced.token_ids == [] and forced.finish_reason == "eos"
    held = llm.generate(prompt, max_new_tokens=20, logit_bias={eos: 100}, min_tokens=5)
    assert len(held.token_ids) == 5 and held.finish_reason == "eos" and eos not in held.token_ids
    plain = llm.generate(prompt, max_new_tokens=20, ignore_eos=True).token_ids
    stop_id = plain[3]
    first = plain.index(stop_id)
    stopped = llm.generate(prompt, max_new_tokens=20, ignore_eos=True, stop_token_ids=[stop_id])
    assert stopped.finish_reason == "stop" and stopped.token_ids == plain[:first]
    kept = llm.generate(prompt, max_new_tokens=20, ignore_eos=True, stop_token_ids=[stop_id],
                        include_stop_str_in_output=True)
    assert kept.token_ids == plain[:first + 1] and kept.text == llm.tokenizer.decode(plain[:first + 1])
    late = llm.generate(prompt, max_new_tokens=20, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=first + 1)
    assert len(late.token_ids) > first + 1 and stop_id not in late.token_ids[:first + 1]


def test_stop_strings_wait_for_min_tokens_and_can_stay_in_the_text(llm):
    prompt = token_prompts(llm, 1, 7)[0]
    full = llm.generate(prompt, max_new_tokens=24, ignore_eos=True)
    stop = full.text[5:8]
    cut = llm.generate(prompt, max_new_tokens=24, ignore_eos=True, stop=[stop])
    assert cut.text == full.text[:full.text.index(stop)] and cut.finish_reason == "stop"
    kept = llm.generate(prompt, max_new_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == cut.text + stop and kept.finish_reason == "stop"
    late = llm.generate(prompt, max_new_tokens=24, ignore_eos=True, stop=[stop], min_tokens=20)
    assert len(late.token_ids) >= 20 and late.text.startswith(full.text[:full.text.index(stop) + len(stop)])


def test_penalized_decode_graph_steps_give_the_eager_tokens(compiled_llm, llm):
    """The compiled engine's decode steps with penalty rows (their own step variant) give the eager engine's
    tokens, mixed with plain and sampled rows and launched ahead."""
    prompts = token_prompts(llm, 4, 6)
    options = [GenerationOptions(max_new_tokens=10, ignore_eos=True, repetition_penalty=2.5),
               GenerationOptions(max_new_tokens=10, ignore_eos=True),
               GenerationOptions(max_new_tokens=10, ignore_eos=True, temperature=0.9, seed=4, min_p=0.2,
                                 presence_penalty=1.0),
               GenerationOptions(max_new_tokens=10, ignore_eos=True, frequency_penalty=2.0, logit_bias={5: 4.0})]
    want = [r.token_ids for r in llm.generate_batch(prompts, options)]
    engine = Engine(compiled_llm, page_size=4)
    keys = []
    real = engine.graphs.run
    engine.graphs.run = lambda *args: keys.append(args[5] is not None) or real(*args)
    with engine.paused():
        handles = [engine.add_request(p, o) for p, o in zip(prompts, options)]
    assert [h.result(timeout=300).token_ids for h in handles] == want
    assert keys and all(keys)  # every decode step had penalty rows
    plain = engine.add_request(prompts[1], options[1]).result(timeout=300)
    assert plain.token_ids == want[1] and not keys[-1]  # a plain batch takes the plain step
    assert engine.steps_followed > 0
    engine.shutdown()


def test_bad_penalty_settings_are_refused_in_one_line(llm):
    for settings, words in ((dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "[-2, 2]"),
                            (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
                            (dict(logit_bias={"x": 1}), "logit_bias"), (dict(logit_bias={3: 101}), "[-100, 100]"),
                            (dict(logit_bias={i: 1 for i in range(301)}), "at most 300"),
                            (dict(min_tokens=-1), "min_tokens"), (dict(stop_token_ids=[-1]), "stop_token_ids")):
        with pytest.raises(ValueError, match=words.replace("[", r"\[")):
            GenerationOptions(**settings)
    with pytest.raises(ValueError, match=f"logit_bias names token id {llm.vocab_size}"):
        llm.generate("hi", logit_bias={llm.vocab_size: 1.0})
    with pytest.raises(ValueError, match="stop_token_ids names token id"):
        llm.generate_batch(["hi"], stop_token_ids=[10**6])
    with pytest.raises(ValueError, match="batching engine"):
        llm.generate("hi", repetition_penalty=1.2, draft="prompt_lookup")


@pytest.mark.gpu
def test_gpu_penalized_decode_graphs_give_the_eager_engine_tokens():
    """On a GPU the penalty rows' graph variant (counts updated inside the replayed graph) gives the eager engine's
    tokens, with plain and sampled rows beside them and alone; a plain batch then replays a plain graph."""
    eager, graphed = random_gpu_llm(False, True), random_gpu_llm(True, True)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 40, 17, 9)]
    common = dict(max_new_tokens=24, ignore_eos=True)
    options = [GenerationOptions(repetition_penalty=1.8, logit_bias={7: 3.0}, **common),
               GenerationOptions(**common),
               GenerationOptions(temperature=0.9, seed=7, min_p=0.1, presence_penalty=1.0, **common),
               GenerationOptions(frequency_penalty=1.5, stop_token_ids=[11], **common)]
    want = [r.token_ids for r in eager.generate_batch(prompts, options)]
    engine = Engine(graphed, max_kv_tokens=graphed.max_kv_tokens)
    with engine.paused():
        handles = [engine.add_request(p, o) for p, o in zip(prompts, options)]
    assert [h.result(timeout=120).token_ids for h in handles] == want
    assert [engine.add_request(p, o).result(timeout=120).token_ids for p, o in zip(prompts, options)] == want
    assert any(key[4] for key in engine.graphs.graphs) and any(not key[4] for key in engine.graphs.graphs)
    engine.shutdown()
