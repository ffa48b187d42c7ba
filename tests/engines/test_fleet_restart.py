"""A managed SGLang engine's restart when several calls are in flight on it (no SGLang needed).

The router sends one engine several chunks at once (`chunks_per_engine`); when its server dies,
every one of them fails. One restart must serve them all, each call redone once on the new
server. The real server's death is tested in test_sglang_fleet.py; here the server and the
client are stand-ins, so the interleaving can be forced.
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.engines.base import EngineGone, Generation, SamplingParams
from relax_hpc.engines.sglang.fleet import ManagedSGLangEngine, SGLangLaunch
from relax_hpc.spec.schema import SGLangSpec


class _Process:
    def __init__(self) -> None:
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code

    def wait(self, timeout: float | None = None) -> int:
        if self.code is None:
            raise subprocess.TimeoutExpired("sglang", timeout or 0)
        return self.code


class _Server:
    """What ManagedSGLangEngine reads of SGLangServer."""

    url, log_path = "http://127.0.0.1:1", Path("sglang-engine-0.log")

    def __init__(self) -> None:
        self.process = _Process()
        self.restarted = 0

    def healthy(self, timeout_s: float) -> bool:
        return self.process.code is None

    def restart(self) -> None:
        self.restarted += 1
        self.process = _Process()

    def stop(self) -> None:
        self.process.code = -15

    def log_tail(self, limit: int) -> str:
        return "(log)"


class _Client:
    """One server incarnation's client: `fail_together` callers fail at once, as they would when
    the server dies under all of them."""

    def __init__(self, server: _Server, incarnation: int, fail_together: int) -> None:
        self.server, self.incarnation = server, incarnation
        self.barrier = threading.Barrier(fail_together) if fail_together else None
        self.answered: list[list[int]] = []

    def admit_media(self, prompts: list[list[int]], media: Any) -> None:
        return None

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None,
                 media: Any) -> list[Generation]:
        if self.barrier is not None:
            self.barrier.wait(timeout=30)  # every call is in flight when the server dies
            self.server.process.code = -9
            raise ConnectionError("Connection refused")
        self.answered.extend(prompts)
        return [Generation(p, [self.incarnation], [0.0], "stop", 0) for p in prompts]


def _engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_flight: int, max_restarts: int,
            ) -> tuple[ManagedSGLangEngine, list[_Client]]:
    launch = SGLangLaunch(interpreter="p", model_path=str(tmp_path), device="cpu", log_dir=str(tmp_path),
                          api_key=None, update_mode="disk", sglang=SGLangSpec(max_restarts=max_restarts))
    engine = ManagedSGLangEngine(0, launch)
    server = _Server()
    engine.server = server  # type: ignore[assignment]
    clients = [_Client(server, 0, fail_together=in_flight)]

    def connect() -> _Client:
        clients.append(_Client(server, len(clients), fail_together=0))
        return clients[-1]

    monkeypatch.setattr(engine, "_connect", connect)
    engine._client = clients[0]  # type: ignore[assignment]  # as start() leaves it
    return engine, clients


def _generate_side_by_side(engine: ManagedSGLangEngine, prompts: list[list[int]]) -> dict[int, Any]:
    results: dict[int, Any] = {}

    def call(k: int) -> None:
        try:
            results[k] = engine.generate([prompts[k]], SamplingParams(max_new_tokens=1))
        except Exception as error:  # noqa: BLE001 - the test reads what each call ended with
            results[k] = error

    threads = [threading.Thread(target=call, args=(k,)) for k in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_calls_in_flight_when_the_server_dies_share_one_restart_and_are_each_answered_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [[1, 2], [3, 4], [5, 6]]
    engine, clients = _engine(tmp_path, monkeypatch, in_flight=len(prompts), max_restarts=1)
    results = _generate_side_by_side(engine, prompts)
    assert engine.restarts == 1 and engine.server.restarted == 1  # type: ignore[attr-defined]
    assert len(clients) == 2, "one new server, one new client"
    for k, prompt in enumerate(prompts):
        gens = results[k]
        assert isinstance(gens, list), f"call {k} ended with {gens!r}"
        assert [(g.prompt_ids, g.token_ids) for g in gens] == [(prompt, [1])]  # answered by the new server
    assert sorted(clients[1].answered) == sorted(prompts)  # each prompt once


def test_past_max_restarts_every_call_in_flight_gets_engine_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, clients = _engine(tmp_path, monkeypatch, in_flight=2, max_restarts=0)
    results = _generate_side_by_side(engine, [[1], [2]])
    assert all(isinstance(r, EngineGone) for r in results.values()), results
    assert "max_restarts = 0" in str(results[0]) and engine.server.restarted == 0  # type: ignore[attr-defined]
    assert len(clients) == 1
