"""The elastic REST API against a real uvicorn server on 127.0.0.1 (port 0) and real clients
(httpx, raw sockets, `RestClient`), over a fake `ElasticControl` that records its calls and
answers canned replies: the token is checked on every path before the body is read, each route
is one control action, replies pass through as they are, bad bodies get 400/413, unknown routes
404/405, a dead control 503 without a traceback, and the server closes its port on stop()."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from relax_hpc.auth import JobSecret
from relax_hpc.engines.elastic.api import ElasticReply, error_reply
from relax_hpc.engines.elastic.rest_api import (
    MAX_BODY_BYTES,
    REST_TOKEN_PURPOSE,
    RestClient,
    RestServer,
    RestServerError,
    RestUnavailable,
    make_rest_app,
)

WAIT_S = 10.0  # a generous bound on anything that should happen within a fraction of a second
TOKEN = JobSecret.generate().token(REST_TOKEN_PURPOSE)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OP = {"id": "op-1", "kind": "scale_out", "state": "pending", "engines": [], "message": "",
      "requested": {"num_engines": 2}, "started_at": 1.0, "finished_at": None}


class FakeControl:
    """Records (action, body); answers `replies[action]`, or 200 {"action": action}; raises `error` if set."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.replies: dict[str, Any] = {}
        self.error: Exception | None = None

    def elastic(self, action: str, body: dict[str, Any]) -> ElasticReply:
        self.calls.append((action, body))
        if self.error is not None:
            raise self.error
        reply: ElasticReply = self.replies.get(action, ElasticReply(200, {"action": action}))
        return reply


@pytest.fixture(scope="module")
def shared() -> Iterator[tuple[FakeControl, RestServer]]:
    """One server for the module (stopping one takes uvicorn a few tenths of a second)."""
    control = FakeControl()
    with RestServer(make_rest_app(control, TOKEN, max_body_bytes=4096), host="127.0.0.1") as server:
        yield control, server


@pytest.fixture
def control(shared: tuple[FakeControl, RestServer]) -> FakeControl:
    """The shared server's control, with no calls, replies or error left from an earlier test."""
    control = shared[0]
    control.calls.clear()
    control.replies.clear()
    control.error = None
    return control


@pytest.fixture
def server(shared: tuple[FakeControl, RestServer], control: FakeControl) -> RestServer:
    return shared[1]


@pytest.fixture
def http(server: RestServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=WAIT_S, trust_env=False) as client:
        yield client


