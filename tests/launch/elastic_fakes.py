"""In-memory stand-ins for a running job's elastic side, shared by the federation tests.

`FakeElastic` is an `ElasticControl` (relax_hpc/engines/elastic/api.py) over a list of engines
whose operations finish at once; serve it with the real `RestServer`, or call it through
`InMemoryRest`, which maps the REST routes onto its actions the way elastic/rest_api.py does.
"""

from __future__ import annotations

import itertools
from typing import Any

from relax_hpc.engines.elastic.api import ElasticReply, error_reply

MAIN_ENGINE = {"id": "engine-0", "address": "in-job", "state": "active", "weight_version": 7, "samples": 120,
               "job": None, "protected": True}


class FakeElastic:
    """Engines and operations in memory. Set `busy` to answer 409 with that operation, `outcome`
    for the state every new operation ends in, `refuse` to answer 400 with that message,
    `unanswered_lookups` to answer that many next operation lookups 503, as the REST API does
    while the rollout role is gone (the job is being requeued)."""

    def __init__(self) -> None:
        self.engines: list[dict[str, Any]] = [dict(MAIN_ENGINE)]
        self.operations: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.busy: dict[str, Any] | None = None
        self.refuse: str | None = None
        self.outcome = "done"
        self.unanswered_lookups = 0
        self._ids = itertools.count(1)

    def elastic(self, action: str, body: dict[str, Any]) -> ElasticReply:
        self.calls.append((action, dict(body)))
        if action == "engines":
            return ElasticReply(200, {"engines": [dict(e) for e in self.engines], "operation": None})
        if action == "operation" and self.unanswered_lookups > 0:
            self.unanswered_lookups -= 1
            return error_reply(503, "the rollout role did not answer: RoleDiedError: rollout died; retry once "
                                    "the job is running again")
        if action == "operation":
            op = self.operations.get(str(body.get("id")))
            return ElasticReply(200, {"operation": op}) if op else error_reply(404, f"no operation {body.get('id')!r}")
        if self.busy is not None:
            return error_reply(409, f"operation {self.busy['id']} is in progress", operation=self.busy)
        if self.refuse is not None:
            return error_reply(400, self.refuse)
        changed = self._scale_out(body) if action == "scale_out" else self._scale_in(body)
        op = {"id": f"op-{next(self._ids)}", "kind": action, "state": self.outcome, "engines": changed,
              "message": f"{len(changed)} engines {'joined' if action == 'scale_out' else 'removed'}",
              "requested": dict(body), "started_at": 1.0, "finished_at": 2.0}
        self.operations[op["id"]] = op
        return ElasticReply(202, {"operation": op})

    def _scale_out(self, body: dict[str, Any]) -> list[str]:
        added = []
        for url in body["engine_urls"]:
            engine_id = f"engine-{len(self.engines)}"
            state = "active" if self.outcome == "done" else "gone"
            self.engines.append({"id": engine_id, "address": url, "state": state, "weight_version": 7,
                                 "samples": 0, "job": body.get("job"), "protected": False})
            added.append(engine_id)
        return added

    def _scale_in(self, body: dict[str, Any]) -> list[str]:
        serving = [e for e in self.engines if e["state"] == "active" and not e["protected"]]
        if "job" in body:
            chosen = [e for e in serving if e["job"] == body["job"]]
        elif "engine_urls" in body:
            chosen = [e for e in serving if e["address"] in body["engine_urls"]]
        else:
            chosen = list(reversed(serving))[: body["num_engines"]]
        for engine in chosen:
            engine["state"] = "gone"
        return [e["id"] for e in chosen]

    def restart(self) -> None:
        """A requeued main job: a new driver, whose list holds only its own engines."""
        self.engines = [dict(MAIN_ENGINE)]

    def posted(self, action: str) -> list[dict[str, Any]]:
        return [body for name, body in self.calls if name == action]


class InMemoryRest:
    """The REST routes over a control, without HTTP (what RestClient does, minus the network).
    `down = True`: every call raises ConnectionError, as RestUnavailable does."""

    def __init__(self, control: FakeElastic) -> None:
        self.control = control
        self.down = False

    def _call(self, action: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if self.down:
            raise ConnectionError("the REST server at http://fake did not answer")
        reply = self.control.elastic(action, body)
        return reply.status, reply.body

    def get(self, path: str) -> tuple[int, dict[str, Any]]:
        if path == "/rollout/engines":
            return self._call("engines", {})
        return self._call("operation", {"id": path.rsplit("/", 1)[1]})

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return self._call(path.rsplit("/", 1)[1], body)
