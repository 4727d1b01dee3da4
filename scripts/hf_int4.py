"""The 4-bit layouts of Hugging Face checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized) read into Redline's
int4 layout (quantize.py) once, at conversion, with no float round trip.

Each layout stores, per linear module, 4-bit codes q, fp16 scales s and zero points z in groups of G consecutive
inputs of a row, and means w = s * (q - z):
  AWQ (GEMM)                 qweight int32 (K, N/8), eight outputs a word in the order 0, 2, 4, 6, 1, 3, 5, 7 (one
                             nibble each, low first); qzeros int32 (K/G, N/8) packed the same way; scales (K/G, N).
  GPTQ                       qweight int32 (K/8, N), eight consecutive inputs a word, low nibble first; qzeros
                             int32 (K/G, N/8), eight outputs a word; scales (K/G, N); g_idx (K,) the group of each
                             input. Files in the original format ("gptq", v1) store z - 1 (z = (stored + 1) & 15, as
                             AutoGPTQ reads it); "gptq_v2" stores z.
  compressed-tensors         weight_packed int32 (N, K/8), eight consecutive inputs a word, low nibble first, each
  (pack-quantized)           stored as q + 8 for signed q; weight_scale (N, K/G) or (N, 1) for the channel
                             strategy; weight_zero_point int32 (N/8, K/G) packed along the rows (asymmetric only,
                             else z = 8); weight_g_idx (K,) with actorder "group".
What is kept exactly: every code (Redline's bytes are GPTQ's and compressed-tensors' words, byte for byte; AWQ's are
reordered), every scale fp16 holds (AWQ's and GPTQ's are fp16; a bf16 scale fits unless it is below 2^-17), and
symmetric zero points (offset -8s, a power-of-two multiple). What is not: an asymmetric zero point becomes Redline's
offset -s * z rounded once to fp16 (at most half an fp16 step of s * z); a bf16/fp32 scale fp16 cannot hold is
rounded to the nearest fp16 (counted per module in the metadata). A group larger than
Redline's (channel strategy, group_size -1, 256) is split into Redline groups sharing its scale and offset.

Act-order (GPTQ desc_act, compressed-tensors actorder "group"): a g_idx that is the plain order (input k in group
k // G) is nothing to do. Otherwise it is folded at conversion where the model allows it: a down projection's inputs
are reordered so that its groups are contiguous, and the rows of the gate and up projections that produce those inputs
are reordered with them (exact: the product is the same sum). Act-order on another projection, whose inputs come
from the residual stream or the attention, has no such fold and is refused.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from redline.quantize import DEFAULT_GROUP_SIZE, MIN_GROUP_SIZE, pack_int4, unpack_int4

# The quant_method values read here.
QUANT_METHODS = ("awq", "gptq", "compressed-tensors")
# AWQ's GEMM packing: nibble p of a word holds output 8j + AWQ_ORDER[p].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The zero point of a symmetric 4-bit code (w = s * (q - 8)).
SYMMETRIC_ZERO = 8
# Each layout's tensors of one module, by suffix: (codes, scales, zeros, group index).
SUFFIXES = {"awq": ("qweight", "scales", "qzeros", None), "gptq": ("qweight", "scales", "qzeros", "g_idx"),
            "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx")}
# compressed-tensors tensors that carry nothing the conversion needs.
CT_IGNORED_SUFFIXES = ("weight_shape",)
# A down projection's name, and the projections whose rows produce its inputs (Llama/Qwen MLPs and experts,
# Mixtral's w1/w3/w2, Phi-3's fused gate_up_proj).
DOWN_PROJECTION = re.compile(r"(.+\.)(down_proj|w2)")
FEEDING_PROJECTIONS = {"down_proj": ("gate_proj", "up_proj", "gate_up_proj"), "w2": ("w1", "w3")}


@dataclass(frozen=True)
class Int4Source:
    """What a checkpoint's quantization_config says, checked: the layout and how to read its zero points."""

    method: str
    zero_plus_one: bool = False  # GPTQ v1: the stored zero is z - 1
    describe: str = ""


@dataclass
class Int4Module:
    """One linear module's 4-bit weight: w[n, k] = scales[n, g] * (q[n, k] - zeros[n, g]) with g = group[k].
    packed: uint8 (N, K/2) in Redline's nibble order (input 2i low in byte i); scales fp16 (N, K/G); zeros int16
    (N, K/G); group_index (K,) int64, or None for the plain order k // G."""

    packed: Tensor
    scales: Tensor
    zeros: Tensor
    group_index: Tensor | None = None
    bias: Tensor | None = None
    rounded_scales: int = 0  # scales of the file that fp16 holds only rounded

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], 2 * self.packed.shape[1]

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scales.shape[1]


