"""The engine server's bearer token against a real server on 127.0.0.1: every path and method
without the token gets 401 (before the body is read, before "100 Continue"), the client sends
it and names a mismatch, and `serve-engine` writes it to an owner-only file and never prints it."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from relax_hpc.auth import JobSecret
from relax_hpc.cli.main import main
from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.http.auth import ENGINE_AUTH_MESSAGE, default_token_file, engine_token, write_token_file
from relax_hpc.engines.http.client import EngineAuthError, EngineHttpError, HttpEngine
from relax_hpc.engines.http.server import EngineServer, ServerLimits
from relax_hpc.engines.memory import ScriptedEngine
from relax_hpc.models.hf import load_tokenizer

WAIT_S = 10.0  # a generous bound on anything that should happen within a fraction of a second
TOKEN = JobSecret.generate().token("engine-http")
OTHER = JobSecret.generate().token("engine-http")
GENERATE = json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}).encode()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tokenizer: Any) -> ScriptedEngine:
    return ScriptedEngine(tokenizer, ["7"])


@pytest.fixture(scope="module")
def server(engine: ScriptedEngine) -> Iterator[EngineServer]:
    limits = ServerLimits(request_timeout_s=WAIT_S, max_body_bytes=4096)
    with EngineServer(engine, token=TOKEN, limits=limits) as running:
        yield running


def _read_reply(sock: socket.socket) -> bytes:
    """One reply: its head and the Content-Length bytes of body after it (the server may keep
    the connection open, reading and dropping the rest of a refused body)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data


def _content_length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
    return next(int(line.split(":", 1)[1]) for line in head.split("\r\n") if line.startswith("content-length:"))


ROUTES = [("GET", "/health", b""), ("GET", "/model_info", b""), ("GET", "/get_model_info", b""),
          ("POST", "/generate", GENERATE), ("GET", "/nowhere", b""), ("PUT", "/generate", b"{}"),
          ("DELETE", "/health", b""), ("HEAD", "/health", b"")]
BAD_HEADERS = {"none": None, "wrong-token": f"Bearer {OTHER}", "basic": f"Basic {TOKEN}",
               "empty-bearer": "Bearer", "token-with-suffix": f"Bearer {TOKEN}x"}


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
@pytest.mark.parametrize("header", list(BAD_HEADERS.values()), ids=list(BAD_HEADERS))
def test_every_route_and_method_without_the_token_gets_401(
    server: EngineServer, engine: ScriptedEngine, method: str, path: str, body: bytes, header: str | None
) -> None:
    headers = {"Authorization": header} if header is not None else {}
    calls = len(engine.calls)
    reply = httpx.request(method, server.url + path, content=body, headers=headers, timeout=WAIT_S)
    assert reply.status_code == 401 and reply.headers["WWW-Authenticate"] == "Bearer"
    if method != "HEAD":
        assert reply.json() == {"error": {"message": ENGINE_AUTH_MESSAGE, "code": 401}}
    assert "JobSecret.token('engine-http')" in ENGINE_AUTH_MESSAGE and "serve-engine" in ENGINE_AUTH_MESSAGE
    assert len(engine.calls) == calls


def test_the_right_token_is_served(server: EngineServer, engine: ScriptedEngine) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(server.url + "/health", headers=auth, timeout=WAIT_S).json() == {"status": "ok"}
    assert httpx.get(server.url + "/model_info", headers=auth, timeout=WAIT_S).status_code == 200
    calls = len(engine.calls)
    reply = httpx.post(server.url + "/generate", content=GENERATE, headers=auth, timeout=WAIT_S)
    assert reply.status_code == 200 and len(engine.calls) == calls + 1
    # The scheme is case-insensitive, as RFC 9110 says.
    assert httpx.get(server.url + "/health", headers={"Authorization": f"bearer {TOKEN}"}).status_code == 200
    assert httpx.get(server.url + "/nowhere", headers=auth, timeout=WAIT_S).status_code == 404


def test_the_401_comes_before_the_body_is_read(server: EngineServer, engine: ScriptedEngine) -> None:
    calls = len(engine.calls)
    # 100 MiB announced (far over the body limit: 413 if it got that far), 2 bytes sent: the 401
    # comes back although the rest of the body never arrives.
    head = f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {OTHER}\r\nContent-Length: {100 << 20}\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
        sock.sendall(head.encode() + b"\r\n{}")
        reply = _read_reply(sock)
    assert reply.startswith(b"HTTP/1.1 401 ") and b"WWW-Authenticate: Bearer" in reply
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"] == ENGINE_AUTH_MESSAGE
    assert len(engine.calls) == calls
    assert HttpEngine(server.url, token=TOKEN, timeout_s=WAIT_S).health()  # still serving


