"""CLIP image preprocessing, bit-exact with transformers 5's PIL backend (``CLIPImageProcessorPil``).

transformers 5 falls back to the PIL/NumPy backend when torchvision is missing (as here). Its pipeline, which
this module follows step by step (``PilBackend`` in transformers/image_processing_backends.py, and
transformers/image_transforms.py):

1. convert to RGB, compositing any transparency onto white (``convert_to_rgb``);
2. resize with PIL so the shortest edge is ``size.shortest_edge``, the long edge ``int(edge * long / short)``;
3. center crop to ``crop_size`` (zero-padding an image that is too small);
4. rescale: ``uint8 -> float64 * rescale_factor -> float32``;
5. normalize in float32: ``(x - mean) / std`` per channel; channels first.

Settings come from the model folder. transformers 5 saves them nested under ``"image_processor"`` in
``processor_config.json``; older folders have a flat ``preprocessor_config.json``. Like transformers, the
nested form wins when both exist.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from pdserve.models.config import ModelConfigError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = int(Image.Resampling.BICUBIC)

# The image processor classes whose preprocessing is the plain CLIP pipeline above.
CLIP_PROCESSOR_TYPES = ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil")
# Bump when the algorithm changes, so content hashes that include the fingerprint change with it.
_FINGERPRINT_VERSION = "clip-image-v1"


@dataclass(frozen=True, slots=True)
class ClipImageSettings:
    """Defaults are CLIPImageProcessor's class defaults (what transformers uses for keys a file omits)."""

    do_convert_rgb: bool = True
    do_resize: bool = True
    # Exactly one of shortest_edge or (resize_height, resize_width) is set when do_resize.
    shortest_edge: int | None = 224
    resize_height: int | None = None
    resize_width: int | None = None
    resample: int = BICUBIC
    do_center_crop: bool = True
    crop_height: int = 224
    crop_width: int = 224
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> ClipImageSettings:
        kind = raw.get("image_processor_type")
        if kind is not None and kind not in CLIP_PROCESSOR_TYPES:
            raise ModelConfigError(f"unsupported image processor {kind!r}; pdserve implements "
                                   f"{', '.join(CLIP_PROCESSOR_TYPES)}")
        defaults = cls()
        shortest_edge, resize_height, resize_width = _resize_target(raw.get("size"), defaults)
        crop_height, crop_width = _crop_target(raw.get("crop_size"), defaults)
        return cls(
            do_convert_rgb=bool(raw.get("do_convert_rgb", defaults.do_convert_rgb)),
            do_resize=bool(raw.get("do_resize", defaults.do_resize)),
            shortest_edge=shortest_edge,
            resize_height=resize_height,
            resize_width=resize_width,
            resample=int(raw.get("resample", defaults.resample)),
            do_center_crop=bool(raw.get("do_center_crop", defaults.do_center_crop)),
            crop_height=crop_height,
            crop_width=crop_width,
            do_rescale=bool(raw.get("do_rescale", defaults.do_rescale)),
            rescale_factor=float(raw.get("rescale_factor", defaults.rescale_factor)),
            do_normalize=bool(raw.get("do_normalize", defaults.do_normalize)),
            image_mean=_per_channel(raw.get("image_mean", defaults.image_mean)),
            image_std=_per_channel(raw.get("image_std", defaults.image_std)),
        )


def _resize_target(size: Any, defaults: ClipImageSettings) -> tuple[int | None, int | None, int | None]:
    """(shortest_edge, height, width). An int means the shortest edge: CLIP does not default to square."""
    if size is None:
        return defaults.shortest_edge, None, None
    if isinstance(size, int):
        return size, None, None
    if isinstance(size, Mapping):
        if set(size) == {"shortest_edge"}:
            return int(size["shortest_edge"]), None, None
        if set(size) == {"height", "width"}:
            return None, int(size["height"]), int(size["width"])
    raise ModelConfigError(f"unsupported image processor size {size!r}; "
                           "expected shortest_edge or height and width")


def _crop_target(crop_size: Any, defaults: ClipImageSettings) -> tuple[int, int]:
    if crop_size is None:
        return defaults.crop_height, defaults.crop_width
    if isinstance(crop_size, int):
        return crop_size, crop_size
    if isinstance(crop_size, Mapping) and {"height", "width"} <= set(crop_size):
        return int(crop_size["height"]), int(crop_size["width"])
    raise ModelConfigError(f"unsupported image processor crop_size {crop_size!r}")


def _per_channel(value: Any) -> tuple[float, float, float]:
    values = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != 3:
        raise ModelConfigError(f"expected 3 per-channel values, got {value!r}")
    return values[0], values[1], values[2]


