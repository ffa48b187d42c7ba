"""The agent proxy's connection limits and JSON numbers against a real proxy and real sockets:
idle sockets from one address without the token cannot fill it, a request that does not arrive
within the deadline is cut (issue #33 item 7), and an integer too long to read gets 400, not
500 (item 12)."""

from __future__ import annotations

import socket
import time
from contextlib import ExitStack

import httpx
import pytest

from relax_hpc.agents import proxy as proxy_module
from relax_hpc.agents.service import AgenticRollout
from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.http.serving import ServingLimits
from relax_hpc.spec.schema import RolloutSpec
from agent_doubles import ScriptedEngine, tiny_tokenizer
from socket_waits import closed_by_server

WAIT_S = 10.0  # a generous bound on anything that should happen within a fraction of a second
TOK = tiny_tokenizer()
PARAMS = SamplingParams(max_new_tokens=6, stop_token_ids=(int(TOK.eos_token_id),))


def _service() -> tuple[AgenticRollout, ScriptedEngine]:
    engine = ScriptedEngine(TOK, ["ab"], version=3)
    config = RolloutSpec(agent="agent_doubles:ChatAgent")
    return AgenticRollout(config, engine, TOK, PARAMS, int(TOK.eos_token_id), 256), engine  # type: ignore[arg-type]


def _closed(sockets: list[socket.socket], expected: int) -> list[int]:
    return closed_by_server(sockets, expected, WAIT_S)


def test_idle_sockets_and_half_sent_requests_cannot_hold_the_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy_module, "PROXY_LIMITS",
                        ServingLimits(request_timeout_s=0.5, max_connections=64, max_untrusted_per_peer=8))
    svc, engine = _service()
    try:
        assert svc.proxy is not None
        port, key = svc.proxy.port, svc.proxy.sessions.open().api_key
        with ExitStack() as stack:
            half = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=WAIT_S))
            half.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
            idle = [stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=WAIT_S,
                                                                 source_address=("127.0.0.2", 0)))
                    for _ in range(72)]
            assert _closed(idle, 64) == list(range(64))  # 8 per address without the token
            body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
            reply = httpx.post(f"{svc.proxy.base_url}/chat/completions", json=body, timeout=WAIT_S,
                               headers={"Authorization": f"Bearer {key}"})
            assert reply.status_code == 200 and len(engine.produced) == 1
            assert _closed([half], 1) == [0]  # cut at the deadline
            assert _closed(idle[64:], 8) == list(range(8))
    finally:
        svc.close()


def test_an_integer_too_long_to_read_gets_400_not_500() -> None:
    svc, engine = _service()
    try:
        assert svc.proxy is not None
        key = svc.proxy.sessions.open().api_key
        raw = b'{"model": "policy", "max_tokens": ' + b"1" * 5000 + b', "messages": []}'
        reply = httpx.post(f"{svc.proxy.base_url}/chat/completions", content=raw, timeout=WAIT_S,
                           headers={"Authorization": f"Bearer {key}"})
        assert reply.status_code == 400, reply.text
        assert "a number too long to read" in reply.json()["error"]["message"]
        assert engine.produced == []
    finally:
        svc.close()
