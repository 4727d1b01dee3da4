"""generate.py's API edges: options, streams and threads, seeds, chat, validation, scoped compiler settings."""
from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch

from redline import generate
from redline.generate import LLM, EngineConfig, GenerateArgs, GenerationOptions, main, sample
from redline.model import ModelArgs, Transformer

# The 0.999 quantile of the chi-square distribution with 7 degrees of freedom: a correct sampler fails one
# fixed-seed check in a thousand.
CHI2_7_DOF_999 = 24.322


@pytest.fixture(scope="module")
def llm(tiny_llm_checkpoint):
    return LLM.load(tiny_llm_checkpoint[0], device="cpu")


def cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_options_object_and_keywords_agree(llm):
    options = GenerationOptions(max_new_tokens=12, temperature=0.9, top_k=40, seed=3, ignore_eos=True)
    a = llm.generate("def", options=options)
    assert a.token_ids == llm.generate("def", max_new_tokens=12, temperature=0.9, top_k=40, seed=3,
                                       ignore_eos=True).token_ids
    assert llm.generate("def", options, seed=4).token_ids != a.token_ids  # keywords override the object
    assert a.trace_path is None and not hasattr(llm, "last_result")


@pytest.mark.parametrize("kwargs, message", [
    (dict(profile=True), "profile"), (dict(stop=""), "stop"), (dict(stop=["a", 3]), "stop"),
    (dict(seed=-1), "seed"), (dict(seed=1.5), "seed"), (dict(temperature=float("nan")), "temperature"),
    (dict(max_new_tokens=True), "max_new_tokens"), (dict(top_k=2.0), "top_k"),
])
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationOptions(**kwargs)


def test_profile_path_under_a_file_is_refused_before_any_work(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        GenerationOptions(profile=tmp_path / "file" / "trace.json.gz")
    assert GenerationOptions(profile=str(tmp_path / "new" / "t.json.gz")).profile.path == tmp_path / "new" / "t.json.gz"


def test_stream_result_is_ready_only_when_exhausted(llm):
    stream = llm.stream("abc", max_new_tokens=5, ignore_eos=True)
    with pytest.raises(RuntimeError, match="exhausted"):
        stream.result
    assert "".join(stream) == stream.result.text and len(stream.result.token_ids) == 5


@pytest.mark.parametrize("prompt", [[1, True], [1.0, 2], ["a"], b"ab", {1: 2}, np.array([1.5]), {3, 4}, None])
def test_prompts_that_are_not_token_ids_are_refused(llm, prompt):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompt, max_new_tokens=2)


def test_numpy_integer_prompts_are_token_ids(llm):
    ids = [5, 17, 99]
    expected = llm.generate(ids, max_new_tokens=4, ignore_eos=True).token_ids
    assert llm.generate(np.array(ids), max_new_tokens=4, ignore_eos=True).token_ids == expected
    assert llm.generate([np.int32(t) for t in ids], max_new_tokens=4, ignore_eos=True).token_ids == expected


def test_lone_surrogate_gets_a_clean_error(llm, tiny_llm_checkpoint, capsys):
    with pytest.raises(ValueError, match="surrogate"):
        llm.generate("abc\ud800", max_new_tokens=2)
    code, out, err = cli(capsys, "--checkpoint_path", str(tiny_llm_checkpoint[0]), "--prompt", "x\udcff")
    assert code == 2 and out == "" and err.count("\n") == 1 and "surrogate" in err


def test_four_threads_get_the_tokens_of_sequential_calls(llm):
    jobs = [("def f", dict(max_new_tokens=16, ignore_eos=True)),
            ("import", dict(max_new_tokens=20, temperature=1.0, seed=1, ignore_eos=True)),
            ("class A", dict(max_new_tokens=12, temperature=0.7, top_p=0.9, seed=2, ignore_eos=True)),
            ([5, 6, 7], dict(max_new_tokens=18, temperature=1.2, top_k=20, seed=3, ignore_eos=True))]
    sequential = [llm.generate(p, **kw).token_ids for p, kw in jobs]
    results: list = [None] * len(jobs)

    def work(i):
        for _ in range(3):
            results[i] = llm.generate(jobs[i][0], **jobs[i][1]).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == sequential


def test_interleaved_streams_raise_instead_of_returning_wrong_tokens(llm):
    kwargs = dict(max_new_tokens=10, ignore_eos=True)
    expected = llm.generate("for x in", **kwargs).text
    first, second = llm.stream("abc", **kwargs), llm.stream("for x in", **kwargs)
    next(first)
    assert next(second) + "".join(second) == expected  # takes the LLM over in this thread: no deadlock
    with pytest.raises(RuntimeError, match="invalidated"):
        next(first)
    abandoned = llm.stream("abc", **kwargs)
    next(abandoned)
    assert llm.generate("for x in", **kwargs).text == expected
    with pytest.raises(RuntimeError, match="invalidated"):
        next(abandoned)


