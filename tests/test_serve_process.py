"""serve.py as users run it: the HTTP front end in one process, the engine core in another, typed messages between
them. Each test starts the real server (`python -m redline.serve`) on a free loopback port."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import zmq

from redline.generate import LLM, GenerationOptions

READY_S = 240  # a cold start on a busy 2-core machine


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m redline.serve` with its log in a file; .core_pid is the engine core's process."""

    def __init__(self, checkpoint: Path, log: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self.log = open(log, "w")
        command = [sys.executable, "-m", "redline.serve", "--checkpoint_path", str(checkpoint), "--port",
                   str(self.port), "--device", "cpu", "--served-model-name", "tiny", *extra]
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the server was not ready in {READY_S} s:\n{self.log_path.read_text()}")

    @property
    def core_pid(self) -> int:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        (pid,) = [int(c) for c in children]
        return pid

    def core_config(self) -> dict:
        argv = Path(f"/proc/{self.core_pid}/cmdline").read_bytes().split(b"\0")
        return json.loads(argv[-2])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def server(tiny_chat_checkpoint, tmp_path_factory):
    srv = Server(tiny_chat_checkpoint[0], tmp_path_factory.mktemp("serve") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def llm(tiny_chat_checkpoint):
    return LLM.load(tiny_chat_checkpoint[0], device="cpu")


def pages_used(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("redline_kv_pages_used "):
            return float(line.split()[1])
    raise AssertionError("no redline_kv_pages_used in /metrics")


def test_64_concurrent_streams_give_generate_s_greedy_text(server, llm):
    prompts = [f"story {i}: the {'quick ' * (i % 5)}fox" for i in range(64)]
    want = [llm.generate(p, GenerationOptions(max_new_tokens=8)).text for p in prompts]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)

    async def one(prompt: str) -> str:
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def every() -> list[str]:
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    assert asyncio.run(every()) == want


def test_a_malformed_frame_is_refused_and_logged_and_the_core_serves_on(server):
    inbox = server.core_config()["inbox"]
    assert inbox.startswith("ipc://") and oct(os.stat(Path(inbox[6:]).parent).st_mode & 0o777) == "0o700"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(inbox)
    for frame in (b"\x93garbage", msgspec.msgpack.encode({"type": "CoreRequest", "request_id": 1}),
                  msgspec.msgpack.encode([1, 2, 3]), b""):
        sock.send(frame)
    sock.close(linger=1000)
    ctx.term()
    deadline = time.monotonic() + 30
    while server.log_path.read_text().count("refused a malformed frame") < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.log_path.read_text().count("refused a malformed frame") == 4
    reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "abc", "max_tokens": 3}, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1


def test_a_disconnected_stream_gives_its_pages_back(server):
    body = {"prompt": "the fox", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert pages_used(server.url) > 0
    deadline = time.monotonic() + 30
    while pages_used(server.url) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pages_used(server.url) == 0


def test_killing_the_core_gives_503_and_a_nonzero_exit_within_5_s(tiny_chat_checkpoint, tmp_path):
    srv = Server(tiny_chat_checkpoint[0], tmp_path / "server.log")
    try:
        srv.wait_ready()
        core = srv.core_pid
        body = {"prompt": "the fox", "max_tokens": 250, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            killed = time.monotonic()
            os.kill(core, signal.SIGKILL)
            rest = list(lines)  # the stream ends with an error event
        assert any('"error"' in line for line in rest)
        health = httpx.get(f"{srv.url}/health", timeout=5)
        assert health.status_code == 503 and time.monotonic() - killed < 5
        code = srv.proc.wait(timeout=10)
        assert code != 0 and time.monotonic() - killed < 5 + 1  # 5 s, and the poll's own second
        assert not Path(f"/proc/{core}").exists()
    finally:
        srv.stop()


def test_sigterm_drains_both_processes_and_exits_0(tiny_chat_checkpoint, tmp_path):
    srv = Server(tiny_chat_checkpoint[0], tmp_path / "server.log", "--min-step-s", "0.02")
    try:
        srv.wait_ready()
        core = srv.core_pid
        body = {"prompt": "the fox", "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            srv.proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        finish = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in rest
                  if line.startswith("data: {") and json.loads(line[6:])["choices"]]
        assert finish[-1] == "length"
        assert srv.proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while Path(f"/proc/{core}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{core}").exists()
    finally:
        srv.stop()


def test_the_core_process_follows_a_grammar(server):
    """A response_format's grammar travels to the engine core's process as its text; the core compiles it for the
    checkpoint's tokenizer (which it loads for grammars only) and masks the request's tokens."""
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    assert server.core_config()["model"]["tokenizer_path"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    for seed in range(3):
        reply = client.completions.create(model="tiny", prompt="JSON:", max_tokens=60, temperature=1.0, seed=seed,
                                          extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                              "name": "n", "schema": schema}}})
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].text), schema)


@pytest.mark.slow
@pytest.mark.parametrize("multimodal_checkpoint", ["qwen2_5_vl"], indirect=True)
def test_an_image_crosses_to_the_core_process(multimodal_checkpoint, tmp_path):
    """The image's bytes travel to the engine core's process as msgpack (engine/messages.py); the core decodes
    them, runs its own vision tower, and the reply is LLM.chat's with the same picture."""
    import base64
    import io

    from PIL import Image

    path = multimodal_checkpoint[-1]
    picture = io.BytesIO()
    Image.radial_gradient("L").convert("RGB").resize((90, 60)).save(picture, format="PNG")
    data = picture.getvalue()
    srv = Server(path, tmp_path / "server.log")
    try:
        srv.wait_ready()
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
        content = [{"type": "text", "text": "w17"}, {"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(data).decode()}}]
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                               max_tokens=6, temperature=0)
    finally:
        srv.stop()
    llm = LLM.load(path, device="cpu", compile=False)
    want = llm.chat([{"role": "user", "content": [{"type": "text", "text": "w17"}, {"type": "image", "image": data}]}],
                    max_new_tokens=6)
    assert reply.choices[0].message.content == want.text and want.text
    assert "vision tower: qwen2_5_vl" in (tmp_path / "server.log").read_text()
