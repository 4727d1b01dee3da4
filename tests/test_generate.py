"""generate.py: the engine against HF generate, sampling, streaming, the CLI and compilation."""
from __future__ import annotations

import io

import pytest
import torch

from redline import generate
from redline.generate import LLM, EngineConfig, GenerateArgs, GenerationOptions, main, nucleus_keep_mask, sample
from conftest import GPU_TEST_KV_TOKENS


@pytest.fixture(scope="module")
def llm(tiny_llm_checkpoint):
    return LLM.load(tiny_llm_checkpoint[0], device="cpu")


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=0)
    return out[0, len(ids):].tolist()


def test_greedy_matches_hf_generate(llm, tiny_llm_checkpoint):
    _, hf_model = tiny_llm_checkpoint
    for prompt in ["def fibonacci(n):", "The quick brown fox"]:
        ids = llm.encode_prompt(prompt)
        ours = llm.generate(prompt, max_new_tokens=32, ignore_eos=True)
        assert ours.token_ids == hf_greedy(hf_model, ids, 32)
        assert ours.finish_reason == "length" and ours.stats.new_tokens == 32


def test_token_id_prompt_is_used_exactly(llm, tiny_llm_checkpoint):
    _, hf_model = tiny_llm_checkpoint
    ids = [5, 17, 99, 3]  # no BOS added
    assert llm.generate(ids, max_new_tokens=8, ignore_eos=True).token_ids == hf_greedy(hf_model, ids, 8)


def test_string_prompt_is_encoded_by_the_tokenizers_own_rules(llm):
    assert llm.encode_prompt("hello") == llm.tokenizer.encode("hello")


def test_seeded_sampling_is_reproducible(llm):
    kwargs = dict(max_new_tokens=24, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    a, b = llm.generate("import os", **kwargs), llm.generate("import os", **kwargs)
    c = llm.generate("import os", **{**kwargs, "seed": 99})
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate("for i in", max_new_tokens=20, ignore_eos=True)
    top1 = llm.generate("for i in", max_new_tokens=20, temperature=1.3, top_k=1, seed=0, ignore_eos=True)
    assert top1.token_ids == greedy.token_ids


def test_nucleus_mask_keeps_exactly_the_smallest_prefix():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    everything = torch.tensor(100)
    cases = {0.5: [1, 0, 0, 0], 0.51: [1, 1, 0, 0], 0.8: [1, 1, 0, 0], 0.81: [1, 1, 1, 0], 1.0: [1, 1, 1, 1],
             0.01: [1, 0, 0, 0]}
    for top_p, expected in cases.items():
        keep = nucleus_keep_mask(probs, everything, torch.tensor(top_p))
        assert keep.int().tolist() == [expected], top_p
    assert nucleus_keep_mask(probs, torch.tensor(2), torch.tensor(2.0)).int().tolist() == [[1, 1, 0, 0]]


def test_top_p_sampling_draws_only_from_the_nucleus():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]])).repeat(4000, 1)  # nucleus at 0.8: ids 1 and 3
    draws = sample(logits, torch.tensor(1.0), torch.tensor(4), torch.tensor(0.8), torch.tensor(0),
                   torch.tensor([7])).flatten()
    counts = torch.bincount(draws, minlength=4)
    assert counts[0] == 0 and counts[2] == 0
    assert abs(counts[1].item() / 4000 - 0.5 / 0.8) < 0.03  # renormalised within the nucleus


def test_stream_joins_to_generate_text(llm):
    kwargs = dict(max_new_tokens=40, temperature=0.9, seed=7, ignore_eos=True)
    stream = llm.stream("class Foo:", **kwargs)
    pieces = list(stream)
    result = stream.result
    assert "".join(pieces) == result.text == llm.generate("class Foo:", **kwargs).text
    assert result.text == llm.tokenizer.decode(result.token_ids)


def test_stream_never_splits_a_multibyte_character(llm):
    # Byte-fallback pieces of one emoji arrive as separate tokens; the stream must wait for the whole character.
    ids = llm.tokenizer.encode("🚀🚀 日本語")
    text_stream = generate.TextStream(llm.tokenizer)
    pieces = [text_stream.push(t) for t in ids] + [text_stream.flush()]
    assert "".join(pieces) == llm.tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    assert len(ids) > 4  # the emoji really were split into byte tokens


