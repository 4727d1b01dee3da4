"""benchmarks/bench_serve.py against a live server (the tiny model on the batching engine)."""
from __future__ import annotations

import json
import math

import pytest

from redline.benchmarks import bench_serve
from redline.generate import LLM
from redline.serve import ServeSettings, create_app
from paced_engine import PacedEngine
from live_server import ServerThread


def test_percentile_interpolates_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert bench_serve.percentile(values, 50) == 2.5 and bench_serve.percentile(values, 100) == 4.0
    assert bench_serve.percentile(values, 90) == pytest.approx(3.7) and math.isnan(bench_serve.percentile([], 50))


def test_poisson_arrivals_have_the_asked_rate():
    cfg = bench_serve.BenchServeConfig(num_prompts=4000)
    offsets = bench_serve.arrival_offsets(cfg, 8.0)
    assert offsets == sorted(offsets) and offsets[-1] / len(offsets) == pytest.approx(1 / 8.0, rel=0.1)
    assert bench_serve.arrival_offsets(cfg, math.inf) == [0.0] * 4000


@pytest.mark.parametrize("argv, message", [(["--input-len", "9:3"], "input-len"), (["--request-rate", "0"], "rate"),
                                           (["--offline"], "offline"), (["--input-len", "x"], "input-len"),
                                           (["--max-concurrency", "0"], "max-concurrency")])
def test_bad_arguments_get_one_line(argv, message, capsys):
    assert bench_serve.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_rate_sweep_against_a_live_server(tiny_chat_checkpoint, tmp_path, capsys):
    llm = LLM.load(tiny_chat_checkpoint[0], device="cpu")
    settings = ServeSettings(checkpoint_path=tiny_chat_checkpoint[0], api_key="k")
    engine = PacedEngine(llm)
    engine.piece_delay_s = 0.005  # unpaced, a fast step can send a whole reply in one read and leave no ITL sample
    with ServerThread(create_app(engine, llm, settings)) as url:
        code = bench_serve.main(["--base-url", url, "--api-key", "k", "--num-prompts", "6", "--input-len", "4:12",
                                 "--output-len", "5", "--vocab-size", "512", "--request-rate", "20,inf",
                                 "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "out.png")])
    assert code == 0
    report = json.loads((tmp_path / "out.json").read_text())
    assert [r["request_rate"] for r in report["runs"]] == [20.0, "inf"]
    for run in report["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0 and run["output_tokens"] == 30
        assert 4 * 6 <= run["prompt_tokens"] <= 12 * 6 and run["output_tok_s"] > 0
        assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"] and run["itl_ms"]["p50"] > 0
    assert report["runs"][1]["peak_concurrency"] > 1  # all at once: the requests overlap
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().out.count("req/s |") == 2


def test_one_client_at_a_time_never_overlaps(tiny_chat_checkpoint, tmp_path):
    """--max-concurrency 1: each request is sent after the one before has finished, as one client would."""
    llm = LLM.load(tiny_chat_checkpoint[0], device="cpu")
    settings = ServeSettings(checkpoint_path=tiny_chat_checkpoint[0])
    with ServerThread(create_app(PacedEngine(llm), llm, settings)) as url:
        code = bench_serve.main(["--base-url", url, "--num-prompts", "4", "--input-len", "6", "--output-len", "4",
                                 "--vocab-size", "512", "--max-concurrency", "1", "--json", str(tmp_path / "o.json")])
    run = json.loads((tmp_path / "o.json").read_text())["runs"][0]
    assert code == 0 and run["completed"] == 4 and run["peak_concurrency"] == 1


def test_json_schema_on_every_request(tiny_chat_checkpoint, tmp_path):
    """--json-schema list: every streamed completion is masked by the grammar and still writes --output-len tokens
    (the list is too long to finish); its text is the start of the list."""
    llm = LLM.load(tiny_chat_checkpoint[0], device="cpu")
    settings = ServeSettings(checkpoint_path=tiny_chat_checkpoint[0])
    with ServerThread(create_app(PacedEngine(llm), llm, settings)) as url:
        code = bench_serve.main(["--base-url", url, "--num-prompts", "4", "--input-len", "6", "--output-len", "12",
                                 "--vocab-size", "512", "--json-schema", "list", "--json", str(tmp_path / "o.json")])
        import httpx

        body = {"prompt": [1, 5, 6], "max_tokens": 12, "temperature": 1.0, "ignore_eos": True,
                "response_format": bench_serve.BenchServeConfig(json_schema="list").response_format()}
        text = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    run = json.loads((tmp_path / "o.json").read_text())["runs"][0]
    assert code == 0 and run["completed"] == 4 and run["output_tokens"] == 4 * 12
    assert text.startswith('[{"id": ')


def test_bench_tokenizer_serves_random_weights_with_grammars(tmp_path, tokenizer_sample_text):
    """The benchmark tokenizer trains on local text and loads as a Redline tokenizer that grammars compile for."""
    from redline.benchmarks.bench_tokenizer import train
    from redline.grammar import GrammarCompiler, json_schema_lark, reply_grammar
    from redline.tokenizer import load_tokenizer

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "sample.md").write_text(tokenizer_sample_text, encoding="utf-8")
    size = train(tmp_path / "tok", 400, root=tmp_path / "text")
    tokenizer = load_tokenizer(tmp_path / "tok")
    assert tokenizer.vocab_size == size and tokenizer.decode(tokenizer.encode("def f(x):")).endswith("def f(x):")
    compiler = GrammarCompiler(tokenizer, 512)
    try:
        compiled = compiler.compile_now(reply_grammar(json_schema_lark(bench_serve.BENCH_SCHEMA), None))
        matcher = compiled.matcher()
        assert matcher.consume_tokens(tokenizer.encode('[{"id": 1, "name": "a"', add_special_tokens=False))
    finally:
        compiler.shutdown()


@pytest.mark.parametrize("multimodal_checkpoint", ["gemma3"], indirect=True)
def test_image_requests_beside_text_only_ones(multimodal_checkpoint, tmp_path):
    """--image-share: half the requests carry a picture (chat completions with an image_url part), against the
    server and offline; their TTFT is reported apart."""
    from redline.engine import Engine

    path = multimodal_checkpoint[-1]
    llm = LLM.load(path, device="cpu", compile=False)
    engine = Engine(llm)
    common = ["--num-prompts", "4", "--input-len", "6", "--output-len", "3", "--vocab-size", "290",
              "--image-share", "0.5", "--image-size", "64"]
    try:
        with ServerThread(create_app(engine, llm, ServeSettings(checkpoint_path=path))) as url:
            assert bench_serve.main(["--base-url", url, *common, "--json", str(tmp_path / "on.json")]) == 0
    finally:
        engine.shutdown()
    assert bench_serve.main(["--offline", "--checkpoint_path", str(path), "--device", "cpu", "--dtype", "float32",
                             *common, "--json", str(tmp_path / "off.json")]) == 0
    for name in ("on.json", "off.json"):
        run = json.loads((tmp_path / name).read_text())["runs"][0]
        assert run["completed"] == 4 and run["failed"] == 0 and run["output_tokens"] == 12
        assert run["ttft_image_ms"]["p50"] > 0 and run["ttft_text_ms"]["p50"] > 0
        assert run["prompt_tokens"] > 4 * 6 + 2 * 9  # the pictures' tokens count
