"""Grow a running job with rollout engines from separate Slurm jobs, and talk to its REST API.

    request = grow_request(job_dir, "4242", spec, engines=4, nodes=2, partition="preempt", preemptible=True)
    print(render_grow_sbatch(request))                  # pure: the grow job's batch script
    grow_id = submit_grow(request, client, Path.cwd())  # sbatch it; JOBDIR/federation/grow_jobs.json records it
    api = ElasticApi.for_job(job_dir)                    # the main job's REST API (JOBDIR/cluster.json)
    op = api.start("scale_in", {"job": grow_id}); api.wait(op["id"], limit_s=120)

A grow job is a plain (not heterogeneous) Slurm job rendered from templates/grow.sbatch.in,
as the main job is from hetjob.sbatch.in: one ``python -m relax_hpc.launch.grow_node`` per node
starts that node's engines (`relax-hpc serve-engine`) and registers them with the main job
(grow_node.py). Its resources default to the main job's rollout component (the trainer's with
``[cluster] colocate``); a ``--partition`` or ``--qos`` given replaces both of the component's.
It never requeues: a grow job Slurm takes back is gone, and `relax-hpc grow` makes another.

The REST API's routes and bodies are in relax_hpc/engines/elastic/api.py; docs/federation.md
is the user's guide.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from relax_hpc.auth import SECRET_FILE, JobSecret
from relax_hpc.ckpt.fs import atomic_write_text
from relax_hpc.driver.jobdir import make_private_dir
from relax_hpc.engines.disk_weights import FEDERATION_WEIGHTS
from relax_hpc.engines.elastic.api import CLUSTER_JSON, REST_TOKEN_PURPOSE
from relax_hpc.launch.container import render_wrapper

# The renderer's quoting and filling, shared so both scripts follow the same rules (render.py).
from relax_hpc.launch.render import _count, _fill, _option, _plain, output_pattern
from relax_hpc.launch.slurm_client import SlurmClient
from relax_hpc.ops.files import check_private_dir, exclusive_lock, read_private_text
from relax_hpc.spec import ContainerSpec, JobSpec
from relax_hpc.spec.constraints import slurm_time
from relax_hpc.spec.text_checks import slurm_name, slurm_names

__all__ = [
    "DRAIN_TIMEOUT_S",
    "ElasticApi",
    "FederationError",
    "GrowRequest",
    "JobUnavailable",
    "OperationBusy",
    "federation_dir",
    "federation_lines",
    "grow_request",
    "prepare_federation_dir",
    "read_cluster_json",
    "read_grow_jobs",
    "render_grow_sbatch",
    "rest_endpoint",
    "submit_grow",
]

GROW_TEMPLATE = "grow.sbatch.in"
FEDERATION_DIR = "federation"  # JOBDIR/federation: grow_jobs.json, grow scripts, the weights (roles/rollout.py)
GROW_JOBS_FILE = "grow_jobs.json"
GROW_LOCK_FILE = ".lock"  # JOBDIR/federation/.lock: one grow submission at a time (CLI and driver)
DRAIN_TIMEOUT_S = 30  # how long engines that leave may finish their prompts (USR1 / TERM)
SIGNAL_MARGIN_S = 30  # the time-limit USR1 comes this much before the drain must end
OPERATION_DONE = ("done", "failed", "rolled_back")
NOT_STARTED = ("the job has not started its REST API yet (pending or starting?), or has ended: wait until "
               "`relax-hpc status {job}` shows it running with a step, then retry")


class FederationError(ValueError):
    """A grow / shrink / REST problem the user fixes; the message says what to do."""


class OperationBusy(FederationError):
    """409: another elastic operation of the job is in progress."""


class JobUnavailable(FederationError):
    """503: the job's REST server answers but its rollout role does not (the job is being requeued
    or is stopping). A state that passes: ask again once the job runs."""


def federation_dir(job_dir: Path) -> Path:
    return Path(job_dir) / FEDERATION_DIR


# --- the grow job --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GrowRequest:
    """Everything the grow job's script depends on (render_grow_sbatch is a function of it alone)."""

    job_dir: str
    main_job_id: str
    job_name: str  # the main job's; the grow job is "<name>-grow"
    model_dir: str  # absolute: the main job's [model] path as submitted (spec.submit.toml)
    dtype: str
    engines: int  # in the whole grow job, spread over its nodes
    nodes: int
    cpus_per_node: int
    gpus_per_node: int
    time: str
    # Where it runs: the main job's rollout component's settings unless the user named others.
    memory: str | None
    partition: str | None
    qos: str | None
    account: str | None
    constraint: str | None
    preemptible: bool
    container: ContainerSpec
    drain_timeout_s: int = DRAIN_TIMEOUT_S


