"""A load generator for serve.py (as `vllm bench serve` is for vLLM): N streamed completions of random token ids, sent
all at once or at a fixed rate with Poisson arrivals, timed on the client.

    python serve.py --random-weights Llama-3-8B --dtype bfloat16 &
    python benchmarks/bench_serve.py --num-prompts 64 --input-len 512 --output-len 256 --json out.json
    python benchmarks/bench_serve.py --request-rate 2,8,32 --num-prompts 1000 --input-len 100:1024 \\
        --output-len 256 --json sweep.json --plot sweep.png

With --json-schema every request carries a response_format (the server then masks every output token with its
grammar), to compare with the same run without it. With --image-share F a share F of the requests carry one random
--image-size picture each (a chat completion with an image_url data URL part before the prompt's text, against a
server of a multimodal checkpoint); their TTFT is reported apart from the text-only requests'. Offline,
--vision-model runs a published multimodal shape with random weights (benchmarks/bench_vision.py), tower included:

    python benchmarks/bench_serve.py --offline --vision-model Gemma-3-12B --image-share 0.5 --num-prompts 64 \
        --input-len 256 --output-len 128

Reports request throughput, output tok/s, TTFT, time per output token (TPOT) and inter-token latency (ITL) at
p50/p90/p99 for each rate. `--offline` runs the same requests through redline.engine.Engine in this process instead
(no HTTP), to see what the server adds.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PERCENTILES = (50, 90, 99)
# --json-schema list: a list of records too long to finish in the output length, so that every request still writes
# --output-len tokens, each of them masked by the grammar (keys, numbers and short strings; not one free string).
BENCH_SCHEMA = {"type": "array", "minItems": 10000, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12},
                                     "score": {"type": "number"}, "tags": {"type": "array", "maxItems": 3, "items": {
                                         "enum": ["red", "green", "blue"]}}},
    "required": ["id", "name", "score", "tags"], "additionalProperties": False}}


@dataclass(frozen=True)
class BenchServeConfig:
    base_url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    num_prompts: int = 64
    input_len: tuple[int, int] = (512, 512)  # prompt lengths drawn uniformly in [lo, hi]
    output_len: int = 256
    request_rates: tuple[float, ...] = (math.inf,)  # requests/s; inf: all at once
    vocab_size: int = 32000  # random prompt ids are drawn below this
    seed: int = 0
    json_path: Path | None = None
    plot_path: Path | None = None
    offline: bool = False  # run through redline.engine in-process (needs --random-weights or --checkpoint_path)
    random_weights: str | None = None
    checkpoint_path: Path | None = None
    device: str | None = None
    dtype: str | None = None
    max_kv_tokens: int | None = None
    kv_cache_dtype: str = "auto"  # --offline: the engine's pages, "auto" (the model's dtype) or "fp8"
    max_running: int = 256
    compile_prefill: bool | None = None  # --offline: the engine's steps with prompt chunks compiled; None: its rule
    capture_tokens: int | None = None  # --offline: decode graphs captured up front for sequences up to this long
    max_concurrency: int | None = None  # requests in flight at once at most (1: one client); None: no limit
    clients: int = 1  # client processes sharing the requests (one Python process parses ~10k SSE lines/s at most)
    shard: tuple[int, int] | None = None  # (k, n): this process sends requests k, k + n, ... (set by --clients)
    start_at: float | None = None  # with shard: the perf_counter time at which every client process starts
    timings_path: Path | None = None  # with shard: where this process writes its requests' raw timings
    json_schema: str | None = None  # every request's output must match a JSON schema: "list" (BENCH_SCHEMA) or a file
    image_share: float = 0.0  # the share of requests that carry one picture
    image_size: int = 896  # each picture's side in pixels (random pixels, a PNG)
    vision_model: str | None = None  # --offline: a published multimodal shape with random weights (bench_vision.py)

    def __post_init__(self) -> None:
        lo, hi = self.input_len
        if not 1 <= lo <= hi:
            raise ValueError(f"--input-len must be N or LO:HI with 1 <= LO <= HI, got {lo}:{hi}")
        for name in ("num_prompts", "output_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.clients < 1 or (self.clients > 1 and self.offline):
            raise ValueError(f"--clients must be positive, and 1 with --offline; got {self.clients}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be positive, got {self.max_concurrency}")
        if not self.request_rates or not all(r > 0 for r in self.request_rates):
            raise ValueError("--request-rate takes positive numbers or inf, comma-separated")
        sources = sum(x is not None for x in (self.random_weights, self.checkpoint_path, self.vision_model))
        if self.offline and sources != 1:
            raise ValueError("--offline needs exactly one of --random-weights, --checkpoint_path and --vision-model")
        if self.json_schema is not None and self.offline:
            raise ValueError("--json-schema measures the server (its grammars compile per request); drop --offline")
        if not 0 <= self.image_share <= 1 or self.image_size < 28:
            raise ValueError(f"--image-share must lie in [0, 1] and --image-size be >= 28, got {self.image_share}, "
                             f"{self.image_size}")
        if self.vision_model is not None and (not self.offline or self.random_weights or self.checkpoint_path):
            raise ValueError("--vision-model goes with --offline, instead of --random-weights and --checkpoint_path")
        if self.json_schema is not None and self.image_share:
            raise ValueError("--json-schema and --image-share measure different things; pick one")
        if self.json_schema not in (None, "list") and not Path(self.json_schema).is_file():
            raise FileNotFoundError(f"--json-schema {self.json_schema}: no such file; give 'list' or a JSON file")

    def response_format(self) -> dict[str, Any] | None:
        """The response_format every request sends, or None."""
        if self.json_schema is None:
            return None
        schema = BENCH_SCHEMA if self.json_schema == "list" else json.loads(Path(self.json_schema).read_text())
        return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema, "strict": True}}


@dataclass
class RequestTiming:
    prompt_len: int
    start: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # when each piece of output came
    output_tokens: int = 0
    error: str | None = None
    image: bool = False  # the request carried a picture

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.start

    @property
    def latency(self) -> float:
        return self.arrivals[-1] - self.start

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def distribution_ms(values: Sequence[float]) -> dict[str, float]:
    out = {"mean": 1e3 * sum(values) / len(values) if values else math.nan}
    out.update({f"p{q}": 1e3 * percentile(values, q) for q in PERCENTILES})
    return out


def make_prompts(cfg: BenchServeConfig) -> list[list[int]]:
    rng = random.Random(cfg.seed)
    low = min(10, cfg.vocab_size - 1)  # skip the first ids: special tokens live there
    return [[rng.randrange(low, cfg.vocab_size) for _ in range(rng.randint(*cfg.input_len))]
            for _ in range(cfg.num_prompts)]


def make_images(cfg: BenchServeConfig) -> list[bytes | None]:
    """For each request, the PNG file of its picture (random pixels, a different one each), or None."""
    import io

    import numpy as np
    from PIL import Image

    chosen = set(random.Random(cfg.seed + 2).sample(range(cfg.num_prompts), round(cfg.image_share * cfg.num_prompts)))
    out: list[bytes | None] = []
    for i in range(cfg.num_prompts):
        if i not in chosen:
            out.append(None)
            continue
        pixels = np.random.default_rng(cfg.seed + i).integers(0, 256, (cfg.image_size, cfg.image_size, 3), np.uint8)
        data = io.BytesIO()
        Image.fromarray(pixels).save(data, format="PNG", compress_level=1)
        out.append(data.getvalue())
    return out


def arrival_offsets(cfg: BenchServeConfig, rate: float) -> list[float]:
    """Seconds after the start at which each request is sent: 0 for all at an infinite rate, else Poisson."""
    if math.isinf(rate):
        return [0.0] * cfg.num_prompts
    rng = random.Random(cfg.seed + 1)
    t, out = 0.0, []
    for _ in range(cfg.num_prompts):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def summarize(timings: list[RequestTiming], duration: float, rate: float) -> dict[str, Any]:
    done = [t for t in timings if t.error is None and t.arrivals]
    tokens = sum(t.output_tokens for t in done)
    itl = [b - a for t in done for a, b in zip(t.arrivals, t.arrivals[1:])]
    return {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "completed": len(done), "failed": len(timings) - len(done),
        "errors": sorted({t.error for t in timings if t.error})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration, "output_tok_s": tokens / duration,
        "total_tok_s": (tokens + sum(t.prompt_len for t in done)) / duration,
        "prompt_tokens": sum(t.prompt_len for t in done), "output_tokens": tokens,
        "ttft_ms": distribution_ms([t.ttft for t in done]),
        **({"ttft_image_ms": distribution_ms([t.ttft for t in done if t.image]),
            "ttft_text_ms": distribution_ms([t.ttft for t in done if not t.image])}
           if any(t.image for t in timings) else {}),
        "tpot_ms": distribution_ms([t.tpot for t in done if t.tpot is not None]),
        "itl_ms": distribution_ms(itl),
        "e2e_latency_ms": distribution_ms([t.latency for t in done]),
        "peak_concurrency": peak_concurrency(done),
    }


def peak_concurrency(done: list[RequestTiming]) -> int:
    """The most requests in flight at once, each from its start to its last piece of output."""
    events = sorted([(t.start, 1) for t in done] + [(t.arrivals[-1], -1) for t in done])  # an end sorts first
    peak = running = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


# ---------------------------------------------------------------------------------------------------------------------
# Against a server.


async def one_request(client: Any, cfg: BenchServeConfig, model: str, prompt: list[int],
                      timing: RequestTiming, image: bytes | None = None) -> None:
    """One streamed completion of the prompt ids; with an image, a chat completion of the picture and the ids as
    text (completions take no images)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": cfg.output_len, "temperature": 0.0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    path = "/v1/completions"
    if image is not None:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        text = " ".join(f"w{t}" for t in body.pop("prompt"))  # a word per prompt id
        body["messages"] = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                         {"type": "text", "text": text}]}]
        path, timing.image = "/v1/chat/completions", True
    if cfg.json_schema is not None:
        body["response_format"] = cfg.response_format()
    timing.start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    timing.error = chunk["error"]["message"]
                    return
                if chunk.get("usage"):
                    timing.output_tokens = chunk["usage"]["completion_tokens"]
                    timing.prompt_len = chunk["usage"]["prompt_tokens"]
                for choice in chunk.get("choices", []):
                    text = choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content")
                    if text or choice["finish_reason"] is None:  # a piece of output, not a bare finish
                        timing.arrivals.append(time.perf_counter())
    except Exception as exc:  # noqa: BLE001 - one failed request is counted, the run goes on
        timing.error = f"{type(exc).__name__}: {exc}"
    if timing.error is None and not timing.arrivals:
        timing.error = "no output"


