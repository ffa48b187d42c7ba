"""SGLang 0.5.23 from its own environment serves the tiny model on CPU: /generate with input_ids
gives HF's greedy tokens and log-probs, and a weight broadcast over gloo from this process (torch
2.13, the trainer's side) into the server (torch 2.14.1) lands.

Needs the environment that tools/setup-sglang-cpu builds (.venv-sglang, or $RELAX_SGLANG_ENV).
Without it these tests skip, unless RELAX_TEST_SGLANG=1, which makes a missing environment a
failure. About 1-2 minutes on 2 cores, most of it the server's start-up:

    RELAX_TEST_SGLANG=1 .venv/bin/python -m pytest tests/engines/test_sglang_server_cpu.py -q
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import hf_greedy
from side_env import SGLANG

from relax_hpc.engines.sglang_server import SGLangServer
from relax_hpc.engines.sglang_weights import DistributedWeightPush
from relax_hpc.models.hf import load_causal_lm, load_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

PROMPT_TEXTS = ("7", "1+2=", "<|im_start|>user:5+4=<|im_end|><|im_start|>assistant:")
NEW_TOKENS = 8
# float32 SGLang (torch_native attention, KV cache) vs a full HF forward; observed 2.4e-7.
LOGPROB_TOL = 1e-5
START_TIMEOUT_S = 240  # start-up is ~40 s alone on 2 cores, several times that beside a busy CI


def test_the_sglang_environment_is_built() -> None:
    SGLANG.require_built()


@pytest.fixture(scope="module")
def sglang_python() -> Path:
    return SGLANG.python_or_skip()


def _request(url: str, body: dict[str, Any] | None = None, timeout: float = 60) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@pytest.fixture(scope="module")
def server_url(sglang_python: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # SGLangServer fails naming its log when the server exits or misses the deadline, and stops
    # it by PID (SIGTERM, then SIGKILL of its process group).
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    with SGLangServer(sglang_python, tiny_model_dir, log_path=log, start_timeout_s=START_TIMEOUT_S,
                      env={"HF_HUB_OFFLINE": "1"}) as server:
        yield server.url


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:
    tokenizer = load_tokenizer(tiny_model_dir)
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPT_TEXTS]


def _generate(url: str, prompts: list[list[int]], temperature: float) -> list[dict[str, Any]]:
    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": {"temperature": temperature, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
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
        hf_tokens, hf_logprobs = hf_greedy(model, prompt, NEW_TOKENS)
        assert tokens == hf_tokens
        assert logprobs == pytest.approx(hf_logprobs, abs=LOGPROB_TOL)


def test_greedy_tokens_and_logprobs_equal_hf(server_url: str, tiny_model_dir: Path,
                                              prompts: list[list[int]]) -> None:
    _assert_greedy_matches(server_url, load_causal_lm(tiny_model_dir).eval(), prompts)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_hf_recomputation(server_url: str, tiny_model_dir: Path,
                                                  prompts: list[list[int]], temperature: float) -> None:
    # The tiny model's greedy path repeats one token; sampling checks the log-probs of many
    # different tokens. SGLang's are under the temperature-scaled distribution, as the trainer's
    # (at 0.7 the unscaled ones differ by about 0.1).
    model = load_causal_lm(tiny_model_dir).eval()
    replies = _generate(server_url, prompts, temperature=temperature)
    sampled = [_tokens_and_logprobs(reply) for reply in replies]
    assert len({t for tokens, _ in sampled for t in tokens}) > 3
    for prompt, (tokens, logprobs) in zip(prompts, sampled):
        assert logprobs == pytest.approx(_hf_logprobs(model, prompt, tokens, temperature), abs=LOGPROB_TOL)


class _Sender:
    """The `RequestSender` a weight push needs, over plain urllib (no API key on this server)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def post(self, path: str, body: Any) -> Any:
        status, reply = _request(self.base_url + path, body)
        assert status == 200, (path, reply)
        return reply


def test_gloo_weight_update_from_this_torch_lands(server_url: str, tiny_model_dir: Path,
                                                   prompts: list[list[int]]) -> None:
    # Last in the module: it changes the served weights. This process (torch 2.13, the sender's
    # side) is rank 0 of the group, as the rollout role is (relax_hpc/engines/sglang_weights.py).
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
        push.push(sender, list(model.state_dict().items()), version=1)  # the group forms on first use
        sender.post("/end_weight_update", {})
    finally:
        push.close(sender)

    replies = _generate(server_url, prompts[:1], temperature=0.0)
    assert replies[0]["meta_info"]["weight_version"] == "1"
    _assert_greedy_matches(server_url, model, prompts)
