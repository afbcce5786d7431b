"""Shared fixtures for the engine tests: tiny models built once per session, engines that must end clean.

Every test runs single-threaded (the CI machine has two cores and pytest runs one test at a time).
Engines made through `make_llm` are checked at teardown: a test that leaves a KV block referenced fails,
so block leaks show up in whichever test causes them.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.launcher import start_command
from pdserve.llm import LLM
from pdserve.modelgen import make_text_model

torch.set_num_threads(1)

# Planes run for breadth: in each suite parametrised over data planes they run only the cases marked `core`,
# which exercise the plane end to end (pull, push, concurrency, faults, refusals) at a fraction of the suite's time.
BREADTH_PLANES = {"mooncake"}


# Fixtures of these scopes are made once per worker that runs a test needing them: such tests run in one worker.
SHARED_SCOPES = {"package", "module", "class"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the xdist_group marks added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def breadth_only(item: pytest.Item) -> bool:
        params = getattr(item, "callspec", None)
        on_breadth_plane = params is not None and any(v in BREADTH_PLANES for v in params.params.values()
                                                      if isinstance(v, str))
        return on_breadth_plane and item.get_closest_marker("core") is None

    dropped = [item for item in items if breadth_only(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not breadth_only(item)]
    for item in items:
        group_shared_fixtures(item)


def group_shared_fixtures(item: pytest.Item) -> None:
    """Put a test that uses a module- or class-scoped fixture in its file's xdist group, so that under
    `--dist loadgroup` one worker runs the whole file and the fixture's servers start once, not once per worker.
    A test marked with an xdist_group of its own keeps that group (several files can share one that way)."""
    if item.get_closest_marker("xdist_group") is not None:
        return
    info = getattr(item, "_fixtureinfo", None)
    if info is not None and any(defs[-1].scope in SHARED_SCOPES for defs in info.name2fixturedefs.values()):
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


# Small enough to keep every engine cheap to build (the default budget zeroes ~0.5 GiB of KV cache).
DEFAULT_ENGINE_KWARGS: dict[str, Any] = {"num_kv_blocks": 256, "max_model_len": 512, "seed": 0}


@pytest.fixture(autouse=True)
def _single_thread() -> None:
    torch.set_num_threads(1)


def assert_no_blocks_in_use(engine: LLMEngine) -> None:
    """Every KV block is back in the pool (prefix-cached blocks keep their contents, but no references)."""
    assert not engine.has_unfinished_requests(), "requests are still running"
    assert engine.kv.num_used_blocks == 0, f"{engine.kv.num_used_blocks} KV blocks still referenced"
    assert not engine.kv.req_blocks, f"block tables left for {list(engine.kv.req_blocks)}"


@pytest.fixture(name="assert_no_blocks_in_use")
def _assert_no_blocks_in_use_fixture() -> Callable[[LLMEngine], None]:
    return assert_no_blocks_in_use


class ModelFactory:
    """Builds each distinct tiny model once per session (make_text_model is byte-identical per args)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.built: dict[str, Path] = {}

    def __call__(self, arch: str, *, num_shards: int = 1, dtype: str = "float32",
                 rope_scaling: dict[str, Any] | None = None) -> Path:
        key = json.dumps([arch, num_shards, dtype, rope_scaling], sort_keys=True)
        if key not in self.built:
            out = self.root / f"{arch}-{len(self.built)}"
            self.built[key] = make_text_model(arch, out, num_shards=num_shards, dtype=dtype,
                                              rope_scaling=rope_scaling)
        return self.built[key]

    def variant(self, base: Path, name: str, edit: Callable[[Path], None]) -> Path:
        """A copy of `base` changed by `edit` (e.g. a rewritten config file), built once per name."""
        key = f"variant:{base}:{name}"
        if key not in self.built:
            out = self.root / f"variant-{len(self.built)}-{name}"
            shutil.copytree(base, out)
            edit(out)
            self.built[key] = out
        return self.built[key]


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> ModelFactory:
    return ModelFactory(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def llama_dir(models: ModelFactory) -> Path:
    return models("llama")


@pytest.fixture
def make_llm() -> Iterator[Callable[..., LLM]]:
    """LLM(model_dir, **kwargs) with small defaults; at teardown every engine it made must hold no blocks."""
    made: list[LLM] = []

    def make(model_dir: Path, **kwargs: Any) -> LLM:
        llm = LLM(str(model_dir), **{**DEFAULT_ENGINE_KWARGS, **kwargs})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert_no_blocks_in_use(llm.engine)


def random_prompt(length: int, seed: int, vocab: int = 4096) -> list[int]:
    """Reproducible ordinary-token ids (special tokens live at 4096 and above)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


@pytest.fixture(scope="session")
def hf_models() -> Callable[[Path, torch.dtype], torch.nn.Module]:
    """Hugging Face reference models, loaded once per (folder, dtype)."""
    from transformers import AutoModelForCausalLM

    cache: dict[tuple[str, torch.dtype], torch.nn.Module] = {}

    def load(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        key = (str(model_dir), dtype)
        if key not in cache:
            cache[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        return cache[key]

    return load


@pytest.fixture()
def recorded(tmp_path: Path):
    """Recording fake vLLM instances (tests/fake_vllm.py): yields (start a fake by name, what a fake received).

    A fake started again under the same name (after a kill) keeps appending to the same record.
    """
    procs = []
    fake = str(Path(__file__).with_name("fake_vllm.py"))

    def start_fake(name: str, *extra: str):
        procs.append(start_command(name, [sys.executable, fake, "--record", str(tmp_path / f"{name}.jsonl"), *extra]))
        return procs[-1]

    def received(name: str) -> list[dict]:
        path = tmp_path / f"{name}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    yield start_fake, received
    for proc in procs:
        proc.stop()
