"""ElasticScaler and the router's elastic side: engines join with the current weights, leave
after draining, a failed join rolls back, one operation at a time, nothing answered twice."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.elastic.scaler import ElasticScaler
from relax_hpc.engines.memory import ScriptedEngine
from relax_hpc.engines.router import EngineRouter, LocalEngineClient
from relax_hpc.models.hf import load_tokenizer

PARAMS = SamplingParams(max_new_tokens=4)
WEIGHTS = [("w", torch.ones(2))]


class WeightedClient(LocalEngineClient):
    """A local client that hands over its weights and records what it loaded; `address` like a
    remote engine's."""

    def __init__(self, id: str, engine: ScriptedEngine, address: str = "", fail_load: bool = False) -> None:
        super().__init__(id, engine)
        self.address, self.fail_load = address, fail_load
        self.loaded: list[int] = []
        self.closed = False

    def current_weights(self) -> list[tuple[str, torch.Tensor]]:
        return list(WEIGHTS)

    def load_weights(self, shared: Any, version: int) -> concurrent.futures.Future:
        if self.fail_load:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_exception(RuntimeError(f"{self.address} refused the weights: out of memory"))
            return future
        self.loaded.append(version)
        return super().load_weights(shared, version)

    def close(self) -> None:
        self.closed = True
        super().close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def _router(tokenizer: Any, n: int = 1) -> EngineRouter:
    clients = [WeightedClient(f"engine-{k}", ScriptedEngine(tokenizer, [str(k)])) for k in range(n)]
    # Two pieces per engine: a drained engine's piece has others to go to while the rest run.
    return EngineRouter(clients, tokenizer, tokenizer.eos_token_id, chunks_per_engine=2)


def _remote(tokenizer: Any, made: dict[str, WeightedClient], fail: set[str] = frozenset(),  # type: ignore[assignment]
            gate: threading.Event | None = None) -> Any:
    def connect(engine_id: str, url: str, job: str | None) -> WeightedClient:
        if gate is not None:
            assert gate.wait(30)
        client = WeightedClient(engine_id, ScriptedEngine(tokenizer, [url[-1]]), url, fail_load=url in fail)
        made[url] = client
        return client
    return connect


def _settle(scaler: ElasticScaler, op: dict[str, Any]) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        reply = scaler.elastic("operation", {"id": op["id"]})
        assert reply.status == 200
        if reply.body["operation"]["state"] not in ("pending", "running"):
            return reply.body["operation"]
        assert time.monotonic() < deadline, reply.body
        time.sleep(0.02)


def _states(scaler: ElasticScaler) -> dict[str, str]:
    return {e["id"]: e["state"] for e in scaler.elastic("engines", {}).body["engines"]}


def test_external_engines_join_with_the_current_weights_then_serve(tokenizer: Any) -> None:
    router = _router(tokenizer)
    router.update_weights(WEIGHTS, 3)
    made: dict[str, WeightedClient] = {}
    scaler = ElasticScaler(router, connect=_remote(tokenizer, made))
    reply = scaler.elastic("scale_out", {"engine_urls": ["http://n3:1", "http://n3:2"], "job": "77"})
    assert reply.status == 202 and reply.body["operation"]["kind"] == "scale_out"
    op = _settle(scaler, reply.body["operation"])
    assert op["state"] == "done" and op["engines"] == ["engine-1", "engine-2"], op
    assert [c.loaded for c in made.values()] == [[3], [3]]  # the version the job's engine runs
    engines = scaler.elastic("engines", {}).body["engines"]
    assert [(e["id"], e["state"], e["job"], e["protected"], e["weight_version"]) for e in engines] == [
        ("engine-0", "active", None, True, 3), ("engine-1", "active", "77", False, 3),
        ("engine-2", "active", "77", False, 3)]
    assert router.serving_by_job() == {"main": 1, "77": 2}

    gens = router.generate([[100 + g] for g in range(6) for _ in range(2)], PARAMS, seed=1, group_size=2)
    assert len(gens) == 12 and {g.text for g in gens} == {"0", "1", "2"}  # all three served
    router.update_weights(WEIGHTS, 4)  # later versions reach the joined engines too
    assert [c.loaded for c in made.values()] == [[3, 4], [3, 4]]

    again = _settle(scaler, scaler.elastic("scale_out", {"engine_urls": ["http://n3:1/"], "job": "77"}).body["operation"])
    assert again["state"] == "done" and "already serve" in again["message"] and len(router.engines) == 3


