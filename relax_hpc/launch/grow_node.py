"""One node of a grow job: start this node's engines, register them with the main job, watch it.

    python -m relax_hpc.launch.grow_node --job-dir D --main-job-id J --grow-job-id G \\
        --engines N --nodes M --model-dir P [--dtype float32] [--gpus-per-node 0] [--drain-timeout-s 30]

The grow job's batch script (templates/grow.sbatch.in) runs it through srun, one task per node.
It starts this node's share of the N engines as `relax-hpc serve-engine` processes on the node's
address (port 0: a free one; the job's engine token; weights from JOBDIR/federation/weights),
registers their URLs with the main job (POST /rollout/scale_out, the REST URL from
JOBDIR/cluster.json) and then looks every few seconds at the main job's engine list and Slurm
state. What it does about what it sees is the pure function :func:`decide`:

* its engines are listed (joining, active, draining): nothing;
* they are not listed (the main job was requeued: a new driver, a new list): register them again;
* they are listed "gone" or "failed" (`relax-hpc shrink` removed them): stop those servers; when
  none is left, exit 0;
* the main job has ended (seen for ``ended_confirm_s``), or its REST API has been silent for
  ``orphan_after_s`` while the main job does not run (or squeue cannot say): stop everything, exit 0;
* SIGUSR1 (the batch script forwards the time-limit USR1 and a TERM it receives as USR1): ask
  the main job to drain them (POST /rollout/scale_in, ``--drain-timeout-s``), then stop them;
  SIGTERM straight from Slurm (pre-emption, scancel: the servers got it too and are gone) the
  same with a short timeout. Exit 0.

The engine servers ignore SIGUSR1 (it is ignored when they are started), so the signal srun
passes to every process of the step leaves them serving until they are drained. A server that
dies is logged; the main job's router notices on its own and re-issues its prompts.
"""

from __future__ import annotations

import argparse
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from relax_hpc.engines.disk_weights import FEDERATION_WEIGHTS
from relax_hpc.launch.federation import (
    ElasticApi,
    FederationError,
    JobUnavailable,
    OperationBusy,
    federation_dir,
    prepare_federation_dir,
    rest_endpoint,
)
from relax_hpc.launch.jobs import is_finished_state
from relax_hpc.launch.slurm_client import SlurmClient, SlurmError, SubprocessSlurmClient

__all__ = ["Action", "Observation", "WatchLimits", "decide", "engine_command", "engines_on_node", "main"]

EXIT_FAILED = 1
TERM_DRAIN_S = 5.0  # after a TERM from Slurm the servers are gone already: hand their prompts on now
STOP_GRACE_S = 5.0  # SIGTERM to a server, then SIGKILL after this
ENGINE_STATES_LEFT = ("gone", "failed")


# --- pure parts ----------------------------------------------------------------------------------


def engines_on_node(total: int, nodes: int, node_id: int) -> int:
    """This node's share of ``total`` engines over ``nodes`` nodes (the first nodes take the rest)."""
    if not 0 <= node_id < nodes:
        raise ValueError(f"node {node_id} is not one of the grow job's {nodes} nodes (SLURM_NODEID)")
    return total // nodes + (1 if node_id < total % nodes else 0)


def engine_device(index: int, gpus_per_node: int) -> str:
    """The torch device of this node's engine ``index``: its GPU round-robin, else the CPU."""
    return f"cuda:{index % gpus_per_node}" if gpus_per_node > 0 else "cpu"


def engine_command(python: str, model_dir: str, host: str, weights_root: Path, token_file: Path,
                   dtype: str, device: str) -> list[str]:
    """The `relax-hpc serve-engine` command line of one engine (pure)."""
    return [python, "-m", "relax_hpc.cli.main", "serve-engine", model_dir, "--host", host, "--port", "0",
            "--weights-root", str(weights_root), "--token-file", str(token_file), "--dtype", dtype,
            "--device", device]


@dataclass(frozen=True)
class WatchLimits:
    ended_confirm_s: float = 30.0  # a finished main job state must last this long (a requeue passes through some)
    orphan_after_s: float = 1800.0  # REST silent this long while the main job does not run: give the nodes back


