"""vLLM's KV cache in device memory (CUDA vLLM), as far as it can be checked on a host without a GPU.

No test here moves a byte of device memory: that path is written and unverified. What runs is every piece of
real code the device path goes through before NIXL moves bytes: a cache described by addresses alone (a meta
tensor, or (address, stride) descriptions named as on cuda), the planes that copy through the host refusing it,
NIXL itself asked to register VRAM (and this host's UCX, built without CUDA, saying so), the device checksums
(torch ops, run here on host tensors, against a pure Python oracle of the same sums), and the compatibility hash
that keeps a device cache from pairing with a host one.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from server_utils import data_planes

from pdserve.kv_transfer.data_plane import DATA_PLANES, DataPlaneError, make_data_plane
from pdserve.kv_transfer.data_plane.nixl_agent import descriptors, memory_kind
from pdserve.kv_transfer.data_plane.one_sided import KvLayout
from pdserve.kv_transfer.data_plane.regions import BlockRegions
from pdserve.kv_transfer.integrity import block_checksums, invalid_blocks

BLOCKS, LAYERS, LAYER_BYTES = 5, 3, 64
CUDA1 = torch.device("cuda", 1)


def meta_caches() -> dict[str, torch.Tensor]:
    """vLLM's per-layer caches, `[blocks, heads, block_size, 2 * head_dim]`, with no memory behind them."""
    return {f"model.layers.{i}.self_attn.attn": torch.empty(BLOCKS, 2, 16, 16, dtype=torch.bfloat16, device="meta")
            for i in range(LAYERS)}


def host_layers(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (BLOCKS, LAYER_BYTES), dtype=torch.uint8, generator=generator)
            for _ in range(LAYERS)]


def device_style(layers: list[torch.Tensor], device: torch.device = torch.device("cpu")) -> BlockRegions:
    """Regions that reach their bytes only through `[blocks, layer_bytes]` tensors, as a GPU cache's do."""
    return BlockRegions.described([(t.data_ptr(), LAYER_BYTES) for t in layers], LAYER_BYTES, BLOCKS, device,
                                  layers)


def oracle(layers: list[torch.Tensor], block: int) -> int:
    """The device checksum in Python integers: per block, its little-endian 32-bit words in layer order, summed
    with weights (position * multiplier mod p) + 1, modulo p = 2^31 - 1, for two multipliers."""
    data = b"".join(bytes(t[block].tolist()) for t in layers)
    words = [int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data), 4)]
    p = 2**31 - 1
    sums = [sum(w * ((i * m) % p + 1) for i, w in enumerate(words)) % p for m in (48271, 69621)]
    return (sums[0] << 31) | sums[1]


def test_a_device_cache_is_described_by_address_only():
    """A meta tensor (no memory, as a CUDA tensor is to the host) gives regions with no host byte view; a CUDA
    cache described by addresses gives the per (block, layer) layout and VRAM descriptors on its own GPU."""
    regions = BlockRegions.from_layers(list(meta_caches().values()))
    assert (regions.device.type, regions.num_layers, regions.num_blocks) == ("meta", LAYERS, BLOCKS)
    assert regions.layer_bytes == 2 * 16 * 16 * 2 and regions.device_layers[0].shape == (BLOCKS, regions.layer_bytes)
    with pytest.raises(DataPlaneError, match="no host byte view"):
        regions.spans([0, 1], None)

    bases = [1 << 30, 1 << 31, 3 << 30]
    layout = KvLayout.of(BlockRegions.described([(b, LAYER_BYTES) for b in bases], LAYER_BYTES, BLOCKS, CUDA1),
                         CUDA1)
    assert layout.device == CUDA1 and not layout.contiguous
    assert layout.memory() == [(b, BLOCKS * LAYER_BYTES) for b in bases]
    assert layout.start(3, 2) == bases[2] + 3 * LAYER_BYTES
    assert KvLayout.from_wire(layout.wire()) == layout  # the peer learns it is on cuda:1
    kind, device_id = memory_kind(layout.device)
    table = descriptors(layout.layer_starts(), layout.layer_bytes, device_id)
    assert kind == "VRAM" and table.shape == (BLOCKS * LAYERS, 3) and set(table[:, 2]) == {1}
    assert table[3 * LAYERS + 2].tolist() == [bases[2] + 3 * LAYER_BYTES, LAYER_BYTES, 1]


@pytest.mark.core
@pytest.mark.parametrize("plane", data_planes("tcp", "shm", "mooncake"))
def test_planes_that_copy_through_the_host_refuse_a_device_cache(plane):
    regions = BlockRegions.described([(1 << 30, LAYER_BYTES)], LAYER_BYTES, BLOCKS, CUDA1)
    with pytest.raises(DataPlaneError, match=f"the {plane} data plane copies KV through host memory and cannot "
                                             "serve a KV cache on cuda:1; use the nixl data plane"):
        make_data_plane(plane, "127.0.0.1").attach_regions(regions)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a UCX built without CUDA answers")