# ----------------------------------------------------------------------------- the steps


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: transparent pixels are composited onto white, not just dropped."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if not has_alpha:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def shortest_edge_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """(height, width) as transformers' get_resize_output_image_size(default_to_square=False) computes it."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = shortest_edge, int(shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def center_crop(image: np.ndarray, crop_height: int, crop_width: int) -> np.ndarray:
    """Crop a [C, H, W] array around its center; zero-pad first where the image is smaller than the crop."""
    height, width = image.shape[-2:]
    top, left = (height - crop_height) // 2, (width - crop_width) // 2
    if top >= 0 and left >= 0:
        return image[..., top:top + crop_height, left:left + crop_width]
    # Same placement as transformers: the image sits at ceil(pad / 2), then the crop window moves with it.
    padded_height, padded_width = max(crop_height, height), max(crop_width, width)
    pad_top, pad_left = math.ceil((padded_height - height) / 2), math.ceil((padded_width - width) / 2)
    padded = np.zeros(image.shape[:-2] + (padded_height, padded_width), dtype=image.dtype)
    padded[..., pad_top:pad_top + height, pad_left:pad_left + width] = image
    top, left = top + pad_top, left + pad_left
    return padded[..., max(0, top):min(padded_height, top + crop_height),
                  max(0, left):min(padded_width, left + crop_width)]


class ClipImageProcessor:
    """PIL image -> float32 ``[3, crop_height, crop_width]`` tensor, as transformers would preprocess it."""

    def __init__(self, settings: ClipImageSettings) -> None:
        self.settings = settings

    def __call__(self, image: Image.Image) -> torch.Tensor:
        s = self.settings
        if s.do_convert_rgb:
            image = to_rgb(image)
        if s.do_resize:
            image = image.resize(self._resized_width_height(image), resample=Image.Resampling(s.resample))
        pixels = np.array(image)
        pixels = pixels[None] if pixels.ndim == 2 else np.moveaxis(pixels, -1, 0)  # channels first
        if s.do_center_crop:
            pixels = center_crop(pixels, s.crop_height, s.crop_width)
        if s.do_rescale:
            # float64 first, float32 at the end, exactly as transformers' rescale.
            pixels = (pixels.astype(np.float64) * s.rescale_factor).astype(np.float32)
        else:
            pixels = pixels.astype(np.float32)
        if s.do_normalize:
            mean = np.array(s.image_mean, dtype=np.float32)[:, None, None]
            std = np.array(s.image_std, dtype=np.float32)[:, None, None]
            pixels = (pixels - mean) / std
        return torch.from_numpy(np.ascontiguousarray(pixels))

    def _resized_width_height(self, image: Image.Image) -> tuple[int, int]:
        s = self.settings
        if s.shortest_edge is not None:
            height, width = shortest_edge_size(image.height, image.width, s.shortest_edge)
        else:
            assert s.resize_height is not None and s.resize_width is not None
            height, width = s.resize_height, s.resize_width
        return width, height  # PIL sizes are (width, height)

    def settings_fingerprint(self) -> str:
        """A stable string naming the settings and the algorithm version (an input to content hashes)."""
        payload = json.dumps(asdict(self.settings), sort_keys=True, separators=(",", ":"))
        return f"{_FINGERPRINT_VERSION}:{payload}"


# ----------------------------------------------------------------------------- loading


def read_image_processor_settings(model_dir: Path) -> dict[str, Any] | None:
    """The image-processor dict of a model folder, found the way transformers 5 finds it; None if absent."""
    model_dir = Path(model_dir)
    processor_file = model_dir / "processor_config.json"
    if processor_file.is_file():
        nested = json.loads(processor_file.read_text()).get("image_processor")
        if nested is not None:
            return nested
    legacy_file = model_dir / "preprocessor_config.json"
    if legacy_file.is_file():
        return json.loads(legacy_file.read_text())
    return None


def load_image_processor(model_dir: Path, fallback_image_size: int | None = None) -> ClipImageProcessor:
    """The folder's CLIP image processor. Without a settings file, ``fallback_image_size`` (the vision tower's
    input size) gives CLIP defaults at that size; without either, the folder is refused."""
    raw = read_image_processor_settings(model_dir)
    if raw is None:
        if fallback_image_size is None:
            raise ModelConfigError(f"{model_dir} has neither processor_config.json (with an image_processor "
                                   "section) nor preprocessor_config.json")
        raw = {"size": {"shortest_edge": fallback_image_size},
               "crop_size": {"height": fallback_image_size, "width": fallback_image_size}}
    return ClipImageProcessor(ClipImageSettings.from_hf(raw))
