"""Encoder disaggregation (E→P→D) on a tiny LLaVA: equals colocated, encodes each image once, recovers by local
recompute from every kind of EC failure (or fails clearly under `fail`), and leaves nothing held."""

from __future__ import annotations

import base64
import io
import json
import shutil
import struct
import zlib

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from pdserve.launcher import start, start_instance, stop_all
from server_utils import metric_values, wait_until_idle

COMMON = ["--max-model-len", "512", "--num-kv-blocks", "128", "--served-model-name", "llava"]


def image(seed: int, size=(40, 30)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(seeds: list[int], text: str = "describe", **extra) -> dict:
    content = [{"type": "text", "text": "look:"}]
    content += [{"type": "image_url", "image_url": {"url": data_url(image(s))}} for s in seeds]
    content.append({"type": "text", "text": text})
    return {"model": "llava", "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}


def tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from pdserve.modelgen.llava import make_llava_model

    return make_llava_model(tmp_path_factory.mktemp("llava") / "tiny-llava")


@pytest.fixture(scope="module")
def colocated(llava):
    proc = start_instance(llava, *COMMON, name="C")
    yield proc
    proc.stop()


def test_server_matches_transformers_with_an_image(llava, colocated):
    """The whole path — data URL, preprocessing, placeholder expansion, engine — against HF LLaVA in fp32."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(llava)
    model = LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": [{"type": "text", "text": "look:"}, {"type": "image"},
                                             {"type": "text", "text": "describe"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(images=[image(5)], text=text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    expected = out[0, inputs["input_ids"].shape[1]:].tolist()
    r = httpx.post(colocated.url + "/v1/chat/completions", json=chat([5], max_tokens=12), timeout=60)
    assert r.json()["prompt_token_ids"] == inputs["input_ids"][0].tolist()
    assert tokens(r) == expected


def test_chunked_prefill_through_an_image_equals_one_shot(llava, colocated):
    chunked = start_instance(llava, *COMMON, "--max-num-batched-tokens", "7", name="chunked")
    try:
        body = chat([11, 12])
        assert tokens(httpx.post(chunked.url + "/v1/chat/completions", json=body, timeout=60)) == \
            tokens(httpx.post(colocated.url + "/v1/chat/completions", json=body, timeout=60))
    finally:
        chunked.stop()


def test_media_policy(llava, colocated, tmp_path):
    path = tmp_path / "img.png"
    image(3).save(path)
    for url in ("http://example.invalid/cat.png", str(path), "data:image/png;base64,!!!notbase64"):
        body = chat([])
        body["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": url}})
        r = httpx.post(colocated.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"]
    allowed = start_instance(llava, *COMMON, "--allowed-local-media-path", str(tmp_path), name="local-media")
    try:
        body = chat([])
        body["messages"][0]["content"].insert(1, {"type": "image_url", "image_url": {"url": str(path)}})
        assert httpx.post(allowed.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    finally:
        allowed.stop()


def png_claiming(width: int, height: int) -> str:
    """A PNG data URL whose header claims width x height pixels (its few bytes of image data never decode)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.mark.parametrize("size", [(100_000, 100_000), (9_000, 9_000)])
def test_image_too_large_to_decode_is_refused(colocated, size):
    body = chat([])
    body["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": png_claiming(*size)}})
    r = httpx.post(colocated.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "pixels" in r.json()["error"]["message"]
    assert httpx.get(colocated.url + "/health", timeout=10).status_code == 200


def ec_config(kind: str, role: str, store, **extra) -> str:
    return json.dumps({"ec_connector": kind, "ec_role": role,
                       "ec_connector_extra_config": {"shared_storage_path": str(store), "fetch_timeout": 1.0, **extra}})


def kv(role: str) -> str:
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role})