def test_stop_string_ends_generation(llm):
    full = llm.generate("x = ", max_new_tokens=30, temperature=1.0, seed=5, ignore_eos=True)
    stop = full.text[5:8]
    assert stop and stop in full.text
    stopped = llm.generate("x = ", max_new_tokens=30, temperature=1.0, seed=5, ignore_eos=True, stop=stop)
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.find(stop)]
    assert "".join(llm.stream("x = ", max_new_tokens=30, temperature=1.0, seed=5, ignore_eos=True, stop=stop)) \
        == stopped.text


def test_eos_stops_generation(llm, monkeypatch):
    first = llm.generate("def", max_new_tokens=10, temperature=1.0, seed=11, ignore_eos=True).token_ids
    cut = next(i for i in range(1, 10) if first[i] not in first[:i])  # an id that first appears at index `cut`
    monkeypatch.setattr(llm.tokenizer, "eos_ids", (first[cut],))
    result = llm.generate("def", max_new_tokens=10, temperature=1.0, seed=11)
    assert result.finish_reason == "eos" and result.token_ids == first[:cut]


def test_generation_is_capped_by_the_context(llm):
    context = llm.model.args.block_size
    ids = list(range(3, 3 + context - 5))
    result = llm.generate(ids, max_new_tokens=50, ignore_eos=True)
    assert len(result.token_ids) == 5 and result.finish_reason == "length"


def test_caller_may_resize_the_cache_between_generations(llm):
    before = llm.generate("abc", max_new_tokens=12, ignore_eos=True).token_ids
    llm.model.setup_caches(max_batch_size=3, max_seq_length=20)
    assert llm.generate("abc", max_new_tokens=12, ignore_eos=True).token_ids == before
    llm.model.setup_caches(max_batch_size=1, max_seq_length=8)  # too small: generate grows it again
    assert llm.generate("abc", max_new_tokens=12, ignore_eos=True).token_ids == before


def test_stats_are_filled(llm):
    stats = llm.generate("hello", max_new_tokens=10, ignore_eos=True).stats
    assert stats.prompt_tokens == len(llm.encode_prompt("hello")) and stats.new_tokens == 10
    assert stats.ttft_s > 0 and stats.decode_tok_s > 0 and stats.prefill_tok_s > 0
    expected_bytes = sum(p.numel() * 4 for n, p in llm.model.named_parameters() if n != "tok_embeddings.weight")
    assert stats.model_bytes_per_token == expected_bytes
    assert stats.bandwidth_gb_s == pytest.approx(stats.decode_tok_s * expected_bytes / 1e9)
    assert stats.peak_memory_gb is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=0.0), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=0), "top_k"),
    ],
)
def test_bad_api_arguments(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("hi", **kwargs)


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="empty"):
        llm.generate([])
    with pytest.raises(ValueError, match="context"):
        llm.generate(list(range(3, 3 + llm.model.args.block_size)))
    with pytest.raises(ValueError, match="outside the model.s vocabulary"):
        llm.generate([10**7])


def cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max_new_tokens", "-3"], "max_new_tokens"),
        (["--top_p", "1.5"], "top_p"),
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "word " * 400], "context"),
        (["--device", "tpu"], "--device"),
        (["--repetition_penalty", "0"], "repetition_penalty must be a number > 0"),
        (["--presence_penalty", "3"], "presence_penalty must be a number in [-2, 2]"),
        (["--min_p", "2"], "min_p must be a number in [0, 1]"),
    ],
)
def test_cli_bad_arguments_give_one_line(tiny_llm_checkpoint, capsys, extra, message):
    argv = ["--checkpoint_path", str(tiny_llm_checkpoint[0]), "--prompt", "hi", "--device", "cpu", *extra]
    code, out, err = cli(capsys, *argv)
    assert code == 2 and "Traceback" not in err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_cli_penalty_flags_reach_the_engine(tiny_llm_checkpoint, capsys, llm):
    code, out, err = cli(capsys, "--checkpoint_path", str(tiny_llm_checkpoint[0]), "--prompt", "def add(a, b):",
                         "--max_new_tokens", "12", "--temperature", "0", "--device", "cpu", "--repetition_penalty",
                         "2.5", "--frequency_penalty", "1", "--presence_penalty", "0.5", "--min_p", "0.1")
    assert code == 0 and "Traceback" not in err
    settings = dict(repetition_penalty=2.5, frequency_penalty=1.0, presence_penalty=0.5, min_p=0.1)
    expected = llm.generate("def add(a, b):", max_new_tokens=12, **settings)
    assert out == "def add(a, b):" + expected.text + "\n"
    assert expected.token_ids != llm.generate("def add(a, b):", max_new_tokens=12).token_ids


