"""The vision towers (vision.py) against transformers' Gemma3ForConditionalGeneration and
Qwen2_5_VLForConditionalGeneration: fp32 logits of prompts with one and two images, and greedy tokens through
LLM.generate."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers")

from conftest import GPU_TEST_KV_TOKENS, MULTIMODAL_NEWLINES, MULTIMODAL_TOKENS  # noqa: E402


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A smooth random RGB picture (noise blurred by upsampling, so resizing filters matter but do not dominate)."""
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8))
    return small.resize((width, height), Image.BICUBIC)


PICTURES = [picture(100, 70, 1), picture(150, 120, 2)]


def placeholder(family: str) -> int:
    tokens = MULTIMODAL_TOKENS[family]
    return tokens["boi_token_index"] if family == "gemma3" else tokens["image_token_id"]


def prompt_ids(family: str, n_images: int) -> list[int]:
    """Text ids with one placeholder per image, as the family's chat template writes it."""
    text = [2, 17, 45, 99, 23]
    tokens = MULTIMODAL_TOKENS[family]
    if family == "gemma3":
        image = [placeholder(family)]
    else:
        image = [tokens["vision_start_token_id"], placeholder(family), tokens["vision_end_token_id"]]
    ids = list(text)
    for i in range(n_images):
        ids += image + [60 + i, 61 + i]
    return ids + [88, 7]


def hf_inputs(family: str, processor, ids: list[int], images: list[Image.Image]) -> dict:
    """transformers' model inputs for the expanded prompt `ids`: pixels from its own image processor."""
    out = {"input_ids": torch.tensor([ids])}
    if not images:
        return out
    features = processor(images=images, return_tensors="pt")
    image_token = MULTIMODAL_TOKENS[family]["image_token_index" if family == "gemma3" else "image_token_id"]
    types = (out["input_ids"] == image_token).long()
    out["pixel_values"] = features["pixel_values"]
    if family == "gemma3":
        out["token_type_ids"] = types
    else:
        out["image_grid_thw"] = features["image_grid_thw"]
        out["mm_token_type_ids"] = types.int()
    return out


@pytest.fixture(scope="module")
def multimodal_llm(multimodal_checkpoint):
    from redline.generate import LLM

    family, hf_dir, hf_model, processor, path = multimodal_checkpoint
    return family, hf_model, processor, LLM.load(path, device="cpu", compile=False)


@pytest.mark.parametrize("n_images", [1, 2])
def test_prompt_logits_and_decode_steps_match_transformers(multimodal_llm, n_images):
    """Every prompt position's logits, then three decode steps after it (the M-RoPE shift, the bidirectional image
    attention's end), within 1e-4 of transformers' logits of the whole sequence in one forward."""
    from redline.vision import prompt_images

    family, hf_model, processor, llm = multimodal_llm
    images = PICTURES[:n_images]
    with torch.inference_mode():
        ids, media = prompt_images(llm.vision, prompt_ids(family, n_images), images)
        steps = [31, 400, 5]
        model = llm.model
        model.setup_caches(1, 64)
        ours = [model(torch.tensor([ids]), torch.arange(len(ids)), images=media)]
        ours += [model(torch.tensor([[t]]), torch.tensor([len(ids) + i])) for i, t in enumerate(steps)]
        ours = torch.cat(ours, dim=1)
        theirs = hf_model(**hf_inputs(family, processor, ids + steps, images)).logits
    assert media.embeds.shape[0] == sum(llm.vision.token_count(image) for image in images)
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-4, diff
    assert theirs.std() > 0.3  # the comparison is of real logits, not of near-constant ones


