"""The Qwen2.5-VL vision tower held to transformers' `model.visual` on a tiny random
checkpoint (float32, atol 1e-5): one image, several images of different sizes (window
attention with padded edge windows, full attention per image)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve.multimodal.image_input import ImageConfig, preprocess
from nanoserve.multimodal.vision_model import VisionConfig, VisionTransformer
from nanoserve.testing import save_tiny_qwen2_5_vl


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    from transformers import Qwen2_5_VLForConditionalGeneration

    folder = save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-vl"))
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf


def _ours(hf) -> VisionTransformer:
    cfg = VisionConfig.from_hf_dict(hf.config.vision_config.to_dict())
    model = VisionTransformer(cfg)
    model.load_state_dict(hf.model.visual.state_dict(), strict=True)
    return model.eval()


def _image(w: int, h: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("sizes", [[(84, 56)], [(84, 56), (140, 112), (56, 170)]])
def test_vision_tower_equals_transformers(tiny_vl, sizes):
    folder, hf = tiny_vl
    cfg = ImageConfig.from_folder(folder)
    parts = [preprocess(_image(w, h, i), cfg) for i, (w, h) in enumerate(sizes)]
    pixels = torch.from_numpy(np.concatenate([p for p, _ in parts]))
    grids = [g for _, g in parts]
    with torch.no_grad():
        ref = hf.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
        ours = _ours(hf)(pixels, grids)
    assert ours.shape == ref.shape == (sum(t * h * w for t, h, w in grids) // 4, 64)
    assert (ours - ref).abs().max().item() <= 1e-5
