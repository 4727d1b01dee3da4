"""serve.py against a live server on a free loopback port, driven through the official `openai` package and raw
HTTP. The engine is redline.engine.Engine, paced for the tests that hang up mid-stream (tests/paced_engine.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from redline.engine import Engine
from redline.generate import LLM
from redline.serve import ServeSettings, create_app
from redline.serve_metrics import parse_metrics
from paced_engine import PacedEngine
from live_server import ServerThread

KEY = "sk-test-key"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "The quick brown fox"}]
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def llm(tiny_chat_checkpoint):
    return LLM.load(tiny_chat_checkpoint[0], device="cpu")


@pytest.fixture(scope="module")
def engine(llm):
    return PacedEngine(llm, max_queue=256)


@pytest.fixture(scope="module")
def url(tiny_chat_checkpoint, llm, engine):
    settings = ServeSettings(checkpoint_path=tiny_chat_checkpoint[0], served_model_name="tiny", api_key=KEY,
                             max_body_bytes=64 * 1024)
    with ServerThread(create_app(engine, llm, settings)) as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def metrics(url) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics").text)


def greedy(llm, prompt, n: int, **settings):
    return llm.generate(prompt, max_new_tokens=n, temperature=0.0, **settings)


def test_greedy_chat_equals_llm_generate(client, llm):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=12)
    ids = llm.chat_prompt(MESSAGES)
    expected = greedy(llm, ids, 12)
    assert reply.choices[0].message.content == expected.text and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[expected.finish_reason]
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0 and reply.model == "tiny"


@pytest.mark.parametrize("prompt", ["def fibonacci(n):", [1, 40, 41, 42, 99]])
def test_greedy_completion_equals_llm_generate(client, llm, prompt):
    reply = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=10,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].text == greedy(llm, prompt, 10, ignore_eos=True).text
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 10


def test_completion_stop_string_ends_with_stop(client, llm):
    full = greedy(llm, "The quick", 12, ignore_eos=True).text
    stop = full.strip()[3:6]
    reply = client.completions.create(model="tiny", prompt="The quick", temperature=0, max_tokens=12,
                                      extra_body={"ignore_eos": True}, stop=[stop])
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].text == full[:full.index(stop)]


def test_prompt_list_and_echo(client, llm):
    reply = client.completions.create(model="tiny", prompt=["abc", "def"], temperature=0, max_tokens=4,
                                      extra_body={"ignore_eos": True}, echo=True)
    assert [c.text for c in reply.choices] == [p + greedy(llm, p, 4, ignore_eos=True).text for p in ("abc", "def")]


def test_streamed_pieces_join_to_the_whole_text(client):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=16)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=16,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    pieces = client.completions.create(model="tiny", prompt="abc", temperature=0, max_tokens=9, stream=True)
    assert "".join(c.choices[0].text for c in pieces) == client.completions.create(
        model="tiny", prompt="abc", temperature=0, max_tokens=9).choices[0].text


def test_event_stream_ends_with_done(url):
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth()) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert "usage" not in json.loads(lines[-2][6:])  # no usage chunk unless asked


def test_n3_with_a_seed_repeats(client, llm):
    def ask():
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, max_tokens=10,
                                               n=3, seed=11)
        return [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)]

    first = ask()
    assert first == ask() and len(set(first)) > 1
    ids = llm.chat_prompt(MESSAGES)
    assert first == [llm.generate(ids, max_new_tokens=10, temperature=1.0, seed=11 + i).text for i in range(3)]


def test_32_concurrent_streams_each_get_their_own_answer(client, llm):
    prompts = [[1, 10 + i, 200 + i, 7] for i in range(32)]
    expected = [greedy(llm, p, 6, ignore_eos=True).text for p in prompts]

    def one(prompt):
        stream = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=6,
                                           extra_body={"ignore_eos": True}, stream=True)
        return "".join(c.choices[0].text for c in stream)

    start = time.monotonic()
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, prompts))
    assert got == expected and time.monotonic() - start < 120


def test_a_disconnected_stream_is_aborted_and_its_pages_return(url, engine):
    before = metrics(url)["redline_requests_aborted_total"]
    engine.piece_delay_s = 0.05
    try:
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth()) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            deadline = time.monotonic() + 10
            while metrics(url)["redline_kv_pages_used"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert metrics(url)["redline_kv_pages_used"] > 0  # it runs and holds pages
        deadline = time.monotonic() + 10
        while metrics(url)["redline_kv_pages_used"] and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        engine.piece_delay_s = 0.0
    after = metrics(url)
    assert after["redline_kv_pages_used"] == 0 and after["redline_requests_running"] == 0
    assert after["redline_requests_aborted_total"] == before + 1


BAD = {"model": "tiny", "messages": MESSAGES}


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/v1/chat/completions", {**BAD, "logit_bias": {"100000": 1}}, 400, "logit_bias", None),  # past the vocabulary
    ("/v1/chat/completions", {**BAD, "logit_bias": {"5": 101}}, 400, "logit_bias", None),
    ("/v1/chat/completions", {**BAD, "logit_bias": {"five": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logit_bias": {"100000": -1}}, 400, "logit_bias", None),
    ("/v1/chat/completions", {**BAD, "presence_penalty": -2.5}, 400, "presence_penalty", "invalid_value"),
    ("/v1/chat/completions", {**BAD, "repetition_penalty": 0}, 400, "repetition_penalty", "invalid_value"),
    ("/v1/chat/completions", {**BAD, "min_p": 1.5}, 400, "min_p", "invalid_value"),
    ("/v1/chat/completions", {**BAD, "min_tokens": -1}, 400, "min_tokens", "invalid_value"),
    ("/v1/chat/completions", {**BAD, "max_tokens": 4, "min_tokens": 9}, 400, "min_tokens", None),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "stop_token_ids": [100000]}, 400, "stop_token_ids", None),
    ("/v1/chat/completions", {**BAD, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools",
     None),  # the tiny template names no tool-call format
    ("/v1/chat/completions", {**BAD, "tool_choice": "required"}, 400, "tool_choice", None),
    ("/v1/chat/completions", {**BAD, "frequency_penalty": 2.5}, 400, "frequency_penalty", "invalid_value"),
    ("/v1/chat/completions", {**BAD, "temperature": "hot"}, 400, "temperature", "invalid_value"),
    ("/v1/chat/completions", {**BAD, "max_tokens": True}, 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {**BAD, "top_p": 1.5}, 400, "top_p", "invalid_value"),
    ("/v1/chat/completions", {**BAD, "n": 0}, 400, "n", "invalid_value"),
    ("/v1/chat/completions", {**BAD, "seed": -1}, 400, "seed", "invalid_value"),
    ("/v1/chat/completions", {**BAD, "top_logprobs": 2}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {**BAD, "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages", "missing_required_parameter"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 2000}]}, 400,
     "messages", "context_length_exceeded"),
    ("/v1/completions", {"model": "tiny", "prompt": list(range(3, 303))}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, 100000]}, 400, "prompt", None),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "suffix": "b"}, 400, "suffix", "unsupported_parameter"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model", "model_not_found"),
    ("/v1/embeddings", {"model": "tiny", "input": "a"}, 404, None, "not_found"),
    ("/v1/completions", {"model": "tiny", "prompt": "a" * 70000}, 413, None, "request_too_large"),
])
def test_errors_have_their_status_and_openai_shape(url, path, body, status, param, code):
    r = httpx.post(f"{url}{path}", json=body, headers=auth())
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["code"] == code


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", "{\"prompt\": \"\\ud800\"}".encode()])
def test_malformed_bodies_get_400(url, content):
    r = httpx.post(f"{url}/v1/completions", content=content, headers={**auth(), "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_a_missing_or_wrong_api_key_gets_401(url, headers):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "a"}, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/health").status_code == 200  # health and metrics need no key


def test_a_full_queue_gets_429(url, engine):
    engine.max_queue = 0
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2}, headers=auth())
    finally:
        engine.max_queue = 256
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"]


def test_the_server_survives_bad_requests(client, url):
    for body in ({"prompt": {"a": 1}}, {"prompt": [[1, 2], "x"]}, {"prompt": "a", "stop": [""]}, {"prompt": None},
                 {"prompt": []}, {"prompt": [[]]}, {"prompt": [""]}, {"prompt": [[1, 2], [-1]]},
                 {"prompt": "a", "n": 17}, {"prompt": "a", "seed": 2**63}, {"prompt": "a", "seed": 2**63 - 1, "n": 2},
                 {"prompt": "a", "top_k": 1.5}, {"prompt": json.loads("[" * 200 + "]" * 200)}):
        assert httpx.post(f"{url}/v1/completions", json=body, headers=auth()).status_code == 400
    assert client.completions.create(model="tiny", prompt="a", max_tokens=2).choices[0].text is not None


def test_chat_logprobs_are_log_softmax_of_fp32_logits(client, llm, tiny_chat_checkpoint):
    hf_model = tiny_chat_checkpoint[1]
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=6,
                                           logprobs=True, top_logprobs=3)
    ids = llm.chat_prompt(MESSAGES)
    new = greedy(llm, ids, 6).token_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + new])).logits[0].float()  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)[len(ids) - 1:len(ids) + len(new) - 1]  # (N, V)
    content = reply.choices[0].logprobs.content
    assert len(content) == len(new)
    for row, token, entry in zip(logp, new, content):
        assert abs(entry.logprob - row[token].item()) < 1e-4
        assert [round(a.logprob, 4) for a in entry.top_logprobs] == [round(v, 4) for v in row.topk(3).values.tolist()]
    assert "".join(e.token for e in content) == reply.choices[0].message.content


def test_completion_echo_logprobs_score_the_prompt(client, llm, tiny_chat_checkpoint):
    hf_model = tiny_chat_checkpoint[1]
    reply = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=0, echo=True,
                                      logprobs=1)
    ids = llm.encode_prompt("The quick brown fox")
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)  # (T, V)
    lp = reply.choices[0].logprobs
    assert reply.choices[0].text == "The quick brown fox" and lp.token_logprobs[0] is None
    expected = [logp[i - 1, t].item() for i, t in enumerate(ids) if i > 0]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], expected)) < 1e-4
    assert reply.usage.completion_tokens == 0 and "".join(lp.tokens).strip() == "The quick brown fox"


def test_models_tokenize_detokenize_and_metrics(client, url, llm):
    assert [m.id for m in client.models.list()] == ["tiny"]
    r = httpx.post(f"{url}/tokenize", json={"prompt": "hello world"}, headers=auth()).json()
    assert r["tokens"] == llm.tokenizer.encode("hello world") and r["count"] == len(r["tokens"])
    chat = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}, headers=auth()).json()
    assert chat["tokens"] == llm.chat_prompt(MESSAGES)
    back = httpx.post(f"{url}/detokenize", json={"tokens": r["tokens"]}, headers=auth()).json()
    assert back["prompt"] == llm.tokenizer.decode(r["tokens"])
    page = httpx.get(f"{url}/metrics")
    assert page.headers["content-type"].startswith("text/plain; version=0.0.4")
    for name in ("redline_requests_running", "redline_requests_waiting", "redline_kv_pages_used",
                 "redline_prefix_cache_hit_rate", "redline_prompt_tokens_total", "redline_generation_tokens_total",
                 "redline_time_to_first_token_seconds_count", "redline_inter_token_latency_seconds_count"):
        assert f"# TYPE {name.removesuffix('_count')} " in page.text and name in parse_metrics(page.text)
    assert parse_metrics(page.text)['redline_api_requests_total{endpoint="models",status="200"}'] >= 1


def test_health_is_503_until_the_model_has_loaded(tiny_chat_checkpoint, llm):
    release = threading.Event()

    def start(state):
        def load():
            release.wait(30)
            state.prompts, state.engine = llm, PacedEngine(llm)
        threading.Thread(target=load, daemon=True).start()

    settings = ServeSettings(checkpoint_path=tiny_chat_checkpoint[0])
    with ServerThread(create_app(None, None, settings, start)) as base:
        assert httpx.get(f"{base}/health").status_code == 503
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "a"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
        release.set()
        deadline = time.monotonic() + 30
        while httpx.get(f"{base}/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


@pytest.fixture(scope="module")
def smollm2_served(smollm2_checkpoint):
    llm = LLM.load(smollm2_checkpoint, device="cpu", dtype="float32")
    settings = ServeSettings(checkpoint_path=smollm2_checkpoint, served_model_name="smollm2")
    with ServerThread(create_app(PacedEngine(llm), llm, settings)) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300), llm


@pytest.mark.real_model
def test_smollm2_through_the_server(smollm2_served, smollm2_hf):
    client, llm = smollm2_served
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=24,
                                           logprobs=True)
    ids = llm.chat_prompt(messages)
    expected = greedy(llm, ids, 24)
    assert reply.choices[0].message.content == expected.text and "Paris" in expected.text
    stream = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=24,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.text
    with torch.no_grad():
        logits = smollm2_hf[1](torch.tensor([ids + expected.token_ids])).logits[0].float()  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)[len(ids) - 1:-1]  # (N, V)
    got = [e.logprob for e in reply.choices[0].logprobs.content]
    want = [row[t].item() for row, t in zip(logp, expected.token_ids)]
    assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < 1e-3


def test_a_client_that_hangs_up_on_a_plain_request_aborts_it(url, engine):
    before = metrics(url)["redline_requests_aborted_total"]
    engine.piece_delay_s = 0.05
    try:
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 200, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, headers=auth(), timeout=0.5)
        deadline = time.monotonic() + 10
        while metrics(url)["redline_requests_aborted_total"] == before and time.monotonic() < deadline:
            time.sleep(0.05)
        while metrics(url)["redline_requests_running"] and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        engine.piece_delay_s = 0.0
    after = metrics(url)
    assert after["redline_requests_aborted_total"] == before + 1 and after["redline_kv_pages_used"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint_path", "/nonexistent/model.safetensors"], "does not exist"),
    ([], "exactly one of"),
    (["--random-weights", "Llama-3-8B", "--port", "70000"], "--port"),
    (["--random-weights", "Llama-3-8B", "--max-queue", "0"], "--max-queue"),
    (["--random-weights", "Llama-3-8B", "--api-key", ""], "--api-key"),
    (["--random-weights", "Llama-3-8B", "--device", "tpu"], "--device"),
    (["--random-weights", "Llama-9"], "unknown model name"),
])
def test_cli_errors_are_one_line(argv, message, capsys):
    from redline.serve import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_threads_flag_reaches_the_cores_model_source():
    from redline.runner.load import load_runner
    from redline.serve import parse_args

    settings = parse_args(["--random-weights", "debug-tiny", "--device", "cpu", "--dtype", "float32", "--threads", "3"])
    source = settings.model_source(None)
    assert source.threads == 3 and parse_args(["--random-weights", "debug-tiny"]).model_source(None).threads is None
    from redline.kernels.cpu_linear import cpu_ops

    cpu_ops()
    before = torch.get_num_threads(), torch.ops.redline_cpu.threads()
    try:
        load_runner(source, lambda message: None)
        assert torch.ops.redline_cpu.threads() == 3 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before[0])
        torch.ops.redline_cpu.set_threads(before[1])


def test_prefill_graphs_flag_reaches_the_engine():
    from redline.serve import parse_args

    settings = parse_args(["--random-weights", "debug-tiny", "--device", "cpu", "--dtype", "float32",
                           "--compile-prefill", "--prefill-graphs", "--max-kv-tokens", "2048"])
    assert settings.engine.prefill_graphs and not parse_args(["--random-weights", "debug-tiny"]).engine.prefill_graphs
    engine = Engine(random_llm(), settings.engine)
    engine.warm_up()  # prefills one-chunk steps through the prefill graphs
    assert engine.paged.prefill_graphs is not None and settings.engine.max_kv_tokens == 2048
    engine.shutdown()


def random_llm():
    from redline.runner.load import random_model

    return LLM(random_model("debug-tiny", torch.device("cpu"), "float32", None, lambda line: None), None, "cpu",
               compile=False)


def test_random_weights_serve_token_ids_without_a_tokenizer():
    settings = ServeSettings(random_weights="debug-tiny", device="cpu", dtype="float32")
    llm = random_llm()
    assert llm.tokenizer is None and settings.model_name == "debug-tiny"
    with ServerThread(create_app(PacedEngine(llm), llm, settings)) as base:
        body = {"model": "debug-tiny", "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{base}/v1/completions", json=body).json()
        assert reply["usage"]["completion_tokens"] == 6 and reply["choices"][0]["finish_reason"] == "length"
        chat = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and "tokenizer" in chat.json()["error"]["message"]
        assert httpx.post(f"{base}/v1/completions", json={**body, "prompt": "text"}).status_code == 400


@pytest.mark.slow
def test_tensor_parallel_server_gives_one_process_text(tiny_chat_checkpoint):
    """serve.py --tensor-parallel 2: the engine core is rank 0 of two (gloo on the CPU) and starts rank 1 beside it;
    every rank runs each engine step on its heads. Greedy replies equal one process's; SIGTERM stops all cleanly."""
    from tests.test_tensor_parallel import free_port, launch_env

    port = free_port()
    command = [sys.executable, str(TESTS.parent / "serve.py"), "--tensor-parallel", "2", "--checkpoint_path",
               str(tiny_chat_checkpoint[0]), "--device", "cpu", "--port", str(port), "--served-model-name", "tiny",
               "--shutdown-grace", "1", "--compile-cache", "none"]
    proc = subprocess.Popen(command, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    llm = LLM.load(tiny_chat_checkpoint[0], device="cpu")
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        prompts = ["The quick brown fox", "Once upon a time", "abc"]
        with ThreadPoolExecutor(3) as pool:  # batched together in the engine
            replies = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=12,
                                                                        temperature=0), prompts))
        for prompt, reply in zip(prompts, replies):
            assert reply.choices[0].text == llm.generate(prompt, max_new_tokens=12, temperature=0).text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        output = proc.communicate()[0]
    assert proc.returncode == 0 and "Traceback" not in output, output[-3000:]
    assert "rank 1:" in output  # the second rank loaded its part


