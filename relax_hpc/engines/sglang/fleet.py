"""The SGLang servers of `[rollout] engine = "sglang"`: started, restarted on death, stopped.

The rollout component starts `num_engines` servers (`start_sglang_engines`), each wrapped in a
`ManagedSGLangEngine`: a `RolloutEngine` that the rollout role's `EngineRouter` drives like any
other. It owns the server process (sglang/server.py), its HTTP client (sglang/engine.py) and its
weight-update group (sglang/weights.py), and it keeps the newest weights it was given, so that:

- a server that dies is restarted (up to `max_restarts` times), its update group formed anew
  and the newest weights pushed before it serves again; the call that found it dead is then
  redone on it, so a prompt it had in flight is answered exactly once (the dead server answered
  nothing). Calls in flight side by side when it dies share that one restart. Past
  `max_restarts` the call raises `EngineGone` and the router hands that work to the engines left;
- `close()` stops the server by PID (and a watcher stops it if this process dies first).

    launch = SGLangLaunch(interpreter=".venv-sglang/bin/python", model_path=model_dir, device="cpu",
                          log_dir=job_dir / "logs", api_key=engine_token(), sglang=spec.rollout.sglang)
    engines = start_sglang_engines(launch, count=2)
    ...
    for engine in engines:
        engine.close()
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import subprocess
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from relax_hpc.engines.base import EngineGone, Generation, SamplingParams
from relax_hpc.engines.sglang.engine import SGLangEngine
from relax_hpc.engines.sglang.server import SGLangServer
from relax_hpc.engines.sglang.weights import (
    DistributedWeightPush,
    TensorWeightPush,
    WeightPush,
)
from relax_hpc.ops.ports import EnginePorts, engine_ports
from relax_hpc.spec.schema import SGLangSpec

__all__ = ["ManagedSGLangEngine", "SGLangLaunch", "start_sglang_engines"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class SGLangLaunch:
    """How to start and feed the servers: the [rollout.sglang] table, and what the job decides
    beside it (the interpreter found, the device, where the logs go, the API key, R3's flag)."""

    interpreter: str  # [rollout.sglang] python resolved: this interpreter when it is unset
    model_path: str  # [model] path
    device: str  # resolved (cpu, cuda:N)
    log_dir: str
    api_key: str | None
    sglang: SGLangSpec
    host: str = "127.0.0.1"  # the servers' HTTP and the update groups' store listen here only
    more_args: tuple[str, ...] = ()  # launch_server flags the job adds after [rollout.sglang] extra_args
    update_mode: str = "distributed"  # [rollout.sglang] weight_update resolved: distributed, tensor or disk
    request_timeout_s: float = 600.0
    request_fields: dict[str, Any] = field(default_factory=dict)  # more /generate fields (R3)

    @property
    def extra_args(self) -> tuple[str, ...]:
        """Every launch_server flag after ours: [rollout.sglang] extra_args, then the job's own."""
        return (*self.sglang.extra_args, *self.more_args)

    def server_args(self, index: int) -> tuple[str, ...]:
        s = self.sglang
        args = ["--tp-size", str(s.tp_size)]
        if self.device.startswith("cuda"):  # engine i takes GPUs i*tp .. (i+1)*tp-1 of the role's
            args += ["--base-gpu-id", str(index * s.tp_size)]
        if s.mem_fraction_static is not None:
            args += ["--mem-fraction-static", str(s.mem_fraction_static)]
        if s.context_length is not None:
            args += ["--context-length", str(s.context_length)]
        return (*args, *self.extra_args)


def tied_names(model_path: str) -> frozenset[str]:
    """Names SGLang's model has no parameter for: `lm_head.weight` when tied to the embedding."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return frozenset()
    return frozenset({"lm_head.weight"}) if config.get("tie_word_embeddings") else frozenset()


class ManagedSGLangEngine:
    """One SGLang server and its client, restarted on death (see the module docstring)."""

    def __init__(self, index: int, launch: SGLangLaunch, ports: EnginePorts | None = None) -> None:
        self.index, self.launch, self.ports = index, launch, ports
        self.restarts = 0
        self.server = SGLangServer(
            launch.interpreter, launch.model_path, port=ports.http if ports else None, host=launch.host,
            device=launch.device, extra_args=launch.server_args(index),
            log_path=Path(launch.log_dir) / f"sglang-engine-{index}.log",
            start_timeout_s=launch.sglang.startup_timeout_s, api_key=launch.api_key)
        self._client: SGLangEngine | None = None
        self._push: WeightPush | None = None
        self._latest: list[tuple[str, torch.Tensor]] | None = None  # what a restarted server gets
        self._latest_version = 0
        self._version = 0  # what the server runs
        self._released = False  # the server gave its device memory back (release_memory)
        # Calls run side by side (the router sends an engine several chunks at once): when the
        # server dies each of them fails, and only the first may restart it.
        self._restart_lock = threading.Lock()

    @property
    def name(self) -> str:
        return f"SGLang engine {self.index} ({self.server.url}, log {self.server.log_path})"

    def start(self) -> ManagedSGLangEngine:
        self.server.start()
        self._client = self._connect()
        return self

    def _connect(self) -> SGLangEngine:
        launch = self.launch
        self._push = None
        if launch.update_mode == "distributed":
            self._push = DistributedWeightPush(
                launch.host, self.ports.update_group if self.ports else 0, 1 + launch.sglang.tp_size,
                "gloo" if launch.device == "cpu" else "nccl", launch.sglang.update_bucket_mb << 20,
                skip=tied_names(launch.model_path))
        elif launch.update_mode == "tensor":
            self._push = TensorWeightPush(launch.sglang.tp_size, launch.sglang.update_bucket_mb << 20, tied_names(launch.model_path))
        return SGLangEngine(self.server.url, launch.model_path, api_key=launch.api_key,
                            timeout_s=launch.request_timeout_s, retries=1, weight_push=self._push,
                            weights_dir=Path(launch.log_dir) / f"sglang-engine-{self.index}-weights",
                            request_fields=launch.request_fields)

    @property
    def client(self) -> SGLangEngine:
        if self._client is None:
            raise RuntimeError(f"{self.name} is not started (call start()) or was closed")
        return self._client

    # -- RolloutEngine ---------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.client.tokenizer

    @property
    def eos_id(self) -> int:
        return self.client.eos_id

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None,
                 media: Sequence[Any] | None = None) -> list[Generation]:
        # Refusals first: a media call the server cannot take is no reason to look for a dead server.
        admitted = self.client.admit_media(prompts, media)
        generations = self._survive(lambda: self.client.generate(prompts, params, seed, admitted), redo=True)
        assert generations is not None  # redo=True returns only what the call returned
        return generations

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        named = list(named_tensors)
        if self.launch.sglang.max_restarts > self.restarts:
            # A restart must push this version. The rollout role's inbox keeps these tensors
            # unchanged until it installs the next version (WeightInbox.install), in host memory
            # for SGLang engines: they are kept as they are, not copied; only tensors on a GPU
            # are copied to the host.
            self._latest = [(n, t.detach() if t.device.type == "cpu" else t.detach().to("cpu")) for n, t in named]
            self._latest_version = version
        self._survive(lambda: self._update(named, version), redo=False)  # a restart pushes _latest

    def _update(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        client = self.client
        client.pause()  # new generate calls wait; the server's running requests are retracted
        try:
            client.update_weights(named, version)
        finally:
            client.resume()
        self._version = version

    def pause(self) -> None:
        self._survive(lambda: self.client.pause(), redo=False)

    def resume(self) -> None:
        self._survive(lambda: self.client.resume(), redo=False)

    def release_memory(self) -> int:
        """Have the server give its device memory back until `resume_memory`. Not on CPU: there
        SGLang 0.5.23's /release_memory_occupation ends in `torch.cuda.synchronize()`, which kills
        its scheduler (no NVIDIA driver), and host memory has nobody to go to; returns 0."""
        if self.launch.device == "cpu" or self._released:
            return 0
        restarts = self.restarts
        self._survive(lambda: self.client.release_memory(), redo=False)
        self._released = self.restarts == restarts  # a server restarted meanwhile holds its memory
        return 0

    def resume_memory(self) -> None:
        # Only after a release: SGLang's resume of memory it holds fails (KeyError in its scheduler),
        # and a server restarted meanwhile holds all of its memory again.
        if self._released:
            self._released = False
            self._survive(lambda: self.client.resume_memory(), redo=False)

    def close(self) -> None:
        """Leave the update group and stop the server by PID."""
        client, self._client = self._client, None  # first: a call failing from here on restarts nothing
        if self._push is not None:
            alive = self.server.process is not None and self.server.process.poll() is None
            self._push.close(client if alive else None)
            self._push = None
        self.server.stop()

    # -- restart on death ------------------------------------------------------------------------

    def _survive(self, call: Callable[[], T], redo: bool) -> T | None:
        """Run `call`; when the server turns out dead, restart it and (`redo`) run `call` again."""
        while True:
            incarnation = self.restarts  # the server this call is about to reach
            try:
                return call()
            except EngineGone:
                raise
            except Exception as error:  # noqa: BLE001 - sorted by whether the server lives
                with self._restart_lock:
                    if self.restarts == incarnation:  # else a call beside this one restarted it already
                        self._restart_if_dead(error)
                if not redo:
                    return None

    def _restart_if_dead(self, error: Exception) -> None:
        """Re-raise `error` when the server lives; else restart it or, past max_restarts, EngineGone.
        Called under `_restart_lock`, only by a call that reached the server now running."""
        if self._client is None:  # closed: nothing to restart
            raise error
        process = self.server.process
        if process is not None:
            try:
                process.wait(timeout=10)  # a server going down takes a moment to exit
            except subprocess.TimeoutExpired:
                if self.server.healthy(timeout_s=60):
                    raise error  # it lives: the error is the call's own
        code = None if process is None else process.poll()
        if self._push is not None:
            self._push.close(None)
            self._push = None
        if self.restarts >= self.launch.sglang.max_restarts:
            self.server.stop()
            raise EngineGone(
                f"{self.name} stopped (exit code {code}) and was restarted {self.restarts} times already "
                f"([rollout.sglang] max_restarts = {self.launch.sglang.max_restarts}); its work goes to the engines "
                f"left. Why it stopped is in its log:\n{self.server.log_tail(1500)}") from error
        self.restarts += 1
        log.warning("%s stopped (exit code %s, %s); restarting it (%d of at most %d)", self.name, code,
                    str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__,
                    self.restarts, self.launch.sglang.max_restarts)
        self._released = False
        try:
            self.server.restart()
            self._client = self._connect()
            if self._latest is not None:
                self.client.update_weights(self._latest, self._latest_version)
                self._version = self._latest_version
            else:
                self._version = 0  # the model as loaded from model_path
        except Exception as failed:  # a server that cannot come back is gone
            self.server.stop()
            raise EngineGone(f"{self.name} stopped and did not come back: {failed}") from failed


def start_sglang_engines(launch: SGLangLaunch, count: int,
                         port_slot: tuple[int, int] | None = None) -> list[ManagedSGLangEngine]:
    """Start `count` servers side by side and wait until each answers; `port_slot` (job id, node
    slot): take their ports from the job's port plan, else free ones. On any failure every server
    started is stopped and the first error raised."""
    engines = [ManagedSGLangEngine(i, launch, engine_ports(*port_slot, i) if port_slot else None)
               for i in range(count)]
    with concurrent.futures.ThreadPoolExecutor(count, thread_name_prefix="sglang-start") as pool:
        starts = [pool.submit(e.start) for e in engines]
        errors = [f.exception() for f in starts]
    failed = [e for e in errors if e is not None]
    if failed:
        for engine in engines:
            engine.close()
        raise failed[0]
    return engines
