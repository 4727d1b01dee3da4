"""Grammars: limits on hostile schemas, the token masks against a plain sampling loop, and the engine's per-row masks
on a random-weight model (every sampled generation at temperature 1 parses and validates)."""
from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import pytest
import torch

from redline.grammar import (COMPILE_SECONDS, MAX_SCHEMA_DEPTH, GrammarError, apply_masks, fill_masks,
                             json_depth, json_schema_lark, mask_words, reply_grammar, schema_text)

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "eel"]}, "maxItems": 3},
    "admin": {"type": "boolean"}}, "required": ["name", "age", "pets", "admin"], "additionalProperties": False}
POINT = {"type": "object", "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5},
                                          "tag": {"anyOf": [{"type": "null"}, {"const": "origin"}]}},
         "required": ["x", "tag"], "additionalProperties": False}


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def test_depth_and_size_limits_are_named():
    assert json_depth({"a": [1, {"b": 2}]}) == 3 and json_depth(5) == 0
    with pytest.raises(GrammarError, match=f"deeper than {MAX_SCHEMA_DEPTH}"):
        schema_text(deep_schema(100_000), "response_format's schema")  # iterative: no recursion error
    with pytest.raises(GrammarError, match="larger than"):
        schema_text({"enum": ["x" * 1000] * 300}, "the schema")
    with pytest.raises(GrammarError, match="must be a JSON object"):
        schema_text([1, 2], "the schema")


@pytest.mark.parametrize("pattern", ["(a|aa)*(b|c){1000}(d{1000}){1000}", "((a*)*)*b", "(x+x+)+y", "[a-z]{1,100000}"])
def test_regex_bombs_compile_and_mask_in_bounded_time(tools_grammar_compiler, pattern):
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}
    start = time.monotonic()
    try:
        compiled = asyncio.run(tools_grammar_compiler.compile(reply_grammar(json_schema_lark(schema), None)))
    except GrammarError:
        compiled = None  # refused with a message: as good as compiled, as long as it is quick
    if compiled is not None:
        masks = torch.full((1, mask_words(compiled.vocab_size)), -1, dtype=torch.int32)
        matcher = compiled.matcher()
        for token in tools_grammar_compiler.lltokenizer().tokenize_str('{"s": "'):
            fill_masks([matcher], masks)
            matcher.consume_token(token)
        fill_masks([matcher], masks)
    assert time.monotonic() - start < COMPILE_SECONDS


def test_compile_errors_are_grammar_errors(tools_grammar_compiler):
    with pytest.raises(GrammarError, match="does not compile"):
        tools_grammar_compiler.compile_now(reply_grammar(json_schema_lark({"type": "object", "properties": {
            "s": {"type": "string", "pattern": "(unclosed"}}}), None))


def test_compiled_grammars_are_cached(tools_grammar_compiler):
    text = reply_grammar(json_schema_lark(POINT), None)
    assert tools_grammar_compiler.compile_now(text) is tools_grammar_compiler.compile_now(text)


def sample_with_grammar(compiler, compiled, generator: torch.Generator, max_tokens: int = 80) -> str:
    """A plain sampling loop over random logits, masked by the grammar: the text the grammar let through."""
    vocab = compiled.vocab_size
    matcher = compiled.matcher()
    masks = torch.full((1, mask_words(vocab)), -1, dtype=torch.int32)
    eos = set(compiler.lltokenizer().eos_tokens)
    ids = []
    for _ in range(max_tokens):
        fill_masks([matcher], masks)
        logits = apply_masks(torch.randn(1, vocab, generator=generator) * 3, masks)  # (1, V)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        assert matcher.consume_token(token), matcher.get_error()
        if token in eos:
            break
        ids.append(token)
        if matcher.is_stopped():
            break
    assert matcher.is_stopped()
    return compiler.lltokenizer().decode_str(ids)


def test_masks_hold_in_a_plain_sampling_loop(tools_grammar_compiler):
    compiled = tools_grammar_compiler.compile_now(reply_grammar(json_schema_lark(PERSON), None))
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        jsonschema.validate(json.loads(sample_with_grammar(tools_grammar_compiler, compiled, generator)), PERSON)


@pytest.mark.parametrize("mode, prefix", [("tags", "<think>I should answer with a point.</think>\n"),
                                          ("tags", ""), ("open", "Hmm, x = 1.\n</think>\n\n")])
def test_the_grammar_starts_after_the_reasoning(tools_grammar_compiler, mode, prefix):
    compiled = tools_grammar_compiler.compile_now(reply_grammar(json_schema_lark(POINT), mode))
    tokenize = tools_grammar_compiler.lltokenizer().tokenize_str
    good, bad = prefix + '{"x": 1, "tag": "origin"}', prefix + "The point is 1."
    matcher = compiled.matcher()
    assert matcher.consume_tokens(tokenize(good)) and matcher.is_accepting()
    matcher = compiled.matcher()
    assert not (matcher.consume_tokens(tokenize(bad)) and matcher.is_accepting())


