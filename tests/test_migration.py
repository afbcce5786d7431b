"""Live migration between pdserve decode instances, through a real gateway, over shm, tcp and NIXL.

A request moved mid-generation (its KV copied stage by stage while it decodes, then handed over after a step) must
give its client exactly the answer it gets when it never moves: the same tokens and text, logprobs within the
cross-process bound, the same usage, one stream with no token lost or repeated. Afterwards every instance holds
nothing: no KV block, no lease. The oracle is the same request through the same gateway, unmoved.
"""

from __future__ import annotations

import threading
import uuid

import httpx
import pytest

from conftest import random_prompt
from migration_fleet import AUTH, COMMON, Fleet, Stream, kv_config
from server_utils import CROSS_PROCESS_LOGPROB_TOL, data_planes, wait_for

PLANES = data_planes("shm", "tcp", "nixl")


@pytest.fixture(scope="module")
def fleet(models):
    decodes = {"D1": ["--kv-transfer-config", kv_config("kv_consumer")],
               "D2": ["--kv-transfer-config", kv_config("kv_consumer")]}
    f = Fleet(models("llama"), decodes)
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="module")
def spare(fleet):
    """Decode instances started once, registered only by the tests that use them."""
    from concurrent.futures import ThreadPoolExecutor

    from pdserve.launcher import start_instance

    specs = {"other layout": ["--block-size", "32", "--kv-transfer-config", kv_config("kv_consumer")]}
    specs.update({plane: ["--kv-transfer-config", kv_config("kv_consumer", plane)] for plane in ("tcp", "nixl")})
    with ThreadPoolExecutor(3) as pool:
        jobs = {name: pool.submit(start_instance, fleet.model, *COMMON, *flags, name=name)
                for name, flags in specs.items()}
        procs = {name: job.result() for name, job in jobs.items()}
    fleet.procs.update(procs)
    yield procs


def body(seed: int = 1, max_tokens: int = 160, **extra) -> dict:
    return {"model": "tiny", "prompt": random_prompt(70, seed=seed), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 1, "stream": True, "stream_options": {"include_usage": True}, **extra}


_references: dict[str, dict] = {}


def unmoved(fleet: Fleet, request: dict, path: str = "/v1/completions") -> dict:
    key = f"{path} {sorted(request.items())}"
    if key not in _references:
        stream = Stream(fleet, request, path)
        _references[key] = stream.result()
        assert not _references[key]["errors"] and _references[key]["done"], _references[key]["errors"]
    return _references[key]


def assert_same(got: dict, expected: dict) -> None:
    assert not got["errors"], got["errors"]
    assert got["done"], "the stream was cut"
    assert got["text"] == expected["text"]
    assert got["token_ids"] == expected["token_ids"]
    assert got["usage"] == expected["usage"]
    assert got["finish_reason"] == expected["finish_reason"]
    assert len(got["logprobs"]) == len(expected["logprobs"])
    for a, b in zip(got["logprobs"], expected["logprobs"], strict=True):
        assert abs(a - b) <= CROSS_PROCESS_LOGPROB_TOL


def other(fleet: Fleet, name: str) -> str:
    return "D2" if name == "D1" else "D1"


def moved(fleet: Fleet, request: dict, to: str | None = None, path: str = "/v1/completions", after: int = 15,
          joining: tuple[str, ...] | list[str] = (), **extra) -> tuple[dict, dict, str]:
    """Stream `request`, move it after `after` events (to `to`, else the other decode instance, once the instances
    `joining` joined the gateway): (what the client got, the gateway's answer to the move, where it ran first)."""
    with fleet.held_back():
        stream = Stream(fleet, request, path)
        stream.wait_for_events(after)
        for url in joining:
            httpx.post(f"{fleet.gateway.url}/register", json={"url": url, "role": "decode"}, headers=AUTH)
        source = fleet.serving(stream.request_id)
        r = fleet.migrate(stream.request_id, to or other(fleet, source), **extra)
    assert r.status_code == 200, r.text
    return stream.result(), r.json()["data"][0], source


