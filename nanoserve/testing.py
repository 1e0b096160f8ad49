"""Small real checkpoints for tests and benchmarks (needs the `test` extra: transformers).

`save_tiny_llama` writes a tiny random `LlamaForCausalLM` through transformers' own
`save_pretrained` (so the engine loads it through the real checkpoint path), with a real
tokenizer: batch jobs over it run in seconds on a CPU and still tokenize text as the model
they stand in for would. `write_tiny_gguf` writes a tiny GGUF file (a model's metadata
from its transformers config, any more keys, and the tensors as given, quantized or not).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanoserve.model.families import Family


def save_tiny_llama(folder: str | Path, tokenizer_source: str | Path) -> Path:
    """A tiny random LlamaForCausalLM (hidden 64, 2 layers, GQA 4:2, tied embeddings, seed 0)
    saved in `folder`, with the tokenizer of `tokenizer_source` (a model path) as its
    tokenizer.json; returns `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nanoserve.weights.tokenizer import Tokenizer

    folder = Path(folder)
    tok = Tokenizer.from_path(tokenizer_source)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.backend.save(str(folder / "tokenizer.json"))
    return folder


# The tiny test checkpoints' shape, every family's (a family's own options, its record's
# `tiny` in nanoserve/model/families.py, go on top): hidden 64, 2 layers, GQA 4:2, untied.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2)


def write_tiny_gguf(path: str | Path, arch: str, tensors: Iterable[tuple[str, Any, Any]],
                    config: Any = None, *, rope_dimensions: bool = False,
                    head_lengths: bool = False,
                    metadata: Callable[[Any], None] | None = None) -> Path:
    """A GGUF file of architecture `arch` at `path`, written with gguf's GGUFWriter: with
    `config` (a transformers config), the model's hyperparameters under llama.cpp's keys
    (`rope_dimensions`: also the rotary dimension count; `head_lengths`: also the key and
    value lengths, head_dim); then whatever `metadata(writer)` adds (a tokenizer, ...);
    then `tensors`, each (GGUF name, numpy array, raw GGML type or None: the array's own)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    if config is not None:
        writer.add_block_count(config.num_hidden_layers)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        if head_lengths:
            writer.add_key_length(config.head_dim)
            writer.add_value_length(config.head_dim)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        if rope_dimensions:
            writer.add_rope_dimension_count(config.head_dim)
        writer.add_vocab_size(config.vocab_size)
        writer.add_bos_token_id(config.bos_token_id)
        writer.add_eos_token_id(config.eos_token_id)
    if metadata is not None:
        metadata(writer)
    for name, array, raw_dtype in tensors:
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def family_record(family: str | Family) -> Family:
    """A family's record from its `model_type` ('qwen3', 'mixtral', ...) or itself."""
    from nanoserve.model.families import FAMILIES, by_model_type

    if not isinstance(family, str):
        return family
    record = by_model_type(family)
    if record is None:
        raise ValueError(f"no family {family!r}; choose {', '.join(f.model_type for f in FAMILIES)}")
    return record


def tiny_hf_config(family: str | Family, vocab_size: int, *, sliding_window: int | None = None,
                   **options: Any) -> Any:
    """transformers' config of `family`'s tiny test checkpoint: `TINY_SHAPE`, the family's
    `tiny` options, `sliding_window` as its rule places it (Mistral's, Mixtral's and
    Qwen3-MoE's on every layer; Qwen2/3's and Qwen2.5-VL's on layer 1 only, Qwen2-MoE's on
    layer 0), then `options` (a vision family's `text_config` / `vision_config` merged)."""
    from transformers import AutoConfig

    family = family_record(family)
    tiny = dict(family.tiny)
    lm = {"vocab_size": vocab_size, **TINY_SHAPE, **_window_options(family, sliding_window)}
    if not family.vision:
        return AutoConfig.for_model(family.model_type, **{**lm, **tiny, **options})
    text = {**lm, **tiny.pop("text_config", {}), **options.pop("text_config", {})}
    vision = {**tiny.pop("vision_config", {}), **options.pop("vision_config", {})}
    return AutoConfig.for_model(family.model_type, text_config=text, vision_config=vision,
                                **{"tie_word_embeddings": False, **tiny, **options})


def _window_options(family: Family, window: int | None) -> dict[str, Any]:
    if family.window == "none":
        if window is not None:
            raise ValueError(f"{family.name} has no sliding window")
        return {}
    options: dict[str, Any] = {"sliding_window": window}
    if family.window != "every_layer":
        options["use_sliding_window"] = window is not None
    if family.window in ("from_max_window_layers", "even_below_max_window_layers"):
        options["max_window_layers"] = 1
    return options


def tiny_hf_model(family: str | Family, vocab_size: int, *, seed: int = 0,
                  sliding_window: int | None = None, classifier: bool = False,
                  **options: Any) -> Any:
    """A tiny random model of `family` through transformers' own class (`tiny_hf_config`;
    seed `seed`), in eval mode, with random norm weights and biases (so a missing or
    misplaced one shows) and routers that spread the tokens over the experts. `classifier`:
    the family's `*ForSequenceClassification` instead (`options` then carry `num_labels`,
    `id2label`, `problem_type`, `pad_token_id`), its `score` head at 0.5 / sqrt(hidden) so
    the classes' logits differ by more than rounding."""
    import torch
    import transformers

    family = family_record(family)
    torch.manual_seed(seed)
    cfg = tiny_hf_config(family, vocab_size, sliding_window=sliding_window, **options)
    if classifier and family.classifier is None:
        raise ValueError(f"{family.name} has no sequence-classification model")
    model = getattr(transformers, family.classifier if classifier else family.architecture)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # a router that spreads the tokens
                p.copy_(0.5 * torch.randn_like(p))
            elif name == "score.weight":
                p.copy_(0.5 * torch.randn_like(p) / p.shape[1] ** 0.5)
    return model.eval()


def save_tiny_family(folder: str | Path, family: str, tokenizer_source: str | Path, *,
                     sliding_window: int | None = None, chat_template: str | None = None,
                     special_tokens: dict[str, str] | None = None,
                     eos_tokens: tuple[str, ...] = (), seed: int = 0,
                     classifier: bool = False, **head: Any) -> Path:
    """A tiny random checkpoint of `family` (a `model_type` of nanoserve/model/families.py without
    a vision tower: 'qwen2', 'qwen3', 'mistral', 'qwen3_moe', 'mixtral', 'qwen2_moe', 'llama';
    `tiny_hf_model`, seed `seed`) saved by transformers, with the tokenizer of `tokenizer_source`.
    `sliding_window`: placed by the family's rule (`tiny_hf_config`). `chat_template` and
    `special_tokens` ({'bos_token': ..., 'eos_token': ...}) go into tokenizer_config.json,
    `eos_tokens` (token strings) into generation_config.json. `classifier`: its
    `*ForSequenceClassification`, `head` its config keys (`num_labels`, `id2label`,
    `problem_type`, `pad_token_id`)."""

    from nanoserve.weights.tokenizer import Tokenizer

    folder = Path(folder)
    tok = Tokenizer.from_path(tokenizer_source)
    tiny_hf_model(family, tok.vocab_size, sliding_window=sliding_window, seed=seed,
                  classifier=classifier, **head).save_pretrained(folder)
    tok.backend.save(str(folder / "tokenizer.json"))
    tokenizer_config = dict(special_tokens or {})
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    if tokenizer_config:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if eos_tokens:
        ids = [tok.token_to_id(t) for t in eos_tokens]
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return folder


__all__ = ["TINY_SHAPE", "family_record", "save_fp8_checkpoint", "save_tiny_embedding",
           "write_sentence_transformers_files",
           "save_tiny_family", "save_tiny_llama", "tiny_hf_config", "tiny_hf_model"]


def assert_rows_match_engine(llm, prompts: list[str], rows: list[dict], max_tokens: int) -> None:
    """The batch job's oracle check: `rows` (output rows of a job over the text `prompts`,
    row id = position) hold every prompt exactly once, and each row's tokens, text and
    finish reason are what `llm.generate` gives that prompt alone (greedy, `max_tokens`)."""
    from nanoserve.sampling.params import SamplingParams

    assert sorted(r["id"] for r in rows) == list(range(len(prompts)))
    for row in rows:
        ids = llm.tokenizer.encode(prompts[row["id"]])
        (want,) = llm.generate([ids], [SamplingParams(max_tokens=max_tokens)])
        assert row["error"] is None, row["error"]
        assert row["generated_token_ids"] == want.token_ids, row["id"]
        assert row["generated_text"] == want.text, row["id"]
        assert row["finish_reason"] == want.finish_reason, row["id"]


def save_tiny_byte_llama(folder: str | Path, seed: int = 0) -> Path:
    """A tiny random LlamaForCausalLM (saved by transformers) with a byte-level tokenizer of
    its own: ids 0..255 are the 256 bytes, 256 `<s>`, 257 `</s>` (EOS). Every string is
    some sequence of tokens, so grammars (structured outputs) work on it, with no files
    from elsewhere: the GPU tests' model for output controls."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                      bos_token_id=256, eos_token_id=257)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return save_byte_tokenizer(folder)


def save_byte_tokenizer(folder: str | Path) -> Path:
    """`save_tiny_byte_llama`'s byte-level tokenizer alone (tokenizer.json and
    tokenizer_config.json in `folder`): ids 0..255 the bytes, 256 `<s>`, 257 `</s>`. Made
    here, from nothing: for random-weight checkpoints of any shape (benchmarks)."""

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_char = sorted(alphabet, key=lambda c: _BYTE_ORDER(c))
    vocab = {c: i for i, c in enumerate(byte_char)}
    vocab.update({"<s>": 256, "</s>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}))
    return folder


def _BYTE_ORDER(char: str) -> int:
    """The byte a byte-level BPE character stands for (GPT-2's bytes-to-unicode map)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    if ord(char) in printable:
        return ord(char)
    others = [b for b in range(256) if b not in printable]
    return others[ord(char) - 256]


def save_tiny_embedding(folder: str | Path, tokenizer_source: str | Path, *,
                        family: str = "qwen3", pooling: str | None = None,
                        normalize: bool = True, max_seq_length: int | None = None,
                        closing_token: str | None = None) -> Path:
    """A tiny random headless checkpoint (transformers' `Qwen3Model`, `LlamaModel` or
    `MistralModel`: no LM head, tensors named without `model.`; hidden 64, 2 layers, GQA 4:2,
    seed 0, random norm weights) with the tokenizer of `tokenizer_source`. With `pooling`
    ('lasttoken', 'mean' or 'cls'), sentence-transformers' files too: `modules.json`
    (Transformer, Pooling, and Normalize when `normalize`), `1_Pooling/config.json` and,
    with `max_seq_length`, `sentence_bert_config.json`. With `closing_token` (a special
    token of the vocabulary, e.g. '<|endoftext|>') the tokenizer appends it to every text,
    as Qwen3-Embedding's does (a `TemplateProcessing` post-processor in tokenizer.json).
    `tokenizer_config.json` names the fast tokenizer class and the pad (and closing) token,
    so transformers' `AutoTokenizer` and sentence-transformers load the same files."""

    import torch
    import transformers
    from tokenizers import processors

    from nanoserve.weights.tokenizer import Tokenizer

    record = family_record(family)
    if record.base_model is None:
        raise ValueError(f"{record.name} has no base model without an LM head")
    config_cls = transformers.AutoConfig.for_model(record.model_type).__class__
    model_cls = getattr(transformers, record.base_model)
    folder = Path(folder)
    tok = Tokenizer.from_path(tokenizer_source)
    torch.manual_seed(0)
    cfg = config_cls(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                     bos_token_id=1, eos_token_id=2)
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    backend = tok.backend
    pad = closing_token or "<|endoftext|>"
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": pad,
                        "model_max_length": cfg.max_position_embeddings}
    if closing_token is not None:
        token_id = backend.token_to_id(closing_token)
        if token_id is None:
            raise ValueError(f"{closing_token!r} is not a token of {tokenizer_source}")
        backend.post_processor = processors.TemplateProcessing(
            single=f"$A:0 {closing_token}:0", pair=f"$A:0 $B:1 {closing_token}:1",
            special_tokens=[(closing_token, token_id)])
        tokenizer_config["eos_token"] = closing_token
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if pooling is not None:
        write_sentence_transformers_files(folder, pooling, 64, normalize, max_seq_length)
    return folder


def write_sentence_transformers_files(folder: Path, pooling: str, dim: int,
                                      normalize: bool = True,
                                      max_seq_length: int | None = None) -> None:
    """A sentence-transformers folder's own files beside a saved model, as its `save` writes
    them: modules.json (Transformer, Pooling, and Normalize when `normalize`), the Pooling
    module's config.json (`pooling`: 'lasttoken', 'mean' or 'cls' over `dim` values) and,
    with `max_seq_length`, sentence_bert_config.json."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
             "weightedmean_tokens", "lasttoken")
    want = {"lasttoken": "lasttoken", "mean": "mean_tokens", "cls": "cls_token"}[pooling]
    pool_cfg = {"word_embedding_dimension": dim,
                **{f"pooling_mode_{m}": m == want for m in modes}, "include_prompt": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pool_cfg))
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}))


# --- FP8 checkpoints (nanoserve/model/quantization.py lists the formats) ----------------------------

FP8_FORMATS = ("ct-tensor-static", "ct-tensor-scalar", "ct-channel-dynamic", "ct-block",
               "fbgemm", "fp8-block", "fp8-block-small", "fp8-tensor-static")
_FP8_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)$")  # MoE experts


def save_fp8_checkpoint(src: str | Path, dst: str | Path, fmt: str, twin: str | Path, *,
                        ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """The float checkpoint folder `src` (one model.safetensors) written to `dst` as an FP8
    checkpoint of format `fmt` (one of FP8_FORMATS), with the tensor names, dtypes, shapes
    and config keys of that format, and to `twin` as its dequantized float32 twin (a plain
    checkpoint whose every tensor equals what the FP8 one stands for). The decoder linears
    (and a mixture of experts' expert linears, not its router) are quantized, except the modules named in `ignore` (stored bf16, as the other tensors
    are); `lm_head` is never quantized. Tokenizer files are copied to both. Returns `dst`."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src, dst, twin = Path(src), Path(dst), Path(twin)
    qc, strategy, scale_name, block, static = _fp8_format(fmt, list(ignore))
    tensors = load_file(src / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module = name.rsplit(".", 1)[0]
        if (name.endswith(".weight") and module not in ignore
                and (module.split(".", 3)[-1] in _FP8_LINEARS or _EXPERT.search(module))):
            q, scale = _ref_quantize(t.float(), strategy, block)
            out[name], out[f"{module}.{scale_name}"] = q, scale
            deq[name] = _ref_dequantize(q, scale, strategy, block)
            if static:  # a calibrated activation scale (any positive value is valid)
                out[f"{module}.input_scale"] = torch.tensor(
                    [0.02 + 0.001 * len(out)], dtype=torch.float32).reshape(
                    () if fmt == "fp8-tensor-static" else (1,))
        else:
            out[name] = t.to(torch.bfloat16)
            deq[name] = out[name].float()
    for folder, content, quantization in ((dst, out, qc), (twin, deq, None)):
        folder.mkdir(parents=True, exist_ok=True)
        config = json.loads((src / "config.json").read_text())
        config.pop("quantization_config", None)
        if quantization is not None:
            config["quantization_config"] = quantization
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        save_file({k: v.contiguous() for k, v in content.items()},
                  str(folder / "model.safetensors"), metadata={"format": "pt"})
        for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (src / extra).is_file():
                shutil.copy(src / extra, folder / extra)
    return dst


def _fp8_format(fmt: str, ignore: list[str]) -> tuple[dict, str, str, tuple[int, int] | None, bool]:
    """(quantization_config, weight strategy, scale tensor name, block, static input scale)."""
    def ct_args(strategy, block=None, dynamic=True):
        return {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": dynamic,
                "strategy": strategy, "group_size": None, "block_structure": block,
                "actorder": None, "observer": None if dynamic else "minmax",
                "observer_kwargs": {}}

    def ct(strategy, activations, block=None):
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "quantization_status": "compressed", "global_compression_ratio": None,
                "kv_cache_scheme": None, "ignore": ignore,
                "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None,
                                              "weights": ct_args(strategy, block, False),
                                              "input_activations": activations}}}

    if fmt in ("ct-tensor-static", "ct-tensor-scalar"):
        static = fmt == "ct-tensor-static"
        acts = ct_args("tensor", dynamic=False) if static else ct_args("token")
        return ct("tensor", acts), "tensor" if static else "scalar", "weight_scale", None, static
    if fmt == "ct-channel-dynamic":
        return ct("channel", ct_args("token")), "channel-bf16", "weight_scale", None, False
    if fmt == "ct-block":
        acts = {**ct_args("group"), "group_size": 128}
        return ct("block", acts, [128, 128]), "block", "weight_scale", (128, 128), False
    if fmt == "fbgemm":
        qc = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
              "modules_to_not_convert": ignore}
        return qc, "channel", "weight_scale", None, False
    if fmt in ("fp8-block", "fp8-block-small"):
        block = (128, 128) if fmt == "fp8-block" else (32, 64)
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(block), "modules_to_not_convert": ignore}
        return qc, "block", "weight_scale_inv", block, False
    if fmt == "fp8-tensor-static":
        qc = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ignore}
        return qc, "scalar", "weight_scale", None, True
    raise ValueError(f"unknown FP8 test format {fmt!r}; choose {', '.join(FP8_FORMATS)}")


def _ref_quantize(w, strategy: str, block):
    """w [N, K] float32 -> (e4m3 weight, its scale as the format stores it)."""
    import torch

    fp8_max = 448.0
    n, k = w.shape
    if strategy in ("tensor", "scalar"):
        scale = w.abs().max() / fp8_max
        stored = scale.reshape(1) if strategy == "tensor" else scale.reshape(())
    elif strategy.startswith("channel"):
        scale = w.abs().amax(dim=1, keepdim=True) / fp8_max  # [N, 1]
        stored = scale.to(torch.bfloat16) if strategy == "channel-bf16" else scale
        scale = stored.float()  # quantize with the scale the file holds
    else:
        bo, bi = block
        stored = torch.empty(-(-n // bo), -(-k // bi))
        for r in range(stored.shape[0]):
            for c in range(stored.shape[1]):
                stored[r, c] = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi].abs().max() / fp8_max
        scale = torch.kron(stored, torch.ones(bo, bi))[:n, :k]
    return (w / scale).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn), stored


def _ref_dequantize(q, stored, strategy: str, block):
    """What an FP8 weight stands for, in float32: each element times its block's scale."""
    import torch

    n, k = q.shape
    if block is not None:
        scale = torch.kron(stored.float(), torch.ones(*block))[:n, :k]
    else:
        scale = stored.float().reshape(-1, 1) if strategy.startswith("channel") else stored.float()
    return q.float() * scale


# --- Qwen2.5-VL (vision-language) --------------------------------------------------------------

# Qwen2-VL / Qwen2.5-VL's published chat template: an image content part ({"type": "image"},
# {"type": "image_url", ...}) becomes <|vision_start|><|image_pad|><|vision_end|>, which the
# processor widens to the image's token count.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VL_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                     "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")  # ids 256..262


def save_tiny_qwen2_5_vl(folder: str | Path, seed: int = 0, *, vision_depth: int = 3,
                         min_pixels: int = 28 * 28 * 4, max_pixels: int = 28 * 28 * 24,
                         weight_scale: float = 1.0) -> Path:
    """A tiny random Qwen2_5_VLForConditionalGeneration saved by transformers (LM hidden 64,
    2 layers, GQA 4:2, mrope_section [2, 3, 3]; vision hidden 32, `vision_depth` blocks, the
    last one full attention, windows of 2 x 2 merged blocks; random norm weights and biases)
    with a byte-level tokenizer of its own (ids 0..255 the bytes, 256.. `VL_SPECIAL_TOKENS`;
    EOS <|im_end|>), Qwen2-VL's chat template and a real `preprocessor_config.json` (the
    Qwen2-VL image processor with small min/max pixels: images of a few tokens).
    `weight_scale` multiplies every other weight: at the initializer's scale (1) the greedy
    tokens hardly depend on the prompt (the same token again and again); at 10 they differ
    from image to image and from text to text (what a test that a row's images reached the
    model needs)."""

    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2_5_VLForConditionalGeneration

    folder = Path(folder)
    ids = {t: 256 + i for i, t in enumerate(VL_SPECIAL_TOKENS)}
    special = dict(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    cfg = tiny_hf_config(
        "qwen2_5_vl", 272, text_config=special,
        vision_config=dict(depth=vision_depth, fullatt_block_indexes=[vision_depth - 1]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], **special)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.mul_(weight_scale)
    model.save_pretrained(folder)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_char = sorted(alphabet, key=lambda c: _BYTE_ORDER(c))
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(byte_char)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in VL_SPECIAL_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False,
        "chat_template": QWEN2_VL_CHAT_TEMPLATE}))
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "rescale_factor": 1 / 255, "resample": 3,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": min_pixels, "max_pixels": max_pixels, "patch_size": 14,
        "temporal_patch_size": 2, "merge_size": 2}))
    return folder


def png_header(w: int, h: int) -> bytes:
    """A PNG (8-bit RGB) whose header claims w x h pixels and whose data holds a few: an
    oversized image, or a decompression bomb, without the memory of one."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
