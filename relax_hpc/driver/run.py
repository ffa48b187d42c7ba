"""`relax-hpc run`: set up the job directory, start Ray and the roles, run the loop, report.

Job directory layout (`[job] output_dir`, default runs/<name>):
    .lock                held (flock) by the run using the directory; names its pid and host
    spec.toml            the fully resolved spec this run used
    checkpoints/         DCP checkpoints (step_N, latest)
    metrics.jsonl        one record per step (appended across restarts)
    tensorboard/         TensorBoard event files
    wandb/, clearml/     the W&B run and ClearML sessions, offline ([metrics] wandb_project, clearml_project)
    mlflow/              the MLflow run's id and, by default, its file store ([metrics] mlflow_experiment)
    trajectories/        trained samples, rank<r>/step_N.h5 ([metrics] trajectory_archive)
    reward_curve.png     the reward per step; plots.png: reward, losses, KL, entropy, lengths, step time,
                         samples/s; redrawn every [metrics] plot_every_steps and at the end
    summary.json         the final numbers, written at the end
    cluster.json         the REST API's URL while the run lives (and, on Slurm, the Ray head)
    federation/          grow jobs and the weight versions written for their engines (docs/federation.md)
    health/              every role's heartbeat, <role>.json (relax_hpc/ops/health.py)

The directory is created 0700 (an existing one keeps its mode), the files written here 0600
and the subdirectories 0700; a second run on a directory in use stops at once
(relax_hpc/driver/jobdir.py, docs/security.md).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc.agents.config import samples_per_session
from relax_hpc.auth import SECRET_ENV
from relax_hpc.backends.base import require_backend
from relax_hpc.ckpt.fs import atomic_write_text
from relax_hpc.ckpt.permissions import PRIVATE_FILE_MODE
from relax_hpc.driver.alerts import (
    JobAlerts,
    make_job_alerts,
    newest_checkpoint,
)
from relax_hpc.driver.credentials import job_secret_env
from relax_hpc.driver.grow_policy import GrowDriver, GrowSubmitter
from relax_hpc.driver.jobdir import JobDirLock, create_private_file, make_private_dir
from relax_hpc.driver.loop import LoopResult, StopFlag
from relax_hpc.driver.rest import publish_rest_url, serve_rest_api
from relax_hpc.driver.restarts import RebuildableRoles, run_with_restarts
from relax_hpc.driver.spec_checks import check_spec_runs
from relax_hpc.engines.disk_weights import FEDERATION_WEIGHTS
from relax_hpc.engines.factory import check_engine_available
from relax_hpc.ops.archive import archive_dir
from relax_hpc.ops.health import (
    HealthEvent,
    HeartbeatWriter,
    heartbeat_path,
)
from relax_hpc.ops.heap import settle_heap
from relax_hpc.ops.metrics import FanOut, JsonlSink, MetricsSink, TensorBoardSink
from relax_hpc.ops.plot import PlotWriter, RunPlots, plot_run
from relax_hpc.ops.progress import make_progress
from relax_hpc.ops.ray_node_env import apply_ray_node_env
from relax_hpc.ops.run_status import RunStatus
from relax_hpc.ops.trackers import ClearMLSink, MlflowSink, WandbSink, require_trackers
from relax_hpc.roles.actor import ActorConfig
from relax_hpc.roles.advantages import AdvantagesConfig
from relax_hpc.roles.critic import CRITIC_CHECKPOINTS, critic_config
from relax_hpc.roles.critic_roles import with_critic
from relax_hpc.roles.forward import OUTPUT_FIELD, ForwardConfig
from relax_hpc.roles.handles import LocalRoles, RayRoles, Roles
from relax_hpc.roles.healing import RoleHealer
from relax_hpc.roles.rollout import RolloutConfig
from relax_hpc.spec import JobSpec, spec_to_dict, spec_to_toml
from relax_hpc.spec.schema import SGLangSpec
from relax_hpc.transfer.queue import queue_capacity


@dataclass
class RunReport:
    job_dir: Path
    result: LoopResult
    seconds: float
    curve: Path | None

    def summary_line(self) -> str:
        r = self.result.rewards
        head = ""
        if r:
            first, last = r[: min(5, len(r))], r[-min(10, len(r)):]
            head = (f"; reward first-{len(first)} mean {sum(first) / len(first):.3f} -> "
                    f"last-{len(last)} mean {sum(last) / len(last):.3f}")
        status = "stopped early at" if self.result.stopped_early else "finished"
        return (f"{status} step {self.result.end_step} (from {self.result.start_step}) in "
                f"{self.seconds:.0f} s, {self.result.samples_trained} samples trained{head}; "
                f"job dir {self.job_dir}")


def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("[train] device = \"cuda\" but torch sees no CUDA device; use \"auto\" or \"cpu\"")
    return requested


def check_backends_available(spec: JobSpec) -> None:
    """The spec may name the cluster backends; refuse clearly, before Ray starts, where this
    build cannot run them (the factories the roles call say the same)."""
    check_engine_available(spec.rollout.engine, sglang_spec_resolved(spec.rollout.sglang).python)
    require_backend(spec.train.backend)
    check_spec_runs(spec, "the job spec")  # the model, the media, [notify], the agent code: as validate
    require_trackers(spec.metrics)  # [metrics] wandb_project / clearml_project / mlflow_experiment, no package


def shares_devices(spec: JobSpec) -> bool:
    """Engines and trainer ranks on the same devices, taking turns ([cluster] colocate)."""
    return spec.job.mode == "colocate" and spec.cluster.colocate


def sglang_spec_resolved(s: SGLangSpec) -> SGLangSpec:
    """[rollout.sglang] with `python` absolute: a path with a "/" is relative to the working
    directory (as every path of the spec); a bare name is looked up on PATH here. Unset, and this
    interpreter cannot import sglang: $RELAX_SGLANG_ENV/bin/python when it exists (the image sets
    the variable, container/relax.def)."""
    if s.python is None:
        side = Path(os.environ.get("RELAX_SGLANG_ENV") or "/nonexistent") / "bin" / "python"
        if side.is_file() and importlib.util.find_spec("sglang") is None:
            return dataclasses.replace(s, python=str(side))
        return s
    found = str(Path(s.python).absolute()) if "/" in s.python else shutil.which(s.python)
    return dataclasses.replace(s, python=found or s.python)


def role_configs(spec: JobSpec, job_dir: Path, device: str) -> tuple[RolloutConfig, ActorConfig]:
    r, a, t = spec.rollout, spec.algorithm, spec.train
    # One thread per role: these models are small, and oversubscribed intra-op threads slow
    # everything down badly on a busy 2-core machine.
    threads = 1
    rollout = RolloutConfig(
        model=spec.model, data=spec.data, reward=spec.reward, rollout=r, algorithm=a, job=spec.job,
        device=device, num_threads=threads,
        # With GAE the critic writes the advantages onto the queue, as the Advantages role would.
        rows_without_advantages=spec.train.advantages_role or a.advantage == "gae",
        release_between_steps=shares_devices(spec), sglang_spec=sglang_spec_resolved(r.sglang),
        job_dir=str(job_dir),
    )
    actor = ActorConfig(
        model=spec.model, train=t, job=spec.job, checkpoint_dir=str(job_dir / "checkpoints"),
        algorithm=a, rollout=r, checkpoint=spec.checkpoint, device=device, num_threads=threads,
        archive_dir=str(archive_dir(job_dir)) if spec.metrics.trajectory_archive else None,
        role_fields=tuple(OUTPUT_FIELD[f.kind] for f in queue_role_configs(spec, device)
                          if isinstance(f, ForwardConfig)),
        offload_between_steps=shares_devices(spec),
    )
    return rollout, actor


def queue_role_configs(spec: JobSpec, device: str) -> list[ForwardConfig | AdvantagesConfig]:
    """The ActorFwd / Reference / Advantages roles the spec asks for (the reference is the initial
    model; advantages need no model)."""
    kinds = [k for k, on in (("actor_fwd", spec.train.actor_fwd_role),
                             ("reference", spec.train.reference_role)) if on]
    roles: list[ForwardConfig | AdvantagesConfig] = [
        ForwardConfig(kind=k, model=spec.model, train=spec.train, rollout=spec.rollout, device=device,
                      num_threads=1) for k in kinds]
    if spec.train.advantages_role:
        roles.append(AdvantagesConfig(spec.algorithm))
    return roles


def prepare_job_dir(spec: JobSpec) -> Path:
    """Write spec.toml and create, owner-only, what the sinks and the trainer write into.

    Called under the job directory's lock. Files and directories that exist keep their modes.
    """
    job_dir = make_private_dir(spec.job_dir())
    atomic_write_text(job_dir / "spec.toml", spec_to_toml(spec))
    make_private_dir(job_dir / "checkpoints")
    if spec.critic is not None:
        make_private_dir(job_dir / CRITIC_CHECKPOINTS)
    make_private_dir(job_dir / "health")
    # Weight versions for engines that join over HTTP (a grow job's serve-engine --weights-root).
    make_private_dir((job_dir / FEDERATION_WEIGHTS).parent)
    make_private_dir(job_dir / FEDERATION_WEIGHTS)
    if spec.metrics.jsonl:
        create_private_file(job_dir / "metrics.jsonl")
    if spec.metrics.tensorboard:
        make_private_dir(job_dir / "tensorboard")
    if spec.metrics.trajectory_archive:
        make_private_dir(archive_dir(job_dir))
    for tracker, key in (("wandb", spec.metrics.wandb_project), ("clearml", spec.metrics.clearml_project),
                         ("mlflow", spec.metrics.mlflow_experiment)):
        if key:
            make_private_dir(job_dir / tracker)
    return job_dir


def ensure_model(spec: JobSpec) -> None:
    ensure_data(spec)
    path = Path(spec.model.path)
    if (path / "config.json").is_file() or not spec.model.build_tiny_if_missing:
        return
    print(f"building the tiny {spec.model.tiny_arch} model at {path} (build_tiny_if_missing = true)",
          file=sys.stderr)
    if spec.model.tiny_arch == "qwen3":
        from relax_hpc.models.tiny import write_tiny_model

        write_tiny_model(path, seed=spec.job.seed)
    elif spec.model.tiny_arch == "qwen3_tools":
        from relax_hpc.models.tiny_tools import write_tool_model

        write_tool_model(path, seed=spec.job.seed)
    else:
        from relax_hpc.models.tiny_mm import shape_for_engine, write_tiny_multimodal

        write_tiny_multimodal(path, spec.model.tiny_arch, seed=spec.job.seed,
                              **shape_for_engine(spec.model.tiny_arch, spec.rollout.on_sglang))


TINY_OMNI_ROWS = 600  # 200 each of image, audio and video rows


def ensure_data(spec: JobSpec) -> None:
    """Write the `[data] build_if_missing` data set at `[data] path` when it is not there; refuse
    a missing one here, before Ray and the roles start (the rollout would, after ~20 s)."""
    path = Path(spec.data.path)
    if path.is_file():
        return
    if spec.data.build_if_missing is None:
        where = "" if path.is_absolute() else f" (a relative path is read from the directory the run starts in, {Path.cwd()})"
        raise FileNotFoundError(f"dataset {path} does not exist{where}; check [data] path")
    from relax_hpc.media.synthetic import write_omni_task

    print(f"writing the {spec.data.build_if_missing} data at {path.parent} (build_if_missing)", file=sys.stderr)
    written = write_omni_task(path.parent, rows=TINY_OMNI_ROWS, seed=spec.job.seed)
    if written != path:
        written.rename(path)


def make_sinks(spec: JobSpec, job_dir: Path) -> FanOut:
    """The [metrics] sinks, named by their keys; one that fails to start or to log is counted and
    warned about, and training goes on (ops/metrics.py: FanOut)."""
    m = spec.metrics
    builders: dict[str, Callable[[], MetricsSink]] = {}
    if m.jsonl:
        builders["jsonl"] = lambda: JsonlSink(job_dir / "metrics.jsonl")
    if m.tensorboard:
        builders["tensorboard"] = lambda: TensorBoardSink(job_dir / "tensorboard")
    if wandb_project := m.wandb_project:
        builders["wandb"] = lambda: WandbSink(wandb_project, spec.job.name, spec_to_dict(spec), job_dir,
                                              m.wandb_mode)
    if clearml_project := m.clearml_project:
        builders["clearml"] = lambda: ClearMLSink(clearml_project, spec.job.name, job_dir)
    if mlflow_experiment := m.mlflow_experiment:
        builders["mlflow"] = lambda: MlflowSink(mlflow_experiment, spec.job.name, spec_to_dict(spec), job_dir,
                                                m.mlflow_tracking_uri)
    return FanOut.open(builders)


def draw_plots(spec: JobSpec, job_dir: Path) -> RunPlots:
    """JOBDIR/reward_curve.png and plots.png from metrics.jsonl, owner-only like the job's files."""
    return plot_run(job_dir / "metrics.jsonl", job_dir, spec.job.name, mode=PRIVATE_FILE_MODE)


