"""Tensor parallel: 2 ranks under torchrun (gloo, CPU) against one process, the shard plan, slice-wise reading."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from redline import tensor_parallel as tp
from redline.checkpoint import load_tensors, read_checkpoint_info
from redline.model import ModelArgs

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "tp_worker.py"
PROMPT = "The quick brown fox"
# torchrun's launch of two CPU ranks imports torch twice; this is far above what it takes.
LAUNCH_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def import_path() -> str:
    """PYTHONPATH for a child process: where this process imports `redline` from (a checkout run without an install,
    as benchmarks/gpu_run.sh links it, included), then the checkout itself (for `tests`)."""
    return os.pathsep.join(dict.fromkeys(p for p in tp.child_import_path().split(os.pathsep) + [str(ROOT)] if p))


def launch_env(extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without torchrun's variables, with the import path children need."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", tp.ALL_REDUCE_ENV)}
    env.update(PYTHONPATH=import_path(), OMP_NUM_THREADS="1", **(extra_env or {}))
    return env


def torchrun(args: list[str], nproc: int = 2, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), *args]
    return subprocess.run(cmd, cwd=ROOT, env=launch_env(extra_env), capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def checkpoints(tiny_llm_checkpoint, tmp_path_factory) -> list[Path]:
    """The float32 tiny model (4 heads, 2 kv heads, intermediate 160) and its int8 copy, each beside the tokenizer."""
    from redline.quantize import quantize_checkpoint
    from redline.tokenizer import copy_tokenizer_files

    float_path = tiny_llm_checkpoint[0]
    folder = tmp_path_factory.mktemp("tp-int8")
    copy_tokenizer_files(float_path.parent, folder)
    return [float_path, quantize_checkpoint(float_path, "int8", folder / "model.int8.safetensors")]


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory):
    """The worker's results per checkpoint and rank, and torchrun's output."""
    out = tmp_path_factory.mktemp("tp-out")
    proc = torchrun([str(WORKER), str(out), PROMPT, *map(str, checkpoints)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [[torch.load(out / f"{i}-rank{r}.pt", weights_only=True) for r in range(2)]
               for i in range(len(checkpoints))]
    return results, proc


def one_process(path: Path) -> dict:
    from redline import generate
    from tests.tp_worker import NEW_TOKENS, logits

    llm = generate.LLM.load(path, device="cpu", compile=False)
    return {"logits": logits(llm.model), "greedy": llm.generate(PROMPT, max_new_tokens=NEW_TOKENS,
                                                                 temperature=0).token_ids}


@pytest.mark.parametrize("which", [0, 1], ids=["float32", "int8"])
def test_two_ranks_give_one_process_logits_and_greedy_tokens(two_ranks, checkpoints, which):
    results, _ = two_ranks
    reference = one_process(checkpoints[which])
    for rank in range(2):
        got = results[which][rank]
        assert got["local_heads"] == 2  # each rank really held half of the 4 heads
        torch.testing.assert_close(got["logits"], reference["logits"], atol=1e-4, rtol=0)
        assert got["greedy"] == reference["greedy"]
        # The fused batch-1 decode per rank (residual in rank 0's partial, norms summed after the all-reduce).
        from tests.tp_worker import PROMPT_TOKENS
        torch.testing.assert_close(got["fused"], reference["logits"][:, PROMPT_TOKENS:], atol=1e-4, rtol=0)


def test_ranks_agree_on_unseeded_samples(two_ranks):
    results, _ = two_ranks
    for per_rank in results:
        assert per_rank[0]["sampled"] == per_rank[1]["sampled"]
        assert len(per_rank[0]["sampled"]) > 0


def test_cli_prints_once_from_rank_zero(two_ranks, checkpoints):
    from redline import generate
    from tests.tp_worker import NEW_TOKENS

    _, proc = two_ranks
    text = generate.LLM.load(checkpoints[0], device="cpu", compile=False).generate(
        PROMPT, max_new_tokens=NEW_TOKENS, temperature=0).text
    assert proc.stdout.count(PROMPT + text) == 1, proc.stdout
    assert proc.stderr.count("[sample 1/1]") == 1


@pytest.fixture(scope="module")
def linked_launch(tmp_path_factory) -> list[dict]:
    """Each rank's launch check (tp_worker.py --launch-check) from a torchrun started by a parent process that
    imports redline only through PYTHONPATH, from a folder linking the checkout under that name (a checkout run without
    an install, as benchmarks/gpu_run.sh does), not through an installed package."""
    tmp = tmp_path_factory.mktemp("tp-linked")
    (tmp / "pkg").mkdir()
    (tmp / "pkg" / "redline").symlink_to(ROOT, target_is_directory=True)
    parent = ("import sys; from tests.test_tensor_parallel import WORKER, torchrun; "
              f"proc = torchrun([str(WORKER), '--launch-check', {str(tmp)!r}]); "
              "sys.stderr.write(proc.stderr[-3000:]); sys.exit(proc.returncode)")
    env = {**launch_env(), "PYTHONPATH": os.pathsep.join([str(tmp / "pkg"), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", parent], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(tmp / f"launch-rank{r}.pt", weights_only=True) for r in range(2)], tmp


def test_torchrun_children_import_redline_from_the_parents_path(linked_launch):
    results, tmp = linked_launch
    for result in results:
        assert result["redline"] == str(tmp / "pkg" / "redline" / "__init__.py")


def test_bench_tp_gives_each_rank_its_own_gpu_from_device_cuda(linked_launch):
    """`torchrun --nproc_per_node 2 benchmarks/bench.py --tp 2 --device cuda`: the flag is resolved to
    cuda:LOCAL_RANK once, not refused as an explicit cuda:N the second time."""
    results, _ = linked_launch
    for rank, result in enumerate(results):
        assert result.get("error") is None
        assert result["device"] == result["world"] == f"cuda:{rank}"


def test_multi_node_launch_gives_one_process_greedy_tokens(checkpoints, tmp_path):
    """`torchrun --nnodes 2`: two launch agents on 127.0.0.1 meet at a c10d rendezvous, one rank each (gloo); every
    rank holds half the heads and generates one process's greedy tokens."""
    from redline import generate
    from tests.tp_worker import NEW_TOKENS

    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend",
           "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", "redline-test", str(WORKER), "--greedy", str(tmp_path),
           PROMPT, str(checkpoints[0])]
    agents = [subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]
    outputs = [agent.communicate(timeout=LAUNCH_TIMEOUT_S) for agent in agents]
    for agent, (_, err) in zip(agents, outputs):
        assert agent.returncode == 0, err[-4000:]
    want = generate.LLM.load(checkpoints[0], device="cpu", compile=False).generate(
        PROMPT, max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True).token_ids
    for rank in range(2):
        got = torch.load(tmp_path / f"greedy-rank{rank}.pt", weights_only=True)
        assert got["world"] == [rank, 2, 0, 1]  # two nodes of one process: each its node's local rank 0
        assert got["local_heads"] == 2 and got["tokens"] == want


