"""Shared fixtures: tiny random HF checkpoints and tokenizers trained on the fly."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# A GPU test's page pool in tokens: room for its prompts, not most of the GPU. A pool sized from free memory stays
# allocated until the test's objects are collected, and the next test's pool would find no room.
GPU_TEST_KV_TOKENS = 8192


@pytest.fixture(autouse=True)
def _free_gpu_memory_after_gpu_tests(request):
    """After each GPU test, collect its objects and give their cached blocks back, so tests share one GPU."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


# --- model and checkpoint fixtures (owner: model/checkpoint) ---
from pathlib import Path

# Tiny HF Llama configs, one per feature the converter and model must handle.
HF_VARIANTS: dict[str, dict] = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),
    "llama3_rope": dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "head_dim": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24),
    "sharded": dict(num_attention_heads=4, num_key_value_heads=2),
    "bin": dict(num_attention_heads=4, num_key_value_heads=2),
}


def prefill_then_decode_logits(model, ids: torch.Tensor, prompt_len: int, cache_len: int = 64) -> torch.Tensor:
    """Logits (B, T, vocab) of a fresh cache: ids[:, :prompt_len] as one prefill, then one token per step."""
    model.setup_caches(ids.shape[0], cache_len)
    steps = [model(ids[:, :prompt_len], torch.arange(prompt_len, device=ids.device))]
    steps += [model(ids[:, p:p + 1], torch.tensor([p], device=ids.device)) for p in range(prompt_len, ids.shape[1])]
    return torch.cat(steps, dim=1)


def captured_graph(call):
    """call() run once (Triton compiles outside the capture), then captured as a CUDA graph: (graph, its output)."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def interpreted_errors_of(script: str, timeout: int, extra_env: dict[str, str] | None = None) -> dict[str, float]:
    """Run a kernel test module as a script under TRITON_INTERPRET=1 (set before Triton is imported, which other test
    modules may already have done in this process) and read the {case/dtype: relative error} JSON it prints last."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", **(extra_env or {})}
    proc = subprocess.run([sys.executable, script], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tiny_hf_config(**overrides):
    from transformers import LlamaConfig

    base = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=160, vocab_size=512,
                max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    base.update(overrides)
    return LlamaConfig(**base)


def save_tiny_hf_checkpoint(out_dir: Path, variant: str = "gqa", seed: int = 0, **overrides):
    """Save a random LlamaForCausalLM in HF layout; returns (out_dir, fp32 HF model in eval mode)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = tiny_hf_config(**{**HF_VARIANTS[variant], **overrides})
    model = LlamaForCausalLM(config).eval()
    # Random norms too, so a wrong norm mapping cannot hide behind all-ones weights.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    out_dir.mkdir(parents=True, exist_ok=True)
    if variant == "bin":
        config.save_pretrained(out_dir)
        torch.save(model.state_dict(), out_dir / "pytorch_model.bin")
    elif variant == "sharded":
        model.save_pretrained(out_dir, max_shard_size="100KB")
    else:
        model.save_pretrained(out_dir)
    return out_dir, model


@pytest.fixture(scope="session", params=sorted(HF_VARIANTS))
def hf_variant_checkpoint(request, tmp_path_factory):
    """(variant, HF dir, HF model, converted fp32 Redline file) for every variant."""
    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    hf_dir, hf_model = save_tiny_hf_checkpoint(tmp_path_factory.mktemp(f"hf-{request.param}"), request.param)
    path = convert_hf_checkpoint(hf_dir, dtype="float32")
    return request.param, hf_dir, hf_model, path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A converted fp32 tiny GQA checkpoint with its HF reference model: (path, hf_model)."""
    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    hf_dir, hf_model = save_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf-tiny"), "gqa")
    return convert_hf_checkpoint(hf_dir, dtype="float32"), hf_model



@pytest.fixture(scope="session")
def tiny_llm_checkpoint(tmp_path_factory, sp_tokenizer_dir):
    """A converted fp32 tiny model with a SentencePiece tokenizer beside it: (path, hf_model).

    The model's vocabulary equals the tokenizer's, so every sampled id decodes.
    """
    import shutil

    import sentencepiece as spm

    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    vocab = spm.SentencePieceProcessor(model_file=str(sp_tokenizer_dir / "tokenizer.model")).vocab_size()
    hf_dir, hf_model = save_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf-llm"), "gqa", vocab_size=vocab)
    shutil.copy(sp_tokenizer_dir / "tokenizer.model", hf_dir / "tokenizer.model")
    hf_model.generation_config.eos_token_id = None  # compare fixed-length continuations
    return convert_hf_checkpoint(hf_dir, dtype="float32"), hf_model


# Tiny configs of the other families, each option at both values somewhere: (transformers class, config overrides).
# Every one has head_dim != hidden / heads or a family default that differs from Llama's.
_FAMILY_BASE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=96, vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-5,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1)
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 256,
             "short_factor": [1.0, 1.3, 1.9, 2.6, 3.1, 4.0], "long_factor": [1.2, 2.0, 3.5, 5.0, 7.5, 11.0]}
