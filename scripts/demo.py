"""`make demo`: a 1P1D cluster behind the gateway on a tiny model, all as real processes on loopback.

It generates a tiny Qwen3 model offline, starts a prefill instance, a decode instance, a colocated instance
(the reference) and the gateway, sends a completion, a chat and a streamed chat through the gateway, shows that
each answer equals the colocated one, prints the per-leg timings and the KV bytes moved, and stops everything.
"""

from __future__ import annotations

import http.client
import json
import sys
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pdserve.launcher import Process, start, start_instance
from pdserve.modelgen import make_text_model

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "tiny-qwen3"
COMMON = ["--served-model-name", "tiny-qwen3", "--max-model-len", "1024"]


def request(port: int, path: str, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = json.loads(response.read())
    conn.close()
    if response.status != 200:
        raise RuntimeError(f"{path} answered {response.status}: {data}")
    return data


def stream(port: int, path: str, body: dict) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    pieces = []
    for raw in conn.getresponse():
        line = raw.decode().strip()
        if line == "data: [DONE]":
            break
        if line.startswith("data: "):
            for choice in json.loads(line[6:])["choices"]:
                piece = choice.get("delta", {}).get("content", "")
                pieces.append(piece)
                print(piece, end="", flush=True)
    conn.close()
    print()
    return "".join(pieces)


def metrics(proc: Process) -> dict[str, dict[tuple, float]]:
    conn = http.client.HTTPConnection("127.0.0.1", proc.port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def text_of(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def main() -> int:
    if not (MODEL_DIR / "config.json").exists():
        print(f"generating a tiny Qwen3 model in {MODEL_DIR} (offline, deterministic) ...")
        make_text_model("qwen3", MODEL_DIR, preset="tiny")
    procs: list[Process] = []
    try:
        started = time.monotonic()
        kv = lambda role: json.dumps({"kv_connector": "PdConnector", "kv_role": role})  # noqa: E731
        prefill = start_instance(MODEL_DIR, *COMMON, "--kv-transfer-config", kv("kv_producer"), name="prefill")
        procs.append(prefill)
        decode = start_instance(MODEL_DIR, *COMMON, "--kv-transfer-config", kv("kv_consumer"), name="decode")
        procs.append(decode)
        colocated = start_instance(MODEL_DIR, *COMMON, name="colocated")
        procs.append(colocated)
        gateway = start("gateway", ["gateway", "--prefill", prefill.url, "--decode", decode.url, "--protocol", "pull",
                                    "--port", "0", "--log-level", "warning"])
        procs.append(gateway)
        print(f"1P1D cluster up in {time.monotonic() - started:.1f} s: gateway {gateway.url}, prefill {prefill.url}, "
              f"decode {decode.url}, colocated reference {colocated.url}\n")

        all_equal = True
        cases = [("/v1/completions", {"prompt": "Disaggregated serving splits prefill and decode", "max_tokens": 16}),
                 ("/v1/chat/completions", {"messages": [{"role": "user", "content": "What does the KV cache hold?"}],
                                           "max_tokens": 16})]
        for path, body in cases:
            body = {**body, "model": "tiny-qwen3", "temperature": 0}
            through_gateway, reference = request(gateway.port, path, body), request(colocated.port, path, body)
            same = text_of(through_gateway) == text_of(reference)
            all_equal &= same
            print(f"{path:22s} {text_of(through_gateway)!r}\n{'':22s} equals colocated: {same}; usage {through_gateway['usage']}")
        chat = {"model": "tiny-qwen3", "temperature": 0, "max_tokens": 16,
                "messages": [{"role": "user", "content": "Stream me an answer."}]}
        print(f"{'streamed chat':22s} ", end="")
        streamed = stream(gateway.port, "/v1/chat/completions", chat)
        same = streamed == text_of(request(colocated.port, "/v1/chat/completions", chat))
        all_equal &= same
        print(f"{'':22s} equals colocated: {same}")

        print("\nper-leg timings at the gateway (mean over these requests):")
        g = metrics(gateway)
        for leg in ("prefill", "kv_ready", "decode_first_token", "e2e"):
            total = g["pdserve:gateway_leg_seconds_sum"].get((("leg", leg),), 0.0)
            count = g["pdserve:gateway_leg_seconds_count"].get((("leg", leg),), 0.0)
            if count:
                print(f"  {leg:20s} {1000 * total / count:8.1f} ms  ({int(count)} requests)")
        d = metrics(decode)
        moved = sum(d["pdserve:kv_transfer_bytes_received_total"].values())
        loads = sum(d["pdserve:kv_transfer_loads_ok_total"].values())
        print(f"KV moved from prefill to decode: {int(moved)} bytes in {int(loads)} transfers")
        print("(random weights: the words are noise; the plumbing is what is shown)")
        return 0 if all_equal else 1
    finally:
        for proc in reversed(procs):
            proc.stop()
        print(f"stopped {len(procs)} processes")


if __name__ == "__main__":
    sys.exit(main())