def test_cli_missing_checkpoint(tmp_path, capsys):
    code, _, err = cli(capsys, "--checkpoint_path", str(tmp_path / "nope"), "--prompt", "hi")
    assert code == 2 and err.startswith("error: ") and "does not exist" in err and err.count("\n") == 1


def test_cli_streams_text_and_prints_stats(tiny_llm_checkpoint, capsys, llm):
    code, out, err = cli(capsys, "--checkpoint_path", str(tiny_llm_checkpoint[0]), "--prompt", "def add(a, b):",
                         "--max_new_tokens", "16", "--temperature", "0", "--device", "cpu", "--num_samples", "2")
    assert code == 0
    expected = llm.generate("def add(a, b):", max_new_tokens=16).text
    assert out == ("def add(a, b):" + expected + "\n") * 2
    assert err.count("decode") == 2 and "tok/s" in err


def test_cli_interactive_uses_the_chat_template(tiny_llm_checkpoint, chat_tokenizer, monkeypatch, llm):
    monkeypatch.setattr(generate, "load_tokenizer", lambda path: chat_tokenizer)
    cfg = GenerateArgs(tiny_llm_checkpoint[0], EngineConfig(device="cpu"), GenerationOptions(max_new_tokens=6),
                       interactive=True, system="be brief")
    out, err = io.StringIO(), io.StringIO()
    code = generate.run_cli(cfg, stdin=io.StringIO("hello there\n\n"), out=out, err=err)
    assert code == 0
    # the banner names the model (its folder) and the file, not a dtype folder
    path = tiny_llm_checkpoint[0]
    assert err.getvalue().startswith(f"chatting with {path.parent.name} ({path});")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    assert chat_tokenizer.calls[-1] == messages
    reply = llm.generate(chat_tokenizer.apply_chat_template(messages), max_new_tokens=6).text
    assert out.getvalue() == f"you> assistant> {reply}\nyou> "


class InterruptingWriter(io.StringIO):
    """stdout whose first write of a reply's text raises KeyboardInterrupt, as Ctrl-C during the reply would."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupted = False

    def write(self, text: str) -> int:
        if not self.interrupted and self.getvalue().endswith("assistant> ") and text.strip():
            self.interrupted = True
            raise KeyboardInterrupt
        return super().write(text)


def test_cli_interactive_ctrl_c_stops_the_reply_not_the_conversation(tiny_llm_checkpoint, chat_tokenizer,
                                                                      monkeypatch):
    monkeypatch.setattr(generate, "load_tokenizer", lambda path: chat_tokenizer)
    cfg = GenerateArgs(tiny_llm_checkpoint[0], EngineConfig(device="cpu"), GenerationOptions(max_new_tokens=6),
                       interactive=True)
    out, err = InterruptingWriter(), io.StringIO()
    code = generate.run_cli(cfg, stdin=io.StringIO("first\nsecond\n\n"), out=out, err=err)
    assert code == 0 and out.interrupted
    assert "stopped" in err.getvalue()
    # The second message was answered: the conversation went on, with the stopped turn kept in it.
    assert [m["role"] for m in chat_tokenizer.calls[-1]] == ["user", "assistant", "user"]
    assert chat_tokenizer.calls[-1][2]["content"] == "second"
    assert out.getvalue().count("you> ") == 3


def test_compiled_decode_never_recompiles_on_cpu(tiny_llm_checkpoint, llm):
    """fullgraph inductor on the CPU: one graph serves three prompt lengths and every position."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    compiled = LLM.load(tiny_llm_checkpoint[0], device="cpu", compile=True)
    counters.clear()
    first = compiled.generate("a", max_new_tokens=20, ignore_eos=True)
    graphs_after_first = counters["stats"]["unique_graphs"]
    assert graphs_after_first == 1 and first.stats.compile_s > 0  # warm-up and generation share one graph
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt in ["def main():\n    return", "x" * 40]:
            result = compiled.generate(prompt, max_new_tokens=20, ignore_eos=True)
            assert result.token_ids == llm.generate(prompt, max_new_tokens=20, ignore_eos=True).token_ids
            assert result.stats.compile_s == 0
    assert counters["stats"]["unique_graphs"] == graphs_after_first


