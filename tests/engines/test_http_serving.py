"""Connection limits of the engine server, the REST API and (tests/agents/test_proxy_limits.py)
the agent proxy, against real servers on 127.0.0.1 and real sockets: idle sockets from one
address without the token cannot starve clients that have it, a request that does not arrive in
time is cut, a busy engine (503 with Retry-After) is asked again instead of being dropped, and
integers too long to read get 400."""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.auth import JobSecret
from relax_hpc.engines.http import client as http_client
from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.elastic.api import ElasticReply
from relax_hpc.engines.http.client import EngineHttpError, HttpEngine
from relax_hpc.engines.http.server import EngineServer, ServerLimits
from relax_hpc.engines.http.serving import ServingLimits
from relax_hpc.engines.memory import ScriptedEngine
from relax_hpc.engines.elastic.remote import RemoteEngineClient
from relax_hpc.engines.elastic.rest_api import RestClient, RestServer, make_rest_app
from relax_hpc.models.hf import load_tokenizer
from socket_waits import closed_by_server

WAIT_S = 10.0  # a generous bound on anything that should happen within a fraction of a second
TOKEN = JobSecret.generate().token("engine-http")
OTHER_PEER = "127.0.0.2"  # another address of this machine: the sockets of "someone else"
PARAMS = SamplingParams(max_new_tokens=2)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def engine(tokenizer: Any) -> ScriptedEngine:
    return ScriptedEngine(tokenizer, ["7"])


def _idle(port: int, stack: ExitStack, count: int) -> list[socket.socket]:
    """`count` connections from OTHER_PEER that never send a byte."""
    return [stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=WAIT_S,
                                                         source_address=(OTHER_PEER, 0))) for _ in range(count)]


def _closed_by_server(sockets: list[socket.socket], expected: int) -> list[int]:
    return closed_by_server(sockets, expected, WAIT_S)


def _still_open(sockets: list[socket.socket]) -> bool:
    readable, _, _ = select.select(sockets, [], [], 0)
    return not readable


def _wait_for(predicate: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, "the server did not get there"
        time.sleep(0.01)


def test_idle_sockets_from_one_address_do_not_starve_the_engines_clients(engine: ScriptedEngine) -> None:
    """Issue #33 item 1: 64 idle sockets made the job's next /generate get 503."""
    limits = ServerLimits(request_timeout_s=WAIT_S * 3)  # the defaults: 64 connections, 16 per address
    with EngineServer(engine, token=TOKEN, limits=limits) as server, ExitStack() as stack:
        idle = _idle(server.port, stack, 70)
        # Each connection past 16 closed the address's oldest: the first 54 are gone, the last 16 held.
        assert _closed_by_server(idle, 54) == list(range(54))
        gens = HttpEngine(server.url, token=TOKEN, retries=0).generate([[1, 2]], PARAMS)
        assert gens[0].text == "7" and len(engine.calls) == 1
        assert _still_open(idle[54:])
        _wait_for(lambda: server.open_connections == 16)  # the client kept no connection; the server sees it closed soon


def test_a_connection_that_showed_the_token_is_not_counted_against_its_address(engine: ScriptedEngine) -> None:
    limits = ServerLimits(request_timeout_s=WAIT_S * 3)
    with EngineServer(engine, token=TOKEN, limits=limits) as server, ExitStack() as stack:
        keep = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S, source_address=(OTHER_PEER, 0))
        stack.callback(keep.close)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        keep.request("GET", "/health", headers=auth)
        assert keep.getresponse().read() == b'{"status":"ok"}'
        idle = _idle(server.port, stack, 20)  # the same address: 16 may stay, the keep-alive one is not one of them
        assert _closed_by_server(idle, 4) == [0, 1, 2, 3]
        keep.request("GET", "/health", headers=auth)  # the same connection, still open
        assert keep.getresponse().status == 200