def test_gemma_images_are_wrapped_as_its_processor_does(multimodal_llm):
    """Gemma 3: each placeholder becomes "\\n\\n", start, the image's tokens, end, "\\n\\n" (its processor's text)."""
    from redline.vision import prompt_images

    family, _, _, llm = multimodal_llm
    if family != "gemma3":
        pytest.skip("Gemma 3 only")
    t = MULTIMODAL_TOKENS["gemma3"]
    with torch.inference_mode():
        ids, media = prompt_images(llm.vision, [2, placeholder(family), 9], PICTURES[:1])
    run = [t["image_token_index"]] * 9
    assert ids == [2, MULTIMODAL_NEWLINES, t["boi_token_index"], *run, t["eoi_token_index"], MULTIMODAL_NEWLINES, 9]
    assert media.slots.tolist() == list(range(3, 12))


@pytest.mark.parametrize("n_images", [1, 2])
def test_greedy_tokens_through_generate_equal_transformers(multimodal_llm, n_images):
    from redline.vision import prompt_images

    family, hf_model, processor, llm = multimodal_llm
    images = PICTURES[:n_images]
    prompt = prompt_ids(family, n_images)
    result = llm.generate(prompt, images=images, max_new_tokens=8, temperature=0.0, ignore_eos=True)
    with torch.inference_mode():
        ids, _ = prompt_images(llm.vision, prompt, images)
        inputs = hf_inputs(family, processor, ids, images)
        want = hf_model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert result.token_ids == want
    assert result.stats.prompt_tokens == len(ids)


def test_text_only_prompts_still_match_transformers(multimodal_llm):
    """No images: the language model alone (Qwen2.5-VL's M-RoPE then equals 1D rope)."""
    family, hf_model, processor, llm = multimodal_llm
    ids = [2, 17, 45, 99, 23, 88, 7]
    result = llm.generate(ids, max_new_tokens=6, temperature=0.0, ignore_eos=True)
    with torch.inference_mode():
        want = hf_model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    assert result.token_ids == want


def test_image_placeholders_and_images_must_agree(multimodal_llm):
    family, _, _, llm = multimodal_llm
    with pytest.raises(ValueError, match="1 image placeholders .* but 2 images"):
        llm.generate(prompt_ids(family, 1), images=PICTURES, max_new_tokens=2)
    with pytest.raises(ValueError, match="no images came with it"):
        llm.generate(prompt_ids(family, 1), max_new_tokens=2)


def test_a_text_only_checkpoint_refuses_images(tiny_llm_checkpoint):
    from redline.generate import LLM

    llm = LLM.load(tiny_llm_checkpoint[0], device="cpu", compile=False)
    with pytest.raises(ValueError, match="no vision tower"):
        llm.generate([1, 5, 6], images=PICTURES[:1], max_new_tokens=2)


def test_image_bytes_are_decoded_like_pil_images(multimodal_llm):
    """PNG bytes give the same tokens as the PIL image they encode."""
    import io

    family, _, _, llm = multimodal_llm
    buffer = io.BytesIO()
    PICTURES[0].save(buffer, format="PNG")
    prompt = prompt_ids(family, 1)
    from_bytes = llm.generate(prompt, images=[buffer.getvalue()], max_new_tokens=4, ignore_eos=True)
    from_pil = llm.generate(prompt, images=PICTURES[:1], max_new_tokens=4, ignore_eos=True)
    assert from_bytes.token_ids == from_pil.token_ids


# --- the converter and config readers ---

# Published config.json of Qwen2.5-VL-7B-Instruct (transformers 4's flat layout) and Gemma 3 12B's multimodal one
# (its text_config only what differs from transformers' defaults), as the GPU benchmark builds them.
from redline.benchmarks.bench_vision import PUBLISHED_CONFIGS  # noqa: E402

QWEN2_5_VL_7B, GEMMA3_12B = PUBLISHED_CONFIGS["Qwen2.5-VL-7B"], PUBLISHED_CONFIGS["Gemma-3-12B"]


