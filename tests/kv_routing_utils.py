"""Reading a kv_aware gateway from outside: its index metrics, its subscriptions, and which instance served a
request's legs (its timeline)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def samples(url: str, name: str) -> dict[str, float]:
    """One metric's samples by their instance label."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels.get("instance", "")] = sample.value
    return out


def live(g, *instances) -> bool:
    text = httpx.get(g.url + "/metrics", timeout=10).text
    return all(f'instance="{i.url}",state="live"}} 1.0' in text for i in instances)


def ask(url: str, prompt: str, request_id: str | None = None, path: str = "/v1/completions") -> str:
    headers = {"x-request-id": request_id} if request_id else {}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + path, json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def legs(g, request_id: str) -> dict[str, str]:
    """Which instance served each leg of a request, from the gateway's timeline."""
    data = httpx.get(f"{g.url}/v1/timeline/{request_id}", timeout=10).json()["data"]
    return {e["attrs"]["leg"]: e["attrs"]["url"] for t in data for e in t["events"] if e["name"] == "leg_start"}


def indexed(g, instance) -> float:
    return samples(g.url, "pdserve:gateway_kv_index_blocks").get(instance.url, 0.0)