def grow_request(job_dir: Path, main_job_id: str, spec: JobSpec, *, engines: int, nodes: int = 1,
                 partition: str | None = None, qos: str | None = None, time_limit: str | None = None,
                 account: str | None = None, cpus_per_node: int | None = None,
                 gpus_per_node: int | None = None, preemptible: bool = False) -> GrowRequest:
    """The grow request for the main job ``spec`` (its spec.submit.toml), checked: every problem
    with a flag is reported at once, naming the flag."""
    source = spec.cluster.trainer if spec.cluster.colocate else spec.cluster.rollout
    problems = []
    if not main_job_id.isdigit():
        problems.append(f"JOB = {main_job_id!r}: the main job's Slurm id must be digits")
    if type(engines) is not int or engines < 1:
        problems.append(f"--engines {engines}: pass a whole number >= 1")
    if type(nodes) is not int or nodes < 1:
        problems.append(f"--nodes {nodes}: pass a whole number >= 1")
    elif type(engines) is int and 1 <= engines < nodes:
        problems.append(f"--engines {engines} over --nodes {nodes}: every node runs at least one engine; "
                        f"pass --nodes {max(engines, 1)} or fewer")
    for flag, value, check in (("--partition", partition, slurm_names), ("--qos", qos, slurm_name),
                               ("--account", account, slurm_name), ("--time", time_limit, slurm_time)):
        message = check(value) if value is not None else None
        if message:
            problems.append(f"{flag} {value!r}: {message}")
    for flag, count in (("--cpus-per-node", cpus_per_node), ("--gpus-per-node", gpus_per_node)):
        if count is not None and (type(count) is not int or count < (1 if flag == "--cpus-per-node" else 0)):
            problems.append(f"{flag} {count}: pass a whole number >= {1 if flag == '--cpus-per-node' else 0}")
    if preemptible and partition is None and qos is None:
        problems.append("--preemptible: name the partition (--partition) or QOS (--qos) whose jobs Slurm "
                        "pre-empts; Slurm decides pre-emption by those, not by a flag of the job")
    if problems:
        raise FederationError("cannot grow the job:\n  " + "\n  ".join(problems))
    inherit_place = partition is None and qos is None  # a new partition: the component's QOS may not apply there
    return GrowRequest(
        job_dir=str(job_dir), main_job_id=main_job_id, job_name=spec.job.name, model_dir=spec.model.path,
        dtype=spec.model.dtype, engines=engines, nodes=nodes,
        cpus_per_node=cpus_per_node if cpus_per_node is not None else source.cpus_per_node,
        gpus_per_node=gpus_per_node if gpus_per_node is not None else source.gpus_per_node,
        time=time_limit or source.time, memory=source.memory,
        partition=source.partition if inherit_place else partition,
        qos=source.qos if inherit_place else qos, account=account or source.account,
        constraint=source.constraint if inherit_place else None, preemptible=preemptible,
        container=spec.container,
    )


