"""Redline engines as Ray Serve replicas behind one OpenAI-compatible route: scale-out over GPUs and hosts.

    from ray import serve
    from redline.ray_serve import build_app

    serve.run(build_app("checkpoints/llama/model.safetensors", replicas=4), route_prefix="/")
    # or from the shell, Ray's own CLI with the same arguments:
    serve run redline.ray_serve:app_builder checkpoint=checkpoints/llama/model.safetensors replicas=4

Each replica holds one engine, on one GPU or on a tensor-parallel group (tensor_parallel=N: the replica's process is
rank 0 and starts the other ranks beside it), and serves serve.py's own app: the same routes, request checks,
errors, streaming and /metrics. Ray's proxy takes every request on one port and routes it to the replica with
the shortest queue; Ray's autoscaler adds or removes replicas to keep each one's ongoing requests (running and queued
at the replica) near a target. A replica that dies is replaced by Ray's controller while the others keep answering.
Every response carries the replica that answered in the `x-redline-replica` header.

Ray is an optional dependency (`pip install "redline[ray]"`): nothing here imports it until build_app is called.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redline.checkpoint import read_checkpoint_info
from redline.engine import EngineSettings
from redline.serve import SERVE_ENGINE, ServeSettings, create_app

# The response header naming the replica that answered.
REPLICA_HEADER = "x-redline-replica"
# The deployment's name in Ray Serve (its replicas' actors are named after it).
DEPLOYMENT_NAME = "redline"


@dataclass(frozen=True)
class ScaleSettings:
    """How many replicas, and what each reserves. With max_replicas above replicas, Ray autoscales between them."""

    replicas: int = 1
    max_replicas: int | None = None  # None: a fixed number of replicas
    target_ongoing_requests: int = 64  # the autoscaler's aim for each replica's running plus queued requests
    tensor_parallel: int = 1  # GPUs per replica: its engine's ranks
    num_cpus: float = 1.0  # CPU cores Ray reserves for each replica

    def __post_init__(self) -> None:
        for name in ("replicas", "target_ongoing_requests", "tensor_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below replicas ({self.replicas}); raise it or "
                             f"drop it for a fixed number of replicas")
        if not self.num_cpus >= 0:
            raise ValueError(f"num_cpus must be >= 0, got {self.num_cpus}")

    def deployment_options(self, settings: ServeSettings) -> dict[str, Any]:
        """The options of Ray Serve's @serve.deployment for these settings."""
        gpus = 0 if settings.engine_config.torch_device().type == "cpu" else self.tensor_parallel
        options: dict[str, Any] = {
            "name": DEPLOYMENT_NAME,
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": gpus},
            # Above what the engine batches, requests wait in Ray's router, free to go to whichever replica frees first.
            "max_ongoing_requests": settings.engine.max_running,
        }
        if self.max_replicas is None or self.max_replicas == self.replicas:
            options["num_replicas"] = self.replicas
        else:
            options["autoscaling_config"] = {"min_replicas": self.replicas, "max_replicas": self.max_replicas,
                                             "target_ongoing_requests": self.target_ongoing_requests}
        return options


class RedlineReplica:
    """One replica: the model and its batching engine in this process (graphs captured and warmed up, as serve.py's
    core does before it says ready), loaded before Ray sends it any request, behind serve.py's app (Ray Serve's
    late-bound ingress calls __serve_build_asgi_app__ after __init__)."""

    def __init__(self, settings: ServeSettings) -> None:
        from redline.engine import Engine
        from redline.generate import LLM

        self.settings = settings
        self.followers = follower_ranks(settings)
        self.llm = LLM.from_config(settings.checkpoint_path, settings.engine_config)  # rank 0's slices with TP
        self.engine = Engine(self.llm, settings.engine)
        self.engine.capture_graphs()  # every decode shape before the first request
        self.engine.warm_up()

    def __serve_build_asgi_app__(self) -> Any:
        from ray import serve

        app = create_app(self.engine, self.llm, self.settings)
        replica = serve.get_replica_context().replica_id.unique_id

        @app.middleware("http")
        async def name_the_replica(request: Any, call_next: Any) -> Any:
            response = await call_next(request)
            response.headers[REPLICA_HEADER] = replica
            return response

        return app


