"""Image decoding and preprocessing held to transformers' Qwen2-VL image processor (its PIL
backend) on the same images: patches exact to float32 rounding (atol 1e-6), grids equal;
and the safety rules: EXIF orientation, RGB, remote URLs, broken and oversized images,
decompression bombs refused from the header."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from nanoserve.multimodal.image_input import (
    ImageConfig,
    ImageError,
    decode_image,
    load_image,
    preprocess,
    read_image_bytes,
    smart_resize,
)
from nanoserve.testing import png_header

SMALL = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 24)  # tiny grids, fast tests


def _png(w: int, h: int, mode: str = "RGB", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (h, w, len(mode)), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr.squeeze(-1) if mode == "L" else arr, mode).save(buf, "PNG")
    return buf.getvalue()


def _hf_processor(cfg: ImageConfig):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels,
                                    patch_size=cfg.patch_size, merge_size=cfg.merge_size,
                                    temporal_patch_size=cfg.temporal_patch_size)


@pytest.mark.parametrize("w,h,mode", [(84, 56, "RGB"), (100, 37, "RGB"), (20, 30, "RGB"),
                                      (400, 300, "RGB"), (60, 61, "RGBA"), (70, 45, "L")])
def test_patches_equal_transformers(w, h, mode):
    cfg = ImageConfig(**SMALL)
    img = decode_image(_png(w, h, mode))
    ours, grid = preprocess(img, cfg)
    ref = _hf_processor(cfg)(images=[img], return_tensors="np")
    assert grid == tuple(ref["image_grid_thw"][0].tolist())
    assert ours.shape == ref["pixel_values"].shape
    np.testing.assert_allclose(ours, ref["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("h,w", [(56, 84), (37, 100), (20, 30), (3000, 4000), (28, 5000)])
def test_smart_resize_equals_transformers(h, w):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as ref

    assert smart_resize(h, w, 28, 56 * 56, 28 * 28 * 1280) == ref(h, w, 28, 56 * 56,
                                                                  28 * 28 * 1280)


def test_config_reads_both_spellings(tmp_path):
    a = ImageConfig.from_dict({"min_pixels": 100, "max_pixels": 2000, "merge_size": 2})
    b = ImageConfig.from_dict({"size": {"shortest_edge": 100, "longest_edge": 2000}})
    assert (a.min_pixels, a.max_pixels) == (b.min_pixels, b.max_pixels) == (100, 2000)
    assert ImageConfig.from_folder(tmp_path) == ImageConfig()


def test_sources_data_url_path_bytes_agree(tmp_path):
    data = _png(84, 56)
    path = tmp_path / "a.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    cfg = ImageConfig(**SMALL)
    outs = [load_image(s, cfg) for s in (data, str(path), f"file://{path}", url)]
    for o in outs[1:]:
        assert o.digest == outs[0].digest and o.grid_thw == outs[0].grid_thw
        np.testing.assert_array_equal(o.pixel_values, outs[0].pixel_values)
    assert outs[0].num_tokens == 2 * 3  # 56x84 -> 4x6 patches -> 2x3 tokens


def test_exif_orientation_is_applied():
    arr = np.zeros((20, 40, 3), dtype=np.uint8)
    arr[:, :20] = 255  # left half white
    img = Image.fromarray(arr)
    exif = img.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif, quality=95)
    out = decode_image(buf.getvalue())
    assert out.size == (20, 40) and out.mode == "RGB"
    top = np.asarray(out)[:20].mean()
    assert top > 200  # the white half is on top once upright


def test_remote_urls_are_not_fetched():
    with pytest.raises(ImageError, match="network"):
        read_image_bytes("https://example.invalid/cat.png")


@pytest.mark.parametrize("data,match", [(b"not an image", "does not decode"),
                                        (_png(30, 30)[:60], "does not decode")])
def test_broken_images_are_one_line_errors(data, match):
    with pytest.raises(ImageError, match=match):
        decode_image(data)


def test_oversized_and_bomb_refused_before_decoding():
    with pytest.raises(ImageError, match="over"):
        read_image_bytes(_png(30, 30), max_bytes=100)
    # a PNG header claiming 9,000 x 9,000 pixels (243 MB decoded): refused from the header
    with pytest.raises(ImageError, match="refused before decoding"):
        decode_image(png_header(9000, 9000), max_pixels=10_000_000)
    # past Pillow's own bomb limit too, whatever our cap
    with pytest.raises(ImageError, match="bomb|over"):
        decode_image(png_header(100000, 100000), max_pixels=1 << 40)


def test_object_storage_uris_read_through_pyarrow(tmp_path, monkeypatch):
    """An s3:// URI goes through pyarrow.fs (here a local filesystem stands in for the
    bucket); its size is checked before its bytes are read."""
    import pyarrow.fs as pafs

    from nanoserve.multimodal import image_input
    data = _png(84, 56)
    (tmp_path / "cat.png").write_bytes(data)
    seen = []

    def from_uri(uri):
        seen.append(uri)
        return pafs.LocalFileSystem(), str(tmp_path / uri.rsplit("/", 1)[1])

    monkeypatch.setattr(image_input, "_filesystem", from_uri)
    assert read_image_bytes("s3://bucket/cat.png") == data and seen == ["s3://bucket/cat.png"]
    with pytest.raises(ImageError, match="over 100 bytes"):
        read_image_bytes("gs://bucket/cat.png", max_bytes=100)
    with pytest.raises(ImageError, match="cannot read image s3://bucket/none.png"):
        read_image_bytes("s3://bucket/none.png")
