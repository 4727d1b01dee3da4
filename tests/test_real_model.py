"""SmolLM2-135M-Instruct end to end, against HF transformers reading the same GGUF file with its own loader.

Marked `real_model` (select with `-m real_model`); `make test` runs them. The model comes from the session fixture
`smollm2_checkpoint`, which downloads and converts it once (cached under checkpoints/smollm2)."""
from __future__ import annotations

import argparse
import json
import textwrap

import pytest
import torch

from redline.checkpoint import read_checkpoint_info
from redline.quantize import load_model
from redline.tokenizer import load_tokenizer

pytestmark = pytest.mark.real_model

# How far Redline's fp32 logits may be from HF's: both run the same fp32 weights, so only summation order differs.
LOGITS_ATOL = 1e-3
# Tokens of real text scored in one forward pass.
REAL_TEXT_TOKENS = 512
PROMPTS = ("What is the capital of France?", "Write a Python function that reverses a string.",
           "Give me three tips for sleeping better.")
ENCODE_TEXTS = [
    "Hello world", "", " ", "\n\n\t  \r\n",
    "héllo wörld — naïve café, Straße, 日本語, 中文, 한국어, Привет 🚀👍🏽🦙",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "   leading and trailing   ", "<|im_start|>user\nhi<|im_end|>", "x = {'a': [1, 2.5e-3]}  // 10 /* c */",
    "The year 2024 had 366 days; 1234567890.",
]
CONVERSATIONS = [
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a prime number over 10."}],
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Answer in French. 🇫🇷"}, {"role": "user", "content": "Good morning\n"},
     {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "  And good night?  "},
     {"role": "assistant", "content": "Bonne nuit."}, {"role": "user", "content": "Thanks"}],
]


def real_text() -> str:
    """A few KB of English prose from the standard library's own documentation."""
    return "\n\n".join(textwrap.dedent(module.__doc__) for module in (argparse, json, textwrap, torch.nn.Module))


def test_tokenizer_specials_follow_the_gguf(smollm2_checkpoint):
    tok = load_tokenizer(smollm2_checkpoint)
    assert tok.encode("Hello world") == [19556, 905]  # no BOS: the vocabulary's add_bos_token is false
    assert tok.bos_id == 1 and tok.eos_ids == (2,)
    assert tok.vocab_size == read_checkpoint_info(smollm2_checkpoint).args.vocab_size == 49152


def test_encode_matches_hf(smollm2_checkpoint, smollm2_hf):
    hf_tok, _ = smollm2_hf
    tok = load_tokenizer(smollm2_checkpoint)
    for text in ENCODE_TEXTS + [real_text()]:
        assert tok.encode(text) == hf_tok(text)["input_ids"], text[:40]
        assert tok.decode(tok.encode(text)) == hf_tok.decode(hf_tok(text)["input_ids"])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(smollm2_checkpoint, smollm2_hf, add_generation_prompt):
    hf_tok, _ = smollm2_hf
    tok = load_tokenizer(smollm2_checkpoint)
    for messages in CONVERSATIONS:
        text = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        assert tok.render_chat_template(messages, add_generation_prompt) == text
        assert tok.apply_chat_template(messages, add_generation_prompt) == hf_tok(text, add_special_tokens=False)["input_ids"]


def test_fp32_logits_match_hf_over_real_text(smollm2_checkpoint, smollm2_hf):
    _, hf_model = smollm2_hf
    ids = load_tokenizer(smollm2_checkpoint).encode(real_text())
    assert len(ids) >= REAL_TEXT_TOKENS
    ids = torch.tensor([ids[:REAL_TEXT_TOKENS]])
    model = load_model(read_checkpoint_info(smollm2_checkpoint), "cpu", torch.float32)
    with torch.no_grad():
        model.setup_caches(1, REAL_TEXT_TOKENS)
        ours = model(ids, torch.arange(REAL_TEXT_TOKENS))
        theirs = hf_model(ids).logits
    assert (ours - theirs).abs().max().item() <= LOGITS_ATOL
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_greedy_generation_matches_hf(smollm2_checkpoint, smollm2_hf):
    from redline.generate import LLM

    _, hf_model = smollm2_hf
    llm = LLM.load(smollm2_checkpoint, device="cpu", dtype="float32")
    answers = []
    for prompt in PROMPTS:
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        result = llm.generate(ids, max_new_tokens=64, temperature=0)
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=2,
                                    pad_token_id=2)[0, len(ids):].tolist()
        hf_eos = out[-1:] == [2]
        assert result.token_ids == (out[:-1] if hf_eos else out), prompt
        assert (result.finish_reason == "eos") == hf_eos
        answers.append(result.text)
    assert "Paris" in answers[0]


def test_perplexity_script_matches_hf(smollm2_checkpoint, smollm2_hf, tmp_path):
    """scripts/perplexity.py on real text, in one window, equals transformers' loss on the ids transformers' own
    tokenizer gives for the text (its BOS rule: none for SmolLM2) plus EOS."""
    import math

    from transformers import AutoTokenizer

    from redline.scripts.perplexity import main as perplexity_main

    _, hf_model = smollm2_hf
    doc = tmp_path / "doc.txt"
    doc.write_text(textwrap.dedent(json.__doc__))
    out = tmp_path / "ppl.json"
    assert perplexity_main(["--checkpoint_path", str(smollm2_checkpoint), "--text", str(doc), "--max_seq_len", "1024",
                            "--device", "cpu", "--dtype", "float32", "--json", str(out)]) == 0
    hf_tok = AutoTokenizer.from_pretrained(smollm2_checkpoint.parent)
    ids = torch.tensor([hf_tok(doc.read_text())["input_ids"] + [load_tokenizer(smollm2_checkpoint).eos_ids[0]]])
    with torch.no_grad():
        expected = math.exp(hf_model(ids, labels=ids).loss.item())
    record = json.loads(out.read_text())
    assert record["tokens"] == ids.shape[1] - 1
    assert record["perplexity"] == pytest.approx(expected, rel=1e-4)
