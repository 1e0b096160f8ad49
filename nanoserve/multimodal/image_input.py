"""Images in: decoding, resizing and patchifying for a Qwen2.5-VL vision tower, with Pillow
and numpy, as transformers' `Qwen2VLImageProcessor` (its PIL backend) computes them.

    source (data: URL, local path, bytes) --decode_image--> RGB `PIL.Image`, EXIF-upright
        --preprocess--> patches [gh * gw, C * T * P * P] float32 and grid (1, gh, gw)

- Resize: `smart_resize` picks the size: both sides multiples of P * merge (28), the pixel
  count within [min_pixels, max_pixels], the aspect ratio kept as near as it can be; the
  image is resized with Pillow's bicubic filter on its uint8 pixels.
- Pixels: x / 255 (computed in float64, stored float32), then (x - mean) / std per channel.
- Patches: P x P pixels, each frame repeated `temporal_patch_size` times (a still image
  is one frame), laid out merge-block by merge-block (the 2 x 2 patches one LM token
  stands for are consecutive): grid (t, gh, gw) = (1, H / P, W / P), and the image
  becomes gh * gw / merge**2 tokens in the prompt.

Safety (an image is untrusted input): nothing is fetched from the web (object stores are
read as the batch job reads its input, through pyarrow.fs); the encoded
file is capped in bytes; its pixel count is read from the header and refused above
`max_image_pixels` before any pixel is decoded (a decompression bomb never inflates);
decoding errors are `ImageError` with one line. Pillow's own bomb guard stays on.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nanoserve.errors import NanoserveError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_FILE = "preprocessor_config.json"
MAX_IMAGE_BYTES = 64 << 20  # an encoded image larger than this is refused unread
MAX_IMAGE_PIXELS = 64 << 20  # decoded pixels (w * h) above this are refused from the header
OBJECT_STORES = ("s3", "gs", "gcs", "hdfs", "abfs", "abfss")  # read through pyarrow.fs


class ImageError(NanoserveError, ValueError):
    """One image cannot be used (unreadable, broken, too large, a remote URL): the row
    that holds it fails, the others go on."""


@dataclass(frozen=True)
class ImageConfig:
    """The image processor's settings (`preprocessor_config.json`)."""

    patch_size: int = 14  # P: a patch is P x P pixels
    temporal_patch_size: int = 2  # frames per patch (an image's one frame, repeated)
    merge_size: int = 2  # merge x merge patches become one LM token
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD

    @property
    def factor(self) -> int:
        """What both sides of a resized image are multiples of (28)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageConfig:
        size = d.get("size") or {}
        return cls(
            patch_size=int(d.get("patch_size", 14)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            merge_size=int(d.get("merge_size", 2)),
            # 5.x writes size {shortest_edge, longest_edge} (pixel counts); 4.x min/max_pixels
            min_pixels=int(d.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            max_pixels=int(d.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)),
            image_mean=tuple(float(x) for x in d.get("image_mean", OPENAI_CLIP_MEAN)),
            image_std=tuple(float(x) for x in d.get("image_std", OPENAI_CLIP_STD)),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ImageConfig:
        """The folder's preprocessor_config.json, else the Qwen2-VL defaults."""
        path = Path(folder) / PREPROCESSOR_FILE
        if not path.is_file():
            return cls()
        return cls.from_dict(json.loads(path.read_text()))


