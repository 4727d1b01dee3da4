"""Tensor parallelism over the ranks of a torchrun launch: each rank holds whole attention heads and a slice of the
feed-forward, reads only its slices of the checkpoint, and sums the row-parallel projections with an all-reduce.

    torchrun --nproc_per_node 2 generate.py --checkpoint_path PATH --prompt TEXT
    # or, inside a torchrun-launched process:  LLM.load(path)

How the weights are cut over N ranks (rank r keeps part r of every block listed):
    attention.wqkv  rows: its q heads, then its k heads, then its v heads (the q, k and v blocks each cut in N)
    feed_forward.w13  rows: its gate rows, then its up rows
    attention.wo, feed_forward.w2  columns (input features), then an all-reduce of the outputs
    experts (Mixtral, Qwen3-MoE): each expert's intermediate features, as w13 and w2 above (w13 (E, 2I, dim) along
        its rows, w2 (E, dim, I) along its columns, int4 experts' packed columns and group scales with them); the
        router is replicated, so every rank routes alike, and the whole MoEFeedForward's output is all-reduced
    embedding, norms, output head: replicated
So a rank's model is a plain model.Transformer of ModelArgs with n_head / N, n_kv_heads / N and
intermediate_size / N (head_dim and dim unchanged), with wo and w2 wrapped in RowParallelLinear.

int8 (per output channel): the scales of the row-cut layers are cut with their rows; those of wo and w2 belong to
output channels, which every rank keeps, so they are replicated (sum over r of (x_r W_r^T) * s = (x W^T) * s).
A group-wise scheme (int4) shards the same way provided each rank's part of a cut dimension is a whole number of
groups and of packing units: for wo and w2 (cut along the input features K) K / N must be a multiple of the group
size and of the packed tile width, and their (N_out, K / group) scales are cut along the same columns; for wqkv and
w13 the per-row groups follow their rows.

The all-reduce is torch.distributed's collective on the default group (NCCL or RCCL on GPUs, gloo on the CPU),
traced by torch.compile as a functional collective and captured in the decode CUDA graph; REDLINE_ALL_REDUCE=oneshot
selects the one-shot all-reduce over symmetric memory for small tensors (the batch-1 decode's), checked once at setup.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import msgspec
import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from torch import Tensor

from redline.checkpoint import CheckpointInfo, meta_model, model_state_dict
from redline.model import ModelArgs, MoEFeedForward, Transformer
from redline.quantize import prepare_quantized_structure
from redline.sampling import SEED_LIMIT, SamplingParams

# The environment variable that picks the all-reduce, and what it may name.
ALL_REDUCE_ENV = "REDLINE_ALL_REDUCE"
ALL_REDUCE_MODES = ("nccl", "oneshot")
# Tensors up to this size take the one-shot all-reduce (each rank reads every peer's copy, so it pays off only for
# small messages; inductor's own one-shot threshold is the same): 8 rows of an 8192-wide bf16 hidden state.
ONE_SHOT_MAX_BYTES = 128 * 1024
# The model dimensions a rank holds a part of; each must divide by the number of ranks.
SHARDED_DIMS = ("n_head", "n_kv_heads", "intermediate_size")
# The process groups this module initialized (start), which stop() alone destroys: a caller's own group is theirs.
_STARTED_GROUPS: set[str] = set()
# Seconds a rank other than 0 waits before exiting with an error, so that rank 0 has printed it by then.
ERROR_GRACE_S = 2.0


@dataclass(frozen=True)
class TPWorld:
    """This process's place in a tensor-parallel run."""

    rank: int
    world_size: int
    device: torch.device
    group_name: str = ""  # the default process group's name ("" when only loading shards, with no group)
    all_reduce: str = "nccl"  # one of ALL_REDUCE_MODES

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} of {self.world_size} ranks is impossible; launch with torchrun")
        if self.all_reduce not in ALL_REDUCE_MODES:
            raise ValueError(f"{ALL_REDUCE_ENV}={self.all_reduce!r}; choose one of: {', '.join(ALL_REDUCE_MODES)}")


def env_ranks() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun's environment; None outside torchrun or with one rank."""
    if os.environ.get("WORLD_SIZE") is None:
        return None
    try:
        world_size = int(os.environ["WORLD_SIZE"])
        rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        raise ValueError("WORLD_SIZE, RANK and LOCAL_RANK must be integers; launch with torchrun") from None
    return None if world_size == 1 else (rank, world_size, local_rank)


