"""Which engine URLs a job accepts on scale_out (the engine token goes to them): its own nodes and
its grow jobs' nodes only, refused with 400 before anything connects (issue 33, item 11).

A real REST server over a real scaler with the rollout role's `EngineHostPolicy`; the job
directory's real grow-job record and cluster.json; Slurm's answers from a stand-in function (and `squeue_job_nodes` from a stand-in `squeue` on PATH); a real
listening socket on this machine's route address stands for a host someone else chose, and must
see no connection at all.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from relax_hpc.engines.elastic.scaler import ElasticScaler
from relax_hpc.engines.memory import ScriptedEngine
from relax_hpc.engines.elastic.rest_api import RestClient, RestServer, make_rest_app
from relax_hpc.engines.router import EngineRouter, LocalEngineClient
from relax_hpc.engines.elastic.hosts import EngineHostPolicy, expand_hostlist, resolve_host, squeue_job_nodes
from relax_hpc.models.hf import load_tokenizer
from relax_hpc.weights.group import local_address_towards

TOKEN = "r" * 64
MAIN, GROW, OTHER_MAINS_GROW, PENDING_GROW = "4242", "4243", "5000", "4244"


@pytest.fixture(scope="module")
def route_address() -> str:
    """This machine's non-loopback address: a host that is not loopback and not the job's."""
    addr = local_address_towards("192.0.2.123", 9)
    if not resolve_host(addr) or ipaddress.ip_address(next(iter(resolve_host(addr)))).is_loopback:
        pytest.skip("no non-loopback IPv4 interface on this machine")
    return addr


@pytest.fixture
def listener(route_address: str) -> Iterator[socket.socket]:
    """A real port on the route address that nothing of the job may connect to."""
    sock = socket.create_server((route_address, 0))
    sock.setblocking(False)
    yield sock
    sock.close()


def _job_dir(tmp_path: Path) -> Path:
    """A job directory as `relax-hpc submit` and `relax-hpc grow` leave it: cluster.json names the
    main job, federation/grow_jobs.json records its grow jobs (and one of another submission)."""
    (tmp_path / "federation").mkdir(mode=0o700)
    (tmp_path / "cluster.json").write_text(json.dumps({"job_id": MAIN, "rest_url": None}))
    records = [{"job_id": GROW, "main_job_id": MAIN}, {"job_id": PENDING_GROW, "main_job_id": MAIN},
               {"job_id": OTHER_MAINS_GROW, "main_job_id": "1"}]
    (tmp_path / "federation" / "grow_jobs.json").write_text(json.dumps({"grow_jobs": records}))
    return tmp_path


class Client(LocalEngineClient):
    def __init__(self, id: str, engine: ScriptedEngine, address: str = "") -> None:
        super().__init__(id, engine)
        self.address = address

    def current_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [("w", torch.ones(2))]


def test_engine_urls_only_on_the_jobs_own_or_its_grow_jobs_nodes(tmp_path: Path, tiny_model_dir: Path,
                                                                  route_address: str, listener: socket.socket) -> None:
    tokenizer = load_tokenizer(tiny_model_dir)
    running = {GROW: [route_address], OTHER_MAINS_GROW: [route_address]}  # where grow jobs' engines run

    def grow_job_nodes(job: str) -> tuple[list[str], str]:  # what squeue_job_nodes reads from Slurm
        return (running[job], "") if job in running else ([], f"grow job {job} runs on no node now (PENDING)")

    policy = EngineHostPolicy(_job_dir(tmp_path), own_addresses=lambda: {"10.255.255.1"},
                              grow_job_nodes=grow_job_nodes, node_addresses=resolve_host)
    connected: list[str] = []

    def connect(engine_id: str, url: str, job: str | None) -> Client:  # where the token would be sent
        connected.append(url)
        return Client(engine_id, ScriptedEngine(tokenizer, ["g"]), url)

    router = EngineRouter([Client("engine-0", ScriptedEngine(tokenizer, ["0"]))], tokenizer, tokenizer.eos_token_id)
    scaler = ElasticScaler(router, connect=connect, check_hosts=policy.check)
    chosen = f"http://{route_address}:{listener.getsockname()[1]}"  # a host a REST token holder picked
    with RestServer(make_rest_app(scaler, TOKEN), "127.0.0.1") as server, RestClient(server.url, TOKEN) as rest:
        refusals: dict[str, Any] = {}
        for job in (None, OTHER_MAINS_GROW, PENDING_GROW, "9999"):
            body = {"engine_urls": [chosen], **({"job": job} if job else {})}
            status, reply = rest.post("/rollout/scale_out", body)
            assert status == 400, reply
            refusals[str(job)] = reply["error"]
        for error in refusals.values():
            assert error.startswith(f"scale_out refused {chosen}") and "engine token" in error
            assert "its own nodes" in error and "grow_jobs.json" in error and "relax-hpc grow" in error
        assert 'no "job" was given' in refusals["None"]
        assert f"job {OTHER_MAINS_GROW} is not one of this job's grow jobs" in refusals[OTHER_MAINS_GROW]
        assert f"grow job {PENDING_GROW} runs on no node now (PENDING)" in refusals[PENDING_GROW]
        assert "job 9999 is not one of this job's grow jobs" in refusals["9999"]
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing connected to the chosen host: no token went there
        assert connected == [] and rest.get("/rollout/operations") == (200, {"operations": []})

        # The same host as the running grow job's node, with its id, is accepted; so is loopback.
        grow_url = f"http://{route_address}:30001"
        status, reply = rest.post("/rollout/scale_out", {"engine_urls": [grow_url], "job": GROW})
        assert status == 202, reply
        assert policy.check(["http://127.0.0.1:30002"], None) is None
        assert policy.check(["http://10.255.255.1:30003"], None) is None  # one of the job's own nodes
    assert grow_url in connected


def test_a_url_whose_host_does_not_resolve_is_refused(tmp_path: Path) -> None:
    policy = EngineHostPolicy(_job_dir(tmp_path), own_addresses=set, grow_job_nodes=lambda job: ([], "unused"))
    problem = policy.check(["http://no-such-host.invalid:1"], GROW)
    assert problem is not None and "its host does not resolve" in problem


@pytest.mark.parametrize("nodes,names", [
    ("n1", ["n1"]), ("n[01-03,7],gpu5", ["n01", "n02", "n03", "n7", "gpu5"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]), ("", []),
])
def test_slurm_node_lists_expand(nodes: str, names: list[str]) -> None:
    assert expand_hostlist(nodes) == names


def test_a_node_list_too_long_to_be_a_cluster_is_refused() -> None:
    with pytest.raises(ValueError, match="more than"):
        expand_hostlist("n[0-99999999]")


def _stand_in_squeue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, out: str, err: str = "", rc: int = 0) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "squeue"
    script.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'args'}\nprintf '{out}'\nprintf '{err}' >&2\nexit {rc}\n")
    script.chmod(0o700)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_squeue_job_nodes_reads_the_running_components_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _stand_in_squeue(tmp_path, monkeypatch, "RUNNING n[1-2]\\nPENDING \\n")
    assert squeue_job_nodes("4243") == (["n1", "n2"], "")
    assert (tmp_path / "args").read_text().split() == ["-h", "-j", "4243", "-o", "%T", "%N"]


@pytest.mark.parametrize(("out", "err", "rc", "why"), [
    ("PENDING \\n", "", 0, "grow job 7 runs on no node now (PENDING)"),
    ("", "slurm_load_jobs error: Invalid job id specified", 1, "grow job 7 runs on no node now (not in the queue)"),
    ("", "slurm_load_jobs error: Unable to contact slurm controller", 1,
     "squeue could not say where grow job 7 runs (slurm_load_jobs error: Unable to contact slurm controller); retry"),
])
def test_squeue_job_nodes_says_why_there_is_no_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   out: str, err: str, rc: int, why: str) -> None:
    _stand_in_squeue(tmp_path, monkeypatch, out, err, rc)
    assert squeue_job_nodes("7") == ([], why)