def _read_grow_template() -> tuple[str, str]:
    """(text, where it came from): $RELAX_HPC_SBATCH_DIR/grow.sbatch.in, else the package's."""
    override = os.environ.get("RELAX_HPC_SBATCH_DIR")
    if override and (Path(override) / GROW_TEMPLATE).is_file():
        path = Path(override) / GROW_TEMPLATE
        return path.read_text(encoding="utf-8"), str(path)
    packaged = resources.files("relax_hpc.launch") / "templates" / GROW_TEMPLATE
    return packaged.read_text(encoding="utf-8"), str(packaged)


def grow_output_pattern(job_dir: str) -> str:
    """JOBDIR/logs/grow-%j.out, JOBDIR taken literally (output_pattern's rules)."""
    return output_pattern(job_dir).removesuffix("slurm-%j.out") + "grow-%j.out"


def grow_sbatch_headers(request: GrowRequest) -> list[str]:
    r = request
    lead = int(_count(r.drain_timeout_s, "the drain timeout")) + SIGNAL_MARGIN_S
    place = "pre-emptible: Slurm may take its nodes back at any time" if r.preemptible else "not pre-emptible"
    lines = [
        _option("job-name", f"{r.job_name}-grow"),
        _option("output", grow_output_pattern(r.job_dir)),
        _option("open-mode", "append"),
        _option("signal", f"B:USR1@{lead}"),
        # A grow job Slurm takes back is not requeued: `relax-hpc grow` submits another.
        "#SBATCH --no-requeue",
        f"# {_count(r.engines, '--engines')} engine(s) on {_count(r.nodes, '--nodes')} node(s), {place}",
        _option("nodes", r.nodes), _option("ntasks-per-node", 1),
        _option("cpus-per-task", _count(r.cpus_per_node, "--cpus-per-node")), _option("time", r.time),
    ]
    if _count(r.gpus_per_node, "--gpus-per-node") != "0":
        lines.append(_option("gpus-per-node", r.gpus_per_node))
    optional = [("mem", r.memory), ("partition", r.partition), ("account", r.account), ("qos", r.qos),
                ("constraint", r.constraint)]
    return lines + [_option(name, value) for name, value in optional if value is not None]


def render_grow_sbatch(request: GrowRequest) -> str:
    """The grow job's batch script (pure; the golden files in tests/launch/golden/ pin it)."""
    r = request
    python = "python3" if r.container.image is not None else '"${RELAX_HPC_PYTHON:-python3}"'
    node_args = [f"--engines {_count(r.engines, '--engines')}", f"--nodes {_count(r.nodes, '--nodes')}",
                 f"--model-dir {shlex.quote(_plain(r.model_dir, 'model.path'))}",
                 f"--dtype {shlex.quote(_plain(r.dtype, 'model.dtype'))}",
                 f"--gpus-per-node {_count(r.gpus_per_node, '--gpus-per-node')}",
                 f"--drain-timeout-s {_count(r.drain_timeout_s, 'the drain timeout')}"]
    values = {
        "job_name": _plain(r.job_name, "job.name"),  # in comment lines
        "main_job_id": _count(int(r.main_job_id), "the main job id"),
        "sbatch_headers": "\n".join(grow_sbatch_headers(r)),
        "job_dir": shlex.quote(_plain(r.job_dir, "the job directory")),
        "python": python,
        "wrapper": render_wrapper("grow", r.container, r.gpus_per_node),
        "nodes": _count(r.nodes, "--nodes"),
        "srun_gpus": f" --gpus-per-node={r.gpus_per_node}" if r.gpus_per_node > 0 else "",
        "grow_node_args": " ".join(node_args),
    }
    template, source = _read_grow_template()
    return _fill(template, values, source)


# --- submitting and recording grow jobs ----------------------------------------------------------


def read_grow_jobs(job_dir: Path) -> list[dict[str, Any]]:
    """The grow jobs submitted for this job (JOBDIR/federation/grow_jobs.json), oldest first."""
    path = federation_dir(job_dir) / GROW_JOBS_FILE
    if not path.is_file():
        return []
    try:
        jobs = json.loads(path.read_text(encoding="utf-8")).get("grow_jobs", [])
    except (ValueError, AttributeError) as e:
        raise FederationError(f"{path} is not a grow-job record ({e}); move it away and the next "
                              "`relax-hpc grow` starts a new one") from None
    return [j for j in jobs if isinstance(j, dict)]


