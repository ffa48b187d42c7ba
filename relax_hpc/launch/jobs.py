"""Submit a spec as a Slurm job and read a job's state back: the logic behind the CLI.

Job directory of a submitted job (``[job] output_dir``, default runs/<name>, made absolute):

    spec.original.toml   the spec file as the user wrote it (several files: each, then the --set list)
    spec.submit.toml     the resolved spec the job runs (absolute paths)
    job.sbatch           the rendered batch script that was submitted
    container.env        the [container] env assignments (only with an image and env)
    slurm_job_id         the job id (one line; a resubmission replaces it)
    .secret              the job secret (0600): every listener of the job requires it
    .ray_token           Ray's token, derived from it (0600; RAY_AUTH_TOKEN_PATH)
    cluster.json         head address, REST URL, the secret file's path (0600), once Ray is up
    logs/restart-<n>/    batch.log, driver.log, ray-*.log of attempt n (SLURM_RESTART_COUNT)
    ... plus what `relax-hpc run` writes: checkpoints/, metrics.jsonl, summary.json, ...

Submit creates the directory and logs/ 0700 (an existing directory keeps its mode) and every
file above 0600: the spec copies and container.env may hold secrets. Each submission writes
a fresh job secret; a requeued attempt keeps it. It refuses a directory
that a `relax-hpc run` holds (relax_hpc/driver/jobdir.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from relax_hpc.auth import JobSecret, write_job_secret
from relax_hpc.ckpt.fs import atomic_write_text
from relax_hpc.driver.jobdir import JobDirBusyError, JobDirLock, make_private_dir
from relax_hpc.driver.spec_checks import check_spec_runs
from relax_hpc.launch.container import ENV_FILE, env_file_text
from relax_hpc.launch.preflight import preflight_problems
from relax_hpc.launch.render import components, render_sbatch
from relax_hpc.launch.slurm_client import JobComponent, SlurmClient
from relax_hpc.spec import JobSpec, load_spec, spec_to_toml

__all__ = ["JobStatus", "Submission", "checked_script", "dry_run", "find_job", "is_finished_state", "job_status",
           "pin_paths", "submit_spec"]

JOB_ID_FILE = "slurm_job_id"
SUBMIT_SPEC = "spec.submit.toml"
SCRIPT = "job.sbatch"


class PreflightError(ValueError):
    """The spec asks for something the cluster cannot give; the message lists every problem."""


def _absolute(path: str, base: Path) -> str:
    chosen = Path(path).expanduser()
    return str(chosen if chosen.is_absolute() else base / chosen)


def pin_paths(spec: JobSpec, base: Path) -> JobSpec:
    """``spec`` with its job dir, model and data paths absolute (relative ones taken from ``base``).

    Ray workers on other nodes do not share the submitting shell's working directory.
    """
    job = dataclasses.replace(spec.job, output_dir=str(spec.job_dir(base)))
    model = dataclasses.replace(spec.model, path=_absolute(spec.model.path, base))
    data = dataclasses.replace(spec.data, path=_absolute(spec.data.path, base))
    return dataclasses.replace(spec, job=job, model=model, data=data)


@dataclass(frozen=True)
class Submission:
    job_id: str
    job_dir: Path
    script: Path


def submit_spec(spec: JobSpec, spec_path: Path, client: SlurmClient, base: Path | None = None,
                check_cluster: bool = True, original_text: str | None = None) -> Submission:
    """Preflight, write the job directory (owner-only), sbatch the rendered script; the submission.

    ``original_text`` is what spec.original.toml keeps (default: the file at ``spec_path``): for a
    spec composed of several files and --set overrides, each of them as written.
    """
    base = base or Path.cwd()
    pinned, text = checked_script(spec, spec_path, client, base, check_cluster)
    job_dir = pinned.job_dir()
    # JobDirBusyError (one line, exit 2) while a `relax-hpc run` holds the directory: rewriting
    # spec.submit.toml under it would change what its next attempt runs. Free, the lock is only
    # looked at: the job's own run takes it.
    with JobDirLock(job_dir):  # creates the directory 0700 when it is missing
        pass
    refuse_if_job_active(job_dir, client)
    make_private_dir(job_dir / "logs")
    if original_text is None:
        original_text = spec_path.read_text(encoding="utf-8")
    atomic_write_text(job_dir / "spec.original.toml", original_text)
    # The job reads its alert URLs back from this file (owner-only), so they are kept as written.
    atomic_write_text(job_dir / SUBMIT_SPEC, spec_to_toml(pinned, redact=False))
    if spec.container.image is not None and spec.container.env:
        atomic_write_text(job_dir / ENV_FILE, env_file_text(spec.container))
    else:
        (job_dir / ENV_FILE).unlink(missing_ok=True)  # an earlier submission's values, unused now
    write_job_secret(job_dir, JobSecret.generate())  # read by path in the job, never on a command line
    script = job_dir / SCRIPT
    atomic_write_text(script, text)
    job_id = client.sbatch(script, base, _submit_env(spec))
    atomic_write_text(job_dir / JOB_ID_FILE, job_id + "\n")
    return Submission(job_id, job_dir, script)


def checked_script(spec: JobSpec, spec_path: Path, client: SlurmClient, base: Path,
                   check_cluster: bool = True) -> tuple[JobSpec, str]:
    """Every check a submission makes before it writes anything, then what it would submit: the
    spec with its paths pinned, and the rendered script. Writes nothing."""
    if check_cluster:
        problems = preflight_problems(spec, client.nodes())
        if problems:
            raise PreflightError(f"{spec_path}: the cluster cannot run this job:\n  " + "\n  ".join(problems))
    check_spec_runs(spec, str(spec_path))  # the model, the media, [notify], the agent code: as validate
    pinned = pin_paths(spec, base)
    job_dir = pinned.job_dir()
    return pinned, render_sbatch(pinned, str(job_dir), str(job_dir / SUBMIT_SPEC))


def dry_run(spec: JobSpec, spec_path: Path, client: SlurmClient, base: Path | None = None,
            check_cluster: bool = True) -> str:
    """`relax-hpc submit --dry-run`: the submission's checks, then Slurm's answer to the rendered
    script under `sbatch --test-only` (when and where it would start). Writes nothing, submits nothing."""
    base = base or Path.cwd()
    pinned, text = checked_script(spec, spec_path, client, base, check_cluster)
    refuse_if_job_active(pinned.job_dir(), client)  # the submission would refuse: say so now
    return client.test_only(text, base, _submit_env(spec))


def _submit_env(spec: JobSpec) -> dict[str, str]:
    env = dict(os.environ)
    if spec.container.image is None:
        env["RELAX_HPC_PYTHON"] = sys.executable  # the Python that has relax_hpc installed
    return env


# Slurm states after which a job never runs again (squeue keeps showing them for MinJobAge).
_FINISHED_STATES = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                              "BOOT_FAIL", "DEADLINE", "PREEMPTED", "REVOKED", "SPECIAL_EXIT"})


def is_finished_state(state: str) -> bool:
    """Whether a Slurm job state (squeue/sacct, e.g. "CANCELLED by 1000", "RUNNING+") is final."""
    words = state.split()
    return bool(words) and words[0].rstrip("+") in _FINISHED_STATES


def refuse_if_job_active(job_dir: Path, client: SlurmClient) -> None:
    """JobDirBusyError when the job this directory was last submitted as is still queued or
    running: a pending job holds no lock yet, and a new submission would change the spec and
    the secret its next start reads."""
    id_file = job_dir / JOB_ID_FILE
    if not id_file.is_file():
        return
    job_id = id_file.read_text(encoding="utf-8").strip()
    if not job_id:
        return
    active = sorted({c.state for c in client.job_components(job_id) if not is_finished_state(c.state)})
    if active:
        raise JobDirBusyError(
            f"job directory {job_dir} belongs to Slurm job {job_id}, still {'/'.join(active)}; a new submission "
            f"would change the spec and the secret it starts with: wait for it, cancel it (`relax-hpc cancel "
            f"{job_id}`), or set [job] output_dir to another directory"
        )


def find_job(job: str, client: SlurmClient | None = None,
             search_roots: list[Path] | None = None) -> tuple[str, Path | None]:
    """(job id, job dir or None) for a job id or a job directory given on the command line.

    For a job id the directory is looked up under ./runs, then from the job's --output path
    (JOBDIR/logs/slurm-%j.out) while Slurm still knows the job.
    """
    path = Path(job)
    if path.is_dir():
        id_file = path / JOB_ID_FILE
        if not id_file.is_file():
            raise FileNotFoundError(f"{path} has no {JOB_ID_FILE}: not a job directory made by relax-hpc submit")
        return id_file.read_text().strip(), path.resolve()
    if not job.isdigit():
        raise ValueError(f"JOB = {job!r}: expected a Slurm job id (digits) or a job directory")
    for root in search_roots or [Path.cwd() / "runs"]:
        for id_file in sorted(root.glob(f"*/{JOB_ID_FILE}")):
            if id_file.read_text().strip() == job:
                return job, id_file.parent.resolve()
    for component in client.job_components(job) if client is not None else []:
        out = Path(component.stdout)
        if out.name == "slurm-%j.out":  # the pattern as submitted (older Slurm reports it unexpanded)
            out = Path(str(out.parent).replace("%%", "%")) / out.name
        if out.parent.name == "logs" and (out.parent.parent / JOB_ID_FILE).is_file():
            return job, out.parent.parent
    return job, None


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    job_dir: Path | None
    components: list[tuple[str, JobComponent]]  # (component name, Slurm view)
    source: str  # "squeue", "sacct" or "none"
    step: int | None
    reward: float | None
    restarts: int
    summary: dict[str, object] | None

    def lines(self) -> list[str]:
        out = [f"job {self.job_id}" + (f"  ({self.job_dir})" if self.job_dir else "")]
        if not self.components:
            out.append("  Slurm: no longer in the queue and no accounting (sacct) to ask; "
                       "see the job directory")
        for name, c in self.components:
            reason = f" ({c.reason})" if c.reason and c.reason != "None" else ""
            out.append(f"  {name:<8} {c.job_id:<10} {c.state:<11} {c.nodes or '-'}{reason}  [{self.source}]")
        if self.step is not None:
            reward = f", reward {self.reward:.3f}" if self.reward is not None else ""
            out.append(f"  step {self.step}{reward}, restarts {self.restarts}")
        if self.summary is not None:
            out.append(f"  summary: {self.summary.get('summary')}")
        return out


def _last_metrics(job_dir: Path) -> tuple[int | None, float | None]:
    path = job_dir / "metrics.jsonl"
    if not path.is_file():
        return None, None
    last = None
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            last = line
    if last is None:
        return None, None
    record = json.loads(last)
    reward = record.get("reward/mean")
    return int(record.get("step", 0)), float(reward) if reward is not None else None


def job_status(job_id: str, job_dir: Path | None, client: SlurmClient) -> JobStatus:
    """Slurm state of every component plus progress read from the job directory.

    Components are named from the job directory's spec.submit.toml (with ``[cluster] colocate``
    group 1 is forward, not rollout); without it they are "group N".
    """
    found, source = client.job_components(job_id), "squeue"
    if not found:
        accounted = client.accounting(job_id)
        found, source = (accounted or []), ("sacct" if accounted else "none")
    labels = component_names(job_dir)
    named = [(labels[c.offset] if c.offset < len(labels) else f"group {c.offset}", c) for c in found]
    step = reward = summary = None
    restarts = 0
    if job_dir is not None:
        step, reward = _last_metrics(job_dir)
        restarts = max(0, len(list((job_dir / "logs").glob("restart-*"))) - 1)
        if (job_dir / "summary.json").is_file():
            summary = json.loads((job_dir / "summary.json").read_text())
    return JobStatus(job_id, job_dir, named, source, step, reward, restarts, summary)


def component_names(job_dir: Path | None) -> list[str]:
    """The hetjob groups' names from JOBDIR/spec.submit.toml, in group order; [] without one."""
    if job_dir is None or not (job_dir / SUBMIT_SPEC).is_file():
        return []
    return [c.name for c in components(load_spec(job_dir / SUBMIT_SPEC))]
