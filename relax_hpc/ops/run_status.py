"""A run's live status: `JOBDIR/status.json`, written by the driver, read by `relax-hpc status`.

    status = RunStatus(job_dir, "tiny_local", total_steps=400)   # state "starting"
    status.set_state("running")
    status.on_step(12, metrics, samples_trained=256)             # after every step
    status.set_roles({"rollout": {"state": "running", "restarts": 0}, ...})
    status.set_state("finished")

The driver rewrites the whole file on every change (write-then-rename, 0600), so a reader on
any node of the job always finds a complete one. It holds what only the driver knows: the
state, progress, what the driver decided about each role, the router's engines, restarts and
the latest health events. What each role process last did comes from its own heartbeat file
(relax_hpc/ops/health.py); `status_lines` joins the two with the newest complete checkpoint and
whether the driver still lives into the summary `relax-hpc status JOBDIR` prints.

A failed write is logged once and otherwise ignored: the status never stops training.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomllib

from relax_hpc.ops.files import write_private_text
from relax_hpc.ops.health import heartbeat_path, read_heartbeats
from relax_hpc.ops.progress import format_duration
from relax_hpc.spec.schema import HealthSpec

__all__ = ["STATUS_FILE", "RunStatus", "driver_alive", "newest_checkpoint_dir", "read_status", "status_lines"]

log = logging.getLogger(__name__)

STATUS_FILE = "status.json"
STATES = ("starting", "running", "restarting", "finished", "stopped", "failed")
LIVE_STATES = frozenset({"starting", "running", "restarting"})  # a driver should be behind these
MAX_EVENTS = 50  # kept in the file
SHOWN_EVENTS = 5  # printed by status_lines
RATE_WINDOW = 10  # steps in the samples/s mean
# The checkpoint layout (relax_hpc/ckpt/layout.py): read here by name, since ops sits under ckpt.
CHECKPOINTS_DIR, LATEST_FILE = "checkpoints", "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _finite(value: Any) -> float | None:
    """JSON has no NaN: a missing or non-finite number is written as null."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


class RunStatus:
    """The driver's writer of JOBDIR/status.json; thread-safe (the loop and the health watcher
    both report). Each setter changes its part and rewrites the file."""

    def __init__(self, job_dir: str | Path, job_name: str, total_steps: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(job_dir) / STATUS_FILE
        self._clock = clock
        self._lock = threading.Lock()
        self._rates: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW)  # (samples, seconds) per step
        self._warned = False
        now = clock()
        self._data: dict[str, Any] = {
            "job": job_name, "job_dir": str(Path(job_dir)), "state": "starting", "note": "",
            "driver": {"pid": os.getpid(), "host": socket.gethostname(), "started": now},
            "updated": now, "total_steps": int(total_steps),
            "step": None, "reward": None, "step_s": None, "samples_per_s": None,
            "samples_per_s_mean": None, "samples_since_start": 0, "step_time": None,
            "roles": {}, "engines": [], "restarts": {"in_place": 0, "global": 0},
            "events": [], "checkpoint": None,
        }
        self._write()

    def set_state(self, state: str, note: str = "") -> None:
        """``state`` is one of STATES; ``note`` says why, in words (shown next to it)."""
        if state not in STATES:
            raise ValueError(f"run state {state!r}: expected one of {', '.join(STATES)}")
        self._update(state=state, note=note)

    def on_step(self, step: int, metrics: dict[str, float], samples_trained: int) -> None:
        """After step ``step`` (1-based, as in metrics.jsonl); ``samples_trained`` is the number
        of samples trained in this step alone, ``metrics`` the step's metrics."""
        step_s = _finite(metrics.get("time/step_s"))
        with self._lock:
            rate = None
            if step_s is not None and step_s > 0:
                self._rates.append((int(samples_trained), step_s))
                rate = samples_trained / step_s
            seconds = sum(s for _, s in self._rates)
            mean = sum(n for n, _ in self._rates) / seconds if seconds > 0 else None
            self._data.update(
                step=int(step), reward=_finite(metrics.get("reward/mean")), step_s=step_s,
                samples_per_s=_finite(rate), samples_per_s_mean=_finite(mean), step_time=self._clock(),
                samples_since_start=self._data["samples_since_start"] + int(samples_trained))
            self._write_locked()

    def set_roles(self, roles: dict[str, dict[str, Any]]) -> None:
        """Per role: {"state": "running" | "restarting" | "replaced" | "dead" | "stale", "restarts": n, ...}."""
        self._update(roles={name: dict(info) for name, info in roles.items()})

    def set_engines(self, engines: list[dict[str, Any]]) -> None:
        """The router's report (EngineRouter.report): id, address, state, weight_version, ..."""
        self._update(engines=[dict(e) for e in engines])

    def set_memory(self, records: list[dict[str, Any]]) -> None:
        """Each role's bytes held (relax_hpc/roles/memory.py MemoryRecord.as_dict)."""
        self._update(memory=[dict(r) for r in records])

    def set_restarts(self, in_place: int, global_restarts: int) -> None:
        self._update(restarts={"in_place": int(in_place), "global": int(global_restarts)})

    def add_event(self, line: str) -> None:
        """One line of what happened (a HealthEvent's line()); the newest MAX_EVENTS are kept."""
        with self._lock:
            events = [*self._data["events"], {"time": self._clock(), "line": str(line)}]
            self._data["events"] = events[-MAX_EVENTS:]
            self._write_locked()

    def set_checkpoint(self, path: str | None) -> None:
        """The checkpoint this run wrote last (None: none yet)."""
        self._update(checkpoint=None if path is None else str(path))

    def _update(self, **changes: Any) -> None:
        with self._lock:
            self._data.update(changes)
            self._write_locked()

    def _write(self) -> None:
        with self._lock:
            self._write_locked()

    def _write_locked(self) -> None:
        self._data["updated"] = self._clock()
        try:
            text = json.dumps(self._data, indent=1, default=str)  # a stray type never fails the driver
            write_private_text(self.path, text)
        except (OSError, ValueError) as e:
            if not self._warned:  # once: a full disk would otherwise log on every step
                log.warning("cannot write %s (%s); `relax-hpc status` shows the last one written", self.path, e)
                self._warned = True


