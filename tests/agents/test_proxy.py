"""The OpenAI-compatible proxy: the official SDK in both modes, recorded tokens, security (the
proxy's bearer token on every route, per-session keys, bounded bodies)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from relax_hpc.agents.proxy import PROXY_AUTH_MESSAGE, RequestError, parse_chat_request, proxy_token
from relax_hpc.agents.service import AgenticRollout
from relax_hpc.agents.sessions import SessionAuthError, SessionStore
from relax_hpc.auth import JobSecret
from relax_hpc.data.dataset import PromptRow as Row
from relax_hpc.engines.base import SamplingParams
from relax_hpc.spec.schema import RolloutSpec
from agent_doubles import ScriptedEngine, tiny_tokenizer

TOK = tiny_tokenizer()
EOS = int(TOK.eos_token_id)
PARAMS = SamplingParams(max_new_tokens=6, stop_token_ids=(EOS,))


ROWS = [Row(0, [], "hi", "x", {}), Row(1, [], "yo", "y", {})]


def service(agent: str, script: list[str], **kw: object) -> tuple[AgenticRollout, ScriptedEngine]:
    engine = ScriptedEngine(TOK, script, version=3)
    return AgenticRollout(RolloutSpec(agent=agent, **kw), engine, TOK, PARAMS, EOS, 256), engine  # type: ignore[arg-type]


def produced_set(engine: ScriptedEngine) -> list[tuple]:
    """Every (prompt, response, log-probs) the engine generated, sorted."""
    return sorted((tuple(g.prompt_ids), tuple(g.token_ids), tuple(g.logprobs)) for g in engine.produced)


def recorded_set(samples: list) -> list[tuple]:
    return sorted((tuple(s.prompt_ids), tuple(s.response_ids), tuple(s.rollout_log_probs)) for s in samples)


def test_inline_sdk_chat_records_exactly_what_the_engine_produced() -> None:
    svc, engine = service("agent_doubles:ChatAgent", ["ab", "cd"])
    # A batch goes when every live session waits, or after max_wait_s; with the wait that long,
    # the batches below are the sessions', whatever the load (a session's request through the
    # proxy can take longer than the default 50 ms on a busy machine).
    svc.batcher.max_wait_s = 60.0
    try:
        groups, stats = svc.generate_groups(ROWS, 2, seed=5, first_group_id=1)
    finally:
        svc.close()
    samples = [s for g in groups for s in g]
    assert len(samples) == 8 and stats["rollout/completions_per_session"] == 2.0  # 4 sessions x 2 turns
    assert recorded_set(samples) == produced_set(engine)
    for s in samples:
        assert s.loss_mask == [1] * len(s.response_ids)
        assert s.metadata["env_reward"] == 1.0  # turn discount 1.0: both turns get the final reward
    first = TOK.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert TOK.encode(first, add_special_tokens=False) in [s.prompt_ids for s in groups[0]]
    assert [s.group_id for s in samples] == [1] * 4 + [2] * 4
    # The 4 sessions' first turns were decoded together, then their second turns.
    assert svc.batcher.batch_sizes == [4, 4]


def test_inline_concat_export_and_discount() -> None:
    engine = ScriptedEngine(TOK, ["ab"], version=3)
    svc = AgenticRollout(RolloutSpec(agent="agent_doubles:ChatAgent", agent_export_style="concat",
                                     agent_turn_discount=0.5), engine, TOK, PARAMS, EOS)
    try:
        groups, _ = svc.generate_groups(ROWS[:1], 1, seed=5, first_group_id=1)
    finally:
        svc.close()
    [[s]] = groups
    g1, g2 = engine.produced
    between = g2.prompt_ids[len(g1.prompt_ids) + len(g1.token_ids):]
    assert s.prompt_ids == g1.prompt_ids
    assert s.response_ids == g1.token_ids + between + g2.token_ids
    assert s.loss_mask == [1] * 3 + [0] * len(between) + [1] * 3
    assert s.rollout_log_probs == g1.logprobs + [0.0] * len(between) + g2.logprobs
    assert s.metadata["env_reward"] == 1.0  # the chain's last completion's reward


def test_dict_reward_maps_to_the_named_completion() -> None:
    svc, _ = service("agent_doubles:DictRewardAgent", ["ab"], agent_turn_discount=0.5)
    try:
        groups, _ = svc.generate_groups(ROWS[:1], 1, seed=5, first_group_id=1)
    finally:
        svc.close()
    # The first completion was rewarded 0.5 by id; the second, after it, gets 0.
    assert [s.metadata["env_reward"] for s in groups[0]] == [0.5, 0.0]


def test_subproc_sync_sdk_reads_the_endpoint_from_the_environment() -> None:
    svc, engine = service("sync_agent:SyncEnvAgent", ["zz"], agent_mode="subproc", agent_subproc_max_workers=1)
    try:
        groups, _ = svc.generate_groups(ROWS, 1, seed=5, first_group_id=1)
    finally:
        svc.close()
    samples = [s for g in groups for s in g]
    assert len(samples) == 4 and len(engine.produced) == 4
    assert recorded_set(samples) == produced_set(engine)
    assert all(s.metadata["env_reward"] == 2.0 for s in samples)


def test_security_401_cross_session_expiry_and_malformed_requests() -> None:
    svc, _ = service("agent_doubles:ChatAgent", ["ab"])
    try:
        assert svc.proxy is not None
        url = svc.proxy.base_url
        a, b = svc.proxy.sessions.open(), svc.proxy.sessions.open()
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}

        def post(key: str | None, payload: object, raw: bytes | None = None) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            content = raw if raw is not None else json.dumps(payload).encode()
            return httpx.post(f"{url}/chat/completions", content=content, headers=headers, timeout=30)

        assert post(None, body).status_code == 401
        assert post("sk-wrong", body).status_code == 401
        assert httpx.get(f"{url}/models", timeout=30).status_code == 401
        # The proxy's token alone passes its check but names no session.
        r = post(proxy_token(), body)
        assert r.status_code == 401 and "invalid API key" in r.json()["error"]["message"]
        assert post(f"{proxy_token()}.sk-relax-guessed", body).status_code == 401
        ok = post(a.api_key, body)
        assert ok.status_code == 200
        cid = ok.json()["id"]
        # Only session a can read its completion; b sees it as unknown.
        assert httpx.get(f"{url}/chat/completions/{cid}", headers={"Authorization": f"Bearer {a.api_key}"}).status_code == 200
        assert httpx.get(f"{url}/chat/completions/{cid}", headers={"Authorization": f"Bearer {b.api_key}"}).status_code == 404
        assert len(a.completions) == 1 and b.completions == []
        for payload, raw, needle in [
            (None, b"{not json", "not valid JSON"),
            ([], None, "JSON object"),
            ({"model": "p"}, None, "messages"),
            ({**body, "n": 0}, None, "n = 0"),
            ({**body, "stream": "yes"}, None, "stream"),
            ({**body, "max_tokens": 0}, None, "max_tokens"),
            ({"messages": [{"role": "robot", "content": "x"}]}, None, "role"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, '"image_url": {"url"'),
            ({"messages": [{"role": "user", "content": [{"type": "video_url"}]}]}, None, "text parts"),
            ({**body, "messages": [{"role": "user", "content": "z" * 300}]}, None, "context"),
        ]:
            r = post(b.api_key, payload, raw)
            assert 400 <= r.status_code < 500, (payload, r.status_code, r.text)
            assert needle in r.json()["error"]["message"]
        # A closed session's key stops working.
        svc.proxy.sessions.close(a)
        r = post(a.api_key, body)
        assert r.status_code == 401 and "expired" in r.json()["error"]["message"]
    finally:
        svc.close()


PROXY_ROUTES = [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/v1/chat/completions/x"),
                ("GET", "/v1/nowhere"), ("GET", "/docs"), ("DELETE", "/v1/models")]


def test_every_route_needs_the_proxys_token() -> None:
    svc, engine = service("agent_doubles:ChatAgent", ["ab"])
    try:
        assert svc.proxy is not None
        root = f"http://127.0.0.1:{svc.proxy.port}"
        session = svc.proxy.sessions.open()
        assert session.api_key.startswith(proxy_token() + ".")  # what the agent gets as api_key
        # A key of the same shape under another token, and the token under another scheme.
        forged = JobSecret.generate().token("agent-proxy") + session.api_key[len(proxy_token()):]
        body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
        for header in (None, "Bearer sk-wrong", f"Bearer {forged}", f"Basic {proxy_token()}",
                       f"Basic {session.api_key}", "Bearer"):
            for method, path in PROXY_ROUTES:
                r = httpx.request(method, root + path, content=body,
                                  headers={"Authorization": header} if header else {}, timeout=30)
                assert r.status_code == 401, (header, method, path, r.status_code)
                assert r.headers["WWW-Authenticate"] == "Bearer"
                assert r.json()["error"] == {"message": PROXY_AUTH_MESSAGE, "type": "authentication_error",
                                             "code": 401}
        assert engine.produced == []
        # The right token: the model list needs nothing more; completions need the session's key.
        for key in (proxy_token(), session.api_key):
            r = httpx.get(f"{root}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "policy"
        r = httpx.post(f"{root}/v1/chat/completions", content=body, timeout=30,
                       headers={"Authorization": f"Bearer {session.api_key}"})
        assert r.status_code == 200 and len(engine.produced) == 1
        # 100 MiB announced with a wrong token, one byte sent: the 401 comes back, the body unread.
        with socket.create_connection(("127.0.0.1", svc.proxy.port), timeout=30) as sock:
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {forged}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {100 << 20}\r\n\r\n{{".encode())
            reply = b""
            while chunk := sock.recv(65536):  # the proxy answers, then closes the connection
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 401 ")
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"] == PROXY_AUTH_MESSAGE
    finally:
        svc.close()


def test_sessions_expire_after_their_ttl() -> None:
    now = [0.0]
    store = SessionStore(10.0, clock=lambda: now[0])
    s = store.open()
    assert store.lookup(s.api_key) is s
    now[0] = 10.0
    with pytest.raises(SessionAuthError, match="expired after 10 s"):
        store.lookup(s.api_key)
    with pytest.raises(SessionAuthError, match="session expired"):
        store.lookup(s.api_key)  # still reported as expired, not unknown
    with pytest.raises(SessionAuthError, match="missing API key"):
        store.lookup(None)


def test_parse_chat_request_accepts_text_parts_and_stop_strings() -> None:
    req = parse_chat_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]}],
                              "max_tokens": 3, "stop": "x"})
    assert req.messages == [{"role": "user", "content": "ab"}] and req.max_tokens == 3 and req.stop == ("x",)
    with pytest.raises(RequestError, match="stop must be"):
        parse_chat_request({"messages": [{"role": "user", "content": "a"}], "stop": [1]})


def test_oversized_and_deeply_nested_bodies_get_4xx_not_500() -> None:
    svc, engine = service("agent_doubles:ChatAgent", ["ab"])
    try:
        assert svc.proxy is not None
        url, port = svc.proxy.base_url, svc.proxy.port
        key = svc.proxy.sessions.open().api_key
        auth = {"Authorization": f"Bearer {key}"}
        limit = svc.proxy.max_body_bytes
        # 100 MiB announced, one byte sent: the 413 comes without the proxy waiting for the rest.
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {100 << 20}\r\n\r\n{{".encode())
            reply = b""
            while chunk := sock.recv(65536):  # the proxy answers, then closes the connection
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 413 ")
        message = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["message"]
        assert message == f"the request body is {100 << 20} bytes; at most {limit} are accepted"

        def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked, counted as it arrives
            for _ in range(limit // (1 << 20) + 2):
                yield b" " * (1 << 20)

        r = httpx.post(f"{url}/chat/completions", content=chunks(), headers=auth, timeout=30)
        assert r.status_code == 413
        assert r.json()["error"]["message"] == f"the request body is over {limit} bytes, the most this proxy accepts"
        # Nested past the decoder's recursion limit, and one level past the proxy's own limit.
        deep = svc.proxy.max_json_depth
        for raw in (b"[" * 100_000, b'{"messages": ' + b"[" * deep + b"]" * deep + b"}"):
            r = httpx.post(f"{url}/chat/completions", content=raw, headers=auth, timeout=30)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == (f"the JSON body nests more than {deep} levels deep; "
                                                    f"at most {deep} are accepted")
        assert engine.produced == []
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(f"{url}/chat/completions", json=body, headers=auth, timeout=30).status_code == 200
    finally:
        svc.close()
