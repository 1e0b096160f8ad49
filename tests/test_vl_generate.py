"""Qwen2.5-VL through `LLM.chat` on the continuous scheduler (CPU), held to transformers'
`generate` on the same tiny random checkpoint (float32, greedy, EOS ignored so every row
runs its full length): images as data: URLs and local paths, several a row, rows with and
without images in one call, each equal to itself alone; the prefix cache never shares an
image's blocks with another image behind the same placeholders, and does share them for
the same image; preempted rows recompute to the same tokens.

transformers' side: its tokenizer renders the chat template, its image processor (the PIL
backend: torchvision is not installed) makes pixel values and grids, each <|image_pad|> is
widened to grid_t * grid_h * grid_w / merge**2 tokens (what Qwen2_5_VLProcessor does; the
processor class itself needs torchvision for its video half), then `generate`."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from hf_oracle import qwen2_5_vl_generate
from PIL import Image

from nanoserve.llm import LLM
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import VL_SPECIAL_TOKENS, save_tiny_qwen2_5_vl

IMG = 256 + VL_SPECIAL_TOKENS.index("<|image_pad|>")
NEW = 12


def _with_oracle(folder):
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        Qwen2_5_VLForConditionalGeneration,
    )

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return folder, hf, AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    return _with_oracle(save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-vl")))


def _png(w: int, h: int, seed: int) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return buf.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _hf_generate(vl, messages, images: list[bytes]) -> list[int]:
    _, hf, tok, proc = vl
    plain = [{**m, "content": [{"type": "image"} if p["type"] == "image_url" else p
                               for p in m["content"]]} if isinstance(m["content"], list) else m
             for m in messages]
    ids = tok(tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=False))["input_ids"]
    pil = [Image.open(io.BytesIO(b)) for b in images]
    return qwen2_5_vl_generate(hf, tok, proc, ids, pil, NEW)[0]


def _conversations(tmp_path):
    a, b, c = _png(84, 56, 1), _png(56, 140, 2), _png(100, 70, 3)
    path = tmp_path / "b.png"
    path.write_bytes(b)
    return [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(a)}},
                                       {"type": "text", "text": "What is it?"}]}], [a]),
        ([{"role": "user", "content": "No image here."}], []),
        ([{"role": "system", "content": "Be short."},
          {"role": "user", "content": [{"type": "text", "text": "Compare "},
                                       {"type": "image_url", "image_url": {"url": str(path)}},
                                       {"type": "text", "text": " and "},
                                       {"type": "image_url", "image_url": {"url": _url(c)}}]}],
         [b, c]),
    ]


def _llm(folder, **kw) -> LLM:
    return LLM(str(folder), device="cpu", kv_cache_bytes=kw.pop("kv_cache_bytes", 1 << 20),
               block_size=4, **kw)


@pytest.mark.parametrize("decode_step", ["eager", "static"])
def test_chat_equals_transformers_generate_mixed_batch(vl, tmp_path, decode_step):
    folder = vl[0]
    convs = _conversations(tmp_path)
    want = [_hf_generate(vl, m, imgs) for m, imgs in convs]
    llm = _llm(folder, decode_step=decode_step)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    together = llm.chat([m for m, _ in convs], params)
    assert [o.token_ids for o in together] == want
    for (m, _), w in zip(convs, want):  # each alone, on a pool with the others' blocks cached
        assert llm.chat(m, params)[0].token_ids == w


@pytest.fixture(scope="module")
def vl10(tmp_path_factory):
    """The checkpoint the batch-job tests use (`weight_scale=10`: its greedy tokens differ
    from image to image, where the default's barely depend on the prompt)."""
    return _with_oracle(save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-vl-10"),
                                             weight_scale=10.0))


def test_larger_weights_give_image_dependent_tokens_equal_to_transformers(vl10, tmp_path):
    """The larger weights equal transformers as well, the mixed batch and each row alone."""
    vl = vl10
    convs = _conversations(tmp_path)
    want = [_hf_generate(vl, m, imgs) for m, imgs in convs]
    assert len({tuple(w) for w in want}) == len(want) and len(set(want[0])) > 2
    llm = _llm(vl[0])
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.chat([m for m, _ in convs], params)] == want
    assert [llm.chat(m, params)[0].token_ids for m, _ in convs] == want


