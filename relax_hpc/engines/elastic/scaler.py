"""`ElasticScaler`: rollout engines added and removed while a job runs (the REST API's side).

The scaler owns the operations; the `EngineRouter` owns the engines. One operation runs at a
time, on a thread of its own, so the REST call returns at once (202 with the operation) and
the caller polls `GET /rollout/operations/{id}`; a second request while one runs is refused
with 409 and the running operation. The actions and bodies are in elastic/api.py.

Scale-out connects each engine (`connect(url)` for an engine already serving somewhere, e.g. a
grow job's; `spawn(n)` for engines started in the job's own allocation), registers it with the
router ("joining") and joins it (it loads the weights the others run, then serves). When one
engine of the operation cannot join, every engine the operation added leaves again and the
operation ends "rolled_back" with the reason: a scale-out adds all it was asked for or nothing.
URLs already serving are skipped, so a grow job that registers twice adds nothing twice.

Scale-in drains: the engine gets no new work, finishes what it holds (up to `timeout_s`,
after which its prompts go to the others) and is retired; a drain that fails retires the engine
all the same, so none stays "draining". Every number of a body is bounded (elastic/api.py): a
body that is not refuses with 400 before any operation exists. The job's own engines are protected
unless the request says `"force": true`; the last serving engine is never removed.

    scaler = ElasticScaler(router, connect=lambda url, job: RemoteEngineClient(...))
    scaler.elastic("scale_out", {"engine_urls": ["http://n3:30001"], "job": "4242"})  # 202
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relax_hpc.engines.elastic.api import (
    ACTIONS,
    MAX_FLEET_ENGINES,
    MAX_JOB_CHARS,
    MAX_TIMEOUT_S,
    MAX_URL_CHARS,
    ElasticReply,
    error_reply,
)
from relax_hpc.engines.router import EngineClient, EngineRouter

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_JOIN_TIMEOUT_S = 600.0
KEPT_OPERATIONS = 100  # finished operations remembered for GET /rollout/operations

Connect = Callable[[str, str, str | None], EngineClient]  # (engine id, url, job) -> a client
Spawn = Callable[[list[str]], list[EngineClient]]  # engine ids -> clients of engines started here
# (urls, job) -> None when the job may send its engine token to every URL's host, else the 400
# message saying which URLs are refused and what is accepted (engines/elastic/hosts.py).
CheckHosts = Callable[[list[str], str | None], str | None]


@dataclass
class Operation:
    id: str
    kind: str  # "scale_out" | "scale_in"
    requested: dict[str, Any]
    state: str = "pending"
    engines: list[str] = field(default_factory=list)  # ids of the engines it added or removed
    message: str = ""
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None

    def view(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "state": self.state, "engines": list(self.engines),
                "message": self.message, "requested": dict(self.requested), "started_at": self.started_at,
                "finished_at": self.finished_at}

    @property
    def running(self) -> bool:
        return self.state in ("pending", "running")


class BadRequest(ValueError):
    """A request body the scaler cannot act on (answered 400 with this message)."""


class ElasticScaler:
    """The `ElasticControl` of a rollout role; see the module docstring."""

    def __init__(self, router: EngineRouter, connect: Connect | None = None, spawn: Spawn | None = None,
                 join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S, check_hosts: CheckHosts | None = None) -> None:
        """`check_hosts`: which engine URLs the job may send its engine token to (None: any;
        the rollout role passes `engine_hosts.EngineHostPolicy.check`)."""
        self.router = router
        self._connect, self._spawn, self._check_hosts = connect, spawn, check_hosts
        self.join_timeout_s = join_timeout_s
        self._lock = threading.Lock()
        self._operations: dict[str, Operation] = {}
        self._current: Operation | None = None
        self._ids = itertools.count(1)
        self._engine_ids = itertools.count(len(router.engines))
        self._pending: dict[str, dict[str, Any]] = {}  # engines being connected: not in the router yet

    # -- the one entry point ----------------------------------------------------------------------

    def elastic(self, action: str, body: dict[str, Any] | None = None) -> ElasticReply:
        body = body or {}
        if action not in ACTIONS:
            return error_reply(404, f"no elastic action {action!r}; actions: {', '.join(ACTIONS)}")
        if not isinstance(body, dict):
            return error_reply(400, 'the body must be a JSON object, e.g. {"num_engines": 1}')
        try:
            if action == "engines":
                return ElasticReply(200, {"engines": self.engines(), "operation": self._current_view()})
            if action == "operations":
                with self._lock:
                    return ElasticReply(200, {"operations": [op.view() for op in self._operations.values()]})
            if action == "operation":
                with self._lock:
                    op = self._operations.get(str(body.get("id")))
                if op is None:
                    return error_reply(404, f"no operation {body.get('id')!r}; GET /rollout/operations lists them")
                return ElasticReply(200, {"operation": op.view()})
            return self._start(action, body)
        except BadRequest as e:
            return error_reply(400, str(e))

    def engines(self) -> list[dict[str, Any]]:
        """Every engine the router knows, and those still being connected ("pending")."""
        with self._lock:
            pending = [dict(p) for p in self._pending.values()]
        return [{k: v for k, v in e.items() if k != "alive"} for e in self.router.report()] + pending

    def _current_view(self) -> dict[str, Any] | None:
        with self._lock:
            return self._current.view() if self._current is not None and self._current.running else None

    # -- starting an operation ---------------------------------------------------------------------

    def _start(self, kind: str, body: dict[str, Any]) -> ElasticReply:
        plan = self._plan_out(body) if kind == "scale_out" else self._plan_in(body)
        with self._lock:
            if self._current is not None and self._current.running:
                running = self._current.view()
                return error_reply(409, f"operation {running['id']} ({running['kind']}) is in progress; wait for it "
                                   f"(GET /rollout/operations/{running['id']}) and retry", operation=running)
            op = Operation(f"op-{next(self._ids)}", kind, dict(body))
            self._operations[op.id] = op
            self._current = op
            while len(self._operations) > KEPT_OPERATIONS:
                self._operations.pop(next(iter(self._operations)))
        run = self._scale_out if kind == "scale_out" else self._scale_in
        threading.Thread(target=self._run, args=(op, run, plan), name=f"elastic-{op.id}", daemon=True).start()
        return ElasticReply(202, {"operation": op.view()})

    def _run(self, op: Operation, run: Callable[[Operation, Any], None], plan: Any) -> None:
        op.state = "running"
        try:
            run(op, plan)
        except Exception as e:  # reported on the operation; the job goes on with the engines it has
            log.exception("elastic %s %s failed", op.kind, op.id)
            op.state, op.message = "failed", f"{type(e).__name__}: {e}"
        finally:
            op.finished_at = time.time()
            log.info("elastic %s %s: %s %s", op.kind, op.id, op.state, op.message)

    # -- scale-out ------------------------------------------------------------------------------

    def _plan_out(self, body: dict[str, Any]) -> dict[str, Any]:
        _only(body, ("num_engines", "engine_urls", "job", "timeout_s"), "scale_out")
        urls, count = body.get("engine_urls"), body.get("num_engines")
        if (urls is None) == (count is None):
            raise BadRequest('scale_out needs exactly one of "num_engines" (engines started in this job\'s '
                             'allocation) or "engine_urls" (engines serving elsewhere, e.g. a grow job\'s)')
        timeout = _seconds(body.get("timeout_s", self.join_timeout_s), "timeout_s")
        job = _job(body.get("job"))
        room = self._fleet_room()
        if count is not None:
            if self._spawn is None:
                raise BadRequest('this job cannot start engines in its own allocation; register engines that '
                                 'serve elsewhere with "engine_urls" (relax-hpc grow does so)')
            return {"count": _count(count, "num_engines", room, self._room_note(room)), "timeout": timeout,
                    "job": None}
        if not isinstance(urls, list) or not urls or not all(isinstance(u, str) and u for u in urls):
            raise BadRequest('"engine_urls" must be a non-empty list of engine URLs, e.g. ["http://node7:30001"]')
        if len(urls) > room:
            raise BadRequest(f'"engine_urls" lists {len(urls)} URLs; at most {room} can join '
                             f"{self._room_note(room)}: send fewer")
        long = [u[:80] + "..." for u in urls if len(u) > MAX_URL_CHARS]
        if long:
            raise BadRequest(f"engine URLs must be at most {MAX_URL_CHARS} characters: {long}")
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise BadRequest(f"engine URLs must start with http:// or https://: {bad}")
        if self._connect is None:
            raise BadRequest("this job cannot connect engines by URL")
        unique = [u.rstrip("/") for u in dict.fromkeys(urls)]
        refused = self._check_hosts(unique, job) if self._check_hosts is not None else None
        if refused:
            raise BadRequest(refused)
        return {"urls": unique, "timeout": timeout, "job": job}

    def _fleet_room(self) -> int:
        """How many engines may still join: MAX_FLEET_ENGINES less those serving, joining or pending."""
        with self._lock:
            pending = len(self._pending)
        busy = sum(e["state"] in ("joining", "active", "draining") for e in self.router.report())
        return max(MAX_FLEET_ENGINES - busy - pending, 0)

    @staticmethod
    def _room_note(room: int) -> str:
        return (f"(the fleet holds at most {MAX_FLEET_ENGINES} engines, {MAX_FLEET_ENGINES - room} are in it; "
                "scale in first to make room)")

    def _scale_out(self, op: Operation, plan: dict[str, Any]) -> None:
        joined: list[int] = []
        try:
            if "count" in plan:
                ids = [f"engine-{next(self._engine_ids)}" for _ in range(plan["count"])]
                clients = self._track_pending(ids, ["in-job"] * len(ids), None, lambda: self._spawn(ids))
            else:
                serving = {e["address"] for e in self.router.report() if e["state"] in ("joining", "active")}
                urls = [u for u in plan["urls"] if u not in serving]
                skipped = len(plan["urls"]) - len(urls)
                if not urls:
                    op.state, op.message = "done", f"all {skipped} engines already serve; nothing to add"
                    return
                ids = [f"engine-{next(self._engine_ids)}" for _ in urls]
                assert self._connect is not None
                connect = self._connect
                clients = self._track_pending(ids, urls, plan["job"],
                                              lambda: [connect(i, u, plan["job"]) for i, u in zip(ids, urls)])
            for client in clients:
                k = self.router.add_engine(client, job=plan["job"], protected=False)
                op.engines.append(client.id)
                joined.append(k)
                self.router.join(k, timeout_s=plan["timeout"])
        except Exception as e:
            for k in joined:  # all or nothing: what this operation added leaves again
                if self.router.engines[k].state in ("joining", "active"):
                    self.router.drain(k, DEFAULT_DRAIN_TIMEOUT_S)
            op.state = "rolled_back"
            op.message = (f"scale-out failed, {len(joined)} engines it had added were removed again: "
                          f"{type(e).__name__}: {e}")
            return
        op.state = "done"
        op.message = f"{len(joined)} engines joined; {self.router.serving()} serve"

    def _track_pending(self, ids: list[str], addresses: list[str], job: str | None,
                       make: Callable[[], list[EngineClient]]) -> list[EngineClient]:
        """Show the engines as "pending" while they are started or connected."""
        with self._lock:
            for i, address in zip(ids, addresses):
                self._pending[i] = {"id": i, "address": address, "state": "pending", "weight_version": None,
                                    "samples": 0, "job": job, "protected": False}
        try:
            return make()
        finally:
            with self._lock:
                for i in ids:
                    self._pending.pop(i, None)

    # -- scale-in -------------------------------------------------------------------------------

    def _plan_in(self, body: dict[str, Any]) -> dict[str, Any]:
        keys = ("num_engines", "engine_ids", "engine_urls", "job")
        _only(body, (*keys, "force", "timeout_s"), "scale_in")
        given = [k for k in keys if body.get(k) is not None]
        if len(given) != 1:
            raise BadRequest(f"scale_in needs exactly one of {', '.join(repr(k) for k in keys)}; got "
                             f"{', '.join(given) or 'none'}")
        force = body.get("force", False)
        if not isinstance(force, bool):
            raise BadRequest(f'"force" must be true or false, got {force!r}')
        timeout = _seconds(body.get("timeout_s", DEFAULT_DRAIN_TIMEOUT_S), "timeout_s")
        engines = [e for e in self.router.report() if e["state"] in ("joining", "active")]
        key = given[0]
        if key == "num_engines":
            n = _count(body[key], key, MAX_FLEET_ENGINES, f"(the fleet holds at most {MAX_FLEET_ENGINES} engines)")
            candidates = [e for e in engines if force or not e["protected"]]
            chosen = list(reversed(candidates))[:n]  # the newest first
        else:
            wanted = body[key]
            if key == "job":
                chosen = [e for e in engines if e["job"] == _job(wanted)]
            else:
                if not isinstance(wanted, list) or not all(isinstance(w, str) for w in wanted):
                    raise BadRequest(f'"{key}" must be a list of strings')
                if len(wanted) > MAX_FLEET_ENGINES or any(len(w) > MAX_URL_CHARS for w in wanted):
                    raise BadRequest(f'"{key}" may list at most {MAX_FLEET_ENGINES} entries of at most '
                                     f"{MAX_URL_CHARS} characters each (GET /rollout/engines lists the engines)")
                field_name = "id" if key == "engine_ids" else "address"
                wanted = [w.rstrip("/") for w in wanted]
                known = {e[field_name] for e in self.router.report()}
                unknown = [w for w in wanted if w not in known]
                if unknown:
                    raise BadRequest(f"no engine has {field_name} {unknown}; GET /rollout/engines lists them")
                chosen = [e for e in engines if e[field_name] in wanted]
            protected = [e["id"] for e in chosen if e["protected"]]
            if protected and not force:
                raise BadRequest(f"engines {protected} belong to the job's start-up set and are protected; send "
                                 '"force": true to remove them anyway')
        if chosen and len(chosen) >= len(engines):
            raise BadRequest(f"removing {len(chosen)} of the {len(engines)} serving engines would leave none; "
                             "the job needs at least one (cancel the job to stop it)")
        return {"ids": [e["id"] for e in chosen], "timeout": timeout}

    def _scale_in(self, op: Operation, plan: dict[str, Any]) -> None:
        index = {e.client.id: k for k, e in enumerate(self.router.engines)}
        late, broken = [], []
        for engine_id in plan["ids"]:
            op.engines.append(engine_id)
            try:
                if not self.router.drain(index[engine_id], plan["timeout"]):
                    late.append(engine_id)
            except Exception as e:  # the engine leaves all the same: it must not stay "draining"
                log.exception("draining rollout engine %s failed; retiring it", engine_id)
                self.router.retire(index[engine_id])
                broken.append(f"{engine_id} ({type(e).__name__}: {e})")
        op.state = "failed" if broken else "done"
        if not plan["ids"]:
            op.message = "no engine matched; nothing removed"
            return
        op.message = (f"{len(plan['ids'])} engines removed; {self.router.serving()} serve"
                      + (f"; {late} did not finish within {plan['timeout']:g} s and their prompts went to the "
                         "others" if late else "")
                      + (f"; the drain of {', '.join(broken)} failed, so they were retired at once and their "
                         "prompts went to the others (the rollout log has the traceback)" if broken else ""))


def _only(body: dict[str, Any], allowed: tuple[str, ...], action: str) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise BadRequest(f"{action} does not take {unknown}; allowed keys: {', '.join(allowed)}")


def _shown(value: Any) -> str:
    """A value as the message shows it (a huge number or string is cut, never printed whole)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**18:
        return f"a whole number of about {int(abs(value).bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _count(value: Any, key: str, most: int, why: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
        if most < 1:
            raise BadRequest(f'"{key}": no engine can be added now {why}; got {_shown(value)}')
        raise BadRequest(f'"{key}" must be a whole number >= 1 and at most {most} {why}, got {_shown(value)}')
    return value


def _seconds(value: Any, key: str) -> float:
    """A finite number of seconds in (0, MAX_TIMEOUT_S]: infinity, NaN and 1e300 would break the
    thread waits (OverflowError) and the JSON of the operation (no Infinity in JSON)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise BadRequest(f'"{key}" must be a finite number of seconds > 0 and at most {MAX_TIMEOUT_S:g}, '
                         f"got {_shown(value)}")
    return float(value)


def _job(value: Any) -> str | None:
    """The Slurm job id of a body's "job" (a string or a whole number), or None when absent."""
    if value is None:
        return None
    text = ""
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)
                                  and 0 <= value < 10**MAX_JOB_CHARS):
        text = str(value)
    if not text or len(text) > MAX_JOB_CHARS or not text.isprintable():
        raise BadRequest(f'"job" must be the Slurm job id of the engines (a string of 1 to {MAX_JOB_CHARS} '
                         f"printable characters, e.g. \"4242\"), got {_shown(value)}")
    return text
