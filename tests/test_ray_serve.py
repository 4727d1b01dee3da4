"""ray_serve: Redline replicas on a local Ray cluster behind one OpenAI route (CPU, tiny model), and the settings."""
from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from redline.ray_serve import DEPLOYMENT_NAME, REPLICA_HEADER, ScaleSettings, app_builder, build_app
from redline.engine import EngineSettings
from redline.serve import ServeSettings

PROMPT = "The quick brown fox"
NEW_TOKENS = 8
# Concurrent requests: Ray's router picks the shorter queue of two replicas drawn at random, so all of them landing
# on one replica of two has odds of about 2 in 2**16.
SPREAD_REQUESTS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_llm_checkpoint):
    """Two CPU replicas of the tiny model on a local Ray cluster; the base URL of Ray's proxy."""
    import ray
    from ray import serve

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(tiny_llm_checkpoint[0], replicas=2, device="cpu", compile=False,
                            served_model_name="tiny", num_cpus=1), name="redline", route_prefix="/")
        # A second application: one replica whose engine runs on two ranks (gloo on the CPU).
        serve.run(build_app(tiny_llm_checkpoint[0], replicas=1, tensor_parallel=2, device="cpu", compile=False,
                            served_model_name="tiny", num_cpus=1), name="redline-tp", route_prefix="/tp")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def complete(base: str) -> tuple[str, str]:
    """(the replica that answered, the text) of one greedy completion through the openai client."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    raw = client.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=NEW_TOKENS,
                                                     temperature=0)
    return raw.headers[REPLICA_HEADER], raw.parse().choices[0].text


def one_process_text(path) -> str:
    from redline.generate import LLM

    return LLM.load(path, device="cpu", compile=False).generate(PROMPT, max_new_tokens=NEW_TOKENS, temperature=0).text


@pytest.mark.slow
def test_two_replicas_share_the_requests_and_survive_losing_one(cluster, tiny_llm_checkpoint):
    import ray

    want = one_process_text(tiny_llm_checkpoint[0])
    with ThreadPoolExecutor(SPREAD_REQUESTS) as pool:
        answers = list(pool.map(lambda _: complete(cluster), range(SPREAD_REQUESTS)))
    replicas = {replica for replica, _ in answers}
    assert len(replicas) == 2, answers  # both replicas answered
    assert all(text == want for _, text in answers)  # and each gave one process's greedy text
    # Kill one replica's process: the other keeps answering while Ray's controller starts a replacement.
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::")]
    killed = sorted(replicas)[0]
    victim = next(name for name in names if name.endswith(killed) and f"#{DEPLOYMENT_NAME}#" in name)
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    after = [complete(cluster) for _ in range(4)]
    assert all(text == want for _, text in after)
    assert killed not in {replica for replica, _ in after}


@pytest.mark.slow
def test_a_tensor_parallel_replica_gives_one_process_text(cluster, tiny_llm_checkpoint):
    want = one_process_text(tiny_llm_checkpoint[0])
    with ThreadPoolExecutor(4) as pool:  # batched together in the replica's engine
        answers = list(pool.map(lambda _: complete(f"{cluster}/tp"), range(4)))
    assert all(text == want for _, text in answers)


def test_scale_settings_give_rays_deployment_options():
    settings = ServeSettings(random_weights="debug-tiny", device="cpu", engine=EngineSettings(max_running=32))
    fixed = ScaleSettings(replicas=3).deployment_options(settings)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0}  # a CPU replica reserves no GPU
    assert fixed["max_ongoing_requests"] == 32  # what the engine batches; the rest waits in Ray's router
    scaled = ScaleSettings(replicas=1, max_replicas=4, target_ongoing_requests=16).deployment_options(settings)
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16}
    assert "num_replicas" not in scaled


def test_bad_settings_are_refused_in_one_line(tiny_llm_checkpoint, tmp_path):
    path = tiny_llm_checkpoint[0]
    cases = [
        (dict(replicas=0), "replicas must be a positive integer"),
        (dict(replicas=2, max_replicas=1), "max_replicas (1) is below replicas (2)"),
        (dict(tensor_parallel=0), "tensor_parallel must be a positive integer"),
        (dict(port=9000), "port is not a replica setting"),
        (dict(max_runing=8), "unknown replica setting(s) max_runing"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as info:
            build_app(path, **kwargs)
        assert message in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_app(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="checkpoint=PATH is required"):
        app_builder({"replicas": "2"})
    with pytest.raises(ValueError, match="replicas='two' is not a number"):
        app_builder({"checkpoint": str(path), "replicas": "two"})
    with pytest.raises(ValueError, match="gateway_metrics='yes': pass true or false"):
        app_builder({"checkpoint": str(path), "gateway_metrics": "yes"})
    assert app_builder({"checkpoint": str(path), "replicas": "2", "device": "cpu", "gateway_metrics": "true"})