FAMILY_VARIANTS: dict[str, tuple[str, dict]] = {
    "qwen2_tied": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen2_window": ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3": ("Qwen3ForCausalLM", dict(head_dim=24, rope_theta=1e6)),
    "qwen3_tied_bias": ("Qwen3ForCausalLM", dict(head_dim=8, tie_word_embeddings=True, attention_bias=True)),
    "gemma3": ("Gemma3ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=8, num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})),
    "gemma3_untied_softcap": ("Gemma3ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=6, tie_word_embeddings=False,
        final_logit_softcapping=3.0, attn_logit_softcapping=2.0)),
    "gemma2": ("Gemma2ForCausalLM", dict(head_dim=24, query_pre_attn_scalar=20, sliding_window=8,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "phi3_longrope": ("Phi3ForCausalLM", dict(max_position_embeddings=1024, original_max_position_embeddings=256,
                                              partial_rotary_factor=0.75,
                                              rope_parameters=dict(_LONGROPE, partial_rotary_factor=0.75),
                                              tie_word_embeddings=True)),
    "phi3_window": ("Phi3ForCausalLM", dict(sliding_window=8, num_key_value_heads=4)),
    "olmo2": ("Olmo2ForCausalLM", dict(rope_theta=5e5)),
    "olmo2_bias": ("Olmo2ForCausalLM", dict(attention_bias=True, tie_word_embeddings=True, num_key_value_heads=1)),
    "granite": ("GraniteForCausalLM", dict(embedding_multiplier=3.0, attention_multiplier=0.3,
                                           residual_multiplier=0.6, logits_scaling=4.0, tie_word_embeddings=True)),
}


def randomize_parameters(model, gemma: bool) -> None:
    """Every parameter random, norms and biases included (transformers initializes those to constants, which hide
    a wrong mapping): norms around 1 (Gemma's around 0, since they scale by 1 + w), biases around 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                base = 0.0 if gemma or not name.endswith("norm.weight") else 1.0
                p.copy_(base + 0.2 * torch.randn_like(p))


def save_family_checkpoint(out_dir: Path, variant: str, seed: int = 0, **overrides):
    """Save a random model of FAMILY_VARIANTS[variant] in HF layout; returns (out_dir, fp32 HF model in eval mode)."""
    return save_random_hf_model(out_dir, *FAMILY_VARIANTS[variant], seed, overrides)


def save_random_hf_model(out_dir: Path, arch: str, extra: dict, seed: int, overrides: dict, wide_routers: bool = False):
    """A random transformers `arch` model of _FAMILY_BASE updated by extra and overrides, saved in HF layout; returns
    (out_dir, the fp32 model in eval mode). wide_routers: MoE routers drawn wide enough that tokens choose different
    experts."""
    import transformers

    model_class = getattr(transformers, arch)
    torch.manual_seed(seed)
    config = model_class.config_class(**{**_FAMILY_BASE, **extra, **overrides}, attn_implementation="eager")
    model = model_class(config).eval()
    randomize_parameters(model, arch.startswith("Gemma"))
    if wide_routers:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("gate.weight") and ".experts." not in name:
                    p.normal_(0.0, 0.5)
    model.save_pretrained(out_dir)
    return out_dir, model


@pytest.fixture(scope="session", params=sorted(FAMILY_VARIANTS))
def family_checkpoint(request, tmp_path_factory):
    """(variant, HF dir, HF model, converted fp32 Redline file) for every family variant."""
    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    hf_dir, hf_model = save_family_checkpoint(tmp_path_factory.mktemp(f"hf-{request.param}"), request.param)
    return request.param, hf_dir, hf_model, convert_hf_checkpoint(hf_dir, dtype="float32")


# Tiny mixtures of experts: (transformers class, config overrides). Both renormalizations, dense layers through
# mlp_only_layers and decoder_sparse_step, a sliding window, tied embeddings.
MOE_VARIANTS: dict[str, tuple[str, dict]] = {
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=24,
                                           rope_theta=1e6)),
    "mixtral_window": ("MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                                                  tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                              head_dim=24, mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe_norm_step": ("Qwen3MoeForCausalLM", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48,
                                                        head_dim=16, decoder_sparse_step=2, norm_topk_prob=True,
                                                        num_hidden_layers=4, tie_word_embeddings=True)),
}


def save_moe_checkpoint(out_dir: Path, variant: str, seed: int = 0):
    """Save a random model of MOE_VARIANTS[variant] in HF layout; returns (out_dir, fp32 HF model in eval mode).
    The routers and experts are drawn wide enough that tokens choose different experts."""
    return save_random_hf_model(out_dir, *MOE_VARIANTS[variant], seed, {}, wide_routers=True)


@pytest.fixture(scope="session", params=sorted(MOE_VARIANTS))
def moe_checkpoint(request, tmp_path_factory):
    """(variant, HF dir, HF model, converted fp32 Redline file) for every mixture-of-experts variant."""
    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    hf_dir, hf_model = save_moe_checkpoint(tmp_path_factory.mktemp(f"hf-{request.param}"), request.param)
    return request.param, hf_dir, hf_model, convert_hf_checkpoint(hf_dir, dtype="float32")


class ChatTemplateTokenizer:
    """A real tokenizer plus a small chat template of its own: `<role>\\ncontent\\n` per message, then
    `<assistant>\\n`, BOS first. Records each conversation it renders (in `calls`)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.bos_id, self.eos_ids, self.vocab_size = inner.bos_id, tuple(inner.eos_ids), inner.vocab_size
        self.calls: list[list[dict]] = []

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def decode(self, ids) -> str:
        return self.inner.decode(ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        self.calls.append([dict(m) for m in messages])
        text = "".join(f"<{m['role']}>\n{m['content']}\n" for m in messages)
        return [self.bos_id] + self.inner.encode(text + ("<assistant>\n" if add_generation_prompt else ""))


@pytest.fixture
def chat_tokenizer(sp_tokenizer_dir):
    """The SentencePiece fixture tokenizer with a chat template (a fresh one per test: it records its calls)."""
    from redline.tokenizer import load_tokenizer

    return ChatTemplateTokenizer(load_tokenizer(sp_tokenizer_dir))


# --- tokenizer fixtures (owner: tokenizer) ---

# Sample text for the tokenizer fixtures: English, code with indentation, and multi-byte characters.
_TOKENIZER_SAMPLE_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "A tokenizer turns text into ids, and ids back into the same text.",
    "Llama models read tokens, predict the next one, and stop at the end of a turn.",
    "héllo wörld, ça va? naïve café, jalapeño, Straße, smörgåsbord.",
    "日本語のテキストも正しく扱えます。東京、大阪、京都。",
    "Emoji too: 🚀 launch, 🦙 llama, 🔥 fire, 👍🏽 thumbs up.",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी.",
    "def fibonacci(n: int) -> int:",
    "    if n < 2:",
    "        return n",
    "    return fibonacci(n - 1) + fibonacci(n - 2)",
    "for i in range(10):",
    "    print(f\"{i}: {fibonacci(i)}\")",
    "class Cache:",
    "    def __init__(self, size=128):",
    "        self.data = {}  # key -> value",
    "if (x != NULL && y >= 0) { return x[y]; } else { return -1; }",
    "numbers 0123456789, 3.14159, 2**10 == 1024, 1e-5",
    "The model has 32 layers, 4096 dimensions and 32000 tokens in its vocabulary.",
]


@pytest.fixture(scope="session")
def tokenizer_sample_text() -> str:
    """A few KB of mixed English, Python/C code and non-ASCII text, used to train the tiny tokenizers."""
    return "\n".join(_TOKENIZER_SAMPLE_LINES * 4) + "\n"


@pytest.fixture(scope="session")
def sp_tokenizer_dir(tmp_path_factory, tokenizer_sample_text):
    """A directory with a tiny SentencePiece BPE `tokenizer.model` (512 pieces, byte fallback,
    Llama-2-style settings: unk=0, bos=1, eos=2, identity normalisation, whitespace kept)."""
    import sentencepiece as spm

    directory = tmp_path_factory.mktemp("sp_tokenizer")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(tokenizer_sample_text.splitlines()),
        model_prefix=str(directory / "tokenizer"),
        model_type="bpe",
        vocab_size=512,
        hard_vocab_limit=False,
        byte_fallback=True,
        character_coverage=0.995,  # the rarest characters (the emoji) go through byte fallback
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return directory


def _train_byte_bpe_ranks(text: str, num_merges: int) -> dict[bytes, int]:
    """Tiktoken-style mergeable ranks: the 256 single bytes (rank = byte value), then `num_merges`
    merges of the most frequent adjacent pair, each ranked after both of its parts."""
    import re
    from collections import Counter

    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(re.findall(r" ?\w+| ?[^\w\s]+|\s+", text))
    seqs = {tuple(bytes([c]) for c in word.encode("utf-8")): n for word, n in words.items()}
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for seq, n in seqs.items():
            for pair in zip(seq, seq[1:]):
                pairs[pair] += n
        if not pairs:
            break
        (left, right), _ = pairs.most_common(1)[0]
        ranks.setdefault(left + right, len(ranks))
        merged_seqs = {}
        for seq, n in seqs.items():
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == left and seq[i + 1] == right:
                    out.append(left + right)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            merged_seqs[tuple(out)] = merged_seqs.get(tuple(out), 0) + n
        seqs = merged_seqs
    return ranks


@pytest.fixture(scope="session")
def tiktoken_tokenizer_dir(tmp_path_factory, tokenizer_sample_text):
    """A directory with a tiny tiktoken-format (Llama 3 style) `tokenizer.model`: the 256 single
    bytes plus 64 merges learned from the sample text, one `<base64 token> <rank>` per line."""
    import base64

    directory = tmp_path_factory.mktemp("tiktoken_tokenizer")
    ranks = _train_byte_bpe_ranks(tokenizer_sample_text, num_merges=64)
    lines = [f"{base64.b64encode(token).decode('ascii')} {rank}\n" for token, rank in ranks.items()]
    (directory / "tokenizer.model").write_text("".join(lines), encoding="ascii")
    return directory


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory, tokenizer_sample_text):
    """A directory with a tiny byte-level BPE `tokenizer.json` (special tokens `<s>` = 0 and
    `</s>` = 1) and a `tokenizer_config.json` naming them as BOS (a string) and EOS (a dict)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = tmp_path_factory.mktemp("hf_tokenizer")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(tokenizer_sample_text.splitlines(keepends=True), trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


# --- real-model fixtures (owner: tokenizer) ---
SMOLLM2_DOWNLOAD_HELP = "run `make demo` once with network access (it caches the model under checkpoints/smollm2)"


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Path:
    """SmolLM2-135M-Instruct as a float32 Redline checkpoint, fetched and converted as `make demo` does (cached in
    checkpoints/smollm2). Skips when the download fails outside CI; in CI (CI=true) that fails the test."""
    import os

    from redline.scripts.demo_model import DEFAULT_DIR, demo_checkpoint

    try:
        return demo_checkpoint(Path(__file__).resolve().parents[1] / DEFAULT_DIR)
    except RuntimeError as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"the real-model tests need SmolLM2 and CI must be able to download it: {exc}")
        pytest.skip(f"SmolLM2 could not be downloaded ({exc}); {SMOLLM2_DOWNLOAD_HELP}")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_checkpoint):
    """(HF tokenizer, HF fp32 model) from transformers' own GGUF loader, reading the same GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from redline.scripts.demo_model import gguf_path

    gguf_file = gguf_path(smollm2_checkpoint.parents[1])
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    return tokenizer, model.eval()


# --- server fixtures (owner: server) ---
# A small ChatML-style template: every message as <|role|>\n...\n, then the assistant's header.
TINY_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="session")
def tiny_chat_checkpoint(tmp_path_factory, tiny_llm_checkpoint):
    """tiny_llm_checkpoint's folder copied with a chat template beside it: (checkpoint path, hf_model)."""
    import shutil

    path, hf_model = tiny_llm_checkpoint
    folder = tmp_path_factory.mktemp("tiny-chat") / "tiny-chat"
    shutil.copytree(path.parent, folder)
    (folder / "chat_template.jinja").write_text(TINY_CHAT_TEMPLATE, encoding="utf-8")
    return folder / path.name, hf_model


