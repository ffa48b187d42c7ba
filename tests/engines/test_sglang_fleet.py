"""The SGLang servers of `engine = "sglang"` (relax_hpc/engines/sglang/fleet.py and the process
handling of sglang/server.py): started, authenticated, fed weights over a gloo group, restarted
on death with every prompt answered once, and never left running; and one of them through
`SGLangEngine` (relax_hpc/engines/sglang/engine.py) and over plain HTTP: /generate with input_ids gives
HF's greedy tokens and log-probs, pause holds requests, and weight updates from disk and a
broadcast over gloo from this process (torch 2.13, the trainer's side) into the server (torch
2.14.1) land.

The first tests need no SGLang: process handling runs against fake_sglang_server.py. The ones
marked `sglang` start two real SGLang 0.5.23 servers for the module (about a minute on 2 cores,
and one restart of about as long), from the environment of tools/setup-sglang-cpu; the
one-server tests read the weights the servers started with, so they come before the fleet's:

    RELAX_TEST_SGLANG=1 .venv/bin/python -m pytest tests/engines/test_sglang_fleet.py -q
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import hf_greedy
from side_env import SGLANG

from relax_hpc.engines.base import Generation, SamplingParams
from relax_hpc.engines.http.client import EngineHttpError
from relax_hpc.engines.router import EngineRouter, LocalEngineClient
from relax_hpc.engines.sglang.engine import SGLangEngine
from relax_hpc.engines.sglang.fleet import (
    ManagedSGLangEngine,
    SGLangLaunch,
    start_sglang_engines,
    tied_names,
)
from relax_hpc.engines.sglang.server import SGLangServer, SGLangServerError
from relax_hpc.engines.sglang.weights import DistributedWeightPush, TensorWeightPush, buckets
from relax_hpc.models.hf import load_causal_lm, load_tokenizer
from relax_hpc.ops.ports import (
    ENGINES_PER_NODE,
    engine_ports,
    port_slot_from_env,
    ray_ports,
)
from relax_hpc.spec.schema import AlgorithmSpec, JobInfoSpec, ModelSpec, RolloutSpec, SGLangSpec

HERE = Path(__file__).resolve().parent
TOKEN = "t0ken-" * 8  # the servers' API key in these tests
LOGPROB_TOL = 1e-4  # float32 SGLang vs a full HF forward; observed ~5e-7


def _running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a killed child nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {timeout_s} s")
        time.sleep(0.05)


def _fake_pids(log: Path) -> tuple[int, int]:
    """The fake server's PID and its child's, from its log."""
    _wait_until(lambda: log.exists() and "scheduler pid" in log.read_text(), f"the fake server's PIDs in {log}")
    found = re.search(r"server pid (\d+) scheduler pid (\d+)", log.read_text())
    assert found is not None
    return int(found[1]), int(found[2])


# --- process handling, against a fake server ---------------------------------------------------


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """An executable that SGLangServer runs as `python -m sglang.launch_server ...`."""
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\nshift 2  # -m sglang.launch_server\nexec {shlex.quote(sys.executable)} "
                      f"{shlex.quote(str(HERE / 'fake_sglang_server.py'))} \"$@\"\n")
    script.chmod(0o755)
    return script


def test_stop_ends_the_server_and_its_children_by_pid(fake_python: Path, tmp_path: Path) -> None:
    server = SGLangServer(fake_python, tmp_path, log_path=tmp_path / "server.log").start()
    pids = _fake_pids(server.log_path)
    assert server.pid == pids[0] and all(_running(p) for p in pids)
    server.stop()
    _wait_until(lambda: not any(_running(p) for p in pids), "the server and its child stopped")


def test_a_server_does_not_outlive_its_owner_killed_with_sigkill(fake_python: Path, tmp_path: Path) -> None:
    # As when Ray kills the rollout actor: no shutdown code runs in the owner, the watcher acts.
    log = tmp_path / "server.log"
    owner_code = ("import sys, time\nfrom relax_hpc.engines.sglang.server import SGLangServer\n"
                  "SGLangServer(sys.argv[1], sys.argv[2], log_path=sys.argv[3]).start()\n"
                  "print('up', flush=True)\ntime.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", owner_code, str(fake_python), str(tmp_path), str(log)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "up"
        pids = _fake_pids(log)
        assert all(_running(p) for p in pids)
    finally:
        owner.kill()
        owner.wait()
    _wait_until(lambda: not any(_running(p) for p in pids), "the orphaned server and its child killed")


def test_a_failed_start_stops_the_servers_already_up(fake_python: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    # On "cuda" engine 1 gets --base-gpu-id 1, which the fake refuses; engine 0 starts (its start
    # is waited for before the cleanup) and must be stopped.
    launch = SGLangLaunch(interpreter=str(fake_python), model_path=str(tiny_model_dir), device="cuda",
                          log_dir=str(tmp_path / "logs"), api_key=None, update_mode="disk",
                          sglang=SGLangSpec(startup_timeout_s=60))
    with pytest.raises(SGLangServerError, match=r"exited with code 3 while starting; see its log .*sglang-engine-1\.log"):
        start_sglang_engines(launch, 2)
    pids = _fake_pids(tmp_path / "logs" / "sglang-engine-0.log")
    _wait_until(lambda: not any(_running(p) for p in pids), "engine 0 stopped after engine 1 failed")


def test_the_api_key_travels_in_an_owner_only_file_not_the_command_line(fake_python: Path, tmp_path: Path) -> None:
    server = SGLangServer(fake_python, tmp_path, log_path=tmp_path / "logs" / "e.log", api_key=TOKEN)
    assert TOKEN not in " ".join(server.command())
    server.start()
    try:
        pid, _ = _fake_pids(server.log_path)
        assert TOKEN not in Path(f"/proc/{pid}/cmdline").read_text()
        assert server.config_path.stat().st_mode & 0o777 == 0o600
        assert TOKEN in server.config_path.read_text()
        assert server.log_path.stat().st_mode & 0o777 == 0o600  # SGLang logs its arguments, the key too
    finally:
        server.stop()


# --- small pieces -------------------------------------------------------------------------------


def test_buckets_keep_order_and_cut_by_bytes() -> None:
    named = [(str(i), torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([2, 2, 3, 10, 1])]
    # 4 bytes per element, 16-byte buckets: [2+2], [3], [10] alone (over the limit), [1]
    assert [[n for n, _ in b] for b in buckets(named, 16)] == [["0", "1"], ["2"], ["3"], ["4"]]
    assert [[n for n, _ in b] for b in buckets(named, 1 << 20)] == [["0", "1", "2", "3", "4"]]


def test_engine_ports_come_from_the_rollout_nodes_block_apart_from_rays() -> None:
    ports = [engine_ports(4242, 3, i) for i in range(ENGINES_PER_NODE)]
    flat = [p for e in ports for p in (e.http, e.update_group)]
    assert len(set(flat)) == len(flat)
    ray = ray_ports(4242, 3)
    assert not set(flat) & set(ray.all_ports())
    assert ray.gcs < min(flat) and max(flat) < ray.gcs + 64
    with pytest.raises(ValueError, match="spread \\[rollout\\] num_engines over more rollout nodes"):
        engine_ports(4242, 3, ENGINES_PER_NODE)
    assert port_slot_from_env({"RELAX_HPC_PORT_SLOT": "4242:3"}) == (4242, 3)
    assert port_slot_from_env({}) is None and port_slot_from_env({"RELAX_HPC_PORT_SLOT": "x:1"}) is None


def test_server_args_from_the_spec_keys() -> None:
    launch = SGLangLaunch(interpreter="p", model_path="m", device="cuda", log_dir="l", api_key=None,
                          sglang=SGLangSpec(tp_size=2, mem_fraction_static=0.5, context_length=128, extra_args=["--foo=1"]))
    assert launch.server_args(1) == ("--tp-size", "2", "--base-gpu-id", "2", "--mem-fraction-static", "0.5",
                                     "--context-length", "128", "--foo=1")
    cpu = SGLangLaunch(interpreter="p", model_path="m", device="cpu", log_dir="l", api_key=None, sglang=SGLangSpec())
    assert cpu.server_args(1) == ("--tp-size", "1")


def test_the_tied_lm_head_is_not_sent(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert tied_names(str(tiny_model_dir)) == frozenset({"lm_head.weight"})
    assert tied_names(str(tmp_path)) == frozenset()


def test_an_unusable_sglang_python_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from relax_hpc.engines.factory import require_sglang_python

    with pytest.raises(ValueError, match=r"is not an executable file.*tools/setup-sglang-cpu"):
        require_sglang_python(str(tmp_path / "no-python"))
    require_sglang_python(sys.executable)  # an interpreter: whether it has SGLang shows at start


def test_rollout_turns_the_spec_into_a_launch(tmp_path: Path) -> None:
    from relax_hpc.driver.run import sglang_spec_resolved
    from relax_hpc.engines.fleet import sglang_launch
    from relax_hpc.roles.rollout import RolloutConfig

    def config(**sglang: Any) -> RolloutConfig:
        return RolloutConfig(model=ModelSpec(path="m"), data=None, reward=None,  # type: ignore[arg-type]
                             rollout=RolloutSpec(engine="sglang"), algorithm=AlgorithmSpec(),
                             job=JobInfoSpec(name="launch"), sglang_spec=SGLangSpec(**sglang), job_dir=str(tmp_path))

    launch = sglang_launch(config(python="/x/python", extra_args=["--a"], max_restarts=1))
    assert (launch.interpreter, launch.update_mode, launch.extra_args, launch.sglang.max_restarts) == (
        "/x/python", "distributed", ("--a",), 1)
    assert launch.log_dir == str(tmp_path / "logs") and launch.api_key  # the job's engine token
    assert sglang_launch(config()).interpreter == sys.executable
    assert sglang_launch(config(weight_update="disk")).update_mode == "disk"
    # "auto" is "tensor" where engines and trainer share the devices (colocate), else "distributed".
    colocated = dataclasses.replace(config(), release_between_steps=True)
    assert sglang_launch(colocated).update_mode == "tensor"
    assert sglang_launch(dataclasses.replace(colocated, sglang_spec=SGLangSpec(weight_update="distributed"))
                         ).update_mode == "distributed"
    resolved = sglang_spec_resolved(SGLangSpec(python=".venv-sglang/bin/python")).python
    assert resolved == str(Path.cwd() / ".venv-sglang/bin/python")


# --- two real SGLang servers ----------------------------------------------------------------------

GREEDY = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=1)


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ManagedSGLangEngine]]:
    launch = SGLangLaunch(interpreter=str(SGLANG.python_or_skip()), model_path=str(tiny_model_dir), device="cpu",
                          log_dir=str(tmp_path_factory.mktemp("sglang-fleet")), api_key=TOKEN,
                          sglang=SGLangSpec(startup_timeout_s=400, max_restarts=1), request_timeout_s=300)
    engines = start_sglang_engines(launch, 2)
    try:
        yield engines
    finally:
        pids = [e.server.pid for e in engines]
        for engine in engines:
            engine.close()
        assert not any(_running(p) for p in pids if p is not None)


@pytest.fixture(scope="module")
def new_model(tiny_model_dir: Path) -> torch.nn.Module:
    """The tiny model with every weight changed: what the servers must run after an update."""
    model = load_causal_lm(tiny_model_dir).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(tiny_model_dir)
    return [tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"] for a in range(4) for b in range(4)]


# The one-server tests' plain-HTTP requests (no SGLangEngine).
RAW_PROMPT_TEXTS = ("7", "1+2=", "<|im_start|>user:5+4=<|im_end|><|im_start|>assistant:")
RAW_NEW_TOKENS = 8
# float32 SGLang (torch_native attention, KV cache) vs a full HF forward; observed 2.4e-7.
RAW_LOGPROB_TOL = 1e-5


# --- one of the fleet's servers, through SGLangEngine and over plain HTTP -------------------------
# These come first: they read the weights the servers started with, then change them on fleet[0]
# (versions 1 and 2 from disk, 3 over gloo); the fleet's own tests install theirs afterwards.


@pytest.fixture(scope="module")
def server(fleet: list[ManagedSGLangEngine]) -> SGLangServer:
    """The fleet's first server, for the tests of one server: SGLangEngine and plain HTTP."""
    return fleet[0].server


