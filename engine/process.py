"""The engine core in a process of its own, and the link the front end (serve.py) reaches it through.

The front end makes a private folder (mode 0700) for two ZeroMQ sockets, binds the one it reads and starts `python -m
redline.engine.process` with its settings as JSON on the command line; the core binds the one it reads, loads the model
(logging each phase), captures its graphs, warms up and says Ready with its limits. From then on requests and aborts
go in, outputs come back: msgspec structs encoded as MessagePack (engine/messages.py), never pickles. A frame that
does not decode is refused and logged, and the core serves on.

The core dies with its front end (the kernel's parent-death signal, and a check of its parent every second), and
the front end's receiving thread notices within a fraction of a second when the core is gone.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from redline.checkpoint import dtype_name
from redline.engine.core import EngineCore, EngineSettings
from redline.engine.messages import (Abort, CoreOutput, CoreRequest, Failed, FromCore, Outputs, Ready, Shutdown, Stats,
                                     StatsQuery, ToCore)
from redline.engine.requests import EngineStats

POLL_MS = 100  # how often each side's loop wakes with nothing to read, to look at the other side
STATS_TIMEOUT_S = 5.0
PR_SET_PDEATHSIG = 1


class ModelSource(msgspec.Struct, frozen=True):
    """What model the core loads: a checkpoint, or a registry model with random weights (benchmarks)."""

    checkpoint_path: str | None = None
    random_weights: str | None = None
    device: str | None = None
    dtype: str | None = None
    quantize: str | None = None
    compile: bool | None = None
    tokenizer_vocab: int | None = None  # ids past the tokenizer's are never sampled
    tokenizer_path: str | None = None  # the tokenizer grammars are compiled for (requests with a grammar need one)
    threads: int | None = None  # CPU threads of the kernels (serve.py --threads); None: the physical cores
    tensor_parallel: int = 1  # GPUs of this host the model is split over: the core is rank 0 and starts the others


class CoreConfig(msgspec.Struct, frozen=True):
    model: ModelSource
    engine: dict[str, Any]  # EngineSettings' fields
    inbox: str  # the ZeroMQ address the core reads requests from
    outbox: str  # and writes its outputs to
    capture_graphs: bool = True
    warm_up_tokens: int | None = None  # the warm-up's longest prompt; None: a prefill chunk and a bit


# ---------------------------------------------------------------------------------------------------------------------
# The core's side.


def log(message: str) -> None:
    print(f"[redline core] {message}", file=sys.stderr, flush=True)


def serve_core(config: CoreConfig) -> int:
    """Load, capture, warm up, then serve requests until Shutdown (0) or the front end is gone (1)."""
    die_with_parent()
    parent = os.getppid()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the front end decides when the core stops
        signal.signal(sig, signal.SIG_IGN)
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind(config.inbox)  # the core reads from its own address; the front end connects to it
    outbox.connect(config.outbox)
    outbox.setsockopt(zmq.LINGER, 2000)
    encoder = msgspec.msgpack.Encoder()
    send_lock = threading.Lock()

    def send(message: Any) -> None:
        data = encoder.encode(message)
        with send_lock:  # the engine's thread sends outputs, this one replies to queries
            outbox.send(data)

    try:
        start_ranks(config)
        core, startup = start_core(config, lambda outputs: send(Outputs(outputs)))
    except Exception as exc:  # noqa: BLE001 - reported to the front end in one line
        message = str(exc) if isinstance(exc, (ValueError, OSError)) else f"{type(exc).__name__}: {exc}"
        log(f"failed: {message}")
        send(Failed(message.splitlines()[0] if message else type(exc).__name__))
        outbox.close()
        return 1
    limits = core.limits
    send(Ready(limits.block_size, limits.vocab_size, limits.capacity_tokens, core.runner.bytes_per_token,
               str(core.device), startup))
    decoder = msgspec.msgpack.Decoder(ToCore)
    while True:
        if not inbox.poll(POLL_MS * 10):
            if os.getppid() != parent:
                log("the front end is gone; stopping")
                core.shutdown(0)
                return 1
            continue
        frame = inbox.recv()
        try:
            message = decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log(f"refused a malformed frame of {len(frame)} bytes: {exc}")
            continue
        if isinstance(message, CoreRequest):
            core.add(message)
        elif isinstance(message, Abort):
            core.abort(message.request_id, "stop" if message.reason == "stop" else "abort")
        elif isinstance(message, StatsQuery):
            send(core.stats())
        elif isinstance(message, Shutdown):
            log(f"draining (up to {message.grace_s:g} s)")
            core.shutdown(message.grace_s)  # tensor parallel: the other ranks' follow() returns
            stop_ranks()
            log("stopped")
            return 0


def start_ranks(config: CoreConfig) -> list[subprocess.Popen]:
    """With tensor parallel, make this process rank 0 of config.model.tensor_parallel ranks of this host (torchrun's
    variables, a free port on 127.0.0.1) and start the other ranks (follow_core); they die with this process."""
    from redline import tensor_parallel

    world_size = config.model.tensor_parallel
    if world_size == 1:
        return []
    envs = tensor_parallel.rank_environments(world_size)
    os.environ.update({name: envs[0][name] for name in tensor_parallel.RANK_VARIABLES})
    command = [sys.executable, "-m", "redline.engine.process", "--follow", msgspec.json.encode(config).decode()]
    return [subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env) for env in envs[1:]]


def follow_core(config: CoreConfig) -> int:
    """A tensor-parallel rank other than 0: load this rank's part of the model, make the same engine core, and run
    the steps rank 0's core sends until it shuts down (or dies, which ends this process too)."""
    from redline.runner.load import load_runner

    die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0's core decides when this one stops
        signal.signal(sig, signal.SIG_IGN)
    rank = os.environ.get("RANK", "?")

    def rank_log(message: str) -> None:
        log(f"rank {rank}: {message}")

    EngineCore(load_runner(config.model, rank_log), EngineSettings(**config.engine), lambda outputs: None).follow()
    stop_ranks()
    return 0