async def run_online(cfg: BenchServeConfig, prompts: list[list[int]], rate: float,
                     images: list[bytes | None] | None = None) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=None, limits=limits) as client:
        models = await client.get("/v1/models")
        if models.status_code != 200:
            raise ValueError(f"{cfg.base_url}/v1/models answered {models.status_code}; is the server up and ready?")
        model = models.json()["data"][0]["id"]
        timings = [RequestTiming(len(p)) for p in prompts]
        images = images or [None] * len(prompts)
        slots = asyncio.Semaphore(cfg.max_concurrency or len(prompts))

        async def limited(prompt: list[int], timing: RequestTiming, image: bytes | None) -> None:
            async with slots:  # the request's clock starts once it is sent
                await one_request(client, cfg, model, prompt, timing, image)

        offsets = arrival_offsets(cfg, rate)
        if cfg.shard is not None:
            k, n = cfg.shard
            prompts, timings, offsets, images = prompts[k::n], timings[k::n], offsets[k::n], images[k::n]
        # Connections are opened before the clock starts: one per request that may be in flight at once.
        warm = min(len(prompts), cfg.max_concurrency or len(prompts))
        await asyncio.gather(*(client.get("/health") for _ in range(warm)))
        if cfg.start_at is not None:
            await asyncio.sleep(max(0.0, cfg.start_at - time.perf_counter()))
        start = time.perf_counter()
        tasks = []
        for prompt, timing, offset, image in zip(prompts, timings, offsets, images):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(limited(prompt, timing, image)))
        await asyncio.gather(*tasks)
        if cfg.timings_path is not None:
            write_json({"timings": [asdict(t) for t in timings]}, cfg.timings_path)
        return summarize(timings, time.perf_counter() - start, rate)


