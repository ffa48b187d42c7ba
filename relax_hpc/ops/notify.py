"""Alerts to the job's owner: the Notifier interface, its Apprise adapter and two twins.

    notifier = make_notifier(urls, events, min_interval_s)   # NullNotifier without URLs
    notifier.notify("finished", "relax-hpc tiny: finished", "finished step 400 ...")
    notifier.close()   # waits a little for the alerts still on their way

``AppriseNotifier`` is the only module that imports apprise (Slack, e-mail, Matrix, ntfy, a JSON
webhook, ... behind one URL each). It sends on a background thread, one URL after the other,
each with Apprise's own connect and read timeouts (4 s each), so a slow or dead endpoint never
holds up the caller; a failed send is counted and logged once per URL, redacted. Each
notifier keeps only the events it was given and rate-limits per event kind (``RateLimiter``).
Apprise and urllib3 write the URLs they call into their debug logs: while an AppriseNotifier
lives, those loggers' records have the URLs' secret parts replaced by ``***``.

relax_hpc/driver/alerts.py decides when each event fires; docs/operations.md, "Alerts", is the
user's side. ``InMemoryNotifier`` records what would be sent, for tests.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple, Protocol

from relax_hpc.spec.secret_urls import HIDDEN, redact_url, url_secrets

__all__ = [
    "CLOSE_WAIT_S",
    "AppriseNotifier",
    "InMemoryNotifier",
    "Notifier",
    "NullNotifier",
    "RateLimiter",
    "SentAlert",
    "check_urls",
    "make_notifier",
    "redact_url",
]

log = logging.getLogger(__name__)

# How long close() waits for alerts still queued or on their way (the last one is usually
# "finished" or "failed"); what is left after it is given up, on a daemon thread.
CLOSE_WAIT_S = 15.0
# Alerts waiting for the sender thread; more are dropped and counted (an endpoint that hangs).
QUEUE_LIMIT = 100
# The loggers of the libraries that write request URLs (and so the secrets) into their records.
_LIBRARY_LOGGERS = ("apprise", "urllib3.connectionpool")


class Notifier(Protocol):
    def notify(self, event: str, title: str, body: str) -> None: ...
    def close(self) -> None: ...


class SentAlert(NamedTuple):
    event: str
    title: str
    body: str


class RateLimiter:
    """Per event kind, at most one alert every ``min_interval_s`` seconds.

    ``admit(event)`` is None for an alert to drop (counted), else the number of alerts of that
    kind dropped since the last one admitted, which the admitted one reports.
    """

    def __init__(self, min_interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._pending_drops: dict[str, int] = {}
        self.dropped = 0

    def admit(self, event: str) -> int | None:
        now = self._clock()
        last = self._last.get(event)
        if last is not None and now - last < self.min_interval_s:
            self._pending_drops[event] = self._pending_drops.get(event, 0) + 1
            self.dropped += 1
            return None
        self._last[event] = now
        return self._pending_drops.pop(event, 0)


class _Gate:
    """The event filter and the rate limit that every notifier applies before sending."""

    def __init__(self, events: Collection[str] | None, min_interval_s: float,
                 clock: Callable[[], float]) -> None:
        self.events = None if events is None else frozenset(events)
        self.limiter = RateLimiter(min_interval_s, clock)

    def admit(self, event: str, body: str) -> str | None:
        """The body to send (with a note of earlier drops), or None: not sent."""
        if self.events is not None and event not in self.events:
            return None
        dropped = self.limiter.admit(event)
        if dropped is None:
            return None
        if dropped:
            body += (f"\n({dropped} earlier '{event}' alert{'s' if dropped > 1 else ''} dropped by the rate "
                     f"limit, [notify] min_interval_s = {self.limiter.min_interval_s:g})")
        return body


class NullNotifier:
    """No URLs: nothing is sent."""

    def notify(self, event: str, title: str, body: str) -> None:
        pass

    def close(self) -> None:
        pass


class InMemoryNotifier:
    """Records the alerts it would send (``sent``), after the same filter and rate limit."""

    def __init__(self, events: Collection[str] | None = None, min_interval_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._gate = _Gate(events, min_interval_s, clock)
        self.sent: list[SentAlert] = []
        self.closed = False

    @property
    def dropped(self) -> int:
        return self._gate.limiter.dropped

    def notify(self, event: str, title: str, body: str) -> None:
        shown = self._gate.admit(event, body)
        if shown is not None:
            self.sent.append(SentAlert(event, title, shown))

    def close(self) -> None:
        self.closed = True


class _Scrubber(logging.Filter):
    """Replaces the given secrets in every record of the logger it is added to."""

    def __init__(self, secrets: Sequence[str]) -> None:
        super().__init__()
        self.secrets = sorted(set(secrets), key=len, reverse=True)

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        scrubbed = text
        for secret in self.secrets:
            scrubbed = scrubbed.replace(secret, HIDDEN)
        if scrubbed != text:
            record.msg, record.args = scrubbed, None
        return True

    def install(self) -> None:
        for name in _LIBRARY_LOGGERS:
            logging.getLogger(name).addFilter(self)

    def remove(self) -> None:
        for name in _LIBRARY_LOGGERS:
            logging.getLogger(name).removeFilter(self)


def _load(urls: Sequence[str]) -> tuple[list[tuple[str, Any]], list[str]]:
    """(redacted URL, a one-URL Apprise object) per URL, and a problem per URL Apprise refuses."""
    import apprise

    targets: list[tuple[str, Any]] = []
    problems: list[str] = []
    for index, url in enumerate(urls):
        target = apprise.Apprise()
        if target.add(url):
            targets.append((redact_url(url), target))
        else:
            problems.append(f"[notify] URL {index + 1} ({redact_url(url)}): Apprise does not accept it (an "
                            "unknown scheme, or a part the service needs is missing); see "
                            "https://github.com/caronc/apprise/wiki for the service's URL form")
    return targets, problems


def check_urls(urls: Sequence[str]) -> list[str]:
    """One line per URL that Apprise does not accept (redacted); empty when all are fine."""
    if not urls:
        return []
    scrubber = _Scrubber([secret for url in urls for secret in url_secrets(url)])
    scrubber.install()
    try:
        return _load(urls)[1]
    finally:
        scrubber.remove()


class AppriseNotifier:
    """Sends each alert to every URL through Apprise, on a background thread (module docstring).

    ValueError when Apprise does not accept a URL (the URL redacted in the message).
    ``stats()``: alerts sent, sends failed, alerts dropped by the rate limit or a full queue.
    """

    def __init__(self, urls: Sequence[str], events: Collection[str], min_interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._gate = _Gate(events, min_interval_s, clock)
        self._scrubber = _Scrubber([secret for url in urls for secret in url_secrets(url)])
        self._scrubber.install()
        targets, problems = _load(urls)
        if problems:
            self._scrubber.remove()
            raise ValueError("; ".join(problems))
        self._targets = targets
        self._queue: queue.Queue[SentAlert | None] = queue.Queue(QUEUE_LIMIT)
        self._failures: dict[str, int] = {}
        self._sent = self._queue_dropped = 0
        self._closed = False
        self._thread = threading.Thread(target=self._send_loop, name="relax-hpc-notify", daemon=True)
        self._thread.start()

    def notify(self, event: str, title: str, body: str) -> None:
        shown = self._gate.admit(event, body)
        if shown is None or self._closed:
            return
        try:
            self._queue.put_nowait(SentAlert(event, title, shown))
        except queue.Full:
            self._queue_dropped += 1
            if self._queue_dropped == 1:
                log.warning("notify: %d alerts are waiting to be sent; dropping more until they are",
                            QUEUE_LIMIT)

    def _send_loop(self) -> None:
        while (alert := self._queue.get()) is not None:
            for shown_url, target in self._targets:
                try:
                    ok = bool(target.notify(title=alert.title, body=alert.body))
                except Exception:  # noqa: BLE001 - a plugin's bug must not end the sender
                    ok = False
                if ok:
                    self._sent += 1
                    continue
                failures = self._failures[shown_url] = self._failures.get(shown_url, 0) + 1
                if failures == 1:
                    log.warning("notify: sending the '%s' alert to %s failed; later failures of this URL "
                                "are counted, not logged (test it: apprise -vv -t test -b test 'URL')",
                                alert.event, shown_url)

    def stats(self) -> dict[str, int]:
        return {"sent": self._sent, "failed": sum(self._failures.values()),
                "rate_dropped": self._gate.limiter.dropped, "queue_dropped": self._queue_dropped}

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Send what is queued (waiting at most ``wait_s``), then stop scrubbing the logs."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + wait_s
        try:
            self._queue.put(None, timeout=wait_s)
            self._thread.join(max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        if self._failures:
            counts = ", ".join(f"{url}: {count}" for url, count in self._failures.items())
            log.warning("notify: failed sends per URL: %s", counts)
        if self._thread.is_alive():
            # The scrubber stays: the send still running may log its URL after this.
            log.warning("notify: alerts still being sent after %.0f s were given up", wait_s)
        else:
            self._scrubber.remove()


def make_notifier(urls: Sequence[str], events: Collection[str], min_interval_s: float) -> Notifier:
    """The notifier for these settings: NullNotifier without URLs, else an AppriseNotifier."""
    if not urls:
        return NullNotifier()
    return AppriseNotifier(urls, events, min_interval_s)