def follower_ranks(settings: ServeSettings) -> list[Any]:
    """With tensor parallel, this replica's process becomes rank 0 of settings.tensor_parallel ranks on the GPUs Ray
    gave it, and starts the others as serve.py's engine core does (python -m redline.engine.process --follow: the
    same model and engine settings, following rank 0's steps, dying with this process). Nothing with one GPU."""
    import os
    import subprocess
    import sys

    import msgspec

    from redline.engine.process import CoreConfig
    from redline.tensor_parallel import RANK_VARIABLES, rank_environments

    if settings.tensor_parallel == 1:
        return []
    envs = rank_environments(settings.tensor_parallel)
    os.environ.update({name: envs[0][name] for name in RANK_VARIABLES})  # this process: rank 0
    config = CoreConfig(settings.model_source(None), dataclasses.asdict(settings.engine), "", "")
    command = [sys.executable, "-m", "redline.engine.process", "--follow", msgspec.json.encode(config).decode()]
    return [subprocess.Popen(command, stdin=subprocess.DEVNULL, env=env) for env in envs[1:]]


def build_app(checkpoint: str | Path, replicas: int = 1, tensor_parallel: int = 1, *, max_replicas: int | None = None,
              target_ongoing_requests: int = 64, num_cpus: float = 1.0, **serve_options: Any) -> Any:
    """A Ray Serve application of Redline replicas of `checkpoint`, for serve.run. serve_options are ServeSettings
    fields (device, dtype, quantize, served_model_name, api_key, gateway_metrics, ...) and EngineSettings fields
    (max_kv_tokens, max_running, ...)."""
    try:
        from ray import serve
    except ImportError:
        raise ValueError('Ray Serve is not installed; pip install "redline[ray]" (or "ray[serve]")') from None
    for name in ("host", "port", "checkpoint_path", "random_weights"):
        if name in serve_options:
            raise ValueError(f"{name} is not a replica setting: Ray's proxy listens (serve.start's http_options) "
                             f"and build_app's first argument is the checkpoint")
    engine_fields = {f.name for f in dataclasses.fields(EngineSettings)}
    fields = {f.name for f in dataclasses.fields(ServeSettings)} - {"engine"} | engine_fields
    unknown = sorted(set(serve_options) - fields)
    if unknown:
        raise ValueError(f"unknown replica setting(s) {', '.join(unknown)}; choose from {', '.join(sorted(fields))}")
    engine = dataclasses.replace(SERVE_ENGINE, **{k: v for k, v in serve_options.items() if k in engine_fields})
    serve_options = {k: v for k, v in serve_options.items() if k not in engine_fields}
    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; pass a Redline checkpoint (file or folder)")
    read_checkpoint_info(path)  # a file that is no Redline checkpoint is refused here, not in every replica
    scale = ScaleSettings(replicas, max_replicas, target_ongoing_requests, tensor_parallel, num_cpus)
    settings = ServeSettings(checkpoint_path=path, engine=engine, tensor_parallel=tensor_parallel, **serve_options)
    deployment = serve.deployment(serve.ingress()(RedlineReplica), **scale.deployment_options(settings))
    return deployment.bind(settings)


# Arguments of app_builder that are numbers, and their types (Ray's CLI passes every argument as a string).
NUMERIC_ARGS = {"replicas": int, "tensor_parallel": int, "max_replicas": int, "target_ongoing_requests": int,
                "num_cpus": float, "max_kv_tokens": int, "max_running": int, "max_queue": int, "prefill_chunk": int}
BOOLEAN_ARGS = ("compile", "compile_prefill", "prefill_graphs", "gateway_metrics")


def app_builder(args: dict[str, str]) -> Any:
    """`serve run redline.ray_serve:app_builder checkpoint=PATH replicas=N ...`: build_app from Ray's CLI arguments
    (strings; numbers and true/false are converted)."""
    values: dict[str, Any] = dict(args)
    if "checkpoint" not in values:
        raise ValueError("checkpoint=PATH is required: serve run redline.ray_serve:app_builder checkpoint=PATH")
    for name, kind in NUMERIC_ARGS.items():
        if name in values:
            try:
                values[name] = kind(values[name])
            except ValueError:
                raise ValueError(f"{name}={values[name]!r} is not a number") from None
    for name in BOOLEAN_ARGS:
        if name in values:
            if values[name].lower() not in ("true", "false"):
                raise ValueError(f"{name}={values[name]!r}: pass true or false")
            values[name] = values[name].lower() == "true"
    return build_app(values.pop("checkpoint"), **values)