def test_an_engine_at_the_current_version_is_not_sent_the_weights_again(tokenizer: Any) -> None:
    router = _router(tokenizer)  # version 0: the joining engine loaded the same model
    made: dict[str, WeightedClient] = {}
    scaler = ElasticScaler(router, connect=_remote(tokenizer, made))
    op = _settle(scaler, scaler.elastic("scale_out", {"engine_urls": ["http://n3:1"]}).body["operation"])
    assert op["state"] == "done" and made["http://n3:1"].loaded == []


def test_a_failed_join_rolls_the_whole_operation_back_and_says_why(tokenizer: Any) -> None:
    router = _router(tokenizer)
    router.update_weights(WEIGHTS, 2)
    made: dict[str, WeightedClient] = {}
    scaler = ElasticScaler(router, connect=_remote(tokenizer, made, fail={"http://n4:2"}))
    op = _settle(scaler, scaler.elastic("scale_out", {"engine_urls": ["http://n4:1", "http://n4:2"]}).body["operation"])
    assert op["state"] == "rolled_back", op
    assert "http://n4:2 refused the weights: out of memory" in op["message"] and "removed again" in op["message"]
    assert _states(scaler) == {"engine-0": "active", "engine-1": "gone", "engine-2": "failed"}
    assert made["http://n4:1"].closed and made["http://n4:2"].closed
    assert router.serving() == 1
    gens = router.generate([[5], [6]], PARAMS, seed=0)
    assert {g.text for g in gens} == {"0"}  # only the job's own engine serves


def test_a_second_operation_while_one_runs_gets_409_with_the_running_one(tokenizer: Any) -> None:
    router = _router(tokenizer)
    gate = threading.Event()
    scaler = ElasticScaler(router, connect=_remote(tokenizer, {}, gate=gate))
    first = scaler.elastic("scale_out", {"engine_urls": ["http://n5:1"]}).body["operation"]
    deadline = time.monotonic() + 10
    while _states(scaler).get("engine-1") != "pending":  # shown while it connects
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert scaler.elastic("engines", {}).body["operation"]["id"] == first["id"]
    clash = scaler.elastic("scale_in", {"num_engines": 1})
    assert clash.status == 409 and clash.body["operation"]["id"] == first["id"]
    assert "in progress" in clash.body["error"]
    gate.set()
    assert _settle(scaler, first)["state"] == "done"
    assert scaler.elastic("engines", {}).body["operation"] is None