@pytest.mark.core
@pytest.mark.parametrize("plane", PLANES)
def test_moved_stream_equals_unmoved(fleet, spare, plane):
    request = body(seed=1, max_tokens=300, return_token_ids=True)
    expected = unmoved(fleet, request)
    # D1 and D2 read over shm (the first plane that connects); the others read only over theirs, and join once the
    # request runs (on D1 or D2).
    target = None if plane == "shm" else plane
    joins = [] if target is None else [fleet[plane].url]
    try:
        # Moved early (after 5 chunks): on a loaded box one chunk may carry many tokens.
        got, outcome, source = moved(fleet, request, to=target, joining=joins, after=5)
    finally:
        for url in joins:
            httpx.post(f"{fleet.gateway.url}/deregister", json={"url": url}, headers=AUTH)
    assert outcome["outcome"] == "handed_over", outcome
    assert outcome["stages"] >= 2, "the KV moved in stages while the request decoded on"
    assert_same(got, expected)
    fleet.idle()


def test_a_paced_move_copies_its_bulk_in_bounded_stages_at_its_rate(fleet):
    """`max_mib_per_s`: the bulk copy goes a block or so per stage (the tiny model's blocks are 16 KiB, a tenth of
    a second at 0.25 MiB/s is 25.6 KiB), no faster than the rate, and the answer is still exactly the unmoved one."""
    request = body(seed=6, max_tokens=300, return_token_ids=True)
    expected = unmoved(fleet, request)
    got, outcome, _ = moved(fleet, request, after=5, max_mib_per_s=0.25)
    assert outcome["outcome"] == "handed_over", outcome
    full_blocks = 70 // 16  # at least the prompt's full blocks were filled when it moved
    assert outcome["stages"] > full_blocks, f"{outcome}: the bulk moved in more than one block per stage"
    assert_same(got, expected)
    fleet.idle()


def test_chat_with_seeded_sampling_moves_exactly(fleet):
    """Seeded sampling goes on with the sampler's own random stream; held-back text (a stop string's prefix) is
    sent once; the window leg's token ids never reach a client that did not ask for them."""
    request = {"model": "tiny", "messages": [{"role": "user", "content": "tell me about the sea " * 8}],
               "max_tokens": 160, "temperature": 0.9, "top_p": 0.95, "seed": 1234, "ignore_eos": True,
               "logprobs": True, "top_logprobs": 2, "stop": ["zzq", "qqz"], "stream": True,
               "stream_options": {"include_usage": True}}
    expected = unmoved(fleet, request, "/v1/chat/completions")
    got, outcome, _ = moved(fleet, request, path="/v1/chat/completions")
    assert outcome["outcome"] == "handed_over", outcome
    assert_same(got, expected)
    fleet.idle()


@pytest.mark.parametrize("mode", ["stop-copy", "recompute"])
def test_other_modes_equal_unmoved(fleet, mode):
    """The benchmark's baselines: stop, copy everything, resume; and recompute on the new instance."""
    request = body(seed=2)
    expected = unmoved(fleet, request)
    got, outcome, _ = moved(fleet, request, mode=mode)
    assert outcome["outcome"] == "handed_over", outcome
    assert_same(got, expected)
    fleet.idle()


def test_moves_twice_and_back(fleet):
    request = body(seed=3, max_tokens=240)
    expected = unmoved(fleet, request)
    with fleet.held_back():
        stream = Stream(fleet, request)
        for hop in range(2):
            stream.wait_for_events(15 + 60 * hop)
            source = fleet.serving(stream.request_id)
            r = fleet.migrate(stream.request_id, other(fleet, source))
            assert r.status_code == 200 and r.json()["data"][0]["outcome"] == "handed_over", r.text
    assert_same(stream.result(), expected)
    fleet.idle()