def run_clients(cfg: BenchServeConfig, argv: Sequence[str], rate: float) -> dict[str, Any]:
    """The requests at one rate split over cfg.clients processes of this benchmark, started together; their raw
    timings merged into one summary (perf_counter is the same clock in every process on Linux)."""
    import subprocess
    import tempfile

    start = time.perf_counter() + 5.0 + 0.02 * cfg.num_prompts  # time for every process to start and connect
    with tempfile.TemporaryDirectory() as folder:
        paths = [Path(folder) / f"client-{k}.json" for k in range(cfg.clients)]
        procs = [subprocess.Popen([sys.executable, "-m", "redline.benchmarks.bench_serve", *argv, "--clients", "1",
                                   "--request-rate", str(rate), "--shard", f"{k}/{cfg.clients}",
                                   "--start-at", repr(start), "--timings", str(path)], stdout=subprocess.DEVNULL)
                 for k, path in enumerate(paths)]
        if any(p.wait() != 0 for p in procs) and not all(path.exists() for path in paths):
            raise ValueError("a client process failed; run with --clients 1 to see why")
        timings = [RequestTiming(**t) for path in paths for t in json.loads(path.read_text())["timings"]]
    sent = [t for t in timings if t.start]
    end = max((t.arrivals[-1] for t in sent if t.arrivals), default=start)
    return summarize(timings, end - min((t.start for t in sent), default=start), rate)


