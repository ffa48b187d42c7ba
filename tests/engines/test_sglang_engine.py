"""`SGLangEngine` (relax_hpc/engines/sglang/engine.py): its request bodies and its reading of replies,
and that every body it sends is valid for SGLang 0.5.23's own request classes.

The first tests need nothing. The one marked `sglang` needs the environment of
tools/setup-sglang-cpu (.venv-sglang or $RELAX_SGLANG_ENV) and skips without it, naming it, unless
RELAX_TEST_SGLANG=1, which makes a missing environment a failure. The engine against a real
server (greedy generation and log-probs equal HF's, pause, weight updates from disk and over
gloo) is tested in tests/engines/test_sglang_fleet.py, on one of the fleet's servers: an SGLang
server takes about 40 s of CPU to start.

    RELAX_TEST_SGLANG=1 .venv/bin/python -m pytest tests/engines/test_sglang_engine.py -q
"""
from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

import pytest
from side_env import SGLANG

from relax_hpc.engines.sglang import requests as requests
from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.http.client import EngineHttpError
from relax_hpc.engines.sglang.engine import SGLangEngine

HERE = Path(__file__).resolve().parent
URL = "http://sglang-test:30000"
NEW_TOKENS = 6
# Greedy in our terms: top_k 1 at temperature 1, so log-probs are log_softmax(logits) as HF's.
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=1)


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


def test_an_unreachable_server_is_named_in_the_error(tiny_model_dir: Path) -> None:
    from relax_hpc.engines.sglang.server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineHttpError, match="check that it is running") as error:
        SGLangEngine(url, tiny_model_dir, timeout_s=2, retries=0)
    assert url in str(error.value)
