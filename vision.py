"""The vision towers beside model.py, in plain PyTorch: Gemma 3's SigLIP encoder with its pooling projector, and
Qwen2.5-VL's window-attention ViT with its patch merger. Each turns a prompt's images into embeddings in the
language model's width; `prompt_images` then expands each image placeholder of the prompt into the image's run of
tokens and says where the embeddings go, with the M-RoPE positions (Qwen2.5-VL) or the bidirectional attention
among an image's tokens (Gemma 3) that the language model's prefill needs (model.PromptImages).

    tower = load_vision_tower(checkpoint_file, device, dtype)   # None when the checkpoint has no vision file
    ids, images = prompt_images(tower, prompt_ids, [pil_image, ...])
    logits = model(torch.tensor([ids]), torch.arange(len(ids)), images=images)

The tower is stored in its own file beside the language model's checkpoint (vision_path), written by
scripts/convert_hf_checkpoint.py, with VisionArgs in its metadata.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from redline.images import fitted_size, image_patches, tile_pixels
from redline.model import PromptImages, RMSNorm
from redline.rope import apply_rope

VISION_FAMILIES = ("gemma3", "qwen2_5_vl")
VISION_SUFFIX = ".vision.safetensors"
# PIL's resampling filters by the numbers transformers' processor configs use.
RESAMPLE_FILTERS = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


@dataclass(frozen=True)
class ImageProcessing:
    """How an image becomes the tower's input (the checkpoint's preprocessor_config.json): resized (to a square tile
    of tile_size, Gemma 3; or to multiples of patch_size * merge_size with min_pixels..max_pixels pixels, Qwen2.5-VL)
    with PIL filter `resample`, times rescale_factor, normalized per channel."""

    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 2  # PIL bilinear
    tile_size: int = 0
    patch_size: int = 14
    merge_size: int = 1
    temporal_patch_size: int = 1
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_mean", tuple(float(v) for v in self.image_mean))
        object.__setattr__(self, "image_std", tuple(float(v) for v in self.image_std))
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError(f"image_mean and image_std must hold three numbers (std > 0), got {self.image_mean}, "
                             f"{self.image_std}")
        if self.resample not in RESAMPLE_FILTERS:
            raise ValueError(f"resample must be one of PIL's filters {sorted(RESAMPLE_FILTERS)}, got {self.resample}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"min_pixels and max_pixels must satisfy 0 < min <= max, got {self.min_pixels}, "
                             f"{self.max_pixels}")


@dataclass(frozen=True)
class VisionArgs:
    """A vision tower's shapes, its place in the prompt and its preprocessing. family: "gemma3" (SigLIP on square
    tiles, each pooled to tokens_per_image tokens) or "qwen2_5_vl" (a ViT on the image's own patch grid, windowed
    attention except in full_attention_layers, each merge_size x merge_size patches merged into one token)."""

    family: str
    dim: int
    n_layer: int
    n_head: int
    intermediate_size: int
    out_dim: int  # the language model's width
    patch_size: int = 14
    norm_eps: float = 1e-6
    image_size: int = 0  # gemma3: the tile side in pixels
    tokens_per_image: int = 0  # gemma3: tokens per tile after pooling
    temporal_patch_size: int = 1  # qwen2_5_vl: frames per patch (an image repeats its one frame)
    merge_size: int = 1  # qwen2_5_vl
    window_size: int = 0  # qwen2_5_vl: the attention window's side in pixels
    full_attention_layers: tuple[int, ...] = ()  # qwen2_5_vl: layers attending over the whole image
    rope_base: float = 10000.0  # qwen2_5_vl: the 2D rope of patches
    placeholder_id: int = 0  # the token the prompt (its chat template) holds once per image
    image_token_id: int = 0  # the token an image's embeddings stand in for, once per embedding
    image_prefix: tuple[int, ...] = ()  # tokens before and after an image's run (gemma3: "\n\n", start, ...)
    image_suffix: tuple[int, ...] = ()
    processing: ImageProcessing = ImageProcessing()

    def __post_init__(self) -> None:
        for name in ("image_prefix", "image_suffix", "full_attention_layers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.processing, dict):
            object.__setattr__(self, "processing", ImageProcessing(**self.processing))
        if self.family not in VISION_FAMILIES:
            raise ValueError(f"unknown vision family {self.family!r}; known: {', '.join(VISION_FAMILIES)}")
        for name in ("dim", "n_layer", "n_head", "intermediate_size", "out_dim", "patch_size"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"VisionArgs.{name} must be a positive integer, got {value!r}")
        if self.dim % self.n_head or (self.family == "qwen2_5_vl" and (self.dim // self.n_head) % 4):
            raise ValueError(f"the vision width {self.dim} must split into {self.n_head} heads (of a multiple of 4 "
                             f"for the 2D rope)")
        if self.family == "gemma3":
            per_side, pooled = self.image_size // self.patch_size, round(self.tokens_per_image ** 0.5)
            if not (self.image_size % self.patch_size == 0 and pooled ** 2 == self.tokens_per_image and pooled > 0
                    and per_side % pooled == 0):
                raise ValueError(f"a Gemma 3 tower needs image_size a multiple of patch_size and tokens_per_image a "
                                 f"square whose side divides the patch grid; got {self.image_size}, "
                                 f"{self.patch_size}, {self.tokens_per_image}")
        elif self.window_size % (self.patch_size * self.merge_size) or self.window_size <= 0:
            raise ValueError(f"window_size must be a positive multiple of patch_size * merge_size "
                             f"({self.patch_size * self.merge_size}), got {self.window_size}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VisionArgs:
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown VisionArgs fields {unknown}; the vision file was written by a newer Redline")
        return cls(**data)


# ---------------------------------------------------------------------------------------------------------------------
# Gemma 3: SigLIP, then the projector (average pooling, a norm and one matrix).


class SiglipAttention(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.n_head = args.n_head
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(args.dim, args.dim) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        batch, length, dim = x.shape
        q, k, v = (proj(x).view(batch, length, self.n_head, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))  # (B, H, P, D) each
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch of its tile
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, dim))


class SiglipMLP(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.fc1 = nn.Linear(args.dim, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipLayer(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.self_attn = SiglipAttention(args)
        self.layer_norm2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = SiglipMLP(args)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEmbeddings(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, args.dim, kernel_size=args.patch_size, stride=args.patch_size)
        self.position_embedding = nn.Embedding((args.image_size // args.patch_size) ** 2, args.dim)

    def forward(self, pixels: Tensor) -> Tensor:
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # (B, P, dim), patches row by row
        return patches + self.position_embedding.weight


class SiglipEncoder(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipLayer(args) for _ in range(args.n_layer))


class SiglipVision(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(args)
        self.encoder = SiglipEncoder(args)
        self.post_layernorm = nn.LayerNorm(args.dim, eps=args.norm_eps)

    def forward(self, pixels: Tensor) -> Tensor:
        """pixels (B, 3, S, S) -> (B, P, dim)."""
        x = self.embeddings(pixels.to(self.post_layernorm.weight.dtype))
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3Projector(nn.Module):
    """The patch grid averaged down to tokens_per_image tokens, RMS-normed (Gemma's 1 + w), then one matrix into
    the language model's width."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.per_side = args.image_size // args.patch_size
        self.pool = self.per_side // round(args.tokens_per_image ** 0.5)
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(args.dim, args.out_dim))  # (dim, out_dim)
        self.mm_soft_emb_norm = RMSNorm(args.dim, args.norm_eps, offset=1.0, scale_fp32=True)

    def forward(self, x: Tensor) -> Tensor:
        batch, _, dim = x.shape
        grid = x.transpose(1, 2).reshape(batch, dim, self.per_side, self.per_side)  # (B, dim, s, s)
        pooled = F.avg_pool2d(grid, self.pool).flatten(2).transpose(1, 2)  # (B, tokens, dim)
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).type_as(x)  # (B, tokens, out_dim)


