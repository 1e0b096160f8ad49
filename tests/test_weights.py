"""Checkpoint loading, held to transformers: the state dict and config it builds from the same
files (the real SmolLM2 GGUF, tiny GGUF files written with gguf's GGUFWriter, tiny
safetensors folders written with save_pretrained), plus every refused input."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from nanoserve.errors import ModelError
from nanoserve.model.config import ModelConfig
from nanoserve.testing import write_tiny_gguf
from nanoserve.weights.gguf_file import gguf_tokenizer_metadata
from nanoserve.weights.weights import expected_shapes, load_checkpoint, validate_checkpoint

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)


def assert_config_matches(ours: ModelConfig, theirs) -> None:
    """Our ModelConfig against a transformers LlamaConfig, field by field."""
    assert ours.vocab_size == theirs.vocab_size
    assert ours.hidden_size == theirs.hidden_size
    assert ours.intermediate_size == theirs.intermediate_size
    assert ours.num_hidden_layers == theirs.num_hidden_layers
    assert ours.num_attention_heads == theirs.num_attention_heads
    assert ours.num_key_value_heads == theirs.num_key_value_heads
    assert ours.head_dim == theirs.head_dim
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.bos_token_id == theirs.bos_token_id
    eos = theirs.eos_token_id
    assert ours.eos_token_ids == (tuple(eos) if isinstance(eos, list) else (eos,))
    rope = theirs.rope_parameters
    if rope.get("rope_type", "default") == "default":
        assert ours.rope_scaling is None
    else:
        assert rope["rope_type"] == "llama3"
        s = ours.rope_scaling
        assert s is not None
        assert s.factor == rope["factor"]
        assert s.low_freq_factor == rope["low_freq_factor"]
        assert s.high_freq_factor == rope["high_freq_factor"]
        assert s.original_max_position_embeddings == rope["original_max_position_embeddings"]


def assert_same_tensors(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(theirs)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype, name
        assert torch.equal(ours[name], t), name


# --- the real default model (GGUF, Q8_0 / Q4_1 / F32) against transformers --------------------


@pytest.fixture(scope="module")
def smollm2_checkpoint(smollm2_gguf_path):
    return load_checkpoint(smollm2_gguf_path)


def test_smollm2_gguf_weights_equal_transformers(smollm2_checkpoint, hf_smollm2):
    config, ours = smollm2_checkpoint
    theirs = hf_smollm2.state_dict()
    # transformers ties lm_head to the embedding; a tied checkpoint gives no lm_head.weight
    assert hf_smollm2.config.tie_word_embeddings
    assert theirs["lm_head.weight"].data_ptr() == theirs["model.embed_tokens.weight"].data_ptr()
    del theirs["lm_head.weight"]
    assert_same_tensors(ours, theirs)
    assert {name: tuple(t.shape) for name, t in ours.items()} == expected_shapes(config)


def test_smollm2_gguf_config_matches_transformers(smollm2_checkpoint, hf_smollm2):
    config, _ = smollm2_checkpoint
    assert_config_matches(config, hf_smollm2.config)
    assert config.architecture == "LlamaForCausalLM"


def test_smollm2_gguf_tokenizer_metadata_matches_transformers(smollm2_gguf_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name, local_files_only=True
    )
    meta = gguf_tokenizer_metadata(smollm2_gguf_path)
    assert meta["model"] == "gpt2"
    vocab = tok.get_vocab()
    assert len(meta["tokens"]) == len(vocab) == len(meta["token_type"])
    assert all(vocab[token] == i for i, token in enumerate(meta["tokens"]))
    hf_merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    assert meta["merges"] == [" ".join(m) if isinstance(m, list) else m for m in hf_merges]
    assert meta["bos_token_id"] == tok.bos_token_id
    assert meta["eos_token_id"] == tok.eos_token_id
    assert meta["unknown_token_id"] == tok.unk_token_id
    assert meta["padding_token_id"] == tok.pad_token_id
    assert meta["chat_template"] == tok.chat_template
    assert meta["add_bos_token"] is False


# --- tiny GGUF files written here -----------------------------------------------------------

_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row permutation (convert_hf_to_gguf.py `permute`)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_tiny_gguf_mixed_types_untied_equal_transformers(tmp_path):
    """An untied tiny model written as GGUF with Q8_0, F16, BF16 and F32 tensors: our loader
    and transformers' agree on every tensor; F32 tensors (q/k included, after the permutation
    round trip) equal the original weights exactly; stored dtypes are kept."""
    torch.manual_seed(0)
    cfg = LlamaConfig(**TINY, tie_word_embeddings=False, rope_theta=50000.0)
    original = LlamaForCausalLM(cfg).state_dict()
    path = tmp_path / "tiny.gguf"
    tensors = []  # (GGUF name, array, raw type)
    stored = {}  # HF name -> the GGUF type it was written as
    for name, t in original.items():
        if name in _GGUF_GLOBAL:
            gname = _GGUF_GLOBAL[name]
        else:
            _, _, layer, *rest = name.split(".")
            gname = f"blk.{layer}.{_GGUF_LAYER['.'.join(rest[:-1])]}.weight"
        w = t.numpy()
        if gname.endswith("attn_q.weight"):
            w = _llama_cpp_permute(w, cfg.num_attention_heads)
        elif gname.endswith("attn_k.weight"):
            w = _llama_cpp_permute(w, cfg.num_key_value_heads)
        if gname == "token_embd.weight":
            qtype = GGMLQuantizationType.Q8_0
            tensors.append((gname, gguf.quants.quantize(w, qtype), qtype))
        elif gname.endswith("attn_v.weight"):
            qtype = GGMLQuantizationType.BF16
            tensors.append((gname, gguf.quants.quantize(w, qtype), qtype))
        elif "ffn_" in gname and w.ndim == 2:
            qtype = GGMLQuantizationType.F16
            tensors.append((gname, w.astype(np.float16), None))
        else:
            qtype = GGMLQuantizationType.F32
            tensors.append((gname, w, None))
        stored[name] = qtype
    write_tiny_gguf(path, "llama", tensors, cfg, rope_dimensions=True)

    config, ours = load_checkpoint(path)
    hf = LlamaForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, local_files_only=True
    )
    assert_config_matches(config, hf.config)
    theirs = hf.state_dict()
    assert sorted(ours) == sorted(theirs)
    want_dtype = {
        GGMLQuantizationType.Q8_0: torch.float32,
        GGMLQuantizationType.BF16: torch.bfloat16,
        GGMLQuantizationType.F16: torch.float16,
        GGMLQuantizationType.F32: torch.float32,
    }
    for name, t in theirs.items():
        assert ours[name].dtype == want_dtype[stored[name]], name
        assert torch.equal(ours[name].float(), t), name
        if stored[name] == GGMLQuantizationType.F32:
            assert torch.equal(ours[name], original[name]), name


def test_gguf_unsupported_quant_type_is_refused(tmp_path):
    cfg = LlamaConfig(**TINY)
    path = tmp_path / "q8_1.gguf"
    qtype = GGMLQuantizationType.Q8_1  # a llama.cpp block type gguf cannot dequantize
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((cfg.vocab_size, cfg.hidden_size // block_size * type_size), dtype=np.uint8)
    write_tiny_gguf(path, "llama", [("token_embd.weight", raw, qtype)], cfg, rope_dimensions=True)
    with pytest.raises(ModelError, match=r"token_embd\.weight uses quantization type Q8_1"):
        load_checkpoint(path)


def test_gguf_non_llama_architecture_is_refused(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_tiny_gguf(path, "gpt2", [("token_embd.weight", np.zeros((8, 4), dtype=np.float32), None)],
                    metadata=lambda writer: writer.add_block_count(2))
    with pytest.raises(ModelError, match=r"GGUF architecture 'gpt2' is not supported; "
                                         r"nanoserve runs 'llama', 'qwen2', 'qwen3'"):
        load_checkpoint(path)


def test_gguf_garbage_file_is_refused(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"this is not a gguf file" * 10)
    with pytest.raises(ModelError, match=r"garbage\.gguf is not a readable GGUF file"):
        load_checkpoint(path)


# --- tiny Hugging Face safetensors folders -------------------------------------------------


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A tiny untied random LlamaForCausalLM saved once as one file and once in shards."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        **TINY,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
    )
    model = LlamaForCausalLM(cfg).eval()
    root = tmp_path_factory.mktemp("tiny_hf")
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="40KB")
    return model, root


def test_safetensors_single_file_equals_state_dict(tiny_hf):
    model, root = tiny_hf
    assert not (root / "single" / "model.safetensors.index.json").exists()
    config, tensors = load_checkpoint(root / "single")
    assert_same_tensors(tensors, model.state_dict())
    assert_config_matches(config, model.config)


def test_safetensors_sharded_equals_state_dict(tiny_hf):
    model, root = tiny_hf
    shards = sorted((root / "sharded").glob("*.safetensors"))
    assert len(shards) > 2
    assert (root / "sharded" / "model.safetensors.index.json").is_file()
    config, tensors = load_checkpoint(root / "sharded")
    assert_same_tensors(tensors, model.state_dict())
    assert_config_matches(config, model.config)


def test_bf16_checkpoint_stays_bf16(tmp_path):
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True)).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    config, tensors = load_checkpoint(tmp_path)
    theirs = model.state_dict()
    del theirs["lm_head.weight"]  # tied
    assert config.tie_word_embeddings
    assert_same_tensors(tensors, theirs)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_tied_checkpoint_with_lm_head_and_extras_loads(tmp_path):
    """A tied checkpoint that still stores lm_head.weight, plus a rotary inv_freq buffer:
    both are ignored."""
    torch.manual_seed(2)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True))
    model.config.save_pretrained(tmp_path)
    sd = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(sd, tmp_path / "model.safetensors")
    _, tensors = load_checkpoint(tmp_path)
    assert "lm_head.weight" not in tensors
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in tensors
    del sd["lm_head.weight"], sd["model.layers.0.self_attn.rotary_emb.inv_freq"]
    assert_same_tensors(tensors, sd)


LLAMA3_ROPE = {
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "llama3"])
def test_config_4x_and_5x_spellings_give_same_config(tiny_hf, tmp_path, scaled):
    """config.json in the transformers 4.x spelling (rope_theta + rope_scaling) and in the 5.x
    spelling (rope_parameters) load to the same ModelConfig, the one transformers reads."""
    _, root = tiny_hf
    base = json.loads((root / "single" / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        base.pop(key, None)
    v4 = {
        **base,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", **LLAMA3_ROPE} if scaled else None,
    }
    v5 = {
        **base,
        "rope_parameters": {
            "rope_type": "llama3" if scaled else "default",
            "rope_theta": 500000.0,
            **(LLAMA3_ROPE if scaled else {}),
        },
    }
    configs = []
    for spelling, d in (("v4", v4), ("v5", v5)):
        folder = tmp_path / spelling
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(d))
        shutil.copy(root / "single" / "model.safetensors", folder)
        config, _ = load_checkpoint(folder)
        assert_config_matches(config, LlamaConfig.from_pretrained(folder))
        configs.append(config)
    assert configs[0] == configs[1]
    assert (configs[0].rope_scaling is not None) == scaled


@pytest.fixture(params=["load", "validate"])
def check(request):
    """Each refusal is found both by a full load and by the header-only validation the
    batch job's driver runs before any worker starts."""
    return load_checkpoint if request.param == "load" else validate_checkpoint


