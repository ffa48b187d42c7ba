"""One `relax-hpc run` of the fault suite: started as a session of its own, watched through its
metrics.jsonl, and every process it started ended afterwards.

The run starts a local Ray cluster (GCS, raylet, workers). Ray gives its workers process groups
of their own, so killing the driver's group is not enough; they all stay in the driver's
*session*, though, which is what `JobProcess.kill_all` ends, and nothing outside it: other runs
on the same machine (and their Ray clusters) are left alone. `ray stop` would not be.

metrics.jsonl records carry no wall time, so `MetricsTail` notes when each record was first
seen; the suite polls it every `POLL_S`, which bounds the error of every time it reports.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

POLL_S = 0.05
KILL_WAIT_S = 30.0  # for SIGKILLed processes to be gone
SETTLE_S = 15.0  # after the driver exits, for its Ray workers to exit on their own

WaitResult = Literal["ok", "exited", "timeout"]


def session_of(pid: int) -> int | None:
    """The session id of a live (not zombie) process, from /proc; None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name, in parentheses, may hold spaces: the fields start after the last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):  # dead, waiting to be reaped: it holds no resources
        return None
    return int(fields[3])  # state, ppid, pgrp, session


def session_processes(sid: int) -> list[int]:
    """The live processes of session `sid`."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and session_of(int(entry.name)) == sid:
            found.append(int(entry.name))
    return sorted(found)


@dataclass(frozen=True)
class StepRecord:
    seen: float  # time.monotonic() when the suite first read it
    step: int
    scalars: dict[str, Any]


class MetricsTail:
    """The records of a growing metrics.jsonl, each with the time it was first seen."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self._clock = Path(path), clock
        self._offset = 0
        self._partial = b""
        self.records: list[StepRecord] = []

    def poll(self) -> list[StepRecord]:
        """Read what was appended since the last poll; a line still being written waits."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        now, new = self._clock(), []
        for line in lines:
            try:
                record = json.loads(line)
                new.append(StepRecord(now, int(record["step"]), record))
            except (ValueError, KeyError, TypeError):
                continue  # not a step record: nothing to time
        self.records += new
        return new

    def last_step(self) -> int:
        """The step of the newest record (a resumed run goes back to its checkpoint's), 0 before any."""
        return self.records[-1].step if self.records else 0

    def max_scalar(self, name: str) -> float:
        return max((float(r.scalars[name]) for r in self.records if name in r.scalars), default=0.0)


class JobProcess:
    """`command` in a new session, its output appended to `log_path`."""

    def __init__(self, command: list[str], log_path: Path, env: Mapping[str, str]) -> None:
        self.command, self.log_path, self.env = command, Path(log_path), dict(env)
        self.started_at = 0.0  # time.time(), to tell this run's files from an earlier one's
        with self.log_path.open("ab") as log:
            log.write(f"\n$ {' '.join(command)}\n".encode())
            self.started_at = time.time()
            self._proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.pid = self.sid = self._proc.pid

    def exit_code(self) -> int | None:
        return self._proc.poll()

    def owns(self, pid: int) -> bool:
        """Whether `pid` is one of this run's live processes (a pid from a file is checked first)."""
        if pid == self.sid and self._proc.poll() is not None:
            return False  # the driver was reaped: a process with its number now is another's
        return session_of(pid) == self.sid

    def signal_driver(self, sig: int) -> None:
        if self._proc.poll() is None:
            os.kill(self.pid, sig)

    def members(self) -> list[int]:
        return [pid for pid in session_processes(self.sid) if self.owns(pid)]

    def kill_all(self, wait_s: float = KILL_WAIT_S) -> list[int]:
        """SIGKILL every process of the session (stopped ones too) until none is left; returns
        those still there after `wait_s` (none, unless a process hangs in the kernel)."""
        deadline = time.monotonic() + wait_s
        while True:
            left = self.members()
            if not left or time.monotonic() > deadline:
                self._proc.poll()
                return left
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._proc.poll()  # reap the driver, once dead
            time.sleep(POLL_S)

    def finish(self, settle_s: float = SETTLE_S) -> list[int]:
        """End the run's processes: once the driver exited, its Ray processes get `settle_s` to
        exit by themselves; a driver still running (the suite was interrupted) is killed at once."""
        if self._proc.poll() is None:
            return self.kill_all()
        deadline = time.monotonic() + settle_s
        while self.members() and time.monotonic() < deadline:
            time.sleep(POLL_S * 4)
        return self.kill_all()

    def wait_until(self, ready: Callable[[], bool], tail: MetricsTail, deadline: float) -> WaitResult:
        """Poll `tail` until `ready()`, the driver exits, or `deadline` (time.monotonic())."""
        while True:
            tail.poll()
            if ready():
                return "ok"
            if self._proc.poll() is not None:
                tail.poll()
                return "ok" if ready() else "exited"
            if time.monotonic() > deadline:
                return "timeout"
            time.sleep(POLL_S)

    def wait_exit(self, tail: MetricsTail, deadline: float) -> int | None:
        """The driver's exit status, or None when `deadline` passed first (it is then killed)."""
        if self.wait_until(lambda: False, tail, deadline) == "timeout":
            self.kill_all()
            return None
        return self._proc.returncode


_ERROR_LINE = re.compile(r"^(\w+\.)*\w*(Error|Exception|Exhausted)\b|^relax-hpc \w[\w-]*: ")


def log_tail(path: Path, max_chars: int = 240) -> str:
    """What a failed row quotes from the run's log: its last error line (an exception, or
    `relax-hpc run: ...`), else its last line; shortened."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.match(line)]
    last = (errors or lines or [""])[-1]
    return last if len(last) <= max_chars else last[: max_chars - 3] + "..."