def read_status(job_dir: str | Path) -> dict[str, Any] | None:
    """JOBDIR/status.json as written by RunStatus; None when there is none (or it is unreadable)."""
    try:
        data = json.loads((Path(job_dir) / STATUS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def driver_alive(status: dict[str, Any]) -> bool | None:
    """Whether the driver process named in ``status`` lives: None when it ran on another host
    (its pid means nothing here)."""
    driver = status.get("driver") or {}
    pid = driver.get("pid")
    if driver.get("host") != socket.gethostname() or not isinstance(pid, int):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user: it exists
        return True
    return True


# --- the summary -------------------------------------------------------------------------------


def status_lines(job_dir: str | Path, now: float | None = None) -> list[str]:
    """What `relax-hpc status JOBDIR` prints: state, progress, roles, engines, checkpoint, events."""
    job_dir = Path(job_dir)
    now = time.time() if now is None else now
    status = read_status(job_dir)
    beats = read_heartbeats(job_dir)
    if status is None and not beats:
        if (job_dir / STATUS_FILE).exists():
            return [f"{job_dir / STATUS_FILE} is unreadable; it is rewritten at the run's next change"]
        return [(f"{job_dir}: no {STATUS_FILE}: the run has not started yet, or this is not a job directory "
                 f"(`relax-hpc run SPEC` writes it there when it starts)")]
    heartbeat_s, stale_s = _health_settings(job_dir)
    if status is None:  # a driver that does not write it (yet): its own heartbeat tells if it lives
        driver = beats.get("driver") or {}
        gone = driver_alive({"driver": driver}) is False
        live = not gone
        out = [f"run in {job_dir}", f"  state      unknown: no {STATUS_FILE}, only heartbeats"
               + (f"; driver pid {driver.get('pid')} is gone" if gone else "")]
    else:
        state, live = _state_text(status, now)
        out = [f"run {status.get('job')}  ({job_dir})", f"  state      {state}", _progress_line(status, now)]
    out += _role_lines((status or {}).get("roles") or {}, beats, job_dir, now, live, heartbeat_s, stale_s)
    out += _engine_lines((status or {}).get("engines") or [])
    out += memory_lines((status or {}).get("memory") or [])
    out.append(_checkpoint_line(job_dir))
    if status is not None:
        restarts = status.get("restarts") or {}
        out.append(f"  restarts   {restarts.get('in_place', 0)} in place, {restarts.get('global', 0)} global")
        out += _event_lines(status.get("events") or [])
    return out


def memory_lines(records: list[dict[str, Any]]) -> list[str]:
    """One line per role: what it holds on its device and in host memory, by category (GiB or
    MiB), and its share of the whole model's parameters."""
    out = []
    for r in records:
        if not isinstance(r, dict):
            continue
        device = {k: v for k, v in (r.get("on_device") or {}).items() if v}
        host = {k: v for k, v in (r.get("in_host_memory") or {}).items() if v}
        model = r.get("model_bytes") or 0
        share = ""
        if model and "parameters" in device:
            share = f" ({device['parameters'] / model:.0%} of the model's parameters)"
        parts = ", ".join(f"{k} {_bytes_text(v)}" for k, v in device.items()) or "nothing"
        line = f"  memory     {r.get('role')} {r.get('rank')} on {r.get('device')}: {parts}{share}"
        if host:
            line += "; host: " + ", ".join(f"{k} {_bytes_text(v)}" for k, v in host.items())
        out.append(line)
    return out


def _bytes_text(n: Any) -> str:
    n = float(n)
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _health_settings(job_dir: Path) -> tuple[float, float]:
    """[health] heartbeat_s and stale_s of the run's spec (JOBDIR/spec.toml), else the defaults."""
    for name in ("spec.toml", "spec.submit.toml"):
        try:
            health = tomllib.loads((job_dir / name).read_text(encoding="utf-8")).get("health", {})
        except (OSError, ValueError):
            continue
        try:
            return (float(health.get("heartbeat_s", HealthSpec.heartbeat_s)),
                    float(health.get("stale_s", HealthSpec.stale_s)))
        except (TypeError, ValueError):
            break
    return HealthSpec.heartbeat_s, HealthSpec.stale_s


def _ago(then: Any, now: float) -> str:
    return "?" if not isinstance(then, (int, float)) else f"{format_duration(now - then)} ago"


def _state_text(status: dict[str, Any], now: float) -> tuple[str, bool]:
    """The state line and whether the run is live (a live state with its driver not known gone)."""
    state = str(status.get("state", "?"))
    note = str(status.get("note") or "")
    driver = status.get("driver") or {}
    pid, host = driver.get("pid"), driver.get("host")
    text = state + (f": {note}" if note else "")
    if state not in LIVE_STATES:  # finished, stopped or failed: when, not a driver that looks alive
        ended = status.get("updated")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ended)) if isinstance(ended, (int, float)) else "?"
        return f"{state} at {stamp} ({_ago(ended, now)})" + (f": {note}" if note else ""), False
    alive = driver_alive(status)
    if alive is False:
        return (f"{text} (driver pid {pid} is gone: the run was killed; `relax-hpc run` again resumes it "
                f"from its newest checkpoint)"), False
    where = "this host" if alive else f"host {host}, not this one: not checked"
    return f"{text}  (driver pid {pid} on {where}, started {_ago(driver.get('started'), now)})", True


