"""`make demo`: generate a tiny model offline, serve it, and talk to it over vLLM's OpenAI API."""

from __future__ import annotations

import http.client
import json
import sys
import time
from pathlib import Path

from pdserve.launcher import start_instance
from pdserve.modelgen import make_text_model

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "tiny-qwen3"


def post(port: int, path: str, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = json.loads(response.read())
    conn.close()
    if response.status != 200:
        raise RuntimeError(f"{path} answered {response.status}: {data}")
    return data


def stream(port: int, path: str, body: dict):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            break
        yield json.loads(line[len("data: "):])
    conn.close()


def main() -> int:
    if not (MODEL_DIR / "config.json").exists():
        print(f"generating a tiny Qwen3 model in {MODEL_DIR} ...")
        make_text_model("qwen3", MODEL_DIR, preset="tiny")
    print("starting an instance ...")
    started = time.monotonic()
    instance = start_instance(MODEL_DIR, "--served-model-name", "tiny-qwen3", "--max-model-len", "1024")
    try:
        print(f"instance pid {instance.pid} ready on {instance.url} after {time.monotonic() - started:.1f} s\n")
        completion = post(instance.port, "/v1/completions",
                          {"model": "tiny-qwen3", "prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0})
        print("completion :", repr(completion["choices"][0]["text"]), completion["usage"])
        messages = [{"role": "user", "content": "Tell me about disaggregated serving."}]
        chat = post(instance.port, "/v1/chat/completions",
                    {"model": "tiny-qwen3", "messages": messages, "max_tokens": 16, "temperature": 0})
        print("chat       :", repr(chat["choices"][0]["message"]["content"]), chat["usage"])
        print("streamed   : ", end="", flush=True)
        pieces = []
        for event in stream(instance.port, "/v1/chat/completions",
                            {"model": "tiny-qwen3", "messages": messages, "max_tokens": 16, "temperature": 0}):
            for choice in event["choices"]:
                piece = choice["delta"].get("content", "")
                pieces.append(piece)
                print(piece, end="", flush=True)
        print()
        same = "".join(pieces) == chat["choices"][0]["message"]["content"]
        print(f"\nstreamed text equals the non-streamed answer: {same}")
        print("(the model has random weights, so the words are noise; the plumbing is what is shown)")
        return 0 if same else 1
    finally:
        instance.stop()
        print(f"instance {instance.pid} stopped")


if __name__ == "__main__":
    sys.exit(main())
