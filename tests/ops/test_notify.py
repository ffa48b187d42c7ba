"""Alerts through Apprise, against a real local HTTP endpoint (Apprise's json:// scheme).

tests/notify_endpoint.py is an http.server on 127.0.0.1 in a thread that records every POST;
the AppriseNotifier sends real requests to it. No timing asserts: waits have generous timeouts
and only bound a test that would otherwise hang.
"""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
from notify_endpoint import closed_port, json_endpoint

from relax_hpc.ops.notify import (
    AppriseNotifier,
    InMemoryNotifier,
    NullNotifier,
    RateLimiter,
    SentAlert,
    check_urls,
    make_notifier,
    redact_url,
)

PACKAGE = Path(__file__).resolve().parents[2] / "relax_hpc"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


ALL = ["started", "finished", "failed", "reward_milestone"]


def test_an_alert_arrives_with_title_and_message() -> None:
    with json_endpoint() as endpoint:
        notifier = AppriseNotifier([endpoint.url()], ALL, min_interval_s=0)
        notifier.notify("finished", "relax-hpc tiny: finished", "finished step 3 (from 0)")
        notifier.close()
        (post,) = endpoint.wait_for(1)
    assert post["path"] == "/hook"
    assert post["title"] == "relax-hpc tiny: finished" and post["message"] == "finished step 3 (from 0)"
    assert notifier.stats() == {"sent": 1, "failed": 0, "rate_dropped": 0, "queue_dropped": 0}


def test_only_the_configured_events_are_sent() -> None:
    with json_endpoint() as endpoint:
        notifier = AppriseNotifier([endpoint.url()], ["failed", "finished"], min_interval_s=0)
        for event in ("started", "reward_milestone", "finished"):
            notifier.notify(event, event, f"the {event} alert")
        notifier.close()
        posts = endpoint.wait_for(1)
    assert [p["message"] for p in posts] == ["the finished alert"]


def test_the_rate_limit_drops_and_counts_per_event_kind() -> None:
    clock = Clock()
    with json_endpoint() as endpoint:
        notifier = AppriseNotifier([endpoint.url()], ALL, min_interval_s=60, clock=clock)
        notifier.notify("reward_milestone", "m", "first")       # t = 0: sent
        clock.now += 10
        notifier.notify("reward_milestone", "m", "second")      # t = 10: dropped
        notifier.notify("started", "s", "another kind")         # its own limit: sent
        clock.now += 20
        notifier.notify("reward_milestone", "m", "third")       # t = 30: dropped
        clock.now += 31
        notifier.notify("reward_milestone", "m", "fourth")      # t = 61: sent, says 2 were dropped
        notifier.close()
        posts = endpoint.wait_for(3)
    assert [p["message"] for p in posts] == [
        "first", "another kind",
        "fourth\n(2 earlier 'reward_milestone' alerts dropped by the rate limit, [notify] min_interval_s = 60)"]
    assert notifier.stats()["rate_dropped"] == 2


def test_the_rate_limiter_alone() -> None:
    clock = Clock()
    limiter = RateLimiter(5.0, clock)
    assert limiter.admit("a") == 0
    assert limiter.admit("a") is None and limiter.admit("b") == 0
    clock.now += 5.0  # exactly the interval: allowed again
    assert limiter.admit("a") == 1 and limiter.dropped == 1
    assert RateLimiter(0.0, clock).admit("a") == 0  # 0: no limit
    unlimited = RateLimiter(0.0, clock)
    assert [unlimited.admit("a") for _ in range(3)] == [0, 0, 0]


def test_a_dead_endpoint_neither_raises_nor_logs_more_than_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"json://alice:pa55-secret@127.0.0.1:{closed_port()}/hook-token-123"
    notifier = AppriseNotifier([url], ALL, min_interval_s=0)
    notifier.notify("started", "s", "one")
    notifier.notify("finished", "f", "two")
    notifier.close()  # returns: the sender has finished both (connection refused at once)
    assert notifier.stats()["failed"] == 2 and notifier.stats()["sent"] == 0
    ours = [r.getMessage() for r in caplog.records if r.name == "relax_hpc.ops.notify"]
    assert len([m for m in ours if "failed;" in m]) == 1, ours
    assert any(f"json://***@127.0.0.1:{url.rsplit(':', 1)[1].split('/')[0]}/***" in m for m in ours), ours
    for secret in ("pa55-secret", "hook-token-123", "alice"):
        assert secret not in caplog.text