@pytest.fixture(params=["ECStorageConnector", "ECP2PConnector"])
def epd(request, llava, colocated, tmp_path):
    kind, store = request.param, tmp_path / "ec-store"
    procs = {"C": colocated}
    try:
        procs["E"] = start_instance(llava, *COMMON, "--role", "encode", "--ec-transfer-config",
                                    ec_config(kind, "ec_producer", store), name="E")
        # P keeps one image's encoder output: a test can make it forget one and have to load it again.
        procs["P"] = start_instance(llava, *COMMON, "--kv-transfer-config", kv("kv_producer"),
                                    "--encoder-cache-size", "16",
                                    "--ec-transfer-config", ec_config(kind, "ec_consumer", store), name="P")
        procs["D"] = start_instance(llava, *COMMON, "--kv-transfer-config", kv("kv_consumer"),
                                    "--ec-transfer-config", ec_config(kind, "ec_consumer", store), name="D")
        # Checked at start only: a killed E is found by the requests that reach for it (what the kill test is
        # about), never by a health check that happens to fall between the kill and the next request.
        procs["G"] = start("gateway", ["gateway", "--encode", procs["E"].url, "--prefill", procs["P"].url,
                                       "--decode", procs["D"].url, "--port", "0", "--log-level", "warning",
                                       "--health-check-interval", "600"])
        yield procs, kind, store
    finally:
        for name, proc in procs.items():
            if name != "C":
                proc.stop()


def nothing_held(procs: dict, names=("P", "D", "C")) -> None:
    for name in names:
        idle = wait_until_idle(procs[name].url)
        assert idle["pdserve:encoder_cache_entries_held"] == 0


def both(procs: dict, body: dict) -> tuple[list[int], list[int]]:
    routed = httpx.post(procs["G"].url + "/v1/chat/completions", json=body, timeout=60)
    reference = httpx.post(procs["C"].url + "/v1/chat/completions", json=body, timeout=60)
    return tokens(routed), tokens(reference)


def test_epd_equals_colocated_and_encodes_each_image_once(epd):
    procs, _, _ = epd
    for seeds in ([21], [22, 23, 24], [21, 25]):  # one image, several, and one seen before
        routed, reference = both(procs, chat(seeds))
        assert routed == reference
    assert metric_values(procs["E"].url)["pdserve:encoder_runs_total"] == 5  # 21..25, each once
    gateway = httpx.get(procs["G"].url + "/metrics").text
    assert 'pdserve:gateway_encode_items_total{outcome="cache_hit"} 1.0' in gateway
    p = metric_values(procs["P"].url)
    # P loaded every output it needed (some twice: it keeps only one), and never encoded one itself.
    assert p["pdserve:ec_load_failures_total"] == 0
    assert p["pdserve:ec_loads_total"] == p["pdserve:encoder_cache_misses_total"] >= 5
    nothing_held(procs)


def test_encode_instance_killed_falls_back_to_local_encoding(epd):
    procs, kind, store = epd
    for seeds in ([31], [33]):  # image 33 pushes 31's output out of P's one-image encoder cache
        routed, reference = both(procs, chat(seeds))
        assert routed == reference
    procs["E"].kill()
    if kind == "ECStorageConnector":
        shutil.rmtree(store)  # with E gone, its stored outputs go too
    # The gateway still remembers where image 31's output was; P's load fails and P encodes it itself.
    failures = metric_values(procs["P"].url)["pdserve:ec_load_failures_total"]
    routed, reference = both(procs, chat([31], text="again"))
    assert routed == reference
    assert metric_values(procs["P"].url)["pdserve:ec_load_failures_total"] == failures + 1
    routed, reference = both(procs, chat([32]))  # a new image: no encode instance left, P encodes
    assert routed == reference
    nothing_held(procs)


