"""Qwen2.5-VL's language model held to transformers on a tiny random checkpoint (float32):
the config (nested and flat spellings), the multimodal rotary positions against its
`get_rope_index`, the logits of prompts with images (atol 1e-4), and a decode step at the
row's position (cache position + delta) against transformers' forward over the whole
sequence."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from nanoserve.cache.pool import CacheShape, DenseKVCache
from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.config import ModelConfig
from nanoserve.model.model import PlacedImages, build_model
from nanoserve.multimodal.image_input import ImageConfig, preprocess
from nanoserve.multimodal.mrope import extend_positions, mrope_positions
from nanoserve.testing import VL_SPECIAL_TOKENS, save_tiny_qwen2_5_vl
from nanoserve.weights.weights import load_checkpoint

_ID = {t: 256 + i for i, t in enumerate(VL_SPECIAL_TOKENS)}
IMG, START, END = _ID["<|image_pad|>"], _ID["<|vision_start|>"], _ID["<|vision_end|>"]


@pytest.fixture(scope="module")
def vl_pair(tmp_path_factory):
    from transformers import Qwen2_5_VLForConditionalGeneration

    folder = save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-vl"))
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    config, sd = load_checkpoint(folder)
    return folder, hf, build_model(config, sd)


def _images(folder, sizes):
    from PIL import Image

    cfg = ImageConfig.from_folder(folder)
    out = []
    for i, (w, h) in enumerate(sizes):
        rng = np.random.default_rng(10 + i)
        out.append(preprocess(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)),
                              cfg))
    return out


def _prompt(texts: list[bytes], grids) -> list[int]:
    ids: list[int] = []
    for i, text in enumerate(texts):
        ids += list(text)
        if i < len(grids):
            t, h, w = grids[i]
            ids += [START] + [IMG] * (t * h * w // 4) + [END]
    return ids


def test_config_nested_and_flat(vl_pair):
    folder, hf, model = vl_pair
    nested = json.loads((folder / "config.json").read_text())
    flat = {k: v for k, v in nested.items() if k != "text_config"} | nested["text_config"]
    flat["model_type"] = "qwen2_5_vl"
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}  # 4.x spelling
    flat["rope_theta"] = flat.pop("rope_parameters")["rope_theta"]  # beside it, in 4.x
    a, b = ModelConfig.from_hf_dict(nested), ModelConfig.from_hf_dict(flat)
    assert a == b == model.config
    assert a.mrope_section == (2, 3, 3) and a.qkv_bias and a.image_token_id == IMG
    assert a.vision.depth == 3 and a.vision.fullatt_block_indexes == (2,)


@pytest.mark.parametrize("sizes", [[(84, 56)], [(84, 56), (56, 140)], [(140, 112)]])
def test_positions_equal_get_rope_index(vl_pair, sizes):
    folder, hf, _ = vl_pair
    grids = [g for _, g in _images(folder, sizes)]
    ids = _prompt([b"ab", b"cde", b"f"][:len(grids) + 1], grids)
    ours, delta = mrope_positions(ids, grids, IMG, 2)
    tt = torch.tensor([ids])
    ref, ref_delta = hf.model.get_rope_index(tt, (tt == IMG).int(), torch.tensor(grids))
    assert ours == ref[:, 0].tolist() and delta == int(ref_delta)


def _forward(model, ids, grids, pixels):
    positions, delta = mrope_positions(ids, grids, IMG, 2)
    images = None
    if grids:
        embeds = model.visual(torch.from_numpy(pixels), grids)
        images = PlacedImages(torch.tensor([i for i, t in enumerate(ids) if t == IMG]), embeds)
    cache = DenseKVCache(CacheShape.of(model.config), len(ids) + 4)
    logits = model(torch.tensor([ids]), torch.tensor(positions)[:, None], cache,
                   AttentionMetadata.prefill(), images)
    return logits, cache, delta


@pytest.mark.parametrize("sizes", [[], [(84, 56)], [(84, 56), (56, 140)]])
def test_prefill_and_decode_logits_equal_transformers(vl_pair, sizes):
    folder, hf, model = vl_pair
    parts = _images(folder, sizes)
    grids = [g for _, g in parts]
    pixels = (np.concatenate([p for p, _ in parts]) if parts
              else np.zeros((0, 3 * 2 * 14 * 14), np.float32))
    ids = _prompt([b"hi ", b" and ", b"?"][:len(grids) + 1], grids)
    kw = {}
    if grids:
        kw = dict(pixel_values=torch.from_numpy(pixels), image_grid_thw=torch.tensor(grids),
                  mm_token_type_ids=(torch.tensor([ids]) == IMG).int())
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), **kw).logits
        ours, cache, delta = _forward(model, ids, grids, pixels)
        assert (ours - ref).abs().max().item() <= 1e-4
        # two decode steps: the token at cache position j rotates at j + delta
        seq = list(ids)
        for _ in range(2):
            seq.append(int(ours[0, -1].argmax()))
            j = len(seq) - 1
            ours = model(torch.tensor([[seq[-1]]]), torch.tensor([[j + delta]]), cache,
                         AttentionMetadata.prefill())
            if grids:  # transformers' 3D positions need the token types
                kw["mm_token_type_ids"] = (torch.tensor([seq]) == IMG).int()
            ref = hf(input_ids=torch.tensor([seq]), **kw).logits[:, -1:]
            assert (ours - ref).abs().max().item() <= 1e-4
    full, _ = mrope_positions(seq, grids, IMG, 2)
    assert extend_positions(mrope_positions(ids, grids, IMG, 2)[0], delta, len(seq)) == full


def test_nested_tensor_names_load_as_flat(vl_pair, tmp_path):
    """Checkpoints saved by other transformers versions name the language model
    `model.language_model.*` and the tower `model.visual.*`: they load to the same tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, _, _ = vl_pair
    nested = tmp_path / "nested"
    shutil.copytree(folder, nested)
    flat = load_file(folder / "model.safetensors")
    renamed = {("model.language_model." + n[len("model."):] if n.startswith("model.")
                else "model." + n if n.startswith("visual.") else n): t for n, t in flat.items()}
    save_file(renamed, nested / "model.safetensors")
    _, a = load_checkpoint(folder)
    _, b = load_checkpoint(nested)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.startswith("visual.") for k in a)
