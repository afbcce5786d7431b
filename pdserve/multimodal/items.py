"""Media items of a prompt: identity (mm_hash), placeholder range (mm_position), preprocessed data.

The chat template renders one image token per image; pdserve expands each into the model's image-token count
(as Hugging Face's LLaVA processor does), so every item owns `length` consecutive prompt positions.

The identity is what encode instances and prefill/decode instances must agree on without talking: a client's
`uuid` if it gave one, else a hash of the decoded pixels; either way folded with the image processor's
settings, since the same picture processed differently is a different encoder input.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from PIL import Image

from pdserve.ec_transfer.params import ECSource
from pdserve.engine.request import MultiModalItem


class PlaceholderError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ImagePart:
    image: Image.Image
    uuid: str | None = None


def mm_hash_of(part: ImagePart, processor_fingerprint: str) -> str:
    h = hashlib.sha256(processor_fingerprint.encode())
    if part.uuid:
        h.update(b"uuid:" + part.uuid.encode())
    else:
        rgb = part.image.convert("RGB")
        h.update(f"pixels:{rgb.width}x{rgb.height}:".encode())
        h.update(rgb.tobytes())
    return h.hexdigest()[:40]


def expand_placeholders(token_ids: list[int], image_token_id: int, tokens_per_image: int,
                        hashes: list[str], data: list[Any]) -> tuple[list[int], list[MultiModalItem]]:
    """Replace each single image token by `tokens_per_image` copies; one item per image, in order."""
    marks = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(marks) != len(hashes):
        raise PlaceholderError(f"the prompt has {len(marks)} image placeholders but the request has "
                               f"{len(hashes)} images")
    out: list[int] = []
    items: list[MultiModalItem] = []
    previous = 0
    for index, mark in enumerate(marks):
        out.extend(token_ids[previous:mark])
        items.append(MultiModalItem(mm_hash=hashes[index], offset=len(out), length=tokens_per_image,
                                    data=data[index]))
        out.extend([image_token_id] * tokens_per_image)
        previous = mark + 1
    out.extend(token_ids[previous:])
    return out, items


def apply_ec_params(items: list[MultiModalItem], sources: dict[str, ECSource]) -> None:
    """Items an encode instance already holds are loaded, not encoded: optimistic, with no probe."""
    for item in items:
        source = sources.get(item.mm_hash)
        if source is not None:
            item.remote = True
            item.source = source
