"""`SGLangEngine` (relax_hpc/engines/sglang.py): its request bodies, its reading of replies, and the
engine against a real SGLang 0.5.23 server on the tiny model; and that server itself over plain
HTTP: /generate with input_ids gives HF's greedy tokens and log-probs, and a weight broadcast over
gloo from this process (torch 2.13, the trainer's side) into the server (torch 2.14.1) lands.

The first tests need nothing. The ones marked `sglang` need the environment of
tools/setup-sglang-cpu (.venv-sglang or $RELAX_SGLANG_ENV) and skip without it, naming it, unless
RELAX_TEST_SGLANG=1, which makes a missing environment a failure. They share one server for the
module (about 40 s to start on 2 cores, the most of the module's time), stopped by PID at the end;
the two tests that change its weights come last:

    RELAX_TEST_SGLANG=1 .venv/bin/python -m pytest tests/engines/test_sglang_engine.py -q
"""

from __future__ import annotations

import base64
import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import hf_greedy
from side_env import SGLANG

from relax_hpc.engines import sglang_requests as requests
from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.http_client import EngineHttpError
from relax_hpc.engines.sglang import SGLangEngine
from relax_hpc.engines.sglang_server import SGLangServer
from relax_hpc.engines.sglang_weights import DistributedWeightPush
from relax_hpc.models.hf import load_causal_lm, load_tokenizer

HERE = Path(__file__).resolve().parent
URL = "http://sglang-test:30000"
NEW_TOKENS = 6
LOGPROB_TOL = 1e-4  # float32 SGLang vs a full HF forward; observed ~2e-7 (docs/engines.md)
# Greedy in our terms: top_k 1 at temperature 1, so log-probs are log_softmax(logits) as HF's.
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=1)
# The raw server tests (plain HTTP, no SGLangEngine).
RAW_PROMPT_TEXTS = ("7", "1+2=", "<|im_start|>user:5+4=<|im_end|><|im_start|>assistant:")
RAW_NEW_TOKENS = 8
# float32 SGLang (torch_native attention, KV cache) vs a full HF forward; observed 2.4e-7.
RAW_LOGPROB_TOL = 1e-5
START_TIMEOUT_S = 300  # start-up is ~40 s alone on 2 cores, several times that beside a busy CI


# --- request bodies and replies: no SGLang needed ---------------------------------------------


def test_generate_request_maps_our_sampling_params_to_sglang_ones() -> None:
    params = SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=0, stop_token_ids=(7,), stop=("\n",))
    body = requests.generate_request([[1, 2], [3]], params, seed=11)
    assert body["input_ids"] == [[1, 2], [3]] and body["return_logprob"] is True
    first, second = body["sampling_params"]
    # Our top_k 0 is SGLang's -1 (off). No "stop": a server without its tokenizer refuses stop
    # strings; the engine cuts the reply instead (cut_at_stop_strings).
    assert {k: v for k, v in first.items() if k != "sampling_seed"} == {
        "max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "stop_token_ids": [7]}
    # One seed per prompt, a function of (batch seed, index): reproducible, distinct, and not
    # shared with the neighbouring batch seed (seed + index would give batch 12's prompt 0 this one's prompt 1).
    assert first["sampling_seed"] == requests.prompt_seed(11, 0) != second["sampling_seed"] == requests.prompt_seed(11, 1)
    assert requests.prompt_seed(12, 0) not in (first["sampling_seed"], second["sampling_seed"])
    assert 0 <= first["sampling_seed"] < 2**63
    assert requests.generate_request([[1]], SamplingParams(top_k=4), seed=None)["sampling_params"][0]["top_k"] == 4
    assert "sampling_seed" not in requests.generate_request([[1]], params, seed=None)["sampling_params"][0]


def test_stop_strings_cut_the_reply_after_the_token_that_completes_them() -> None:
    from relax_hpc.engines.base import Generation

    def decode(ids: list[int]) -> str:  # token t is the letter chr(ord("a") + t)
        return "".join(chr(ord("a") + t) for t in ids)

    g = Generation([0], [0, 1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4, -0.5], "length", 0)
    requests.cut_at_stop_strings(g, ("zz", "cd"), decode)  # "abcd" completes "cd" at token 3
    assert (g.token_ids, g.logprobs, g.finish_reason) == ([0, 1, 2, 3], [-0.1, -0.2, -0.3, -0.4], "stop")
    untouched = Generation([0], [0, 1], [-0.1, -0.2], "length", 0)
    requests.cut_at_stop_strings(untouched, ("x",), decode)
    assert (untouched.token_ids, untouched.finish_reason) == ([0, 1], "length")


def test_generate_request_refuses_empty_prompts() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        requests.generate_request([[1], []], SamplingParams(), seed=0)


def _reply(ids: list[int], logprobs: list[float], finish: object, version: str = "default") -> dict:
    return {"output_ids": ids, "meta_info": {
        "id": "r", "finish_reason": finish, "weight_version": version,
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)]}}