def _record_grow_job(job_dir: Path, entry: dict[str, Any]) -> None:
    """Add ``entry`` to grow_jobs.json; the caller holds the federation lock (read, add, write)."""
    jobs = read_grow_jobs(job_dir) + [entry]
    # Write-then-rename, 0600: a crash leaves the old record or the new one, never half of one.
    atomic_write_text(federation_dir(job_dir) / GROW_JOBS_FILE, json.dumps({"grow_jobs": jobs}, indent=2) + "\n")


def prepare_federation_dir(job_dir: Path) -> Path:
    """JOBDIR/federation and its weights/ (0700 when created); engines refuse a missing weights root.
    UnsafePathError when either exists writable by group/others or owned by another user."""
    weights = Path(job_dir) / FEDERATION_WEIGHTS
    fed = make_private_dir(weights.parent, "federation directory")  # mkdir's mode reaches only the last one
    make_private_dir(weights, "federation weights directory")
    return fed


def submit_grow(request: GrowRequest, client: SlurmClient, cwd: Path, now: float | None = None) -> str:
    """sbatch the grow job (from ``cwd``, like the main job from its submit directory), keep its
    script as JOBDIR/federation/grow-<id>.sbatch and record it in grow_jobs.json; its id.

    `relax-hpc grow` and the driver's grow policy may submit at the same time: each holds
    JOBDIR/federation/.lock from sbatch to the record, so neither submits the other's script
    nor loses the other's record, and the script sbatch reads has a name of its own."""
    job_dir = Path(request.job_dir)
    text = render_grow_sbatch(request)  # refuses before anything is written
    fed = prepare_federation_dir(job_dir)
    env = dict(os.environ)
    if request.container.image is None:
        env["RELAX_HPC_PYTHON"] = sys.executable  # the Python that has relax_hpc installed
    with exclusive_lock(fed / GROW_LOCK_FILE, "the federation directory's lock file"):
        fd, pending_name = tempfile.mkstemp(dir=fed, prefix="grow-next.", suffix=".sbatch")  # 0600, O_EXCL
        pending = Path(pending_name)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            grow_id = client.sbatch(pending, cwd, env)
        finally:
            pending.unlink(missing_ok=True)  # sbatch keeps its own copy
        script = fed / f"grow-{grow_id}.sbatch"
        atomic_write_text(script, text)
        entry = {"job_id": grow_id, "main_job_id": request.main_job_id, "engines": request.engines,
                 "nodes": request.nodes, "partition": request.partition, "qos": request.qos, "time": request.time,
                 "preemptible": request.preemptible, "submitted_at": time.time() if now is None else now,
                 "script": str(script)}
        _record_grow_job(job_dir, entry)
    return grow_id


class SlurmGrowSubmitter:
    """How the driver of a submitted job grows it by itself (`[federation]`, driver/grow_policy.py):
    `relax-hpc grow JOB --engines N` with the table's partition, QOS and time, and scancel."""

    def __init__(self, job_dir: Path, main_job_id: str, spec: JobSpec, client: SlurmClient) -> None:
        self.job_dir, self.main_job_id, self.spec, self.client = job_dir, main_job_id, spec, client

    def submit(self, engines: int) -> str:
        fed = self.spec.federation
        request = grow_request(self.job_dir, self.main_job_id, self.spec, engines=engines, partition=fed.partition,
                               qos=fed.qos, time_limit=fed.time, preemptible=bool(fed.partition or fed.qos))
        return submit_grow(request, self.client, Path.cwd())

    def cancel(self, grow_job: str) -> None:
        self.client.cancel(grow_job)


# --- the main job's REST API ---------------------------------------------------------------------