def _progress_line(status: dict[str, Any], now: float) -> str:
    step, total = status.get("step"), status.get("total_steps")
    if step is None:
        return f"  step       none finished yet of {total}"
    parts = [f"{step}/{total}"]
    if status.get("reward") is not None:
        parts.append(f"reward {status['reward']:.3f}")
    if status.get("step_s") is not None:
        parts.append(f"{status['step_s']:.2f} s/step")
    if status.get("samples_per_s") is not None:
        mean = status.get("samples_per_s_mean")
        parts.append(f"{status['samples_per_s']:.1f} samples/s"
                     + (f" ({mean:.1f} over the last {RATE_WINDOW} steps)" if mean is not None else ""))
    return f"  step       {'  '.join(parts)}  ({_ago(status.get('step_time'), now)})"


def _role_order(role: str) -> tuple[int, int, str]:
    """driver, rollout, trainer ranks, the queue roles, engines; numbers in numeric order."""
    head = ("driver", "rollout", "trainer_rank_", "actor_fwd", "reference", "advantages", "engine_")
    for rank, prefix in enumerate(head):
        if role == prefix or (prefix.endswith("_") and role.startswith(prefix)):
            tail = role[len(prefix):]
            return rank, int(tail) if tail.isdigit() else 0, role
    return len(head), 0, role


