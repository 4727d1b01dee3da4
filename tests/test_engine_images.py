"""Images through the batching engine (engine/images.py): rows with and without images in one batch give the greedy
tokens LLM.generate gives each alone (which test_vision.py checks against transformers), prompt chunks that split
the prompt between images, the prefix cache keyed by the images' content, and the checks at both ends."""
from __future__ import annotations

import msgspec
import pytest
import torch

from test_vision import PICTURES, picture, prompt_ids
from conftest import GPU_TEST_KV_TOKENS


@pytest.fixture(scope="module")
def vision_llm(multimodal_checkpoint):
    from redline.generate import LLM

    family, _, _, _, path = multimodal_checkpoint
    return family, LLM.load(path, device="cpu", compile=False)


def small_engine(llm, **settings):
    """An engine of small pages and prompt chunks, so that chunks end between and beside images."""
    from redline.engine import Engine

    return Engine(llm, **{"page_size": 4, "prefill_chunk": 8, **settings})


def test_rows_with_and_without_images_equal_generate_alone(vision_llm):
    from redline.engine.client import generate_all

    family, llm = vision_llm
    prompts = [prompt_ids(family, 0), prompt_ids(family, 1), prompt_ids(family, 2), prompt_ids(family, 1)]
    images = [None, PICTURES[:1], PICTURES[:2], [PICTURES[1]]]
    want = [llm.generate(p, images=i, max_new_tokens=6, ignore_eos=True).token_ids for p, i in zip(prompts, images)]
    engine = small_engine(llm)
    try:
        got = generate_all(engine, prompts, None, {"max_new_tokens": 6, "ignore_eos": True}, images)
    finally:
        engine.shutdown()
    assert [r.token_ids for r in got] == want
    assert want[1] != want[3]  # the picture decides the tokens, not only the placeholders
    # LLM.generate_batch is the same engine
    batch = llm.generate_batch(prompts[1:3], images=images[1:3], max_new_tokens=6, ignore_eos=True)
    assert [r.token_ids for r in batch] == want[1:3]


def test_prompt_logprobs_with_images_equal_the_whole_prompt_forward(vision_llm):
    """Every prompt position scored through chunked paged prefill steps (each chunk's share of the embeddings, the
    M-RoPE rows, Gemma's image mask) within 1e-4 of one forward of the whole prompt on the static cache."""
    from redline.vision import prompt_images

    family, llm = vision_llm
    prompt, images = prompt_ids(family, 2), PICTURES[:2]
    engine = small_engine(llm, prefill_chunk=5)
    try:
        handle = engine.add_request(prompt, llm_options(prompt_logprobs=True, max_new_tokens=1), images)
        first = next(iter(handle))
        handle.result()
    finally:
        engine.shutdown()
    with torch.inference_mode():
        ids, media = prompt_images(llm.vision, prompt, images)
        llm.model.setup_caches(1, 64)
        logits = llm.model(torch.tensor([ids]), torch.arange(len(ids)), images=media)[0].float()
    want = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:]).view(-1, 1)).squeeze(1)
    got = torch.tensor(first.prompt_logprobs[1:])
    assert first.prompt_logprobs[0] is None and got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4


def llm_options(**fields):
    from redline.options import GenerationOptions

    return GenerationOptions(**{"ignore_eos": True, **fields})


def test_the_same_picture_hits_the_prefix_cache_and_another_does_not(vision_llm):
    """A second turn with the same picture reuses the pages of the first (counted in the engine's stats) and gives
    the tokens LLM.generate gives; the same prompt with another picture reuses none past the image's start."""
    from redline.vision import expanded_prompt, image_token_count

    family, llm = vision_llm
    first = prompt_ids(family, 1)
    args = llm.vision.args
    runs = expanded_prompt(args, first, [image_token_count(args, PICTURES[0])])[1]
    engine = small_engine(llm)
    try:
        reply = engine.add_request(first, llm_options(max_new_tokens=4), [PICTURES[0]]).result().token_ids
        second = first + reply + [40, 41, 42]
        before = engine.stats().prefix_cache_hits
        handle = engine.add_request(second, llm_options(max_new_tokens=5), [PICTURES[0]])
        outputs = list(handle)
        hit = engine.stats().prefix_cache_hits - before
        assert hit >= len(expanded_prompt(args, first, [runs[0][1]])[0]) // 4 * 4  # every page of the first turn
        assert outputs[-1].cached_tokens == hit
        want = llm.generate(second, images=[PICTURES[0]], max_new_tokens=5, ignore_eos=True).token_ids
        assert [t for o in outputs for t in o.token_ids] == want
        other = picture(*PICTURES[0].size, seed=7)  # the same size: the same placeholder run, other pixels
        before = engine.stats().prefix_cache_hits
        engine.add_request(second, llm_options(max_new_tokens=2), [other]).result()
        assert engine.stats().prefix_cache_hits - before <= runs[0][0]  # only text pages before the image
    finally:
        engine.shutdown()