def make_plot_writer(spec: JobSpec, job_dir: Path) -> PlotWriter:
    """Redraws the plots every `[metrics] plot_every_steps` on its own thread (never when the
    plots or metrics.jsonl are off)."""
    m = spec.metrics
    every = m.plot_every_steps if m.plot and m.jsonl else 0
    return PlotWriter(every, lambda: draw_plots(spec, job_dir))


def install_stop_handlers(stop: StopFlag) -> None:
    def handler(signum: int, _frame: Any) -> None:
        if stop.requested:  # a second Ctrl-C means "now"
            raise KeyboardInterrupt
        stop.requested, stop.reason = True, signal.Signals(signum).name
        print(f"\n{stop.reason} received: finishing this step, writing a checkpoint, then stopping "
              "(send it again to stop at once)", file=sys.stderr)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, handler)


ENGINE_STATUS_EVERY_S = 5.0  # how often status.json gets the engines' report (one call to rollout)


def memory_report(roles: Roles) -> list[dict[str, Any]]:
    """Every role's bytes held at the end of the run; best effort: a role that cannot say is
    left out, named on stderr, and the run's result stands."""
    try:
        return roles.memory_report()
    except Exception as e:  # noqa: BLE001 - a report, never a reason to fail a finished run
        print(f"memory: the roles could not report the bytes they hold ({type(e).__name__}: {e})", file=sys.stderr)
        return []