@dataclass(frozen=True)
class Observation:
    """What one look at the world shows; every field is data, so :func:`decide` is pure."""

    mine: tuple[str, ...]  # URLs of this node's servers that still run
    listed: dict[str, str] | None  # address -> state in the main job's engine list; None: the API did not answer
    main_state: str | None  # the main job's Slurm state; "" no longer in the queue; None: squeue failed
    main_ended_for_s: float = 0.0  # how long the main job has been seen ended
    unanswered_for_s: float = 0.0  # how long the REST API has not answered
    signal: str | None = None  # "USR1" or "TERM" once received
    died: int = 0  # servers that exited without being asked


@dataclass(frozen=True)
class Action:
    kind: Literal["wait", "register", "stop", "leave", "exit"]
    urls: tuple[str, ...] = ()
    reason: str = ""
    code: int = 0  # the exit status, for "exit"


def decide(obs: Observation, limits: WatchLimits = WatchLimits()) -> Action:
    """What this node does next, given what it sees (module docstring, in this order)."""
    if obs.signal is not None:
        return Action("leave", obs.mine, f"got SIG{obs.signal}")
    if not obs.mine:
        if obs.died:
            return Action("exit", (), f"{obs.died} engine server(s) died and none is left", EXIT_FAILED)
        return Action("exit", (), "every engine of this node was removed from the job")
    ended = obs.main_state is not None and (obs.main_state == "" or is_finished_state(obs.main_state))
    if ended and obs.main_ended_for_s >= limits.ended_confirm_s:
        return Action("exit", (), f"the main job ended ({obs.main_state or 'no longer in the queue'})")
    if obs.listed is None:
        # An unknown state counts as not running: without squeue (a container may lack it) the
        # silence alone must end the grow job some time.
        running = obs.main_state is not None and obs.main_state.startswith("RUNNING")
        if not running and obs.unanswered_for_s >= limits.orphan_after_s:
            state = "of unknown state (squeue fails)" if obs.main_state is None else obs.main_state or "gone"
            return Action("exit", (), f"the main job's REST API has not answered for {obs.unanswered_for_s:.0f} s "
                                      f"and the job is {state}")
        return Action("wait", (), "the main job's REST API does not answer")
    left = tuple(u for u in obs.mine if obs.listed.get(u) in ENGINE_STATES_LEFT)
    if left:
        return Action("stop", left, "removed from the job (" + ", ".join(sorted({obs.listed[u] for u in left})) + ")")
    absent = tuple(u for u in obs.mine if u not in obs.listed)
    if absent:
        return Action("register", absent, "not in the main job's engine list")
    return Action("wait", (), "serving")


def listed_states(engines: Sequence[dict[str, object]]) -> dict[str, str]:
    """address -> state; an address listed twice (gone, then registered again) keeps the newest entry."""
    return {str(e.get("address", "")).rstrip("/"): str(e.get("state")) for e in engines}


# --- the engine servers --------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[{time.strftime('%F %T')}] grow_node: {message}", file=sys.stderr, flush=True)


