"""The engine HTTP server's limits against a real server on 127.0.0.1 and real sockets: a slow or
idle client is cut at the request deadline, connections past the cap get 503 and no thread, an
oversized body is refused from its Content-Length, deep JSON and oversized batches get 400, and
the server keeps serving after each. Plus the warning of `serve-engine --host 0.0.0.0`."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.auth import JobSecret
from relax_hpc.cli.main import main
from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.http.client import EngineHttpError, HttpEngine
from relax_hpc.engines.http.server import (
    EngineServer,
    JsonBodyError,
    ServerLimits,
    exposure_warning,
    load_json_body,
)
from relax_hpc.engines.memory import ScriptedEngine
from relax_hpc.models.hf import load_tokenizer

WAIT_S = 10.0  # a generous bound on anything that should happen within a fraction of a second
TOKEN = JobSecret.generate().token("engine-http")
AUTH = f"Authorization: Bearer {TOKEN}\n"  # a header line of the raw requests below


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def engine(tokenizer: Any) -> ScriptedEngine:
    return ScriptedEngine(tokenizer, ["7"])


@pytest.fixture
def small(engine: ScriptedEngine) -> Iterator[EngineServer]:
    """A server with every limit small enough to reach from a test."""
    limits = ServerLimits(request_timeout_s=0.5, max_connections=2, max_body_bytes=4096, max_json_depth=8,
                          max_prompts=4, max_request_prompt_tokens=20,
                          max_request_new_tokens=16)
    with EngineServer(engine, token=TOKEN, limits=limits) as server:
        yield server


def _connect(server: EngineServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (recv returns b'')."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _post(server: EngineServer, body: bytes) -> tuple[int, dict[str, Any]]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
    try:
        connection.request("POST", "/generate", body=body,
                           headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
        reply = connection.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        connection.close()


def _serves(server: EngineServer) -> bool:
    """Poll /health until it answers (connections just closed free their slots a moment later)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if HttpEngine(server.url, token=TOKEN, timeout_s=WAIT_S).health():
            return True
        time.sleep(0.05)
    return False


def test_limits_are_checked_and_name_their_option() -> None:
    with pytest.raises(ValueError) as error:
        ServerLimits(request_timeout_s=0, max_connections=0, max_request_new_tokens=True)  # type: ignore[arg-type]
    message = str(error.value)
    assert "request_timeout_s (--request-timeout-s) must be a number of seconds > 0, got 0" in message
    assert "max_connections (--max-connections) must be an integer >= 1, got 0" in message
    assert "max_request_new_tokens (--max-new-tokens) must be an integer >= 1, got True" in message


def test_an_idle_connection_is_closed_after_the_timeout(small: EngineServer) -> None:
    # Keep-alive still works within the timeout: two requests on one connection.
    connection = http.client.HTTPConnection("127.0.0.1", small.port, timeout=WAIT_S)
    for _ in range(2):
        connection.request("GET", "/health", headers={"Authorization": f"Bearer {TOKEN}"})
        reply = connection.getresponse()
        assert (reply.status, json.loads(reply.read())) == (200, {"status": "ok"})
    assert connection.sock is not None
    assert connection.sock.recv(1) == b""  # then the server closes it: nothing more came
    connection.close()
    with _connect(small) as sock:  # connected, never sends a byte
        assert sock.recv(1) == b""
    assert _serves(small)


def test_a_client_trickling_its_request_is_cut_at_the_deadline(small: EngineServer) -> None:
    # One header byte every 20 ms never ends the request; each read is quick, the request is not.
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
    closed = False
    with _connect(small) as sock:
        sock.settimeout(0.02)
        deadline = time.monotonic() + WAIT_S
        for byte in request:
            if time.monotonic() > deadline:
                break
            try:
                sock.send(bytes([byte]))
                closed = sock.recv(1) == b""
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            if closed:
                break
    assert closed, "the server kept reading a request that never ends"
    assert _serves(small)


