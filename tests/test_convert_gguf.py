"""scripts/convert_gguf.py and scripts/gguf_tokenizer.py, on GGUF files written with gguf's own writer."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

from redline.checkpoint import read_checkpoint_info
from redline.quantize import load_model  # noqa: E402
from redline.model import RopeScaling  # noqa: E402
from redline.scripts.convert_gguf import convert_gguf, llama3_factors, main, read_gguf, tensor_to_float  # noqa: E402
from redline.tokenizer import load_tokenizer  # noqa: E402

# Types the writer can quantize itself, and the K-quants, whose blocks the tests fill with random codes.
WRITER_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1)
K_TYPES = (QT.Q4_K, QT.Q6_K)
HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's two rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stored(array: np.ndarray, qtype: QT) -> np.ndarray:
    """`array` as the writer stores it in `qtype` (norms and other 1-D tensors stay F32, as llama.cpp keeps them)."""
    if array.ndim == 1 or qtype == QT.F32:
        return array.astype(np.float32)
    if qtype == QT.F16:
        return array.astype(np.float16)
    return gguf.quants.quantize(array.astype(np.float32), qtype)


def add_tensor(writer, name: str, array: np.ndarray, qtype: QT) -> None:
    data = stored(array, qtype)
    raw = None if data.dtype in (np.float32, np.float16) else qtype
    writer.add_tensor(name, data, raw_dtype=raw)


def write_gguf(path, hf_model=None, qtype=QT.F32, arch="llama", tokenizer=None, rope_freqs=None, tensors=None):
    """A GGUF file of `hf_model` (a transformers LlamaForCausalLM) the way llama.cpp lays it out."""
    writer = gguf.GGUFWriter(str(path), arch)
    if hf_model is not None:
        c = hf_model.config
        writer.add_block_count(c.num_hidden_layers)
        writer.add_context_length(c.max_position_embeddings)
        writer.add_embedding_length(c.hidden_size)
        writer.add_feed_forward_length(c.intermediate_size)
        writer.add_head_count(c.num_attention_heads)
        writer.add_head_count_kv(c.num_key_value_heads)
        writer.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
        writer.add_layer_norm_rms_eps(c.rms_norm_eps)
        writer.add_vocab_size(c.vocab_size)
        writer.add_rope_dimension_count(c.head_dim)
        if rope_freqs is not None:
            writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
        for name, p in hf_model.state_dict().items():
            gguf_name = gguf_tensor_name(name)
            if gguf_name == "output.weight" and c.tie_word_embeddings:
                continue  # llama.cpp stores a tied head once, as the embedding
            w = p.float().numpy()
            if gguf_name.endswith("attn_q.weight"):
                w = llama_cpp_permute(w, c.num_attention_heads)
            elif gguf_name.endswith("attn_k.weight"):
                w = llama_cpp_permute(w, c.num_key_value_heads)
            add_tensor(writer, gguf_name, w, qtype if gguf_name != "token_embd.weight" else QT.F32)
    for name, (data, raw) in (tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=raw)
    if tokenizer is not None:
        tokenizer(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_tensor_name(hf_name: str) -> str | None:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")  # model.layers.N.<module>.<sub>.weight
    return f"blk.{parts[2]}.{HF_TO_GGUF['.'.join(parts[3:-1])]}.weight"


def gpt2_tokenizer_from(hf_tokenizer_dir, add_bos=False, template=CHATML):
    """Writes the fixture's byte-level BPE into the GGUF, with <|im_start|>/<|im_end|> as control tokens."""
    spec = json.loads((hf_tokenizer_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])] + ["<|im_start|>", "<|im_end|>"]
    types = [3 if t in ("<s>", "</s>", "<|im_start|>", "<|im_end|>") else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]

    def add(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
        writer.add_eot_token_id(len(tokens) - 1)
        writer.add_add_bos_token(add_bos)
        writer.add_chat_template(template)
    return add


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from conftest import save_tiny_hf_checkpoint

    return save_tiny_hf_checkpoint(tmp_path_factory.mktemp("hf-gguf"), "gqa")[1]


def redline_logits(path, ids):
    model = load_model(read_checkpoint_info(path), "cpu", torch.float32)
    with torch.no_grad():
        model.setup_caches(1, ids.shape[1])
        return model(ids, torch.arange(ids.shape[1]))


@pytest.mark.parametrize("qtype", WRITER_TYPES + K_TYPES, ids=lambda t: t.name)
def test_each_tensor_type_dequantizes_like_gguf(tmp_path, qtype):
    rng = np.random.default_rng(0)
    if qtype in K_TYPES:  # random codes, with the block's fp16 scale fields set to sane values
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, size=(4, 2 * block_bytes), dtype=np.uint8)
        blocks = data.reshape(4, 2, block_bytes)
        scale_at = (0, 2) if qtype == QT.Q4_K else (block_bytes - 2,)  # Q4_K: d, dmin first; Q6_K: d last
        for at in scale_at:
            blocks[..., at:at + 2] = np.full((4, 2, 1), 0.01, np.float16).view(np.uint8)
        tensors = {"t": (data, qtype)}
    else:
        values = rng.standard_normal((4, 256)).astype(np.float32)
        data = stored(values, qtype)
        tensors = {"t": (data, None if data.dtype in (np.float32, np.float16) else qtype)}
    path = write_gguf(tmp_path / "t.gguf", tensors=tensors)
    (t,) = read_gguf(path).tensors
    expected = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(4, -1)
    ours = tensor_to_float(t)
    assert ours.shape == (4, 2 * gguf.GGML_QUANT_SIZES[qtype][0] if qtype in K_TYPES else 256)
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("qtype", (QT.F32, QT.Q8_0, QT.Q4_1), ids=lambda t: t.name)
def test_converted_model_matches_hf_on_dequantized_weights(tmp_path, tiny_hf, qtype):
    """The q/k rows come back in HF's rotate-half order, qkv and gate/up are fused right, norms and the head map."""
    from transformers import LlamaForCausalLM

    path = write_gguf(tmp_path / "m.gguf", tiny_hf, qtype)
    out = convert_gguf(path, tmp_path / "out" / "model.safetensors", "float32")
    reference = LlamaForCausalLM(tiny_hf.config).eval()
    with torch.no_grad():  # HF's model holding the same rounded weights the GGUF stores
        for name, p in tiny_hf.state_dict().items():
            w = p.float().numpy()
            if w.ndim == 2 and gguf_tensor_name(name) != "token_embd.weight" and qtype != QT.F32:
                w = gguf.quants.dequantize(stored(w, qtype), qtype).reshape(w.shape)
            reference.state_dict()[name].copy_(torch.from_numpy(w))
    ids = torch.randint(0, tiny_hf.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
    torch.testing.assert_close(redline_logits(out, ids), expected, atol=1e-4, rtol=1e-4)
    info = read_checkpoint_info(out)
    assert info.args.n_kv_heads == 2 and info.args.rope_base == tiny_hf.config.rope_parameters["rope_theta"]
    assert not info.args.tie_word_embeddings


def test_tied_embeddings_when_there_is_no_output_weight(tmp_path):
    from conftest import save_tiny_hf_checkpoint

    hf = save_tiny_hf_checkpoint(tmp_path / "hf", "tied")[1]
    out = convert_gguf(write_gguf(tmp_path / "m.gguf", hf), tmp_path / "o" / "model.safetensors", "float32")
    assert read_checkpoint_info(out).args.tie_word_embeddings
    ids = torch.arange(20)[None]
    with torch.no_grad():
        torch.testing.assert_close(redline_logits(out, ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_llama3_rope_factors_become_llama3_scaling(tmp_path, tiny_hf):
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    head_dim, base = tiny_hf.config.head_dim, 500000.0
    tiny_hf.config.rope_parameters["rope_theta"] = base
    try:
        freqs = 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim)
        path = write_gguf(tmp_path / "m.gguf", tiny_hf, rope_freqs=llama3_factors(freqs, scaling))
        out = convert_gguf(path, tmp_path / "o" / "model.safetensors", "float32")
        assert read_checkpoint_info(out).args.rope_scaling == scaling
        bad = write_gguf(tmp_path / "bad.gguf", tiny_hf, rope_freqs=np.linspace(1, 3, head_dim // 2))
        with pytest.raises(ValueError, match="rope"):
            convert_gguf(bad, tmp_path / "b" / "model.safetensors")
    finally:
        tiny_hf.config.rope_parameters["rope_theta"] = 10000.0


def test_gpt2_tokenizer_matches_the_source_and_transformers(tmp_path, tiny_hf, hf_tokenizer_dir):
    from transformers import AutoTokenizer

    from redline.tokenizer import HFTokenizer

    path = write_gguf(tmp_path / "m.gguf", tiny_hf, tokenizer=gpt2_tokenizer_from(hf_tokenizer_dir, add_bos=True))
    out = convert_gguf(path, tmp_path / "o" / "model.safetensors", "float32")
    ours, source = load_tokenizer(out), load_tokenizer(hf_tokenizer_dir)
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    assert isinstance(ours, HFTokenizer)
    assert ours.bos_id == 0 and ours.eos_ids == (1, ours.special_token_id("<|im_end|>"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🚀"}]
    for text in ("Hello world", "", "def f(x):\n    return x  # é", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == theirs(text)["input_ids"]
        if "<|im_" not in text:  # the source vocabulary lacks the two chat tokens
            assert ours.encode(text, add_special_tokens=False) == source.encode(text, add_special_tokens=False)
    assert ours.encode("hi")[0] == 0  # add_bos_token from the GGUF
    expected = theirs(theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"]
    assert ours.apply_chat_template(messages) == expected


def test_sentencepiece_tokenizer_matches_the_source(tmp_path, tiny_hf, sp_tokenizer_dir):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_tokenizer_dir / "tokenizer.model"))
    n = sp.vocab_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]

    def add(writer):
        writer.add_tokenizer_model("llama")
        writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
        writer.add_token_scores([sp.get_score(i) for i in range(n)])
        writer.add_token_types(types)
        writer.add_bos_token_id(sp.bos_id())
        writer.add_eos_token_id(sp.eos_id())
        writer.add_unk_token_id(sp.unk_id())

    out = convert_gguf(write_gguf(tmp_path / "m.gguf", tiny_hf, tokenizer=add), tmp_path / "o" / "model.safetensors")
    assert (out.parent / "tokenizer.model").is_file() and not (out.parent / "tokenizer.json").exists()
    ours = load_tokenizer(out)
    for text in ("Hello, world!", "héllo wörld 日本語 🚀", "  spaced\tout\n", "def f(x):\n    return x\n"):
        assert ours.encode(text) == [sp.bos_id()] + sp.encode(text)
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
    assert ours.apply_chat_template([{"role": "user", "content": "Hi"}])[0] == sp.bos_id()  # the llama2 fallback


def test_generation_config_lists_every_eos(tmp_path, tiny_hf, hf_tokenizer_dir):
    path = write_gguf(tmp_path / "m.gguf", tiny_hf, tokenizer=gpt2_tokenizer_from(hf_tokenizer_dir))
    out = convert_gguf(path, tmp_path / "o" / "model.safetensors")
    config = json.loads((out.parent / "generation_config.json").read_text())
    assert config["eos_token_id"] == [1, load_tokenizer(out).special_token_id("<|im_end|>")]
    assert json.loads((out.parent / "tokenizer_config.json").read_text())["chat_template"] == CHATML


def test_unsupported_architecture_is_a_one_line_error(tmp_path, tiny_hf, capsys):
    path = write_gguf(tmp_path / "m.gguf", tiny_hf, arch="gpt2")
    assert main(["--gguf", str(path), "--out", str(tmp_path / "o" / "model.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'gpt2'" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_unknown_tensor_type_is_a_one_line_error(tmp_path, tiny_hf, capsys):
    q5 = gguf.quants.quantize(np.ones((4, 64), np.float32), QT.Q5_0)
    path = write_gguf(tmp_path / "m.gguf", tiny_hf, tensors={"blk.0.extra.weight": (q5, QT.Q5_0)})
    with pytest.raises(ValueError, match="blk.0.extra.weight"):
        convert_gguf(path, tmp_path / "o" / "model.safetensors")
    (t,) = [t for t in read_gguf(path).tensors if t.name == "blk.0.extra.weight"]
    with pytest.raises(ValueError, match="Q5_0"):
        tensor_to_float(t)
    assert main(["--gguf", str(path), "--out", str(tmp_path / "o" / "model.safetensors")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.0])
def test_truncated_or_empty_file_is_a_one_line_error(tmp_path, tiny_hf, capsys, keep):
    data = write_gguf(tmp_path / "m.gguf", tiny_hf, QT.Q8_0).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    assert main(["--gguf", str(cut), "--out", str(tmp_path / "o" / "model.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(cut) in err and err.count("\n") == 1


def test_bad_arguments(tmp_path, capsys):
    assert main(["--gguf", str(tmp_path / "missing.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["--gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "m.bin")]) == 2
    assert ".safetensors" in capsys.readouterr().err


@pytest.mark.parametrize("qtype", (QT.Q4_0, QT.Q4_1), ids=lambda t: t.name)
def test_q4_files_load_natively_as_int4_g32_with_no_loss(tmp_path, tiny_hf, qtype):
    """Every block projection keeps its codes: the int4 checkpoint dequantizes to exactly gguf's own values,
    an untied output head of the same type is int4 too, and --dequantize still gives float."""
    from redline.checkpoint import load_tensors
    from redline.quantize import dequantize_int4

    path = write_gguf(tmp_path / "m.gguf", tiny_hf, qtype)
    native = convert_gguf(path, tmp_path / "int4" / "model.safetensors", "float32")
    info = read_checkpoint_info(native)
    assert info.scheme == "int4" and info.quantization["group_size"] == 32
    assert "quantized_from_float" not in info.quantization
    tensors = load_tensors(info)
    floats = load_tensors(read_checkpoint_info(convert_gguf(path, tmp_path / "f" / "model.safetensors", "float32",
                                                           dequantize=True)))
    int4_names = [n for n in tensors if n.endswith(".scales")]
    assert len(int4_names) == 4 * tiny_hf.config.num_hidden_layers + 1  # the untied head too
    for name in int4_names:
        weight = name.removesuffix(".scales") + ".weight"
        assert tensors[name].dtype == torch.float16 and tensors[weight].dtype == torch.uint8
        assert torch.equal(dequantize_int4(tensors[weight], tensors[name]), floats[weight]), weight
    # and against gguf's reference dequantization directly, on a tensor that needs no row reordering
    w = tiny_hf.state_dict()["model.layers.0.mlp.down_proj.weight"].float().numpy()
    expected = gguf.quants.dequantize(stored(w, qtype), qtype).reshape(w.shape)
    got = dequantize_int4(tensors["layers.0.feed_forward.w2.weight"], tensors["layers.0.feed_forward.w2.scales"])
    assert np.array_equal(got.numpy(), expected)
    ids = torch.randint(0, tiny_hf.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(redline_logits(native, ids), redline_logits(tmp_path / "f" / "model.safetensors", ids),
                               atol=1e-5, rtol=1e-5)