def log_status_problem(error: Exception) -> None:
    print(f"status: could not read the engines ({type(error).__name__}: {error})", file=sys.stderr)


def make_grow_driver(spec: JobSpec, submitter: GrowSubmitter | None, roles: Roles) -> GrowDriver | None:
    """The [federation] policy when it is on and this run can submit grow jobs (a job on Slurm)."""
    if spec.federation.max_engines <= 0:
        return None
    if submitter is None:
        print("[federation] max_engines is set, but this run is not a job submitted to Slurm: it does not "
              "grow by itself (relax-hpc submit)", file=sys.stderr)
        return None
    return GrowDriver(spec.federation, submitter, roles)


def rest_host(local: bool) -> str:
    """Where the REST API listens: loopback for a run on this machine, else this node's address
    (the job's other nodes and the grow jobs reach it there)."""
    if local:
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


def start_ray(address: str | None) -> None:
    import ray

    # Every Ray worker of the job finds the secret (and Ray's token) by path, never by value.
    names = (SECRET_ENV, "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")  # never RAY_AUTH_TOKEN's value
    env = {name: os.environ[name] for name in names if name in os.environ}
    env["TOKENIZERS_PARALLELISM"] = "false"
    if address:
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False)
    else:
        apply_ray_node_env(os.environ)  # the local node's raylet inherits this process's environment
        ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": env})


