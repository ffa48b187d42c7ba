"""Federated engines: `RemoteEngineClient` against a real `EngineServer` (a native engine on the
tiny model, real HTTP on 127.0.0.1), with weights travelling through a weights root on disk.

Loaded weights make the server generate exactly what an engine built on those weights does;
every refused load (no weights root, a path out of it, a missing, empty or corrupt directory,
an unknown tensor, a wrong shape, a bad version) names its problem and leaves the old weights
serving; `died` tells a gone server from a wrong token; `share` writes each version once and
keeps two."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from safetensors.torch import load_file, save_file

from relax_hpc.cli.main import main
from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.http.auth import engine_token
from relax_hpc.engines.http.client import EngineAuthError, EngineHttpError, HttpEngine
from relax_hpc.engines.http.server import EngineServer
from relax_hpc.engines.memory import ScriptedEngine
from relax_hpc.engines.native import NativeEngine
from relax_hpc.engines.elastic.remote import RemoteEngineClient, WeightLoadError, write_weights_dir
from relax_hpc.engines.router import EngineRouter, LocalEngineClient
from relax_hpc.models.tiny import write_tiny_model

TOKEN = engine_token()  # the test job's (tests/conftest.py)
PROMPTS = [[1, 2, 3], [4, 5]]
PARAMS = SamplingParams(max_new_tokens=4, temperature=1.0)
GREEDY = SamplingParams(max_new_tokens=4, temperature=1e-5)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("other") / "tiny-seed1", seed=1)


@pytest.fixture(scope="module")
def other_engine(other_model_dir: Path) -> NativeEngine:
    return NativeEngine(other_model_dir)


@pytest.fixture(scope="module")
def other_weights(other_engine: NativeEngine) -> list[tuple[str, torch.Tensor]]:
    return [(name, p.detach().clone()) for name, p in other_engine.model.named_parameters()]


def _serve(engine: Any, root: Path | None) -> EngineServer:
    vocab = getattr(getattr(engine, "model", None), "config", None)
    return EngineServer(engine, token=TOKEN, weights_root=root, model_info={"model_type": "qwen3"},
                        vocab_size=int(vocab.vocab_size) if vocab is not None else None).start()


@pytest.fixture
def served(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[EngineServer, Path]]:
    root = tmp_path / "weights"
    root.mkdir()
    server = _serve(NativeEngine(tiny_model_dir), root)
    yield server, root
    server.stop()


def _post(url: str, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _outputs(gens: list[Any]) -> list[tuple[list[int], list[float], int]]:
    return [(g.token_ids, g.logprobs, g.weight_version) for g in gens]


def test_loaded_weights_serve_like_an_engine_built_on_them(
    served: tuple[EngineServer, Path], other_engine: NativeEngine, other_weights: list[tuple[str, torch.Tensor]]
) -> None:
    server, root = served
    client = RemoteEngineClient("grow-0", server.url, TOKEN, root, model_type="qwen3")
    try:
        assert (client.id, client.address, client.weight_version) == ("grow-0", server.url, 0)
        before = client.submit(PROMPTS, PARAMS, 5).result()
        shared = client.share(other_weights, 1)
        assert shared == (root / "v1").absolute() and (shared / "model.safetensors").is_file()
        client.load_weights(shared, 1).result()
        assert client.weight_version == 1
        for params in (PARAMS, GREEDY):
            got = client.submit(PROMPTS, params, 5).result()
            want = other_engine.generate(PROMPTS, params, seed=5)
            assert [(t, lp) for t, lp, _ in _outputs(got)] == [(t, lp) for t, lp, _ in _outputs(want)]
            assert all(g.weight_version == 1 for g in got)
        assert _outputs(before) != _outputs(client.submit(PROMPTS, PARAMS, 5).result())
        assert HttpEngine(server.url, token=TOKEN).model_info()["weight_version"] == 1
    finally:
        client.close()


def test_the_reply_is_sglangs_and_the_version_may_be_a_string(
    served: tuple[EngineServer, Path], other_weights: list[tuple[str, torch.Tensor]]
) -> None:
    server, root = served
    target = write_weights_dir(other_weights, root, 4)
    status, reply = _post(server.url + "/update_weights_from_disk",
                          {"model_path": "v4", "weight_version": "4", "flush_cache": True})  # relative: from the root
    assert status == 200 and reply["success"] is True and reply["weight_version"] == 4
    assert str(target.resolve()) in reply["message"]
    assert server.engine.weight_version == 4


def test_the_router_drives_remote_engines(
    served: tuple[EngineServer, Path], tiny_model_dir: Path, other_engine: NativeEngine,
    other_weights: list[tuple[str, torch.Tensor]],
) -> None:
    server, root = served
    second = _serve(NativeEngine(tiny_model_dir), root)
    clients = [RemoteEngineClient(f"grow-{i}", s.url, TOKEN, root) for i, s in enumerate((server, second))]
    router = EngineRouter(clients, other_engine.tokenizer, other_engine.eos_id)
    try:
        router.update_weights(other_weights, 2)  # one share() for both clients
        assert sorted(p.name for p in root.iterdir()) == ["v2"]
        assert router.weight_version == 2 and server.engine.weight_version == second.engine.weight_version == 2
        gens = router.generate(PROMPTS * 2, GREEDY, seed=3, group_size=2)
        want = other_engine.generate(PROMPTS, GREEDY, seed=None)
        assert [g.token_ids for g in gens] == [g.token_ids for g in want] * 2  # greedy: the seed does not matter
    finally:
        router.close()
        second.stop()


def test_a_remote_engine_joins_with_the_weights_the_job_serves(
    served: tuple[EngineServer, Path], other_model_dir: Path, other_engine: NativeEngine
) -> None:
    server, root = served
    local = NativeEngine(other_model_dir)
    router = EngineRouter([LocalEngineClient("main-0", local)], local.tokenizer, local.eos_id)
    try:
        router.update_weights(list(local.model.named_parameters()), 1)
        router.join(router.add_engine(RemoteEngineClient("grow-0", server.url, TOKEN, root), job="4242"))
        assert server.engine.weight_version == 1  # from the local engine's state dict, tied weights and all
        got = HttpEngine(server.url, token=TOKEN).generate(PROMPTS, PARAMS, seed=5)
        assert _outputs(got) == [(t, lp, 1) for t, lp, _ in _outputs(other_engine.generate(PROMPTS, PARAMS, seed=5))]
    finally:
        router.close()


def _stale_server_state(server: EngineServer) -> tuple[Any, int]:
    return _outputs(HttpEngine(server.url, token=TOKEN).generate(PROMPTS, PARAMS, seed=5)), server.engine.weight_version


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_refused_loads_name_the_problem_and_keep_the_old_weights(
    served: tuple[EngineServer, Path], tmp_path: Path, other_weights: list[tuple[str, torch.Tensor]]
) -> None:
    server, root = served
    before = _stale_server_state(server)
    outside = write_weights_dir(other_weights, tmp_path / "elsewhere", 1)  # loadable, but not under the root
    (root / "v2").symlink_to(outside)
    (root / "v3").mkdir()
    (root / "v3" / "model.safetensors").symlink_to(outside / "model.safetensors")
    (root / "v4").mkdir()
    (root / "v5").mkdir()
    (root / "v5" / "model.safetensors").write_bytes(b"\x00" * 64)
    embed = dict(other_weights)["model.embed_tokens.weight"]
    _write(root / "v6", {"model.nonexistent.weight": torch.zeros(2)})
    _write(root / "v7", {"model.embed_tokens.weight": torch.zeros(embed.shape[0], embed.shape[1] + 1)})
    cases = [
        ({"model_path": str(outside), "weight_version": 1}, "not inside this server's weights root"),
        ({"model_path": str(root / ".." / "elsewhere" / "v1"), "weight_version": 1}, "not inside"),
        ({"model_path": "v2", "weight_version": 1}, f"resolves to {outside.resolve()}, which is not inside"),
        ({"model_path": "v3", "weight_version": 1}, "outside this server's weights root"),
        ({"model_path": str(root), "weight_version": 1}, "not inside"),
        ({"model_path": "v9", "weight_version": 1}, "does not exist"),
        ({"model_path": "v4", "weight_version": 1}, "holds no *.safetensors file"),
        ({"model_path": "v5", "weight_version": 1}, "cannot read"),
        ({"model_path": "v6", "weight_version": 1}, "the served model does not have: model.nonexistent.weight"),
        ({"model_path": "v7", "weight_version": 1}, "wrong shape: model.embed_tokens.weight"),
        ({"model_path": "v2", "weight_version": -1}, "weight_version must be an integer >= 0"),
        ({"model_path": "v2", "weight_version": True}, "weight_version must be an integer >= 0"),
        ({"model_path": "v2"}, "weight_version must be an integer >= 0"),
        ({"weight_version": 1}, "model_path must be the path of a directory"),
        ([], "must be a JSON object"),
    ]
    for body, says in cases:
        status, reply = _post(server.url + "/update_weights_from_disk", body)
        assert status == 400, (body, reply)
        assert reply["success"] is False and says in reply["message"] == reply["error"]["message"], (body, reply)
    client = RemoteEngineClient("grow-0", server.url, TOKEN, root)
    with pytest.raises(WeightLoadError, match=r"did not load weight version 6 .*HTTP 400: .*does not have") as caught:
        client.load_weights(root / "v6", 6).result()
    assert client.died(caught.value) and client.weight_version == 0
    client.close()
    assert _stale_server_state(server) == before


def test_a_server_without_a_weights_root_refuses_every_update(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = ScriptedEngine(NativeEngine(tiny_model_dir).tokenizer, ["7"])
    server = _serve(engine, None)
    try:
        status, reply = _post(server.url + "/update_weights_from_disk", {"model_path": "v1", "weight_version": 1})
        assert status == 403 and "started without --weights-root; it takes no weight updates" in reply["message"]
        assert engine.updates == []
        status, reply = _post(server.url + "/flush_cache", {})
        assert status == 404 and "POST /update_weights_from_disk" in reply["error"]["message"]
        request = urllib.request.Request(server.url + "/update_weights_from_disk",
                                         headers={"Authorization": f"Bearer {TOKEN}"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=30)
        assert caught.value.code == 405
    finally:
        server.stop()
    with pytest.raises(ValueError, match="is not a directory; create it"):
        EngineServer(engine, token=TOKEN, weights_root=tmp_path / "missing")


@pytest.fixture
def scripted(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[EngineServer, ScriptedEngine]]:
    engine = ScriptedEngine(NativeEngine(tiny_model_dir).tokenizer, ["7"], fail_first=1)
    server = _serve(engine, tmp_path)
    yield server, engine
    server.stop()


def test_died_is_true_for_a_server_that_fails_or_is_gone(
    scripted: tuple[EngineServer, ScriptedEngine], tmp_path: Path
) -> None:
    server, engine = scripted
    client = RemoteEngineClient("grow-0", server.url, TOKEN, tmp_path, timeout_s=10)
    try:
        failed = client.submit([[1, 2]], PARAMS, 0).exception()  # HTTP 500, not retried
        assert isinstance(failed, EngineHttpError) and client.died(failed)
        assert len(engine.calls) == 1  # a re-issued request comes from the router, not from the client
        assert client.submit([[1, 2]], PARAMS, 0).result()[0].text == "7"
        refused = client.submit([[1, -1]], PARAMS, 0).exception()  # not a token id: HTTP 400
        assert isinstance(refused, EngineHttpError) and client.died(refused)
        media: Any = [{"image": []}]
        wrong = client.submit([[1]], PARAMS, 0, media).exception()  # media: refused before sending
        assert isinstance(wrong, ValueError) and not client.died(wrong)
        assert [client.call(m).result() for m in ("pause", "resume", "release_memory", "resume_memory")] == \
            [None, None, 0, None]
        server.stop()
        gone = client.submit([[1, 2]], PARAMS, 0).exception()
        assert isinstance(gone, EngineHttpError) and "failed after 1 attempt" in str(gone) and client.died(gone)
        with pytest.raises(WeightLoadError):
            client.load_weights(tmp_path, 1).result()
    finally:
        client.close()
    with pytest.raises(EngineHttpError, match="does not answer GET /health"):
        RemoteEngineClient("grow-1", server.url, TOKEN, tmp_path)


def test_a_wrong_token_or_model_is_refused_at_connection(
    scripted: tuple[EngineServer, ScriptedEngine], tmp_path: Path
) -> None:
    server, _ = scripted
    with pytest.raises(EngineAuthError, match="refused this client") as caught:
        RemoteEngineClient("grow-0", server.url, "x" * 40, tmp_path)
    with pytest.raises(EngineHttpError, match="serves model type 'qwen3'.*the policy is 'llama'"):
        RemoteEngineClient("grow-0", server.url, TOKEN, tmp_path, model_type="llama")
    client = RemoteEngineClient("grow-0", server.url, TOKEN, tmp_path)
    assert not client.died(caught.value)
    client.close()


def test_share_writes_each_version_once_and_keeps_two(tmp_path: Path) -> None:
    root = tmp_path / "weights"
    (root / "v9").mkdir(parents=True)  # left by an earlier run that got further: numbers get reused
    _write(root / "v2", {"a": torch.full((2,), 7.0)})  # also an earlier run's: not this process's to reuse
    tied = torch.ones(3)
    first = write_weights_dir([("a", torch.zeros(2)), ("b", tied), ("c", tied)], root, 1)
    assert first == (root / "v1").absolute() and sorted(load_file(first / "model.safetensors")) == ["a", "b", "c"]
    assert sorted(p.name for p in root.iterdir()) == ["v1"]  # v2 and v9 are above v1: stale
    again = write_weights_dir([("a", torch.ones(2))], root, 1)  # the same version: not written again
    assert again == first and load_file(first / "model.safetensors")["a"].tolist() == [0.0, 0.0]
    _write(root / "v2", {"a": torch.full((2,), 7.0)})
    assert load_file(write_weights_dir([("a", torch.ones(2))], root, 2) / "model.safetensors")["a"].tolist() == [1, 1]
    write_weights_dir([("a", torch.ones(2))], root, 3)
    assert sorted(p.name for p in root.iterdir()) == ["v2", "v3"]
    write_weights_dir([("a", torch.ones(2))], root, 5)
    assert sorted(p.name for p in root.iterdir()) == ["v3", "v5"]
    with pytest.raises(ValueError, match="got no tensors"):
        write_weights_dir([], root, 6)
    assert sorted(p.name for p in root.iterdir()) == ["v3", "v5"]  # the failed write left nothing


def test_cli_serve_engine_takes_a_weights_root(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    served: list[EngineServer] = []

    def serve_once(self: EngineServer) -> None:  # instead of serving until interrupted
        served.append(self)
        self.stop()

    monkeypatch.setattr(EngineServer, "serve_forever", serve_once)
    token_file = tmp_path / "engine.token"
    assert main(["serve-engine", str(tiny_model_dir), "--port", "0", "--token-file", str(token_file),
                 "--weights-root", str(tmp_path)]) == 0
    [server] = served
    assert server.weights_root == tmp_path.resolve() and server.info()["model_type"] == "qwen3"
    assert main(["serve-engine", str(tiny_model_dir), "--port", "0", "--token-file", str(token_file),
                 "--weights-root", str(tmp_path / "missing")]) == 2
    assert "(--weights-root) is not a directory" in capsys.readouterr().err