# ---------------------------------------------------------------------------------------------------------------------
# The same requests through the engine in this process.


def offline_engine(cfg: BenchServeConfig) -> Any:
    """The engine core serve.py would run, loaded and prepared as its process does (graphs captured, warmed up),
    in this process."""
    from redline.engine import Engine, EngineSettings
    from redline.engine.process import log, prepared
    from redline.runner.load import load_runner
    from redline.serve import ServeSettings

    engine_settings = EngineSettings(max_kv_tokens=cfg.max_kv_tokens, max_running=cfg.max_running, max_queue=None,
                                     compile_prefill=cfg.compile_prefill, capture_tokens=cfg.capture_tokens,
                                     kv_cache_dtype=cfg.kv_cache_dtype)
    begin = time.perf_counter()
    if cfg.vision_model is not None:
        engine = vision_engine(cfg, engine_settings)
        log(f"built {cfg.vision_model} with random weights, its vision tower included, in "
            f"{time.perf_counter() - begin:.1f} s")
    else:
        from redline.engine.process import vision_tower

        settings = ServeSettings(checkpoint_path=cfg.checkpoint_path, random_weights=cfg.random_weights,
                                 device=cfg.device, dtype=cfg.dtype, engine=engine_settings)
        runner = load_runner(settings.model_source(None), log)
        engine = Engine.of_runner(runner, engine_settings, vision_tower(settings.model_source(None), runner))
    prepared(engine.core)
    return engine


def vision_engine(cfg: BenchServeConfig, settings: Any) -> Any:
    """The engine of a published multimodal shape with random weights, its vision tower included."""
    import torch

    from redline.benchmarks.bench_vision import random_multimodal
    from redline.engine import Engine
    from redline.options import EngineConfig
    from redline.runner import Runner

    config = EngineConfig(device=cfg.device, dtype=cfg.dtype)
    device = config.torch_device()
    model, tower = random_multimodal(cfg.vision_model, device, getattr(torch, cfg.dtype or "bfloat16"))
    runner = Runner(model, device, compile=device.type == "cuda")
    return Engine.of_runner(runner, settings, tower)


def run_offline(engine: Any, cfg: BenchServeConfig, prompts: list[list[int]], rate: float,
                images: list[bytes | None] | None = None) -> dict[str, Any]:
    """The requests through the in-process engine, read as the server reads them: one event loop takes each
    request's outputs as they arrive (all that came since its last read at once), no thread per request."""
    return asyncio.run(offline_requests(engine, cfg, prompts, rate, images))