@pytest.fixture(scope="module")
def client(server: SGLangServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> SGLangEngine:
    return SGLangEngine(server.url, tiny_model_dir, timeout_s=120, api_key=TOKEN,
                        weights_dir=tmp_path_factory.mktemp("sglang-weights"))


@pytest.fixture(scope="module")
def client_prompts(tiny_model_dir: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(tiny_model_dir)
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("7", "1+2=", "hello world")]


def _assert_generations_match_hf(engine: SGLangEngine, model: torch.nn.Module, prompts: list[list[int]]) -> list:
    generations = engine.generate(prompts, GREEDY, seed=0)
    for prompt, g in zip(prompts, generations):
        tokens, logprobs = hf_greedy(model, prompt, GREEDY.max_new_tokens, engine.eos_id)
        assert g.prompt_ids == prompt
        assert g.token_ids == tokens
        assert g.logprobs == pytest.approx(logprobs, abs=LOGPROB_TOL)
        assert g.finish_reason == ("stop" if tokens[-1] == engine.eos_id else "length")
    return generations


@pytest.mark.slow
@pytest.mark.sglang
def test_greedy_generation_equals_hf(client: SGLangEngine, tiny_model_dir: Path, client_prompts: list[list[int]]) -> None:
    assert client.server_version == "0.5.23" and client.weight_version == 0
    generations = _assert_generations_match_hf(client, load_causal_lm(tiny_model_dir).eval(), client_prompts)
    assert all(g.weight_version == 0 for g in generations)
    assert generations[0].text == client.tokenizer.decode(generations[0].token_ids, skip_special_tokens=False)


@pytest.mark.slow
@pytest.mark.sglang
def test_pause_holds_generate_until_resume(client: SGLangEngine, client_prompts: list[list[int]]) -> None:
    client.pause()
    results: list = []
    caller = threading.Thread(target=lambda: results.append(client.generate(client_prompts[:1], GREEDY)), daemon=True)
    try:
        caller.start()
        time.sleep(1.5)
        assert caller.is_alive() and not results
    finally:
        client.resume()
    caller.join(timeout=120)
    assert len(results) == 1 and len(results[0][0].token_ids) > 0


@pytest.mark.slow
@pytest.mark.sglang
def test_a_server_of_another_sglang_version_is_refused(server: SGLangServer, tiny_model_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SGLangEngine, "_server_info", lambda self: {"version": "0.4.9"})
    with pytest.raises(EngineHttpError, match=r"runs SGLang 0\.4\.9; SGLangEngine supports SGLang 0\.5\.23") as error:
        SGLangEngine(server.url, tiny_model_dir, api_key=TOKEN)
    assert server.url in str(error.value)


# --- the raw server: plain HTTP, no SGLangEngine ------------------------------------------------


def _request(url: str, body: dict[str, Any] | None = None, timeout: float = 60,
             token: str | None = TOKEN) -> tuple[int, Any]:
    """POST `body` (GET without one) with the bearer `token` (None: no Authorization header)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@pytest.fixture(scope="module")
def server_url(server: SGLangServer) -> str:
    return server.url


@pytest.fixture(scope="module")
def raw_prompts(tiny_model_dir: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(tiny_model_dir)
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in RAW_PROMPT_TEXTS]


def _generate(url: str, prompts: list[list[int]], temperature: float) -> list[dict[str, Any]]:
    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": {"temperature": temperature, "max_new_tokens": RAW_NEW_TOKENS, "ignore_eos": True}}
    status, replies = _request(url + "/generate", body)
    assert status == 200, replies
    assert len(replies) == len(prompts)
    return replies


def _tokens_and_logprobs(reply: dict[str, Any]) -> tuple[list[int], list[float]]:
    # output_token_logprobs: [log-prob, token id, token text (None without a tokenizer)] per token
    entries = reply["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == reply["output_ids"]
    return reply["output_ids"], [e[0] for e in entries]


def _hf_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """Log-probs of `tokens` after `prompt` under the temperature-scaled distribution, one teacher-forced forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def _assert_greedy_matches(url: str, model: torch.nn.Module, prompts: list[list[int]]) -> None:
    for prompt, reply in zip(prompts, _generate(url, prompts, temperature=0.0)):
        tokens, logprobs = _tokens_and_logprobs(reply)
        hf_tokens, hf_logprobs = hf_greedy(model, prompt, RAW_NEW_TOKENS)
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=RAW_LOGPROB_TOL)


