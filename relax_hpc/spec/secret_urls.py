"""Spec values that carry secrets: alert URLs ([notify] urls), their check, and how they and the
``[container] env`` values are shown redacted.

An Apprise URL holds its credentials in every part: ``slack://TokenA/TokenB/TokenC`` (the
tokens are the host and the path), ``mailto://user:password@example.com``, ``ntfy://topic``
(whoever knows the topic reads it), ``json://user:password@host/path?token=...``. So a URL is
shown as its scheme, ``***@`` for any user part, its host only when that is a network host
name or address (``example.com``, ``127.0.0.1:8080``, ``localhost``), else ``***``, then
``/***`` for any path and ``?***`` for any query::

    redact_url("slack://TokenA/TokenB/TokenC")        # "slack://***/***"
    redact_url("mailto://user:pass@example.com")      # "mailto://***@example.com"
    redact_url("json://u:p@127.0.0.1:8080/hook?x=1")  # "json://***@127.0.0.1:8080/***?***"

A redacted URL is still a well-formed one, so a resolved spec written with redacted URLs
(relax_hpc/spec/render.py) loads again. ``url_secrets`` lists the parts that redaction hides,
for scrubbing them out of other libraries' log lines (relax_hpc/ops/notify.py). Nothing here
imports apprise: whether Apprise knows a URL's scheme is checked by the adapter when the job
starts (and by ``relax-hpc validate``).

``[container] env`` holds ``NAME=VALUE`` assignments whose values are often tokens
(``HF_TOKEN=hf_...``, ``WANDB_API_KEY=...``): a redacted one keeps its name and hides the value,
``redact_env("HF_TOKEN=hf_abc")`` is ``"HF_TOKEN=***"``, which is still a valid assignment. The
keys redacted that way are ``SECRET_ENV_KEYS``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import unquote, urlsplit, urlunsplit

from relax_hpc.spec.text_checks import control_character

__all__ = ["HIDDEN", "SECRET_ENV_KEYS", "notify_urls", "redact_env", "redact_env_value", "redact_url",
           "redact_userinfo",
           "redact_value", "url_secrets"]

HIDDEN = "***"
# Spec keys of "NAME=VALUE" assignments whose values are secrets: shown as "NAME=***".
SECRET_ENV_KEYS = frozenset({"container.env"})
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# "scheme://rest": the scheme as RFC 3986 spells it, then anything without whitespace.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")
_HOST_NAME = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,63}")
_IPV4 = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}")
_IPV6 = re.compile(r"\[[0-9A-Fa-f:.]+\]")
_PORT = re.compile(r":\d{1,5}")


def _is_network_host(host_port: str) -> bool:
    """Whether the authority (without user part) is a host name or address, with an optional
    port: shown as it is. Anything else there (a token, a topic, "123:abc") is a secret."""
    host = host_port
    head, colon, tail = host_port.rpartition(":")
    if colon and _PORT.fullmatch(colon + tail):
        host = head
    return (host.lower() == "localhost" or _HOST_NAME.fullmatch(host) is not None
            or _IPV4.fullmatch(host) is not None or _IPV6.fullmatch(host) is not None)


def _split(url: str) -> tuple[str, str | None, str, str, str] | None:
    """(scheme, user part or None without "@", host and port, path, query) of ``scheme://...``;
    None when there is no scheme."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return None
    # Apprise reads "#" as part of a path (slack://T/B/C/#channel), so only "?" ends it.
    main, _, query = rest.partition("?")
    authority, _, path = main.partition("/")
    user, at, host_port = authority.rpartition("@")
    return scheme, user if at else None, host_port, path, query


def redact_url(url: str) -> str:
    """``url`` with its secrets replaced by ``***`` (see the module docstring)."""
    parts = _split(url)
    if parts is None:
        return HIDDEN
    scheme, user, host_port, path, query = parts
    shown = f"{scheme}://"
    if user is not None:
        shown += f"{HIDDEN}@"
    shown += host_port if _is_network_host(host_port) else HIDDEN
    if path.strip("/"):
        shown += f"/{HIDDEN}"
    if query:
        shown += f"?{HIDDEN}"
    return shown


def url_secrets(url: str) -> list[str]:
    """Every part of ``url`` that ``redact_url`` hides, as written and %-decoded, longest first."""
    parts = _split(url)
    if parts is None:
        return [url] if url else []
    _, user, host_port, path, query = parts
    found = [user, *user.split(":")] if user else []
    if not _is_network_host(host_port):
        found.append(host_port)
    found += [segment for segment in path.split("/") if segment.strip("#")]
    for pair in query.split("&"):
        value = pair.partition("=")[2]
        if value:
            found.append(value)
    found += [unquote(piece) for piece in found]
    return sorted({piece for piece in found if piece}, key=len, reverse=True)


def redact_value(value: object) -> object:
    """A spec value of a secret key as a problem report may show it: strings redacted as URLs
    (and wholly when they are not URLs), lists element by element, anything else as it is."""
    if isinstance(value, str):
        return redact_url(value) if "://" in value else HIDDEN
    if isinstance(value, list):
        return [redact_value(item) for item in value]
    return value


def redact_userinfo(url: str) -> str:
    """``scheme://user:***@host/path`` for a URL with a password in it (a tracking server's
    credentials); the host and path stay readable. Anything else is returned as it is."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:{HIDDEN}@{host}"))


def redact_env(assignment: str) -> str:
    """``NAME=***`` for ``NAME=VALUE``; ``***`` for a string that is not an assignment (its
    name may itself be the secret, as in a value pasted without ``NAME=``)."""
    name, equals, _ = assignment.partition("=")
    return f"{name}={HIDDEN}" if equals and _ENV_NAME.fullmatch(name) else HIDDEN


def redact_env_value(value: object) -> object:
    """A value of a ``SECRET_ENV_KEYS`` key as a report may show it: strings by ``redact_env``,
    lists element by element, anything else (a number, a table) as it is."""
    if isinstance(value, str):
        return redact_env(value)
    if isinstance(value, list):
        return [redact_env_value(item) for item in value]
    return value


def notify_urls(values: Sequence[str]) -> str | None:
    """Check of [notify] urls: each element "scheme://..." without whitespace or control
    characters. The message names the element redacted: a report must not print the secret."""
    for index, url in enumerate(values):
        found = control_character(url)
        if found is not None:
            return (f"element {index} ({redact_url(url)}) must not contain control characters; "
                    f"found {found}")
        if _URL.fullmatch(url) is None:
            return (f"element {index} ({redact_url(url)}) must be an Apprise URL, \"scheme://...\" without "
                    'spaces (e.g. "ntfy://ntfy.sh/my-topic", "slack://TokenA/TokenB/TokenC"; '
                    "docs/operations.md, \"Alerts\")")
    return None