class RestLike(Protocol):
    """What relax_hpc.engines.elastic.rest_api.RestClient offers (tests pass an in-memory one)."""

    def get(self, path: str) -> tuple[int, dict[str, Any]]: ...

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]: ...


def read_cluster_json(job_dir: Path) -> dict[str, Any] | None:
    """JOBDIR/cluster.json (written by `incluster wait`, rest_url filled by the driver); None when absent.

    It names the URL the job's REST token is sent to, so it is trusted only in a job directory
    nobody else may write and only as a regular file of ours that only we may write: anything
    else raises UnsafePathError (a ValueError) naming the path and the fix."""
    try:
        check_private_dir(Path(job_dir), "job directory")
    except FileNotFoundError:
        return None
    path = Path(job_dir) / CLUSTER_JSON
    text = read_private_text(path, "cluster.json")
    if text is None:
        return None
    try:
        content = json.loads(text)
    except ValueError:
        return None  # not JSON: written by rename, so never torn by our writers; no URL to use
    return content if isinstance(content, dict) else None


def rest_endpoint(job_dir: Path, job: str = "JOB") -> tuple[str, str]:
    """(REST URL, bearer token) of the job in ``job_dir``; FederationError when it has none yet."""
    cluster = read_cluster_json(job_dir)
    url = cluster.get("rest_url") if cluster else None
    if not url:
        raise FederationError(NOT_STARTED.format(job=job) + f" ({Path(job_dir) / CLUSTER_JSON} has no rest_url)")
    secret_file = cluster.get("secret_file") or str(Path(job_dir) / SECRET_FILE)  # type: ignore[union-attr]
    return str(url), JobSecret.load(secret_file).token(REST_TOKEN_PURPOSE)


def _error_text(status: int, body: dict[str, Any]) -> str:
    error = body.get("error")
    text = error.get("message") if isinstance(error, dict) else error
    return f"{status}: {text or json.dumps(body)[:300]}"


class ElasticApi:
    """The elastic routes of one job's REST API, with the errors a user can act on.

    ``rest`` raises ConnectionError (RestUnavailable) when the server does not answer; every
    HTTP error becomes a FederationError (503, a job between two attempts: JobUnavailable),
    except 409 when ``busy_wait_s`` allows a retry."""

    def __init__(self, rest: RestLike, url: str, job: str = "JOB") -> None:
        self.rest, self.url, self.job = rest, url, job

    @classmethod
    def for_job(cls, job_dir: Path, job: str = "JOB", timeout_s: float = 30.0) -> ElasticApi:
        from relax_hpc.engines.elastic.rest_api import (
            RestClient,  # httpx and FastAPI: only when talking to a job
        )

        url, token = rest_endpoint(job_dir, job)
        return cls(RestClient(url, token, timeout_s=timeout_s), url, job)

    def _checked(self, status: int, body: dict[str, Any], what: str) -> dict[str, Any]:
        if status == 401:
            raise FederationError(f"the REST API at {self.url} refused the job's token (401): JOBDIR/.secret is "
                                  "not the running job's secret (was the directory resubmitted?)")
        if status == 503:
            raise JobUnavailable(f"{what} was not answered by {self.url}: {_error_text(status, body)}")
        if status >= 400:
            raise FederationError(f"{what} was refused by {self.url}: {_error_text(status, body)}")
        return body

    def engines(self) -> list[dict[str, Any]]:
        """Every engine of the job: {"id","address","state","weight_version","samples","job","protected"}."""
        status, body = self.rest.get("/rollout/engines")
        return list(self._checked(status, body, "GET /rollout/engines").get("engines", []))

    def start(self, action: str, body: dict[str, Any], busy_wait_s: float = 0.0, poll_s: float = 2.0) -> dict[str, Any]:
        """POST /rollout/<action>; the operation it started. While another operation runs (409)
        retry every ``poll_s`` for up to ``busy_wait_s``, then say which one is in the way."""
        deadline = time.monotonic() + busy_wait_s
        while True:
            status, reply = self.rest.post(f"/rollout/{action}", body)
            if status != 409:
                return dict(self._checked(status, reply, f"POST /rollout/{action}").get("operation", {}))
            if time.monotonic() >= deadline:
                running = reply.get("operation") or {}
                raise OperationBusy(
                    f"another operation is in progress ({running.get('id', '?')} {running.get('kind', '')} "
                    f"{running.get('state', '')}); wait for it to finish (`relax-hpc status {self.job}` shows it) "
                    "and retry")
            time.sleep(poll_s)

    def operation(self, op_id: str) -> dict[str, Any]:
        status, body = self.rest.get(f"/rollout/operations/{op_id}")
        return dict(self._checked(status, body, f"GET /rollout/operations/{op_id}").get("operation", {}))

    def wait(self, op_id: str, limit_s: float, poll_s: float = 1.0) -> dict[str, Any]:
        """The operation once it is done, failed or rolled back; FederationError after ``limit_s``."""
        deadline = time.monotonic() + limit_s
        while True:
            op = self.operation(op_id)
            if op.get("state") in OPERATION_DONE:
                return op
            if time.monotonic() >= deadline:
                raise FederationError(f"operation {op_id} is still {op.get('state')} after {limit_s:.0f} s; follow "
                                      f"it with `relax-hpc status {self.job}`")
            time.sleep(poll_s)