def _role_lines(roles: dict[str, Any], beats: dict[str, dict[str, Any]], job_dir: Path, now: float,
                live: bool, heartbeat_s: float, stale_s: float) -> list[str]:
    names = sorted(set(roles) | set(beats), key=_role_order)
    if not names:
        return ["  roles      none reported yet"]
    out = [f"  roles      (heartbeat every {heartbeat_s:g}s, stale after {stale_s:g}s)"]
    for name in names:
        info, beat = roles.get(name) or {}, beats.get(name)
        age = _beat_age(job_dir, name, beat, now)
        health = str(info.get("state") or ("running" if beat is not None else "?"))
        if not live:
            health = health if health == "dead" else "ended"
        elif beat is None:
            health = f"{health}, no heartbeat"
        elif age is not None and age > stale_s and health in ("running", "?"):
            health = "stale"  # the driver may not have noticed yet; a restarting role beats anew
        fields = [f"    {name:<16} {health:<10}"]
        if beat is not None:
            where = beat.get("node") or beat.get("host")  # the Slurm node: dev-slurm's nodes share one host
            fields.append(f"pid {beat.get('pid')!s:<7} {where!s:<12} {'beat' if live else 'last beat'} "
                          f"{'?' if age is None else format_duration(age)} ago")
            if beat.get("doing"):  # an ended run's role is doing nothing now: what it did last
                fields.append(str(beat["doing"]) if live else f"last: {beat['doing']}")
        if info.get("restarts"):
            fields.append(f"restarts {info['restarts']}")
        out.append("  ".join(fields))
    return out


def _beat_age(job_dir: Path, role: str, beat: dict[str, Any] | None, now: float) -> float | None:
    """Seconds since the role's heartbeat file was last written (the file's time: one clock, the
    file system's, for writers on every node)."""
    if beat is None:
        return None
    try:
        return max(0.0, now - heartbeat_path(job_dir, role).stat().st_mtime)
    except OSError:
        return None


def _engine_lines(engines: list[dict[str, Any]]) -> list[str]:
    if not engines:
        return []
    active = sum(1 for e in engines if e.get("state") == "active" and e.get("alive", True))
    out = [f"  engines    {len(engines)}, {active} active"]
    for e in engines:
        version = e.get("weight_version")
        flags = [word for word, on in (("protected", e.get("protected")), ("dead", e.get("alive") is False)) if on]
        out.append(f"    {e.get('id')!s:<10} {e.get('job') or 'main'!s:<10} {e.get('state')!s:<9} "
                   f"v{'-' if version is None else version!s:<6} {e.get('samples', 0)!s:>7} samples  "
                   f"{e.get('address') or '-'}" + (f"  ({', '.join(flags)})" if flags else ""))
    return out


def newest_checkpoint_dir(job_dir: Path) -> Path | None:
    """The checkpoint a resuming run loads first: the one `checkpoints/latest` names, else the
    newest step_<N> directory (the same rule as relax_hpc/ckpt/layout.py load_order)."""
    root = job_dir / CHECKPOINTS_DIR
    try:
        pointer = _STEP_DIR.match((root / LATEST_FILE).read_text(encoding="utf-8").strip())
    except OSError:
        pointer = None
    if pointer is not None and (root / pointer.group(0)).is_dir():
        return root / pointer.group(0)
    try:
        steps = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    except OSError:
        return None
    return max(steps)[1] if steps else None


def _checkpoint_line(job_dir: Path) -> str:
    newest = newest_checkpoint_dir(job_dir)
    return f"  checkpoint {newest.name} ({newest})" if newest is not None else "  checkpoint none yet"


def _event_lines(events: list[dict[str, Any]]) -> list[str]:
    if not events:
        return []
    shown = events[-SHOWN_EVENTS:]
    out = [f"  events     (the last {len(shown)} of {len(events)} kept)" if len(events) > len(shown) else "  events"]
    for event in shown:
        when = event.get("time")
        stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(when)) if isinstance(when, (int, float)) else "?"
        out.append(f"    {stamp}  {event.get('line')}")
    return out