@pytest.mark.slow
@pytest.mark.sglang
def test_greedy_tokens_and_logprobs_equal_hf(server_url: str, tiny_model_dir: Path,
                                              raw_prompts: list[list[int]]) -> None:
    _assert_greedy_matches(server_url, load_causal_lm(tiny_model_dir).eval(), raw_prompts)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.slow
@pytest.mark.sglang
def test_sampled_logprobs_equal_hf_recomputation(server_url: str, tiny_model_dir: Path,
                                                  raw_prompts: list[list[int]], temperature: float) -> None:
    # The tiny model's greedy path repeats one token; sampling checks the log-probs of many
    # different tokens. SGLang's are under the temperature-scaled distribution, as the trainer's
    # (at 0.7 the unscaled ones differ by about 0.1).
    model = load_causal_lm(tiny_model_dir).eval()
    replies = _generate(server_url, raw_prompts, temperature=temperature)
    sampled = [_tokens_and_logprobs(reply) for reply in replies]
    assert len({t for tokens, _ in sampled for t in tokens}) > 3
    for prompt, (tokens, logprobs) in zip(raw_prompts, sampled):
        assert logprobs == pytest.approx(_hf_logprobs(model, prompt, tokens, temperature), abs=RAW_LOGPROB_TOL)


@pytest.mark.slow
@pytest.mark.sglang
def test_update_weights_from_disk_changes_logprobs_and_version(client: SGLangEngine, tiny_model_dir: Path,
                                                               client_prompts: list[list[int]]) -> None:
    # It changes the served weights: after every test that reads the first ones.
    model = load_causal_lm(tiny_model_dir).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # tied to the embedding in the tiny model: both change
    client.update_weights(model.state_dict().items(), version=1)
    assert client.weight_version == 1
    generations = _assert_generations_match_hf(client, model, client_prompts)
    assert all(g.weight_version == 1 for g in generations)
    assert sorted(p.name for p in client.weights_dir.iterdir()) == ["v1"]
    client.update_weights(model.state_dict().items(), version=2)
    assert sorted(p.name for p in client.weights_dir.iterdir()) == ["v2"]  # v1 deleted
    assert client.generate(client_prompts[:1], GREEDY)[0].weight_version == 2