# Older exports keep the quantization settings beside config.json: AutoGPTQ's quantize_config.json, AutoAWQ's
# quant_config.json (file name -> the quant_method it implies when the file does not name one).
SIDE_CONFIG_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}


def side_quantization_config(folder: Path) -> dict[str, Any] | None:
    """The quantization settings of a folder whose config.json has no quantization_config, from the file an older
    exporter wrote beside it; None when there is none."""
    for name, method in SIDE_CONFIG_FILES.items():
        path = folder / name
        if path.is_file():
            try:
                qc = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
                raise ValueError(f"cannot read {path} ({exc}); re-download it") from None
            if not isinstance(qc, dict):
                raise ValueError(f"{path} is not a JSON object; re-download it")
            return {"quant_method": method, **qc}
    return None


def refuse(field_name: str, value: Any, why: str) -> ValueError:
    return ValueError(f"quantization_config.{field_name} is {value!r}: {why}")


def int4_source(config: dict[str, Any]) -> Int4Source | None:
    """The checkpoint's 4-bit layout from config.json's quantization_config; None for an unquantized checkpoint.
    Anything Redline's int4 layout cannot represent is refused in one line naming the field."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError("config.json's quantization_config is not a JSON object; re-download the checkpoint")
    method = qc.get("quant_method")
    if method not in QUANT_METHODS:
        raise refuse("quant_method", method, f"Redline converts {', '.join(QUANT_METHODS)} 4-bit checkpoints "
                                             f"(or an unquantized one)")
    if method == "compressed-tensors":
        return compressed_tensors_source(qc)
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise refuse("bits", bits, "Redline's int4 kernels hold 4-bit weights only; convert a 4-bit or an "
                                   "unquantized copy of the model")
    group = qc.get("group_size", qc.get("q_group_size"))
    check_file_group_size("group_size", group, allow_channel=method == "gptq")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise refuse("version", qc.get("version"), "Redline reads AWQ's GEMM packing only")
        if qc.get("zero_point", True) is not True:
            raise refuse("zero_point", qc.get("zero_point"), "Redline reads AWQ files with zero points (GEMM) only")
        return Int4Source("awq", describe=f"awq gemm, group {group}, zero points")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse("checkpoint_format", fmt, "Redline reads GPTQ's 'gptq' and 'gptq_v2' formats")
    sym = "symmetric" if qc.get("sym", True) else "asymmetric"
    act = "act-order" if qc.get("desc_act") else "no act-order"
    return Int4Source("gptq", zero_plus_one=fmt == "gptq",
                      describe=f"gptq ({fmt}), group {group}, {sym}, {act}")


def check_file_group_size(field_name: str, group: Any, allow_channel: bool) -> None:
    if allow_channel and group == -1:
        return
    if not isinstance(group, int) or isinstance(group, bool) or group < MIN_GROUP_SIZE or group % MIN_GROUP_SIZE:
        raise refuse(field_name, group, f"Redline's int4 groups are multiples of {MIN_GROUP_SIZE} inputs, so a "
                                        f"file's groups must be too")


def compressed_tensors_source(qc: dict[str, Any]) -> Int4Source:
    fmt = qc.get("format")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise refuse("config_groups", groups, "a compressed-tensors checkpoint needs its config groups")
    described = []
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(group, dict):
            raise refuse(where, group, "expected a quantization scheme")
        group_fmt = group.get("format") or fmt
        if group_fmt != "pack-quantized":
            raise refuse(f"{where}.format" if group.get("format") else "format", group_fmt,
                         "Redline reads compressed-tensors' pack-quantized format only")
        if group.get("input_activations") is not None:
            raise refuse(f"{where}.input_activations", "set", "Redline runs weight-only int4 (W4A16); activations "
                                                              "stay float")
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise refuse(f"{where}.weights", weights, "a pack-quantized scheme quantizes the weights")
        if weights.get("num_bits") != 4:
            raise refuse(f"{where}.weights.num_bits", weights.get("num_bits"),
                         "Redline's int4 kernels hold 4-bit weights only")
        if weights.get("type", "int") != "int":
            raise refuse(f"{where}.weights.type", weights.get("type"), "Redline reads integer codes only")
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel"):
            raise refuse(f"{where}.weights.strategy", strategy, "Redline reads the group and channel strategies")
        if strategy == "group":
            check_file_group_size(f"{where}.weights.group_size", weights.get("group_size"), allow_channel=False)
        if weights.get("dynamic", False):
            raise refuse(f"{where}.weights.dynamic", weights.get("dynamic"), "weights need stored scales")
        described.append(f"{strategy}{' ' + str(weights.get('group_size')) if strategy == 'group' else ''}, "
                         f"{'symmetric' if weights.get('symmetric', True) else 'asymmetric'}"
                         f"{', actorder ' + str(weights['actorder']) if weights.get('actorder') else ''}")
    return Int4Source("compressed-tensors", describe=f"compressed-tensors pack-quantized ({'; '.join(described)})")


def unpack_nibbles(words: Tensor) -> Tensor:
    """int32 (..., W) -> uint8 (..., 8W): nibble p of word w at position 8w + p (low nibble first)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8).flatten(-2)


