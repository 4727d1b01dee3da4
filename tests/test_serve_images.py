"""Images through the server (serve_images.py, serve.py, serve_responses.py): chat completions' image_url parts and
the Responses API's input_image parts give LLM.chat's greedy reply with the same picture; hostile images, too many
of them, remote URLs (never to loopback, even on an allowed domain) and a model without a vision tower get 400s in
OpenAI's error shape, in bounded time, and the server serves on."""
from __future__ import annotations

import base64
import io
import struct
import time
import zlib

import httpx
import openai
import pytest

from live_server import ServerThread
from test_vision import PICTURES


def png_bytes(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bomb_png() -> bytes:
    """A valid PNG header declaring 30000 x 30000 pixels (2.7 GB decoded) over a few bytes of data."""
    header = png_chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + png_chunk(b"IDAT", zlib.compress(b"\0" * 64)) + png_chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def served(multimodal_checkpoint):
    from redline.engine import Engine
    from redline.generate import LLM
    from redline.serve import ServeSettings, create_app

    family, _, _, _, path = multimodal_checkpoint
    llm = LLM.load(path, device="cpu", compile=False)
    engine = Engine(llm, max_queue=64)
    settings = ServeSettings(checkpoint_path=path, served_model_name="mm", allowed_media_domains=("localhost",
                                                                                                  "127.0.0.1"))
    with ServerThread(create_app(engine, llm, settings)) as base:
        yield family, llm, base
    engine.shutdown()


def chat_parts(url: str) -> list[dict]:
    return [{"type": "text", "text": "w17 w45"}, {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "w60"}]


def test_an_image_url_part_gives_llm_chats_reply(served):
    family, llm, base = served
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    data = png_bytes(PICTURES[0])
    reply = client.chat.completions.create(model="mm", messages=[{"role": "user", "content": chat_parts(
        data_url(data))}], max_tokens=6, temperature=0)
    want = llm.chat([{"role": "user", "content": [{"type": "text", "text": "w17 w45"}, {"type": "image", "image": data},
                                                  {"type": "text", "text": "w60"}]}], max_new_tokens=6)
    assert reply.choices[0].message.content == want.text and want.text
    assert reply.usage.prompt_tokens == want.stats.prompt_tokens
    other = client.chat.completions.create(model="mm", messages=[{"role": "user", "content": chat_parts(
        data_url(png_bytes(PICTURES[1])))}], max_tokens=6, temperature=0)
    assert other.usage.prompt_tokens > 0  # another picture is served too
    response = client.responses.create(model="mm", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "w17 w45"}, {"type": "input_image", "image_url": data_url(data)},
        {"type": "input_text", "text": "w60"}]}], max_output_tokens=6, temperature=0)
    assert response.output_text == want.text


HOSTILE = [
    ("data:image/png;base64,@@not base64@@", "base64 is malformed"),
    (data_url(b"just some text, no picture at all"), "not an image"),
    (data_url(bomb_png()), "pixels"),
    (data_url(png_bytes(PICTURES[0])[:200]), "truncated or corrupt"),
    ("data:text/plain;base64,aGVsbG8=", "data URL must read"),
    ("file:///etc/passwd", "data: URL"),
    ("http://127.0.0.1:9/cat.png", "not a public address"),
    ("http://localhost:9/cat.png", "not a public address"),
    ("https://example.org/cat.png", "not among the server's --allowed-media-domains"),
]


@pytest.mark.parametrize("url, message", HOSTILE)
def test_hostile_images_get_400_and_the_server_serves_on(served, url, message):
    _, _, base = served
    begin = time.monotonic()
    r = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
        "model": "mm", "messages": [{"role": "user", "content": chat_parts(url)}], "max_tokens": 2})
    assert time.monotonic() - begin < 10
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error" and error["param"] == "messages"
    plain = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
        "model": "mm", "messages": [{"role": "user", "content": "w17 w45"}], "max_tokens": 2})
    assert plain.status_code == 200


def test_too_many_images_get_400(served):
    _, _, base = served
    parts = [{"type": "image_url", "image_url": {"url": data_url(png_bytes(PICTURES[0]))}}] * 9
    r = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
        "model": "mm", "messages": [{"role": "user", "content": parts}], "max_tokens": 2})
    assert r.status_code == 400 and "more than the 8 allowed" in r.json()["error"]["message"]


def test_remote_urls_are_refused_without_allowed_domains():
    from redline.serve_images import MediaSettings, load_images

    with pytest.raises(ValueError, match="fetches no remote images"):
        load_images(["http://127.0.0.1/cat.png"], MediaSettings())
    assert MediaSettings(("example.com",)).allows("cdn.example.com")
    assert not MediaSettings(("example.com",)).allows("badexample.com")


def test_the_flag_reaches_the_media_settings(tiny_chat_checkpoint):
    from redline.serve import parse_args

    settings = parse_args(["--checkpoint_path", str(tiny_chat_checkpoint[0]), "--allowed-media-domains",
                           "example.com,cdn.example.org"])
    assert settings.media.allowed_domains == ("example.com", "cdn.example.org")
    with pytest.raises(ValueError, match="--allowed-media-domains takes host names"):
        parse_args(["--checkpoint_path", str(tiny_chat_checkpoint[0]), "--allowed-media-domains", "http://x.org/"])


def test_a_model_without_a_vision_tower_refuses_images(tiny_chat_checkpoint):
    from redline.engine import Engine
    from redline.generate import LLM
    from redline.serve import ServeSettings, create_app

    llm = LLM.load(tiny_chat_checkpoint[0], device="cpu")
    engine = Engine(llm)
    settings = ServeSettings(checkpoint_path=tiny_chat_checkpoint[0], served_model_name="tiny")
    try:
        with ServerThread(create_app(engine, llm, settings)) as base:
            r = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
                "model": "tiny", "messages": [{"role": "user", "content": chat_parts(data_url(png_bytes(
                    PICTURES[0])))}], "max_tokens": 2})
    finally:
        engine.shutdown()
    assert r.status_code == 400 and "no vision tower" in r.json()["error"]["message"]
