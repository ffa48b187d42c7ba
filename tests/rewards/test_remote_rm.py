"""remote_rm against real HTTP servers on 127.0.0.1: success, retries after 500, timeouts, 4xx."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from relax_hpc.data.sample import Sample
from relax_hpc.rewards.hub import RewardHub
from relax_hpc.rewards.remote import RemoteRewardError, RemoteRewardModel


class Server:
    """A local HTTP reward server whose replies follow a script: one entry per request."""

    def __init__(self, script: list[tuple[int, Any, float]]) -> None:
        self.script, self.requests = script, []  # (status, body, delay seconds)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers["Content-Length"])
                outer.requests.append(json.loads(self.rfile.read(length)))
                status, body, delay = outer.script[min(len(outer.requests), len(outer.script)) - 1]
                time.sleep(delay)
                data = json.dumps(body).encode() if not isinstance(body, bytes) else body
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting, as the timeout test wants

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/reward"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[Server] = []

    def start(script: list[tuple[int, Any, float]]) -> Server:
        servers.append(Server(script))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _sample() -> Sample:
    return Sample([1], [2], [-1.0], 0, group_id=0, prompt_index=0, label="42", prompt_text="6*7=",
                  response_text="42", metadata={"source": "t", "image": b"\x89PNG"})


def _call(model: RemoteRewardModel) -> dict[str, float]:
    return asyncio.run(model(_sample()))


def test_posts_the_sample_and_reads_the_score(serve: Any) -> None:
    server = serve([(200, {"score": 0.75, "confidence": 0.9, "note": "x"}, 0.0)])
    assert _call(RemoteRewardModel(server.url)) == {"score": 0.75, "confidence": 0.9}
    assert server.requests == [{"prompt": "6*7=", "response": "42", "label": "42",
                                "metadata": {"source": "t", "image": "<4 bytes>"}}]


@pytest.mark.parametrize(("body", "score"), [(1, 1.0), (-0.5, -0.5), ({"reward": 2}, 2.0)])
def test_reply_forms(serve: Any, body: Any, score: float) -> None:
    assert _call(RemoteRewardModel(serve([(200, body, 0.0)]).url))["score"] == score


def test_retries_after_server_errors(serve: Any) -> None:
    server = serve([(500, {"error": "busy"}, 0.0), (503, {}, 0.0), (200, {"score": 1.0}, 0.0)])
    model = RemoteRewardModel(server.url, max_retries=3, backoff_s=0.05)
    assert _call(model) == {"score": 1.0}
    assert len(server.requests) == 3


def test_gives_up_naming_the_url(serve: Any) -> None:
    server = serve([(500, {"error": "down"}, 0.0)])
    model = RemoteRewardModel(server.url, max_retries=2, backoff_s=0.01)
    with pytest.raises(RemoteRewardError) as info:
        _call(model)
    assert len(server.requests) == 3
    message = str(info.value)
    assert server.url in message and "after 3 attempts" in message and "HTTP 500" in message


def test_timeout_is_retried_then_reported(serve: Any) -> None:
    server = serve([(200, {"score": 1.0}, 1.0)])  # always slower than the client waits
    model = RemoteRewardModel(server.url, timeout_s=0.2, max_retries=1, backoff_s=0.01)
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match=rf"{server.url} failed after 2 attempts .*timed out"):
        _call(model)
    assert time.monotonic() - start < 1.5
    assert len(server.requests) == 2


def test_client_errors_are_not_retried(serve: Any) -> None:
    server = serve([(404, {"error": "no such route"}, 0.0)])
    with pytest.raises(RemoteRewardError, match=rf"{server.url} rejected the request: HTTP 404.*remote_url"):
        _call(RemoteRewardModel(server.url, backoff_s=0.01))
    assert len(server.requests) == 1


@pytest.mark.parametrize("body", [b"not json", {"label": 1}, "1.0", {"score": "high"}])
def test_unusable_replies(serve: Any, body: Any) -> None:
    server = serve([(200, body, 0.0)])
    with pytest.raises(RemoteRewardError, match=server.url):
        _call(RemoteRewardModel(server.url, max_retries=0))


def test_connection_refused_names_the_url() -> None:
    server = Server([(200, 1.0, 0.0)])
    url = server.url
    server.close()  # nothing listens on that port any more
    with pytest.raises(RemoteRewardError, match=rf"{url} failed after 2 attempts .*Connection"):
        _call(RemoteRewardModel(url, max_retries=1, backoff_s=0.01))


def test_through_the_hub_a_dead_server_scores_zero(serve: Any) -> None:
    good = serve([(200, {"score": 1.0}, 0.0)])
    hub = RewardHub("remote_rm", remote_url=good.url, remote_max_retries=0, timeout_s=5)
    samples = [_sample() for _ in range(4)]
    assert hub.score(samples)["reward/errors"] == 0.0
    assert [s.reward for s in samples] == [1.0] * 4
    hub.close()
    bad = serve([(500, {}, 0.0)])
    hub = RewardHub("remote_rm", remote_url=bad.url, remote_max_retries=1, timeout_s=5)
    metrics = hub.score(samples)
    hub.close()
    assert metrics["reward/errors"] == 4.0 and [s.reward for s in samples] == [0.0] * 4