def run_job(spec: JobSpec, in_process: bool = False, ray_address: str | None = None,
            progress: bool = True, grow_submitter: GrowSubmitter | None = None) -> RunReport:
    """Run a job spec to completion (or until a stop signal) on this machine.

    Holds the job directory's lock throughout: JobDirBusyError at once when another run
    holds it; released when this one ends, however it ends. `grow_submitter`: how this job
    submits its own grow jobs (`[federation]`; only a job on Slurm has one).
    """
    check_backends_available(spec)
    with JobDirLock(spec.job_dir()):
        return run_locked(spec, prepare_job_dir(spec), in_process, ray_address, progress, grow_submitter)


def run_locked(spec: JobSpec, job_dir: Path, in_process: bool, ray_address: str | None,
               progress: bool, grow_submitter: GrowSubmitter | None = None) -> RunReport:
    """The run itself, in a job directory whose lock the caller holds."""
    t_start = time.perf_counter()
    alerts = make_job_alerts(spec, job_dir)
    try:
        alerts.started(newest_checkpoint(job_dir) if spec.checkpoint.resume else None)
        ensure_model(spec)
        with job_secret_env(job_dir, joining=bool(ray_address)):
            return run_authenticated(spec, job_dir, in_process, ray_address, progress, t_start, alerts,
                                     grow_submitter)
    except KeyboardInterrupt:
        alerts.interrupted()
        raise
    except Exception as error:
        alerts.failed(error)
        raise
    finally:
        alerts.close()