@dataclass(frozen=True)
class ImageInput:
    """One image ready for the vision tower."""

    pixel_values: np.ndarray  # [gh * gw, C * T * P * P] float32
    grid_thw: tuple[int, int, int]  # (1, gh, gw) in patches
    digest: bytes  # blake2b of the encoded bytes: the prefix cache's name for the image
    merge_size: int

    @property
    def num_tokens(self) -> int:
        """LM tokens the image becomes (its placeholder's length in the prompt)."""
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size**2


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """(height, width): multiples of `factor`, min_pixels <= h * w <= max_pixels, the
    aspect ratio kept as nearly as it can be (transformers' `smart_resize`)."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"image aspect ratio {max(height, width) / min(height, width):.0f}:1 "
                         f"is over 200:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def read_image_bytes(source: str | bytes | Path, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The encoded bytes of an image given as bytes, a `data:` URL (base64), an
    object-storage URI (`OBJECT_STORES`, through pyarrow.fs), a `file://` URL or a local
    path. Web URLs are refused: nothing is fetched from a network."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, (str, Path)):
        s = str(source)
        if s.startswith("data:"):
            header, _, payload = s.partition(",")
            if ";base64" not in header:
                raise ImageError("a data: URL image must be base64 (data:image/...;base64,...)")
            if len(payload) > max_bytes * 4 // 3 + 4:
                raise ImageError(f"image is over {max_bytes} bytes")
            try:
                data = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise ImageError("a data: URL's base64 payload does not decode") from None
        elif s.split("://", 1)[0] in OBJECT_STORES and "://" in s:
            data = _read_object(s, max_bytes)
        elif "://" in s and not s.startswith("file://"):
            raise ImageError(f"image URL scheme of {s[:40]!r} is not read: give a data: URL, "
                             f"an object-storage URI ({', '.join(OBJECT_STORES)}), a local "
                             f"path or the bytes (nothing is fetched from a network)")
        else:
            path = Path(s[len("file://"):] if s.startswith("file://") else s)
            try:
                if path.stat().st_size > max_bytes:
                    raise ImageError(f"image file {path} is over {max_bytes} bytes")
                data = path.read_bytes()
            except OSError as e:
                raise ImageError(f"cannot read image {path}: {e.strerror or e}") from None
    else:
        raise ImageError(f"an image is bytes, a data: URL or a path, not {type(source).__name__}")
    if len(data) > max_bytes:
        raise ImageError(f"image is {len(data)} bytes, over {max_bytes}")
    return data


def _filesystem(uri: str):
    """(pyarrow filesystem, path) of an object-storage URI."""
    import pyarrow.fs as pafs

    return pafs.FileSystem.from_uri(uri)


def _read_object(uri: str, max_bytes: int) -> bytes:
    """An object's bytes through `pyarrow.fs` (credentials from the environment, as the
    batch job's storage), its size checked before it is read."""
    import pyarrow as pa

    try:
        fs, path = _filesystem(uri)
        size = fs.get_file_info(path).size
        if size is not None and size > max_bytes:
            raise ImageError(f"image {uri} is over {max_bytes} bytes")
        with fs.open_input_stream(path) as f:
            data = f.read(max_bytes + 1)
    except ImageError:
        raise
    except (OSError, ValueError, pa.ArrowException) as e:
        raise ImageError(f"cannot read image {uri}: {str(e).splitlines()[0][:200]}") from None
    return data


def decode_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS):
    """Encoded bytes -> an RGB `PIL.Image`, turned upright by its EXIF orientation, with
    transparency composited on white (as transformers' `convert_to_rgb`). Its size is
    checked from the header before any pixel is decoded."""
    import warnings

    from PIL import Image, ImageOps

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > max_pixels:
                raise ImageError(f"image is {w}x{h} pixels, over the {max_pixels} allowed "
                                 f"(refused before decoding)")
            if w < 1 or h < 1:
                raise ImageError(f"image is {w}x{h} pixels")
            img.load()
            img = ImageOps.exif_transpose(img)
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"image refused as a decompression bomb: {e}") from None
    except (OSError, ValueError, SyntaxError, Image.UnidentifiedImageError) as e:
        raise ImageError(f"image does not decode: {e}") from None
    except Exception as e:  # a decoder's own failure on crafted bytes (struct.error, ...)
        raise ImageError(f"image does not decode: {type(e).__name__}: {e}") from None
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def preprocess(img, cfg: ImageConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """An RGB `PIL.Image` -> (patches [gh * gw, 3 * T * P * P] float32, (1, gh, gw))."""
    from PIL import Image

    h, w = smart_resize(img.height, img.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    if (w, h) != img.size:
        img = img.resize((w, h), resample=Image.Resampling.BICUBIC)
    x = np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)  # [C, H, W]
    x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(cfg.image_std, dtype=np.float32)[:, None, None]
    x = (x - mean) / std
    P, M, T = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    C = x.shape[0]
    gh, gw = h // P, w // P
    # [C, gh/M, M, P, gw/M, M, P] -> [gh/M, gw/M, M, M, C, P, P]: merge blocks in raster
    # order, the M x M patches of a block together
    p = x.reshape(C, gh // M, M, P, gw // M, M, P).transpose(1, 4, 2, 5, 0, 3, 6)
    p = np.broadcast_to(p[:, :, :, :, :, None], (*p.shape[:5], T, P, P))  # the frame T times
    return np.ascontiguousarray(p.reshape(gh * gw, C * T * P * P)), (1, gh, gw)


def load_image(source: str | bytes | Path, cfg: ImageConfig, max_bytes: int = MAX_IMAGE_BYTES,
               max_pixels: int = MAX_IMAGE_PIXELS) -> ImageInput:
    """read, decode and preprocess one image (see the module docstring)."""
    data = read_image_bytes(source, max_bytes)
    patches, grid = preprocess(decode_image(data, max_pixels), cfg)
    return ImageInput(patches, grid, image_digest(data), cfg.merge_size)


def image_digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()