# --- refused Hugging Face folders ------------------------------------------------------------


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite_single(folder, change):
    """Rewrite folder/model.safetensors with `change(state_dict)` applied."""
    from safetensors.torch import load_file

    sd = load_file(folder / "model.safetensors")
    change(sd)
    save_file(sd, folder / "model.safetensors")


def test_truncated_safetensors_is_refused(check, tiny_hf, tmp_path):
    folder = _copy(tiny_hf[1] / "single", tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match=r"model\.safetensors is not a readable safetensors file"):
        check(folder)


def test_missing_tensor_is_refused(check, tiny_hf, tmp_path):
    folder = _copy(tiny_hf[1] / "single", tmp_path / "m")
    _rewrite_single(folder, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ModelError,
        match=r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' is missing from .*model\.safetensors",
    ):
        check(folder)


def test_missing_lm_head_of_untied_model_is_refused(check, tiny_hf, tmp_path):
    folder = _copy(tiny_hf[1] / "single", tmp_path / "m")
    _rewrite_single(folder, lambda sd: sd.pop("lm_head.weight"))
    with pytest.raises(ModelError, match=r"tensor 'lm_head\.weight' is missing"):
        check(folder)


def test_misshapen_tensor_is_refused(check, tiny_hf, tmp_path):
    folder = _copy(tiny_hf[1] / "single", tmp_path / "m")
    _rewrite_single(folder, lambda sd: sd.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(
        ModelError, match=r"tensor 'model\.norm\.weight' in .* has shape \[65\], expected \[64\]"
    ):
        check(folder)


def test_missing_shard_is_refused(check, tiny_hf, tmp_path):
    folder = _copy(tiny_hf[1] / "sharded", tmp_path / "m")
    shard = sorted(folder.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelError, match=rf"shard {shard.name} listed in .*index\.json is missing"):
        check(folder)


def test_missing_config_is_refused(check, tiny_hf, tmp_path):
    folder = _copy(tiny_hf[1] / "single", tmp_path / "m")
    (folder / "config.json").unlink()
    with pytest.raises(ModelError, match=r"no config\.json in .*m"):
        check(folder)


def test_pickle_only_folder_is_refused(check, tiny_hf, tmp_path):
    folder = _copy(tiny_hf[1] / "single", tmp_path / "m")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ModelError, match=r"only PyTorch pickle weights.*safetensors only"):
        check(folder)


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}, "GemmaForCausalLM"),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "gpt2"}, "gpt2"),
        ({"architectures": ["Qwen2ForCausalLM"], "model_type": "llama"}, "Qwen2ForCausalLM"),
    ],
)
def test_unknown_architecture_is_refused(check, tiny_hf, tmp_path, change, expected):
    folder = _copy(tiny_hf[1] / "single", tmp_path / "m")
    d = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**d, **change}))
    supported = ("LlamaForCausalLM (llama), MistralForCausalLM (mistral), "
                 "Qwen2ForCausalLM (qwen2), Qwen3ForCausalLM (qwen3), "
                 "Qwen3MoeForCausalLM (qwen3_moe), MixtralForCausalLM (mixtral), "
                 "Qwen2MoeForCausalLM (qwen2_moe), "
                 "Qwen2_5_VLForConditionalGeneration (qwen2_5_vl)")
    with pytest.raises(ModelError, match=rf"unsupported architecture .*{expected}") as e:
        check(folder)
    assert f"nanoserve runs {supported}; encoders" in str(e.value)
    assert "BertForSequenceClassification (bert)" in str(e.value)  # the encoders listed too


def test_no_such_checkpoint_is_refused(check, tmp_path):
    with pytest.raises(ModelError, match=r"no such checkpoint: .*nothing-here"):
        check(tmp_path / "nothing-here")


def test_truncated_gguf_is_refused_by_validation(smollm2_gguf_path, tmp_path):
    data = smollm2_gguf_path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ModelError, match=r"cut\.gguf is not a readable GGUF file"):
        validate_checkpoint(tmp_path / "cut.gguf")
    assert validate_checkpoint(smollm2_gguf_path).num_hidden_layers == 30