def test_parse_generate_response_reads_tokens_logprobs_finish_and_version() -> None:
    body = [_reply([5, 2], [-0.5, -0.25], {"type": "stop", "matched": 2}),
            _reply([4, 4, 4], [-1.0, -2.0, -3.0], {"type": "length", "length": 3}, version="3")]
    stopped, cut = requests.parse_generate_response(body, [[1], [1, 2]], version=2, url=URL)
    assert (stopped.prompt_ids, stopped.token_ids, stopped.logprobs) == ([1], [5, 2], [-0.5, -0.25])
    assert (stopped.finish_reason, cut.finish_reason) == ("stop", "length")
    # "default" (no update yet) -> the engine's own version; a number -> the server's.
    assert (stopped.weight_version, cut.weight_version) == (2, 3)


@pytest.mark.parametrize("body, message", [
    ([_reply([5], [-0.5], {"type": "abort", "message": "aborted by pause"})], "finish_reason 'abort'"),
    ([{"output_ids": [5]}], "expected an object with 'meta_info'"),
    ([{"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length"},
                                           "output_token_logprobs": [[-1.0, 5, None]]}}], "2 output ids but 1 log-probs"),
    ([_reply([5], [-0.5], {"type": "stop"})] * 2, "answered 2 for 1 prompts"),
    ({"error": "boom"}, "expected an object with 'meta_info'"),
])
def test_parse_generate_response_refuses_a_malformed_reply(body: object, message: str) -> None:
    with pytest.raises(EngineHttpError, match=message) as error:
        requests.parse_generate_response(body, [[1]], version=0, url=URL)
    assert URL in str(error.value)


def test_an_unsupported_server_version_is_refused_naming_the_supported_ones() -> None:
    assert requests.check_server_version({"version": "0.5.23"}, URL) == "0.5.23"
    with pytest.raises(EngineHttpError, match=r"runs SGLang 0\.4\.9; SGLangEngine supports SGLang 0\.5\.23"):
        requests.check_server_version({"version": "0.4.9"}, URL)
    with pytest.raises(EngineHttpError, match="did not report an SGLang version"):
        requests.check_server_version({"model_path": "x"}, URL)


def test_control_requests() -> None:
    assert requests.pause_request() == {"mode": "retract"}
    assert requests.update_weights_from_disk_request("/w/v3", 3) == {
        "model_path": "/w/v3", "weight_version": "3", "flush_cache": True}
    assert requests.init_weights_update_group_request("10.0.0.1", 29500, 3, "g", "nccl") == {
        "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3,
        "group_name": "g", "backend": "nccl"}
    # The version and the cache flush come with the last bucket only: until then the server
    # holds a mix of old and new weights, which no reply may be labelled with.
    first = requests.update_weights_from_distributed_request(["a"], ["float32"], [[2, 3]], "g", 4, last=False)
    assert first == {"names": ["a"], "dtypes": ["float32"], "shapes": [[2, 3]], "group_name": "g", "flush_cache": False}
    last = requests.update_weights_from_distributed_request(["a"], ["float32"], [[2, 3]], "g", 4, last=True)
    assert last == {**first, "flush_cache": True, "weight_version": "4"}
    assert requests.update_weights_from_tensor_request(["QUJD"], 4, last=False) == {
        "serialized_named_tensors": ["QUJD"], "flush_cache": False}
    assert requests.update_weights_from_tensor_request(["QUJD", "QUJD"], 4, last=True) == {
        "serialized_named_tensors": ["QUJD", "QUJD"], "flush_cache": True, "weight_version": "4"}


