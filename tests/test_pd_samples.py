"""n > 1 and prompt lists through every PD protocol: the answers equal a colocated instance's with the same seeds.

P prefills each prompt once (its leg asks for one sample); D draws the n samples from one transfer, the other
samples finding the prompt's blocks in its prefix cache; a prompt list runs one PD request per prompt and the
gateway merges the choices (index = prompt index * n + sample index) and the usage.
"""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.launcher import start, start_instance
from server_utils import metric_values, processes, wait_until_idle

COMMON = ["--max-model-len", "512", "--num-kv-blocks", "256", "--served-model-name", "tiny"]
PROTOCOLS = ("pull", "push", "decode-first")
A, B = list(range(40, 90)), list(range(300, 337))  # 50 and 37 tokens: whole blocks of 16 to share, and a partial one
TEXT = "disaggregated serving splits prefill from decode"
SAMPLED = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 6, "ignore_eos": True}

CASES = {
    "prompt list": ("/v1/completions", {"prompt": [TEXT, TEXT + " and moves the KV cache between them"], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                        "return_token_ids": True}),
    "n=3 seeded": ("/v1/completions", {"prompt": A, "n": 3, "seed": 7, "return_token_ids": True, **SAMPLED}),
    "prompt list, n=2 seeded": ("/v1/completions", {"prompt": [B, A, B], "n": 2, "seed": 11, **SAMPLED}),
    "chat, n=2 seeded": ("/v1/chat/completions", {"messages": [{"role": "user", "content": TEXT}], "n": 2,
                                                  "seed": 5, **SAMPLED}),
}


def kv(role: str) -> str:
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role})


@pytest.fixture(scope="module")
def cluster(models):
    model = models("qwen2")
    with processes(P=lambda: start_instance(model, *COMMON, "--kv-transfer-config", kv("kv_producer"), name="P"),
                   D=lambda: start_instance(model, *COMMON, "--kv-transfer-config", kv("kv_consumer"), name="D"),
                   C=lambda: start_instance(model, *COMMON, name="C")) as procs:
        gateways = {protocol: (lambda p=protocol: start("gateway", [
            "gateway", "--port", "0", "--log-level", "warning", "--protocol", p, "--prefill", procs["P"].url,
            "--decode", procs["D"].url])) for protocol in PROTOCOLS}
        with processes(**gateways) as gws:
            yield {**procs, **gws}


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json={"model": "tiny", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def choices(answer: dict) -> list[tuple]:
    return [(c["index"], c.get("text", (c.get("message") or {}).get("content")), c.get("token_ids"), c["finish_reason"])
            for c in sorted(answer["choices"], key=lambda c: c["index"])]


def tokens_of(usage: dict) -> tuple[int, int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def counters(cluster) -> dict[str, float]:
    p, d = metric_values(cluster["P"].url), metric_values(cluster["D"].url)
    return {"p_prompt": p.get("vllm:prompt_tokens_total", 0), "d_computed": d["pdserve:prompt_tokens_computed_total"],
            "transfers": d["pdserve:kv_transfer_loads_ok_total"] + d["pdserve:kv_push_done_ok_total"]}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", CASES)
def test_samples_and_prompt_lists_equal_colocated(cluster, protocol, case):
    path, body = CASES[case]
    reference = post(cluster["C"].url, path, body)
    before = counters(cluster)
    answer = post(cluster[protocol].url, path, body)
    assert choices(answer) == choices(reference)
    assert tokens_of(answer["usage"]) == tokens_of(reference["usage"])
    after = counters(cluster)
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) and isinstance(body["prompt"][0], (list, str)) else 1
    n = body.get("n", 1)
    # P prefilled each prompt once (its prompt tokens, not n times them); D took one transfer per prompt, and
    # computed at most each sample's last, partial block: the whole blocks came from the transfer.
    assert after["p_prompt"] - before["p_prompt"] == reference["usage"]["prompt_tokens"]
    assert after["transfers"] - before["transfers"] == prompts
    assert after["d_computed"] - before["d_computed"] <= prompts * n * 16
    for name in ("P", "D"):
        assert wait_until_idle(cluster[name].url)["pdserve:kv_leases_held"] == 0


def stream(url: str, path: str, body: dict) -> tuple[dict[int, str], dict, int]:
    """Per choice index, the streamed text; the final usage; how many [DONE] markers arrived."""
    texts: dict[int, str] = {}
    usage, done = {}, 0
    with httpx.stream("POST", url + path, json={"model": "tiny", **body, "stream": True,
                                                "stream_options": {"include_usage": True}}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for c in chunk["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + (c.get("text") or c.get("delta", {}).get("content") or "")
                usage = chunk.get("usage") or usage
    return texts, usage, done


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", ["prompt list, n=2 seeded", "chat, n=2 seeded"])
def test_streamed_samples_equal_colocated(cluster, protocol, case):
    path, body = CASES[case]
    texts, usage, done = stream(cluster[protocol].url, path, body)
    ref_texts, ref_usage, _ = stream(cluster["C"].url, path, body)
    assert texts == ref_texts and len(texts) == len(ref_texts) > 1
    assert tokens_of(usage) == tokens_of(ref_usage) and done == 1
    for name in ("P", "D"):
        wait_until_idle(cluster[name].url)