def test_a_busy_engine_is_asked_again_not_dropped(engine: ScriptedEngine, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """503 (the connection limit) is transient for the router's client: it waits Retry-After and asks
    again within its timeout, and only a server busy for the whole timeout is a failed engine."""
    with EngineServer(engine, token=TOKEN, limits=ServerLimits(max_connections=1), weights_root=tmp_path) as server, \
            ExitStack() as stack:
        client = RemoteEngineClient("grow-0", server.url, TOKEN, tmp_path, timeout_s=5)
        _wait_for(lambda: server.open_connections == 0)  # the checks' connections are gone
        [held] = _idle(server.port, stack, 1)
        _wait_for(lambda: server.open_connections == 1)
        waits: list[float] = []

        def release_once(seconds: float) -> None:  # the first wait frees the slot: the retry is served
            waits.append(seconds)
            held.close()
            _wait_for(lambda: server.open_connections == 0)

        monkeypatch.setattr(http_client, "_sleep", release_once)
        assert client.submit([[1, 2]], PARAMS, 0).result()[0].text == "7"
        assert waits == [1.0]  # the server's Retry-After, once
        assert len(engine.calls) == 1

        # Busy for longer than the timeout: a failure, and the router drops the engine.
        [held] = _idle(server.port, stack, 1)
        _wait_for(lambda: server.open_connections == 1)
        now = [0.0]
        monkeypatch.setattr(http_client, "_clock", lambda: now[0])
        monkeypatch.setattr(http_client, "_sleep", lambda seconds: now.__setitem__(0, now[0] + seconds))
        failed = client.submit([[1, 2]], PARAMS, 0).exception()
        assert isinstance(failed, EngineHttpError) and client.died(failed)
        assert "HTTP 503" in str(failed) and "(busy for 5 s)" in str(failed) and now[0] == 5.0
        assert len(engine.calls) == 1
        client.close()


def test_429_is_asked_again_after_its_retry_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that answers 429 (SGLang's queue, a proxy in front): busy, asked again after Retry-After."""
    answers = [(429, b'{"error": {"message": "queue full"}}')]
    reply = [{"text": "7", "output_ids": [7], "meta_info": {"id": "r", "finish_reason": {"type": "stop"},
                                                           "output_token_logprobs": [[-0.5, 7, None]]}}]

    class Busy(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            status, body = answers.pop(0) if answers else (200, json.dumps(reply).encode())
            self.send_response(status)
            if status == 429:
                self.send_header("Retry-After", "2")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    stub = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    waits: list[float] = []
    monkeypatch.setattr(http_client, "_sleep", waits.append)
    try:
        client = HttpEngine(f"http://127.0.0.1:{stub.server_address[1]}", token=TOKEN, retries=0, busy_wait_s=30)
        assert client.generate([[1]], PARAMS)[0].token_ids == [7]
        assert waits == [2.0] and answers == []
    finally:
        stub.shutdown()
        stub.server_close()


def test_a_request_must_arrive_within_the_deadline_on_the_rest_api() -> None:
    """Issue #33 item 7: idle and half-sent connections to the REST API were held for ever."""
    control = _Control()
    limits = ServingLimits(request_timeout_s=0.5, max_connections=64, max_untrusted_per_peer=16)
    with RestServer(make_rest_app(control, TOKEN), host="127.0.0.1", limits=limits) as server, \
            ExitStack() as stack:
        half = stack.enter_context(socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S))
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ")  # and never the rest
        idle = _idle(server.port, stack, 40)
        assert _closed_by_server(idle, 24) == list(range(24))  # 16 per address without the token
        with RestClient(server.url, TOKEN, timeout_s=WAIT_S) as rest:
            assert rest.get("/rollout/engines") == (200, {"action": "engines"})
        assert _closed_by_server([half], 1) == [0]  # cut at the deadline, no reply
        assert _closed_by_server(idle[24:], 16) == list(range(16))  # the idle ones too


def test_the_rest_api_answers_a_bad_content_length_with_its_own_400() -> None:
    with RestServer(make_rest_app(_Control(), TOKEN), host="127.0.0.1") as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
            sock.sendall(f"POST /rollout/scale_out HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                         f"Content-Length: {'9' * 5000}\r\n\r\n{{}}".encode())
            reply = b""
            while not reply.endswith(b'"}'):  # one reply; the connection stays open for the next
                chunk = sock.recv(65536)
                assert chunk, reply
                reply += chunk
    assert reply.startswith(b"HTTP/1.1 413 ")  # h11 alone answers it with a plain-text 400
    assert "at most 1048576 are accepted" in json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]


def test_a_refusal_before_the_body_is_read_says_connection_close() -> None:
    """The REST API and the agent proxy answered 401 from the headers and closed the connection
    without saying so: a keep-alive client sent its next request down it and got no reply at all
    ("Server disconnected without sending a response"), once in a while under load."""
    body = json.dumps({"count": 1})

    def post(port: int, token: str) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
        conn.request("POST", "/rollout/scale_out", body=body,
                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        reply = conn.getresponse()
        reply.read()
        conn.close()
        return reply

    with RestServer(make_rest_app(_Control(), TOKEN), host="127.0.0.1") as server:
        refused = post(server.port, "wrong")
        assert refused.status == 401 and refused.getheader("Connection") == "close"
        served = post(server.port, TOKEN)  # the body read whole: the connection may stay
        assert served.status == 200 and served.getheader("Connection") is None
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
        conn.request("GET", "/health", headers={"Authorization": "Bearer wrong"})  # no body to leave unread
        reply = conn.getresponse()
        reply.read()
        conn.close()
        assert reply.status == 401 and reply.getheader("Connection") is None


def test_an_integer_too_long_to_read_gets_400_from_the_engine_server(engine: ScriptedEngine) -> None:
    """Issue #33 item 12: the handler raised, dropped the connection and logged a traceback."""
    with EngineServer(engine, token=TOKEN) as server:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
        body = b'{"input_ids": [' + b"1" * 5000 + b"]}"
        connection.request("POST", "/generate", body=body, headers={"Authorization": f"Bearer {TOKEN}"})
        reply = connection.getresponse()
        status, message = reply.status, json.loads(reply.read())["error"]["message"]
        connection.close()
        assert status == 400 and "a number too long to read" in message and "4300 digits" in message
        assert engine.calls == []
        assert HttpEngine(server.url, token=TOKEN).generate([[1]], PARAMS)[0].text == "7"


class _Control:
    def elastic(self, action: str, body: dict[str, Any]) -> ElasticReply:
        return ElasticReply(200, {"action": action})
