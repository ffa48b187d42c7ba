"""Engines join a running job through its REST API, serve with its weights, and leave without loss.

A tiny job runs in this process; two `relax-hpc serve-engine` processes (what a grow job
starts, docs/federation.md) register with it over HTTP, receive the current weights and every
version after, and answer prompts. Then one is SIGKILLed mid-run and the other is drained
away; the run goes on on its own engine, and its trajectory archive shows every sample trained
exactly once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.auth import JobSecret
from relax_hpc.engines.elastic.rest_api import RestClient
from relax_hpc.ops.exactly_once import check_exactly_once

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
PROMPTS, SAMPLES = 8, 32  # jobspecs/tiny_local.toml


def _spec(tmp_path: Path, model: Path) -> Any:
    from relax_hpc.spec import parse_spec

    text = (REPO / "jobspecs" / "tiny_local.toml").read_text()
    text = text.replace('name = "tiny_local"', f'name = "fed"\noutput_dir = "{tmp_path / "fed"}"')
    text = text.replace('path = "runs/models/tiny-qwen3"', f'path = "{model}"')
    text = text.replace('path = "jobspecs/', f'path = "{REPO}/jobspecs/')
    text = re.sub(r"(?m)^steps = \d+", "steps = 2000", text)  # stopped by the script below
    text = re.sub(r"(?m)^save_interval = \d+", "save_interval = 1000", text)
    return parse_spec(text, "<federation test>")


def _wait(what: str, check: Any, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return found


def _serve(model: Path, job_dir: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "RELAX_HPC_SECRET_FILE": str(job_dir / ".secret"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "relax_hpc.cli.main", "serve-engine", str(model), "--port", "0",
         "--weights-root", str(job_dir / "federation" / "weights")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    assert url.startswith("http://"), url
    return proc, url


class Grower(threading.Thread):
    """What a grow job and a user do to the running job, step by step; records what it saw."""

    def __init__(self, model: Path, job_dir: Path) -> None:
        super().__init__(daemon=True)
        self.model, self.job_dir = model, job_dir
        self.seen: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.procs: list[subprocess.Popen] = []

    def run(self) -> None:
        try:
            self._script()
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            os.kill(os.getpid(), signal.SIGUSR1)  # the run checkpoints its step and stops

    def _engines(self, rest: RestClient) -> dict[str, dict[str, Any]]:
        status, body = rest.get("/rollout/engines")
        assert status == 200, body
        return {e["address"]: e for e in body["engines"]}

    def _operation(self, rest: RestClient, status: int, body: dict[str, Any]) -> dict[str, Any]:
        assert status == 202, body
        op_id = body["operation"]["id"]

        def finished() -> dict[str, Any] | None:
            op = rest.get(f"/rollout/operations/{op_id}")[1]["operation"]
            return op if op["state"] not in ("pending", "running") else None
        return _wait(f"operation {op_id}", finished)

    def _script(self) -> None:
        cluster = self.job_dir / "cluster.json"
        url = _wait("the REST API", lambda: cluster.is_file() and json.loads(cluster.read_text()).get("rest_url"))
        token = JobSecret.load(self.job_dir / ".secret").token("rest")
        rest = RestClient(url, token)
        assert rest.get("/rollout/engines")[0] == 200
        assert RestClient(url, "x" * 64).get("/rollout/engines")[0] == 401
        _wait("step 2", lambda: _last_step(self.job_dir) >= 2)
        served = [_serve(self.model, self.job_dir) for _ in range(2)]
        self.procs = [p for p, _ in served]
        urls = [u for _, u in served]
        self.seen["join"] = self._operation(rest, *rest.post("/rollout/scale_out", {"engine_urls": urls, "job": "4242"}))
        self.seen["join_step"] = _last_step(self.job_dir)
        # Both serve, with the job's weights: a version past the one they started with.
        both = _wait("the joined engines to serve", lambda: all(
            e["samples"] > 0 and e["weight_version"] > 0 for u, e in self._engines(rest).items() if u in urls) and
            all(u in self._engines(rest) for u in urls))
        self.seen["serving"] = {u: self._engines(rest)[u] for u in urls}
        assert both
        versions = [self._engines(rest)[u]["weight_version"] for u in urls]
        _wait("a newer version on the joined engines", lambda: all(
            self._engines(rest)[u]["weight_version"] > v for u, v in zip(urls, versions)))
        self.procs[0].send_signal(signal.SIGKILL)  # a pre-empted node: no goodbye
        self.seen["killed_step"] = _last_step(self.job_dir)
        _wait("the killed engine to be noticed", lambda: self._engines(rest)[urls[0]]["state"] == "failed")
        self.seen["leave"] = self._operation(rest, *rest.post("/rollout/scale_in", {"engine_urls": [urls[1]]}))
        self.seen["after"] = self._engines(rest)
        left_at = _last_step(self.job_dir)
        _wait("two more steps", lambda: _last_step(self.job_dir) >= left_at + 2)


def _last_step(job_dir: Path) -> int:
    path = job_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1])["step"] if lines else 0


def test_engines_join_serve_and_leave_a_running_job_without_loss(tmp_path: Path) -> None:
    from relax_hpc.driver.run import run_job
    from relax_hpc.models.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "model", seed=1)
    spec = _spec(tmp_path, model)
    job_dir = tmp_path / "fed"
    grower = Grower(model, job_dir)
    grower.start()
    try:
        report = run_job(spec, in_process=True, progress=False)
    finally:
        for p in grower.procs:
            p.kill()
            p.wait()
    grower.join(30)
    assert grower.error is None, f"{grower.error!r}; seen {grower.seen}"
    seen = grower.seen
    assert seen["join"]["state"] == "done", seen["join"]
    assert seen["leave"]["state"] == "done", seen["leave"]
    states = sorted(e["state"] for e in seen["after"].values())
    assert states == ["active", "failed", "gone"], seen["after"]
    assert all(e["job"] == "4242" for u, e in seen["after"].items() if u != "in-job")

    end = report.result.end_step
    assert report.result.stopped_early and end > seen["killed_step"] + 2
    assert report.result.samples_trained == end * PROMPTS * SAMPLES
    check = check_exactly_once(job_dir)
    assert (check.duplicated, check.lost) == (0, 0), check.summary_line()
    assert check.samples == end * PROMPTS * SAMPLES
    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["rollout/engines"] for r in rows) == 3.0 and rows[-1]["rollout/engines"] == 1.0
    assert max(r.get("rollout/engines_by_job/4242", 0.0) for r in rows) == 2.0
    assert json.loads((job_dir / "cluster.json").read_text())["rest_url"] is None  # the API is gone