def test_engine_over_two_ranks_gives_one_process_tokens_with_preemption(checkpoints, tmp_path):
    """The batching engine on two ranks (gloo): rank 0 schedules and every rank runs each step on its KV heads; a
    pool too small for every request preempts some. Greedy and a seeded sampled request equal one process's."""
    from redline import generate
    from tests.tp_worker import engine_tokens

    proc = torchrun([str(WORKER), "--engine", str(tmp_path), str(checkpoints[0]), "cpu"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(tmp_path / "engine-rank0.pt", weights_only=True)
    want, _ = engine_tokens(generate.LLM.load(checkpoints[0], device="cpu", compile=False), compiled=False)
    assert got["local_kv_heads"] == 1  # each rank's pages held one of the 2 KV heads
    assert got["preemptions"] > 0
    assert got["tokens"] == want


def test_indivisible_config_is_refused_in_one_line(checkpoints):
    with pytest.raises(ValueError, match="n_head, n_kv_heads and intermediate_size divisible by 3") as info:
        tp.read_shards(read_checkpoint_info(checkpoints[0]), 0, 3, torch.device("cpu"))
    assert "\n" not in str(info.value) and "launch 1 or 2 processes" in str(info.value)
    llama3 = ModelArgs.from_name("Llama-3-8B")
    with pytest.raises(ValueError, match="n_kv_heads is 8"):
        tp.shard_args(llama3, 16)
    assert tp.shard_args(llama3, 8).n_kv_heads == 1 and tp.shard_args(llama3, 8).head_dim == 128


def test_cli_refusal_under_torchrun_is_one_line(checkpoints):
    proc = torchrun([str(ROOT / "generate.py"), "--checkpoint_path", str(checkpoints[0]), "--prompt", "x",
                     "--device", "cpu", "--no-compile"], nproc=3)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "divisible by 3" in errors[0], proc.stderr[-3000:]


def test_an_error_on_rank_zero_releases_the_following_ranks():
    """bench_serving.py under torchrun: rank 0's engine refuses a request after the other rank began to follow its
    steps; rank 0 still tells that rank to stop before it reports the error, so both end at once, without a
    traceback from the engine's exit handler."""
    proc = torchrun([str(ROOT / "benchmarks" / "bench_serving.py"), "--model", "debug-tiny", "--workload", "long",
                     "--prompt-tokens", "5000", "--num-requests", "1", "--device", "cpu"])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0
    assert errors == ["error: the prompt has 5000 tokens, but the model's context is 256; shorten it"], \
        proc.stderr[-3000:]
    assert "Exception ignored" not in proc.stderr and "core.py" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("which", [0, 1], ids=["float32", "int8"])
def test_each_rank_reads_only_its_slices(checkpoints, which):
    info = read_checkpoint_info(checkpoints[which])
    full = load_tensors(info)
    file_bytes = sum(t.numel() * t.element_size() for t in full.values())
    shards = [tp.read_shards(info, rank, 2, torch.device("cpu")) for rank in range(2)]
    replicated = sum(t.numel() * t.element_size() for n, t in full.items() if tp.shard_plan(n, info.args) is None)
    for tensors, bytes_read in shards:
        assert bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())
        assert bytes_read == replicated + (file_bytes - replicated) // 2  # half of every cut tensor, nothing more
    args = info.args
    for name, tensor in full.items():
        plan = tp.shard_plan(name, args)
        parts = [shards[r][0][name] for r in range(2)]
        if plan is None:
            assert all(torch.equal(p, tensor) for p in parts)
            continue
        dim, blocks = plan
        # Rank r's part of each stacked block (q, k, v; gate, up), in order: put the blocks back together.
        pieces = [p.split([b // 2 for b in blocks], dim=dim) for p in parts]
        rebuilt = torch.cat([torch.cat([pieces[r][i] for r in range(2)], dim=dim) for i in range(len(blocks))], dim=dim)
        assert torch.equal(rebuilt, tensor), name
    if which == 1:  # int8: wo's per-output-channel scales are whole on every rank, wqkv's cut with its rows
        assert shards[0][0]["layers.0.attention.wo.scales"].shape == full["layers.0.attention.wo.scales"].shape
        assert shards[0][0]["layers.0.attention.wqkv.scales"].shape[0] * 2 == \
            full["layers.0.attention.wqkv.scales"].shape[0]


def test_shard_args_divides_heads_and_keeps_head_dim():
    args = ModelArgs.from_name("Llama-2-70B")
    local = tp.shard_args(args, 2)
    assert (local.n_head, local.n_kv_heads, local.intermediate_size) == (32, 4, 14336)
    assert (local.dim, local.head_dim, local.q_size, local.kv_size) == (8192, 128, 4096, 512)
    assert tp.rank_ranges((8, 2, 2), 1, 2) == [(4, 8), (9, 10), (11, 12)]  # its q, k, v rows


def test_outside_torchrun_nothing_changes(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert tp.env_ranks() is None and tp.start() is None and tp.is_main_process()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert tp.start() is None
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="launch with torchrun"):
        tp.env_ranks()


def test_all_reduce_choice_is_checked_before_any_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv(tp.ALL_REDUCE_ENV, "ring")
    with pytest.raises(ValueError, match="choose one of: nccl, oneshot"):
        tp.start("cpu")
    monkeypatch.setenv(tp.ALL_REDUCE_ENV, "oneshot")
    with pytest.raises(ValueError, match="oneshot needs GPUs"):
        tp.start("cpu")
    assert not torch.distributed.is_initialized()
    assert not tp.is_main_process()


# The 2-GPU tests: each runs the worker under torchrun with each all-reduce.
two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
each_all_reduce = pytest.mark.parametrize("all_reduce", ["nccl", "oneshot"])


def run_on_two_gpus(worker_args: list[str], all_reduce: str) -> None:
    """The worker under torchrun on 2 GPUs with `all_reduce`; skips when this torch has no one-shot all-reduce."""
    if all_reduce == "oneshot" and not tp.one_shot_available():
        pytest.skip("this torch build has no symmetric-memory ops")
    proc = torchrun([str(WORKER), *worker_args], extra_env={tp.ALL_REDUCE_ENV: all_reduce})
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.gpu
@two_gpus
@each_all_reduce
def test_fused_decode_per_rank_equals_unfused_tensor_parallel(checkpoints, tmp_path, all_reduce):
    run_on_two_gpus(["--fused", str(tmp_path), str(checkpoints[0])], all_reduce)
    fused, unfused = (torch.load(tmp_path / f"{kind}-rank0.pt", weights_only=True) for kind in ("fused", "unfused"))
    torch.testing.assert_close(fused, unfused, atol=2e-3, rtol=2e-3)
    assert torch.equal(fused, torch.load(tmp_path / "fused-rank1.pt", weights_only=True))  # ranks agree bit for bit


@pytest.mark.gpu
@two_gpus
@each_all_reduce
def test_two_gpus_give_one_gpus_greedy_tokens(checkpoints, tmp_path, all_reduce):
    """The converted float32 checkpoint and its int8 copy, compiled with the fused decode: 2 GPUs against 1."""
    from redline import generate
    from tests.tp_worker import GPU_NEW_TOKENS

    run_on_two_gpus(["--gpu-greedy", str(tmp_path), PROMPT, *map(str, checkpoints)], all_reduce)
    for i, path in enumerate(checkpoints):
        one = generate.LLM.load(path, device="cuda").generate(PROMPT, max_new_tokens=GPU_NEW_TOKENS, temperature=0,
                                                              ignore_eos=True).token_ids
        for rank in range(2):
            two = torch.load(tmp_path / f"gpu-{i}-rank{rank}.pt", weights_only=True)
            first = next((j for j, (a, b) in enumerate(zip(one, two)) if a != b), None)
            assert first is None, f"{path.name}: 2 GPUs diverge from 1 at token {first} of {GPU_NEW_TOKENS}"


@pytest.mark.gpu
@two_gpus
@each_all_reduce
def test_engine_on_two_gpus_gives_one_gpus_tokens(checkpoints, tmp_path, all_reduce):
    """The batching engine compiled, with its decode graphs captured per rank (and steps launched before the one
    before them is read, whose tokens each rank takes from its own graph), with preemption: 2 GPUs against 1."""
    from redline import generate
    from tests.tp_worker import engine_tokens

    run_on_two_gpus(["--engine", str(tmp_path), str(checkpoints[0]), "cuda"], all_reduce)
    got = torch.load(tmp_path / "engine-rank0.pt", weights_only=True)
    want, _ = engine_tokens(generate.LLM.load(checkpoints[0], device="cuda", compile=True), compiled=True)
    assert got["preemptions"] > 0
    assert got["tokens"] == want


def test_bench_tp_needs_a_matching_torchrun_launch(monkeypatch):
    from redline.benchmarks.bench import parse_args

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc_per_node 2 benchmarks/bench.py --tp 2"):
        parse_args(["--tp", "2", "--model", "debug-tiny", "--device", "cpu"])
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="divisible by 3"):
        parse_args(["--tp", "3", "--model", "debug-tiny", "--device", "cpu"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--all-reduce oneshot needs GPUs; drop oneshot from --all-reduce"):
        parse_args(["--tp", "2", "--model", "debug-tiny", "--device", "cpu", "--all-reduce", "nccl,oneshot"])
    with pytest.raises(ValueError, match="unknown all-reduce 'ring'"):
        parse_args(["--tp", "2", "--model", "debug-tiny", "--device", "cpu", "--all-reduce", "ring"])
    assert parse_args(["--tp", "2", "--model", "debug-tiny", "--device", "cpu", "--all-reduce", "NCCL"]
                      ).all_reduce_modes == ("nccl",)
    with pytest.raises(ValueError, match="int4 group size 32 does not divide a layer's 80 inputs"):
        parse_args(["--tp", "2", "--model", "debug-tiny", "--device", "cpu", "--quant", "int4", "--groupsize", "32"])
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match="--all-reduce picks the all-reduce of a --tp run"):
        parse_args(["--model", "debug-tiny", "--device", "cpu", "--all-reduce", "nccl"])


@pytest.mark.slow
def test_bench_tp_under_torchrun_reports_the_sharded_model(tmp_path):
    import json

    out = tmp_path / "tp.json"
    proc = torchrun([str(ROOT / "benchmarks" / "bench.py"), "--tp", "2", "--model", "debug-tiny", "--quant",
                     "none,int8", "--all-reduce", "nccl", "--new-tokens", "4", "--runs", "1",
                     "--device", "cpu", "--json", str(out), "--profile", str(tmp_path / "traces"),
                     "--profile-steps", "2"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = json.loads(out.read_text())["records"]
    assert [(r["quant"], r["all_reduce_mode"]) for r in records] == [("none", "nccl"), ("int8", "nccl")]
    record = records[1]
    tiny = ModelArgs.from_name("debug-tiny")
    assert record["tp"] == 2 and record["all_reduce"]["all_reduces_per_token"] == 2 * tiny.n_layer
    assert record["all_reduce"]["bytes_each"] == tiny.dim * 2  # one bf16 hidden state
    assert record["all_reduce"]["trace"] == {"calls_per_token": None, "us_per_token": None,
                                             "exclusive_us_per_token": None}  # a CPU trace has no kernels
    traces = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert traces == [f"debug-tiny-{q}-b1-tp2-nccl-rank{r}.json.gz" for q in ("int8", "none") for r in (0, 1)]
    assert proc.stdout.count("debug-tiny TP2 | int8") >= 2  # the tables, printed by rank 0 alone
    assert proc.stdout.count("# Redline benchmark") == 1
    # One GPU's run of the same model merged with the TP run gives the table of TP against one GPU.
    single = tmp_path / "one.json"
    from redline.benchmarks import bench

    assert bench.main(["--model", "debug-tiny", "--quant", "int8", "--new-tokens", "4", "--runs", "1",
                       "--device", "cpu", "--json", str(single)]) == 0
    merged = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--merge", f"{single},{out}"],
                            cwd=ROOT, env=launch_env(), capture_output=True, text=True,
                            timeout=LAUNCH_TIMEOUT_S)
    assert merged.returncode == 0, merged.stderr[-4000:]
    assert "Tensor parallel against one GPU" in merged.stdout
    assert "| debug-tiny TP2 | int8 | 1 |" in merged.stdout


def assert_two_ranks_give_one_process_logits(paths: list[Path], out_dir: Path) -> None:
    """Each checkpoint's float32 logits through two ranks' sharded models equal one process's (within 1e-4)."""
    from redline.checkpoint import read_checkpoint_info
    from redline.quantize import load_model
    from tp_worker import logits

    proc = torchrun([str(WORKER), "--logits", str(out_dir), *map(str, paths)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    for i, path in enumerate(paths):
        want = logits(load_model(read_checkpoint_info(path), "cpu", torch.float32))
        for rank in (0, 1):
            got = torch.load(out_dir / f"logits-{i}-rank{rank}.pt", weights_only=True)
            assert (got - want).abs().max().item() <= 1e-4, (str(path.relative_to(out_dir)), rank)


# Families with biases, per-head q/k norms, Gemma's sandwich norms and windows, partial rotary with LongRoPE, and
# Granite's multipliers.
TP_FAMILIES = ["qwen2_tied", "qwen3_tied_bias", "gemma3", "phi3_longrope", "granite"]


def test_family_models_over_two_ranks_give_one_process_logits(tmp_path):
    """Each rank holds its rows of the q/k/v bias and the whole norms; the all-reduced logits equal the single
    process's."""
    from conftest import save_family_checkpoint
    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    paths = [convert_hf_checkpoint(save_family_checkpoint(tmp_path / v, v)[0], dtype="float32") for v in TP_FAMILIES]
    assert_two_ranks_give_one_process_logits(paths, tmp_path)


def test_moe_models_over_two_ranks_give_one_process_logits(tmp_path):
    """Each rank holds its part of every expert's intermediate features (float and int8) and the whole router; the
    all-reduced logits equal the single process's."""
    from conftest import save_moe_checkpoint
    from redline.quantize import quantize_checkpoint
    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    variants = ["mixtral", "qwen3_moe"]
    paths = [convert_hf_checkpoint(save_moe_checkpoint(tmp_path / v, v)[0], dtype="float32") for v in variants]
    paths.append(quantize_checkpoint(paths[1], "int8", tmp_path / "qwen3_moe.int8.safetensors"))
    assert_two_ranks_give_one_process_logits(paths, tmp_path)


def test_olmo2_full_width_qk_norm_is_refused_over_several_ranks():
    from redline.model import ModelArgs

    with pytest.raises(ValueError, match="q/k norm over the whole projection width"):
        tp.shard_args(ModelArgs.from_name("OLMo-2-7B"), 2)


def test_int4_checkpoints_over_two_ranks_give_one_process_logits(tmp_path):
    """int4 files split their packed inputs and group scales with the inputs they cut (wo, w2, the experts' w2):
    a dense family and a mixture of experts, each rank's part whole groups of 32."""
    from conftest import MOE_VARIANTS, save_family_checkpoint, save_random_hf_model
    from redline.quantize import quantize_checkpoint
    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    dense = save_family_checkpoint(tmp_path / "qwen2", "qwen2_tied", intermediate_size=128)[0]
    arch, extra = MOE_VARIANTS["qwen3_moe"]
    moe = save_random_hf_model(tmp_path / "qwen3_moe", arch, extra, 0, dict(head_dim=16, intermediate_size=128,
                                                                             moe_intermediate_size=64),
                               wide_routers=True)[0]
    paths = [quantize_checkpoint(convert_hf_checkpoint(d, dtype="float32"), "int4",
                                 tmp_path / f"{d.name}.int4.safetensors", group_size=32) for d in (dense, moe)]
    assert_two_ranks_give_one_process_logits(paths, tmp_path)


def test_an_int4_split_that_cuts_a_group_is_refused_in_one_line():
    with pytest.raises(ValueError, match="cannot split into whole units") as info:
        tp.stored_blocks("layers.0.feed_forward.w2.scales", (96,), 3, 2)  # 3 groups of 32 over 2 ranks
    assert "\n" not in str(info.value)
    assert tp.stored_blocks("layers.0.feed_forward.w2.weight", (128,), 64, 2) == (64,)  # two inputs a byte
    assert tp.stored_blocks("layers.0.attention.wqkv.weight", (64, 32, 32), 128, 2) == (64, 32, 32)
