"""LLaVA: the offline generator, image preprocessing, vision encoder and end-to-end generation, all checked
against transformers 5.23 as the oracle (LlavaForConditionalGeneration, LlavaProcessor with
CLIPImageProcessorPil).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
import transformers
from transformers.image_transforms import center_crop as hf_center_crop

from pdserve.layers.attention import AttentionMetadata, PrefillChunk
from pdserve.modelgen.cli import main as cli_main
from pdserve.modelgen.llava import (
    IMAGE_TOKEN,
    LAYOUTS,
    checkpoint_name,
    llava_parameter_shapes,
    make_llava_model,
)
from pdserve.models.config import ModelConfigError
from pdserve.models.image_processor import (
    ClipImageProcessor,
    ClipImageSettings,
    center_crop,
    load_image_processor,
)
from pdserve.models.llama import ForwardContext, LlamaForCausalLM, NoHooks
from pdserve.models.llava import LlavaVision
from pdserve.models.registry import LoadedModel, load_model

NEW_TOKENS = 16
BLOCK_SIZE = 16
MAX_POSITIONS = 512


@pytest.fixture(autouse=True)
def single_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llava_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llava")
    return {layout: make_llava_model(root / layout, vision_layout=layout) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def hf_model(llava_dirs: dict[str, Path]) -> transformers.LlavaForConditionalGeneration:
    return load_hf_model(llava_dirs["hf5"])


@pytest.fixture(scope="module")
def processor(llava_dirs: dict[str, Path]):  # -> transformers LlavaProcessor
    return transformers.AutoProcessor.from_pretrained(llava_dirs["hf5"])


@pytest.fixture(scope="module")
def ours(llava_dirs: dict[str, Path]) -> LoadedModel:
    return load_model(llava_dirs["hf5"], torch.float32, torch.device("cpu"), MAX_POSITIONS)


def load_hf_model(model_dir: Path) -> transformers.LlavaForConditionalGeneration:
    # Through the package's lazy attributes: transformers' model and image-processor modules cost ~3 CPU-s to
    # import, which every pytest-xdist worker would pay collecting this file, though only one runs it.
    model, info = transformers.LlavaForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[kind], (kind, info[kind])
    return model.eval()


def vision_of(loaded: LoadedModel) -> LlavaVision:
    assert isinstance(loaded.vision, LlavaVision)
    return loaded.vision


def file_digests(directory: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())}


def random_image(seed: int, height: int, width: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    image = Image.fromarray(pixels[..., 0] if channels == 1 else pixels)  # the array's shape picks the mode
    assert image.mode == mode
    return image


# Sizes around the 32-pixel input: upscaled, downscaled, extreme aspect ratios both ways, exact size.
TEST_IMAGES: list[tuple[int, int, int, str]] = [
    (1, 48, 64, "RGB"), (2, 100, 37, "RGB"), (3, 32, 32, "RGB"), (4, 7, 5, "RGB"), (5, 300, 20, "RGB"),
    (6, 21, 90, "RGB"), (7, 45, 45, "L"), (8, 40, 70, "RGBA"),
]


def sample_images() -> list[Image.Image]:
    return [random_image(*spec) for spec in TEST_IMAGES]


# ----------------------------------------------------------------------------- (a) generator


@pytest.mark.parametrize("layout", LAYOUTS)
def test_build_is_byte_identical(tmp_path: Path, layout: str) -> None:
    first = file_digests(make_llava_model(tmp_path / "a", vision_layout=layout))
    second = file_digests(make_llava_model(tmp_path / "b", vision_layout=layout))
    assert first == second
    assert {"config.json", "model.safetensors", "processor_config.json", "tokenizer.json"} <= set(first)


def test_layouts_hold_the_same_tensors_and_seed_matters(llava_dirs: dict[str, Path], tmp_path: Path) -> None:
    hf5 = load_file(llava_dirs["hf5"] / "model.safetensors")
    hub = load_file(llava_dirs["hub"] / "model.safetensors")
    assert set(hf5) == set(llava_parameter_shapes())
    assert any(name.startswith("vision_tower.vision_model.") for name in hub)
    for name, tensor in hf5.items():
        assert torch.equal(hub[checkpoint_name(name, "hub")], tensor), name
    reseeded = load_file(make_llava_model(tmp_path / "s1", seed=1) / "model.safetensors")
    assert not torch.equal(reseeded["lm_head.weight"], hf5["lm_head.weight"])


def test_cli_builds_llava(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "cli"
    assert cli_main(["make-model", "--arch", "llava", "--vision-layout", "hub", str(out_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(out_dir)
    assert json.loads((out_dir / "config.json").read_text())["model_type"] == "llava"
    assert cli_main(["make-model", "--arch", "llava", "--shards", "2", str(tmp_path / "bad")]) != 0


# ----------------------------------------------------------------------------- (b) transformers compatibility


@pytest.mark.parametrize("layout", LAYOUTS)
def test_transformers_loads_every_tensor(llava_dirs: dict[str, Path], layout: str) -> None:
    model = load_hf_model(llava_dirs[layout])
    state = model.state_dict()
    checkpoint = load_file(llava_dirs[layout] / "model.safetensors")
    for name in llava_parameter_shapes():
        assert torch.equal(state[name], checkpoint[checkpoint_name(name, layout)]), name


def test_config_is_what_transformers_writes(llava_dirs: dict[str, Path], tmp_path: Path) -> None:
    transformers.AutoConfig.from_pretrained(llava_dirs["hf5"]).save_pretrained(tmp_path)
    resaved = json.loads((tmp_path / "config.json").read_text())
    ours = json.loads((llava_dirs["hf5"] / "config.json").read_text())
    resaved.pop("transformers_version")
    ours.pop("image_token_id")  # our extra spelling; transformers maps it onto image_token_index
    assert ours == resaved


def test_processor_and_chat_template(llava_dirs: dict[str, Path], processor, tmp_path: Path) -> None:
    assert type(processor).__name__ == "LlavaProcessor"
    assert type(processor.image_processor).__name__ == "CLIPImageProcessorPil"
    tokenizer = processor.tokenizer
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    config = json.loads((llava_dirs["hf5"] / "config.json").read_text())
    assert image_token_id == config["image_token_index"] == len(tokenizer) - 1
    assert config["text_config"]["vocab_size"] == len(tokenizer)
    processor.save_pretrained(tmp_path)
    resaved = json.loads((tmp_path / "processor_config.json").read_text())
    assert resaved == json.loads((llava_dirs["hf5"] / "processor_config.json").read_text())

    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Look: "}, {"type": "image"},
        {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "?"}]}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = f"<|im_start|>user\nLook: {IMAGE_TOKEN}{IMAGE_TOKEN}?<|im_end|>\n<|im_start|>assistant\n"
    assert rendered == expected


def test_pdserve_loads_what_transformers_saves(llava_dirs: dict[str, Path],
                                               hf_model: transformers.LlavaForConditionalGeneration, ours: LoadedModel,
                                               tmp_path: Path) -> None:
    # A model transformers 5.23 built itself (not loaded) is saved in a third mix: hub names, except that the
    # vision tower is plain `vision_tower.*`. (A loaded model is saved back in the names it was loaded from.)
    fresh = transformers.LlavaForConditionalGeneration(hf_model.config)
    fresh.load_state_dict(hf_model.state_dict())
    fresh.save_pretrained(tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"language_model.lm_head.weight", "vision_tower.pre_layrnorm.weight"} <= names
    # No processor files were saved: the image settings fall back to CLIP's defaults at the tower's size.
    resaved = vision_of(load_model(tmp_path, torch.float32, torch.device("cpu"), MAX_POSITIONS))
    fingerprint = vision_of(ours).image_processor.settings_fingerprint()
    assert resaved.image_processor.settings_fingerprint() == fingerprint
    pixels = torch.stack([vision_of(ours).image_processor(image) for image in sample_images()[:2]])
    assert torch.equal(resaved.encode(pixels), vision_of(ours).encode(pixels))


def test_unknown_tensors_are_refused(llava_dirs: dict[str, Path], tmp_path: Path) -> None:
    model_dir = shutil.copytree(llava_dirs["hf5"], tmp_path / "extra")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.image_newline"] = torch.zeros(128)
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(ModelConfigError, match="image_newline"):
        load_model(model_dir, torch.float32, torch.device("cpu"), MAX_POSITIONS)


# ----------------------------------------------------------------------------- (c) image preprocessing


def test_preprocessing_matches_transformers(ours: LoadedModel, processor) -> None:
    images = sample_images()
    expected = processor.image_processor(images, return_tensors="pt").pixel_values
    got = torch.stack([vision_of(ours).image_processor(image) for image in images])
    assert got.dtype == torch.float32 and got.shape == expected.shape == (len(images), 3, 32, 32)
    assert (got - expected).abs().max().item() <= 1e-6


def test_preprocessing_with_exact_resize_and_padding_crop_matches_transformers() -> None:
    # A fixed-size resize smaller than the crop exercises the zero-padding branch of center crop.
    settings = {"size": {"height": 20, "width": 40}, "crop_size": {"height": 32, "width": 24},
                "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.25, 0.3], "rescale_factor": 1 / 255}
    ours = ClipImageProcessor(ClipImageSettings.from_hf(settings))
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    reference = CLIPImageProcessorPil(**settings)
    images = sample_images()
    expected = reference(images, return_tensors="pt").pixel_values
    got = torch.stack([ours(image) for image in images])
    assert (got - expected).abs().max().item() <= 1e-6


@pytest.mark.parametrize("shape,crop", [((3, 9, 12), (5, 4)), ((3, 4, 7), (6, 6)), ((3, 5, 8), (9, 3))])
def test_center_crop_matches_transformers(shape: tuple[int, int, int], crop: tuple[int, int]) -> None:
    image = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    np.testing.assert_array_equal(center_crop(image, *crop), hf_center_crop(image, crop))


def test_settings_fingerprint_is_stable_and_sensitive(llava_dirs: dict[str, Path]) -> None:
    first = load_image_processor(llava_dirs["hf5"]).settings_fingerprint()
    assert first == load_image_processor(llava_dirs["hub"]).settings_fingerprint()
    changed = ClipImageSettings.from_hf({"size": {"shortest_edge": 32}, "crop_size": 32, "image_std": 0.5})
    assert ClipImageProcessor(changed).settings_fingerprint() != first


# ----------------------------------------------------------------------------- (d) vision encoder


@pytest.mark.parametrize("layout", LAYOUTS)
def test_encode_matches_get_image_features(llava_dirs: dict[str, Path],
                                           hf_model: transformers.LlavaForConditionalGeneration, processor,
                                           layout: str) -> None:
    vision = vision_of(load_model(llava_dirs[layout], torch.float32, torch.device("cpu"), MAX_POSITIONS))
    config = json.loads((llava_dirs[layout] / "config.json").read_text())
    assert vision.image_token_id == config["image_token_index"]
    assert vision.num_image_tokens == vision.image_seq_length == config["image_seq_length"]
    pixels = processor.image_processor(sample_images()[:3], return_tensors="pt").pixel_values
    with torch.no_grad():
        expected = torch.stack(hf_model.get_image_features(pixel_values=pixels).pooler_output)
    got = vision.encode(pixels)
    assert got.shape == expected.shape == (3, vision.num_image_tokens, config["text_config"]["hidden_size"])
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("feature_layer,strategy", [(-1, "full"), (0, "default"), (-3, "full")])
def test_encode_follows_feature_layer_and_strategy(llava_dirs: dict[str, Path], processor, tmp_path: Path,
                                                   feature_layer: int, strategy: str) -> None:
    model_dir = shutil.copytree(llava_dirs["hf5"], tmp_path / "variant")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy)
    (model_dir / "config.json").write_text(json.dumps(config))
    vision = vision_of(load_model(model_dir, torch.float32, torch.device("cpu"), MAX_POSITIONS))
    pixels = processor.image_processor(sample_images()[:2], return_tensors="pt").pixel_values
    with torch.no_grad():
        # output_hidden_states=True: transformers 5.23 turns vision_feature_layer=0 into
        # output_hidden_states=0, which reads as "off", and then fails on hidden_states=None.
        features = load_hf_model(model_dir).get_image_features(pixel_values=pixels, output_hidden_states=True)
    expected = torch.stack(features.pooler_output)
    patches = (config["vision_config"]["image_size"] // config["vision_config"]["patch_size"]) ** 2
    assert vision.num_image_tokens == expected.shape[1] == patches + (strategy == "full")
    assert (vision.encode(pixels) - expected).abs().max().item() <= 1e-4


# ----------------------------------------------------------------------------- (e) end to end


@dataclass
class PagedLlama:
    """Drives pdserve's LlamaForCausalLM as the model runner does: one prefill chunk, then decode steps."""

    model: LlamaForCausalLM
    kv_cache: torch.Tensor
    block_ids: list[int]

    @classmethod
    def create(cls, loaded: LoadedModel, max_tokens: int) -> PagedLlama:
        cfg = loaded.text_config
        num_blocks = -(-max_tokens // BLOCK_SIZE)
        kv_cache = torch.zeros(num_blocks, cfg.num_layers, 2, cfg.num_kv_heads, BLOCK_SIZE, cfg.head_dim)
        # Blocks in reverse order, so a mix-up of logical and physical blocks would show.
        return cls(loaded.model, kv_cache, list(reversed(range(num_blocks))))

    def slots(self, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor([self.block_ids[p // BLOCK_SIZE] for p in positions]),
                torch.tensor([p % BLOCK_SIZE for p in positions]))

    def run(self, positions: range, attn: AttentionMetadata, input_ids: torch.Tensor | None = None,
            inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        ctx = ForwardContext(attn=attn, kv_cache=self.kv_cache, hooks=NoHooks())
        with torch.inference_mode():
            hidden = self.model.forward(input_ids, torch.tensor(list(positions)), ctx,
                                        inputs_embeds=inputs_embeds)
            return self.model.compute_logits(hidden)

    def prefill(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """Logits at every prompt position."""
        positions = range(inputs_embeds.shape[0])
        slot_block, slot_offset = self.slots(positions)
        covered = torch.tensor(self.block_ids[: -(-len(positions) // BLOCK_SIZE)])
        chunk = PrefillChunk(0, len(positions), 0, covered)
        attn = AttentionMetadata(slot_block, slot_offset, prefills=[chunk])
        return self.run(positions, attn, inputs_embeds=inputs_embeds)

    def decode(self, token_id: int, position: int) -> torch.Tensor:
        slot_block, slot_offset = self.slots(range(position, position + 1))
        num_blocks = position // BLOCK_SIZE + 1
        visible = torch.arange(num_blocks * BLOCK_SIZE) <= position
        bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf")).view(1, 1, 1, -1)
        table = torch.tensor([self.block_ids[:num_blocks]])
        attn = AttentionMetadata(slot_block, slot_offset, num_decode_tokens=1, decode_block_table=table,
                                 decode_bias=bias)
        return self.run(range(position, position + 1), attn, input_ids=torch.tensor([token_id]))[0]


def expand_image_placeholders(token_ids: list[int], image_token_id: int, tokens_per_image: int) -> list[int]:
    """pdserve's side of the contract: the chat template emits one <image> per image, pdserve expands it."""
    expanded: list[int] = []
    for token in token_ids:
        expanded.extend([token] * (tokens_per_image if token == image_token_id else 1))
    return expanded


def multimodal_embeds(loaded: LoadedModel, token_ids: list[int], pixel_values: torch.Tensor) -> torch.Tensor:
    vision = vision_of(loaded)
    ids = torch.tensor(token_ids)
    embeds = loaded.model.embed(ids).clone()
    features = vision.encode(pixel_values)  # [images, tokens per image, hidden], images in prompt order
    is_image = ids == vision.image_token_id
    assert int(is_image.sum()) == features.shape[0] * features.shape[1]
    embeds[is_image] = features.reshape(-1, features.shape[-1])
    return embeds


def greedy(logits: torch.Tensor, banned: tuple[int, ...]) -> int:
    # transformers' min_new_tokens masks EOS the same way, so both sides always produce NEW_TOKENS tokens.
    masked = logits.clone()
    masked[list(banned)] = float("-inf")
    return int(masked.argmax())


def pdserve_generate(loaded: LoadedModel, token_ids: list[int], pixel_values: torch.Tensor,
                     ) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """(prompt logits, greedy tokens, logits of each generated step)."""
    runner = PagedLlama.create(loaded, len(token_ids) + NEW_TOKENS)
    prompt_logits = runner.prefill(multimodal_embeds(loaded, token_ids, pixel_values))
    step_logits = [prompt_logits[-1]]
    tokens: list[int] = []
    for step in range(NEW_TOKENS):
        tokens.append(greedy(step_logits[-1], loaded.text_config.eos_token_ids))
        if step + 1 < NEW_TOKENS:
            step_logits.append(runner.decode(tokens[-1], len(token_ids) + step))
    return prompt_logits, tokens, step_logits


def prompt_with_images(num_images: int) -> list[dict]:
    content: list[dict] = [{"type": "text", "text": "Describe"}]
    for index in range(num_images):
        content += [{"type": "text", "text": f" picture {index}: "}, {"type": "image"}]
    return [{"role": "user", "content": content + [{"type": "text", "text": " in a few words."}]}]


def assert_logprobs_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    difference = (torch.log_softmax(got.float(), -1) - torch.log_softmax(expected.float(), -1)).abs().max()
    assert difference.item() <= 1e-3, difference.item()


@pytest.mark.parametrize("num_images", [1, 2])
def test_generation_matches_transformers(ours: LoadedModel, hf_model: transformers.LlavaForConditionalGeneration,
                                         processor, num_images: int) -> None:
    images = [random_image(10 + i, 40 + 13 * i, 64 - 9 * i) for i in range(num_images)]
    text = processor.tokenizer.apply_chat_template(prompt_with_images(num_images), tokenize=False,
                                                   add_generation_prompt=True)
    inputs = processor(text=text, images=images, return_tensors="pt")
    vision = vision_of(ours)
    token_ids = expand_image_placeholders(processor.tokenizer.encode(text), vision.image_token_id,
                                          vision.num_image_tokens)
    assert token_ids == inputs.input_ids[0].tolist()  # transformers expands <image> to the same tokens

    pixel_values = torch.stack([vision.image_processor(image) for image in images])
    prompt_logits, tokens, step_logits = pdserve_generate(ours, token_ids, pixel_values)
    with torch.no_grad():
        expected_prompt_logits = hf_model(**inputs).logits[0]
        generated = hf_model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                      do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert tokens == generated.sequences[0, len(token_ids):].tolist()
    assert len(set(tokens)) >= 4, tokens  # a real continuation, not one repeated token
    assert_logprobs_close(prompt_logits, expected_prompt_logits)
    for got, expected in zip(step_logits, generated.logits, strict=True):
        assert_logprobs_close(got, expected[0])


def test_the_image_changes_the_output(ours: LoadedModel, processor) -> None:
    # Guards the comparison above: if both sides ignored the image, they would still agree.
    vision = vision_of(ours)
    text = processor.tokenizer.apply_chat_template(prompt_with_images(1), tokenize=False,
                                                   add_generation_prompt=True)
    token_ids = expand_image_placeholders(processor.tokenizer.encode(text), vision.image_token_id,
                                          vision.num_image_tokens)

    def next_token_logits(image: Image.Image) -> torch.Tensor:
        embeds = multimodal_embeds(ours, token_ids, vision.image_processor(image)[None])
        return PagedLlama.create(ours, len(token_ids)).prefill(embeds)[-1]

    first, second = next_token_logits(random_image(20, 32, 32)), next_token_logits(random_image(21, 32, 32))
    assert (first - second).abs().max().item() > 1.0


def test_list_feature_layers_are_refused(llava_dirs: dict[str, Path]) -> None:
    from pdserve.models.llava import LlavaConfig

    config = json.loads((llava_dirs["hf5"] / "config.json").read_text())
    with pytest.raises(ModelConfigError, match="single layer"):
        LlavaConfig.from_hf({**config, "vision_feature_layer": [-2, -1]})


def test_bfloat16_encode_stays_close(llava_dirs: dict[str, Path], ours: LoadedModel) -> None:
    half = vision_of(load_model(llava_dirs["hf5"], torch.bfloat16, torch.device("cpu"), MAX_POSITIONS))
    pixels = torch.stack([half.image_processor(image) for image in sample_images()[:2]])
    got = half.encode(pixels)
    assert got.dtype == torch.bfloat16
    reference = vision_of(ours).encode(pixels)
    relative = (got.float() - reference).norm() / reference.norm()
    assert relative.item() < 0.05