def test_connections_past_the_cap_get_503_and_no_thread(engine: ScriptedEngine) -> None:
    with EngineServer(engine, token=TOKEN, limits=ServerLimits(max_connections=2, request_timeout_s=WAIT_S)) as server:
        threads = threading.active_count()
        with ExitStack() as sockets:
            held = [sockets.enter_context(_connect(server)) for _ in range(2)]  # the cap; they send nothing
            extra = [sockets.enter_context(_connect(server)) for _ in range(5)]
            for sock in extra:
                reply = _read_until_closed(sock)  # answered and closed at once, without a request
                assert reply.startswith(b"HTTP/1.1 503 ")
                message = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"]
                assert "limit of 2 connections (--max-connections); retry later" in message
            for sock in held:  # still open, still waiting for a request
                sock.settimeout(0.05)
                with pytest.raises(TimeoutError):
                    sock.recv(1)
            assert threading.active_count() <= threads + 2
        assert _serves(server)  # the held connections closed: their slots are free again


def test_a_body_over_the_limit_is_refused_from_its_content_length(
    small: EngineServer, engine: ScriptedEngine
) -> None:
    # 100 MiB announced, 2 bytes sent: the 413 comes without the server waiting for the rest.
    head = f"POST /generate HTTP/1.1\nHost: x\n{AUTH}Content-Length: {100 << 20}\n"
    with _connect(small) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n{}")
        reply = b""
        while b"}}" not in reply:
            chunk = sock.recv(65536)
            assert chunk, reply
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413 ") and b"Connection: close" in reply
    message = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    assert message == "the body is 104857600 bytes; at most 4096 are accepted (--max-body-bytes)"
    # A client that sends its whole body before reading reads the 413, not a broken pipe.
    client = HttpEngine(small.url, token=TOKEN, retries=3, backoff_s=10.0)  # a retry would take 10 s
    with pytest.raises(EngineHttpError, match=r"HTTP 413: the body is \d+ bytes; at most 4096"):
        client.generate([[1] * 20] * 200, SamplingParams())
    assert engine.calls == []
    assert _serves(small)


@pytest.mark.parametrize(
    ("head", "status", "says"),
    [
        ("POST /generate HTTP/1.1\nHost: x\n" + AUTH, 411, "needs a Content-Length header"),
        ("POST /generate HTTP/1.1\nHost: x\n" + AUTH + "Content-Length: -5\n", 400,
         "Content-Length \"-5\" is not a byte count"),
        ("POST /generate HTTP/1.1\nHost: x\n" + AUTH + "Content-Length: 1_0\n", 400, "is not a byte count"),
        ("POST /generate HTTP/1.1\nHost: x\n" + AUTH + "Content-Length: " + "9" * 5000 + "\n", 413,
         "is over the limit of 4096"),
        ("POST /generate HTTP/1.1\nHost: x\n" + AUTH + "Content-Length: 30\n", 400,
         "the body ended after 2 of its 30 bytes"),
    ],
    ids=["missing", "negative", "underscore", "huge", "short"],
)
def test_content_length_must_be_a_byte_count(small: EngineServer, head: str, status: int, says: str) -> None:
    # The client half-closes after "{}", so a short body ends instead of waiting for the deadline.
    with _connect(small) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n{}")
        sock.shutdown(socket.SHUT_WR)
        data = _read_until_closed(sock)
    assert int(data.split(b" ", 2)[1]) == status
    assert says in json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["message"]


@pytest.mark.parametrize(
    "body",
    [b"[" * 4000, b'{"input_ids": ' + b"[" * 9 + b"1" + b"]" * 9 + b"}"],
    ids=["past-the-recursion-limit", "one-past-the-limit"],  # Python's limit is 1000 frames
)
def test_deep_json_gets_400(small: EngineServer, body: bytes) -> None:
    status, reply = _post(small, body)
    assert status == 400
    assert reply["error"]["message"] == "the JSON body nests more than 8 levels deep; at most 8 are accepted"
    assert _serves(small)