class Gemma3Vision(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.vision_tower = SiglipVision(args)
        self.multi_modal_projector = Gemma3Projector(args)

    def forward(self, pixels: Tensor) -> Tensor:
        """pixels (B, 3, S, S), one tile per image -> (B, tokens_per_image, out_dim)."""
        return self.multi_modal_projector(self.vision_tower(pixels))

    def encode(self, images: list[Image.Image]) -> list[Tensor]:
        """Each image's token embeddings (tokens_per_image, out_dim), all tiles in one batch."""
        device = self.multi_modal_projector.mm_input_projection_weight.device
        pixels = torch.stack([tile_pixels(image, self.args.processing) for image in images]).to(device)
        return list(self(pixels).unbind(0))

    def token_count(self, image: Image.Image) -> int:
        return self.args.tokens_per_image


# ---------------------------------------------------------------------------------------------------------------------
# Qwen2.5-VL: a ViT over the image's own patch grid (windowed attention in most layers, 2D rope), then the merger.


class QwenVisionAttention(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.n_head = args.n_head
        self.qkv = nn.Linear(args.dim, 3 * args.dim)
        self.proj = nn.Linear(args.dim, args.dim)

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor) -> Tensor:
        """x (P, dim), rope (P, 2, D/2), mask (P, P) bool, True where a patch may attend."""
        length, dim = x.shape
        q, k, v = self.qkv(x).view(1, length, 3, self.n_head, -1).unbind(2)  # (1, P, H, D) each
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(length, dim))


