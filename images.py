"""Images in: bytes checked and decoded with Pillow, then resized, rescaled, normalized and cut into patches as a
checkpoint's image processor says (vision.ImageProcessing), for the towers in vision.py.

    image = open_image(data)                       # bytes -> an RGB PIL image, or a one-line ValueError
    pixels = tile_pixels(image, processing)        # Gemma 3: (3, S, S) one square tile
    patches, grid = image_patches(image, processing)   # Qwen2.5-VL: (P, 3 * t * p * p) and its (t, h, w) patch grid

Decoding refuses in bounded time and memory: too many bytes, too many pixels (checked from the header, before any
pixel is decoded), a format that is not PNG, JPEG, WebP or GIF, and a truncated or corrupt file.
"""
from __future__ import annotations

import io
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

if TYPE_CHECKING:
    from redline.vision import ImageProcessing

# An image's encoded size and decoded pixel count at most: well above any camera photo the towers would shrink
# anyway, well below what could exhaust a server's memory (a 100-megapixel RGB image is 300 MB decoded).
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 50_000_000
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


def open_image(data: bytes) -> Image.Image:
    """The RGB image that `data` encodes (a transparent one laid on white, as transformers does), fully decoded; a
    one-line ValueError for bytes that are no image, an unsupported format, an image too large, or a truncated file."""
    if not isinstance(data, (bytes, bytearray)):
        raise ValueError(f"an image must be given as bytes, got {type(data).__name__}")
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"the image has {len(data)} bytes, more than the {MAX_IMAGE_BYTES} allowed; send a smaller "
                         f"one")
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError:
        raise ValueError(f"the data is not an image Redline reads ({', '.join(IMAGE_FORMATS)}); send one of "
                         f"those") from None
    except Image.DecompressionBombError:
        raise ValueError(f"the image declares more than {MAX_IMAGE_PIXELS} pixels; send a smaller one") from None
    except (OSError, SyntaxError, ValueError) as exc:  # a header cut short or malformed
        raise ValueError(f"the image cannot be read ({one_line(exc)}); it is truncated or corrupt") from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"the image is {width}x{height} pixels, more than the {MAX_IMAGE_PIXELS} allowed; send a "
                         f"smaller one")
    if width < 1 or height < 1:
        raise ValueError("the image has no pixels; send another")
    try:
        image.load()  # decodes now: a truncated or corrupt file fails here, not later in the tower
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ValueError(f"the {image.format} image cannot be decoded ({one_line(exc)}); it is truncated or "
                         f"corrupt") from None
    return rgb(image)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def read_image_file(path: Path) -> bytes:
    """An image file's bytes (decoded later by open_image); a one-line error for a missing or oversized file."""
    if not path.is_file():
        raise FileNotFoundError(f"image file {path} does not exist; check the path")
    try:
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise ValueError(f"image file {path} has more than {MAX_IMAGE_BYTES} bytes; use a smaller image")
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read image file {path} ({exc.strerror}); check its permissions") from None


def rgb(image: Image.Image) -> Image.Image:
    """The image in RGB; one with transparency composited onto white first (transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def normalized(image: Image.Image, processing: ImageProcessing) -> np.ndarray:
    """An RGB image's pixels (3, H, W) float32: rescaled (in float64, as transformers does), then normalized."""
    array = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)  # (3, H, W)
    scaled = (array.astype(np.float64) * processing.rescale_factor).astype(np.float32)
    mean = np.asarray(processing.image_mean, dtype=np.float32).reshape(3, 1, 1)
    std = np.asarray(processing.image_std, dtype=np.float32).reshape(3, 1, 1)
    return (scaled - mean) / std


def tile_pixels(image: Image.Image, processing: ImageProcessing) -> Tensor:
    """Gemma 3's input: the image resized to one square tile (3, S, S) fp32."""
    side = processing.tile_size
    resized = rgb(image).resize((side, side), resample=processing.resample)
    return torch.from_numpy(normalized(resized, processing))


def fitted_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's size rule: both sides multiples of `factor`, the area within [min_pixels, max_pixels], the aspect
    ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the image is {width}x{height} pixels, an aspect ratio above 200; crop it")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def image_patches(image: Image.Image, processing: ImageProcessing) -> tuple[Tensor, tuple[int, int, int]]:
    """Qwen2.5-VL's input: the image resized by fitted_size, normalized and cut into patches of p x p pixels, each
    repeated over the t frames of a temporal patch. Patches come in merge order: each merge x merge block of
    neighbours together, blocks row by row. Returns (P, 3 * t * p * p) fp32 and the patch grid (1, h, w)."""
    p, merge, frames = processing.patch_size, processing.merge_size, processing.temporal_patch_size
    height, width = fitted_size(image.height, image.width, p * merge, processing.min_pixels, processing.max_pixels)
    pixels = normalized(rgb(image).resize((width, height), resample=processing.resample), processing)  # (3, H, W)
    gh, gw = height // p, width // p
    blocks = pixels.reshape(3, gh // merge, merge, p, gw // merge, merge, p)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, 3, p, p)
    frames_of = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], frames, p, p))  # (.., 3, t, p, p)
    return torch.from_numpy(np.ascontiguousarray(frames_of).reshape(gh * gw, 3 * frames * p * p)), (1, gh, gw)
