"""The Slurm boundary: a small interface, the subprocess adapter, and an in-memory fake.

Everything in relax_hpc that talks to Slurm goes through :class:`SlurmClient`, so the submit,
status and cancel logic is tested without a cluster (:class:`FakeSlurmClient`) and against
the real one (:class:`SubprocessSlurmClient`, which runs sbatch / sbatch --test-only / squeue --json
/ sinfo --json / sacct --json / scontrol / scancel).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = ["FakeSlurmClient", "JobComponent", "SlurmClient", "SlurmError", "SubprocessSlurmClient"]


class SlurmError(RuntimeError):
    """A Slurm command failed; the message names the command and carries its stderr."""


@dataclass(frozen=True)
class JobComponent:
    """One component (hetjob group) of a job as Slurm reports it."""

    job_id: str  # the component's own id (het_job_id + offset for a hetjob)
    offset: int  # hetjob group index; 0 for a plain job
    state: str  # PENDING, RUNNING, COMPLETED, ...
    nodes: str  # node list, "" while pending
    name: str = ""
    reason: str = ""
    stdout: str = ""  # the --output path (relax-hpc jobs: JOBDIR/logs/slurm-%j.out)


class SlurmClient(Protocol):
    def sbatch(self, script: Path, cwd: Path, env: Mapping[str, str]) -> str:
        """Submit ``script`` from ``cwd``; the job id."""
        ...

    def job_components(self, job_id: str) -> list[JobComponent]:
        """The components of a job still known to the controller (squeue); [] once it is gone."""
        ...

    def accounting(self, job_id: str) -> list[JobComponent] | None:
        """Components from accounting (sacct); None when accounting is not available."""
        ...

    def nodes(self) -> list[dict[str, Any]]:
        """``sinfo --json``'s node records (name, cpus, gres, partitions, state, ...)."""
        ...

    def test_only(self, script_text: str, cwd: Path, env: Mapping[str, str]) -> str:
        """Ask Slurm whether and when it would start ``script_text`` (``sbatch --test-only``),
        submitting nothing; Slurm's own answer ("Job N to start at ... on nodes ..."), or
        SlurmError carrying its refusal."""
        ...

    def requeue(self, job_id: str) -> None: ...

    def cancel(self, job_id: str, signal: str | None = None, batch_only: bool = False) -> None: ...


def _squeue_components(records: Sequence[Mapping[str, Any]], job_id: str) -> list[JobComponent]:
    found = []
    for job in records:
        het_id = str(job.get("het_job_id") or 0)
        own_id = str(job.get("job_id"))
        if own_id != job_id and het_id != job_id:
            continue
        found.append(JobComponent(
            job_id=own_id, offset=int(job.get("het_job_offset") or 0), state=str(job.get("job_state", "")),
            nodes=str(job.get("nodes") or ""), name=str(job.get("name", "")),
            reason=str(job.get("state_reason") or ""), stdout=str(job.get("standard_output") or ""),
        ))
    return sorted(found, key=lambda c: c.offset)


def _sacct_components(records: Sequence[Mapping[str, Any]], job_id: str) -> list[JobComponent]:
    found = []
    for job in records:
        het = job.get("het") or {}
        het_id = str(het.get("job_id") or 0)
        own_id = str(job.get("job_id"))
        if own_id != job_id and het_id != job_id:
            continue
        state = job.get("state") or {}
        found.append(JobComponent(
            job_id=own_id, offset=int(het.get("job_offset") or 0),
            state=str(state.get("current", "") if isinstance(state, Mapping) else state),
            nodes=str(job.get("nodes") or ""), name=str(job.get("name", "")),
            reason=str(state.get("reason", "") if isinstance(state, Mapping) else ""),
        ))
    return sorted(found, key=lambda c: c.offset)


# A query (squeue, sacct, sinfo, scontrol show) that met a busy controller is asked again: a
# client killed by a signal (SIGPIPE when slurmctld closed the connection mid-request, seen while a
# job was being requeued) or one that could not reach the controller in time. Commands that change
# something (sbatch, scancel, scontrol requeue) are never repeated: they may have been done.
QUERY_ATTEMPTS = 3
QUERY_RETRY_S = 1.0
_TRANSIENT = ("Socket timed out", "Unable to contact slurm controller", "Connection refused",
              "Zero Bytes were transmitted or received")


def transient_failure(returncode: int, stderr: str) -> bool:
    """Whether a failed Slurm client command is worth asking again (a query only)."""
    return returncode < 0 or any(text in stderr for text in _TRANSIENT)