@pytest.mark.parametrize("damage", ["delete", "corrupt"])
def test_damaged_stored_entry(llava, colocated, tmp_path, damage):
    """Storage connector, without a gateway: E stores, P's load finds the entry gone or damaged."""
    store = tmp_path / "store"
    procs = {"C": colocated}
    try:
        procs["E"] = start_instance(llava, *COMMON, "--role", "encode", "--ec-transfer-config",
                                    ec_config("ECStorageConnector", "ec_producer", store), name="E")
        for policy in ("recompute", "fail"):
            cfg = json.loads(ec_config("ECStorageConnector", "ec_consumer", store))
            cfg["ec_load_failure_policy"] = policy
            procs[policy] = start_instance(llava, *COMMON, "--ec-transfer-config", json.dumps(cfg), name=policy)
        body = chat([41 if damage == "delete" else 42])
        encoded = httpx.post(procs["E"].url + "/v1/chat/completions", json=body, timeout=60).json()
        (mm_hash,) = encoded["ec_transfer_params"]
        entry = store / mm_hash / "encoder_cache.safetensors"
        if damage == "delete":
            entry.unlink()
        else:
            raw = bytearray(entry.read_bytes())
            raw[-40:] = bytes(40)  # damage the tensor's bytes (the checksum must catch it)
            entry.write_bytes(bytes(raw))
        body["ec_transfer_params"] = encoded["ec_transfer_params"]
        reference = tokens(httpx.post(colocated.url + "/v1/chat/completions", json=chat([41 if damage == "delete" else 42]),
                                      timeout=60))
        assert tokens(httpx.post(procs["recompute"].url + "/v1/chat/completions", json=body, timeout=60)) == reference
        failed = httpx.post(procs["fail"].url + "/v1/chat/completions", json=body, timeout=60)
        assert failed.status_code == 500 and "encoder output" in failed.json()["error"]["message"]
        nothing_held(procs, ("recompute", "fail"))
    finally:
        for name, proc in procs.items():
            if name != "C":
                proc.stop()


def test_injected_ec_load_failure_recomputes(llava, colocated, tmp_path):
    store = tmp_path / "store"
    procs = {}
    try:
        procs["E"] = start_instance(llava, *COMMON, "--role", "encode", "--ec-transfer-config",
                                    ec_config("ECStorageConnector", "ec_producer", store), name="E")
        procs["P"] = start_instance(llava, *COMMON, "--ec-transfer-config",
                                    ec_config("ECStorageConnector", "ec_consumer", store,
                                              fault_injection={"read_fail": 1.0}), name="P")
        body = chat([51])
        encoded = httpx.post(procs["E"].url + "/v1/chat/completions", json=body, timeout=60).json()
        reference = tokens(httpx.post(colocated.url + "/v1/chat/completions", json=body, timeout=60))
        r = httpx.post(procs["P"].url + "/v1/chat/completions",
                       json={**body, "ec_transfer_params": encoded["ec_transfer_params"]}, timeout=60)
        assert tokens(r) == reference
        m = metric_values(procs["P"].url)
        assert m["pdserve:ec_load_failures_total"] == 1 and m["pdserve:encoder_cache_misses_total"] >= 1
        nothing_held({"P": procs["P"]}, ("P",))
    finally:
        stop_all(procs.values())


def test_e_to_pd_over_two_encode_instances(llava, colocated, tmp_path):
    """E→PD: images spread over two encode instances (in parallel), then a colocated instance loads them."""
    store = tmp_path / "store"
    procs = {}
    try:
        for name in ("E1", "E2"):
            procs[name] = start_instance(llava, *COMMON, "--role", "encode", "--ec-transfer-config",
                                         ec_config("ECStorageConnector", "ec_producer", store), name=name)
        procs["PD"] = start_instance(llava, *COMMON, "--ec-transfer-config",
                                     ec_config("ECStorageConnector", "ec_consumer", store), name="PD")
        procs["G"] = start("gateway", ["gateway", "--encode", procs["E1"].url, procs["E2"].url, "--both",
                                       procs["PD"].url, "--protocol", "colocated", "--policy", "round_robin",
                                       "--port", "0", "--log-level", "warning"])
        body = chat([61, 62, 63, 64])
        routed = tokens(httpx.post(procs["G"].url + "/v1/chat/completions", json=body, timeout=60))
        assert routed == tokens(httpx.post(colocated.url + "/v1/chat/completions", json=body, timeout=60))
        runs = [metric_values(procs[n].url)["pdserve:encoder_runs_total"] for n in ("E1", "E2")]
        assert sorted(runs) == [2, 2]  # four images, two on each encode instance
        assert metric_values(procs["PD"].url)["pdserve:ec_loads_total"] == 4
        nothing_held(procs, ("PD",))
    finally:
        stop_all(procs.values())