def test_published_multimodal_configs_read_as_their_shapes():
    from redline.model import ModelArgs
    from redline.scripts.hf_config import args_from_hf_config, vision_args_from_hf_config

    qwen = args_from_hf_config(QWEN2_5_VL_7B)
    assert qwen.mrope_sections == (16, 24, 24) and qwen.qkv_bias and qwen.rope_scaling is None
    assert qwen == ModelArgs(**{**ModelArgs.from_name("Qwen2.5-7B").to_dict(), "mrope_sections": (16, 24, 24),
                                "block_size": 128000})
    tower = vision_args_from_hf_config(QWEN2_5_VL_7B, None, None)
    shapes = (tower.dim, tower.n_layer, tower.n_head, tower.intermediate_size, tower.out_dim)
    assert shapes == (1280, 32, 16, 3420, 3584)
    assert tower.full_attention_layers == (7, 15, 23, 31) and tower.window_size == 112
    assert tower.processing.resample == 3 and tower.processing.max_pixels == 28 * 28 * 1280
    assert args_from_hf_config(GEMMA3_12B) == ModelArgs.from_name("Gemma-3-12B")  # transformers' defaults filled in
    gemma = vision_args_from_hf_config(GEMMA3_12B, {"size": {"height": 896, "width": 896}}, 108)
    assert (gemma.dim, gemma.n_layer, gemma.tokens_per_image, gemma.out_dim) == (1152, 27, 256, 3840)
    assert gemma.image_prefix == (108, 255999) and gemma.image_suffix == (256000, 108)
    assert vision_args_from_hf_config({"architectures": ["LlamaForCausalLM"]}) is None


@pytest.mark.parametrize("processor, message", [
    ({"do_pan_and_scan": True}, "pan and scan"),
    ({"size": {"height": 448, "width": 448}}, "differs from the tower's 896-pixel tiles"),
    ({"do_normalize": False}, "do_normalize=False"),
])
def test_unimplemented_preprocessing_is_refused(processor, message):
    from redline.scripts.hf_config import vision_args_from_hf_config

    with pytest.raises(ValueError, match=message) as info:
        vision_args_from_hf_config(GEMMA3_12B, processor)
    assert "\n" not in str(info.value)


def test_the_tower_is_converted_beside_the_checkpoint(multimodal_checkpoint, tiny_checkpoint, tmp_path):
    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint
    from redline.vision import load_vision_tower, vision_path

    family, hf_dir, _, _, path = multimodal_checkpoint
    assert vision_path(path).is_file() and vision_path(path).name == "model.redline.vision.safetensors"
    tower = load_vision_tower(path, "cpu", torch.bfloat16)
    assert tower.args.family == family and next(tower.parameters()).dtype == torch.bfloat16
    assert not vision_path(tiny_checkpoint[0]).exists()  # a text-only model has none
    out = tmp_path / "m.safetensors"
    vision_path(out).write_bytes(b"someone else's data")
    with pytest.raises(ValueError, match="exists and is not a Redline vision file"):
        convert_hf_checkpoint(hf_dir, out, dtype="float32")
    assert not out.exists() and vision_path(out).read_bytes() == b"someone else's data"
    vision_path(out).unlink()
    convert_hf_checkpoint(hf_dir, out, dtype="float32")
    with pytest.raises(ValueError, match="exists; pass --overwrite"):
        convert_hf_checkpoint(hf_dir, out, dtype="float32")


def test_the_cli_takes_image_files(multimodal_llm, multimodal_checkpoint, tmp_path, capsys):
    from redline.generate import main

    family, _, _, llm = multimodal_llm
    path = multimodal_checkpoint[-1]
    marker = "<start>" if family == "gemma3" else "<start> <image> <end>"
    prompt = f"w17 w45 {marker} w60 w61"
    image = tmp_path / "picture.png"
    PICTURES[0].save(image)
    flags = ["--checkpoint_path", str(path), "--device", "cpu", "--max_new_tokens", "4", "--temperature", "0"]
    assert main([*flags, "--prompt", prompt, "--image", str(image)]) == 0
    want = llm.generate(prompt, images=[image.read_bytes()], max_new_tokens=4).text
    assert capsys.readouterr().out == prompt + want + "\n"
    assert main([*flags, "--prompt", prompt, "--image", str(tmp_path / "missing.png")]) != 0
    err = capsys.readouterr().err
    assert "missing.png does not exist" in err and err.count("\n") == 1