class _Sender:
    """The `RequestSender` a weight push needs, over plain urllib (with the fleet's API key)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def post(self, path: str, body: Any) -> Any:
        status, reply = _request(self.base_url + path, body)
        assert status == 200, (path, reply)
        return reply


@pytest.mark.slow
@pytest.mark.sglang
def test_gloo_weight_update_from_this_torch_lands(server_url: str, tiny_model_dir: Path,
                                                   raw_prompts: list[list[int]]) -> None:
    # Last of the one-server tests, after the update from disk (versions 1 and 2); the fleet's
    # tests below install their own weights (version 1 again) first. This process (torch
    # 2.13, the sender's side) is rank 0 of the group, as the rollout role is
    # (relax_hpc/engines/sglang/weights.py).
    model = load_causal_lm(tiny_model_dir).eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=generator))
    # Tied embeddings: SGLang has no lm_head.weight of its own (it would log "not found" and skip it).
    push = DistributedWeightPush("127.0.0.1", 0, 2, "gloo", bucket_bytes=64 << 10,
                                 skip=frozenset({"lm_head.weight"}))
    sender = _Sender(server_url)
    try:
        # SGLang 0.5.23 refuses weight updates (400) outside begin/end_weight_update.
        sender.post("/begin_weight_update", {})
        push.push(sender, list(model.state_dict().items()), version=3)  # the group forms on first use
        sender.post("/end_weight_update", {})
    finally:
        push.close(sender)

    replies = _generate(server_url, raw_prompts[:1], temperature=0.0)
    assert replies[0]["meta_info"]["weight_version"] == "3"
    _assert_greedy_matches(server_url, model, raw_prompts)


# --- the fleet ------------------------------------------------------------------------------------


def _assert_runs(engine: ManagedSGLangEngine | SGLangEngine, model: torch.nn.Module, gens: list[Generation], version: int) -> None:
    for g in gens:
        tokens, logprobs = hf_greedy(model, g.prompt_ids, len(g.token_ids), engine.eos_id)
        assert g.token_ids == tokens and g.weight_version == version
        assert g.logprobs == pytest.approx(logprobs, abs=LOGPROB_TOL)


def _post(url: str, token: str | None) -> int:
    return _request(url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}, timeout=120, token=token)[0]


@pytest.mark.slow
@pytest.mark.sglang
def test_the_servers_answer_only_the_jobs_token(fleet: list[ManagedSGLangEngine]) -> None:
    url = fleet[0].server.url
    assert _post(url + "/generate", None) == 401
    assert _post(url + "/generate", "wrong-" * 8) == 401
    assert _post(url + "/generate", TOKEN) == 200
    assert fleet[0].server.healthy()  # /health stays open, for probes


@pytest.mark.slow
@pytest.mark.sglang
def test_a_distributed_update_reaches_every_server(fleet: list[ManagedSGLangEngine], new_model: torch.nn.Module,
                                                  prompts: list[list[int]]) -> None:
    for engine in fleet:
        engine.update_weights(new_model.state_dict().items(), version=1)
    for engine in fleet:
        assert engine.weight_version == 1
        _assert_runs(engine, new_model, engine.generate(prompts[:3], GREEDY, seed=0), version=1)


@pytest.mark.slow
@pytest.mark.sglang
def test_release_on_cpu_leaves_the_server_serving(fleet: list[ManagedSGLangEngine], new_model: torch.nn.Module,
                                                  prompts: list[list[int]]) -> None:
    # SGLang's CPU path cannot release (its scheduler would call torch.cuda.synchronize and die).
    engine = fleet[1]
    pid = engine.server.pid
    assert engine.release_memory() == 0
    engine.resume_memory()
    assert engine.server.pid == pid and engine.restarts == 0
    _assert_runs(engine, new_model, engine.generate(prompts[:2], GREEDY, seed=0), version=1)


@pytest.mark.slow
@pytest.mark.sglang
def test_a_killed_server_restarts_on_the_current_weights_and_each_prompt_is_answered_once(
        fleet: list[ManagedSGLangEngine], new_model: torch.nn.Module, prompts: list[list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Last: it restarts engine 0. Every answer a server gives is recorded, so a prompt answered
    # twice (once before the death, once after) would show.
    answered: list[tuple[int, list[int]]] = []
    for k, engine in enumerate(fleet):
        def recording(ps: list[list[int]], params: SamplingParams, seed: int | None = None,
                      k: int = k, real: Any = engine.generate) -> list[Generation]:
            gens = real(ps, params, seed)
            answered.extend((k, g.prompt_ids) for g in gens)
            return gens
        monkeypatch.setattr(engine, "generate", recording)
    victim = fleet[0]
    old_pid, log = victim.server.pid, victim.server.log_path
    seen = log.stat().st_size
    router = EngineRouter([LocalEngineClient(f"engine-{k}", e) for k, e in enumerate(fleet)],
                          victim.tokenizer, victim.eos_id, chunks_per_engine=2)
    long = SamplingParams(max_new_tokens=160, temperature=1.0, top_k=1)  # seconds of decoding per chunk
    box: dict[str, Any] = {}
    caller = threading.Thread(target=lambda: box.update(gens=router.generate(prompts, long, seed=1)), daemon=True)
    caller.start()
    # Kill it once its chunk is being generated: the scheduler has logged the chunk's prefill.
    _wait_until(lambda: "Prefill batch" in log.read_bytes()[seen:].decode(errors="replace"),
                "engine 0 starting its chunk", timeout_s=120)
    assert old_pid is not None
    os.killpg(old_pid, signal.SIGKILL)
    caller.join(timeout=600)
    assert "gens" in box, "the router's generate did not return"

    gens: list[Generation] = box["gens"]
    assert [g.prompt_ids for g in gens] == prompts
    assert sorted(p for _, p in answered) == sorted(prompts)  # each prompt answered exactly once
    assert victim.restarts == 1 and victim.server.pid != old_pid
    assert {k for k, _ in answered} == {0, 1}  # the restarted engine 0 redid its chunk
    assert all(g.weight_version == 1 for g in gens)
    redone = [g for g in gens if (0, g.prompt_ids) in answered]
    assert redone
    _assert_runs(victim, new_model, redone, version=1)  # the restarted server runs version 1
    assert [e["alive"] for e in router.report()] == [True, True]


@pytest.mark.slow
@pytest.mark.sglang
def test_a_tensor_update_through_shared_memory_lands_in_buckets(
        fleet: list[ManagedSGLangEngine], new_model: torch.nn.Module, prompts: list[list[int]]) -> None:
    # weight_update = "tensor" (the colocated default), 4 KiB buckets: many /update_weights_from_tensor calls.
    import copy

    import torch.multiprocessing

    other = copy.deepcopy(new_model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    engine = fleet[1]
    strategy = torch.multiprocessing.get_sharing_strategy()
    push = TensorWeightPush(1, 4096, tied_names(engine.launch.model_path))
    client = SGLangEngine(engine.server.url, engine.launch.model_path, api_key=TOKEN, weight_push=push)
    try:
        client.update_weights(other.state_dict().items(), version=5)
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)  # the push set "file_system" for this process
    _assert_runs(client, other, client.generate(prompts[:3], GREEDY, seed=0), version=5)
