"""The OpenAI server as a real process on loopback: answers, streaming, usage, errors, disconnects, metrics."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.launcher import start_instance
from server_utils import metric_values, sse_events, wait_until_idle

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(models):
    model = models("qwen2")
    proc = start_instance(model, "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "128",
                          "--served-model-name", "tiny", "--max-num-batched-tokens", "64", name="server-test")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
    wait_until_idle(server.url)


@pytest.fixture(scope="module")
def hf(models):
    model = AutoModelForCausalLM.from_pretrained(models("qwen2"), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(models("qwen2"))
    return model, tok


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def completion(client, **body):
    r = client.post("/v1/completions", json={"model": "tiny", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


# -- answers ------------------------------------------------------------------------------------------------
def test_completion_matches_transformers(client, hf):
    model, tok = hf
    prompt = "Disaggregated serving splits prefill and decode"
    data = completion(client, prompt=prompt, max_tokens=24, ignore_eos=True, return_token_ids=True)
    choice = data["choices"][0]
    ids = tok(prompt).input_ids
    assert choice["prompt_token_ids"] == ids
    assert choice["token_ids"] == hf_greedy(model, ids, 24)
    assert choice["text"] == tok.decode(choice["token_ids"], skip_special_tokens=True)
    assert data["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 24, "total_tokens": len(ids) + 24,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert choice["finish_reason"] == "length"


def test_token_id_prompt_and_batch(client, hf):
    model, tok = hf
    prompts = [[5, 6, 7, 8], [100, 200, 300]]
    data = completion(client, prompt=prompts, max_tokens=8, ignore_eos=True, return_token_ids=True)
    assert [c["index"] for c in data["choices"]] == [0, 1]
    for prompt, choice in zip(prompts, data["choices"]):
        assert choice["token_ids"] == hf_greedy(model, prompt, 8)
    assert data["usage"]["prompt_tokens"] == 7
    assert data["usage"]["completion_tokens"] == 16


def test_batch_of_strings_and_n(client):
    data = completion(client, prompt=["alpha", "beta"], max_tokens=4, n=2, temperature=1.0, seed=7)
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert data["usage"]["completion_tokens"] == 16


def test_chat_uses_template_and_matches_transformers(client, hf):
    model, tok = hf
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a KV cache?"}]
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 12,
                                                  "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    data = r.json()
    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert data["prompt_token_ids"] == ids
    assert data["usage"]["prompt_tokens"] == len(ids)
    assert data["choices"][0]["token_ids"] == hf_greedy(model, ids, 12)
    assert data["choices"][0]["message"]["role"] == "assistant"
    assert data["object"] == "chat.completion"


def test_streaming_completion_equals_non_streaming(client):
    body = {"model": "tiny", "prompt": "stream me", "max_tokens": 20, "temperature": 0, "ignore_eos": True,
            "logprobs": 2}
    whole = completion(client, **{k: v for k, v in body.items() if k not in ("model", "temperature")})
    with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                         "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == whole["choices"][0]["text"]
    tokens = [t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
    assert tokens == pytest.approx(whole["choices"][0]["logprobs"]["token_logprobs"], abs=1e-6)
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    finals = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finals == ["length"]


def test_streaming_token_ids_all_arrive_while_text_is_held_back(client):
    """A long stop string holds the text back until the end; the token ids must still stream, every one."""
    body = {"model": "tiny", "prompt": "hold me", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stop": ["a stop string this tiny model will not write" * 3]}
    whole = completion(client, **{k: v for k, v in body.items() if k not in ("model", "temperature")})
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = list(sse_events(r))
    assert [t for e in events for c in e["choices"] for t in c["token_ids"]] == whole["choices"][0]["token_ids"]
    assert len(events) > 2  # the ids came as they were sampled, not in one final chunk
    assert "".join(c["text"] for e in events for c in e["choices"]) == whole["choices"][0]["text"]


def test_streaming_chat_deltas_and_usage(client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/chat/completions", json=body).json()
    with client.stream("POST", "/v1/chat/completions",
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = list(sse_events(r))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    text = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert events[-1]["usage"]["completion_tokens"] == 10


def test_stop_string_and_stop_token(client):
    base = completion(client, prompt="stops", max_tokens=16, ignore_eos=True, return_token_ids=True)
    text, ids = base["choices"][0]["text"], base["choices"][0]["token_ids"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if stop.strip():
        cut = completion(client, prompt="stops", max_tokens=16, ignore_eos=True, stop=[stop])
        assert cut["choices"][0]["text"] == text[:text.index(stop)]
        assert cut["choices"][0]["finish_reason"] == "stop" and cut["choices"][0]["stop_reason"] == stop
    by_token = completion(client, prompt="stops", max_tokens=16, ignore_eos=True, stop_token_ids=[ids[3]],
                          return_token_ids=True)
    assert by_token["choices"][0]["token_ids"] == ids[:ids.index(ids[3]) + 1]
    assert by_token["choices"][0]["finish_reason"] == "stop"


def test_request_id_is_echoed(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "my-id-1"})
    assert r.headers["x-request-id"] == "my-id-1"
    assert r.json()["id"] == "cmpl-my-id-1"


def test_models_health_metrics(client):
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert client.get("/health").status_code == 200
    before = metric_values(str(client.base_url))
    completion(client, prompt="count me", max_tokens=5, ignore_eos=True)
    after = metric_values(str(client.base_url))
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert after["vllm:time_to_first_token_seconds_count"] > before["vllm:time_to_first_token_seconds_count"]
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "pdserve:kv_blocks_total",
                 "vllm:e2e_request_latency_seconds_count", "vllm:inter_token_latency_seconds_count"):
        assert name in after, name


def test_prefix_cache_hit_reported(client):
    prompt = list(range(10, 10 + 48))
    completion(client, prompt=prompt, max_tokens=2)
    again = completion(client, prompt=prompt, max_tokens=2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # whole blocks, last token recomputed


# -- bad input ------------------------------------------------------------------------------------------------
BAD_BODIES = [
    ({"prompt": "x", "temperature": -1}, 400),
    ({"prompt": "x", "top_p": 0}, 400),
    ({"prompt": "x", "n": 0}, 400),
    ({"prompt": "x", "max_tokens": 0}, 400),
    ({"prompt": "x", "logprobs": 99}, 400),
    ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400),
    ({"prompt": "x", "max_tokens": MAX_MODEL_LEN * 2}, 400),
    ({"prompt": list(range(MAX_MODEL_LEN + 5))}, 400),
    ({"prompt": [999999]}, 400),
    ({"prompt": 123}, 400),
    ({"prompt": ""}, 400),
    ({}, 400),
    ({"prompt": "x", "logit_bias": {"1": 5}}, 400),
    ({"prompt": "x", "suffix": "y"}, 400),
    ({"prompt": "x", "model": "not-this-one"}, 404),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400),
]


@pytest.mark.parametrize("body,status", BAD_BODIES)
def test_bad_completion_bodies(client, body, status):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]


@pytest.mark.parametrize("body", [
    {"messages": []},
    {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
    {"messages": "hello"},
    {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
])
def test_bad_chat_bodies(client, body):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == 400


def test_malformed_json_and_wrong_routes(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    assert client.post("/v1/completions", content=b"[1, 2]").status_code == 400
    assert client.get("/v1/completions").status_code == 405
    assert client.get("/v1/nope").status_code == 404


# -- disconnects and responsiveness ----------------------------------------------------------------------------
def _raw_request(port: int, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def _samples(client: httpx.Client, *names: str) -> list[float]:
    """The named samples of /metrics, each summed over its labels (a scan of the text: a full parse takes long
    enough on a busy box to miss a short request)."""
    text = client.get("/metrics").text
    return [sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(name) and line[len(name)] in " {") for name in names]


def _caught_running(server, body: bytes, tries: int = 5) -> socket.socket:
    """`body` sent on a raw socket and seen running; its socket. A 200-token request on the tiny model ends in a few
    tenths of a second, which the polls of a busy box can miss (seen: twice in a row): it is then sent again."""
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for _ in range(tries):
            (done_before,) = _samples(client, "vllm:request_success_total")
            sock = _raw_request(server.port, body)
            deadline = time.monotonic() + 30  # generous: a box busy with other work may admit it late
            while time.monotonic() < deadline:
                running, done = _samples(client, "vllm:num_requests_running", "vllm:request_success_total")
                if running >= 1:
                    return sock
                if done > done_before:
                    break  # it ran and ended between two polls
                time.sleep(0.01)
            sock.close()
            wait_until_idle(server.url)
    raise AssertionError(f"the request was never seen running in {tries} tries")


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_blocks(server, stream):
    body = (b'{"prompt": "long one", "max_tokens": 200, "ignore_eos": true, "stream": '
            + (b"true" if stream else b"false") + b"}")
    sock = _caught_running(server, body)
    if stream:
        assert sock.recv(4096)  # the stream has begun
    before = metric_values(server.url).get('vllm:request_success_total', 0)
    sock.close()
    idle = wait_until_idle(server.url)
    assert idle["vllm:generation_tokens_total"] > 0
    # The aborted request did not run to its 200 tokens: it was counted as aborted, not as finished by length.
    after = metric_values(server.url)
    assert after.get("vllm:request_success_total", 0) - before <= 1


def test_health_answers_while_engine_computes(server):
    """The engine runs in its own thread: /health keeps answering during a long generation."""
    latencies: list[float] = []
    done = threading.Event()

    def generate() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            c.post("/v1/completions", json={"prompt": list(range(1, 200)), "max_tokens": 50, "ignore_eos": True,
                                            "n": 4, "temperature": 1.0})
        done.set()

    worker = threading.Thread(target=generate)
    worker.start()
    with httpx.Client(base_url=server.url, timeout=5) as c:
        while not done.is_set():
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.01)
    worker.join()
    assert len(latencies) >= 3  # answered repeatedly while busy (latency figures live in bench/, not here)
    wait_until_idle(server.url)