def is_main_process() -> bool:
    """Rank 0 of a torchrun launch (or a process outside one): the one that prints."""
    return os.environ.get("RANK", "0") == "0"


def all_reduce_mode() -> str:
    mode = os.environ.get(ALL_REDUCE_ENV, "nccl").strip().lower() or "nccl"
    if mode not in ALL_REDUCE_MODES:
        raise ValueError(f"{ALL_REDUCE_ENV}={mode!r}; choose one of: {', '.join(ALL_REDUCE_MODES)}")
    return mode


def rank_device(requested: str | None, local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK for a GPU run (the default where GPUs are visible), else the CPU."""
    if requested is not None and torch.device(requested).type == "cpu":
        return torch.device("cpu")
    if requested is not None and torch.device(requested).index is not None:
        raise ValueError(f"--device {requested}: under torchrun each rank uses cuda:LOCAL_RANK; pass --device cuda")
    if not torch.cuda.is_available():
        if requested is not None:
            raise ValueError("--device cuda was asked for, but no CUDA/ROCm GPU is visible; use --device cpu")
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible; "
                         f"launch at most {torch.cuda.device_count()} processes per node")
    return torch.device("cuda", local_rank)


def start(requested_device: str | None = None) -> TPWorld | None:
    """Join the torchrun launch this process belongs to: the default process group (NCCL/RCCL for GPUs, gloo for the
    CPU; one already initialized is used as it is) and this rank's device. None outside torchrun or with one rank."""
    ranks = env_ranks()
    if ranks is None:
        return None
    rank, world_size, local_rank = ranks
    mode = all_reduce_mode()
    device = rank_device(requested_device, local_rank)
    check_all_reduce(mode, device, world_size, f"{ALL_REDUCE_ENV}=oneshot", "unset it")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        _STARTED_GROUPS.add(dist.group.WORLD.group_name)
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ValueError(f"the process group has rank {dist.get_rank()} of {dist.get_world_size()}, but torchrun "
                         f"says {rank} of {world_size}; initialize it from torchrun's environment")
    return TPWorld(rank, world_size, device, dist.group.WORLD.group_name, mode)


def child_import_path() -> str:
    """PYTHONPATH for a child process (a rank this process launches) that imports `redline` from where this process
    does: the folder that holds this process's `redline` when it is found on the path (a checkout run without an
    install, linked under that name), then this process's own PYTHONPATH."""
    import redline

    package = Path(redline.__file__).parent  # not resolved: a linked package's folder is the link
    holder = package.parent
    paths = [str(holder)] if (holder / "redline").resolve() == package.resolve() else []
    paths += os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return os.pathsep.join(dict.fromkeys(p for p in paths if p))


# The variables torchrun gives each rank, which start() reads.
RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK")


def rank_environments(world_size: int) -> list[dict[str, str]]:
    """The environment of each of world_size ranks on this host, as torchrun sets them (a free port on 127.0.0.1
    to meet at), with this process's import path."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": child_import_path(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)}
    return [{**env, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(world_size)]


def check_all_reduce(mode: str, device: torch.device, world_size: int, what: str, fix: str) -> None:
    """One line when the all-reduce `mode` cannot run here: the one-shot needs GPUs, all on one host. `what` names
    the setting that asked for it and `fix` how to drop it."""
    if mode not in ALL_REDUCE_MODES:
        raise ValueError(f"{what}: unknown all-reduce {mode!r}; choose one of: {', '.join(ALL_REDUCE_MODES)}")
    if mode == "oneshot" and device.type != "cuda":
        raise ValueError(f"{what} needs GPUs; {fix} to use the process group's all-reduce")
    if mode == "oneshot" and os.environ.get("LOCAL_WORLD_SIZE", str(world_size)) != str(world_size):
        raise ValueError(f"{what} needs every rank on one host (symmetric memory is peer memory); {fix} for a run "
                         f"over several hosts")


# ---------------------------------------------------------------------------------------------------------------------
# Which part of each tensor a rank holds.


def shard_args(args: ModelArgs, world_size: int) -> ModelArgs:
    """One rank's ModelArgs: n_head, n_kv_heads, intermediate_size and moe_intermediate_size divided by the number of
    ranks."""
    dims = SHARDED_DIMS + (("moe_intermediate_size",) if args.n_experts else ())
    if args.qk_norm == "full" and world_size > 1:
        raise ValueError("tensor parallel cannot split a q/k norm over the whole projection width (OLMo 2): each "
                         "rank would normalize its own heads only; run this model on one process")
    for name in dims:
        value = getattr(args, name)
        if value % world_size:
            fits = [n for n in range(1, args.n_kv_heads + 1) if all(getattr(args, d) % n == 0 for d in dims)]
            raise ValueError(f"tensor parallel over {world_size} ranks needs {', '.join(dims[:-1])} and {dims[-1]} "
                             f"divisible by {world_size}, but {name} is {value}; launch "
                             f"{' or '.join(map(str, fits))} processes per model")
    return dataclasses.replace(args, n_head=args.n_head // world_size, n_kv_heads=args.n_kv_heads // world_size,
                               intermediate_size=args.intermediate_size // world_size, head_dim=args.head_dim,
                               moe_intermediate_size=args.moe_intermediate_size // world_size)


def shard_plan(name: str, args: ModelArgs, scheme: str = "none") -> tuple[int, tuple[int, ...]] | None:
    """How the full-model tensor `name` is cut: (dim, blocks) says that along dim it stacks blocks of these sizes,
    each split evenly over the ranks (rank r keeps part r of every block, in order). None: replicated. The sizes
    count inputs; a tensor that packs them (int4: two a byte) or groups them (int4 scales: one a group) along dim
    holds a whole fraction of them (SliceReader.read scales the blocks). scheme: the checkpoint's quantization."""
    layer = name.split(".", 2)[-1] if name.startswith("layers.") else name
    if layer in ("attention.wqkv.weight", "attention.wqkv.scales", "attention.wqkv_bias"):
        return 0, (args.q_size, args.kv_size, args.kv_size)
    if layer in ("feed_forward.w13.weight", "feed_forward.w13.scales"):
        return 0, (args.intermediate_size, args.intermediate_size)
    grouped = scheme == "int4"  # the scales of the input-cut layers are per group of inputs, cut with them
    if layer == "attention.wo.weight" or (grouped and layer == "attention.wo.scales"):
        return 1, (args.q_size,)
    if layer == "feed_forward.w2.weight" or (grouped and layer == "feed_forward.w2.scales"):
        return 1, (args.intermediate_size,)
    if layer in ("feed_forward.w13", "feed_forward.w13_scales"):  # experts (E, 2I, dim) and their scales (E, 2I, ...)
        return 1, (args.moe_intermediate_size, args.moe_intermediate_size)
    if layer == "feed_forward.w2" or (grouped and layer == "feed_forward.w2_scales"):  # experts (E, dim, I)
        return 2, (args.moe_intermediate_size,)
    return None  # embedding, norms, output head, and the int8 per-output-channel scales of wo and w2


def rank_ranges(blocks: tuple[int, ...], rank: int, world_size: int) -> list[tuple[int, int]]:
    """[start, stop) of rank's part of each stacked block."""
    ranges, offset = [], 0
    for size in blocks:
        part = size // world_size
        ranges.append((offset + rank * part, offset + (rank + 1) * part))
        offset += size
    return ranges


def stored_blocks(name: str, blocks: tuple[int, ...], stored: int, world_size: int) -> tuple[int, ...]:
    """The blocks of a plan in the units `name` stores along the cut dim (stored of them for sum(blocks) inputs: a
    packed or grouped tensor holds a whole fraction); ValueError when a rank's part would not be whole units."""
    total = sum(blocks)
    if stored == total:
        return blocks
    ratio = total // stored if stored and total % stored == 0 else 0
    if not ratio or any((b // ratio) % world_size or b % ratio for b in blocks):
        raise ValueError(f"{name} holds {stored} units for {total} inputs along the cut dimension, which "
                         f"{world_size} ranks cannot split into whole units; use fewer ranks or a smaller int4 group")
    return tuple(b // ratio for b in blocks)


class SliceReader:
    """Reads tensors, or only the slices a rank needs, from a safetensors file; counts the bytes it returned."""

    def __init__(self, path: Path, device: torch.device) -> None:
        self.path = path
        self.device = device
        self.bytes_read = 0
        self._file: Any = None

    def __enter__(self) -> SliceReader:
        try:
            self._file = safe_open(str(self.path), "pt", device=str(self.device))
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"cannot read {self.path} ({exc}); the file may be truncated, re-convert it") from None
        return self

    def __exit__(self, *exc: Any) -> None:
        self._file = None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(self._file.get_slice(name).get_shape()) for name in self._file.keys()}

    def read(self, name: str, plan: tuple[int, tuple[int, ...]] | None, rank: int, world_size: int) -> Tensor:
        try:
            if plan is None:
                tensor = self._file.get_tensor(name)
            else:
                dim, blocks = plan
                view = self._file.get_slice(name)
                blocks = stored_blocks(name, blocks, view.get_shape()[dim], world_size)
                cut = lambda a, b: view[(slice(None),) * dim + (slice(a, b),)]  # noqa: E731
                parts = [cut(a, b) for a, b in rank_ranges(blocks, rank, world_size)]
                tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"cannot read {name} from {self.path} ({exc}); the file may be truncated, "
                             f"re-convert it") from None
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def structure(args: ModelArgs, quantization: dict[str, Any]) -> Transformer:
    """A meta-device model of these args with the checkpoint's quantization structure."""
    model = meta_model(args)
    prepare_quantized_structure(model, quantization)
    return model


def read_shards(info: CheckpointInfo, rank: int, world_size: int, device: torch.device,
                dtype: torch.dtype | None = None) -> tuple[dict[str, Tensor], int]:
    """Rank's tensors of the checkpoint (float ones in dtype, scales as stored), read slice by slice, and the number
    of bytes read. The file's names and full shapes are checked against its own config first."""
    full_args = info.args
    local = model_state_dict(structure(shard_args(full_args, world_size), info.quantization))
    expected = {n: tuple(t.shape) for n, t in model_state_dict(structure(full_args, info.quantization)).items()}
    dtype = dtype or info.dtype
    tensors: dict[str, Tensor] = {}
    with SliceReader(info.path, device) as reader:
        found = reader.shapes()
        missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
        if missing or unexpected:
            raise ValueError(f"{info.path} does not match its own config: missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]}; re-convert it")
        for name, shape in expected.items():
            if found[name] != shape:
                raise ValueError(f"{info.path}: tensor {name} has shape {found[name]}, expected {shape}")
        for name, own in local.items():
            tensor = reader.read(name, shard_plan(name, full_args, info.scheme), rank, world_size)
            if tuple(tensor.shape) != tuple(own.shape):
                raise ValueError(f"{info.path}: {name} sliced to {tuple(tensor.shape)}, expected {tuple(own.shape)}")
            if tensor.is_floating_point() and not name.endswith((".scales", "_scales")):
                tensor = tensor.to(dtype)
            tensors[name] = tensor
    return tensors, reader.bytes_read


def load_sharded_model(info: CheckpointInfo, world: TPWorld, dtype: torch.dtype | None = None) -> Transformer:
    """This rank's model (not yet wrapped: see apply_tensor_parallel), built from its slices of the checkpoint."""
    model = structure(shard_args(info.args, world.world_size), info.quantization)
    tensors, _ = read_shards(info, world.rank, world.world_size, world.device, dtype)
    model.load_state_dict(tensors, strict=False, assign=True)
    if model.args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.rope = torch.empty(0, device=world.device)
    model.rope_local = torch.empty(0, device=world.device)
    return model.eval()


# ---------------------------------------------------------------------------------------------------------------------
# The all-reduce.


# The symmetric-memory staging buffers of the one-shot all-reduce, by (group name, dtype, device index): allocated and
# exchanged between ranks once (prepare_one_shot), before any graph is captured.
_ONE_SHOT_BUFFERS: dict[tuple[str, torch.dtype, int | None], Tensor] = {}


def one_shot_available() -> bool:
    try:
        torch.ops.symm_mem.one_shot_all_reduce
    except (AttributeError, RuntimeError):
        return False
    return True


@torch.library.custom_op("redline::one_shot_all_reduce", mutates_args=())
def one_shot_all_reduce(x: Tensor, group_name: str) -> Tensor:
    """The sum of x over the group's ranks, by torch's one-shot kernel: x is copied into this rank's symmetric
    buffer and every rank reads all buffers (rank order, so every rank gets the same bits)."""
    buffer = _ONE_SHOT_BUFFERS.get((group_name, x.dtype, x.device.index))
    if buffer is None or x.numel() > buffer.numel():
        raise RuntimeError(f"no symmetric buffer of {x.numel()} {x.dtype} elements on {x.device} for group "
                           f"{group_name}; call tensor_parallel.prepare_one_shot first")
    staging = buffer[:x.numel()]
    flat = x.contiguous().view(-1)
    ops = torch.ops.symm_mem
    if hasattr(ops, "one_shot_all_reduce_copy"):
        out = ops.one_shot_all_reduce_copy(staging, flat, "sum", group_name)
    else:
        staging.copy_(flat)
        out = ops.one_shot_all_reduce(staging, "sum", group_name)
    return out.view(x.shape)


@one_shot_all_reduce.register_fake
def _one_shot_all_reduce_fake(x: Tensor, group_name: str) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def prepare_one_shot(world: TPWorld, dtype: torch.dtype) -> None:
    """Allocate and exchange the symmetric buffer for dtype, then check that a one-shot all-reduce sums right."""
    if not one_shot_available():
        raise ValueError(f"{ALL_REDUCE_ENV}=oneshot needs torch's symmetric-memory ops (torch.ops.symm_mem), which "
                         f"this torch build lacks; unset {ALL_REDUCE_ENV}")
    key = (world.group_name, dtype, world.device.index)
    if key in _ONE_SHOT_BUFFERS:
        return
    import torch.distributed._symmetric_memory as symm_mem

    with warnings.catch_warnings():  # deprecated (a no-op need) in newer torch, required by older ones
        warnings.simplefilter("ignore", FutureWarning)
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(world.group_name)
    itemsize = torch.empty((), dtype=dtype).element_size()
    buffer = symm_mem.empty(ONE_SHOT_MAX_BYTES // itemsize, dtype=dtype, device=world.device)
    symm_mem.rendezvous(buffer, world.group_name)
    _ONE_SHOT_BUFFERS[key] = buffer
    probe = torch.full((1024,), float(world.rank + 1), dtype=dtype, device=world.device)
    total = torch.ops.redline.one_shot_all_reduce(probe, world.group_name)
    expected = world.world_size * (world.world_size + 1) / 2
    if not bool((total.float() == expected).all()):
        del _ONE_SHOT_BUFFERS[key]
        raise ValueError(f"the one-shot all-reduce summed wrong on rank {world.rank}; unset {ALL_REDUCE_ENV} to "
                         f"use the process group's all-reduce")


def all_reduce(x: Tensor, group_name: str, mode: str = "nccl") -> Tensor:
    """The sum of x over the ranks. Traced by torch.compile (a functional collective, or the one-shot custom op for
    a small x when mode is "oneshot"), so it is captured in the CUDA graph."""
    if mode == "oneshot" and x.numel() * x.element_size() <= ONE_SHOT_MAX_BYTES:
        return torch.ops.redline.one_shot_all_reduce(x, group_name)
    import torch.distributed._functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group_name))


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split over the ranks: this rank's partial product, all-reduced."""

    def __init__(self, inner: nn.Module, world: TPWorld) -> None:
        super().__init__()
        self.inner = inner
        self.group_name = world.group_name
        self.mode = world.all_reduce
        self.rank = world.rank

    def forward(self, x: Tensor) -> Tensor:
        return self.reduce(self.inner(x))

    def reduce(self, partial: Tensor) -> Tensor:
        """The sum of every rank's partial product (kernels.fused_decode calls it on its fused one)."""
        return all_reduce(partial, self.group_name, self.mode)