def test_prefix_cache_keys_blocks_by_image_bytes(vl, tmp_path):
    """Same text, different images: the placeholder tokens are equal, the blocks are not
    shared (each row equals transformers); the same image again reuses its blocks."""
    folder = vl[0]
    a, b = _png(84, 56, 7), _png(84, 56, 8)

    def conv(img):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(img)}},
                                             {"type": "text", "text": "Describe."}]}]

    llm = _llm(folder)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    first = llm.chat(conv(a), params)[0].token_ids
    assert first == _hf_generate(vl, conv(a), [a])
    other = llm.chat(conv(b), params)[0].token_ids
    assert other == _hf_generate(vl, conv(b), [b])
    tok = vl[2]
    plain = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    before = tok(tok.apply_chat_template(plain, add_generation_prompt=True,
                                         tokenize=False))["input_ids"].index(IMG)
    assert 0 < llm.last_stats.cached_tokens <= before  # the blocks before the image only
    again = llm.chat(conv(a), params)[0].token_ids
    assert again == first and llm.last_stats.cached_tokens >= before + 4  # through the image


def test_cache_hit_ending_inside_an_image(vl10):
    """An image-last conversation twice, on blocks of 16: the second run's cache hit (every
    full block but the one with its last token) ends inside the image's tokens, so its
    prefill starts at an image token, whose features it must still place. Both runs equal
    transformers; where the image lies is read from transformers' tokenizer."""
    folder, _, tok, proc = vl10
    img = _png(84, 56, 5)
    conv = [{"role": "user", "content": [{"type": "text", "text": "Name this image"},
                                         {"type": "image_url", "image_url": {"url": _url(img)}}]}]
    plain = [{"role": "user", "content": [{"type": "text", "text": "Name this image"},
                                          {"type": "image"}]}]
    ids = tok(tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=False))["input_ids"]
    grid = proc(images=[Image.open(io.BytesIO(img))], return_tensors="pt")["image_grid_thw"]
    first = ids.index(IMG)
    last = first + int(grid.prod(-1)[0]) // 4 - 1
    want = _hf_generate(vl10, conv, [img])
    llm = LLM(str(folder), device="cpu", kv_cache_bytes=1 << 20, block_size=16)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    assert llm.chat(conv, params)[0].token_ids == want
    assert llm.chat(conv, params)[0].token_ids == want
    assert first < llm.last_stats.cached_tokens <= last, (first, last)


def test_preempted_image_rows_recompute_the_same_tokens(vl, tmp_path):
    folder = vl[0]
    convs = _conversations(tmp_path)
    want = [_hf_generate(vl, m, imgs) for m, imgs in convs]
    # a pool of 60 blocks of 4 tokens: three rows of ~73 prompt tokens (19 blocks each) are
    # admitted together, and cannot all grow to their 12 new tokens
    llm = _llm(folder, kv_cache_bytes=60 * 2 * 2 * 4 * 2 * 16 * 4,  # layers, K/V, tokens, heads, D, fp32
               enable_prefix_caching=False)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    outs = llm.chat([m for m, _ in convs] * 2, params)
    assert [o.token_ids for o in outs] == want * 2
    assert llm.last_stats.preemptions > 0


def test_samples_of_an_image_prompt_share_its_prefill(vl, tmp_path):
    """n = 2 greedy samples: forked at the prefill, both decode at the row's rotary offset."""
    folder = vl[0]
    m, imgs = _conversations(tmp_path)[2]
    want = _hf_generate(vl, m, imgs)
    llm = _llm(folder)
    outs = llm.chat(m, SamplingParams(n=2, max_tokens=NEW, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [want, want]


def test_bad_image_and_text_model_are_one_line_errors(vl, tmp_path):
    from nanoserve.multimodal.image_input import ImageError
    from nanoserve.multimodal.prompt import MultimodalPrompt

    llm = _llm(vl[0])
    bad = [{"role": "user", "content": [{"type": "image_url",
                                         "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(ImageError, match="does not decode"):
        llm.chat(bad)
    remote = [{"role": "user", "content": [{"type": "image_url",
                                            "image_url": {"url": "https://example.invalid/x.png"}}]}]
    with pytest.raises(ImageError, match="network"):
        llm.chat(remote)
    prompt = llm.tokenizer.encode("hi")
    wrong = MultimodalPrompt(prompt, (_image_input(),))
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate([wrong])


def _image_input():
    from nanoserve.multimodal.image_input import ImageConfig, load_image

    return load_image(_png(56, 56, 0), ImageConfig(min_pixels=28 * 28, max_pixels=28 * 28 * 4))


def test_padded_prefills_and_dummy_weights(vl, tmp_path):
    """Prefills padded to `prefill_length` as on a GPU (the padding row's positions appended
    to the image rows' multimodal ones) give the same tokens; a Qwen2.5-VL config loads with
    random weights (`load_format="dummy"`, the benchmark's) and runs an image row."""
    folder = vl[0]
    convs = _conversations(tmp_path)
    want = [_hf_generate(vl, m, imgs) for m, imgs in convs]
    llm = _llm(folder)
    llm.runner.pad_prefills = True
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in llm.chat([m for m, _ in convs], params)] == want
    dummy = _llm(folder, load_format="dummy")
    assert len(dummy.chat(convs[2][0], params)[0].token_ids) == NEW