# --- multimodal fixtures (owner: vision) ---
# Tiny Gemma 3 and Qwen2.5-VL checkpoints built with transformers' own classes: random weights everywhere (the vision
# tower, the projector or merger, every norm and bias), the image processor's config and a word-level tokenizer
# whose vocabulary is the model's, so every id decodes. Token ids of the image markers:
MULTIMODAL_TOKENS = {"gemma3": dict(boi_token_index=300, eoi_token_index=301, image_token_index=302),
                     "qwen2_5_vl": dict(vision_start_token_id=300, vision_end_token_id=301, image_token_id=302,
                                        video_token_id=303)}
MULTIMODAL_NEWLINES = 304  # "\n\n", which Gemma 3's processor puts around each image


def multimodal_hf_model(family: str, seed: int = 0):
    """(fp32 transformers model in eval mode with every weight random, its image processor)."""
    import transformers

    torch.manual_seed(seed)
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=512,
                max_position_embeddings=256, rms_norm_eps=1e-5)
    if family == "gemma3":
        text = dict(base, **{k: v for k, v in FAMILY_VARIANTS["gemma3"][1].items()})
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      image_size=84, patch_size=14, vision_use_head=False)
        config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=9,
                                           attn_implementation="eager", **MULTIMODAL_TOKENS[family])
        model = transformers.Gemma3ForConditionalGeneration(config)
        processor = pil_image_processor("Gemma3")(size={"height": 84, "width": 84})
    else:
        text = dict(base, num_hidden_layers=3, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                 "mrope_section": [4, 2, 2]})
        vision = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1, 3])
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, attn_implementation="eager",
                                               **MULTIMODAL_TOKENS[family])
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
        processor = pil_image_processor("Qwen2VL")(min_pixels=56 * 56, max_pixels=28 * 28 * 16)
    gemma_norms = ("language_model", "mm_soft_emb_norm")  # Gemma's norms scale by 1 + w
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                one = "norm" in name and name.endswith("weight") and not (family == "gemma3" and
                                                                          any(g in name for g in gemma_norms))
                p.copy_(float(one) + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, p[0].numel() ** -0.5)
    model.generation_config.eos_token_id = None  # compare fixed-length continuations
    return model.eval(), processor


