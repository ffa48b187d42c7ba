"""`EngineFleet`: the rollout engines of a job, assembled from the spec in one place.

The rollout role asks for a fleet and drives its router; it never names an engine class or kind.
Here: native engines built in process, engines the driver started in actors of their own (their
router clients handed in), SGLang servers (started, restarted and stopped by sglang/fleet.py),
engines of other jobs that join over HTTP (elastic/remote.py), the scaler that adds and removes
engines while the job runs (elastic/scaler.py), the GenRM judge of `[reward]`, and what each kind
of engine needs of the devices (`gpus_per_rollout`, `engine_actor_count`).

Settings come as the rollout role's config, read through `FleetSettings` (the spec's
`[rollout]`, `[model]` and routing-replay values plus where the role runs).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from relax_hpc.engines.base import Generator, RolloutEngine
from relax_hpc.engines.disk_weights import FEDERATION_WEIGHTS
from relax_hpc.engines.elastic.api import ElasticReply
from relax_hpc.engines.elastic.hosts import EngineHostPolicy
from relax_hpc.engines.elastic.remote import RemoteEngineClient
from relax_hpc.engines.elastic.scaler import ElasticScaler
from relax_hpc.engines.factory import make_engine
from relax_hpc.engines.http.auth import engine_token, read_token_file
from relax_hpc.engines.http.client import HttpEngine
from relax_hpc.engines.router import EngineClient, EngineRouter, LocalEngineClient
from relax_hpc.engines.sglang.fleet import SGLangLaunch, start_sglang_engines
from relax_hpc.models.hf import load_tokenizer
from relax_hpc.ops.ports import port_slot_from_env
from relax_hpc.spec.schema import SGLangSpec

# Engines the job starts in its own allocation at run time (`scale_out` with a count) are started
# by the caller: in actors placed like the job's engines, or None for engines in this process.
SpawnActors = Callable[[list[str]], list[EngineClient]]


class FleetSettings(Protocol):
    """What the fleet reads of the rollout role's config."""

    @property
    def engine(self) -> str: ...  # [rollout] engine
    @property
    def model_path(self) -> str: ...
    @property
    def num_engines(self) -> int: ...
    @property
    def chunks_per_engine(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def routing_replay(self) -> bool: ...
    @property
    def sglang_spec(self) -> SGLangSpec | None: ...
    @property
    def job_dir(self) -> str | None: ...
    @property
    def release_between_steps(self) -> bool: ...  # [cluster] colocate
    @property
    def remote_engine_timeout_s(self) -> float: ...


def engine_actor_count(settings: FleetSettings) -> int:
    """How many engine actors the driver starts beside the rollout role: N > 1 native engines run
    in actors of their own (a GPU each on GPUs); one engine runs in the rollout role, and SGLang
    engines are server processes the rollout role starts."""
    return settings.num_engines if settings.num_engines > 1 and settings.engine == "native" else 0


def gpus_per_rollout(settings: FleetSettings, per_process: float) -> float:
    """The GPUs the rollout role's process asks for when it hosts its engines: its own engine's
    (`per_process`), or with SGLang every server's (`tp_size` each; the servers it starts see the
    role's CUDA_VISIBLE_DEVICES)."""
    if settings.engine == "sglang":
        tp_size = settings.sglang_spec.tp_size if settings.sglang_spec else 1
        return per_process * settings.num_engines * tp_size
    return per_process


def sglang_launch(settings: FleetSettings) -> SGLangLaunch:
    """How the fleet starts its SGLang servers: [rollout.sglang], the job's engine token as their
    API key, their logs under JOBDIR/logs. weight_update "auto": "tensor" when the engines share
    the trainer's devices ([cluster] colocate), else "distributed"."""
    s = settings.sglang_spec or SGLangSpec()
    mode = s.weight_update
    if mode == "auto":
        mode = "tensor" if settings.release_between_steps else "distributed"
    log_dir = Path(settings.job_dir) / "logs" if settings.job_dir else Path(tempfile.mkdtemp(prefix="relax-sglang-"))
    replay = settings.routing_replay
    return SGLangLaunch(
        interpreter=s.python or sys.executable, model_path=settings.model_path, device=settings.device,
        log_dir=str(log_dir), api_key=engine_token(), sglang=s,
        more_args=("--enable-return-routed-experts",) if replay else (),
        update_mode=mode, request_fields={"return_routed_experts": True} if replay else {})


def build_router(settings: FleetSettings, engines: list[RolloutEngine] | None = None,
                 clients: list[EngineClient] | None = None) -> EngineRouter:
    """The router over the engines: `engines` given (tests), router `clients` of engine actors the
    driver started, or else `settings.num_engines` engines of their kind, started here."""
    if clients:
        tokenizer = load_tokenizer(settings.model_path)  # the engines' own: they load the same directory
        return EngineRouter(clients, tokenizer, tokenizer.eos_token_id, settings.chunks_per_engine)
    if not engines and settings.engine == "sglang":
        engines = list(start_sglang_engines(sglang_launch(settings), settings.num_engines, port_slot_from_env()))
    if not engines:
        engines = [make_engine(settings.engine, settings.model_path, settings.dtype, settings.device,
                               record_routing=settings.routing_replay) for _ in range(settings.num_engines)]
    local = [LocalEngineClient(f"engine-{i}", e) for i, e in enumerate(engines)]
    return EngineRouter(local, engines[0].tokenizer, engines[0].eos_id, settings.chunks_per_engine,
                        local_engine=engines[0])


def engine_for_actor(engine: str, model_path: str, dtype: str, device: str, routing_replay: bool) -> RolloutEngine:
    """The engine an engine actor (roles/engine_host.py) runs, built in the actor's process."""
    return make_engine(engine, model_path, dtype, device, record_routing=routing_replay)


def federation_weights_dir(job_dir: str | Path | None) -> Path:
    """Where weight versions are written for engines that joined over HTTP: JOBDIR/federation/weights,
    on the shared filesystem the grow jobs read (a temp dir for a run without a job directory)."""
    if job_dir is None:
        return Path(tempfile.mkdtemp(prefix="relax-federation-weights-"))
    return Path(job_dir) / FEDERATION_WEIGHTS


def _model_type(model_path: str) -> str | None:
    """config.json's model_type: an engine that joins must serve the same kind of model."""
    import json

    try:
        return json.loads((Path(model_path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


class EngineFleet:
    """The router over a job's engines and the scaler that adds and removes engines while it runs.

    `engines`: engine instances to drive (tests); `clients`: router clients of engine actors the
    driver started; neither: `settings.num_engines` engines of the spec's kind, started here.
    `spawn_actors`: how engines added at run time are started when the job's engines run in
    actors (None: in this process). Only native engines can be added by count; any kind of job
    takes engines that join over HTTP.
    """

    def __init__(self, settings: FleetSettings, engines: list[RolloutEngine] | None = None,
                 clients: list[EngineClient] | None = None, spawn_actors: SpawnActors | None = None) -> None:
        self.settings = settings
        self.router = build_router(settings, engines, clients)
        self.in_actors = bool(clients)
        self._spawn_actors = spawn_actors if clients else None
        self._weights_dir: Path | None = None
        # Engine URLs only on the job's own nodes or its grow jobs' (the engine token goes there).
        hosts = EngineHostPolicy(Path(settings.job_dir) if settings.job_dir else None)
        self.scaler = ElasticScaler(self.router, connect=self._connect,
                                    spawn=self._spawn if settings.engine == "native" else None,
                                    check_hosts=hosts.check)

    def elastic(self, action: str, body: dict[str, Any]) -> ElasticReply:
        """One request of the elastic REST API (engines/elastic/api.py)."""
        return self.scaler.elastic(action, body)

    def binds_received_weights(self) -> bool:
        """Whether the one engine computes with a received version in place (a native engine in
        this process binds the buffer). SGLang servers, engine actors and several engines each load
        a version into memory of their own."""
        s = self.settings
        return s.engine == "native" and not self.in_actors and s.num_engines == 1

    def _connect(self, engine_id: str, url: str, job: str | None) -> EngineClient:
        """An engine serving elsewhere (a grow job's `relax-hpc serve-engine`), with this job's
        engine token; its weights arrive through the shared job directory."""
        if self._weights_dir is None:
            self._weights_dir = federation_weights_dir(self.settings.job_dir)
        return RemoteEngineClient(engine_id, url, token=engine_token(), weights_root=self._weights_dir,
                                  timeout_s=self.settings.remote_engine_timeout_s,
                                  model_type=_model_type(self.settings.model_path))

    def _spawn(self, ids: list[str]) -> list[EngineClient]:
        """Engines started in the job's own allocation: actors placed like the job's (when its
        engines run in actors), else engines in this process."""
        if self._spawn_actors is not None:
            return self._spawn_actors(ids)
        s = self.settings
        return [LocalEngineClient(i, make_engine(s.engine, s.model_path, s.dtype, s.device,
                                                 record_routing=s.routing_replay)) for i in ids]


def build_genrm_judge(reward: Any, dtype: str, device: str) -> tuple[Generator | None, Any]:
    """The GenRM judge engine and its tokenizer from [reward], or (None, None) when none is set.

    genrm_url: an engine server (frozen weights), tokenizer from genrm_tokenizer_path (required:
    the server takes token ids), bearer token from genrm_token_file (else the job's own engine
    token: a server started with this job's RELAX_HPC_SECRET_FILE). genrm_model_path: a native
    engine in this process on rollout's device, tokenizer from the same directory unless
    genrm_tokenizer_path overrides it.
    """
    model_path: str | None = getattr(reward, "genrm_model_path", None)
    url: str | None = getattr(reward, "genrm_url", None)
    tokenizer_path: str | None = getattr(reward, "genrm_tokenizer_path", None)
    if url:
        if not tokenizer_path:
            raise ValueError(
                f"[reward] genrm_url = {url!r} needs genrm_tokenizer_path (the judge's local HF directory)"
            )
        # A judge call, retries and their backoffs (0.5 s, 1 s) included, must fit in the reward
        # pool's per-sample timeout; split what the backoffs leave over the 3 attempts.
        per_attempt = max((reward.timeout_s - 1.5) / 3, 0.1)
        token_file: str | None = getattr(reward, "genrm_token_file", None)
        token = read_token_file(Path(token_file)) if token_file else engine_token()
        engine = HttpEngine(url, token=token, timeout_s=per_attempt, retries=2, backoff_s=0.5)
        return engine, load_tokenizer(tokenizer_path)
    if model_path:
        native = make_engine("native", model_path, dtype=dtype, device=device)
        return native, load_tokenizer(tokenizer_path) if tokenizer_path else native.tokenizer
    return None, None
