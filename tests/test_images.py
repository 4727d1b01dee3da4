"""images.py: Pillow preprocessing against transformers' own image processors, and hostile bytes refused in bounded
time and memory."""
from __future__ import annotations

import io
import struct
import time
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from redline.images import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, image_patches, open_image, tile_pixels
from redline.vision import ImageProcessing

transformers = pytest.importorskip("transformers")

from conftest import pil_image_processor  # noqa: E402


def photo(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(mode) if mode in ("RGB", "RGBA") else 1
    pixels = rng.integers(0, 256, (height, width, channels) if channels > 1 else (height, width), dtype=np.uint8)
    return Image.fromarray(pixels, mode)


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def transformers_composites_alpha() -> bool:
    """Whether the installed transformers turns a transparent pixel white (as Redline does) before its processors
    see it; older versions dropped the alpha channel instead."""
    from transformers.image_transforms import convert_to_rgb

    clear = Image.new("RGBA", (1, 1), (255, 0, 0, 0))
    return np.asarray(convert_to_rgb(clear))[0, 0].tolist() == [255, 255, 255]


@pytest.mark.parametrize("size", [(896, 896), (640, 480), (37, 1200)])
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_gemma_tiles_equal_its_image_processor(size, mode):
    if mode == "RGBA" and not transformers_composites_alpha():
        pytest.skip("this transformers drops the alpha channel; Redline composites onto white, as later ones do")
    processor = pil_image_processor("Gemma3")(size={"height": 896, "width": 896})
    image = photo(*size, mode=mode)
    want = processor(images=[image], return_tensors="pt")["pixel_values"][0]
    got = tile_pixels(image, ImageProcessing(tile_size=896, resample=processor.resample))
    assert got.shape == want.shape == (3, 896, 896)
    assert (got - want).abs().max().item() <= 1e-6


@pytest.mark.parametrize("size", [(640, 480), (28, 28), (1000, 3000), (4000, 3000), (57, 29)])
def test_qwen_patches_equal_its_image_processor(size):
    processor = pil_image_processor("Qwen2VL")()
    settings = ImageProcessing(image_mean=processor.image_mean, image_std=processor.image_std, resample=3,
                               patch_size=14, merge_size=2, temporal_patch_size=2,
                               min_pixels=processor.size["shortest_edge"], max_pixels=processor.size["longest_edge"])
    image = photo(*size, seed=1)
    out = processor(images=[image], return_tensors="pt")
    patches, grid = image_patches(image, settings)
    assert list(grid) == out["image_grid_thw"][0].tolist()
    assert patches.shape == out["pixel_values"].shape
    assert (patches - out["pixel_values"]).abs().max().item() <= 1e-6


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_each_supported_format_decodes(fmt):
    image = open_image(encoded(photo(40, 30, seed=2), fmt))
    assert image.mode == "RGB" and image.size == (40, 30)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height pixels (1-bit gray) and holds a few bytes of them."""
    header = png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + png_chunk(b"IDAT", zlib.compress(b"\0" * 64)) + png_chunk(b"IEND", b"")


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.parametrize("data, message", [
    (b"not an image at all", "not an image Redline reads"),
    (b"", "not an image Redline reads"),
    (b"%PDF-1.4\n" + b"0" * 100, "not an image Redline reads"),
    (encoded(photo(16, 16), "BMP"), "not an image Redline reads"),
    (encoded(photo(200, 200, seed=3))[:400], "truncated or corrupt"),
    (encoded(photo(200, 200, seed=3), "JPEG")[:300], "truncated or corrupt"),
    (png_header(10_000, 10_000), "more than the 50000000 allowed"),  # 100 megapixels
    (png_header(60_000, 60_000), f"more than {MAX_IMAGE_PIXELS} pixels"),  # Pillow's own bomb limit
    (b"\x89PNG" + b"\0" * (MAX_IMAGE_BYTES + 1), "bytes, more than"),
], ids=["text", "empty", "pdf", "bmp", "truncated-png", "truncated-jpeg", "100-megapixels", "bomb", "too-many-bytes"])
def test_hostile_bytes_are_refused_in_one_line(data, message):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=message) as info:
        open_image(data)
    assert "\n" not in str(info.value)
    assert time.perf_counter() - start < 2.0


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_a_decompression_bomb_is_refused_before_it_is_decoded():
    """A small PNG that inflates to 100 megapixels: refused from its header, never decoded."""
    bomb = Image.new("1", (10_000, 10_000))
    data = encoded(bomb)
    assert len(data) < 100_000
    start = time.perf_counter()
    with pytest.raises(ValueError, match="10000x10000 pixels"):
        open_image(data)
    assert time.perf_counter() - start < 1.0


def test_transparency_is_laid_on_white():
    clear = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    image = open_image(encoded(clear))
    assert np.asarray(image)[0, 0].tolist() == [255, 255, 255]


def test_the_tile_is_a_tensor_of_the_processing_dtype():
    pixels = tile_pixels(photo(20, 20), ImageProcessing(tile_size=28))
    assert pixels.dtype == torch.float32 and pixels.shape == (3, 28, 28)