@dataclass
class EngineServers:
    """This node's `serve-engine` processes: started, their URLs read, stopped by PID."""

    commands: list[list[str]]
    log_paths: list[Path]
    env: dict[str, str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    stopped: set[str] = field(default_factory=set)  # asked to stop: not a death
    reported: set[str] = field(default_factory=set)  # deaths already logged

    def start(self, startup_timeout_s: float, interrupted: Callable[[], bool]) -> str | None:
        """Start every server and read the URL each prints first; the problem, or None."""
        # Ignored now, ignored in the servers (a disposition of SIG_IGN survives exec): the USR1
        # srun passes to every process of the step must reach grow_node only.
        previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        try:
            for cmd, path in zip(self.commands, self.log_paths):
                with open(path, "ab") as err:
                    self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=self.env))
        finally:
            signal.signal(signal.SIGUSR1, previous)
        return self._read_urls(startup_timeout_s, interrupted)

    def _read_urls(self, timeout_s: float, interrupted: Callable[[], bool]) -> str | None:
        selector = selectors.DefaultSelector()
        for k, proc in enumerate(self.procs):
            assert proc.stdout is not None
            selector.register(proc.stdout, selectors.EVENT_READ, k)
        found: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(found) < len(self.procs):
            if interrupted():
                return "interrupted by a signal while the engines started"
            if time.monotonic() > deadline:
                return f"the engines did not print their URLs within {timeout_s:.0f} s; see {self.log_paths[0].parent}"
            for key, _ in selector.select(timeout=1.0):
                k = key.data
                line = self.procs[k].stdout.readline().decode(errors="replace").strip()  # type: ignore[union-attr]
                selector.unregister(key.fileobj)
                if not line.startswith(("http://", "https://")):
                    code = self.procs[k].wait()
                    return f"engine {k} exited ({code}) before printing its URL; its log: {self.log_paths[k]}"
                found[k] = line.rstrip("/")
        self.urls = [found[k] for k in range(len(self.procs))]
        for k, proc in enumerate(self.procs):  # whatever else they print on stdout goes to their log
            threading.Thread(target=_copy_rest, args=(proc.stdout, self.log_paths[k]), daemon=True).start()
        return None

    def running(self) -> tuple[str, ...]:
        return tuple(u for u, p in zip(self.urls, self.procs) if u not in self.stopped and p.poll() is None)

    def newly_dead(self) -> list[tuple[str, int, Path]]:
        """(url, exit status, log) of servers that exited by themselves since the last call."""
        dead = []
        for url, proc, path in zip(self.urls, self.procs, self.log_paths):
            code = proc.poll()
            if code is not None and url not in self.stopped and url not in self.reported:
                self.reported.add(url)
                dead.append((url, code, path))
        return dead

    def stop(self, urls: Sequence[str] | None = None) -> None:
        """SIGTERM the chosen servers (default: all), SIGKILL those still there after STOP_GRACE_S."""
        chosen = [p for u, p in zip(self.urls or [""] * len(self.procs), self.procs) if urls is None or u in urls]
        self.stopped.update(self.urls if urls is None else urls)
        for proc in chosen:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in chosen:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _copy_rest(stream: IO[bytes] | None, path: Path) -> None:
    if stream is None:
        return
    with open(path, "ab") as out:
        for line in stream:
            out.write(line)
            out.flush()


# --- the watcher ---------------------------------------------------------------------------------


class RegistrationFailed(RuntimeError):
    """The main job refused or rolled back the scale-out of this node's engines."""


