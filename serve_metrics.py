"""The server's /metrics page in the Prometheus text format (version 0.0.4), written out by hand: the engine's gauges
and counters, the API's request counts, and TTFT / inter-token latency histograms."""
from __future__ import annotations

import math
import threading
from collections import Counter
from typing import Any

# Seconds; the last bucket (+Inf) is implied.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]
        return out


# (name, type, help, EngineStats field or None for derived)
ENGINE_METRICS = (
    ("redline_requests_running", "gauge", "Requests the engine is running.", "running"),
    ("redline_requests_waiting", "gauge", "Requests waiting for the engine.", "waiting"),
    ("redline_kv_pages_used", "gauge", "KV cache pages in use.", "kv_pages_used"),
    ("redline_kv_pages_total", "gauge", "KV cache pages in the pool.", "kv_pages_total"),
    ("redline_kv_page_size_tokens", "gauge", "Tokens per KV cache page.", "page_size"),
    ("redline_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("redline_prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache.", "prefix_cache_hits"),
    ("redline_prompt_tokens_total", "counter", "Prompt tokens prefilled.", "prompt_tokens_total"),
    ("redline_generation_tokens_total", "counter", "Tokens generated.", "generation_tokens_total"),
    ("redline_preemptions_total", "counter", "Requests preempted to free KV pages.", "preemptions"),
    ("redline_requests_finished_total", "counter", "Requests the engine finished.", "requests_finished"),
)


# The names vLLM gives the gauges that Kubernetes inference gateways route on (the Gateway API Inference Extension's
# endpoint picker, llm-d): (name, help, the value from EngineStats). Both KV names: newer pickers read
# kv_cache_usage_perc, older ones gpu_cache_usage_perc; each is a fraction (1 = full) despite "perc".
GATEWAY_METRICS = (
    ("vllm:num_requests_waiting", "Requests waiting for the engine.", lambda stats: stats.waiting),
    ("vllm:num_requests_running", "Requests the engine is running.", lambda stats: stats.running),
    ("vllm:kv_cache_usage_perc", "KV cache usage; 1 means full.", lambda stats: kv_usage(stats)),
    ("vllm:gpu_cache_usage_perc", "KV cache usage; 1 means full.", lambda stats: kv_usage(stats)),
)


def kv_usage(stats: Any) -> float:
    """The share of the KV page pool in use, 0 to 1."""
    return stats.kv_pages_used / stats.kv_pages_total if stats.kv_pages_total else 0.0


def label_value(text: str) -> str:
    """text as a Prometheus label value (backslash, quote and newline escaped)."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """Thread-safe: the event loop records, a scrape renders."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> count
        self.aborted = 0  # requests aborted because their client went away

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[endpoint, status] += 1

    def count_abort(self) -> None:
        with self._lock:
            self.aborted += 1

    def render(self, stats: Any | None, loaded: bool, gateway_model: str | None = None) -> str:
        """The page; with gateway_model (the served model's name), also GATEWAY_METRICS labelled with it."""
        lines = [*header("redline_model_loaded", "gauge", "1 once the model is loaded and serving."),
                 f"redline_model_loaded {int(loaded)}"]
        if stats is not None and gateway_model is not None:
            label = f'{{model_name="{label_value(gateway_model)}"}}'
            for name, help_text, value in GATEWAY_METRICS:
                lines += [*header(name, "gauge", help_text), f"{name}{label} {value(stats)!r}"]
        if stats is not None:
            for name, kind, help_text, field in ENGINE_METRICS:
                lines += [*header(name, kind, help_text), f"{name} {getattr(stats, field)}"]
            queries = stats.prefix_cache_queries
            rate = stats.prefix_cache_hits / queries if queries else 0.0
            lines += [*header("redline_prefix_cache_hit_rate", "gauge",
                              "Share of prompt tokens served from the prefix cache."),
                      f"redline_prefix_cache_hit_rate {rate!r}"]
        with self._lock:
            lines += header("redline_api_requests_total", "counter", "API requests by endpoint and HTTP status.")
            lines += [f'redline_api_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                      for (e, s), n in sorted(self.requests.items())]
            lines += [*header("redline_requests_aborted_total", "counter",
                              "Requests aborted because the client disconnected."),
                      f"redline_requests_aborted_total {self.aborted}"]
            lines += header("redline_time_to_first_token_seconds", "histogram",
                            "Time from a request's arrival to its first generated text.")
            lines += self.ttft.lines("redline_time_to_first_token_seconds")
            lines += header("redline_inter_token_latency_seconds", "histogram",
                            "Time between successive streamed pieces of a request.")
            lines += self.itl.lines("redline_inter_token_latency_seconds")
        return "\n".join(lines) + "\n"


def header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def parse_metrics(text: str) -> dict[str, float]:
    """The samples of a /metrics page as {name{labels}: value} (for tests and the benchmark)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = math.inf if value == "+Inf" else float(value)
    return out