def test_expect_100_continue_gets_the_401_instead(server: EngineServer) -> None:
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(GENERATE)}\r\n"
            "Expect: 100-continue\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
        sock.sendall(head.encode())  # and waits, as a client does, for the server's word
        reply = _read_reply(sock)
    assert reply.startswith(b"HTTP/1.1 401 ") and b"100 Continue" not in reply


def test_the_client_sends_the_token_and_names_a_mismatch(server: EngineServer) -> None:
    assert HttpEngine(server.url, token=TOKEN).generate([[1, 2]], SamplingParams(max_new_tokens=2))
    wrong = HttpEngine(server.url, token=OTHER, retries=3, backoff_s=10.0)  # a retry would take 10 s
    with pytest.raises(EngineAuthError, match="sent a bearer token that does not match the server's") as error:
        wrong.generate([[1]], SamplingParams())
    assert "HTTP 401" in str(error.value) and "JobSecret.token('engine-http')" in str(error.value)
    with pytest.raises(EngineAuthError, match="does not match"):
        wrong.health()  # up, but refusing: not "unhealthy"
    with pytest.raises(EngineAuthError, match="it sent no token"):
        HttpEngine(server.url, token=None).model_info()


def test_the_client_does_not_follow_a_redirect_with_its_token() -> None:
    seen: list[str | None] = []

    class Target(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    target = ThreadingHTTPServer(("127.0.0.1", 0), Target)

    class Redirect(Target):
        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{target.server_address[1]}/health")
            self.send_header("Content-Length", "0")
            self.end_headers()

    redirect = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    for s in (target, redirect):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        client = HttpEngine(f"http://127.0.0.1:{redirect.server_address[1]}", token=TOKEN)
        with pytest.raises(EngineHttpError, match="HTTP 302"):
            client.model_info()
        assert seen == []
    finally:
        for s in (target, redirect):
            s.shutdown()
            s.server_close()


@pytest.mark.parametrize("token", ["", "short", " " * 64, "a b" * 20, "é" * 40])
def test_a_server_needs_a_real_token(engine: ScriptedEngine, token: str) -> None:
    with pytest.raises(ValueError, match="EngineServer needs a bearer token of at least 32"):
        EngineServer(engine, token=token)


def test_token_files_are_owner_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_token_file(tmp_path / "new" / "engine.token", TOKEN)
    assert path.read_text() == TOKEN + "\n" and path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["engine.token"]  # no temp file left
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_token_file(30000) == tmp_path / ".relax-hpc" / f"engine-{socket.gethostname()}-30000.token"


@pytest.mark.parametrize("in_job", [True, False], ids=["job-secret", "by-hand"])
def test_serve_engine_writes_its_token_file_and_prints_only_its_path(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    in_job: bool,
) -> None:
    job_token = engine_token()
    seen: list[tuple[EngineServer, str, int]] = []

    def serve_once(self: EngineServer) -> None:  # instead of serving until interrupted
        path = default_token_file(self.port)
        seen.append((self, path.read_text().strip(), path.stat().st_mode & 0o777))
        self.stop()

    monkeypatch.setattr(EngineServer, "serve_forever", serve_once)
    monkeypatch.setenv("HOME", str(tmp_path))  # the default token file's directory
    if not in_job:
        monkeypatch.delenv("RELAX_HPC_SECRET_FILE")
    assert main(["serve-engine", str(tiny_model_dir), "--port", "0"]) == 0
    out, err = capsys.readouterr()
    [(server, written, mode)] = seen
    path = default_token_file(server.port)
    assert out.splitlines()[0] == server.url and written == server.token and mode == 0o600
    assert (written == job_token) is in_job
    origin = "the job's, from RELAX_HPC_SECRET_FILE" if in_job else "new for this run"
    assert f"bearer token ({origin}) in {path} (mode 0600" in err
    assert written not in out + err
    assert not path.exists()  # removed when the server stops


def test_serve_engine_names_a_token_file_it_cannot_write(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["serve-engine", str(tiny_model_dir), "--port", "0", "--token-file", str(blocker / "t")]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the token file {blocker / 't'}" in err and "--token-file PATH" in err