def test_json_answer_of_a_moved_request_is_whole(fleet):
    """A non-streaming request moves too: the last instance answers with everything from the first token."""
    streamed = body(seed=4, return_token_ids=True)
    expected = unmoved(fleet, streamed)
    request = {**streamed, "stream": False}
    del request["stream_options"]
    request_id, answer = uuid.uuid4().hex, {}

    def ask() -> None:
        answer["r"] = httpx.post(f"{fleet.gateway.url}/v1/completions", json=request,
                                 headers={"X-Request-Id": request_id}, timeout=120)

    thread = threading.Thread(target=ask)
    with fleet.held_back():
        thread.start()
        wait_for(lambda: _decoding(fleet, request_id), 60, "the request to decode")
        source = fleet.serving(request_id)
        r = fleet.migrate(request_id, other(fleet, source))
    thread.join(120)
    assert r.status_code == 200 and r.json()["data"][0]["outcome"] == "handed_over", r.text
    got = answer["r"].json()
    choice = got["choices"][0]
    assert choice["token_ids"] == expected["token_ids"] and choice["text"] == expected["text"]
    assert got["usage"] == expected["usage"]
    for a, b in zip(choice["logprobs"]["token_logprobs"], expected["logprobs"], strict=True):
        assert abs(a - b) <= CROSS_PROCESS_LOGPROB_TOL
    fleet.idle()


def _decoding(fleet: Fleet, request_id: str) -> bool:
    r = httpx.get(f"{fleet.gateway.url}/v1/timeline/{request_id}")
    if r.status_code != 200:
        return False
    legs = [e for e in r.json()["data"][-1]["events"] if e["name"] == "leg_start" and e["attrs"]["leg"] == "decode"]
    if not legs:
        return False
    timeline = httpx.get(f"{legs[-1]['attrs']['url']}/v1/timeline/{request_id}").json()
    return any(e["name"] == "first_token" for t in timeline.get("data", []) for e in t["events"])


def test_bad_migrate_calls_get_clear_errors(fleet, spare):
    with fleet.held_back():
        stream = _refused_moves(fleet)
    got = stream.result()  # refused moves left it alone
    assert got["done"] and not got["errors"] and got["usage"]["completion_tokens"] == 300
    fleet.idle()


def _refused_moves(fleet: Fleet) -> Stream:
    """Every bad move of a running request is refused with a clear error; the request runs on (returned)."""
    stream = Stream(fleet, body(seed=5, max_tokens=300))
    stream.wait_for_events(5)
    source = fleet.serving(stream.request_id)
    gw = fleet.gateway.url
    cases = [
        ({"request_id": "nobody", "to": fleet["D1"].url}, 404, "no request"),
        ({"request_id": stream.request_id, "to": fleet["P"].url}, 400, "not a decode instance"),
        ({"request_id": stream.request_id, "to": "http://127.0.0.1:9"}, 404, "not an instance of this gateway"),
        ({"request_id": stream.request_id, "to": fleet[source].url}, 400, "already"),
        ({"request_id": stream.request_id, "to": "ftp://x"}, 400, "http://host:port"),
        ({"request_id": stream.request_id}, 400, "expected"),
        ({"request_id": stream.request_id, "to": fleet[other(fleet, source)].url, "mode": "teleport"}, 400, "mode"),
        ({"request_id": stream.request_id, "to": fleet[other(fleet, source)].url, "max_mib_per_s": -1}, 400,
         "max_mib_per_s"),
    ]
    for payload, status, words in cases:
        r = httpx.post(f"{gw}/admin/migrate", json=payload, headers=AUTH, timeout=30)
        assert r.status_code == status and words in r.json()["error"]["message"], (payload, r.text)
    assert httpx.post(f"{gw}/admin/migrate", json=cases[0][0]).status_code == 401  # the admin token is required
    httpx.post(f"{gw}/register", json={"url": fleet["other layout"].url, "role": "decode"}, headers=AUTH)
    try:
        r = fleet.migrate(stream.request_id, "other layout")
        assert r.status_code == 409 and "another model or KV layout" in r.json()["error"]["message"], r.text
    finally:
        httpx.post(f"{gw}/deregister", json={"url": fleet["other layout"].url}, headers=AUTH)
    return stream


