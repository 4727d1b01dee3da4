"""streaming.py through LLM._pieces (the runner's token loop scripted): held-back text is flushed however generation ends."""
from __future__ import annotations

import time

import pytest

from redline.generate import LLM


@pytest.fixture(scope="module")
def llm(tiny_llm_checkpoint):
    return LLM.load(tiny_llm_checkpoint[0], device="cpu")


def scripted(monkeypatch, llm, tokens):
    def batches(prompts, max_new_tokens, sampling, recorder=None):
        for token in tokens[:max_new_tokens]:
            yield [token], time.perf_counter()

    monkeypatch.setattr(llm.runner, "token_batches", batches)


@pytest.mark.parametrize("stop", [(), ("\ufffdzzz",)])
def test_an_incomplete_character_is_flushed_at_eos_as_at_the_length_limit(llm, monkeypatch, stop):
    ids = llm.tokenizer.encode("ab🚀", add_special_tokens=False)
    partial = ids[:-1]  # ends inside the emoji's bytes: the stream holds that tail back
    assert llm.tokenizer.decode(partial).endswith("\ufffd")
    eos = llm.tokenizer.eos_ids[0]
    scripted(monkeypatch, llm, partial + [eos])
    by_eos = llm.stream("x", max_new_tokens=len(partial) + 1, stop=stop)
    by_eos_text = "".join(by_eos)
    scripted(monkeypatch, llm, partial)
    by_length = llm.generate("x", max_new_tokens=len(partial), stop=stop)
    assert by_eos.result.finish_reason == "eos" and by_length.finish_reason == "length"
    assert by_eos_text == by_eos.result.text == by_length.text == llm.tokenizer.decode(partial)
