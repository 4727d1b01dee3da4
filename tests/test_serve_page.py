"""The chat page (static/chat.html) in a real headless Chromium driven by Selenium, against a live server.

Needs Debian's `chromium` and `chromium-driver`; without them the tests skip, except in CI (CI=true), where they fail.
"""
from __future__ import annotations

import os
import re
import shutil
import time

import httpx
import pytest

from redline.generate import LLM
from redline.serve import ServeSettings, create_app
from redline.serve_metrics import parse_metrics
from paced_engine import PacedEngine
from live_server import ServerThread


def browser_paths() -> tuple[str, str] | None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


@pytest.fixture(scope="module")
def browser():
    paths = browser_paths()
    if paths is None:
        message = "the page test needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=paths[1]))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def served(tiny_chat_checkpoint):
    llm = LLM.load(tiny_chat_checkpoint[0], device="cpu")
    engine = PacedEngine(llm)
    settings = ServeSettings(checkpoint_path=tiny_chat_checkpoint[0], served_model_name="tiny")
    with ServerThread(create_app(engine, llm, settings)) as url:
        yield url, llm, engine


def aborted(url: str) -> float:
    return parse_metrics(httpx.get(f"{url}/metrics").text)["redline_requests_aborted_total"]


def wait_for(condition, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("the page did not get there in time")


def set_field(browser, element_id: str, value: str) -> None:
    field = browser.find_element("id", element_id)
    field.clear()
    field.send_keys(value)


def open_page(browser, url: str, temperature: str, max_tokens: str) -> None:
    browser.get(url + "/")
    wait_for(lambda: browser.find_element("id", "status").text == "model: tiny")
    set_field(browser, "temperature", temperature)
    set_field(browser, "max-tokens", max_tokens)


def send(browser, text: str) -> None:
    set_field(browser, "input", text)
    browser.find_element("id", "send").click()


def test_a_message_gets_the_streamed_greedy_reply(browser, served):
    url, llm, _ = served
    open_page(browser, url, "0", "12")
    set_field(browser, "system", "Be brief.")
    send(browser, "The quick brown fox")
    reply = wait_for(lambda: browser.find_elements("css selector", ".msg.assistant.done"))[-1]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]
    expected = llm.generate(llm.chat_prompt(messages), max_new_tokens=12, temperature=0.0)
    assert reply.find_element("css selector", ".text").text == expected.text.strip()
    stats = reply.find_element("css selector", ".stats").text
    assert f"{len(expected.token_ids)} tokens" in stats and "tok/s" in stats
    assert [m.text for m in browser.find_elements("css selector", ".msg.user")] == ["The quick brown fox"]


def test_a_reply_that_arrives_at_once_shows_its_whole_rate(browser, served):
    url, _, _ = served
    open_page(browser, url, "0", "1")  # one token: the first piece is the last, so no span after it to time
    send(browser, "hello")
    reply = wait_for(lambda: browser.find_elements("css selector", ".msg.assistant.done"))[-1]
    assert re.search(r"^1 tokens, [0-9.]+ tok/s \(whole reply\), first token \d+ ms \(length\)$",
                     reply.find_element("css selector", ".stats").text)


def test_stop_ends_a_reply_midway(browser, served):
    url, llm, engine = served
    # Greedy, so the reply is known to run long (a sampled one may end at once, before the page shows it streaming).
    messages = [{"role": "user", "content": "Tell me a long story"}]
    assert len(llm.generate(llm.chat_prompt(messages), max_new_tokens=100, temperature=0.0).token_ids) == 100
    open_page(browser, url, "0", "200")  # the tiny model's context is 256 tokens
    engine.piece_delay_s = 0.05
    before = aborted(url)
    try:
        send(browser, "Tell me a long story")
        streaming = wait_for(lambda: browser.find_elements("css selector", ".msg.assistant.streaming"))[-1]
        wait_for(lambda: len(streaming.find_element("css selector", ".text").text) > 5)
        assert not browser.find_element("id", "stop").get_attribute("disabled")
        browser.find_element("id", "stop").click()
        wait_for(lambda: "done" in streaming.get_attribute("class"))
        wait_for(lambda: aborted(url) == before + 1)  # the server aborted the request when the page hung up
    finally:
        engine.piece_delay_s = 0.0
    assert "(stopped)" in streaming.find_element("css selector", ".stats").text
    assert browser.find_element("id", "stop").get_attribute("disabled")
    assert not browser.find_element("id", "send").get_attribute("disabled")


def test_a_refused_request_shows_the_servers_error(browser, served):
    url, _, _ = served
    open_page(browser, url, "5", "8")  # temperature 5 is out of range
    send(browser, "hello")
    reply = wait_for(lambda: browser.find_elements("css selector", ".msg.assistant.error.done"))[-1]
    assert "error: invalid value for 'temperature'" in reply.text
    assert not browser.find_element("id", "send").get_attribute("disabled")


@pytest.fixture(scope="module")
def served_gemma(multimodal_checkpoint):
    from redline.engine import Engine

    family, _, _, _, path = multimodal_checkpoint
    llm = LLM.load(path, device="cpu", compile=False)
    engine = Engine(llm)
    settings = ServeSettings(checkpoint_path=path, served_model_name="tiny")
    with ServerThread(create_app(engine, llm, settings)) as url:
        yield url, llm
    engine.shutdown()


@pytest.mark.parametrize("multimodal_checkpoint", ["gemma3"], indirect=True)
def test_an_attached_picture_gets_llm_chats_reply(browser, served_gemma, tmp_path):
    """The picture button attaches a PNG (read by the page as a data: URL, sent as an image_url part before the
    text); the streamed greedy reply is LLM.chat's with the same picture."""
    import numpy as np
    from PIL import Image

    url, llm = served_gemma
    rng = np.random.default_rng(3)
    path = tmp_path / "picture.png"
    Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(path)
    open_page(browser, url, "0", "8")
    browser.find_element("id", "image-file").send_keys(str(path))
    wait_for(lambda: browser.find_element("id", "attached").is_displayed())
    send(browser, "w17 w45")
    reply = wait_for(lambda: browser.find_elements("css selector", ".msg.assistant.done"))[-1]
    content = [{"type": "image", "image": path.read_bytes()}, {"type": "text", "text": "w17 w45"}]
    expected = llm.chat([{"role": "user", "content": content}], max_new_tokens=8, temperature=0.0)
    assert "error" not in reply.get_attribute("class")
    assert reply.find_element("css selector", ".text").text == expected.text.strip() and expected.text.strip()
    assert browser.find_elements("css selector", ".msg.user img")  # the picture is shown in the conversation
    assert not browser.find_element("id", "attached").is_displayed()  # and no longer attached