def test_image_requests_are_checked_at_both_ends(vision_llm, tiny_llm_checkpoint):
    from redline.engine.messages import CoreRequest, ImageInput

    family, llm = vision_llm
    engine = small_engine(llm)
    try:
        with pytest.raises(ValueError, match="no images came with it"):
            engine.add_request(prompt_ids(family, 1), llm_options(max_new_tokens=2))
        with pytest.raises(ValueError, match="1 image placeholders .* but 2 images"):
            engine.add_request(prompt_ids(family, 1), llm_options(max_new_tokens=2), PICTURES[:2])
        with pytest.raises(ValueError, match="not an image"):
            engine.add_request(prompt_ids(family, 1), llm_options(max_new_tokens=2), [b"GIF89a not really"])
        # The core checks again what reaches it: a run that does not match its picture ends with an error.
        ids, _, inputs = engine.check_request(prompt_ids(family, 1), None, [PICTURES[0]])
        forged = [ImageInput(inputs[0].data, inputs[0].start + 1, inputs[0].tokens)]
        caught = []
        engine.core.sink = caught.extend
        engine.core.add(CoreRequest("forged", ids, 2, images=forged))
        assert caught and caught[0].finish_reason == "error" and "image" in caught[0].error
    finally:
        engine.shutdown()
    from redline.generate import LLM

    text_only = LLM.load(tiny_llm_checkpoint[0], device="cpu", compile=False)
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.generate_batch([[1, 2, 3]], images=[[PICTURES[0]]], max_new_tokens=2)


def test_requests_with_images_cross_the_process_boundary_as_msgpack(vision_llm):
    """A CoreRequest with images encodes to MessagePack and back unchanged (the image's file bytes as bytes)."""
    from redline.engine.images import image_inputs
    from redline.engine.messages import CoreRequest, ToCore

    family, llm = vision_llm
    ids, inputs = image_inputs(llm.vision.args, prompt_ids(family, 1), [PICTURES[0]])
    request = CoreRequest("r", ids, 3, images=inputs)
    data = msgspec.msgpack.encode(request)
    assert msgspec.msgpack.Decoder(ToCore).decode(data) == request
    start, count = inputs[0].start, inputs[0].tokens
    assert ids[start:start + count] == [llm.vision.args.image_token_id] * count
    assert len(ids) - len(prompt_ids(family, 1)) == count + len(llm.vision.args.image_prefix) - 1 + len(
        llm.vision.args.image_suffix)


@pytest.mark.gpu
@pytest.mark.parametrize("n_images", [1, 2])
def test_gpu_engine_with_images_equals_generate(multimodal_checkpoint, n_images):
    """On a GPU (fp32, kernels, compiled prefill and decode graphs): rows with and without images through the
    engine give LLM.generate's greedy tokens; the image steps run eagerly, the decode steps as graphs."""
    from redline.generate import LLM

    family, _, _, _, path = multimodal_checkpoint
    llm = LLM.load(path, device="cuda", dtype="float32", compile=True, max_kv_tokens=GPU_TEST_KV_TOKENS)
    prompts = [prompt_ids(family, 0), prompt_ids(family, n_images), prompt_ids(family, 1)]
    images = [None, PICTURES[:n_images], [PICTURES[1]]]
    want = [llm.generate(p, images=i, max_new_tokens=8, ignore_eos=True).token_ids for p, i in zip(prompts, images)]
    got = llm.generate_batch(prompts, images=images, max_new_tokens=8, ignore_eos=True)
    assert [r.token_ids for r in got] == want
    assert llm.engine.graphs is not None
