"""Prompts with images (Qwen2.5-VL): from chat messages to token ids and images, and what
the scheduler keeps per row.

    messages with OpenAI content parts ({"type": "image_url", "image_url": {"url": ...}},
    {"type": "image", "image": path or bytes}, {"type": "text", "text": ...})
      --chat template--> text with one <|image_pad|> per image
      --encode, then each <|image_pad|> widened to the image's token count-->
    `MultimodalPrompt` (token ids, images in prompt order)

`RowImages` (one per prompt, shared by its samples) holds the prompt's multimodal rotary
positions and delta (nanoserve/multimodal/mrope.py), where its image tokens are, the image features
once computed (the vision tower runs once per image, however often the row is prefilled
again after a preemption), and the token ids its prefix-cache names are computed from: an
image's placeholder tokens are replaced by keys drawn from the image bytes' digest
(negative, so never a real token id), so two different images behind the same
placeholders never share a cached block, and the same image at the same place does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from nanoserve.multimodal.image_input import ImageConfig, ImageError, ImageInput, load_image
from nanoserve.multimodal.mrope import extend_positions, mrope_positions


@dataclass(frozen=True)
class MultimodalPrompt:
    """A prompt's token ids (each image's placeholder already its token count long) and
    its images, in the order their placeholders appear."""

    token_ids: list[int]
    images: tuple[ImageInput, ...]

    def __len__(self) -> int:
        return len(self.token_ids)


def image_sources(messages: list[dict]) -> tuple[list[dict], list[Any]]:
    """(the messages with each image part made {"type": "image"}, the images' sources in
    order). A source is a data: URL, a local path or file:// URL, or bytes."""
    sources: list[Any] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ValueError(f"messages[{i}]['content'][{j}] has no image_url.url")
                sources.append(url)
                parts.append({"type": "image"})
            elif kind == "image":
                sources.append(part.get("image"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, sources


def expand_placeholders(token_ids: list[int], images: list[ImageInput],
                        image_token_id: int) -> MultimodalPrompt:
    """Widen the k-th `image_token_id` to images[k].num_tokens copies."""
    at = [j for j, t in enumerate(token_ids) if t == image_token_id]
    if len(at) != len(images):
        raise ValueError(f"the prompt has {len(at)} image placeholders for {len(images)} images")
    out: list[int] = []
    start = 0
    for j, img in zip(at, images):
        out += token_ids[start:j] + [image_token_id] * img.num_tokens
        start = j + 1
    return MultimodalPrompt(out + token_ids[start:], tuple(images))


def chat_prompt(tokenizer, image_token_id: int, image_config: ImageConfig,
                messages: list[dict], **template_kwargs) -> MultimodalPrompt:
    """A conversation's prompt (generation prompt added). Raises ImageError for an image
    that cannot be used, ValueError for a malformed conversation."""
    plain, sources = image_sources(messages)
    text = tokenizer.apply_chat_template(plain, add_generation_prompt=True, content_parts=True,
                                         **template_kwargs)
    ids = tokenizer.encode(text, add_special_tokens=False)
    images = [load_image(s, image_config) for s in sources]
    return expand_placeholders(ids, images, image_token_id)


def _image_keys(digest: bytes, n: int) -> list[int]:
    """n stand-ins for an image's n placeholder tokens in the prefix-cache names: 63 bits
    of blake2b(digest, token index) each, negated (never a token id)."""
    keys = []
    for i in range(n):
        h = hashlib.blake2b(digest + i.to_bytes(4, "little"), digest_size=8).digest()
        keys.append(-1 - (int.from_bytes(h, "little") >> 1))
    return keys


class RowImages:
    """What the scheduler keeps for a prompt with images (see the module docstring)."""

    def __init__(self, prompt: MultimodalPrompt, image_token_id: int, merge_size: int) -> None:
        ids = prompt.token_ids
        self.images = prompt.images
        grids = [img.grid_thw for img in self.images]
        self.positions, self.delta = mrope_positions(ids, grids, image_token_id, merge_size)
        self.image_at = [j for j, t in enumerate(ids) if t == image_token_id]  # [M] sorted
        keys = [k for img in self.images for k in _image_keys(img.digest, img.num_tokens)]
        keyed = list(ids)
        for j, k in zip(self.image_at, keys):
            keyed[j] = k
        self.keyed = keyed  # the prompt's ids for prefix-cache names
        self.embeds = None  # [M, d] on the device, computed at the row's first prefill

    def positions_of(self, start: int, end: int) -> list[list[int]]:
        """[3][end - start]: the rotary positions of tokens start..end-1 (past the prompt:
        generated text, at index + delta)."""
        full = self.positions
        if end > len(full[0]):
            full = extend_positions(full, self.delta, end)
        return [p[start:end] for p in full]


def check_image_model(config) -> None:
    """Refuse images for a model without a vision tower, in one line."""
    if config.vision is None:
        raise ImageError(f"the model ({config.architecture}) takes no images")