def apply_tensor_parallel(model: Transformer, world: TPWorld) -> Transformer:
    """Wrap each block's wo and w2 (a rank's model from load_sharded_model) in RowParallelLinear, in place; set up the
    one-shot all-reduce when it is selected. Quantize (quantize_) before this, not after."""
    for layer in model.layers:
        if not isinstance(layer.attention.wo, RowParallelLinear):
            layer.attention.wo = RowParallelLinear(layer.attention.wo, world)
            if isinstance(layer.feed_forward, MoEFeedForward):  # every expert's partial sum, all-reduced at once
                layer.feed_forward = RowParallelLinear(layer.feed_forward, world)
            else:
                layer.feed_forward.w2 = RowParallelLinear(layer.feed_forward.w2, world)
    if world.all_reduce == "oneshot":
        prepare_one_shot(world, model.cache_dtype)
    return model


def parallel_layer(model: nn.Module) -> RowParallelLinear | None:
    """The model's first RowParallelLinear: None when it runs on one process."""
    return next((m for m in model.modules() if isinstance(m, RowParallelLinear)), None)


# ---------------------------------------------------------------------------------------------------------------------
# Agreement between ranks.


def agreed_sampling(sampling: SamplingParams, model: nn.Module) -> SamplingParams:
    """For a rank's model, an unseeded sampling gets rank 0's fresh seed, so every rank draws the same tokens (the
    noise is a function of (seed, position)); anything else is returned as it is."""
    if sampling.is_greedy or sampling.seed is not None or parallel_layer(model) is None:
        return sampling
    seed = [int(torch.randint(0, SEED_LIMIT - 1, ()).item()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(seed, src=0)
    return dataclasses.replace(sampling, seed=seed[0])


def report_error(line: str) -> None:
    """Print a one-line error on rank 0 (every rank meets the same error); the other ranks wait a moment first, since
    torchrun stops every rank as soon as one exits with an error, which could cut rank 0 off before it prints."""
    if is_main_process():
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(ERROR_GRACE_S)


# msgpack extension code of a tensor inside a StepChannel message.
TENSOR_EXT = 1


def _encode_tensor(value: Any) -> Any:
    if not isinstance(value, Tensor):
        raise TypeError(f"a step message cannot carry {type(value).__name__}")
    host = value.detach().contiguous().cpu()
    raw = host.view(torch.uint8).numpy().tobytes() if host.numel() else b""
    return msgspec.msgpack.Ext(TENSOR_EXT, msgspec.msgpack.encode([str(host.dtype).removeprefix("torch."),
                                                                   list(host.shape), raw]))


def _decode_tensor(code: int, data: memoryview) -> Any:
    if code != TENSOR_EXT:
        raise ValueError(f"unknown extension {code} in a step message")
    dtype, shape, raw = msgspec.msgpack.decode(data)
    kind = getattr(torch, dtype)
    if not raw:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(kind).reshape(shape)


class StepChannel:
    """Rank 0 tells every other rank what to run next, in order: a kind and its fields (numbers, strings, lists,
    dicts and tensors; msgpack through msgspec, tensors as raw bytes that arrive on the CPU), broadcast over a gloo
    group, the CPU side of the world whatever backend its devices use. Constructing one is collective."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")
        self.rank = dist.get_rank(self.group)
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_encode_tensor)
        self._decoder = msgspec.msgpack.Decoder(ext_hook=_decode_tensor)

    def send(self, kind: str, **fields: Any) -> None:
        """Rank 0: broadcast one message."""
        payload = self._encoder.encode([kind, fields])
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.group)

    def receive(self) -> tuple[str, dict[str, Any]]:
        """Any other rank: the next message rank 0 sent (blocks until it comes)."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.group)
        kind, fields = self._decoder.decode(payload.numpy().tobytes())
        return kind, fields


def engine_channel(model: nn.Module) -> StepChannel | None:
    """The channel a batching engine over this rank's model drives the other ranks with (collective: every rank
    makes its engine); None when the model runs on one process."""
    return StepChannel() if parallel_layer(model) is not None else None


def agreed_pages(channel: StepChannel, pages: int) -> int:
    """The fewest KV pages any rank has room for: every rank's pool then holds the same page ids."""
    least = torch.tensor([pages], dtype=torch.int64)
    dist.all_reduce(least, op=dist.ReduceOp.MIN, group=channel.group)
    return int(least.item())


class NullWriter:
    """A text stream that drops what it is given: the output of ranks other than 0."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def stop() -> None:
    """Leave the process group that start() initialized (at the end of a CLI run); a group made by the caller stays.
    Called while an error propagates (from a `finally`), it leaves the group as it is: destroying it waits for the
    other ranks, which may be blocked in a step this rank will never send; the error is printed, this rank exits and
    the launcher stops the others.

    NCCL: once every rank's work is done (a barrier), the communicators are left open and the process must end
    through exit_process(). NCCL frees a communicator only after the CUDA graphs that captured its collectives are
    gone, so destroying or aborting it here, or the process group's destructor at interpreter exit, waits for ever
    (https://github.com/pytorch/pytorch/issues/115388; both were seen to hang on 2 H200s); ending the process frees
    the communicators and the graphs together."""
    if sys.exc_info()[1] is not None:
        return
    if not (dist.is_available() and dist.is_initialized() and dist.group.WORLD.group_name in _STARTED_GROUPS):
        return
    _STARTED_GROUPS.discard(dist.group.WORLD.group_name)
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()
        dist.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()
        return
    dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End this process with exit status `code`: sys.exit, or, while an NCCL process group is still up (stop() leaves
    it so; see there), os._exit once stdout and stderr are flushed, so the interpreter's teardown never waits on it."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