def test_generate_request_takes_more_fields() -> None:
    body = requests.generate_request([[1]], GREEDY, seed=None, return_routed_experts=True)
    assert body["return_routed_experts"] is True and body["input_ids"] == [[1]]


# --- against SGLang itself --------------------------------------------------------------------


def test_the_sglang_environment_is_built() -> None:
    SGLANG.require_built()


@pytest.fixture(scope="module")
def sglang_python() -> Path:
    return SGLANG.python_or_skip()


def _media_request_bodies(sampled: SamplingParams) -> list[dict]:
    """A multimodal model's bodies (SGLangEngine._media_request): unexpanded ids (5/6 media start/end,
    8 image, 9 video, 7 audio placeholders), a markup logit bias, per-prompt data URLs."""
    png, mkv, wav = "data:image/png;base64,iVBO", "data:video/x-matroska;base64,GkXf", "data:audio/wav;base64,UklG"
    bias = dict.fromkeys((5, 6, 7, 8, 9), -1e30)
    return [
        requests.generate_request([[1, 5, 8, 6, 5, 8, 6, 2], [1, 2], [5, 8, 6, 3]], sampled, seed=5, logit_bias=bias,
                                  **requests.media_fields([{"image": [png, png]}, None, {"image": [png]}])),
        requests.generate_request([[1, 5, 8, 6, 5, 9, 6, 5, 7, 6, 2], [5, 7, 6]], GREEDY, seed=None, logit_bias=bias,
                                  **requests.media_fields([{"image": [png], "video": [mkv], "audio": [wav]},
                                                           {"audio": [wav]}])),
        requests.generate_request([[1, 2]], GREEDY, seed=None, logit_bias=bias),  # a text prompt of such a model
    ]


def _every_request_body() -> dict:
    sampled = SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9, top_k=0, stop_token_ids=(2,), stop=("x",))
    return {
        "generate": [requests.generate_request([[1, 2, 3], [4]], sampled, seed=5),
                     requests.generate_request([[1]], GREEDY, seed=None),
                     *_media_request_bodies(sampled)],
        "structs": [
            ["PauseGenerationReqInput", requests.pause_request()],
            ["ContinueGenerationReqInput", requests.continue_request()],
            ["BeginWeightUpdateReqInput", requests.begin_weight_update_request()],
            ["EndWeightUpdateReqInput", requests.end_weight_update_request()],
            ["UpdateWeightFromDiskReqInput", requests.update_weights_from_disk_request("/tmp/w/v1", 1)],
            ["ReleaseMemoryOccupationReqInput", requests.release_memory_request()],
            ["ResumeMemoryOccupationReqInput", requests.resume_memory_request()],
            ["InitWeightsUpdateGroupReqInput",
             requests.init_weights_update_group_request("127.0.0.1", 29500, 2, "relax-weights-1-0", "gloo")],
            ["DestroyWeightsUpdateGroupReqInput", requests.destroy_weights_update_group_request("relax-weights-1-0")],
            *(["UpdateWeightsFromDistributedReqInput", requests.update_weights_from_distributed_request(
                ["model.norm.weight", "model.embed_tokens.weight"], ["float32", "bfloat16"], [[8], [48, 8]],
                "relax-weights-1-0", 3, last=last)] for last in (False, True)),
            *(["UpdateWeightsFromTensorReqInput", requests.update_weights_from_tensor_request(
                [base64.b64encode(b"a pickle").decode()] * 2, 3, last=last)] for last in (False, True)),
        ],
    }