# --- status --------------------------------------------------------------------------------------


def _slurm_state(job_id: str, client: SlurmClient) -> tuple[str, str]:
    """(state, nodes) of a plain job: squeue, then sacct, else "ended" (no longer known)."""
    found = client.job_components(job_id) or client.accounting(job_id) or []
    if not found:
        return "ended", ""
    return found[0].state, found[0].nodes


def _grow_job_line(entry: dict[str, Any], client: SlurmClient) -> str:
    state, nodes = _slurm_state(str(entry.get("job_id")), client)
    where = ", ".join(f"{k} {entry[k]}" for k in ("partition", "qos") if entry.get(k))
    flags = ", preemptible" if entry.get("preemptible") else ""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(entry.get("submitted_at", 0))))
    return (f"    {entry.get('job_id')!s:<10} {state:<11} {nodes or '-':<12} {entry.get('engines')} engine(s) on "
            f"{entry.get('nodes')} node(s){', ' + where if where else ''}{flags}, submitted {when}")


def _engine_line(engine: dict[str, Any]) -> str:
    version = engine.get("weight_version")
    return (f"    {engine.get('id')!s:<12} {engine.get('job') or 'main'!s:<10} {engine.get('state')!s:<9} "
            f"v{'-' if version is None else version!s:<6} {engine.get('samples', 0)!s:>7} samples  "
            f"{engine.get('address')}")


def federation_lines(job_id: str, job_dir: Path, client: SlurmClient,
                     api_for: Callable[[], ElasticApi] | None = None) -> list[str]:
    """`relax-hpc status` lines about grow jobs and engines; one line when the API does not answer."""
    out = []
    grow = read_grow_jobs(job_dir)
    if grow:
        out.append(f"  grow jobs ({federation_dir(job_dir) / GROW_JOBS_FILE}):")
        out += [_grow_job_line(entry, client) for entry in grow]
    api = None
    try:
        api = api_for() if api_for is not None else ElasticApi.for_job(job_dir, job_id, timeout_s=10.0)
        engines = api.engines()
    except ValueError as e:  # FederationError (no rest_url yet, an HTTP error), JobSecretError
        return [*out, f"  REST API: {str(e).splitlines()[0]}"]
    except ConnectionError:  # RestUnavailable
        url = api.url if api is not None else "?"
        return [*out, f"  REST API: {url} does not answer (the job is not running, or its driver is restarting)"]
    serving = sum(1 for e in engines if e.get("state") == "active")
    out.append(f"  engines ({api.url}): {len(engines)}, {serving} active")
    return out + [_engine_line(e) for e in engines]