def stop_ranks() -> None:
    """Leave the ranks' process group, once rank 0's core shut down (no-op on one GPU)."""
    from redline import tensor_parallel

    tensor_parallel.stop()


def start_core(config: CoreConfig, sink: Callable[[list[CoreOutput]], None]) -> tuple[EngineCore, dict[str, float]]:
    """The loaded model's engine core, its graphs captured and warmed up; with the seconds each phase took."""
    from redline.runner.load import load_runner

    startup: dict[str, float] = {}
    begin = time.perf_counter()
    runner = load_runner(config.model, log)
    startup["load_s"] = time.perf_counter() - begin
    begin = time.perf_counter()
    core = EngineCore(runner, EngineSettings(**config.engine), sink, grammar_compiler(config.model, runner),
                      vision_tower(config.model, runner))
    log(f"KV cache: {core.pool.num_pages} pages of {core.pool.page_size} tokens ({core.pool.capacity_tokens} tokens, "
        f"{dtype_name(core.kv_dtype)})")
    startup.update(prepared(core, config.capture_graphs, config.warm_up_tokens, since=begin))
    return core, startup


def prepared(core: EngineCore, capture_graphs: bool = True, warm_up_tokens: int | None = None,
             since: float | None = None) -> dict[str, float]:
    """Capture the core's decode graphs (where it has them) and warm it up, logging each phase; the seconds each
    took, the graphs' counted from `since` (default: now)."""
    begin = time.perf_counter() if since is None else since
    if capture_graphs and core.paged.graphs is not None:
        log("capturing decode graphs")
        made = core.capture_graphs(progress=graph_progress())
        log(f"captured {made} decode graphs in {time.perf_counter() - begin:.1f} s")
    startup = {"graphs_s": time.perf_counter() - begin}
    begin = time.perf_counter()
    core.warm_up(warm_up_tokens)
    startup["warm_up_s"] = time.perf_counter() - begin
    log(f"warmed up in {startup['warm_up_s']:.1f} s; ready")
    return startup


def vision_tower(source: ModelSource, runner: Any) -> Any:
    """The checkpoint's vision tower on the core's device (in the activations' dtype), or None: no checkpoint, no
    vision file, or tensor parallel (whose steps carry no images yet)."""
    if source.checkpoint_path is None or source.tensor_parallel > 1:
        return None
    from redline.checkpoint import read_checkpoint_info
    from redline.vision import load_vision_tower

    tower = load_vision_tower(read_checkpoint_info(source.checkpoint_path).path, runner.device,
                              runner.model.cache_dtype)
    if tower is not None:
        log(f"vision tower: {tower.args.family}, {sum(p.numel() for p in tower.parameters()) / 1e6:.1f} M parameters")
    return tower


def grammar_compiler(source: ModelSource, runner: Any) -> Any:
    """The core's grammar compiler over the model's tokenizer (the core otherwise needs none; it is loaded in the
    compiler's pool, not before the core is ready), or None without a tokenizer."""
    if source.tokenizer_path is None:
        return None
    from redline.grammar import GrammarCompiler
    from redline.tokenizer import load_tokenizer

    path = source.tokenizer_path
    return GrammarCompiler(None, runner.model.args.vocab_size, load=lambda: load_tokenizer(path))


