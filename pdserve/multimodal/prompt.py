"""Chat messages with images into prompt token ids and media items, for multimodal models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.ec_transfer.params import ECSource
from pdserve.engine.request import MultiModalItem
from pdserve.multimodal.items import ImagePart, PlaceholderError, apply_ec_params, expand_placeholders, mm_hash_of
from pdserve.multimodal.media import MediaError, MediaPolicy, load_image
from pdserve.tokenizer import Tokenizer

IMAGE_PART_TYPES = ("image_url", "image")


class MultimodalInputError(ValueError):
    """Bad media in a request (the server answers 400)."""


@dataclass
class MultimodalPrompter:
    tokenizer: Tokenizer
    processor: Any  # callable(PIL image) -> pixel tensor, with settings_fingerprint()
    image_token_id: int
    tokens_per_image: int
    media: MediaPolicy

    def image_parts(self, messages: list[dict[str, Any]]) -> list[ImagePart]:
        parts: list[ImagePart] = []
        for message in messages:
            content = message.get("content")
            if not isinstance(content, list):
                continue
            for part in content:
                if part.get("type") in IMAGE_PART_TYPES:
                    parts.append(ImagePart(self._load(part), part.get("uuid")))
        return parts

    def _load(self, part: dict[str, Any]):
        spec = part.get("image_url") or {}
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str):
            raise MultimodalInputError("an image part needs image_url.url")
        try:
            return load_image(url, self.media)
        except MediaError as exc:
            raise MultimodalInputError(str(exc)) from exc

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Image parts become `{"type": "image"}`, which the chat template renders as one image token."""
        out = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                content = [{"type": "image"} if p.get("type") in IMAGE_PART_TYPES else p for p in content]
            out.append({**message, "content": content})
        return out

    def build(self, messages: list[dict[str, Any]], ec_sources: dict[str, ECSource], **template: Any
              ) -> tuple[list[int], list[MultiModalItem]]:
        parts = self.image_parts(messages)
        token_ids = self.tokenizer.encode_chat(self.template_messages(messages), **template)
        fingerprint = self.processor.settings_fingerprint()
        hashes = [mm_hash_of(p, fingerprint) for p in parts]
        pixels = [self.processor(p.image) for p in parts]
        try:
            token_ids, items = expand_placeholders(token_ids, self.image_token_id, self.tokens_per_image, hashes, pixels)
        except PlaceholderError as exc:
            raise MultimodalInputError(str(exc)) from exc
        apply_ec_params(items, ec_sources)
        return token_ids, items
