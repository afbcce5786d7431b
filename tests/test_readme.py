"""The README's command blocks run as written on a fresh clone once `make demo` has made `.venv`.

Each block is run by `bash -e` in its own session, with only these mechanical substitutions, so the test works
from any venv and beside other tests: `.venv/bin/pdserve` becomes this interpreter running tests/fork_relay.py,
which is `python -m pdserve` forked from the run's fork server where it can be (spawned where not), the fixed
ports (8000, 8001, 8100, 8200, and etcd's 2379 and 2380) become free ephemeral ones, and `models/` becomes a
temporary folder. The block must print
a real completion, stop everything it started by itself (its own `kill` line), and leave no port listening.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from conftest import SpawnedNotForked
from fork_relay import SPAWNED
from peers import reserved_port

README = Path(__file__).resolve().parent.parent / "README.md"
RELAY = Path(__file__).resolve().parent / "fork_relay.py"
FIXED_PORTS = ("8000", "8001", "8100", "8200", "2379", "2380")
BLOCK_DEADLINE_S = 240
EXIT_DEADLINE_S = 30


def bash_blocks(section: str) -> list[str]:
    """The ```bash blocks under the `## section` heading, up to the next heading of that level."""
    text = README.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```bash\n(.*?)```", text[start:end if end > 0 else None], re.S)


def json_objects(text: str) -> list[dict]:
    """Every JSON object in the output (curl prints no newline, so objects may share a line with others)."""
    decoder, found, at = json.JSONDecoder(), [], text.find("{")
    while at >= 0:
        try:
            obj, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            end = at + 1
        else:
            found.append(obj)
        at = text.find("{", end)
    return [obj for obj in found if isinstance(obj, dict)]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def run_block(block: str, tmp_path: Path) -> str:
    ports = {port: str(reserved_port()) for port in FIXED_PORTS}
    script = block.replace(".venv/bin/pdserve", f"{shlex.quote(sys.executable)} {shlex.quote(str(RELAY))}")
    script = re.sub(r"\b(%s)\b" % "|".join(FIXED_PORTS), lambda m: ports[m.group(1)], script)
    script = re.sub(r"(?<![\w/])models/", f"{tmp_path}/models/", script)
    log = tmp_path / "out.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-e", "-c", script], cwd=README.parent, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            proc.wait(timeout=BLOCK_DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the block did not finish in {BLOCK_DEADLINE_S} s:\n{log.read_text()[-3000:]}")
        assert proc.returncode == 0, f"the block failed ({proc.returncode}):\n{log.read_text()[-3000:]}"
        deadline = time.monotonic() + EXIT_DEADLINE_S
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not group_alive(proc.pid), "the block left processes running (its kill line misses some)"
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    left = [port for port in ports.values() if listening(int(port))]
    assert not left, f"ports still listening after the block: {left}"
    output = log.read_text()
    for line in output.splitlines():
        if line.startswith(SPAWNED):
            warnings.warn(line, SpawnedNotForked, stacklevel=2)
    return output


def completion(output: str) -> dict:
    answers = [obj for obj in json_objects(output) if obj.get("choices")]
    assert answers, f"no completion in the block's output:\n{output[-3000:]}"
    return answers[-1]


def test_no_command_line_starts_with_a_bare_pdserve():
    """`pdserve` is not on PATH after `make`; the venv's console script is."""
    lines = [line.strip() for text in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
             for line in text.splitlines()]
    bare = [line for line in lines if re.match(r"pdserve\b", line)]
    assert not bare, "use .venv/bin/pdserve:\n" + "\n".join(bare)


def test_serve_block(tmp_path):
    [block] = bash_blocks("Serve a real model")
    answer = completion(run_block(block, tmp_path))
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]


def test_cluster_block(tmp_path):
    [block, _llava_sketch] = bash_blocks("Run a 1P1D cluster by hand")
    answer = completion(run_block(block, tmp_path))
    assert answer["object"] == "text_completion" and answer["choices"][0]["text"]


def test_fleet_block(tmp_path):
    if shutil.which("etcd") is None and os.environ.get("CI") != "true":
        pytest.skip("etcd-server is not installed (make install installs it)")
    [block, _sidecar, _kubernetes] = bash_blocks("A fleet: several gateways on etcd, or on Kubernetes")
    output = run_block(block, tmp_path)
    listed = [obj for obj in json_objects(output) if "url" in obj and "role" in obj]
    assert {i["role"] for i in listed} == {"prefill", "decode"}
    assert completion(output)["choices"][0]["text"]


def test_kv_routing_block(tmp_path):
    [block] = bash_blocks("KV-aware routing")
    output = run_block(block, tmp_path)
    assert completion(output)["object"] == "chat.completion"
    held = sorted(float(v) for v in re.findall(r'pdserve:gateway_kv_index_blocks\{instance="[^"]+"\} (\S+)', output))
    assert len(held) == 2 and held[0] == 0 and held[1] > 0, f"the scrape after the request shows {held}"


def test_timeline_block(tmp_path):
    [block] = bash_blocks("Request timelines and traces")
    timelines = [obj for obj in json_objects(run_block(block, tmp_path)) if "data" in obj]
    assert timelines and timelines[-1]["data"], "the gateway printed no timeline for r1"
    assert any(event["name"] for event in timelines[-1]["data"][0]["events"])
