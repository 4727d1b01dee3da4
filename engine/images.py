"""A request's images in the engine: the front end expands each image placeholder of the prompt into the image's
run of tokens and sends the image's file bytes beside the prompt (engine/messages.py ImageInput); the core decodes
and checks them again, keys the prefix cache's pages by their content hashes, runs the vision tower once per request
(the requests of one step together) when their prefill starts, and the runner splices each chunk's share of the
embeddings (and Qwen2.5-VL's M-RoPE positions, Gemma 3's bidirectional image attention) into the paged step.

    inputs, ids = image_inputs(vision_args, ids, images)     # front end: expanded ids, ImageInput per image
    seq.images = seq_images(vision_args, prompt, inputs)     # core, in the caller's thread
    encode_images(tower, seqs)                               # core, in the engine's thread, before their prefill
"""
from __future__ import annotations

import hashlib
import io
import struct
from collections.abc import Sequence
from typing import Any

from PIL import Image

from redline.engine.batch import Sequence as Seq
from redline.engine.batch import SeqImages
from redline.engine.messages import ImageInput
from redline.images import open_image
from redline.vision import VisionArgs, expanded_prompt, image_token_count, mrope_positions, merged_grid_of, \
    prompt_media

# Images one request carries at most (each is decoded, checked and encoded; the server caps them lower).
MAX_IMAGES_PER_REQUEST = 64


def image_bytes(image: Any) -> bytes:
    """The file bytes of an image given as bytes, or a PIL image written losslessly as PNG."""
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    if isinstance(image, Image.Image):
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()
    raise ValueError(f"an image must be a PIL image or the bytes of a PNG, JPEG, WebP or GIF file, got "
                     f"{type(image).__name__}")


def image_inputs(args: VisionArgs | None, ids: list[int],
                 images: Sequence[Any] | None) -> tuple[list[int], list[ImageInput]]:
    """The prompt `ids` with each image placeholder expanded into its image's tokens, and each image as it travels
    to the core; a one-line ValueError for an image that is not one, or placeholders and images that disagree."""
    images = list(images or [])
    if args is None:
        if images:
            raise ValueError("this checkpoint has no vision tower, so it takes no images; convert a multimodal "
                             "checkpoint (Gemma 3 4B+, Qwen2.5-VL) with scripts/convert_hf_checkpoint.py")
        return ids, []
    if not images:
        if args.placeholder_id in ids:
            raise ValueError(f"the prompt holds image placeholders (token {args.placeholder_id}) but no images came "
                             f"with it; pass images=[...]")
        return ids, []
    if len(images) > MAX_IMAGES_PER_REQUEST:
        raise ValueError(f"{len(images)} images in one request, more than the {MAX_IMAGES_PER_REQUEST} allowed")
    data = [image_bytes(image) for image in images]
    counts = [image_token_count(args, open_image(d)) for d in data]
    expanded, runs = expanded_prompt(args, ids, counts)
    return expanded, [ImageInput(d, start, count) for d, (start, count) in zip(data, runs)]


def seq_images(args: VisionArgs, prompt: list[int], inputs: Sequence[ImageInput]) -> SeqImages:
    """The core's record of a request's images, checked against its prompt (the front end expanded it): each image
    decodes, takes as many tokens as its run, and the runs hold the image token and nothing else does."""
    pictures = [open_image(i.data) for i in inputs]
    runs = [(i.start, i.tokens) for i in inputs]
    end = 0
    for (start, count), picture in zip(runs, pictures):
        if start < end or count != image_token_count(args, picture) or start + count > len(prompt):
            raise ValueError("the request's image runs do not match its images or its prompt")
        if any(t != args.image_token_id for t in prompt[start:start + count]):
            raise ValueError("an image run of the request holds tokens other than the image token")
        end = start + count
    if sum(1 for t in prompt if t == args.image_token_id) != sum(count for _, count in runs):
        raise ValueError("the prompt holds image tokens outside its images' runs")
    images = SeqImages(runs, [hashlib.sha256(i.data).digest() for i in inputs], pictures,
                       bidirectional=args.family == "gemma3")
    if args.family == "qwen2_5_vl":
        positions = mrope_positions(len(prompt), runs, [merged_grid_of(args, p) for p in pictures])  # (3, T)
        shift = int(positions[0, 0])  # the first token's positions are the shift (vision.mrope_positions)
        images.root = b"mrope-shift" + struct.pack("<q", shift) if shift else b""
    return images


def encode_images(tower: Any, seqs: Sequence[Seq]) -> None:
    """Run the tower once over the pictures of every sequence in `seqs` whose images are not encoded yet, and keep
    each one's model.PromptImages (embeddings and positions) on it."""
    todo = [s for s in seqs if s.images is not None and s.images.media is None]
    if not todo:
        return
    pictures = [p for s in todo for p in s.images.pictures]
    embeds = tower.encode(pictures)  # one (count, dim) tensor per picture, all in one batch
    device = embeds[0].device
    first = 0
    for seq in todo:
        images = seq.images
        own = embeds[first:first + len(images.pictures)]
        first += len(images.pictures)
        images.media = prompt_media(tower.args, seq.prompt_len, images.runs, images.pictures, own, device)
        images.pictures = []  # decoded pixels are not needed any more


def refusal(args: VisionArgs | None, request_images: Sequence[ImageInput], tensor_parallel: bool) -> str | None:
    """Why the core cannot take a request's images, or None."""
    if not request_images:
        return None
    if args is None:
        return "this model has no vision tower, so it takes no images"
    if tensor_parallel:
        return "a tensor-parallel engine does not take images yet"
    if len(request_images) > MAX_IMAGES_PER_REQUEST:
        return f"more than {MAX_IMAGES_PER_REQUEST} images in one request"
    return None