def pil_image_processor(family: str):
    """transformers' Pillow image processor class of a family (FamilyImageProcessorPil since transformers 5.2x; the
    plain FamilyImageProcessor, Pillow-based, before it)."""
    import transformers

    return getattr(transformers, f"{family}ImageProcessorPil", None) or getattr(transformers, f"{family}ImageProcessor")


def save_word_tokenizer(out_dir: Path, vocab_size: int, specials: dict[int, str]) -> None:
    """A word-level tokenizer.json of exactly vocab_size ids: "w<id>" words and the given special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    for i, text in specials.items():
        del vocab[f"w{i}"]
        vocab[text] = i
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out_dir / "tokenizer.json"))


@pytest.fixture(scope="session", params=["gemma3", "qwen2_5_vl"])
def multimodal_checkpoint(request, tmp_path_factory):
    """(family, HF dir, fp32 HF model, its image processor, converted fp32 Redline file with its vision file)."""
    from redline.scripts.convert_hf_checkpoint import convert_hf_checkpoint

    family = request.param
    hf_dir = tmp_path_factory.mktemp(f"hf-{family}")
    model, processor = multimodal_hf_model(family)
    model.save_pretrained(hf_dir)
    processor.save_pretrained(hf_dir)
    specials = {0: "<pad>", 1: "<eos>", 2: "<bos>", 300: "<start>", 301: "<end>", 302: "<image>", 303: "<video>"}
    save_word_tokenizer(hf_dir, 512, {**specials, MULTIMODAL_NEWLINES: "\n\n"})
    (hf_dir / "chat_template.jinja").write_text(MULTIMODAL_CHAT_TEMPLATE.replace(
        "IMAGE", "<start>" if family == "gemma3" else "<start> <image> <end>"), encoding="utf-8")
    return family, hf_dir, model, processor, convert_hf_checkpoint(hf_dir, dtype="float32")


# Each image part rendered as the family's placeholder, as Gemma 3's and Qwen2.5-VL's own templates do.
MULTIMODAL_CHAT_TEMPLATE = (
    "{% for m in messages %}w5 {% if m.content is string %}{{ m.content }} {% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}IMAGE {% else %}{{ p.text }} {% endif %}{% endfor %}{% endif %}w6 {% endfor %}"
    "{% if add_generation_prompt %}w7{% endif %}")

# --- what this machine lacks for some tests (owner: setup) ---
def missing_prerequisites() -> list[str]:
    """One line per test prerequisite this machine lacks: what skips, and how to install it."""
    import importlib.util
    import shutil

    missing = []
    if importlib.util.find_spec("triton") is None:
        missing.append("Triton (the kernel tests, in its interpreter): pip install --no-deps triton==3.6.0")
    if not (shutil.which("chromium") or shutil.which("chromium-browser")) or not shutil.which("chromedriver"):
        missing.append("Chromium and its WebDriver (the chat page test): apt-get install chromium chromium-driver")
    if not (shutil.which("c++") or shutil.which("g++")):
        missing.append("a C++ compiler (the CPU int8/int4 kernel): apt-get install g++")
    if not shutil.which("aarch64-linux-gnu-g++") or not shutil.which("qemu-aarch64"):
        missing.append("an AArch64 cross-compiler and qemu (the CPU kernel's NEON path, emulated): apt-get install "
                       "g++-aarch64-linux-gnu qemu-user")
    return missing


def pytest_terminal_summary(terminalreporter):
    """Printed at the end even under -q (`make test`), after the skip reasons."""
    missing = missing_prerequisites()
    if missing:
        terminalreporter.section("missing here, so their tests skipped (CI installs them)")
        for line in missing:
            terminalreporter.line(f"- {line}")

# --- agent API fixtures (owner: tools, reasoning and structured output) ---
# A ChatML-style template that names the tools (briefly: the tiny model's context is short) and renders calls and
# results in the Hermes format (<tool_call> tags),
# and, with enable_thinking=false, an empty think block after the generation prompt (as Qwen3's template does).
TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n"
    "{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' and m['tool_calls'] %}<|assistant|>\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}\n{% elif m['role'] == 'tool' %}<|tool|>\n<tool_response>{{ m['content'] }}</tool_response>\n"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}")


@pytest.fixture(scope="session")
def tools_chat_checkpoint(tmp_path_factory, tiny_llm_checkpoint):
    """tiny_llm_checkpoint's folder with TOOLS_CHAT_TEMPLATE beside it: (checkpoint path, hf_model)."""
    import shutil

    path, hf_model = tiny_llm_checkpoint
    folder = tmp_path_factory.mktemp("tools-chat") / "tools-chat"
    shutil.copytree(path.parent, folder)
    (folder / "chat_template.jinja").write_text(TOOLS_CHAT_TEMPLATE, encoding="utf-8")
    return folder / path.name, hf_model