async def offline_requests(engine: Any, cfg: BenchServeConfig, prompts: list[list[int]],
                           rate: float, images: list[bytes | None] | None = None) -> dict[str, Any]:
    from redline.options import GenerationOptions

    options = GenerationOptions(max_new_tokens=cfg.output_len, temperature=0.0, ignore_eos=True)
    timings = [RequestTiming(len(p)) for p in prompts]
    images = images or [None] * len(prompts)
    slots = asyncio.Semaphore(cfg.max_concurrency or len(prompts))

    async def follow(prompt: list[int], timing: RequestTiming, image: bytes | None) -> None:
        async with slots:
            timing.start = time.perf_counter()
            if image is not None:  # the picture's placeholder after the first token; the engine expands it
                timing.image = True
                prompt = prompt[:1] + [engine.vision.placeholder_id] + prompt[1:]
                handle = await asyncio.to_thread(engine.add_request, prompt, options, [image])
                timing.prompt_len = len(handle.prompt_token_ids)
            else:
                handle = engine.add_request(prompt, options)
            async for batch in handle.batches():
                tokens = sum(len(out.token_ids) for out in batch)
                if tokens:
                    timing.arrivals.append(time.perf_counter())
                    timing.output_tokens += tokens

    start = time.perf_counter()
    tasks = []
    for prompt, timing, offset, image in zip(prompts, timings, arrival_offsets(cfg, rate), images):
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        tasks.append(asyncio.create_task(follow(prompt, timing, image)))
    await asyncio.gather(*tasks)
    return summarize(timings, time.perf_counter() - start, rate)


# ---------------------------------------------------------------------------------------------------------------------
# Report.


def report_line(run: dict[str, Any]) -> str:
    return (f"rate {run['request_rate']:>5} req/s | {run['completed']} ok, {run['failed']} failed in "
            f"{run['duration_s']:.1f} s | {run['request_throughput']:.2f} req/s, {run['output_tok_s']:.1f} out tok/s"
            f" | TTFT p50/p90/p99 {fmt(run['ttft_ms'])} ms | TPOT {fmt(run['tpot_ms'])} ms | "
            f"ITL {fmt(run['itl_ms'])} ms" + (f" | TTFT with a picture {fmt(run['ttft_image_ms'])} ms, text only "
                                             f"{fmt(run['ttft_text_ms'])} ms" if "ttft_image_ms" in run else "")
            + (f" | first error: {run['errors'][0]}" if run.get("errors") else ""))


def fmt(dist: dict[str, float]) -> str:
    return "/".join(f"{dist[f'p{q}']:.1f}" for q in PERCENTILES)


def write_plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global state, no display

    from redline.checkpoint import write_atomically

    finite = [r for r in runs if r["request_rate"] != "inf"]
    rates = [r["request_rate"] for r in finite]
    fig = Figure(figsize=(12, 4), layout="constrained")
    axes = fig.subplots(1, 3)
    axes[0].plot(rates, [r["output_tok_s"] for r in finite], "o-")
    axes[0].set(title="Output tok/s", xlabel="request rate (req/s)")
    for ax, key, name in ((axes[1], "ttft_ms", "TTFT (ms)"), (axes[2], "itl_ms", "Inter-token latency (ms)")):
        for q in PERCENTILES:
            ax.plot(rates, [r[key][f"p{q}"] for r in finite], "o-", label=f"p{q}")
        ax.set(title=name, xlabel="request rate (req/s)", yscale="log")
        ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])  # the measured rates, not log-scale labels between them
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))


