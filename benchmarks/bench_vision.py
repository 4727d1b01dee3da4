"""Time to first token of a prompt with one image, on random weights of a multimodal model's published shapes:
preprocessing (Pillow, on the CPU), the vision tower and the language model's prefill, each timed apart.

    python benchmarks/bench_vision.py --model Gemma-3-12B --model Qwen2.5-VL-7B [--image-size 896] [--json FILE]

The language model is the registry's (Qwen2.5-VL-7B: Qwen2.5-7B with M-RoPE), the tower is built from the published
config.json (PUBLISHED_CONFIGS); the prefill runs through the Runner as LLM.generate does (eager for image prompts,
Redline's kernels on where they run). Each stage is the median of --repeats runs after one warm-up.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

# Published config.json of the multimodal checkpoints the benchmark models (the fields the readers use), as the Hub
# has them: Qwen2.5-VL-7B-Instruct in transformers 4's flat layout; Gemma 3 12B's text_config lists only the fields
# that differ from transformers' defaults.
PUBLISHED_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen2.5-VL-7B": dict(
        architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl", hidden_size=3584,
        intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=152064, max_position_embeddings=128000, rms_norm_eps=1e-6, rope_theta=1e6, sliding_window=32768,
        max_window_layers=28, use_sliding_window=False, tie_word_embeddings=False, hidden_act="silu",
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
        vision_config=dict(depth=32, hidden_act="silu", hidden_size=1280, intermediate_size=3420, num_heads=16,
                           in_chans=3, out_hidden_size=3584, patch_size=14, spatial_merge_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, temporal_patch_size=2)),
    "Gemma-3-12B": dict(
        architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", boi_token_index=255999,
        eoi_token_index=256000, image_token_index=262144, mm_tokens_per_image=256,
        text_config=dict(hidden_size=3840, intermediate_size=15360, model_type="gemma3_text", num_attention_heads=16,
                         num_hidden_layers=48, num_key_value_heads=8, sliding_window=1024,
                         rope_scaling={"factor": 8.0, "rope_type": "linear"}),
        vision_config=dict(hidden_size=1152, image_size=896, intermediate_size=4304, num_attention_heads=16,
                           num_hidden_layers=27, patch_size=14, vision_use_head=False)),
}
TEXT_TOKENS = 32  # the prompt's text around the image


def random_(module: torch.nn.Module) -> torch.nn.Module:
    """Every weight random (matrices ~ N(0, 1/fan_in), vectors around 1), in place, on the module's device."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.02)
            else:
                p.normal_(0.0, p[0].numel() ** -0.5)
    return module


def median_ms(call: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """The median wall time of call() in ms after one warm-up, the device synchronized around each."""
    call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def random_multimodal(name: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """(language model, vision tower) of a published multimodal config with random weights, in dtype on device
    (the context capped at 8,192 tokens)."""
    from redline.model import ModelArgs, Transformer
    from redline.scripts.hf_config import args_from_hf_config, vision_args_from_hf_config
    from redline.vision import vision_tower

    config = PUBLISHED_CONFIGS[name]
    args = args_from_hf_config(config)
    args = ModelArgs(**{**args.to_dict(), "block_size": min(args.block_size, 8192)})
    with torch.device("meta"):  # built without memory, then allocated in dtype on the device
        tower, model = vision_tower(vision_args_from_hf_config(config)).to(dtype), Transformer(args).to(dtype)
    tower = random_(tower.to_empty(device=device)).eval().requires_grad_(False)
    model = random_(model.to_empty(device=device)).eval().requires_grad_(False)
    if args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model, tower


def measure(name: str, image_size: int, repeats: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    from redline.images import image_patches, tile_pixels
    from redline.runner import Runner
    from redline.sampling import SamplingParams
    from redline.vision import Gemma3Vision, prompt_images

    model, tower = random_multimodal(name, device, dtype)
    vision = tower.args
    runner = Runner(model, device, compile=False)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8))
    ids = [2] + [1000 + i for i in range(TEXT_TOKENS // 2)] + [vision.placeholder_id] + \
          [2000 + i for i in range(TEXT_TOKENS // 2)]
    with torch.inference_mode():
        expanded, images = prompt_images(tower, ids, [image])
        runner.ensure_cache(1, len(expanded) + 16)
        inputs = runner.prefill_inputs(torch.tensor([expanded]), bucketed=False)
        args_ = runner.step_args(SamplingParams())
        if isinstance(tower, Gemma3Vision):
            pixels = tile_pixels(image, vision.processing).unsqueeze(0).to(device)
            preprocess = lambda: tile_pixels(image, vision.processing)  # noqa: E731
            encode = lambda: tower(pixels)  # noqa: E731
        else:
            patches, grid = image_patches(image, vision.processing)
            patches = patches.to(device)
            preprocess = lambda: image_patches(image, vision.processing)  # noqa: E731
            encode = lambda: tower(patches, [grid])  # noqa: E731
        pre_ms = median_ms(preprocess, repeats, torch.device("cpu"))
        encode_ms = median_ms(encode, repeats, device)
        prefill_ms = median_ms(lambda: runner.prefill(inputs, args_, images), repeats, device)
        text_inputs = runner.prefill_inputs(torch.tensor([expanded]), bucketed=False)
        text_ms = median_ms(lambda: runner.prefill(text_inputs, args_), repeats, device)
    return dict(model=name, image=f"{image_size}x{image_size}", image_tokens=int(images.embeds.shape[0]),
                prompt_tokens=len(expanded), preprocess_ms=round(pre_ms, 2), encoder_ms=round(encode_ms, 2),
                prefill_ms=round(prefill_ms, 2), text_only_prefill_ms=round(text_ms, 2),
                ttft_ms=round(pre_ms + encode_ms + prefill_ms, 2), dtype=str(dtype).removeprefix("torch."),
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                torch_version=torch.__version__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", choices=sorted(PUBLISHED_CONFIGS), default=None,
                   help="repeatable; default: all")
    p.add_argument("--image-size", type=int, default=896, help="the square test image's side in pixels")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--json", type=Path, default=None, help="write the results here too")
    ns = p.parse_args(argv)
    if ns.image_size < 28 or ns.repeats < 1:
        print("error: --image-size must be >= 28 and --repeats >= 1", file=sys.stderr)
        return 2
    device, dtype = torch.device(ns.device), getattr(torch, ns.dtype)
    rows = []
    for name in ns.model or sorted(PUBLISHED_CONFIGS):
        row = measure(name, ns.image_size, ns.repeats, device, dtype)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if ns.json is not None:
        from redline.checkpoint import write_atomically

        write_atomically(ns.json, lambda tmp: tmp.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