def _raw(server: RestServer, request: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    """Send `request` (head, maybe no body) on a fresh socket; the status, headers and JSON body."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {name.lower(): value for name, _, value in (line.partition(": ") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


def _length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


ROUTES = [("GET", "/health"), ("GET", "/rollout/engines"), ("POST", "/rollout/scale_out"),
          ("POST", "/rollout/scale_in"), ("GET", "/rollout/operations"), ("GET", "/rollout/operations/op-1"),
          ("GET", "/nope"), ("DELETE", "/rollout/engines"), ("GET", "/docs"), ("GET", "/openapi.json"),
          ("GET", "/redoc")]


@pytest.mark.parametrize("method,path", ROUTES)
# Ids without the token: it is random per process, and two test workers must collect the same ids.
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {TOKEN}", f"Bearer {TOKEN}x"],
                         ids=["none", "wrong", "basic-scheme", "token-plus-one-char"])
def test_every_path_refuses_a_missing_or_wrong_token(http: httpx.Client, control: FakeControl, method: str,
                                                     path: str, authorization: str | None) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    reply = http.request(method, path, headers=headers, json={"num_engines": 1} if method == "POST" else None)
    assert reply.status_code == 401
    assert reply.headers["www-authenticate"] == "Bearer"
    error = reply.json()["error"]
    assert "Authorization: Bearer <token>" in error and "JobSecret.token('rest')" in error
    assert "cluster.json" in error and "docs/federation.md" in error
    assert control.calls == []


def test_the_token_is_checked_before_the_body_is_read(server: RestServer) -> None:
    # A body of 1 GB is announced and never sent: the server answers from the head alone.
    status, headers, body = _raw(server, b"POST /rollout/scale_out HTTP/1.1\r\nHost: x\r\n"
                                         b"Content-Length: 1000000000\r\nExpect: 100-continue\r\n\r\n")
    assert status == 401 and headers["www-authenticate"] == "Bearer" and "bearer token" in body["error"]


def test_docs_and_openapi_are_off_behind_the_token(http: httpx.Client) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        reply = http.get(path, headers=AUTH)
        assert reply.status_code == 404 and reply.json()["error"].startswith(f"no route GET {path}")


def test_health(http: httpx.Client, control: FakeControl) -> None:
    reply = http.get("/health", headers=AUTH)
    assert (reply.status_code, reply.json()) == (200, {"status": "ok"})
    assert control.calls == []


@pytest.mark.parametrize("method,path,body,action,passed", [
    ("GET", "/rollout/engines", None, "engines", {}),
    ("POST", "/rollout/scale_out", {"num_engines": 2}, "scale_out", {"num_engines": 2}),
    ("POST", "/rollout/scale_out", {"engine_urls": ["http://n1:30000"], "job": "77"}, "scale_out",
     {"engine_urls": ["http://n1:30000"], "job": "77"}),
    ("POST", "/rollout/scale_in", {"engine_ids": ["e1"], "force": True, "timeout_s": 5.5}, "scale_in",
     {"engine_ids": ["e1"], "force": True, "timeout_s": 5.5}),
    ("POST", "/rollout/scale_in", {}, "scale_in", {}),  # the control says which keys are missing
    ("POST", "/rollout/scale_in", {"bogus": [1, {"x": None}]}, "scale_in", {"bogus": [1, {"x": None}]}),
    ("GET", "/rollout/operations", None, "operations", {}),
    ("GET", "/rollout/operations/op-17", None, "operation", {"id": "op-17"}),
])
def test_each_route_is_one_action_with_its_body(http: httpx.Client, control: FakeControl, method: str, path: str,
                                                body: Any, action: str, passed: dict[str, Any]) -> None:
    reply = http.request(method, path, headers=AUTH, json=body)
    assert (reply.status_code, reply.json()) == (200, {"action": action})
    assert control.calls == [(action, passed)]


@pytest.mark.parametrize("reply", [
    ElasticReply(200, {"engines": [], "operation": None}),
    ElasticReply(202, {"operation": OP}),
    error_reply(400, "num_engines must be an integer >= 1, got 0"),
    error_reply(404, "no operation 'op-9'; GET /rollout/operations lists them"),
    error_reply(409, "another operation is in progress", operation=OP),
])
def test_replies_pass_through_with_status_and_body(http: httpx.Client, control: FakeControl,
                                                   reply: ElasticReply) -> None:
    control.replies["scale_out"] = reply
    answer = http.post("/rollout/scale_out", headers=AUTH, json={"num_engines": 2})
    assert (answer.status_code, answer.json()) == (reply.status, reply.body)


@pytest.mark.parametrize("content,what", [
    (b"[1, 2]", "an array"), (b'"two"', "a string"), (b"2", "a number"), (b"null", "null"), (b"true", "a boolean"),
    (b"{num_engines: 2}", "not valid JSON"), (b"", "empty"), (b"\xff\xfe{", "not valid JSON"),
])
def test_a_body_that_is_not_a_json_object_is_400(http: httpx.Client, control: FakeControl, content: bytes,
                                                 what: str) -> None:
    reply = http.post("/rollout/scale_in", headers={**AUTH, "Content-Type": "application/json"}, content=content)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert what in error and 'send a JSON object, e.g. {"num_engines": 1}' in error
    assert control.calls == []


def test_a_body_nested_too_deep_to_decode_is_400(control: FakeControl) -> None:
    # 100 000 levels (200 kB, under the default 1 MiB): the decoder's RecursionError, not a 500.
    with RestServer(make_rest_app(control, TOKEN), host="127.0.0.1") as server:
        reply = httpx.post(server.url + "/rollout/scale_out", headers=AUTH, timeout=WAIT_S,
                           content=b"[" * 100_000 + b"]" * 100_000)
    assert reply.status_code == 400 and reply.json()["error"].startswith("the body nests too deep to decode; ")
    assert control.calls == []


def test_an_oversized_body_is_413(http: httpx.Client, control: FakeControl, server: RestServer) -> None:
    # The fixture's limit is 4096 bytes: announced by Content-Length, or sent chunked without one.
    big = {"engine_urls": ["http://node:30000"] * 400}
    reply = http.post("/rollout/scale_out", headers=AUTH, json=big)
    assert reply.status_code == 413 and "at most 4096 are accepted" in reply.json()["error"]
    chunked = http.post("/rollout/scale_out", headers=AUTH, content=iter([b'{"engine_urls": [', b'"x", ' * 1000]))
    assert chunked.status_code == 413 and "over 4096 bytes" in chunked.json()["error"]
    status, _, body = _raw(server, b"POST /rollout/scale_in HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                                   + TOKEN.encode() + b"\r\nContent-Length: 1000000000\r\n\r\n")
    assert status == 413 and "1000000000 bytes" in body["error"]
    assert control.calls == []
    assert http.get("/health", headers=AUTH).status_code == 200  # still serving


def test_the_default_limit_is_one_mib(control: FakeControl) -> None:
    assert MAX_BODY_BYTES == 1024 * 1024
    with RestServer(make_rest_app(control, TOKEN), host="127.0.0.1") as server:
        status, _ = RestClient(server.url, TOKEN).post("/rollout/scale_out", {"pad": "x" * MAX_BODY_BYTES})
    assert status == 413 and control.calls == []


def test_an_unknown_route_is_404_naming_the_routes(http: httpx.Client) -> None:
    reply = http.get("/rollout/engine", headers=AUTH)
    assert reply.status_code == 404
    assert reply.json() == {"error": "no route GET /rollout/engine; routes: GET /health, GET /rollout/engines, "
                                     "POST /rollout/scale_out, POST /rollout/scale_in, GET /rollout/operations, "
                                     "GET /rollout/operations/{op_id}"}


@pytest.mark.parametrize("method,path,allowed", [("GET", "/rollout/scale_out", "POST"),
                                                 ("POST", "/rollout/engines", "GET"),
                                                 ("DELETE", "/rollout/operations/op-1", "GET")])
def test_a_wrong_method_is_405_in_the_error_shape(http: httpx.Client, control: FakeControl, method: str, path: str,
                                                  allowed: str) -> None:
    reply = http.request(method, path, headers=AUTH)
    assert reply.status_code == 405
    error = reply.json()["error"]
    assert error.startswith(f"method {method} is not allowed on {path} (it takes {allowed}") and "routes: " in error
    assert allowed in reply.headers["allow"]
    assert control.calls == []


def test_a_control_that_raises_is_503_without_a_traceback(http: httpx.Client, control: FakeControl,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    control.error = RuntimeError("The actor died unexpectedly before finishing this task.\n"
                                 "Traceback (most recent call last):\n  File \"rollout.py\", line 1")
    with caplog.at_level(logging.ERROR, logger="relax_hpc.engines.elastic.rest_api"):
        reply = http.get("/rollout/engines", headers=AUTH)
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error.startswith("the rollout role did not answer: RuntimeError: The actor died unexpectedly before "
                            "finishing this task.; ")
    assert "Traceback" not in reply.text and "rollout.py" not in reply.text
    assert any(r.exc_info and "'engines'" in r.getMessage() for r in caplog.records)  # the driver log keeps it
    control.error = None
    assert http.get("/rollout/engines", headers=AUTH).status_code == 200  # and the server goes on


@pytest.mark.parametrize("bad", [None, {"status": 200}, ElasticReply(200, {"t": object()}),
                                 ElasticReply(200, {"x": float("nan")}), ElasticReply(42, {})])
def test_a_reply_that_is_not_an_elastic_reply_is_500(http: httpx.Client, control: FakeControl, bad: Any) -> None:
    control.replies["operations"] = bad
    reply = http.get("/rollout/operations", headers=AUTH)
    assert reply.status_code == 500
    assert "reply to 'operations' is not an HTTP status and a JSON object" in reply.json()["error"]


def test_rest_client_round_trips_and_returns_errors(server: RestServer, control: FakeControl) -> None:
    control.replies["scale_in"] = error_reply(409, "another operation is in progress", operation=OP)
    with RestClient(server.url + "/", TOKEN) as client:
        assert client.get("/health") == (200, {"status": "ok"})
        assert client.post("/rollout/scale_out", {"num_engines": 3}) == (200, {"action": "scale_out"})
        assert client.post("/rollout/scale_in", {"num_engines": 1}) == (
            409, {"error": "another operation is in progress", "operation": OP})
        assert client.get("/rollout/nope")[0] == 404
        with pytest.raises(ValueError, match="starts with '/'"):
            client.get("rollout/engines")
    assert control.calls == [("scale_out", {"num_engines": 3}), ("scale_in", {"num_engines": 1})]
    status, body = RestClient(server.url, "x" * 64).get("/rollout/engines")
    assert status == 401 and "bearer token" in body["error"]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_rest_client_raises_rest_unavailable_naming_the_url() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(RestUnavailable, match=f"REST server at {url} did not answer GET /rollout/engines"):
        RestClient(url, TOKEN, timeout_s=WAIT_S).get("/rollout/engines")
    # A server that accepts the connection and never answers: the client's timeout.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(RestUnavailable, match="cluster.json"):
            RestClient(url, TOKEN, timeout_s=0.2).post("/rollout/scale_out", {"num_engines": 1})
    with pytest.raises(ValueError, match="starts with http://"):
        RestClient("node:8000", TOKEN)


def test_the_server_binds_port_0_and_closes_it_on_stop(control: FakeControl) -> None:
    server = RestServer(make_rest_app(control, TOKEN), host="127.0.0.1")
    server.start()
    assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}"
    assert RestClient(server.url, TOKEN).get("/health")[0] == 200
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S):
        pass  # an idle keep-alive connection does not hold stop() up
    server.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S).close()
    server.stop()  # a second stop is harmless


def test_a_port_in_use_fails_start_with_a_clear_error(control: FakeControl) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(RestServerError, match=f"cannot listen on 127.0.0.1:{port}.*pick another port"):
            RestServer(make_rest_app(control, TOKEN), host="127.0.0.1", port=port).start()


def test_a_short_token_is_refused(control: FakeControl) -> None:
    with pytest.raises(ValueError, match="the REST server needs a bearer token of at least 32"):
        make_rest_app(control, "short")