def test_nixl_is_asked_to_register_a_cuda_cache_as_vram(capfd):
    """Real NIXL, real memory: the same host bytes register when described as host memory, and are refused when
    described as on a GPU, because NIXL is asked for VRAM there (its log says so) and this UCX has no CUDA."""
    if "nixl" not in DATA_PLANES:
        pytest.fail("NIXL is not installed")
    layers = host_layers()
    host = make_data_plane("nixl", "127.0.0.1")
    host.attach_regions(BlockRegions.from_layers(layers))
    assert host.layout.device.type == "cpu"
    capfd.readouterr()
    with pytest.raises(DataPlaneError, match="nixl memory registration failed"):
        make_data_plane("nixl", "127.0.0.1").attach_regions(device_style(layers, torch.device("cuda", 0)))
    assert "VRAM" in capfd.readouterr().err


def test_device_checksums_match_their_oracle_and_catch_damage():
    """The torch-op checksums (run here on host tensors; on a GPU they run where the cache lies) equal the Python
    oracle, words of all ones included (no int64 overflow), and catch a damaged byte and two swapped words."""
    layers = host_layers()
    layers[1][4].fill_(0xFF)
    regions = device_style(layers)
    sums = block_checksums(regions, list(range(BLOCKS)))
    assert sums == [oracle(layers, b) for b in range(BLOCKS)] and len(set(sums)) == BLOCKS
    assert block_checksums(device_style([t.clone() for t in layers]), [3, 0]) == [sums[3], sums[0]]

    before = [t[2].clone() for t in layers]
    regions.fill(2, 0xA5, LAYER_BYTES + 1)  # what fault injection does: the block's first bytes overwritten
    assert torch.all(layers[0][2] == 0xA5) and layers[1][2][0] == 0xA5
    assert torch.equal(layers[1][2][1:], before[1][1:]) and torch.equal(layers[2][2], before[2])
    assert invalid_blocks(regions, list(range(BLOCKS)), sums) == [2]
    words = layers[2][1].view(torch.int32)
    words[[0, 5]] = words[[5, 0]].clone()
    assert invalid_blocks(regions, [1, 3], [sums[1], sums[3]]) == [1]


# The worker side imports with vLLM (its package is vLLM's to import), so it runs in vLLM's venv; no vLLM starts.
WORKER = """
import json, torch
from pdserve.integrations.vllm.settings import Settings
from pdserve.integrations.vllm.worker import VllmWorkerSide, plane_names, vllm_compat_hash
from pdserve.kv_transfer.data_plane import DATA_PLANES

def settings(**extra):
    return Settings(kv_cfg={}, extra=extra, engine_id="e", host="127.0.0.1", port=1, block_size=16, max_blocks=8,
                    policy="recompute", model="m")

def caches(device):
    return {f"model.layers.{i}.self_attn.attn": torch.empty(5, 2, 16, 16, dtype=torch.bfloat16, device=device)
            for i in range(3)}

out = {"meta": vllm_compat_hash(settings(), "0.32", caches("meta")),
       "meta_again": vllm_compat_hash(settings(), "0.32", caches("meta")),
       "cpu": vllm_compat_hash(settings(), "0.32", caches("cpu")), "installed": sorted(DATA_PLANES),
       "auto_cpu": plane_names("auto", torch.device("cpu"))}
try:
    out["auto_cuda"] = plane_names("auto", torch.device("cuda", 1))
except ValueError as exc:
    out["auto_cuda"] = str(exc)
worker = VllmWorkerSide(settings(data_plane="tcp"))
try:
    worker.register_kv_caches(caches("meta"), "0.32")
except Exception as exc:
    out["tcp"] = f"{type(exc).__name__}: {exc}"
out["agent"] = worker.agent is not None
print(json.dumps(out))
"""


@pytest.mark.vllm
def test_the_worker_serves_a_device_cache_by_nixl_under_a_hash_naming_the_device():
    """A device cache's compatibility hash differs from a host cache's of the same shape (they never pair by
    opaque copy) and is stable; "auto" serves a device cache by nixl alone; a plane named explicitly refuses it
    when vLLM registers the cache, saying which plane can, and no agent starts."""
    from vllm_live import pdserve_path, vllm_venv

    result = subprocess.run([str(vllm_venv() / "bin" / "python"), "-c", WORKER], capture_output=True, text=True,
                            timeout=300, check=True, env={**os.environ, "PYTHONPATH": pdserve_path()})
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["meta"] == out["meta_again"] != out["cpu"]
    assert out["auto_cpu"] == [p for p in ("shm", "tcp", "nixl") if p in out["installed"]]
    if "nixl" in out["installed"]:
        assert out["auto_cuda"] == ["nixl"]
    else:
        assert "needs the nixl data plane" in out["auto_cuda"]
    assert out["tcp"].startswith("DataPlaneError: the tcp data plane copies KV through host memory and cannot "
                                 "serve a KV cache on meta") and not out["agent"]