def test_another_thread_waits_for_a_live_stream(llm):
    kwargs = dict(max_new_tokens=10, ignore_eos=True)
    expected = llm.generate("x = 1", **kwargs).token_ids
    got = []
    stream = llm.stream("abc", **kwargs)
    next(stream)
    other = threading.Thread(target=lambda: got.append(llm.generate("x = 1", **kwargs).token_ids))
    other.start()
    other.join(0.5)
    assert other.is_alive() and not got  # held while the stream lives
    rest = list(stream)
    other.join(60)
    assert got == [expected] and len(stream.result.token_ids) == 10 and rest is not None


def test_seeded_sampling_leaves_the_global_rng_alone(llm):
    kwargs = dict(max_new_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    state = torch.get_rng_state()
    first = llm.generate("def", **kwargs).token_ids
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(123)
    assert llm.generate("def", **kwargs).token_ids == first
    unseeded = dict(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    torch.manual_seed(7)
    a = llm.generate("def", **unseeded).token_ids
    torch.manual_seed(7)
    assert llm.generate("def", **unseeded).token_ids == a  # one draw from the global RNG per generation


@pytest.mark.parametrize("temperature, top_k, seed", [(1.0, 8, 0), (0.7, 8, 1), (1.3, 5, 2)])
def test_sampling_follows_the_softmax_distribution(temperature, top_k, seed):
    """Chi-square goodness of fit over 8 outcomes, 20000 draws (rows) with a fixed seed."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    n = 20000
    draws = sample(logits.repeat(n, 1), torch.tensor(temperature), torch.tensor(top_k), torch.tensor(2.0),
                   torch.tensor(seed), torch.tensor([3])).flatten()
    expected = torch.softmax(logits / temperature, dim=-1)
    expected[top_k:] = 0
    expected = expected / expected.sum() * n
    observed = torch.bincount(draws, minlength=8).double()
    kept = expected > 0
    assert observed[~kept].sum() == 0
    chi2 = ((observed[kept] - expected[kept]) ** 2 / expected[kept]).sum().item()
    critical = CHI2_7_DOF_999 if top_k == 8 else {5: 18.467}[top_k]  # 0.999 quantile, 4 degrees of freedom
    assert chi2 < critical


def test_noise_differs_by_position_and_seed():
    logits = torch.zeros(1, 1000)
    picks = {sample(logits, torch.tensor(1.0), torch.tensor(1000), torch.tensor(2.0), torch.tensor(s),
                    torch.tensor([p])).item() for s in range(3) for p in range(10)}
    assert len(picks) > 25  # 30 draws from 1000 equal ids: almost all distinct


def test_padded_vocabulary_ids_are_never_sampled(chat_tokenizer):
    torch.manual_seed(0)
    vocab = chat_tokenizer.vocab_size
    model = Transformer(ModelArgs(dim=64, n_layer=1, n_head=4, intermediate_size=128, vocab_size=vocab + 40,
                                  block_size=128))
    # The padding rows would win every step.
    model.output.register_forward_hook(lambda m, i, out: out.index_add(
        -1, torch.arange(vocab, vocab + 40), torch.full((*out.shape[:-1], 40), 1e4)))
    unmasked = LLM(model, None, torch.device("cpu"), compile=False).generate([5, 6], max_new_tokens=4)
    assert all(t >= vocab for t in unmasked.token_ids)
    llm = LLM(model, chat_tokenizer, torch.device("cpu"), compile=False)
    for kwargs in (dict(), dict(temperature=2.0, seed=0)):
        ids = llm.generate([5, 6], max_new_tokens=20, ignore_eos=True, **kwargs).token_ids
        assert len(ids) == 20 and all(t < vocab for t in ids)


def test_kernels_settings_are_checked_and_a_cpu_model_is_left_alone(tiny_llm_checkpoint, capsys):
    model = Transformer(ModelArgs(dim=64, n_layer=1, n_head=4, intermediate_size=128, vocab_size=64, block_size=64))
    from redline.kernels.attention import CpuAttention
    from redline.kernels.cpu_linear import CpuLinear
    from redline.model import Attention

    classes = [type(m) for m in model.modules()]
    LLM(model, None, torch.device("cpu"), compile=False)
    # On the CPU only the bias-free float32 linears and the attention change: they run on the C++ kernels' own
    # threads (CpuLinear, CpuAttention).
    swapped = {torch.nn.Linear: CpuLinear, Attention: CpuAttention}
    assert [type(m) for m in model.modules()] == [swapped.get(c, c) for c in classes]
    assert CpuLinear in [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match="kernels"):
        LLM(model, None, torch.device("cpu"), compile=False, kernels=True)
    with pytest.raises(ValueError, match="fuse"):
        LLM(model, None, torch.device("cpu"), compile=False, kernels=False, fuse=True)
    assert generate.parse_args(["--checkpoint_path", "x", "--prompt", "a", "--no-kernels", "--no-fuse"]).engine \
        == generate.EngineConfig(kernels=False, fuse=False)
    for flags, message in [(["--no-kernels", "--fuse"], "fuse"), (["--kernels", "--device", "cpu"], "kernels")]:
        code, _, err = cli(capsys, "--checkpoint_path", str(tiny_llm_checkpoint[0]), "--prompt", "a", *flags)
        assert code == 2 and err.count("\n") == 1 and message in err


@pytest.mark.parametrize("extra, message", [
    (["--device", "cuda:abc"], "--device"), (["--device", "cuda"], "GPU"), (["--stop", ""], "stop"),
    (["--prompt", "word " * 400], "context"), (["--chat", "--interactive"], "pick one"),
    (["--system", "hi"], "--chat"),
])
def test_cli_rejects_before_echoing_the_prompt(tiny_llm_checkpoint, capsys, extra, message):
    if message == "GPU" and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    code, out, err = cli(capsys, "--checkpoint_path", str(tiny_llm_checkpoint[0]), "--prompt", "hi", *extra)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_cli_profile_under_a_file_fails_before_loading(tmp_path, capsys, monkeypatch):
    (tmp_path / "f").write_text("x")
    monkeypatch.setattr(LLM, "from_config", lambda *a: pytest.fail("loaded before checking the trace path"))
    code, out, err = cli(capsys, "--checkpoint_path", "x", "--prompt", "a", "--profile", str(tmp_path / "f" / "t.json"))
    assert code == 2 and out == "" and err.count("\n") == 1 and "not a folder" in err


def test_ctrl_c_prints_one_line(tiny_llm_checkpoint, capsys, monkeypatch):
    def interrupt(*args):
        raise KeyboardInterrupt

    argv = ["--checkpoint_path", str(tiny_llm_checkpoint[0]), "--prompt", "a", "--device", "cpu"]
    monkeypatch.setattr(generate, "print_stream", interrupt)
    assert cli(capsys, *argv)[::2] == (130, "error: interrupted\n")
    monkeypatch.setattr(LLM, "from_config", interrupt)  # during loading
    assert cli(capsys, *argv)[::2] == (130, "error: interrupted\n")


def test_chat_and_cli_chat_use_the_template(tiny_llm_checkpoint, chat_tokenizer, monkeypatch, capsys):
    monkeypatch.setattr(generate, "load_tokenizer", lambda path: chat_tokenizer)
    llm = LLM.load(tiny_llm_checkpoint[0], device="cpu")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2 + 2?"}]
    reply = llm.chat(messages, max_new_tokens=8, temperature=0)
    assert reply.token_ids == llm.generate(chat_tokenizer.apply_chat_template(messages), max_new_tokens=8).token_ids
    code, out, err = cli(capsys, "--checkpoint_path", str(tiny_llm_checkpoint[0]), "--device", "cpu", "--chat",
                         "--system", "be brief", "--prompt", "What is 2 + 2?", "--max_new_tokens", "8",
                         "--temperature", "0")
    assert code == 0 and out == reply.text + "\n" and chat_tokenizer.calls[-1] == messages
    with pytest.raises(ValueError, match="messages"):
        llm.chat("hello")


def test_interactive_chat_drops_the_oldest_turns_when_the_context_fills(tiny_llm_checkpoint, chat_tokenizer,
                                                                         monkeypatch):
    monkeypatch.setattr(generate, "load_tokenizer", lambda path: chat_tokenizer)
    cfg = GenerateArgs(tiny_llm_checkpoint[0], EngineConfig(device="cpu"), GenerationOptions(max_new_tokens=24),
                       interactive=True, system="be brief")
    line = "The quick brown fox jumps over the lazy dog. " * 3
    out, err = io.StringIO(), io.StringIO()
    assert generate.run_cli(cfg, stdin=io.StringIO(f"{line}\n" * 8 + "\n"), out=out, err=err) == 0
    assert out.getvalue().count("assistant> ") == 8 and "dropped" in err.getvalue()
    final = chat_tokenizer.calls[-1]
    assert final[0]["role"] == "system" and final[-1] == {"role": "user", "content": line}
    context = 256  # the fixture model's block_size
    assert len(chat_tokenizer.apply_chat_template(final)) + 24 <= context


def test_compiled_llm_scopes_its_compiler_settings_and_times_compile_apart(tiny_llm_checkpoint, llm):
    import torch._inductor.config as inductor_config

    before = (inductor_config.get_config_copy(), torch._dynamo.config.get_config_copy())
    torch._dynamo.reset()
    compiled = LLM.load(tiny_llm_checkpoint[0], device="cpu", compile=True, compile_prefill=True)
    first = compiled.generate("def f(x):", max_new_tokens=8, ignore_eos=True)
    assert (inductor_config.get_config_copy(), torch._dynamo.config.get_config_copy()) == before
    assert first.token_ids == llm.generate("def f(x):", max_new_tokens=8, ignore_eos=True).token_ids
    assert first.stats.compile_s > 0 and first.stats.ttft_s < 0.2 * first.stats.compile_s