class SubprocessSlurmClient:
    """The real adapter: runs the Slurm client commands found on PATH."""

    def __init__(self, env: Mapping[str, str] | None = None, timeout_s: float = 60.0) -> None:
        self._env = dict(env) if env is not None else None
        self._timeout_s = timeout_s

    def _run(self, args: Sequence[str], cwd: Path | None = None,
             env: Mapping[str, str] | None = None, query: bool = False) -> str:
        """Run one client command; a `query` is asked again after a transient failure."""
        return self._complete(args, cwd, env, query).stdout

    def _complete(self, args: Sequence[str], cwd: Path | None = None, env: Mapping[str, str] | None = None,
                  query: bool = False, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """The finished command (exit 0), or SlurmError naming it with its stderr."""
        for attempt in range(1, QUERY_ATTEMPTS + 1):
            try:
                done = subprocess.run(list(args), capture_output=True, text=True, timeout=self._timeout_s, input=stdin,
                                      cwd=cwd, env=dict(env) if env is not None else self._env, check=False)
            except FileNotFoundError:
                raise SlurmError(f"{args[0]} not found on PATH: run this on a Slurm login node "
                                 "(or start the local one with tools/dev-slurm up)") from None
            except subprocess.TimeoutExpired:
                raise SlurmError(f"{' '.join(args)} did not answer within {self._timeout_s:.0f} s") from None
            if done.returncode == 0:
                return done
            if not (query and attempt < QUERY_ATTEMPTS and transient_failure(done.returncode, done.stderr)):
                break
            time.sleep(QUERY_RETRY_S * attempt)
        raise SlurmError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")

    def sbatch(self, script: Path, cwd: Path, env: Mapping[str, str]) -> str:
        out = self._run(["sbatch", "--parsable", str(script)], cwd=cwd, env=env)
        # --parsable prints "ID" or "ID;cluster".
        return out.strip().split(";")[0]

    def test_only(self, script_text: str, cwd: Path, env: Mapping[str, str]) -> str:
        # The script goes on stdin: a dry run writes no file. sbatch prints its answer on stderr:
        # "sbatch: Job 12 to start at 2026-12-02T10:00:00 using 2 processors on n[1-2]" for a
        # hetjob (Slurm asks for each component in turn and answers for all of them together),
        # "... on nodes n1 in partition debug" for a plain job.
        done = self._complete(["sbatch", "--test-only"], cwd=cwd, env=env, stdin=script_text)
        return (done.stderr + done.stdout).strip()

    def job_components(self, job_id: str) -> list[JobComponent]:
        try:
            out = self._run(["squeue", "--json", "--jobs", job_id], query=True)
        except SlurmError as error:
            if "Invalid job id" in str(error):
                return []
            raise
        return _squeue_components(json.loads(out).get("jobs", []), job_id)

    def accounting(self, job_id: str) -> list[JobComponent] | None:
        try:
            out = self._run(["sacct", "--json", "--jobs", job_id], query=True)
        except SlurmError:
            return None  # no slurmdbd: sacct fails, and that only means "not available"
        return _sacct_components(json.loads(out).get("jobs", []), job_id)

    def nodes(self) -> list[dict[str, Any]]:
        return list(json.loads(self._run(["sinfo", "--json"], query=True)).get("nodes", []))

    def requeue(self, job_id: str) -> None:
        self._run(["scontrol", "requeue", job_id])

    def cancel(self, job_id: str, signal: str | None = None, batch_only: bool = False) -> None:
        args = ["scancel"]
        if signal is not None:
            args.append(f"--signal={signal}")
        if batch_only:
            args.append("--batch")
        self._run([*args, job_id])


@dataclass
class FakeSlurmClient:
    """In memory: records submissions and hands out ids; tests set states and nodes directly."""

    node_records: list[dict[str, Any]] = field(default_factory=list)
    next_id: int = 1000
    submitted: list[tuple[str, str, Path]] = field(default_factory=list)  # (id, script text, cwd)
    jobs: dict[str, list[JobComponent]] = field(default_factory=dict)
    accounted: dict[str, list[JobComponent]] | None = None  # None: no accounting
    actions: list[tuple[str, ...]] = field(default_factory=list)

    def sbatch(self, script: Path, cwd: Path, env: Mapping[str, str]) -> str:
        job_id = str(self.next_id)
        self.next_id += 1
        self.submitted.append((job_id, script.read_text(), cwd))
        groups = script.read_text().count("#SBATCH hetjob") + 1
        self.jobs[job_id] = [JobComponent(str(int(job_id) + k), k, "PENDING", "") for k in range(groups)]
        return job_id

    def test_only(self, script_text: str, cwd: Path, env: Mapping[str, str]) -> str:
        self.actions.append(("test_only", str(cwd)))
        groups = script_text.count("#SBATCH hetjob") + 1
        return f"sbatch: Job {self.next_id} to start now using {groups} component(s) (fake Slurm, nothing submitted)"

    def job_components(self, job_id: str) -> list[JobComponent]:
        return list(self.jobs.get(job_id, []))

    def accounting(self, job_id: str) -> list[JobComponent] | None:
        return None if self.accounted is None else list(self.accounted.get(job_id, []))

    def nodes(self) -> list[dict[str, Any]]:
        return list(self.node_records)

    def requeue(self, job_id: str) -> None:
        self.actions.append(("requeue", job_id))

    def cancel(self, job_id: str, signal: str | None = None, batch_only: bool = False) -> None:
        self.actions.append(("cancel", job_id, signal or "", "batch" if batch_only else ""))
        if signal is None and job_id in self.jobs:
            self.jobs[job_id] = [JobComponent(c.job_id, c.offset, "CANCELLED", c.nodes)
                                 for c in self.jobs[job_id]]
