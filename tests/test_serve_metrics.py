"""serve_metrics: the /metrics page under vLLM's names for inference gateways (--gateway-metrics), read back by
prometheus-client's own parser."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from redline.engine import EngineStats
from redline.serve_metrics import Metrics, parse_metrics

GATEWAY_NAMES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc")


def stats(**overrides) -> EngineStats:
    values = dict(running=3, waiting=5, kv_pages_used=30, kv_pages_total=120, page_size=16, prefix_cache_queries=0,
                  prefix_cache_hits=0, prompt_tokens_total=0, generation_tokens_total=0, preemptions=0,
                  requests_finished=0)
    return EngineStats(**{**values, **overrides})


def gauges(page: str) -> dict[tuple[str, tuple], float]:
    """{(name, labels): value} of every sample, as prometheus-client parses the page."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(page) for s in family.samples}


def test_gateway_names_carry_the_engines_queue_and_kv_usage():
    page = Metrics().render(stats(), True, gateway_model='llama "3"')
    got = gauges(page)
    label = (("model_name", 'llama "3"'),)
    assert got["vllm:num_requests_waiting", label] == 5 and got["vllm:num_requests_running", label] == 3
    assert got["vllm:kv_cache_usage_perc", label] == got["vllm:gpu_cache_usage_perc", label] == 0.25
    assert got["redline_requests_waiting", ()] == 5  # Redline's own names stay
    for name in GATEWAY_NAMES:
        assert f"# TYPE {name} gauge" in page
    assert gauges(Metrics().render(stats(kv_pages_total=0, kv_pages_used=0), True, "m"))[
        "vllm:kv_cache_usage_perc", (("model_name", "m"),)] == 0.0


def test_gateway_names_only_behind_the_flag():
    assert not any(name in Metrics().render(stats(), True) for name in GATEWAY_NAMES)
    assert not any(name in Metrics().render(None, False, "m") for name in GATEWAY_NAMES)  # nothing before loading


@pytest.mark.parametrize("flag", [False, True])
def test_server_metrics_page_with_and_without_gateway_names(tiny_chat_checkpoint, flag):
    from paced_engine import PacedEngine
    from redline.generate import LLM
    from redline.serve import ServeSettings, create_app, parse_args
    from live_server import ServerThread

    model = ["--random-weights", "debug-tiny"]
    assert parse_args([*model, "--gateway-metrics"]).gateway_metrics and not parse_args(model).gateway_metrics
    llm = LLM.load(tiny_chat_checkpoint[0], device="cpu")
    settings = ServeSettings(checkpoint_path=tiny_chat_checkpoint[0], served_model_name="tiny", gateway_metrics=flag)
    with ServerThread(create_app(PacedEngine(llm), llm, settings)) as base:
        page = httpx.get(f"{base}/metrics").text
    samples = parse_metrics(page)
    assert ('vllm:num_requests_waiting{model_name="tiny"}' in samples) is flag
    if flag:
        total = samples["redline_kv_pages_total"]
        assert samples['vllm:kv_cache_usage_perc{model_name="tiny"}'] == samples["redline_kv_pages_used"] / total
        assert samples['vllm:num_requests_running{model_name="tiny"}'] == samples["redline_requests_running"]