def test_sampling_parameters_are_accepted_and_applied(client, llm):
    """OpenAI's penalties and logit_bias, and vLLM's extras as top-level body fields, reach the engine's sampler:
    each reply equals LLM.generate's with the same settings and differs from the plain reply."""
    ids = llm.chat_prompt(MESSAGES)
    plain = greedy(llm, ids, 12, ignore_eos=True)
    for fields in ({"presence_penalty": 1.5, "frequency_penalty": 1.0}, {"logit_bias": {"7": 6.0, "9": -100}},
                   {"repetition_penalty": 3.0}):
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=12,
                                               **{k: v for k, v in fields.items() if k != "repetition_penalty"},
                                               extra_body={"ignore_eos": True, **{k: v for k, v in fields.items()
                                                                                  if k == "repetition_penalty"}})
        settings = {k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in fields.items()}
        want = greedy(llm, ids, 12, ignore_eos=True, **settings)
        assert want.token_ids != plain.token_ids
        assert reply.choices[0].message.content == want.text
    hot = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.5, seed=2, max_tokens=12,
                                         extra_body={"ignore_eos": True, "min_p": 1.0})
    assert hot.choices[0].message.content == plain.text  # min_p=1 keeps only the most likely token


def test_forced_tokens_min_tokens_stop_token_ids_and_special_tokens(client, llm):
    """logit_bias forcing a token; min_tokens holding off an EOS the bias forces; a stop token id ending the reply
    (its text kept with include_stop_str_in_output); a special token's text only with skip_special_tokens=false."""
    word, eos, special = llm.encode_prompt("fox")[-1], llm.tokenizer.eos_ids[0], llm.tokenizer.bos_id
    assert special in llm.tokenizer.special_ids and word not in llm.tokenizer.special_ids
    forced = client.completions.create(model="tiny", prompt="abc", temperature=0, max_tokens=4,
                                       logit_bias={str(word): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == llm.tokenizer.decode([word] * 4)
    early = client.completions.create(model="tiny", prompt="abc", temperature=0, max_tokens=10,
                                      logit_bias={str(eos): 100})
    assert early.usage.completion_tokens == 0 and early.choices[0].finish_reason == "stop"
    held = client.completions.create(model="tiny", prompt="abc", temperature=0, max_tokens=10,
                                     logit_bias={str(eos): 100}, extra_body={"min_tokens": 6})
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    body = {"logit_bias": {str(word): 100}, "extra_body": {"ignore_eos": True, "stop_token_ids": [word]}}
    stopped = client.completions.create(model="tiny", prompt="abc", temperature=0, max_tokens=5, **body)
    assert stopped.choices[0].text == "" and stopped.choices[0].finish_reason == "stop"
    body["extra_body"]["include_stop_str_in_output"] = True
    kept = client.completions.create(model="tiny", prompt="abc", temperature=0, max_tokens=5, **body)
    assert kept.choices[0].text == llm.tokenizer.decode([word]) and kept.choices[0].finish_reason == "stop"
    for skip, text in ((None, ""), (False, llm.tokenizer.decode([special] * 3))):
        extra = {"ignore_eos": True} | ({} if skip is None else {"skip_special_tokens": skip})
        reply = client.completions.create(model="tiny", prompt="abc", temperature=0, max_tokens=3,
                                          logit_bias={str(special): 100}, extra_body=extra)
        assert reply.choices[0].text == text and reply.usage.completion_tokens == 3
