"""The HTTP engine server and client against a real server on 127.0.0.1 serving the tiny model:
same generations as in process, SGLang-shaped replies, 4xx for bad requests, 500 for engine
failures, retries, and errors that name the URL."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.http.auth import engine_token
from relax_hpc.engines.http.client import EngineHttpError, HttpEngine, parse_generate_reply
from relax_hpc.engines.http.server import EngineServer
from relax_hpc.engines.memory import ScriptedEngine
from relax_hpc.engines.native import NativeEngine

PROMPT_TEXTS = ("7", "1+2=", "<|im_start|>user:5+4=<|im_end|><|im_start|>assistant:")
TOKEN = engine_token()  # the test job's (tests/conftest.py), as a server inside a job has it
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> NativeEngine:
    return NativeEngine(tiny_model_dir)


@pytest.fixture(scope="module")
def server(engine: NativeEngine, tiny_model_dir: Path) -> Iterator[EngineServer]:
    info = {"model_path": str(tiny_model_dir), "tokenizer_path": str(tiny_model_dir)}
    with EngineServer(engine, token=TOKEN, model_info=info, vocab_size=int(engine.model.config.vocab_size)) as running:
        yield running


@pytest.fixture(scope="module")
def prompts(engine: NativeEngine) -> list[list[int]]:
    return [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPT_TEXTS]


def _post(url: str, data: bytes) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json",
                                                                             **AUTH})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=AUTH), timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=6, temperature=1.0),
        SamplingParams(max_new_tokens=5, temperature=0.7, top_k=5, top_p=0.9, stop=("3",), stop_token_ids=(8,)),
    ],
    ids=["plain", "filters-and-stops"],
)
def test_http_generations_equal_in_process(
    engine: NativeEngine, server: EngineServer, prompts: list[list[int]], params: SamplingParams
) -> None:
    local = engine.generate(prompts, params, seed=11)
    remote = HttpEngine(server.url, token=TOKEN).generate(prompts, params, seed=11)
    assert len(remote) == len(local) == 3
    for got, want in zip(remote, local):
        assert got.prompt_ids == want.prompt_ids
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs  # JSON carries floats exactly (repr round trip)
        assert (got.finish_reason, got.weight_version, got.text) == (want.finish_reason, 0, want.text)


def test_reply_has_sglangs_shape(server: EngineServer, prompts: list[list[int]]) -> None:
    body = {"input_ids": prompts[1], "sampling_params": {"max_new_tokens": 3, "top_k": -1}, "return_logprob": True,
            "seed": 1}
    status, reply = _post(server.url + "/generate", json.dumps(body).encode())
    # One prompt as a flat list gets one object back, not a list (as SGLang does).
    assert status == 200 and isinstance(reply, dict)
    meta = reply["meta_info"]
    assert meta["prompt_tokens"] == len(prompts[1]) and meta["completion_tokens"] == len(reply["output_ids"])
    assert [t for _, t, _ in meta["output_token_logprobs"]] == reply["output_ids"]
    assert all(lp <= 0.0 for lp, _, _ in meta["output_token_logprobs"])
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["weight_version"] == 0
    status, reply = _post(server.url + "/generate", json.dumps({**body, "return_logprob": False}).encode())
    assert status == 200 and "output_token_logprobs" not in reply["meta_info"]


def test_weight_version_is_reported(engine: NativeEngine, server: EngineServer, prompts: list[list[int]]) -> None:
    client = HttpEngine(server.url, token=TOKEN)
    engine.update_weights([], version=3)  # no tensors: only the version changes
    try:
        gens = client.generate(prompts[:1], SamplingParams(max_new_tokens=2), seed=0)
        assert gens[0].weight_version == 3 and client.weight_version == 3
        assert client.model_info()["weight_version"] == 3
    finally:
        engine.update_weights([], version=0)


def test_health_and_model_info(server: EngineServer, tiny_model_dir: Path) -> None:
    assert _get(server.url + "/health") == (200, {"status": "ok"})
    client = HttpEngine(server.url + "/", token=TOKEN)  # a trailing slash is fine
    assert client.health()
    info = client.model_info()
    assert info["model_path"] == str(tiny_model_dir) and info["is_generation"] is True
    assert _get(server.url + "/model_info")[1] == info


@pytest.mark.parametrize(
    ("data", "status", "says"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b"{}", 400, "missing 'input_ids'"),
        (b'{"text": "hello"}', 400, "takes token ids, not text"),
        (b'{"input_ids": []}', 400, "non-empty list of token ids"),
        (b'{"input_ids": "12"}', 400, "non-empty list of token ids"),
        (b'{"input_ids": [1, "a"]}', 400, 'input_ids holds "a"'),
        (b'{"input_ids": [[1], [2, true]]}', 400, "input_ids[1] holds true"),
        (b'{"input_ids": [1, -4]}', 400, "integers >= 0"),
        (b'{"input_ids": [1, 100000]}', 400, "below the vocabulary size"),
        (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}', 400, "max_new_tokens must be >= 1"),
        (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 2.5}}', 400, "max_new_tokens must be an integer"),
        (b'{"input_ids": [1], "sampling_params": {"temperature": "hot"}}', 400, "temperature must be a finite number"),
        (b'{"input_ids": [1], "sampling_params": {"top_p": 1.5}}', 400, "top_p must be in (0, 1]"),
        (b'{"input_ids": [1], "sampling_params": {"stop": 3}}', 400, "stop must be a string"),
        (b'{"input_ids": [1], "sampling_params": [{}]}', 400, "one JSON object"),
        (b'{"input_ids": [1], "sampling_params": {"n": 2}}', 400, "unsupported keys ['n']"),
        (b'{"input_ids": [1], "image_data": "x"}', 400, "unsupported request keys ['image_data']"),
        (b'{"input_ids": [1], "seed": "7"}', 400, "seed must be an integer"),
        (b'{"input_ids": [1], "return_logprob": "yes"}', 400, "return_logprob must be true or false"),
        (b'{"input_ids": [1], "stream": true}', 400, "not supported"),
    ],
)
def test_bad_requests_get_400_saying_what_is_wrong(
    server: EngineServer, data: bytes, status: int, says: str
) -> None:
    got_status, reply = _post(server.url + "/generate", data)
    assert got_status == status
    assert says in reply["error"]["message"]


def test_unknown_routes_and_methods(server: EngineServer) -> None:
    status, reply = _get(server.url + "/v1/completions")
    assert status == 404 and "POST /generate" in reply["error"]["message"]
    assert _get(server.url + "/generate")[0] == 405
    assert _post(server.url + "/flush_cache", b"{}")[0] == 404


def test_engine_failure_is_a_short_500_and_the_client_retries(engine: NativeEngine) -> None:
    flaky = ScriptedEngine(engine.tokenizer, ["7"], fail_first=1)
    with EngineServer(flaky, token=TOKEN) as server:
        status, reply = _post(server.url + "/generate", b'{"input_ids": [1]}')
        assert status == 500
        assert reply["error"]["message"] == "engine failed: RuntimeError: out of memory (simulated)"
        assert "Traceback" not in json.dumps(reply)
        flaky.fail_first = len(flaky.calls) + 1  # the next call fails too, the one after succeeds
        gens = HttpEngine(server.url, token=TOKEN, retries=2, backoff_s=0.01).generate([[1, 2]], SamplingParams())
        produced = flaky.produced[-1]
        assert len(flaky.calls) == 3
        assert (gens[0].token_ids, gens[0].logprobs) == (produced.token_ids, produced.logprobs)


def test_client_gives_up_with_the_servers_message_on_4xx(server: EngineServer) -> None:
    client = HttpEngine(server.url, token=TOKEN, retries=3, backoff_s=10.0)  # a retry would take 10 s
    with pytest.raises(EngineHttpError, match=r"rejected the request: HTTP 400: input_ids\[0\] holds 100000"):
        client.generate([[1, 100000]], SamplingParams())


def test_connection_refused_names_the_url() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    client = HttpEngine(url, token=TOKEN, timeout_s=2, retries=1, backoff_s=0.01)
    with pytest.raises(EngineHttpError, match=rf"engine at {url}/generate failed after 2 attempt\(s\)"):
        client.generate([[1]], SamplingParams())
    assert not client.health()


def test_update_weights_is_refused_and_bad_urls_rejected() -> None:
    with pytest.raises(RuntimeError, match="weights of an HTTP engine are updated by its server"):
        HttpEngine("http://127.0.0.1:1", token=TOKEN).update_weights([], 1)
    with pytest.raises(ValueError, match="must start with http://"):
        HttpEngine("127.0.0.1:30000", token=TOKEN)
    assert HttpEngine("http://127.0.0.1:1", token=TOKEN).generate([], SamplingParams()) == []


def test_parses_an_sglang_reply_without_output_ids() -> None:
    # Older SGLang: no "output_ids", weight_version "default", token text in the triples.
    reply = [{"text": "ab", "meta_info": {"id": "r1", "finish_reason": {"type": "stop", "matched": 2},
                                          "weight_version": "default",
                                          "output_token_logprobs": [[-0.5, 7, "a"], [-0.125, 2, "b"]]}},
             {"text": "c", "meta_info": {"finish_reason": {"type": "length", "length": 1}, "weight_version": "4",
                                         "output_token_logprobs": [[-1.0, 9, None]]}}]
    first, second = parse_generate_reply(reply, [[1], [2, 3]], "http://sglang:30000")
    assert (first.token_ids, first.logprobs, first.finish_reason, first.weight_version) == ([7, 2], [-0.5, -0.125],
                                                                                          "stop", 0)
    assert (second.prompt_ids, second.token_ids, second.finish_reason, second.weight_version) == ([2, 3], [9],
                                                                                                "length", 4)
    aborted = [{"meta_info": {"finish_reason": {"type": "abort", "message": "server is draining"},
                              "output_token_logprobs": []}}]
    with pytest.raises(EngineHttpError, match="finish_reason 'abort' server is draining"):
        parse_generate_reply(aborted, [[1]], "http://sglang:30000")
    with pytest.raises(EngineHttpError, match="answered 1 for 2 prompts"):
        parse_generate_reply(reply[:1], [[1], [2]], "http://sglang:30000")


@pytest.mark.slow
def test_cli_serve_engine_prints_its_url_and_its_token_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Run by hand (no job secret): a new token, written to --token-file, named on stderr, never printed.
    env = {k: v for k, v in os.environ.items() if k != "RELAX_HPC_SECRET_FILE"}
    token_file = tmp_path / "engine.token"
    command = [sys.executable, "-m", "relax_hpc.cli.main", "serve-engine", str(tiny_model_dir), "--port", "0",
               "--token-file", str(token_file)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**env, "OMP_NUM_THREADS": "1"})
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), process.stderr.read() if process.poll() is not None else url
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text().strip()
        assert len(token) == 64 and token != TOKEN
        client = HttpEngine(url, token=token)
        assert client.health()
        gens = client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), seed=0)
        assert len(gens[0].token_ids) == len(gens[0].logprobs) >= 1
    finally:
        process.terminate()  # SIGTERM ends it like Ctrl-C: the token file goes
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert f"bearer token (new for this run) in {token_file} (mode 0600" in err and token not in err
    assert not token_file.exists()


def test_a_server_that_dies_in_the_middle_of_its_reply_is_a_failed_attempt_not_a_crash(tmp_path: Path) -> None:
    """A grow job's engine cancelled mid-step closed its connection after the headers of a reply
    that announced 180 bytes: http.client raised IncompleteRead, which is no OSError, and it ended
    the whole rollout. It is an attempt that failed, named in the client's error (the router then
    gives the prompts to another engine)."""
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    served: list[int] = []

    def read_request(conn: socket.socket) -> None:
        # The whole request, body included: a socket closed with unread bytes sends a reset, and
        # the client would see ConnectionResetError instead of the short reply (a CI run,
        # 2026-11-29: http.client sends the headers and the body in two writes).
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, body = data.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(body) < length:
            body += conn.recv(65536)

    def half_replies() -> None:
        while len(served) < 2:
            conn, _ = listener.accept()
            with conn:
                read_request(conn)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 180\r\n\r\n")
                served.append(1)

    thread = threading.Thread(target=half_replies, daemon=True)
    thread.start()
    client = HttpEngine(f"http://127.0.0.1:{port}", token=TOKEN, retries=1, backoff_s=0.01)
    with pytest.raises(EngineHttpError, match=r"failed after 2 attempt\(s\) \(last error: RemoteProtocolError: peer closed connection without "
                       r"sending complete message body \(received 0 bytes, expected 180\)"):
        client.generate([[1, 2]], SamplingParams())
    thread.join(timeout=10)
    listener.close()
    assert len(served) == 2  # it tried again before giving up
