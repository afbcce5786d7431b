"""What a model builder returns: the parsed text config, the decoder, and (for multimodal models) the vision
part. Its own module so that every builder can return it without importing the registry that lists them."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.models.config import TextModelConfig
from pdserve.models.llama import LlamaForCausalLM


@dataclass(slots=True)
class LoadedModel:
    text_config: TextModelConfig
    model: LlamaForCausalLM
    # Set for multimodal architectures (LLaVA): the vision tower and projector.
    vision: object | None = None