@pytest.fixture(scope="session")
def tools_grammar_compiler(sp_tokenizer_dir):
    """A grammar.GrammarCompiler over the SentencePiece fixture tokenizer."""
    from redline.grammar import GrammarCompiler
    from redline.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(sp_tokenizer_dir)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    yield compiler
    compiler.shutdown()


# --- engine fixtures: the tiny checkpoint loaded for the engine's tests (test_engine.py, test_penalties.py) ---
@pytest.fixture(scope="module")
def llm(tiny_llm_checkpoint):
    from redline.generate import LLM

    return LLM.load(tiny_llm_checkpoint[0], device="cpu", max_kv_tokens=2048)


@pytest.fixture(scope="module")
def compiled_llm(tiny_llm_checkpoint):
    from redline.generate import LLM

    return LLM.load(tiny_llm_checkpoint[0], device="cpu", compile=True)


def random_gpu_llm(compile: bool, kernels: bool):
    """A random debug-tiny model on the GPU, its weights drawn wide enough that greedy tokens are stable."""
    from redline.generate import LLM
    from redline.model import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_name("debug-tiny")).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    llm = LLM(model.to("cuda"), None, "cuda", compile=compile, kernels=kernels)
    llm.max_kv_tokens = 4096  # a pool for these prompts, not most of the GPU (other GPU tests may share it)
    return llm


def token_prompts(llm, count: int, length: int) -> list[list[int]]:
    """Distinct prompts of token ids, of different lengths."""
    g = torch.Generator().manual_seed(length)
    vocab = llm.tokenizer.vocab_size
    return [torch.randint(3, vocab, (length + 7 * i,), generator=g).tolist() for i in range(count)]