def graph_progress() -> Callable[[int, int], None]:
    """A progress callback that logs about every tenth of the graphs."""
    begin = time.perf_counter()

    def report(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            log(f"captured graph {done} of {total} ({time.perf_counter() - begin:.1f} s)")
    return report


def die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (elsewhere the parent check in the loop does it)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    follow = argv[:1] == ["--follow"]  # a tensor-parallel rank other than 0, started by rank 0's core
    argv = argv[1:] if follow else argv
    if len(argv) != 1:
        print("usage: python -m redline.engine.process CONFIG_JSON (serve.py starts it)", file=sys.stderr)
        return 2
    try:
        config = msgspec.json.decode(argv[0], type=CoreConfig)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        print(f"error: the core's configuration does not decode: {exc}", file=sys.stderr)
        return 2
    return follow_core(config) if follow else serve_core(config)


# ---------------------------------------------------------------------------------------------------------------------
# The front end's side.


class CoreProcess:
    """A core in its own process, as the front end's link (engine/client.py's Link): start() spawns it, a thread
    receives what it sends. on_ready(Ready), on_outputs(list of CoreOutput), on_exit(error) are called from that
    thread; on_exit once, when the core failed to start, died, or stopped."""

    def __init__(self, model: ModelSource, engine: EngineSettings, on_ready: Callable[[Ready], None],
                 on_outputs: Callable[[list[CoreOutput]], None], on_exit: Callable[[str | None], None],
                 capture_graphs: bool = True, warm_up_tokens: int | None = None,
                 compile_cache: Path | None = None) -> None:
        self.compile_cache = compile_cache
        self.folder = Path(tempfile.mkdtemp(prefix="redline-core-"))  # mode 0700: only this user reaches it
        self.ctx = zmq.Context()
        self.inbox, self.outbox = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        inbox, outbox = f"ipc://{self.folder}/in", f"ipc://{self.folder}/out"
        self.inbox.connect(inbox)  # queued until the core binds it
        self.outbox.bind(outbox)
        self.config = CoreConfig(model, dataclasses.asdict(engine), inbox, outbox, capture_graphs, warm_up_tokens)
        self.on_ready, self.on_outputs, self.on_exit = on_ready, on_outputs, on_exit
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(FromCore)
        self.send_lock = threading.Lock()
        self.stats_lock = threading.Lock()
        self.stats_reply: list[Stats] = []
        self.stats_event = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.stopping = False
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        command = [sys.executable, "-m", "redline.engine.process", msgspec.json.encode(self.config).decode()]
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, env=core_environment(self.compile_cache))
        self.thread = threading.Thread(target=self._receive, name="redline-core-link", daemon=True)
        self.thread.start()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _send(self, message: Any) -> None:
        data = self.encoder.encode(message)
        with self.send_lock:  # handlers (the event loop's thread) and the receiving thread (stop aborts) both send
            self.inbox.send(data)

    def add(self, request: CoreRequest) -> None:
        self._send(request)

    def abort(self, request_id: str, reason: str) -> None:
        self._send(Abort(request_id, reason))

    def stats(self) -> EngineStats:
        with self.stats_lock:
            self.stats_event.clear()
            self._send(StatsQuery())
            if not self.stats_event.wait(STATS_TIMEOUT_S):
                raise RuntimeError("the engine core did not answer a stats query")
            return self.stats_reply.pop()

    def shutdown(self, timeout: float | None) -> None:
        """Let running requests finish (up to timeout seconds), stop the core, wait for it (killed if it hangs)."""
        self.stopping = True
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._send(Shutdown(30.0 if timeout is None else timeout))
            try:
                self.proc.wait((30.0 if timeout is None else timeout) + 10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """Kill the core if it still runs, let the receiving thread see it, then close the sockets."""
        self.stopping = True
        self.kill()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(5)
        self.inbox.close(linger=0)
        self.outbox.close(linger=0)
        shutil.rmtree(self.folder, ignore_errors=True)

    def _receive(self) -> None:
        exit_error: str | None = None
        while True:
            try:
                readable = self.outbox.poll(POLL_MS)
            except zmq.ZMQError:  # closed under it: the front end is stopping
                return
            if readable:
                try:
                    message = self.decoder.decode(self.outbox.recv())
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    print(f"[redline] refused a malformed frame from the core: {exc}", file=sys.stderr)
                    continue
                if isinstance(message, Outputs):
                    self.on_outputs(message.outputs)
                elif isinstance(message, Stats):
                    self.stats_reply.append(message)
                    self.stats_event.set()
                elif isinstance(message, Ready):
                    self.on_ready(message)
                elif isinstance(message, Failed):
                    exit_error = message.error
                continue
            code = self.proc.poll()
            if code is not None:
                if exit_error is None and not (self.stopping and code == 0):
                    exit_error = f"the engine core exited with status {code}"
                self.on_exit(exit_error)
                return


def core_environment(compile_cache: Path | None) -> dict[str, str]:
    """The core's environment: this one, with torch.compile's on-disk caches (inductor's FX graphs and AOTAutograd
    results, Triton's compiled kernels) in compile_cache, so a second start of the same model and settings reuses
    them; variables the user set win."""
    env = dict(os.environ)
    if compile_cache is not None:
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache / "inductor"))
        env.setdefault("TRITON_CACHE_DIR", str(compile_cache / "triton"))
    return env


if __name__ == "__main__":
    from redline import tensor_parallel

    tensor_parallel.exit_process(main())