def test_apply_masks_matches_the_bits():
    vocab = 70
    allowed = [[0, 31, 32, 69], [5], list(range(vocab))]
    masks = torch.zeros(3, mask_words(vocab), dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            masks[row, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    out = apply_masks(torch.zeros(3, vocab), masks)
    for row, tokens in enumerate(allowed):
        assert (out[row] == 0).nonzero().flatten().tolist() == tokens


# ---------------------------------------------------------------------------------------------------------------------
# The engine: per-row masks before sampling.


@pytest.fixture(scope="module")
def grammar_llm(tiny_llm_checkpoint):
    from redline.generate import LLM

    return LLM.load(tiny_llm_checkpoint[0], device="cpu")


def test_engine_grammar_holds_on_200_sampled_generations(grammar_llm):
    """200 generations at temperature 1 on a random-weight model, two schemas and unconstrained rows in the same
    steps: every constrained output parses and validates, and an unconstrained row samples what it samples alone."""
    from redline.engine import Engine
    from redline.grammar import GrammarCompiler
    from redline.options import GenerationOptions

    compiler = GrammarCompiler(grammar_llm.tokenizer, grammar_llm.model.args.vocab_size)
    schemas = [PERSON, POINT]
    grammars = [compiler.compile_now(reply_grammar(json_schema_lark(s), None)) for s in schemas]
    engine = Engine(grammar_llm, max_running=64)
    try:
        free = GenerationOptions(max_new_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
        alone = engine.add_request([1, 40, 41], free).result().token_ids
        handles = []
        for i in range(200):
            options = GenerationOptions(max_new_tokens=120, temperature=1.0, seed=i, grammar=grammars[i % 2])
            handles.append((i % 2, engine.add_request([1, 40 + i % 50, 41], options)))
            if i == 100:
                mixed = engine.add_request([1, 40, 41], free)
        for which, handle in handles:
            result = handle.result()
            assert result.finish_reason == "stop", result.text  # the grammar completed, not the length limit
            jsonschema.validate(json.loads(result.text), schemas[which])
        assert mixed.result().token_ids == alone
    finally:
        engine.shutdown()
        compiler.shutdown()


def test_grammar_rows_run_in_the_decode_graph_steps(tiny_llm_checkpoint, grammar_llm):
    """With compiled decode steps (the CPU's stand-in for CUDA graphs), grammar rows decode in the graph steps with
    the other rows, reading the masks from the graphs' static buffer, also in steps launched before the tokens of
    the step before were read; their outputs still validate, and the unconstrained row samples the same tokens as in
    the eager engine."""
    from redline.engine import Engine
    from redline.generate import LLM
    from redline.grammar import GrammarCompiler
    from redline.options import GenerationOptions

    compiled = LLM.load(tiny_llm_checkpoint[0], device="cpu", compile=True)
    compiler = GrammarCompiler(compiled.tokenizer, compiled.model.args.vocab_size)
    grammar = compiler.compile_now(reply_grammar(json_schema_lark(PERSON), None))
    free = GenerationOptions(max_new_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    eager = Engine(grammar_llm)
    alone = eager.add_request([1, 40, 41], free).result().token_ids
    eager.shutdown()
    engine = Engine(compiled)
    masked_steps = []
    real = engine.graphs.run
    # (masked, its input tokens still on the device: a step launched before the one before it was read)
    engine.graphs.run = lambda *args: masked_steps.append((args[4] is not None, not isinstance(args[0], list))) \
        or real(*args)
    try:
        with engine.paused():  # both arrive before the first step: their decode steps have two rows (one bucket)
            handle = engine.add_request([1, 41, 41], GenerationOptions(max_new_tokens=120, temperature=1.0, seed=1,
                                                                       grammar=grammar))
            mixed = engine.add_request([1, 40, 41], free)
        result = handle.result(timeout=300)
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(result.text), PERSON)
        assert mixed.result(timeout=300).token_ids == alone
        assert any(masked for masked, _ in masked_steps)
        assert any(masked and ahead for masked, ahead in masked_steps)  # masks follow tokens read meanwhile
    finally:
        engine.shutdown()
        compiler.shutdown()


def test_a_compiler_loads_its_tokenizer_once_on_first_use(sp_tokenizer_dir):
    """GrammarCompiler(None, vocab, load=...) calls load once, when a grammar first needs the tokenizer (the engine
    core's start does not wait for it); a compiler takes a tokenizer or a loader, not both."""
    from redline.grammar import GrammarCompiler
    from redline.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(sp_tokenizer_dir)
    calls = []

    def load():
        calls.append(1)
        return tokenizer

    compiler = GrammarCompiler(None, tokenizer.vocab_size, load=load)
    assert calls == []
    text = reply_grammar(json_schema_lark({"type": "integer"}), None)
    assert compiler.compile_now(text).vocab_size == tokenizer.vocab_size
    compiler.compile_now(text)
    assert compiler.tokenizer is tokenizer and calls == [1]
    with pytest.raises(ValueError, match="not both or neither"):
        GrammarCompiler(tokenizer, 8, load=load)
