"""pdserve's own HTTP/1.1 server (pdserve.net.http1), on real sockets, read by clients nobody here wrote (httpx's
h11 parser; raw bytes where a client library would hide the behaviour), and side by side with uvicorn in front of
the same gateway app: every answer a client can see is the same but for the headers servers differ on."""

from __future__ import annotations

import asyncio
import json
import socket

import h11
import httpx
import pytest

from pdserve.launcher import start, start_instance, stop_all
from pdserve.net.http1 import Http1Server
from pdserve.net.listen import bind_socket


# Response headers that would end a line early or make a name of their own: each is refused, never written.
INJECTED = [(b"x-a", b"1\r\nx-b: 2"), (b"x-a", b"1\nx-b: 2"), (b"x-a", b"1\rx-b: 2"), (b"x-b\r\nx-c", b"1"),
            (b"x-b:x-c", b"1"), (b"x-b\n", b"1")]


async def echo(scope, receive, send):
    """Reads the whole body, then answers by path: a JSON echo, a stream, a failure, or nothing."""
    body, parts = b"", 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message["body"]
        parts += 1
        if not message["more_body"]:
            break
    path = scope["path"]
    if path == "/fail":
        raise ValueError("the app failed")
    if path == "/silent":
        return
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for i in range(3):
            await send({"type": "http.response.body", "body": b"part %d\n" % i, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    if path.startswith("/inject/"):
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/plain"), INJECTED[int(path.rsplit("/", 1)[1])]]})
        return
    answer = {"method": scope["method"], "path": path, "query": scope["query_string"].decode(), "size": len(body),
              "parts": parts, "client": list(scope["client"]), "server": list(scope["server"]),
              "headers": [[k.decode(), v.decode()] for k, v in scope["headers"]]}
    await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(answer).encode()})


class Served:
    """An Http1Server on an ephemeral port, in this test's own event loop."""

    def __init__(self, app=echo, **options) -> None:
        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.server = Http1Server(app, **{"keep_alive_s": 5.0, **options})

    async def __aenter__(self) -> Served:
        self.task = asyncio.create_task(self.server.serve([self.sock]))
        while not self.server.started:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.stop()
        await asyncio.wait_for(self.task, 10)
        assert not self.server.connections and not self.server.tasks

    async def raw(self, data: bytes, read_until_closed: bool = True, timeout: float = 5.0) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(data)
        try:
            return await asyncio.wait_for(reader.read() if read_until_closed else reader.read(65536), timeout)
        finally:
            writer.close()


def responses(data: bytes, methods: list[bytes] | None = None) -> list[tuple[int, dict, bytes]]:
    """Parse raw bytes, all a connection carried until the server closed it, as a client would (h11): (status,
    headers, body) of each response, in order. `methods` names the requests' methods where not GET (HEAD)."""
    conn = h11.Connection(h11.CLIENT)
    out, methods = [], list(methods or [])
    conn.receive_data(data)
    conn.receive_data(b"")
    while conn.their_state is not h11.CLOSED:
        conn.send(h11.Request(method=methods.pop(0) if methods else b"GET", target="/", headers=[("host", "x")]))
        conn.send(h11.EndOfMessage())
        head, body = None, b""
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            else:
                break
        if head is None:
            break
        out.append((head.status_code, {k.decode(): v.decode() for k, v in head.headers}, body))
        if not isinstance(event, h11.EndOfMessage) or conn.our_state is h11.MUST_CLOSE:
            break
        conn.start_next_cycle()
    return out


def test_requests_bodies_and_streams_through_httpx():
    async def run():
        async with Served() as s, httpx.AsyncClient(base_url=f"http://127.0.0.1:{s.port}", timeout=5) as c:
            r = await c.post("/a%20b?x=1&y=%2F", content=b"z" * 200_000, headers={"X-Test": "v"})
            assert r.status_code == 201 and r.headers["content-length"] == str(len(r.content))
            got = r.json()
            assert (got["path"], got["query"], got["size"]) == ("/a b", "x=1&y=%2F", 200_000)
            assert ["x-test", "v"] in got["headers"] and got["server"][1] == s.port

            async def upload():
                for _ in range(20):
                    yield b"y" * 5000
            r = await c.post("/chunked", content=upload())
            assert r.json()["size"] == 100_000 and r.json()["parts"] >= 1

            r = await c.get("/stream")
            assert r.headers["transfer-encoding"] == "chunked" and r.text == "part 0\npart 1\npart 2\n"
            r = await c.head("/anything")  # the head GET would get, no body
            assert r.status_code == 201 and int(r.headers["content-length"]) > 0 and r.content == b""
            assert (await c.get("/fail")).status_code == 500
            assert (await c.get("/silent")).status_code == 500
            assert (await c.get("/after")).json()["path"] == "/after"  # the connection pool still works
    asyncio.run(run())


