"""Tests for benchmarks/random_gguf.py: a random-weight GGUF file in a registry model's shapes that Redline converts
and generates from (and llama.cpp loads, where llama-cpp-python is installed)."""
from __future__ import annotations

import importlib.util

import pytest

gguf = pytest.importorskip("gguf")

from test_convert_gguf import gpt2_tokenizer_from, write_gguf  # noqa: E402

from redline.benchmarks import random_gguf  # noqa: E402
from redline.model import ModelArgs  # noqa: E402

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.fixture
def like(tmp_path, hf_tokenizer_dir):
    """A GGUF file that holds only a byte-level BPE tokenizer."""
    return write_gguf(tmp_path / "like.gguf", tokenizer=gpt2_tokenizer_from(hf_tokenizer_dir))


def test_the_file_has_the_models_shapes_and_a_padded_vocabulary(tmp_path, like):
    out = tmp_path / "out"
    assert random_gguf.main(["--model", "debug-tiny", "--like", str(like), "--types", "", "--out-dir", str(out)]) == 0
    path = out / "debug-tiny-random.F16.gguf"
    reader = gguf.GGUFReader(str(path))
    args = ModelArgs.from_name("debug-tiny")
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    assert shapes["token_embd.weight"] == (args.vocab_size, args.dim)
    assert shapes["output.weight"] == (args.vocab_size, args.dim)  # debug-tiny's head is not tied
    assert shapes[f"blk.{args.n_layer - 1}.ffn_down.weight"] == (args.dim, args.intermediate_size)
    assert shapes["blk.0.attn_k.weight"] == (args.n_kv_heads * args.head_dim, args.dim)
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == args.vocab_size
    like_tokens = gguf.GGUFReader(str(like)).fields["tokenizer.ggml.tokens"].contents()
    assert reader.fields["tokenizer.ggml.tokens"].contents()[:len(like_tokens)] == like_tokens
    assert [f.name for f in out.iterdir()] == [path.name]  # no temp file left beside it


def test_redline_converts_the_file_and_generates(tmp_path, like):
    from redline import generate
    from redline.scripts.convert_gguf import convert_gguf

    out = tmp_path / "out"
    assert random_gguf.main(["--model", "debug-tiny", "--like", str(like), "--types", "", "--out-dir", str(out)]) == 0
    checkpoint = convert_gguf(out / "debug-tiny-random.F16.gguf", dtype="float32")
    llm = generate.LLM.load(checkpoint, device="cpu", compile=False)
    assert llm.model.args.vocab_size == ModelArgs.from_name("debug-tiny").vocab_size
    assert len(llm.generate("hello", max_new_tokens=4, temperature=0, ignore_eos=True).token_ids) == 4


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed")
def test_llama_cpp_quantizes_and_runs_the_file(tmp_path, like):
    import llama_cpp

    out = tmp_path / "out"
    assert random_gguf.main(["--model", "debug-tiny", "--like", str(like), "--types", "Q8_0", "--out-dir", str(out),
                             "--threads", "1"]) == 0
    quantized = out / "debug-tiny-random.Q8_0.gguf"
    assert quantized.stat().st_size < (out / "debug-tiny-random.F16.gguf").stat().st_size
    model = llama_cpp.Llama(model_path=str(quantized), n_ctx=64, n_threads=1, verbose=False)
    assert len(model.tokenize(b"hello", add_bos=False)) >= 1
    assert model.create_completion("hello", max_tokens=4, temperature=0)["choices"][0]["text"] is not None


def test_an_existing_file_is_kept_and_bad_arguments_are_one_line(tmp_path, like, capsys):
    out = tmp_path / "out"
    out.mkdir()
    kept = out / "debug-tiny-random.F16.gguf"
    kept.write_bytes(b"mine")
    assert random_gguf.main(["--model", "debug-tiny", "--like", str(like), "--types", "", "--out-dir", str(out)]) == 0
    assert kept.read_bytes() == b"mine"
    cases = [(["--model", "debug-tiny", "--like", str(like), "--types", "Q5_K"], "unknown --types Q5_K"),
             (["--model", "debug-tiny", "--like", str(tmp_path / "none.gguf")], "no such file"),
             (["--model", "Qwen3-30B-A3B", "--like", str(like)], "not a dense model of Llama's layout"),
             (["--model", "nope", "--like", str(like)], "unknown model name 'nope'")]
    for extra, message in cases:
        capsys.readouterr()
        assert random_gguf.main([*extra, "--out-dir", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