def test_forged_migration_messages_are_refused(fleet):
    """A copy stage must name a lease of the source's with its read token, like a pull; an attach must carry the
    migration's token. Forgeries are refused and leave nothing held."""
    d1, d2 = fleet["D1"].url, fleet["D2"].url
    info = httpx.get(f"{d1}/v1/pdserve/info").json()
    forged = {"migration_id": "mig-forged", "token": "f" * 32, "key": "mig-real:0", "read_token": "0" * 32,
              "source": {"engine_id": info["engine_id"], "host": info["side_channel_host"],
                         "port": info["side_channel_port"]}, "first_block": 0,
              "block_ids": [0, 1], "token_ids": list(range(32))}
    r = httpx.post(f"{d2}/v1/migration/stage", json=forged, timeout=60)
    assert r.status_code == 502 and "no KV is held" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{d2}/v1/migration/stage", json={**forged, "first_block": 2}, timeout=60)
    assert r.status_code == 404, r.text  # not the first stage of a migration it knows
    for phase in ("window", "attach"):
        r = httpx.post(f"{d1}/v1/completions", json={**body(), "kv_transfer_params": {"migration": {
            "phase": phase, "migration_id": "mig-forged", "token": "f" * 32}}})
        assert r.status_code == 404 and "no such migration" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{d1}/v1/completions", json={**body(), "kv_transfer_params": {"migration": {"phase": "fly"}}})
    assert r.status_code == 400, r.text
    fleet.idle()


def test_unspliced_requests_do_not_move(fleet):
    """A client talking to the instance directly gets no marker: its requests are not movable."""
    d1 = fleet["D1"].url
    request_id = uuid.uuid4().hex
    lines: list[str] = []

    def read() -> None:
        with httpx.stream("POST", f"{d1}/v1/completions", json=body(seed=6, max_tokens=120),
                          headers={"X-Request-Id": request_id}, timeout=60) as r:
            lines.extend(line for line in r.iter_lines() if line)

    thread = threading.Thread(target=read)
    thread.start()
    wait_for(lambda: len(lines) > 5, 30, "events")
    r = httpx.post(f"{d1}/v1/migrate", json={"request_id": request_id, "to": fleet["D2"].url}, timeout=30)
    thread.join(60)
    assert r.status_code == 404, r.text
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    fleet.idle()


def test_rebalancing_moves_requests_to_an_idle_decode_instance(fleet):
    """With --rebalance, a gateway moves requests off a decode instance whose KV use exceeds another's."""
    from pdserve.launcher import start

    requests = [body(seed=20 + i, max_tokens=300) for i in range(3)]
    expected = [unmoved(fleet, r) for r in requests]
    gateway = start("gateway", ["gateway", "--port", "0", "--log-level", "warning", "--protocol", "pull",
                                "--prefill", fleet["P"].url, "--decode", fleet["D1"].url, "--admin-token", "rebalance",
                                "--rebalance", "--rebalance-margin", "0.05", "--rebalance-max-mib-per-s", "1"])
    try:
        streams = [Stream(fleet, r, gateway_url=gateway.url) for r in requests]
        for stream in streams:
            stream.wait_for_events(5)
        r = httpx.post(f"{gateway.url}/register", json={"url": fleet["D2"].url, "role": "decode"},
                       headers={"Authorization": "Bearer rebalance"})
        assert r.status_code == 200, r.text
        for stream, want in zip(streams, expected, strict=True):
            assert_same(stream.result(), want)
        moves = [line for line in httpx.get(f"{gateway.url}/metrics").text.splitlines()
                 if line.startswith('pdserve:gateway_rebalance_moves_total{outcome="handed_over"}')]
        assert moves and float(moves[0].rsplit(" ", 1)[1]) >= 1, "the rebalancer moved a request to D2"
    finally:
        gateway.stop()
    fleet.idle()