@pytest.mark.gpu
def test_gpu_compiled_greedy_equals_eager(tiny_llm_checkpoint):
    from torch._dynamo.utils import counters

    path, pool = tiny_llm_checkpoint[0], GPU_TEST_KV_TOKENS
    eager = LLM.load(path, device="cuda", dtype="bfloat16", compile=False, max_kv_tokens=pool)
    compiled = LLM.load(path, device="cuda", dtype="bfloat16", compile=True, compile_prefill=True, max_kv_tokens=pool)
    prompts = ["def fibonacci(n):", "import numpy as np\n" * 5, "x"]
    for prompt in prompts:  # each power-of-two prefill bucket compiles once, by design
        compiled.generate(prompt, max_new_tokens=4, ignore_eos=True)
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt in prompts:
            a = compiled.generate(prompt, max_new_tokens=48, ignore_eos=True).token_ids
            b = eager.generate(prompt, max_new_tokens=48, ignore_eos=True).token_ids
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            assert a == b, f"{prompt!r}: first divergence at token {first}: compiled {a[first:first + 4]}, eager {b[first:first + 4]}"
    assert counters["stats"]["unique_graphs"] == graphs


def test_cli_profile_writes_a_trace_that_trace_summary_reads(tiny_llm_checkpoint, tmp_path, capsys):
    import gzip
    import json
    import re

    from redline.scripts.trace_summary import main as summary_main

    trace = tmp_path / "run.json.gz"
    code, _, err = cli(capsys, "--checkpoint_path", str(tiny_llm_checkpoint[0]), "--prompt", "def f(x):",
                       "--max_new_tokens", "30", "--temperature", "0", "--device", "cpu",
                       "--profile", str(trace), "--profile_steps", "6")
    assert code == 0 and f"trace written to {trace}" in err
    printed = float(re.search(r"decode ([0-9.]+) tok/s", err).group(1))
    data = json.loads(gzip.decompress(trace.read_bytes()))
    names = [e.get("name") for e in data["traceEvents"]]
    assert names.count("redline.prefill") == 1 and names.count("redline.decode_step") == 6
    counters = [e for e in data["traceEvents"] if e.get("ph") == "C" and e.get("name") == "tokens/sec"]
    assert len(counters) == 6 and all(e["args"]["tokens/sec"] > 0 for e in counters)
    stats = data["redline"]["stats"]
    assert stats["new_tokens"] == 30 and stats["device"] == "cpu" and stats["quantization"] == "none"
    assert f"{stats['decode_tok_s']:.2f}" == f"{printed:.2f}"
    assert summary_main([str(trace), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tok_s"] == pytest.approx(stats["decode_tok_s"]) and summary["steps"] == 6


@pytest.mark.gpu
def test_kernels_false_runs_no_triton_kernel_int8_included(tiny_llm_checkpoint, monkeypatch):
    from redline.checkpoint import read_checkpoint_info
    from redline.kernels import attention, linear
    from redline.quantize import load_model, quantize_
    from redline.tokenizer import load_tokenizer

    def refuse():
        raise AssertionError("a Triton kernel was asked for with kernels=False")

    monkeypatch.setattr(linear, "triton_linear", refuse)
    monkeypatch.setattr(attention, "triton_attention", refuse)
    info = read_checkpoint_info(tiny_llm_checkpoint[0])
    model = load_model(info, torch.device("cuda"), torch.bfloat16)
    quantize_(model, "int8")
    llm = LLM(model, load_tokenizer(info.path), torch.device("cuda"), compile=False, info=info, kernels=False)
    assert not llm.fuse
    assert not any(type(m).__module__.startswith("kernels") for m in model.modules())
    assert len(llm.generate("def fibonacci(n):", max_new_tokens=6, ignore_eos=True).token_ids) == 6
