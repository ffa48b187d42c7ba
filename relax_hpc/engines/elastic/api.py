"""What the elastic REST API and the rollout role say to each other (no I/O here).

The REST server runs in the driver; the engines and their router live in the rollout role
(a Ray actor, or this process). Every request crosses that boundary as one call,
`ElasticControl.elastic(action, body) -> ElasticReply`, whose reply is plain data (an HTTP
status and a JSON object), so it pickles through Ray and needs no exception mapping.

Actions and their bodies (docs/federation.md has the HTTP side):

    "engines"      {}                                      -> 200 {"engines": [ENGINE...], "operation": OP | null}
    "scale_out"    {"num_engines": N}                      -> 202 {"operation": OP}   engines in the job's allocation
                   {"engine_urls": [URL...], "job": ID}    -> 202 {"operation": OP}   engines already serving elsewhere
    "scale_in"     {"num_engines": N} | {"engine_ids": [...]} | {"engine_urls": [...]} | {"job": ID},
                   optional "force": bool, "timeout_s": float -> 202 {"operation": OP}
    "operation"    {"id": OP_ID}                           -> 200 {"operation": OP}
    "operations"   {}                                      -> 200 {"operations": [OP...]}

    ENGINE = {"id", "address", "state", "weight_version", "samples", "job", "protected"}
    OP     = {"id", "kind", "state", "engines", "message", "requested", "started_at", "finished_at"}

Bounds: "num_engines" and the number of "engine_urls" at most what the fleet has room for
(MAX_FLEET_ENGINES in all), "timeout_s" a finite number of seconds in (0, MAX_TIMEOUT_S]; an
"engine_urls" host must be one the job accepts (engines/elastic/hosts.py: its own nodes and its
grow jobs' nodes), since the engine token is sent there.

Errors: 400 (a bad body: the message names the key and what is allowed), 404 (no such
operation), 409 (another operation is in progress: the body carries it as "operation").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

# An engine's life: registered, loading the current weights, serving, finishing its in-flight
# work before it leaves, left. "failed": its join did not complete, or it died while serving.
ENGINE_STATES = ("pending", "joining", "active", "draining", "gone", "failed")
# An operation's life. "rolled_back": a scale-out that failed part-way; what it added was removed.
OPERATION_STATES = ("pending", "running", "done", "failed", "rolled_back")
ACTIONS = ("engines", "scale_out", "scale_in", "operation", "operations")
# Bounds on every number and list of a body (400 beyond them). The fleet: engines serving or
# joining at once (the router's fleet benchmark runs 256; docs/benchmarks.md); the timeouts: the
# spec's own bound on a timeout, far below what a thread can wait (threading.TIMEOUT_MAX).
MAX_FLEET_ENGINES = 1024
MAX_TIMEOUT_S = 1_000_000.0  # ~11.6 days, as spec/constraints.py's MAX_TIMEOUT_S
MAX_URL_CHARS = 2048
MAX_JOB_CHARS = 64
# Where clients find the API: the driver writes its URL into JOBDIR/cluster.json ("rest_url"), and
# every request carries the bearer token JobSecret.token(REST_TOKEN_PURPOSE) of JOBDIR/.secret.
CLUSTER_JSON = "cluster.json"
REST_TOKEN_PURPOSE = "rest"


@dataclass(frozen=True)
class ElasticReply:
    status: int  # an HTTP status: 200, 202, 400, 404, 409
    body: dict[str, Any] = field(default_factory=dict)


def error_reply(status: int, message: str, **extra: Any) -> ElasticReply:
    """A refusal: {"error": message, ...extra}."""
    return ElasticReply(status, {"error": message, **extra})


class ElasticControl(Protocol):
    """What the REST server calls: the rollout role (through Ray or in process)."""

    def elastic(self, action: str, body: dict[str, Any]) -> ElasticReply: ...