def words_as_packed(words: Tensor) -> Tensor:
    """int32 (N, K/8) of eight consecutive inputs a word, low nibble first -> Redline's uint8 (N, K/2): the same
    bytes (little-endian words), so no code is touched."""
    flat = words.contiguous().view(torch.uint8)  # little-endian: byte b of word w holds inputs 8w + 2b, 2b + 1
    if not torch.tensor([1], dtype=torch.int32).view(torch.uint8)[0]:  # big-endian host: reorder the bytes
        flat = flat.view(*words.shape, 4).flip(-1).reshape(words.shape[0], -1)
    return flat


def gptq_module(name: str, t: dict[str, Tensor], source: Int4Source) -> Int4Module:
    qweight, scales, qzeros = t["qweight"], t["scales"], t["qzeros"]  # (K/8, N), (K/G, N), (K/G, N/8)
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    check_int4_shapes(name, [(qweight, (k // 8, n)), (qzeros, (scales.shape[0], n // 8))],
                      (scales, (scales.shape[0], n)))
    zeros = unpack_nibbles(qzeros).to(torch.int16)  # (K/G, N)
    if source.zero_plus_one:
        zeros = (zeros + 1) & 0xF
    g_idx = t.get("g_idx")
    return Int4Module(packed=words_as_packed(qweight.t()), scales=scales.t(), zeros=zeros.t(),
                      group_index=group_index(name + ".g_idx", g_idx, k, scales.shape[0]), bias=t.get("bias"))


def awq_module(name: str, t: dict[str, Tensor]) -> Int4Module:
    qweight, scales, qzeros = t["qweight"], t["scales"], t["qzeros"]  # (K, N/8), (K/G, N), (K/G, N/8)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    check_int4_shapes(name, [(qweight, (k, n // 8)), (qzeros, (scales.shape[0], n // 8))],
                      (scales, (scales.shape[0], n)))
    order = awq_output_order(n)
    codes = unpack_nibbles(qweight)[:, order]  # (K, N) in output order
    zeros = unpack_nibbles(qzeros)[:, order].to(torch.int16)  # (K/G, N)
    return Int4Module(packed=pack_int4(codes.t()), scales=scales.t(), zeros=zeros.t(), bias=t.get("bias"))


def awq_output_order(n: int) -> Tensor:
    """The unpacked nibble that holds each output 0..n-1: output 8j + c sits in nibble 8j + AWQ_ORDER.index(c)."""
    inverse = torch.tensor([AWQ_ORDER.index(c) for c in range(8)])
    return (torch.arange(0, n, 8).unsqueeze(1) + inverse).flatten()


def compressed_tensors_module(name: str, t: dict[str, Tensor]) -> Int4Module:
    packed, scales = t["weight_packed"], t["weight_scale"]  # (N, K/8), (N, K/G)
    n, k = packed.shape[0], packed.shape[1] * 8
    zp = t.get("weight_zero_point")
    groups = scales.shape[-1]
    check_int4_shapes(name, [(packed, (n, k // 8))] + ([(zp, ((n + 7) // 8, groups))] if zp is not None else []),
                      (scales, (n, groups)))
    if "weight_shape" in t and [int(d) for d in t["weight_shape"].tolist()] != [n, k]:
        raise ValueError(f"tensor {name}.weight_shape says {t['weight_shape'].tolist()}, but its packed codes hold "
                         f"({n}, {k}); Redline reads rows of whole 32-bit words only")
    if zp is None:
        zeros = torch.full(scales.shape, SYMMETRIC_ZERO, dtype=torch.int16)
    else:
        zeros = unpack_nibbles(zp.t())[:, :n].t().to(torch.int16)  # (N, K/G): packed along the rows
    return Int4Module(packed=words_as_packed(packed), scales=scales, zeros=zeros,
                      group_index=group_index(name + ".weight_g_idx", t.get("weight_g_idx"), k, scales.shape[1]),
                      bias=t.get("bias"))


def check_int4_shapes(name: str, words: list[tuple[Tensor, tuple[int, ...]]],
                      scales: tuple[Tensor, tuple[int, ...]]) -> None:
    """One module's packed words (int32) and scales (floating point), each against its expected shape."""
    checks = [(tensor, shape, tensor.dtype == torch.int32, "int32") for tensor, shape in words]
    checks.append((scales[0], scales[1], scales[0].is_floating_point(), "floats"))
    for tensor, shape, kind_ok, kind in checks:
        if tuple(tensor.shape) != shape or not kind_ok:
            raise ValueError(f"the 4-bit tensors of {name} do not fit together (one is {tuple(tensor.shape)} "
                             f"{tensor.dtype}, expected {shape} {kind}); the checkpoint is damaged")


def group_index(name: str, g_idx: Tensor | None, k: int, groups: int) -> Tensor | None:
    """A file's g_idx as int64 (K,), or None when it is absent or the plain order (input k in group k // G)."""
    if g_idx is None:
        return None
    if tuple(g_idx.shape) != (k,) or g_idx.is_floating_point():
        raise ValueError(f"tensor {name} has shape {tuple(g_idx.shape)} ({g_idx.dtype}), expected ({k},) integers; "
                         f"the checkpoint is damaged")
    g_idx = g_idx.long()
    if torch.equal(g_idx, torch.arange(k) // (k // groups)):
        return None
    if g_idx.min() < 0 or g_idx.max() >= groups:
        raise ValueError(f"tensor {name} names groups outside 0..{groups - 1}; the checkpoint is damaged")
    if torch.bincount(g_idx, minlength=groups).ne(k // groups).any():
        raise ValueError(f"tensor {name} does not put {k // groups} inputs in each of {groups} groups; Redline "
                         f"converts act-order only where every group holds the same number of inputs")
    return g_idx


def read_int4_modules(hf: dict[str, Tensor], source: Int4Source) -> tuple[dict[str, Int4Module], dict[str, Tensor]]:
    """Split a checkpoint's tensors into its 4-bit modules (by module name) and the rest (float tensors)."""
    codes_suffix = SUFFIXES[source.method][0]
    names = [name[: -len(codes_suffix) - 1] for name in hf if name.endswith("." + codes_suffix)]
    rest = dict(hf)
    modules = {}
    for name in names:
        parts = {}
        for suffix in (*SUFFIXES[source.method], "bias", *CT_IGNORED_SUFFIXES):
            if suffix is not None and f"{name}.{suffix}" in rest:
                parts[suffix] = rest.pop(f"{name}.{suffix}")
        required = [s for s in SUFFIXES[source.method][:2 if source.method == "compressed-tensors" else 3]]
        missing = [s for s in required if s not in parts]
        if missing:
            raise ValueError(f"tensor {name}.{missing[0]} is missing beside {name}.{codes_suffix}; the checkpoint "
                             f"is incomplete")
        modules[name] = read_module(name, parts, source)
    leftover = next((n for n in rest if n.rsplit(".", 1)[-1] in {s for s in SUFFIXES[source.method] if s}), None)
    if leftover is not None:
        raise ValueError(f"tensor {leftover} has no {codes_suffix} beside it; the checkpoint is incomplete")
    return modules, rest


def read_module(name: str, parts: dict[str, Tensor], source: Int4Source) -> Int4Module:
    module = {"awq": lambda: awq_module(name, parts), "gptq": lambda: gptq_module(name, parts, source),
              "compressed-tensors": lambda: compressed_tensors_module(name, parts)}[source.method]()
    if module.shape[1] % module.scales.shape[1]:
        raise ValueError(f"{name} has {module.scales.shape[1]} scale groups for {module.shape[1]} inputs, which they "
                         f"do not divide; the checkpoint is damaged")
    module.scales, module.rounded_scales = fp16_scales(name, module.scales)
    if module.zeros.min() < 0 or module.zeros.max() > 15:
        raise ValueError(f"the zero points of {name} leave 0..15; the checkpoint is damaged")
    return module


def fp16_scales(name: str, scales: Tensor) -> tuple[Tensor, int]:
    """The scales as fp16, which Redline's layout stores, and how many of them fp16 does not hold exactly (AWQ and
    GPTQ store fp16; a bf16 scale fits unless below 2^-17, where fp16's subnormals drop its low bits: clamped
    scales of all-zero groups). A scale beyond fp16's range is refused."""
    if not scales.is_floating_point():
        raise ValueError(f"the scales of {name} are {scales.dtype}, not floating point; the checkpoint is damaged")
    half = scales.to(torch.float16)
    if not torch.isfinite(half).all():
        raise ValueError(f"a scale of {name} exceeds fp16's range (65504), which Redline's int4 layout stores; "
                         f"convert an unquantized copy and quantize it with quantize.py")
    return half, int((half.to(scales.dtype) != scales).sum())


def fold_act_order(modules: dict[str, Int4Module], floats: dict[str, Tensor]) -> list[str]:
    """Fold every act-order g_idx into the plain order (see the module docstring); returns the folded modules.
    A g_idx that no fold reaches is refused."""
    folded = []
    for name, module in modules.items():
        if module.group_index is None:
            continue
        match = DOWN_PROJECTION.fullmatch(name)
        feeding = [match.group(1) + part for part in FEEDING_PROJECTIONS[match.group(2)]] if match else []
        feeding = [f for f in feeding if f in modules or f"{f}.weight" in floats]
        if not feeding:
            local = name.rsplit(".", 1)[-1]
            raise ValueError(f"tensor {name}.g_idx orders the inputs of {local} by activation (act-order), which "
                             f"Redline folds only into down projections (reordering the gate/up rows); re-quantize "
                             f"with desc_act false (or static_groups true, or compressed-tensors actorder 'weight')")
        order = torch.argsort(module.group_index, stable=True)  # (K,): new input i is old input order[i]
        module.packed = pack_int4(unpack_int4(module.packed)[:, order])
        module.group_index = None
        for part in feeding:
            permute_rows(part, order, modules, floats)
        folded.append(name)
    for name, module in modules.items():
        if module.group_index is not None:  # a gate/up row reorder cannot mend its own act-order
            raise ValueError(f"tensor {name}.g_idx orders the inputs by activation (act-order) in a way Redline "
                             f"cannot fold; re-quantize with desc_act false")
    return folded


def permute_rows(name: str, order: Tensor, modules: dict[str, Int4Module], floats: dict[str, Tensor]) -> None:
    """Reorder the output rows of module `name` (4-bit or float) by `order`; a fused gate_up_proj reorders both
    halves."""
    halves = 2 if name.endswith("gate_up_proj") else 1
    rows = order if halves == 1 else torch.cat([order, order + order.numel()])
    if name in modules:
        m = modules[name]
        m.packed, m.scales, m.zeros = m.packed[rows], m.scales[rows], m.zeros[rows]
        m.bias = m.bias[rows] if m.bias is not None else None
    else:
        floats[f"{name}.weight"] = floats[f"{name}.weight"][rows]
    if f"{name}.bias" in floats:
        floats[f"{name}.bias"] = floats[f"{name}.bias"][rows]


def redline_group_size(modules: dict[str, Int4Module]) -> int:
    """The one group size of the converted checkpoint: the largest power of two up to DEFAULT_GROUP_SIZE that divides
    every module's group (a larger file group is split into Redline groups that share its scale and offset)."""
    group = DEFAULT_GROUP_SIZE
    while group >= MIN_GROUP_SIZE:
        if all(m.group_size % group == 0 for m in modules.values()):
            return group
        group //= 2
    worst = min(modules, key=lambda n: modules[n].group_size)
    raise ValueError(f"module {worst} has groups of {modules[worst].group_size} inputs; Redline's int4 groups are "
                     f"powers of two of at least {MIN_GROUP_SIZE} that divide the file's groups")


def redline_parts(module: Int4Module, group_size: int) -> tuple[Tensor, Tensor]:
    """(uint8 (N, K/2), fp16 (N, K/group_size, 2) [scale, offset]) with offset = -scale * zero rounded once to fp16
    (exact for zero 8 and any power of two)."""
    repeat = module.group_size // group_size
    scale = module.scales.float()  # (N, K/G)
    offset = (-scale * module.zeros.float()).to(torch.float16)  # the product is exact in fp32; one rounding
    pairs = torch.stack((module.scales, offset), dim=-1)  # (N, K/G, 2)
    return module.packed.contiguous(), pairs.repeat_interleave(repeat, dim=1).contiguous()


def dequantize_module(module: Int4Module) -> Tensor:
    """The fp32 (N, K) weight the file means, s * (q - z), per input's group (the reference the tests compare with)."""
    codes = unpack_int4(module.packed).float()  # (N, K)
    n, k = module.shape
    groups = module.group_index if module.group_index is not None else torch.arange(k) // module.group_size
    return (codes - module.zeros.float()[:, groups]) * module.scales.float()[:, groups]