def test_the_batching_engine_refuses_placeholders_without_images(multimodal_llm):
    """A prompt marking an image that came without one is refused rather than run as text."""
    family, _, _, llm = multimodal_llm
    with pytest.raises(ValueError, match="no images came with it"):
        llm.generate_batch([prompt_ids(family, 1)], max_new_tokens=2)


@pytest.mark.gpu
@pytest.mark.parametrize("n_images", [1, 2])
def test_gpu_kernels_and_compile_give_transformers_greedy_tokens(multimodal_checkpoint, n_images):
    """On a GPU: the tower there, the prefill through the kernel attention (Gemma's image mask through model.py's
    masked path), compiled fused decode steps after it; fp32 throughout, against transformers on the CPU."""
    from redline.generate import LLM
    from redline.vision import prompt_images

    family, _, hf_model, processor, path = multimodal_checkpoint
    llm = LLM.load(path, device="cuda", dtype="float32", compile=True, max_kv_tokens=GPU_TEST_KV_TOKENS)
    assert llm.kernels and next(llm.vision.parameters()).is_cuda
    images, prompt = PICTURES[:n_images], prompt_ids(family, n_images)
    ours = llm.generate(prompt, images=images, max_new_tokens=8, temperature=0.0, ignore_eos=True).token_ids
    with torch.inference_mode():
        ids, _ = prompt_images(multimodal_llm_cpu_tower(path), prompt, images)
        want = hf_model.generate(**hf_inputs(family, processor, ids, images), max_new_tokens=8, do_sample=False)
    assert ours == want[0, len(ids):].tolist()


def multimodal_llm_cpu_tower(path):
    from redline.vision import load_vision_tower

    return load_vision_tower(path, "cpu", torch.float32)


def test_chat_takes_image_parts(multimodal_llm):
    """Content parts {"type": "image", "image": ...} go through the chat template as the family's placeholder."""
    family, _, _, llm = multimodal_llm
    parts = [{"type": "text", "text": "w17 w45"}, {"type": "image", "image": PICTURES[1]},
             {"type": "text", "text": "w60"}, {"type": "image", "image": PICTURES[0]}]
    reply = llm.chat([{"role": "user", "content": parts}], max_new_tokens=4, ignore_eos=True)
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "w17 w45 " + " w60 ".join(
        ["<start>" if family == "gemma3" else "<start> <image> <end>"] * 2)}])
    assert ids.count(placeholder(family)) == 2
    want = llm.generate(ids, images=[PICTURES[1], PICTURES[0]], max_new_tokens=4, ignore_eos=True)
    assert reply.token_ids == want.token_ids
    with pytest.raises(ValueError, match="not both"):
        llm.chat([{"role": "user", "content": parts}], images=PICTURES, max_new_tokens=2)
    with pytest.raises(ValueError, match="each content part must be"):
        llm.chat([{"role": "user", "content": [{"type": "audio"}]}], max_new_tokens=2)


def test_quantizing_keeps_the_tower_beside_the_copy(multimodal_checkpoint):
    """quantize.py writes the text model quantized and copies the tower (never quantized) beside it."""
    from redline.generate import LLM
    from redline.quantize import quantize_checkpoint
    from redline.vision import vision_path

    family, _, _, _, path = multimodal_checkpoint
    out = quantize_checkpoint(path, "int8")  # beside the input, with its tokenizer
    assert vision_path(out).read_bytes() == vision_path(path).read_bytes()
    llm = LLM.load(out, device="cpu", compile=False)
    assert llm.generate(prompt_ids(family, 1), images=PICTURES[:1], max_new_tokens=2, ignore_eos=True).token_ids
    with pytest.raises(ValueError, match="exists; pass --overwrite"):
        quantize_checkpoint(path, "int8")
