"""relax_hpc/ops/http.py: the one retry policy and the client every HTTP client of ours uses."""

from __future__ import annotations

import ast
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from relax_hpc.ops.http import MAX_RETRY_AFTER_S, RetryPolicy, retry_after_s, retryable, thread_client

PACKAGE = Path(__file__).resolve().parents[2] / "relax_hpc"


def test_the_waits_double_up_to_the_cap() -> None:
    policy = RetryPolicy(retries=5, backoff_s=0.5, max_backoff_s=3.0)
    assert [policy.wait_s(i) for i in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert policy.total_wait_s() == 9.5 and policy.attempts == 6
    assert RetryPolicy(retries=0).total_wait_s() == 0 and RetryPolicy(retries=0).attempts == 1


def test_a_negative_setting_is_refused_with_the_values() -> None:
    with pytest.raises(ValueError, match=r"retries, backoff_s and max_backoff_s >= 0, got -1, 0.5 and 10.0"):
        RetryPolicy(retries=-1)


def test_busy_and_broken_replies_are_retried_wrong_requests_are_not() -> None:
    assert [code for code in (200, 400, 401, 404, 422, 429, 500, 502, 503) if retryable(code)] == [429, 500, 502, 503]


def test_retry_after_in_seconds_is_read_and_capped_a_date_is_not() -> None:
    assert retry_after_s({"Retry-After": "3"}) == 3.0
    assert retry_after_s({"Retry-After": "100000"}) == MAX_RETRY_AFTER_S
    assert retry_after_s({"Retry-After": "Wed, 21 Oct 2026 07:28:00 GMT"}) is None
    assert retry_after_s({"Retry-After": "-1"}) is None and retry_after_s({}) is None and retry_after_s(None) is None


@pytest.fixture()
def server() -> Iterator[tuple[str, list[str]]]:
    """A real HTTP server that answers 200 and records each request's Authorization header."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append(self.headers.get("Authorization", ""))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    httpd.shutdown()
    httpd.server_close()


def test_the_client_goes_direct_whatever_proxy_the_environment_names(server: tuple[str, list[str]],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    url, seen = server
    # A proxy that does not exist: a client that read it would fail to connect.
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert thread_client(5.0, token="t0k").get(url + "/health").status_code == 200
    assert seen == ["Bearer t0k"]


def test_each_thread_has_its_own_client_made_once() -> None:
    mine = thread_client(5.0)
    assert thread_client(5.0) is mine and thread_client(5.0, token="x") is not mine
    theirs: list[object] = []
    worker = threading.Thread(target=lambda: theirs.append(thread_client(5.0)))
    worker.start()
    worker.join()
    assert theirs and theirs[0] is not mine


def _http_imports(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        found += [f"{path.relative_to(root)}: {name}" for name in names
                  if name in ("urllib.request", "urllib.error", "http.client", "requests")]
    return found


def test_no_module_of_the_package_speaks_http_but_through_httpx() -> None:
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in _http_imports(path)]
    assert found == [], "use relax_hpc/ops/http.py (httpx, one retry policy) instead of: " + ", ".join(found)


def test_the_import_check_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os, urllib.request\nfrom http.client import HTTPConnection\nfrom urllib.parse import quote\n")
    assert _http_imports(bad, tmp_path) == ["bad.py: urllib.request", "bad.py: http.client"]