class GrowNode:
    """Observes, decides, acts (module docstring); everything it talks to is passed in."""

    def __init__(self, servers: EngineServers, api_for: Callable[[], ElasticApi], client: SlurmClient,
                 main_job_id: str, grow_job_id: str, drain_timeout_s: float, limits: WatchLimits = WatchLimits(),
                 poll_s: float = 5.0, slurm_poll_s: float = 30.0, join_limit_s: float = 900.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.servers, self.api_for, self.client = servers, api_for, client
        self.main_job_id, self.grow_job_id = main_job_id, grow_job_id
        self.drain_timeout_s, self.limits, self.poll_s = drain_timeout_s, limits, poll_s
        self.slurm_poll_s, self.join_limit_s, self.clock = slurm_poll_s, join_limit_s, clock
        self.signal: str | None = None
        self.wake = threading.Event()
        self._died = 0
        self._silent_since: float | None = None
        self._ended_since: float | None = None
        self._main_state: str | None = None
        self._slurm_checked = float("-inf")
        self._squeue_failing = False

    def on_signal(self, signum: int, _frame: object = None) -> None:
        self.signal = self.signal or signal.Signals(signum).name.removeprefix("SIG")
        self.wake.set()

    def _sleep(self, seconds: float) -> None:
        self.wake.wait(seconds)

    # -- observing --

    def _listed(self) -> dict[str, str] | None:
        try:
            return listed_states(self.api_for().engines())
        except (ValueError, ConnectionError) as e:  # no rest_url yet, 503 (restarting), not answering, no secret
            if self._silent_since is None:
                log(f"the main job's REST API does not answer: {str(e).splitlines()[0]}")
            return None

    def _slurm_state(self, now: float) -> str | None:
        if now - self._slurm_checked >= self.slurm_poll_s:
            self._slurm_checked = now
            try:
                found = self.client.job_components(self.main_job_id)
                self._main_state, self._squeue_failing = (found[0].state if found else ""), False
            except SlurmError as e:
                if not self._squeue_failing:  # said once, not every poll
                    log(f"squeue failed ({str(e).splitlines()[0]}); the main job's state is unknown for now")
                self._main_state, self._squeue_failing = None, True
        return self._main_state

    def observe(self) -> Observation:
        now = self.clock()
        listed = self._listed()
        for url, code, path in self.servers.newly_dead():
            self._died += 1
            log(f"engine {url} exited ({code}) without being asked; the main job's router re-issues its prompts. "
                f"Its log: {path}")
        self._silent_since = (self._silent_since or now) if listed is None else None
        state = self._slurm_state(now)
        ended = state is not None and (state == "" or is_finished_state(state))
        self._ended_since = (self._ended_since or now) if ended else None
        return Observation(
            mine=self.servers.running(), listed=listed, main_state=state,
            main_ended_for_s=now - self._ended_since if self._ended_since is not None else 0.0,
            unanswered_for_s=now - self._silent_since if self._silent_since is not None else 0.0,
            signal=self.signal, died=self._died)

    # -- acting --

    def register(self, urls: Sequence[str]) -> None:
        """Scale the main job out by ``urls``; returns once the operation is done (or a signal came).
        RegistrationFailed when the job refuses them; a silent API, or one answering 503
        (the main job is being requeued), only means: try again at the next look."""
        body = {"engine_urls": list(urls), "job": self.grow_job_id}
        try:
            api = self.api_for()
            while True:
                try:
                    op = api.start("scale_out", body)
                    break
                except OperationBusy:
                    self._sleep(self.poll_s)
                    if self.signal:
                        return
            log(f"registering {len(urls)} engine(s) with job {self.main_job_id}: operation {op.get('id')}")
            deadline = self.clock() + self.join_limit_s
            while op.get("state") not in ("done", "failed", "rolled_back"):
                if self.signal or self.clock() > deadline:
                    return  # the next look decides (leave, or register again)
                self._sleep(min(self.poll_s, 2.0))
                op = api.operation(str(op.get("id")))
        except (ConnectionError, JobUnavailable) as e:  # not answering, or answering 503 while it is requeued
            log(f"registration interrupted ({str(e).splitlines()[0]}); trying again at the next look")
            return
        except ValueError as e:  # FederationError (400: the job refuses them), JobSecretError
            raise RegistrationFailed(str(e)) from None
        if op.get("state") != "done":
            raise RegistrationFailed(f"operation {op.get('id')} {op.get('state')}: {op.get('message')}")
        log(f"operation {op.get('id')} done: {op.get('message')}")

    def leave(self, urls: Sequence[str], how: str) -> None:
        """Drain ``urls`` from the main job (best effort, bounded), then stop every server."""
        timeout = TERM_DRAIN_S if how == "TERM" else float(self.drain_timeout_s)
        if urls:
            try:
                api = self.api_for()
                op = api.start("scale_in", {"engine_urls": list(urls), "timeout_s": timeout},
                               busy_wait_s=timeout / 2, poll_s=1.0)
                log(f"draining {len(urls)} engine(s): operation {op.get('id')}, up to {timeout:g} s")
                op = api.wait(str(op.get("id")), limit_s=timeout + 5.0, poll_s=1.0)
                log(f"operation {op.get('id')} {op.get('state')}: {op.get('message')}")
            except (FederationError, ConnectionError) as e:
                log(f"could not drain the engines ({str(e).splitlines()[0]}); stopping them anyway: the main "
                    "job's router re-issues the prompts they held")
        self.servers.stop()

    def run(self) -> int:
        while True:
            action = decide(self.observe(), self.limits)
            if action.kind == "wait":
                self._sleep(self.poll_s)
                continue
            log(f"{action.kind} {', '.join(action.urls) or '-'}: {action.reason}")
            if action.kind == "register":
                try:
                    self.register(action.urls)
                except RegistrationFailed as e:
                    log(f"job {self.main_job_id} did not take the engines: {e}; stopping them")
                    self.servers.stop()
                    return EXIT_FAILED
            elif action.kind == "stop":
                self.servers.stop(action.urls)
            elif action.kind == "leave":
                self.leave(action.urls, self.signal or "USR1")
                return 0
            else:
                self.servers.stop()
                return action.code


# --- the command ---------------------------------------------------------------------------------


class _ApiCache:
    """The main job's API, rebuilt when cluster.json names another URL (a requeued driver)."""

    def __init__(self, job_dir: Path, main_job_id: str) -> None:
        self.job_dir, self.main_job_id = job_dir, main_job_id
        self._api: ElasticApi | None = None

    def __call__(self) -> ElasticApi:
        url, _ = rest_endpoint(self.job_dir, self.main_job_id)
        if self._api is None or self._api.url != url:
            self._api = ElasticApi.for_job(self.job_dir, self.main_job_id, timeout_s=15.0)
        return self._api


def _node_address(host: str | None) -> str:
    if host:
        return host
    from relax_hpc.launch.incluster import node_address

    return node_address(os.environ.get("SLURMD_NODENAME", socket.gethostname()))


def _servers(args: argparse.Namespace, count: int, node_id: int) -> EngineServers:
    job_dir = Path(args.job_dir)
    prepare_federation_dir(job_dir)
    weights = Path(job_dir) / FEDERATION_WEIGHTS
    tokens = federation_dir(job_dir) / "run"
    tokens.mkdir(mode=0o700, exist_ok=True)
    host = _node_address(args.host)
    cpus = int(os.environ.get("SLURM_CPUS_PER_TASK", os.cpu_count() or 1))
    env = dict(os.environ)
    # Each engine gets its share of the node's CPUs for torch's threads (at least one).
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(max(1, cpus // max(count, 1)))
    commands, logs = [], []
    for k in range(count):
        name = f"grow-{args.grow_job_id}-node-{node_id}-engine-{k}"
        commands.append(engine_command(sys.executable, args.model_dir, host, weights, tokens / f"{name}.token",
                                       args.dtype, engine_device(k, args.gpus_per_node)))
        logs.append(job_dir / "logs" / f"{name}.log")
    return EngineServers(commands, logs, env)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m relax_hpc.launch.grow_node", description=__doc__.splitlines()[0])
    p.add_argument("--job-dir", required=True, help="the main job's directory")
    p.add_argument("--main-job-id", required=True)
    p.add_argument("--grow-job-id", required=True)
    p.add_argument("--engines", type=int, required=True, help="engines of the whole grow job")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the grow job (this one: SLURM_NODEID)")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--drain-timeout-s", type=float, default=30.0)
    p.add_argument("--host", default=None, help="address to serve on (default: this Slurm node's)")
    p.add_argument("--startup-timeout-s", type=float, default=900.0)
    p.add_argument("--poll-s", type=float, default=5.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    node_id = int(os.environ.get("SLURM_NODEID", "0"))
    count = engines_on_node(args.engines, args.nodes, node_id)
    servers = _servers(args, count, node_id)
    node = GrowNode(servers, _ApiCache(Path(args.job_dir), args.main_job_id), SubprocessSlurmClient(),
                    args.main_job_id, args.grow_job_id, args.drain_timeout_s, poll_s=args.poll_s)
    for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, node.on_signal)
    log(f"node {node_id} of grow job {args.grow_job_id}: starting {count} engine(s) for job {args.main_job_id}")
    problem = servers.start(args.startup_timeout_s, lambda: node.signal is not None)
    if problem is not None:
        log(problem)
        servers.stop()
        return 0 if node.signal else EXIT_FAILED
    log(f"serving: {', '.join(servers.urls)}")
    return node.run()


if __name__ == "__main__":
    sys.exit(main())