class _HealthReporter:
    """What the driver does with a health event of a role (docs/operations.md, "Health"): says it
    on stderr, to the owner and in status.json."""

    def __init__(self, status: RunStatus, alerts: JobAlerts) -> None:
        self.status, self.alerts = status, alerts
        self.healer: RoleHealer | None = None

    def __call__(self, event: HealthEvent) -> None:
        print(f"health: {event.line()}", file=sys.stderr)
        self.alerts.role_restarted(event.line())
        self.status.add_event(event.line())
        if self.healer is not None:
            self.status.set_restarts(self.healer.book.in_place, self.healer.book.global_restarts)
            self.status.set_roles(self.healer.role_states())
        if event.action == "global":
            self.status.set_state("restarting", event.line())


@dataclass
class _StepReporter:
    """What the driver does after each step and when a save fails: the progress bar, the plots,
    status.json (the engines every ENGINE_STATUS_EVERY_S), the owner's alerts, the grow policy."""

    status: RunStatus
    alerts: JobAlerts
    healer: RoleHealer | None
    roles: Roles
    bar: Any
    plots: PlotWriter
    grower: GrowDriver | None
    engines_shown: float = -float("inf")  # when status.json last got the engines

    def on_step(self, step: int, m: dict[str, float]) -> None:
        settle_heap()  # once, after the first step; this process also hosts the queue server
        self.bar.update(step, m["reward/mean"], m["time/step_s"])
        self.plots.on_step(step)  # starts a draw on the writer's thread, or skips it: never waits
        self.status.on_step(step, m, int(m.get("samples/step", 0)))
        if self.healer is not None:
            self.status.set_roles(self.healer.role_states())
        if time.monotonic() - self.engines_shown >= ENGINE_STATUS_EVERY_S:
            self.engines_shown = time.monotonic()
            try:
                self.status.set_engines(self.roles.engine_report())
            except Exception as e:  # noqa: BLE001 - status is best effort; the loop notices a dead rollout
                log_status_problem(e)
        self.alerts.step(step, m)
        if self.grower is not None:
            self.grower.on_step(step, m)

    def on_save_failed(self, step: int, error: BaseException) -> None:
        line = f"the checkpoint of step {step} could not be saved: {error}"[:400]
        self.status.add_event(line)
        self.alerts.save_failed(line)


@dataclass
class _Attempt:
    """What `_start` started for the loop; the ExitStack that started it stops each."""

    roles: RebuildableRoles
    healer: RoleHealer | None
    stop: StopFlag
    metrics: FanOut
    reporter: _StepReporter


def _shutdown_ray() -> None:
    import ray

    ray.shutdown()