@pytest.mark.slow
@pytest.mark.sglang
def test_every_request_body_is_valid_for_sglangs_own_classes(sglang_python: Path, tmp_path: Path) -> None:
    path = tmp_path / "requests.json"
    path.write_text(json.dumps(_every_request_body()))
    done = subprocess.run([str(sglang_python), str(HERE / "sglang_check_requests.py"), str(path)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert "18 of 18 bodies valid" in done.stdout


@pytest.fixture(scope="module")
def server(sglang_python: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    log = tmp_path_factory.mktemp("sglang-engine") / "server.log"
    # SGLangServer fails naming its log when the server exits or misses the deadline, and stops
    # it by PID (SIGTERM, then SIGKILL of its process group).
    with SGLangServer(sglang_python, tiny_model_dir, log_path=log, start_timeout_s=START_TIMEOUT_S,
                      env={"HF_HUB_OFFLINE": "1"}) as running:
        yield running


@pytest.fixture(scope="module")
def engine(server: SGLangServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> SGLangEngine:
    return SGLangEngine(server.url, tiny_model_dir, timeout_s=120,
                        weights_dir=tmp_path_factory.mktemp("sglang-weights"))


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(tiny_model_dir)
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("7", "1+2=", "hello world")]


def _assert_generations_match_hf(engine: SGLangEngine, model: torch.nn.Module, prompts: list[list[int]]) -> list:
    generations = engine.generate(prompts, GREEDY, seed=0)
    for prompt, g in zip(prompts, generations):
        tokens, logprobs = hf_greedy(model, prompt, NEW_TOKENS, engine.eos_id)
        assert g.prompt_ids == prompt
        assert g.token_ids == tokens
        assert g.logprobs == pytest.approx(logprobs, abs=LOGPROB_TOL)
        assert g.finish_reason == ("stop" if tokens[-1] == engine.eos_id else "length")
    return generations


@pytest.mark.slow
@pytest.mark.sglang
def test_greedy_generation_equals_hf(engine: SGLangEngine, tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    assert engine.server_version == "0.5.23" and engine.weight_version == 0
    generations = _assert_generations_match_hf(engine, load_causal_lm(tiny_model_dir).eval(), prompts)
    assert all(g.weight_version == 0 for g in generations)
    assert generations[0].text == engine.tokenizer.decode(generations[0].token_ids, skip_special_tokens=False)


@pytest.mark.slow
@pytest.mark.sglang
def test_pause_holds_generate_until_resume(engine: SGLangEngine, prompts: list[list[int]]) -> None:
    engine.pause()
    results: list = []
    caller = threading.Thread(target=lambda: results.append(engine.generate(prompts[:1], GREEDY)), daemon=True)
    try:
        caller.start()
        time.sleep(1.5)
        assert caller.is_alive() and not results
    finally:
        engine.resume()
    caller.join(timeout=120)
    assert len(results) == 1 and len(results[0][0].token_ids) > 0


@pytest.mark.slow
@pytest.mark.sglang
def test_a_server_of_another_sglang_version_is_refused(server: SGLangServer, tiny_model_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SGLangEngine, "_server_info", lambda self: {"version": "0.4.9"})
    with pytest.raises(EngineHttpError, match=r"runs SGLang 0\.4\.9; SGLangEngine supports SGLang 0\.5\.23") as error:
        SGLangEngine(server.url, tiny_model_dir)
    assert server.url in str(error.value)


# --- the raw server: plain HTTP, no SGLangEngine ------------------------------------------------


def _request(url: str, body: dict[str, Any] | None = None, timeout: float = 60) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
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
def test_update_weights_from_disk_changes_logprobs_and_version(engine: SGLangEngine, tiny_model_dir: Path,
                                                               prompts: list[list[int]]) -> None:
    # It changes the served weights: after every test that reads the first ones.
    model = load_causal_lm(tiny_model_dir).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # tied to the embedding in the tiny model: both change
    engine.update_weights(model.state_dict().items(), version=1)
    assert engine.weight_version == 1
    generations = _assert_generations_match_hf(engine, model, prompts)
    assert all(g.weight_version == 1 for g in generations)
    assert sorted(p.name for p in engine.weights_dir.iterdir()) == ["v1"]
    engine.update_weights(model.state_dict().items(), version=2)
    assert sorted(p.name for p in engine.weights_dir.iterdir()) == ["v2"]  # v1 deleted
    assert engine.generate(prompts[:1], GREEDY)[0].weight_version == 2


class _Sender:
    """The `RequestSender` a weight push needs, over plain urllib (no API key on this server)."""

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
    # Last of the server tests, after the update from disk (versions 1 and 2). This process (torch
    # 2.13, the sender's side) is rank 0 of the group, as the rollout role is
    # (relax_hpc/engines/sglang_weights.py).
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


def test_an_unreachable_server_is_named_in_the_error(tiny_model_dir: Path) -> None:
    from relax_hpc.engines.sglang_server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineHttpError, match="check that it is running") as error:
        SGLangEngine(url, tiny_model_dir, timeout_s=2, retries=0)
    assert url in str(error.value)
