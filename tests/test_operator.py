"""What an operator sees: startup mistakes as one clear line and a non-zero exit (a taken port before the model
loads), --help with defaults, and one access-log line per request that --disable-log-requests turns off."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.launcher import start, start_instance, stop_all

REPO = Path(__file__).resolve().parent.parent
COMMON = ["--max-model-len", "256", "--num-kv-blocks", "64", "--served-model-name", "tiny"]


def pdserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def assert_one_line_failure(result: subprocess.CompletedProcess, expected: str) -> None:
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and expected in errors[0], result.stderr


def test_missing_model_folder(tmp_path):
    assert_one_line_failure(pdserve("serve", str(tmp_path / "nope"), "--port", "0"), "does not exist")


def test_bad_kv_transfer_config_json(models):
    result = pdserve("serve", str(models("qwen2")), "--port", "0", "--kv-transfer-config", "{bad")
    assert_one_line_failure(result, "--kv-transfer-config: not valid JSON")


def test_unknown_flag(models):
    assert_one_line_failure(pdserve("serve", str(models("qwen2")), "--no-such-flag"), "unrecognized arguments")


def test_kv_cache_smaller_than_max_model_len(models):
    result = pdserve("serve", str(models("qwen2")), "--port", "0", "--max-model-len", "256", "--num-kv-blocks", "4")
    assert_one_line_failure(result, "larger than the maximum number of tokens")


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_port_in_use_fails_before_the_model_loads(models, command):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        args = [str(models("qwen2"))] if command == "serve" else ["--both", "http://127.0.0.1:9"]
        result = pdserve(command, *args, "--host", "127.0.0.1", "--port", port)
    assert_one_line_failure(result, f"cannot listen on 127.0.0.1:{port}")
    assert "engine ready" not in result.stderr  # refused before loading anything


def test_help_shows_defaults():
    serve = pdserve("serve", "--help").stdout
    assert "(default: 16)" in serve and "(default: 2048)" in serve and "--disable-log-requests" in serve
    assert "(default: 8000)" in pdserve("gateway", "--help").stdout


def _access_lines(proc, marker: str, expect: int, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in proc.log_tail(1_000_000).splitlines() if "pdserve.access" in line and marker in line]
        if len(lines) >= expect or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_access_log_line_per_request(models):
    procs = []
    try:
        procs.append(start_instance(models("qwen2"), *COMMON, name="logged"))
        procs.append(start("gateway", ["gateway", "--both", procs[0].url, "--protocol", "colocated",
                                       "--host", "127.0.0.1", "--port", "0"]))
        for proc in procs:
            r = httpx.post(f"{proc.url}/v1/completions", headers={"X-Request-Id": f"acc-{proc.name}"}, timeout=30,
                           json={"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200, r.text
            bad = httpx.post(f"{proc.url}/v1/completions", content=b"{nope", headers={"X-Request-Id": "acc-bad"},
                             timeout=30)
            assert bad.status_code == 400
        instance, gateway = procs
        lines = _access_lines(instance, "id=acc-logged", 1)
        assert len(lines) == 1 and "POST /v1/completions 200" in lines[0], lines
        assert "prompt_tokens=3 completion_tokens=4" in lines[0]
        assert len(_access_lines(gateway, "id=acc-gateway", 1)) == 1
        for proc in procs:
            assert any("POST /v1/completions 400" in line for line in _access_lines(proc, "id=acc-bad", 1))
    finally:
        stop_all(procs)


def test_disable_log_requests(models):
    proc = start_instance(models("qwen2"), *COMMON, "--disable-log-requests", name="quiet")
    try:
        r = httpx.post(f"{proc.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        assert "pdserve.access" not in proc.log_tail(1_000_000)
    finally:
        proc.stop()


def test_kv_transfer_config_must_be_an_object(models):
    result = pdserve("serve", str(models("qwen2")), "--port", "0", "--kv-transfer-config", json.dumps([1]))
    assert_one_line_failure(result, "must be a JSON object")