def _start(stack: ExitStack, spec: JobSpec, job_dir: Path, in_process: bool, ray_address: str | None,
           progress: bool, alerts: JobAlerts, grow_submitter: GrowSubmitter | None, status: RunStatus,
           role_cfgs: tuple[RolloutConfig, ActorConfig]) -> _Attempt:
    """Ray, the driver's heartbeat, the roles, the REST API, the sinks, the plots and the bar, in
    that order; each one's stop goes on `stack` as soon as it runs, so a failure part-way stops
    exactly what had started."""
    if not in_process:
        start_ray(ray_address)
        stack.callback(_shutdown_ray)
    stop = StopFlag()
    install_stop_handlers(stop)  # after ray.init, which installs handlers of its own in this process
    driver_beat = HeartbeatWriter(heartbeat_path(job_dir, "driver"), "driver", spec.health.heartbeat_s)
    driver_beat.start()
    stack.callback(driver_beat.stop)
    # Roles in Ray actors are watched and restarted (docs/operations.md, "Health"); in one
    # process there is nothing to restart.
    health = _HealthReporter(status, alerts)
    healer = health.healer = None if in_process else RoleHealer(spec.health, job_dir, on_event=health)
    r = spec.rollout
    # An agent session may export several samples (agents/config.py: up to max_turns).
    capacity = queue_capacity(r.prompts_per_step, spec.algorithm.max_staleness,
                              r.n_samples_per_prompt * samples_per_session(r))
    queue_roles = queue_role_configs(spec, role_cfgs[1].device)

    critic = critic_config(spec, job_dir, role_cfgs[1].device)

    def build_roles() -> Roles:
        if in_process:
            return with_critic(LocalRoles(*role_cfgs, queue_roles, capacity), critic)
        return with_critic(RayRoles(*role_cfgs, spec.train.num_processes, queue_roles, capacity, healer=healer,
                                    security=spec.security),
                           critic)

    roles = RebuildableRoles(build_roles)
    stack.callback(roles.shutdown)
    print(f"dataset: {roles.dataset_summary()}", file=sys.stderr)
    # The elastic REST API (docs/federation.md): on the head node's address in a cluster.
    rest = serve_rest_api(job_dir, roles, rest_host(in_process or not ray_address))  # type: ignore[arg-type]
    stack.callback(publish_rest_url, job_dir, None)
    stack.callback(rest.stop)
    status.set_state("running")
    print(f"REST API: {rest.url} (cluster.json; docs/federation.md)", file=sys.stderr)
    metrics = stack.enter_context(closing(make_sinks(spec, job_dir)))
    plots = stack.enter_context(closing(make_plot_writer(spec, job_dir)))  # a draw in progress finishes first
    # A bar on a terminal; in a Slurm log (not a terminal) one line every N seconds.
    bar = stack.enter_context(closing(make_progress(spec.train.steps, spec.job.name, enabled=progress)))
    grower = make_grow_driver(spec, grow_submitter, roles)  # type: ignore[arg-type]
    return _Attempt(roles, healer, stop, metrics, _StepReporter(status, alerts, healer, roles, bar, plots, grower))


def run_authenticated(spec: JobSpec, job_dir: Path, in_process: bool, ray_address: str | None,
                      progress: bool, t_start: float, alerts: JobAlerts,
                      grow_submitter: GrowSubmitter | None = None) -> RunReport:
    """The run, once every process it starts can find the job secret. What it starts is stopped
    by one ExitStack, in the reverse order, however the run ends; a run that fails says so in
    status.json once, before anything is stopped."""
    role_cfgs = role_configs(spec, job_dir, resolve_device(spec.train.device))
    status = RunStatus(job_dir, spec.job.name, spec.train.steps)  # `relax-hpc status JOBDIR` reads it
    with ExitStack() as stack:
        try:
            attempt = _start(stack, spec, job_dir, in_process, ray_address, progress, alerts, grow_submitter,
                             status, role_cfgs)
            result = run_with_restarts(spec, attempt.roles, attempt.metrics, attempt.stop,
                                       attempt.reporter.on_step, attempt.healer,
                                       on_restart=lambda: status.set_state("running", "after a global restart"),
                                       on_save_failed=attempt.reporter.on_save_failed)
            engines, memory = attempt.roles.engine_report(), memory_report(attempt.roles)
        except BaseException as error:
            status.set_state("failed", f"{type(error).__name__}: {error}"[:300])
            raise
    curve = None
    if spec.metrics.plot and spec.metrics.jsonl and result.end_step > 0:
        curve = draw_plots(spec, job_dir).reward_curve
    report = RunReport(job_dir, result, time.perf_counter() - t_start, curve)
    summary = {"summary": report.summary_line(), "start_step": result.start_step,
               "end_step": result.end_step, "samples_trained": result.samples_trained,
               "stopped_early": result.stopped_early, "last_checkpoint": result.last_checkpoint,
               "rollout_engines": engines, "memory": memory, "metrics/sink_failures": attempt.metrics.failures(),
               "ckpt/save_failures": result.save_failures,
               "health": attempt.healer.book.summary() if attempt.healer else {"in_place": 0, "global": 0,
                                                                                "events": []}}
    atomic_write_text(job_dir / "summary.json", json.dumps(summary, indent=2))
    status.set_memory(memory)
    status.set_checkpoint(result.last_checkpoint)
    status.set_state("stopped" if result.stopped_early else "finished", attempt.stop.reason)
    alerts.ended(report.summary_line(), result.stopped_early, attempt.stop.reason)
    return report