def test_load_json_body_counts_levels() -> None:
    assert load_json_body(b"[" * 8 + b"]" * 8, 8) == [[[[[[[[]]]]]]]]
    assert load_json_body(b'{"a": [{"b": 1}]}', 3) == {"a": [{"b": 1}]}
    with pytest.raises(JsonBodyError, match="nests more than 2 levels"):
        load_json_body(b'{"a": [{"b": 1}]}', 2)
    with pytest.raises(JsonBodyError, match="not valid JSON"):
        load_json_body(b"\xff", 2)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"input_ids": [[1]] * 5},
         "input_ids holds 5 prompts; this server takes at most 4 in one request (--max-prompts): split the batch"),
        ({"input_ids": [[1] * 11, [2] * 10]},
         "input_ids holds 21 prompt tokens in all; this server takes at most 20 in one request (--max-prompt-tokens)"),
        ({"input_ids": [1] * 21},
         "input_ids holds 21 prompt tokens in all; this server takes at most 20 in one request (--max-prompt-tokens)"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 17}},
         "sampling_params.max_new_tokens = 17 is over this server's limit of 16 (--max-new-tokens)"),
        ({"input_ids": [1]},
         "sampling_params.max_new_tokens = 64 (the default) is over this server's limit of 16 (--max-new-tokens)"),
    ],
    ids=["prompts", "prompt-tokens", "one-long-prompt", "max-new-tokens", "default-max-new-tokens"],
)
def test_batches_over_the_limits_get_400_naming_them(
    small: EngineServer, engine: ScriptedEngine, body: dict[str, Any], says: str
) -> None:
    status, reply = _post(small, json.dumps(body).encode())
    assert (status, reply["error"]["message"]) == (400, says)
    assert engine.calls == []
    # At the limits exactly, the server serves.
    ok = {"input_ids": [[1] * 5] * 4, "sampling_params": {"max_new_tokens": 16}}
    status, reply = _post(small, json.dumps(ok).encode())
    assert status == 200 and len(reply) == 4


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_hosts_get_no_warning(host: str) -> None:
    assert exposure_warning(host, 30000) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "node07"])
def test_other_hosts_get_the_plain_http_warning(host: str) -> None:
    warning = exposure_warning(host, 30000)
    assert warning is not None
    assert f"listens on {host}:30000" in warning and "speaks plain HTTP" in warning
    assert "can read the bearer token and the prompts" in warning


def test_cli_serve_engine_warns_on_all_interfaces_and_checks_limits(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    served: list[EngineServer] = []

    def serve_once(self: EngineServer) -> None:  # instead of serving until interrupted
        served.append(self)
        self.stop()

    monkeypatch.setattr(EngineServer, "serve_forever", serve_once)
    token_file = tmp_path / "engine.token"
    assert main(["serve-engine", str(tiny_model_dir), "--host", "0.0.0.0", "--port", "0",
                 "--max-prompts", "3", "--request-timeout-s", "5", "--token-file", str(token_file)]) == 0
    out, err = capsys.readouterr()
    [server] = served
    assert out.splitlines()[0] == server.url == f"http://0.0.0.0:{server.port}"
    assert err.startswith(f"relax-hpc serve-engine: warning: the engine server listens on 0.0.0.0:{server.port}")
    assert "speaks plain HTTP" in err
    assert server.limits == ServerLimits(max_prompts=3, request_timeout_s=5.0)  # the others: defaults
    assert main(["serve-engine", str(tiny_model_dir), "--port", "0", "--token-file", str(token_file)]) == 0
    assert capsys.readouterr().err.startswith("relax-hpc serve-engine: bearer token")  # no warning
    assert main(["serve-engine", str(tiny_model_dir), "--max-connections", "0"]) == 2
    assert "max_connections (--max-connections) must be an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["serve-engine", str(tiny_model_dir), "--max-untrusted-per-peer", "0"]) == 2
    assert "max_untrusted_per_peer (--max-untrusted-per-peer) must be an integer >= 1, got 0" in capsys.readouterr().err