def test_sending_never_waits_for_the_endpoint() -> None:
    with json_endpoint() as endpoint:
        endpoint.release.clear()  # the endpoint takes the request but does not answer yet
        notifier = AppriseNotifier([endpoint.url()], ALL, min_interval_s=0)
        notifier.notify("started", "s", "body")
        # notify() has returned while the only send cannot have finished: it runs on the sender thread.
        endpoint.wait_for(1)
        assert notifier.stats()["sent"] == 0
        endpoint.release.set()
        notifier.close()
    assert notifier.stats()["sent"] == 1


def test_secrets_of_a_real_send_stay_out_of_every_log_record(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with json_endpoint() as endpoint:
        url = endpoint.url("hook-Secret123", auth="alice:pa55-secret@")
        notifier = AppriseNotifier([url], ALL, min_interval_s=0)
        notifier.notify("started", "s", "body")
        notifier.close()
        (post,) = endpoint.wait_for(1)
    assert post["path"] == "/hook-Secret123" and post["headers"]["Authorization"].startswith("Basic ")
    assert any(r.name == "apprise" for r in caplog.records)  # Apprise did log this send
    for secret in ("pa55-secret", "hook-Secret123"):
        assert secret not in caplog.text
        assert all(secret not in r.getMessage() for r in caplog.records)


def test_a_url_apprise_refuses_is_named_redacted() -> None:
    bad = ["bogus://my-secret-token/abc", "json://"]
    problems = check_urls(bad + ["ntfy://ntfy.sh/my-topic"])
    assert len(problems) == 2
    assert "URL 1 (bogus://***/***)" in problems[0] and "URL 2 (json://***)" in problems[1]
    assert "my-secret-token" not in " ".join(problems)
    with pytest.raises(ValueError, match=r"bogus://\*\*\*/\*\*\*") as caught:
        AppriseNotifier(bad, ALL, min_interval_s=0)
    assert "my-secret-token" not in str(caught.value)
    assert check_urls(["slack://TokenA/TokenB/TokenC", "mailto://user:pass@example.com", "ntfy://topic"]) == []


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("slack://TokenA/TokenB/TokenC", "slack://***/***"),
        ("slack://TokenA/TokenB/TokenC/#general", "slack://***/***"),
        ("mailto://user:pass@example.com", "mailto://***@example.com"),
        ("mailto://user:pass@gmail.com?to=boss@example.org", "mailto://***@gmail.com?***"),
        ("json://user:pass@127.0.0.1:8080/path", "json://***@127.0.0.1:8080/***"),
        ("json://localhost/hooks/abc?token=xyz", "json://localhost/***?***"),
        ("ntfy://topic", "ntfy://***"),
        ("ntfy://ntfy.sh/my-topic", "ntfy://ntfy.sh/***"),
        ("ntfys://user:pw@ntfy.example.com:8443/alerts", "ntfys://***@ntfy.example.com:8443/***"),
        ("tgram://123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw/-100123", "tgram://***/***"),
        ("matrix://bot:pw@matrix.example.org/#room", "matrix://***@matrix.example.org/***"),
        ("discord://4174216298/JHMHI8qBe7bk2ZwO5U711o3dV_js", "discord://***/***"),
        ("json://[::1]:9000/x", "json://[::1]:9000/***"),
        ("not a url", "***"),
    ],
)
def test_redact_url_keeps_scheme_and_host_only(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_in_memory_and_null_twins() -> None:
    clock = Clock()
    memory = InMemoryNotifier(events=["started", "finished"], min_interval_s=30, clock=clock)
    memory.notify("started", "t", "a")
    memory.notify("started", "t", "b")  # within 30 s: dropped
    memory.notify("failed", "t", "c")   # not an event of this notifier
    clock.now += 30
    memory.notify("started", "t", "d")
    memory.close()
    assert memory.sent == [SentAlert("started", "t", "a"), SentAlert(
        "started", "t", "d\n(1 earlier 'started' alert dropped by the rate limit, [notify] min_interval_s = 30)")]
    assert memory.dropped == 1 and memory.closed
    assert isinstance(make_notifier([], ALL, 60.0), NullNotifier)
    NullNotifier().notify("started", "t", "b")


def test_only_the_adapter_imports_apprise() -> None:
    importers = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name.split(".")[0] == "apprise" for name in names):
                importers.append(path.relative_to(PACKAGE.parent).as_posix())
    assert sorted(set(importers)) == ["relax_hpc/ops/notify.py"]