class QwenVisionMLP(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QwenVisionBlock(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.norm1 = RMSNorm(args.dim, args.norm_eps)
        self.attn = QwenVisionAttention(args)
        self.norm2 = RMSNorm(args.dim, args.norm_eps)
        self.mlp = QwenVisionMLP(args)

    def forward(self, x: Tensor, rope: Tensor, mask: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x), rope, mask)
        return x + self.mlp(self.norm2(x))


class QwenPatchMerger(nn.Module):
    """Each merge x merge block of neighbouring patches (consecutive in merge order) concatenated, then a two-layer
    GELU MLP into the language model's width."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.merged = args.dim * args.merge_size ** 2
        self.ln_q = RMSNorm(args.dim, args.norm_eps)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(), nn.Linear(self.merged, args.out_dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))  # (P / m^2, out_dim)


class QwenVision(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        patch_features = 3 * args.temporal_patch_size * args.patch_size ** 2
        self.patch_embed = nn.Linear(patch_features, args.dim, bias=False)
        self.blocks = nn.ModuleList(QwenVisionBlock(args) for _ in range(args.n_layer))
        self.merger = QwenPatchMerger(args)

    def forward(self, patches: Tensor, grids: list[tuple[int, int, int]]) -> Tensor:
        """patches (P, 3 t p p) of the images whose patch grids (t, h, w) are `grids`, each in merge order ->
        token embeddings (P / merge^2, out_dim), the images' in turn."""
        x = self.patch_embed(patches.to(self.patch_embed.weight.dtype))  # (P, dim)
        rope = self.rope(grids, x.device)  # (P, 2, D/2)
        images, windows = self.segments(grids, x.device)  # (P,) each
        full = images.unsqueeze(1) == images.unsqueeze(0)  # (P, P): the whole image
        windowed = windows.unsqueeze(1) == windows.unsqueeze(0)  # (P, P): the patch's window only
        for i, block in enumerate(self.blocks):
            x = block(x, rope, full if i in self.args.full_attention_layers else windowed)
        return self.merger(x)

    def positions(self, grids: list[tuple[int, int, int]], device: torch.device) -> Tensor:
        """Each patch's (row, column) in its image (P, 2), patches in merge order."""
        m = self.args.merge_size
        out = []
        for t, h, w in grids:
            rows = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            cols = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            pair = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)  # (h w, 2)
            out.append(pair.repeat(t, 1))
        return torch.cat(out)

    def rope(self, grids: list[tuple[int, int, int]], device: torch.device) -> Tensor:
        """cos and sin (P, 2, D/2): the first half of each head's pairs turned by the row, the second by the column."""
        half = self.args.head_dim // 2  # the row turns the first half of each head's pairs, the column the second
        inv_freq = 1.0 / self.args.rope_base ** (torch.arange(0, half, 2, device=device).float() / half)  # (D/4,)
        angles = self.positions(grids, device).unsqueeze(-1).float() * inv_freq  # (P, 2, D/4)
        angles = angles.flatten(1)  # (P, D/2): row angles, then column angles
        return torch.stack([angles.cos(), angles.sin()], dim=1)

    def segments(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[Tensor, Tensor]:
        """Each patch's image (P,) and attention window (P,): windows are squares of window_size pixels over the
        merged grid, counted from its top-left corner (the last row and column of windows may be smaller)."""
        a = self.args
        m, side = a.merge_size, a.window_size // (a.patch_size * a.merge_size)  # window side in merged tokens
        images, windows, first = [], [], 0
        for index, (t, h, w) in enumerate(grids):
            mh, mw = h // m, w // m
            rows = torch.arange(mh, device=device).view(mh, 1).expand(mh, mw) // side
            cols = torch.arange(mw, device=device).view(1, mw).expand(mh, mw) // side
            per_row = -(-mw // side)
            window = (rows * per_row + cols).flatten().repeat_interleave(m * m)  # (h w,) in merge order
            frames = torch.arange(t, device=device).repeat_interleave(h * w) * (-(-mh // side) * per_row)
            windows.append(first + frames + window.repeat(t))
            first = int(windows[-1].max()) + 1
            images.append(torch.full((t * h * w,), index, device=device))
        return torch.cat(images), torch.cat(windows)

    def encode(self, images: list[Image.Image]) -> list[Tensor]:
        """Each image's token embeddings (tokens, out_dim), all images through the tower in one call."""
        pieces = [image_patches(image, self.args.processing) for image in images]
        patches = torch.cat([p for p, _ in pieces]).to(self.patch_embed.weight.device)
        grids = [grid for _, grid in pieces]
        tokens = self(patches, grids)
        return list(tokens.split([t * h * w // self.args.merge_size ** 2 for t, h, w in grids]))

    def token_count(self, image: Image.Image) -> int:
        return image_token_count(self.args, image)


VisionTower = Gemma3Vision | QwenVision


def vision_tower(args: VisionArgs) -> VisionTower:
    return Gemma3Vision(args) if args.family == "gemma3" else QwenVision(args)


# ---------------------------------------------------------------------------------------------------------------------
# The prompt: placeholders expanded, embeddings placed, positions and attention as the family needs.


def prompt_images(tower: VisionTower, ids: list[int], images: list[Image.Image]) -> tuple[list[int], PromptImages]:
    """The prompt `ids` with each placeholder token (one per image, in order) expanded into its image's run of
    tokens, and what the prefill needs of the images (model.PromptImages), on the tower's device."""
    out, runs = expanded_prompt(tower.args, ids, [image_token_count(tower.args, image) for image in images])
    embeds = tower.encode(images) if images else []
    device = embeds[0].device if embeds else torch.device("cpu")
    return out, prompt_media(tower.args, len(out), runs, images, embeds, device)


def expanded_prompt(a: VisionArgs, ids: list[int], counts: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The prompt `ids` with its placeholders (one per image, in order) expanded into runs of `counts[i]` image
    tokens (wrapped in the family's prefix and suffix), and each run's (start, count) in the expanded prompt."""
    count = sum(1 for t in ids if t == a.placeholder_id)
    if count != len(counts):
        raise ValueError(f"the prompt holds {count} image placeholders (token {a.placeholder_id}) but {len(counts)} "
                         f"images came with it; give one image per placeholder")
    if any(t == a.image_token_id for t in ids) and a.image_token_id != a.placeholder_id:
        raise ValueError(f"the prompt holds the image token {a.image_token_id} itself; mark each image with the "
                         f"placeholder {a.placeholder_id} instead")
    out: list[int] = []
    runs: list[tuple[int, int]] = []  # (start, length) of each image's tokens in `out`
    for token in ids:
        if token != a.placeholder_id:
            out.append(token)
            continue
        out.extend(a.image_prefix)
        runs.append((len(out), counts[len(runs)]))
        out.extend([a.image_token_id] * counts[len(runs) - 1])
        out.extend(a.image_suffix)
    return out, runs


def image_token_count(a: VisionArgs, image: Image.Image) -> int:
    """How many tokens an image takes in the prompt."""
    if a.family == "gemma3":
        return a.tokens_per_image
    rows, cols = merged_grid_of(a, image)
    return rows * cols


def prompt_media(a: VisionArgs, length: int, runs: list[tuple[int, int]], images: list[Image.Image],
                 embeds: list[Tensor], device: torch.device | str) -> PromptImages:
    """What a prefill of a prompt of `length` tokens needs of its images, whose tokens lie at `runs` (start, count)
    and whose embeddings are `embeds` (one (count, out_dim) tensor each): the embeddings and their slots, and the
    M-RoPE positions (Qwen2.5-VL) or each token's image for the bidirectional attention (Gemma 3)."""
    slots = torch.cat([torch.arange(s, s + n) for s, n in runs]) if runs else torch.empty(0, dtype=torch.long)
    joined = torch.cat(embeds) if embeds else torch.empty(0, a.out_dim)
    if a.family == "gemma3":
        groups = torch.full((length,), -1, dtype=torch.long)
        for i, (s, n) in enumerate(runs):
            groups[s:s + n] = i
        return PromptImages(joined, slots.to(device), groups=groups.to(device))
    grids = [merged_grid_of(a, image) for image in images]
    return PromptImages(joined, slots.to(device), rope_positions=mrope_positions(length, runs, grids).to(device))


def merged_grid_of(a: VisionArgs, image: Image.Image) -> tuple[int, int]:
    """A Qwen2.5-VL image's token grid (rows, columns) after merging."""
    p = a.processing
    h, w = fitted_size(image.height, image.width, a.patch_size * a.merge_size, p.min_pixels, p.max_pixels)
    return h // (a.patch_size * a.merge_size), w // (a.patch_size * a.merge_size)


def mrope_positions(length: int, runs: list[tuple[int, int]], grids: list[tuple[int, int]]) -> Tensor:
    """Qwen2.5-VL's positions (3, T) of a prompt whose images' tokens lie at `runs` (start, count) with merged grids
    (rows, columns): text counts on by one in all three; an image's tokens share the time position where it starts
    and add their row and column to it; the text after an image goes on from the image's start plus its longer side.

    Everything is then shifted by one constant so that the prompt's last position is length - 1: rope depends only
    on differences, so logits are unchanged, and the decode steps after it are the plain 1D positions they are for
    text (transformers adds the shift to each decode step instead)."""
    positions = torch.empty(3, length, dtype=torch.long)
    position, index = 0, 0
    for (start, count), (rows, cols) in zip(runs, grids):
        positions[:, index:start] = torch.arange(position, position + start - index)
        position += start - index
        grid_rows = torch.arange(rows).repeat_interleave(cols)  # (count,)
        grid_cols = torch.arange(cols).repeat(rows)
        positions[0, start:start + count] = position
        positions[1, start:start + count] = position + grid_rows
        positions[2, start:start + count] = position + grid_cols
        position += max(rows, cols)
        index = start + count
    positions[:, index:] = torch.arange(position, position + length - index)
    return positions + (length - 1 - positions.max())


# ---------------------------------------------------------------------------------------------------------------------
# The vision file beside a checkpoint.


def vision_path(checkpoint: Path) -> Path:
    """Where a checkpoint file's vision tower lives: NAME.safetensors -> NAME.vision.safetensors beside it."""
    return checkpoint.with_name(checkpoint.name.removesuffix(".safetensors") + VISION_SUFFIX)


def is_vision_file(path: Path) -> bool:
    """Whether `path` is a vision file a conversion wrote (and --overwrite may replace)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return "redline_vision" in (f.metadata() or {})
    except (SafetensorError, OSError, ValueError):
        return False


def check_vision_copy(source: Path, target: Path, overwrite: bool) -> Path | None:
    """Before a command writes the checkpoint `target` from `source`: where source's vision file must be copied
    (vision_path(target)), checked as an output; None when source has none."""
    from redline.outputs import check_output

    if not vision_path(source).is_file():
        return None
    check_output(vision_path(target), [source, vision_path(source)], "--out", overwrite=overwrite,
                 replaceable=is_vision_file, kind="Redline vision file")
    return vision_path(target)


def copy_vision_file(source: Path, target: Path) -> None:
    """source's vision file copied beside the checkpoint `target`, atomically (the tower is never quantized)."""
    from redline.checkpoint import write_atomically

    data = vision_path(source).read_bytes()
    write_atomically(vision_path(target), lambda tmp: tmp.write_bytes(data))


def read_vision_args(checkpoint: Path) -> VisionArgs | None:
    """The VisionArgs in the metadata of the vision file beside a checkpoint file (no tensor is read); None when the
    checkpoint has none. A front end reads them to expand a prompt's images without loading the tower."""
    read = vision_file(checkpoint, with_tensors=False)
    return None if read is None else read[0]


def vision_file(checkpoint: Path, with_tensors: bool) -> tuple[VisionArgs, dict[str, Tensor]] | None:
    """(the VisionArgs, and with_tensors its tensors) of the vision file beside a checkpoint file; None when the
    checkpoint has none; a file that does not read is a one-line ValueError."""
    from safetensors import SafetensorError, safe_open

    path = vision_path(Path(checkpoint))
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()} if with_tensors else {}
        return VisionArgs.from_dict(json.loads(meta["redline_vision"])), tensors
    except (SafetensorError, OSError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable Redline vision file ({exc}); re-convert the checkpoint") from None


def load_vision_tower(checkpoint: Path, device: torch.device | str, dtype: torch.dtype) -> VisionTower | None:
    """The tower stored beside a checkpoint file, in dtype on device; None when the checkpoint has none."""
    read = vision_file(checkpoint, with_tensors=True)
    if read is None:
        return None
    args, tensors = read
    path = vision_path(Path(checkpoint))
    with torch.device("meta"):
        tower = vision_tower(args)
    own = tower.state_dict()
    if set(own) != set(tensors) or any(tuple(tensors[n].shape) != tuple(t.shape) for n, t in own.items()):
        missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
        raise ValueError(f"{path} does not match its own VisionArgs (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}, or a shape differs); re-convert the checkpoint")
    tower.load_state_dict({n: t.to(device, dtype) for n, t in tensors.items()}, assign=True)
    return tower.requires_grad_(False).eval()
