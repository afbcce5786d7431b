"""Fetching images named in chat content: `data:` URLs always; local paths and remote URLs only if allowed."""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

MAX_IMAGE_BYTES = 32 << 20
MAX_IMAGE_PIXELS = 64_000_000


class MediaError(ValueError):
    """An image the server will not or cannot use; the server answers 400."""


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    allowed_local_media_path: Path | None = None  # vLLM's --allowed-local-media-path
    allow_remote_media: bool = False


def load_image(url: str, policy: MediaPolicy) -> Image.Image:
    if url.startswith("data:"):
        return _decode(_data_url_bytes(url))
    if url.startswith("file://") or url.startswith("/"):
        return _decode(_local_bytes(url.removeprefix("file://"), policy))
    if url.startswith(("http://", "https://")):
        if not policy.allow_remote_media:
            raise MediaError("remote image URLs are disabled on this server; send the image as a data: URL")
        return _decode(_fetch(url))
    raise MediaError("image_url must be a data: URL (or a path / URL the server allows)")


def _data_url_bytes(url: str) -> bytes:
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise MediaError("only base64 data: URLs are supported for images")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise MediaError(f"image larger than {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"image data URL is not valid base64: {exc}") from exc


def _local_bytes(path: str, policy: MediaPolicy) -> bytes:
    root = policy.allowed_local_media_path
    if root is None:
        raise MediaError("local image paths are disabled on this server (see --allowed-local-media-path)")
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise MediaError(f"image path outside the allowed directory {root}")
    try:
        return resolved.read_bytes()
    except OSError as exc:
        raise MediaError(f"cannot read image {path}: {exc}") from exc


def _fetch(url: str) -> bytes:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - only when explicitly allowed
            return response.read(MAX_IMAGE_BYTES + 1)
    except OSError as exc:
        raise MediaError(f"cannot fetch image {url}: {exc}") from exc


def _decode(data: bytes) -> Image.Image:
    if len(data) > MAX_IMAGE_BYTES:
        raise MediaError(f"image larger than {MAX_IMAGE_BYTES} bytes")
    try:
        # Opening reads only the header: the size is checked before a pixel is decoded. PIL refuses far larger
        # claims on its own (its limit is above ours), so both refusals say the same thing.
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise MediaError(f"image is {image.width}x{image.height} pixels; this server decodes images of at most "
                             f"{MAX_IMAGE_PIXELS} pixels")
        image.load()
    except Image.DecompressionBombError as exc:
        raise MediaError(f"image dimensions exceed the {MAX_IMAGE_PIXELS} pixels this server decodes "
                         f"(a possible decompression bomb)") from exc
    except (UnidentifiedImageError, OSError) as exc:
        raise MediaError(f"cannot decode image: {exc}") from exc
    return image