def test_scale_in_drains_an_engine_whose_answer_is_kept(tokenizer: Any) -> None:
    router = _router(tokenizer)
    made: dict[str, WeightedClient] = {}
    scaler = ElasticScaler(router, connect=_remote(tokenizer, made))
    _settle(scaler, scaler.elastic("scale_out", {"engine_urls": ["http://n6:1"], "job": "9"}).body["operation"])
    joined = made["http://n6:1"].engine
    started, release = threading.Event(), threading.Event()
    plain = joined.generate

    def held(prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> Any:
        started.set()
        assert release.wait(30)
        return plain(prompts, params, seed)

    joined.generate = held  # type: ignore[method-assign]
    prompts = [[100 + g] for g in range(4) for _ in range(2)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(router.generate, prompts, PARAMS, 0, 2)
        assert started.wait(30)
        op = scaler.elastic("scale_in", {"job": "9", "timeout_s": 30}).body["operation"]
        deadline = time.monotonic() + 10
        while _states(scaler)["engine-1"] != "draining":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        release.set()
        gens = call.result(30)
    assert _settle(scaler, op)["state"] == "done"
    assert [g.prompt_ids for g in gens] == prompts
    assert len(joined.produced) == len(joined.calls[0][0])  # its chunk was answered once, by it
    assert sum(e.samples for e in router.engines) == len(prompts)
    assert _states(scaler) == {"engine-0": "active", "engine-1": "gone"} and made["http://n6:1"].closed


def test_a_drain_that_runs_out_of_time_reissues_the_chunk_once(tokenizer: Any) -> None:
    router = _router(tokenizer)
    made: dict[str, WeightedClient] = {}
    scaler = ElasticScaler(router, connect=_remote(tokenizer, made))
    _settle(scaler, scaler.elastic("scale_out", {"engine_urls": ["http://n7:1"]}).body["operation"])
    stuck = made["http://n7:1"].engine
    started, release = threading.Event(), threading.Event()
    plain = stuck.generate

    def hung(prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> Any:
        started.set()
        release.wait(30)
        return plain(prompts, params, seed)

    stuck.generate = hung  # type: ignore[method-assign]
    prompts = [[100 + g] for g in range(4) for _ in range(2)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        call = pool.submit(router.generate, prompts, PARAMS, 0, 2)
        assert started.wait(30)
        op = scaler.elastic("scale_in", {"engine_urls": ["http://n7:1"], "timeout_s": 0.2}).body["operation"]
        gens = call.result(30)
    done = _settle(scaler, op)
    release.set()
    assert done["state"] == "done" and "did not finish" in done["message"]
    assert [g.prompt_ids for g in gens] == prompts and {g.text for g in gens} == {"0"}  # all from the survivor
    assert router.engines[1].samples == 0  # the late answer was never used


def test_protected_engines_need_force_and_the_last_one_stays(tokenizer: Any) -> None:
    router = _router(tokenizer, 2)
    scaler = ElasticScaler(router)
    refused = scaler.elastic("scale_in", {"engine_ids": ["engine-1"]})
    assert refused.status == 400 and "protected" in refused.body["error"] and '"force": true' in refused.body["error"]
    assert scaler.elastic("scale_in", {"num_engines": 1}).body["operation"]["state"] in ("pending", "running", "done")
    deadline = time.monotonic() + 10
    while scaler.elastic("engines", {}).body["operation"] is not None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert scaler.elastic("operations", {}).body["operations"][-1]["message"] == "no engine matched; nothing removed"
    forced = _settle(scaler, scaler.elastic("scale_in", {"engine_ids": ["engine-1"], "force": True}).body["operation"])
    assert forced["state"] == "done" and _states(scaler) == {"engine-0": "active", "engine-1": "gone"}
    last = scaler.elastic("scale_in", {"engine_ids": ["engine-0"], "force": True})
    assert last.status == 400 and "would leave none" in last.body["error"]


@pytest.mark.parametrize("action, body, expected", [
    ("scale_out", {}, "exactly one of"),
    ("scale_out", {"num_engines": 1, "engine_urls": ["http://a:1"]}, "exactly one of"),
    ("scale_out", {"engine_urls": "http://a:1"}, "non-empty list"),
    ("scale_out", {"engine_urls": ["a:1"]}, "must start with http://"),
    ("scale_out", {"engine_urls": ["http://a:1"], "timeout_s": -1}, '"timeout_s" must be'),
    ("scale_out", {"num_engines": 2}, "cannot start engines"),
    ("scale_out", {"engine_urls": ["http://a:1"], "replicas": 2}, "does not take ['replicas']"),
    ("scale_in", {"num_engines": 0}, "whole number >= 1"),
    ("scale_in", {"engine_ids": ["engine-9"]}, "no engine has id ['engine-9']"),
    ("scale_in", {"num_engines": 1, "job": "3"}, "exactly one of"),
    ("scale_in", {"job": "3", "force": "yes"}, '"force" must be true or false'),
])
def test_bad_bodies_get_400_naming_the_key(tokenizer: Any, action: str, body: dict[str, Any], expected: str) -> None:
    scaler = ElasticScaler(_router(tokenizer), connect=_remote(tokenizer, {}))
    reply = scaler.elastic(action, body)
    assert reply.status == 400 and expected in reply.body["error"], reply.body


def test_unknown_operation_and_action(tokenizer: Any) -> None:
    scaler = ElasticScaler(_router(tokenizer))
    assert scaler.elastic("operation", {"id": "op-42"}).status == 404
    assert scaler.elastic("reboot", {}).status == 404


def test_engines_started_in_the_job_join_through_spawn(tokenizer: Any) -> None:
    router = _router(tokenizer)
    router.update_weights(WEIGHTS, 5)
    spawned: list[WeightedClient] = []

    def spawn(ids: list[str]) -> list[WeightedClient]:
        spawned.extend(WeightedClient(i, ScriptedEngine(tokenizer, ["s"])) for i in ids)
        return spawned[-len(ids):]

    scaler = ElasticScaler(router, spawn=spawn)
    op = _settle(scaler, scaler.elastic("scale_out", {"num_engines": 2}).body["operation"])
    assert op["state"] == "done" and [c.loaded for c in spawned] == [[5], [5]]
    assert router.serving_by_job() == {"main": 3}


def test_the_rest_api_over_a_real_scaler_409_rollback_and_states(tokenizer: Any) -> None:
    """The driver's REST server in front of a real scaler: what an operator sees over HTTP."""
    from relax_hpc.engines.elastic.rest_api import RestClient, RestServer, make_rest_app

    router = _router(tokenizer)
    router.update_weights(WEIGHTS, 1)
    gate = threading.Event()
    made: dict[str, WeightedClient] = {}
    scaler = ElasticScaler(router, connect=_remote(tokenizer, made, fail={"http://n9:2"}, gate=gate))
    token = "t" * 64
    with RestServer(make_rest_app(scaler, token), "127.0.0.1") as server:
        rest = RestClient(server.url, token)
        assert RestClient(server.url, "u" * 64).get("/rollout/engines")[0] == 401
        status, body = rest.post("/rollout/scale_out", {"engine_urls": ["http://n9:1", "http://n9:2"], "job": "5"})
        assert status == 202
        op_id = body["operation"]["id"]
        seen = {e["state"] for e in rest.get("/rollout/engines")[1]["engines"]}
        assert "pending" in seen  # held at connect by the gate
        clash, refused = rest.post("/rollout/scale_in", {"num_engines": 1})
        assert clash == 409 and refused["operation"]["id"] == op_id
        gate.set()
        deadline = time.monotonic() + 30
        while (op := rest.get(f"/rollout/operations/{op_id}")[1]["operation"])["state"] in ("pending", "running"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert op["state"] == "rolled_back" and "http://n9:2" in op["message"]
        states = {e["address"]: e["state"] for e in rest.get("/rollout/engines")[1]["engines"]}
        assert states == {"in-job": "active", "http://n9:1": "gone", "http://n9:2": "failed"}
        assert rest.get("/rollout/operations/op-99")[0] == 404
        assert rest.post("/rollout/scale_in", {"engine_ids": ["engine-0"]})[0] == 400  # protected, and the last


def _state(pid: int) -> str:
    """The process state letter of /proc/PID/stat ("T": stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def _wait_stopped(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _state(pid) != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop within {timeout_s} s of SIGSTOP"
        time.sleep(0.01)


def test_a_hung_remote_engine_is_given_up_after_its_timeout(tokenizer: Any, tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    """A SIGSTOPped server (a node that vanished without closing its connections): the step goes
    on with the others once the client's timeout passes, and every prompt is answered once."""
    import os
    import signal
    import subprocess
    import sys

    from relax_hpc.auth import JobSecret, write_job_secret
    from relax_hpc.engines.elastic.remote import RemoteEngineClient

    job_dir = tmp_path / "job"
    job_dir.mkdir(mode=0o700)
    secret = write_job_secret(job_dir, JobSecret.generate())
    weights = tmp_path / "weights"
    weights.mkdir()
    env = {**os.environ, "RELAX_HPC_SECRET_FILE": str(secret), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "relax_hpc.cli.main", "serve-engine", str(tiny_model_dir),
                             "--port", "0", "--weights-root", str(weights)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        token = JobSecret.load(secret).token("engine-http")
        router = _router(tokenizer)
        k = router.add_engine(RemoteEngineClient("engine-1", url, token, weights, timeout_s=3.0), job="7")
        router.join(k)
        prompts = [[5 + g] for g in range(4) for _ in range(2)]  # ids the tiny model has
        assert len(router.generate(prompts, PARAMS, seed=0, group_size=2)) == 8  # it serves
        assert router.engines[1].samples > 0
        proc.send_signal(signal.SIGSTOP)
        _wait_stopped(proc.pid)  # kill() only queues the signal
        gens = router.generate(prompts, PARAMS, seed=1, group_size=2)
        assert _state(proc.pid) == "T", "something continued the stopped server during the call"
        assert [g.prompt_ids for g in gens] == prompts and {g.text for g in gens} == {"0"}
        assert router.engines[1].state == "failed" and router.serving() == 1
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


# -- bounds on every number of a body (issue 33, item 6), through the real REST API ----------------

BAD_NUMBERS = [
    # (action, raw JSON body, the field the 400 must name, the allowed range it must state)
    ("scale_out", b'{"engine_urls": ["http://n1:1"], "timeout_s": Infinity}', '"timeout_s"', "at most 1e+06"),
    ("scale_out", b'{"engine_urls": ["http://n1:1"], "timeout_s": 1e300}', '"timeout_s"', "at most 1e+06"),
    ("scale_out", b'{"engine_urls": ["http://n1:1"], "timeout_s": NaN}', '"timeout_s"', "at most 1e+06"),
    ("scale_out", b'{"engine_urls": ["http://n1:1"], "timeout_s": -5}', '"timeout_s"', "> 0"),
    ("scale_out", b'{"num_engines": 1000000000}', '"num_engines"', "at most 1022"),  # 1024 less the 2 serving
    ("scale_out", b'{"num_engines": -3}', '"num_engines"', ">= 1"),
    ("scale_in", b'{"num_engines": 1, "timeout_s": Infinity}', '"timeout_s"', "at most 1e+06"),
    ("scale_in", b'{"num_engines": 1, "timeout_s": 1e300}', '"timeout_s"', "at most 1e+06"),
    ("scale_in", b'{"num_engines": 1000000000}', '"num_engines"', "at most 1024"),
    ("scale_in", b'{"job": 1e300}', '"job"', "1 to 64"),
]


def test_unbounded_numbers_get_400_naming_the_field_and_range_and_operations_still_list(tokenizer: Any) -> None:
    """Infinity, 1e300, NaN, negatives and 10**9 are refused before an operation exists; at
    181f8fe Infinity made an operation whose JSON broke GET /rollout/operations (500)."""
    import httpx

    from relax_hpc.engines.elastic.rest_api import RestServer, make_rest_app

    spawned: list[list[str]] = []
    scaler = ElasticScaler(_router(tokenizer, 2), connect=_remote(tokenizer, {}),
                           spawn=lambda ids: spawned.append(ids) or [])  # type: ignore[func-returns-value]
    token = "t" * 64
    auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    with RestServer(make_rest_app(scaler, token), "127.0.0.1") as server, \
            httpx.Client(base_url=server.url, timeout=10, trust_env=False) as http:
        for action, raw, field_name, allowed in BAD_NUMBERS:
            reply = http.post(f"/rollout/{action}", headers=auth, content=raw)
            error = reply.json().get("error", "")
            assert reply.status_code == 400 and field_name in error and allowed in error, (raw, reply.text)
        listed = http.get("/rollout/operations", headers=auth)
        assert (listed.status_code, listed.json()) == (200, {"operations": []})
    assert spawned == []  # no billion ids were made


def test_a_drain_past_what_a_thread_can_wait_still_retires_the_engine(tokenizer: Any) -> None:
    """`drain(k, 1e300)` on a busy engine: at 181f8fe the wait raised OverflowError and the engine
    stayed "draining" for good; now the wait is capped, the chunk finishes, the engine is gone."""
    router = _router(tokenizer, 2)
    held = router.engines[1].client.engine  # type: ignore[attr-defined]
    started, release = threading.Event(), threading.Event()
    plain = held.generate

    def slow(prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> Any:
        started.set()
        assert release.wait(30)
        return plain(prompts, params, seed)

    held.generate = slow
    prompts = [[100 + g] for g in range(4) for _ in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        call = pool.submit(router.generate, prompts, PARAMS, 0, 2)
        assert started.wait(30)
        drained = pool.submit(router.drain, 1, 1e300)
        deadline = time.monotonic() + 10
        while router.engines[1].state != "draining" and not drained.done():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        release.set()
        assert drained.result(30) is True  # it finished its chunk
        assert [g.prompt_ids for g in call.result(30)] == prompts
    assert router.engines[1].state == "gone" and router.engines[1].closed


def test_a_drain_that_raises_retires_the_engine_and_the_operation_says_so(tokenizer: Any) -> None:
    router = _router(tokenizer, 2)
    scaler = ElasticScaler(router)

    def broken(*args: Any, **kwargs: Any) -> bool:
        raise RuntimeError("the wait broke")

    router._changed.wait_for = broken  # type: ignore[method-assign]  # inside the real drain
    op = _settle(scaler, scaler.elastic("scale_in", {"engine_ids": ["engine-1"], "force": True}).body["operation"])
    assert op["state"] == "failed" and "engine-1 (RuntimeError: the wait broke)" in op["message"], op
    assert "retired at once" in op["message"]
    assert _states(scaler) == {"engine-0": "active", "engine-1": "gone"}  # not left "draining"
    assert router.engines[1].closed


# -- a joining engine's version number is not trusted across attempts (issue 33, item 15) ----------

def test_an_engine_reporting_the_jobs_version_number_is_still_sent_the_weights(tokenizer: Any) -> None:
    """A grow engine that outlived a requeue reports version 3; the resumed job runs its own
    version 3 (other weights): the engine is sent them. At 181f8fe the load was skipped."""
    router = _router(tokenizer)
    router.update_weights(WEIGHTS, 3)
    stale = WeightedClient("engine-1", ScriptedEngine(tokenizer, ["s"], version=3), "http://n8:1")
    k = router.add_engine(stale, job="88")
    router.join(k)
    assert stale.loaded == [3] and router.engines[k].state == "active"