def test_pipelined_requests_are_answered_in_order_and_http10_closes():
    async def run():
        async with Served() as s:
            data = await s.raw(b"GET /1 HTTP/1.1\r\nHost: x\r\n\r\n"
                               b"POST /2 HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
                               b"GET /3 HTTP/1.0\r\n\r\n"
                               b"GET /never HTTP/1.1\r\nHost: x\r\n\r\n")
            got = responses(data, [b"GET", b"POST", b"GET"])
            assert [json.loads(body)["path"] for _, _, body in got] == ["/1", "/2", "/3"]
            assert json.loads(got[1][2])["size"] == 3 and got[2][1].get("connection") == "close"
    asyncio.run(run())


def test_expect_100_continue_then_the_body():
    async def run():
        async with Served() as s:
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            writer.write(b"POST /c HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
            assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(b"abcd\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 201")
            writer.close()
    asyncio.run(run())


@pytest.mark.parametrize("request_bytes,status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
    (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),
], ids=["garbage", "bad-length", "long-header", "long-url"])
def test_malformed_or_oversized_heads_are_refused_and_closed(request_bytes, status):
    async def run():
        async with Served() as s:
            got = responses(await s.raw(request_bytes))
            assert [g[0] for g in got] == [status] and got[0][1]["connection"] == "close"
            assert (await s.raw(b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")).startswith(
                b"HTTP/1.1 201")  # the server is unhurt
    asyncio.run(run())


def test_an_upgrade_it_cannot_do_is_answered_in_http11():
    async def run():
        async with Served() as s:
            data = await s.raw(b"GET /u HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                               b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
                               b"GET /next HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert [json.loads(body)["path"] for _, _, body in responses(data)] == ["/u", "/next"]
    asyncio.run(run())


@pytest.mark.parametrize("case", range(len(INJECTED)))
def test_a_header_that_would_split_the_response_is_never_written(case):
    async def run():
        async with Served() as s:
            data = await s.raw(b"GET /inject/%d HTTP/1.1\r\nHost: x\r\n\r\n" % case)
            assert [g[0] for g in responses(data)] == [500] and b"x-b" not in data
    asyncio.run(run())


def test_the_app_is_told_when_its_client_leaves():
    seen: list[str] = []
    done = None

    async def app(scope, receive, send):
        await receive()  # the body
        seen.append((await receive())["type"])  # blocks until the client goes
        done.set()

    async def run():
        nonlocal done
        done = asyncio.Event()
        async with Served(app) as s:
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx")
            await asyncio.sleep(0.2)
            assert seen == []
            writer.close()
            await asyncio.wait_for(done.wait(), 5)
            assert seen == ["http.disconnect"]
    asyncio.run(run())


class GatedEcho:
    """The echo app, holding every request until `gate` is set (asyncio's events bind to a loop when first used)."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        await self.gate.wait()
        await echo(scope, receive, send)


def test_an_unread_upload_is_not_buffered_past_the_high_water_mark():
    app = GatedEcho()

    async def run():
        async with Served(app) as s:
            size = 8 << 20
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            writer.write(b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
            sender = asyncio.create_task(_write_all(writer, b"u" * size))
            await asyncio.sleep(0.5)
            (conn,) = s.server.connections
            assert len(conn.current.body) < 1 << 20 and not sender.done()  # held back by TCP, not in memory
            app.gate.set()
            await asyncio.wait_for(sender, 10)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
            assert json.loads(await reader.readexactly(length))["size"] == size
            writer.close()
    asyncio.run(run())


async def _write_all(writer, data: bytes) -> None:
    writer.write(data)
    await writer.drain()


def test_a_client_that_does_not_read_holds_back_a_stream():
    sent = [0]

    async def flood(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(400):
            await send({"type": "http.response.body", "body": b"f" * 65536, "more_body": True})
            sent[0] += 65536
        await send({"type": "http.response.body", "body": b""})

    async def run():
        async with Served(flood) as s:
            sock = socket.create_connection(("127.0.0.1", s.port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            sock.sendall(b"GET /f HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            await asyncio.sleep(0.5)
            assert sent[0] < 8 << 20  # 26 MB would have gone into the server's buffer without flow control
            sock.setblocking(False)
            loop, total = asyncio.get_running_loop(), 0
            while True:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 10)
                if not chunk:
                    break
                total += len(chunk)
            sock.close()
            assert sent[0] == 400 * 65536 and total > sent[0]
    asyncio.run(run())


def test_idle_connections_close_and_a_stop_lets_requests_in_flight_finish():
    app = GatedEcho()

    async def run():
        async with Served(app, keep_alive_s=0.3) as s:
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            assert await asyncio.wait_for(reader.read(), 5) == b""  # idle past keep-alive: closed by the server
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            writer.write(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0.1)
            s.server.stop()
            await asyncio.sleep(0.1)
            with pytest.raises(OSError):
                await asyncio.open_connection("127.0.0.1", s.port)  # no longer accepting
            app.gate.set()
            got = responses(await asyncio.wait_for(reader.read(), 5))
            assert [g[0] for g in got] == [201] and got[0][1]["connection"] == "close"
            writer.close()
    asyncio.run(run())


def test_a_stop_cancels_what_outlives_its_deadline():
    cancelled = []

    async def stuck(scope, receive, send):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(scope["path"])
            raise

    async def run():
        async with Served(stuck, graceful_s=0.3) as s:
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            writer.write(b"GET /stuck HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0.1)
            s.server.stop()
            await asyncio.wait_for(s.task, 5)
            assert cancelled == ["/stuck"] and await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
    asyncio.run(run())


RAW_REQUESTS = {
    "completion": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n%s",
    "stream": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s",
    "http10": b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s",
    "chunked": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"%x\r\n%s\r\n0\r\n\r\n",
    "not-json": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 5\r\n\r\n{nope",
    "no-route": b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    "method": b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    "health": b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    "head-health": b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    "pipelined": b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    "garbage": b"\x00\x01 nonsense\r\n\r\n",
}
# Servers differ on these and both are right: a Date, a Server name, and how a body is framed (a whole body with its
# Content-Length, or chunks), which the client's parser undoes.
_SERVERS_DIFFER_ON = {"date", "server", "content-length", "transfer-encoding"}


@pytest.fixture(scope="module")
def two_fronts(models):
    """One colocated instance; a gateway in front of it on each HTTP server."""
    procs = []
    try:
        procs.append(start_instance(models("llama"), "--max-model-len", "128", "--num-kv-blocks", "32", name="C"))
        for http in ("pdserve", "uvicorn"):
            procs.append(start("gateway", ["gateway", "--both", procs[0].url, "--protocol", "colocated",
                                           "--port", "0", "--log-level", "warning", "--http-server", http]))
        yield procs[1], procs[2]
    finally:
        stop_all(procs)


@pytest.mark.parametrize("name", sorted(RAW_REQUESTS))
def test_the_gateway_answers_alike_on_either_server(two_fronts, name):
    raw = RAW_REQUESTS[name]
    if b"%" in raw:
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "stream": name == "stream"}).encode()
        raw = raw % (len(body), body)
    methods = [b"HEAD"] if name.startswith("head") else None
    seen = []
    for gateway in two_fronts:
        host, port = gateway.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(raw)  # the last request says Connection: close: the server answers, then closes
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        seen.append([(status, {k: v if "request-id" not in k else "an id" for k, v in headers.items()
                               if k not in _SERVERS_DIFFER_ON},
                      _comparable(body) if name != "garbage" else None)  # each server's own words for it
                     for status, headers, body in responses(data, methods)])
    assert seen[0] == seen[1] and seen[0]


def _comparable(body: bytes) -> object:
    """Bodies minus what differs from one request to the next (ids, times)."""
    if body.startswith(b"data: "):
        events = [json.loads(line[6:]) for line in body.split(b"\n\n") if line.startswith(b"data: {")]
        return [[c.get("text") for c in e.get("choices", [])] for e in events]
    try:
        parsed = json.loads(body)
    except ValueError:
        return body
    if isinstance(parsed, dict) and "choices" in parsed:
        return [c.get("text") for c in parsed["choices"]], parsed.get("usage")
    return parsed