def plain(value: Any) -> Any:
    """JSON-safe: inf and nan (no JSON numbers) as strings, paths and tuples as strings and lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def write_json(payload: dict[str, Any], path: Path) -> None:
    from redline.checkpoint import write_atomically

    text = json.dumps(plain(payload), indent=2, allow_nan=False)
    write_atomically(path, lambda tmp: Path(tmp).write_text(text + "\n", encoding="utf-8"))


def run(cfg: BenchServeConfig, argv: Sequence[str] = ()) -> dict[str, Any]:
    prompts = make_prompts(cfg)
    images = make_images(cfg) if cfg.image_share else None
    engine = offline_engine(cfg) if cfg.offline else None
    runs = []
    try:
        for rate in cfg.request_rates:
            if engine is not None:
                result = run_offline(engine, cfg, prompts, rate, images)
            elif cfg.clients > 1:
                result = run_clients(cfg, client_argv(argv), rate)
            else:
                result = asyncio.run(run_online(cfg, prompts, rate, images))
            if cfg.shard is not None:
                return {"runs": [result]}  # one client of several: its parent reports
            print(report_line(result), flush=True)
            runs.append(result)
    finally:
        if engine is not None:
            engine.shutdown()
    payload = {"config": {k: v for k, v in asdict(cfg).items() if k != "api_key"}, "mode":
               "offline" if cfg.offline else "server", "date": time.strftime("%Y-%m-%d"), "runs": runs}
    if cfg.json_path is not None:
        write_json(payload, cfg.json_path)
    if cfg.plot_path is not None:
        lo, hi = cfg.input_len
        write_plot(runs, cfg.plot_path, f"{cfg.num_prompts} requests, prompts {lo}-{hi} tokens, "
                                        f"{cfg.output_len} output tokens")
    return payload


def client_argv(argv: Sequence[str]) -> list[str]:
    """argv without the options the parent sets for each client process."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=")[0]
        if name in ("--clients", "--request-rate", "--json", "--plot"):
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    k, _, n = text.partition("/")
    return int(k), int(n)


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--input-len must be N or LO:HI, got {text!r}") from None


def parse_rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(r) for r in text.split(","))
    except ValueError:
        raise ValueError(f"--request-rate takes numbers or inf, comma-separated; got {text!r}") from None


def parse_args(argv: Sequence[str] | None) -> BenchServeConfig:
    p = argparse.ArgumentParser(description="Load-test an OpenAI-compatible Redline server (serve.py).")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", default="512", help="prompt tokens: N, or LO:HI drawn uniformly")
    p.add_argument("--output-len", type=int, default=256, help="tokens generated per request (EOS ignored)")
    p.add_argument("--request-rate", dest="request_rates", default="inf",
                   help="requests/s, comma-separated for a sweep; inf: all at once")
    p.add_argument("--vocab-size", type=int, default=32000, help="random prompt ids are drawn below this")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at once at most (1: one client at a time); default: no limit")
    p.add_argument("--clients", type=int, default=1,
                   help="client processes sharing the requests (one Python process parses ~10k SSE lines/s at most)")
    p.add_argument("--shard", default=None, help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--timings", dest="timings_path", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-schema", default=None, metavar="list|FILE",
                   help="every request's output matches this JSON schema ('list': a long list of records; the "
                        "server needs a tokenizer: serve.py --tokenizer with --random-weights)")
    p.add_argument("--image-share", type=float, default=0.0,
                   help="the share of requests that carry one random picture (a chat completion with an image_url "
                        "part; the server needs a multimodal checkpoint)")
    p.add_argument("--image-size", type=int, default=896, help="each picture's side in pixels")
    p.add_argument("--vision-model", default=None, choices=["Gemma-3-12B", "Qwen2.5-VL-7B"],
                   help="--offline: this published multimodal shape with random weights, vision tower included")
    p.add_argument("--json", dest="json_path", type=Path, default=None, help="write the results here")
    p.add_argument("--plot", dest="plot_path", type=Path, default=None, help="write a PNG of a rate sweep here")
    p.add_argument("--offline", action="store_true", help="run the requests through the engine in this process")
    p.add_argument("--random-weights", default=None, help="--offline: a registry model with random weights")
    p.add_argument("--checkpoint_path", type=Path, default=None, help="--offline: a Redline checkpoint")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-kv-tokens", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", help="--offline: the engine's KV pages, auto or fp8 (e4m3)")
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--capture-tokens", type=int, default=None,
                   help="--offline: capture decode graphs up front for sequences up to this many tokens (as serve.py)")
    p.add_argument("--compile-prefill", action=argparse.BooleanOptionalAction,
                   help="--offline: compile the steps with prompt chunks (default: where serve.py does)")
    ns = p.parse_args(argv)
    return BenchServeConfig(**{**vars(ns), "input_len": parse_range(ns.input_len),
                               "request_rates": parse_rates(ns.request_rates), "shard": parse_shard(ns.shard)})


def main(argv: Sequence[str] | None = None) -> int:
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        payload = run(parse_args(argv), argv)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0 if all(r["failed"] == 0 for r in payload["runs"]) else 1


if __name__ == "__main__":
    from redline.benchmarks.bench_serve import main as package_main

    sys.exit(package_main())
