"""Limits of the agent side: request media decode a bounded number at a time
(relax_hpc/agents/media.py), the store of ended sessions' keys stays bounded
(relax_hpc/agents/sessions.py), and a subprocess agent's code, and what it starts, gets no job
credentials in its environment (relax_hpc/agents/subproc.py)."""

from __future__ import annotations

import io
import textwrap
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from relax_hpc.agents import media as agent_media
from relax_hpc.agents.media import MAX_CONCURRENT_DECODES, MediaPart, load_part
from relax_hpc.agents.sessions import MAX_EXPIRED_KEYS, SessionAuthError, SessionStore
from relax_hpc.agents.subproc import run_agent_in_worker
from relax_hpc.auth.worker_env import CREDENTIAL_VARS
from relax_hpc.media.canonical import Geometry
from relax_hpc.media.encode import data_url
from relax_hpc.media.load import DEFAULT_MEDIA_LIMITS

GEOM = Geometry(patch=8, merge=2, temporal=2, min_pixels=16 * 16, max_pixels=64 * 64, audio_rate=16000)


@dataclass(frozen=True)
class _Family:
    kinds: tuple[str, ...] = ("image",)
    model_type: str = "tiny"


class _Processor:
    family = _Family()

    def geometry(self) -> Geometry:
        return GEOM

    def token_count(self, item: Any) -> int:
        return 1


def _png_url() -> str:
    buf = io.BytesIO()
    Image.fromarray(np.full((24, 40, 3), 7, np.uint8)).save(buf, format="PNG")
    return data_url(buf.getvalue(), "image/png")


def test_request_media_decode_at_most_a_few_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight requests' images at once: never more than MAX_CONCURRENT_DECODES decode together.

    Each decode holds its slot until one more would be decoding beside it (a bound broken) or a
    while has passed; what is counted is how many were ever inside at once."""
    assert 1 <= MAX_CONCURRENT_DECODES < 8
    inside, most, decoded = 0, 0, 0
    cond = threading.Condition()
    original = agent_media.load_media

    def counting_load(*args: Any, **kwargs: Any) -> Any:
        nonlocal inside, most, decoded
        with cond:
            inside += 1
            most = max(most, inside)
            cond.notify_all()
            cond.wait_for(lambda: inside > MAX_CONCURRENT_DECODES, timeout=0.15)
        try:
            return original(*args, **kwargs)
        finally:
            with cond:
                inside -= 1
                decoded += 1

    monkeypatch.setattr(agent_media, "load_media", counting_load)
    url = _png_url()
    items: list[Any] = []
    threads = [threading.Thread(target=lambda k=k: items.append(
        load_part(MediaPart("image", url, f"messages[{k}].content[0]"), _Processor(), DEFAULT_MEDIA_LIMITS)))
        for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert decoded == 8 and len(items) == 8 and all(i.data.shape == (32, 32, 3) for i in items)
    assert most == MAX_CONCURRENT_DECODES


def test_the_keys_of_ended_sessions_are_remembered_up_to_a_bound() -> None:
    store = SessionStore(60.0)
    keys = []
    for _ in range(MAX_EXPIRED_KEYS + 50):
        session = store.open()
        store.close(session)
        keys.append(session.api_key)
    assert len(store) == 0 and len(store._expired) == MAX_EXPIRED_KEYS
    with pytest.raises(SessionAuthError, match="^session expired"):
        store.lookup(keys[-1])
    with pytest.raises(SessionAuthError, match="^session expired"):
        store.lookup(keys[50])  # the oldest one still remembered
    with pytest.raises(SessionAuthError, match="^invalid API key"):
        store.lookup(keys[49])  # forgotten: still refused


def test_a_session_that_times_out_is_remembered_within_the_bound_too() -> None:
    now = [0.0]
    store = SessionStore(10.0, clock=lambda: now[0], max_expired_keys=2)
    sessions = [store.open() for _ in range(3)]
    now[0] = 11.0
    for s in sessions:
        with pytest.raises(SessionAuthError, match="^session expired after 10 s"):
            store.lookup(s.api_key)
    assert list(store._expired) == [sessions[1].api_key, sessions[2].api_key]
    with pytest.raises(ValueError, match="max_expired_keys must be >= 0, got -1"):
        SessionStore(10.0, max_expired_keys=-1)


AGENT = """
    import json
    import os
    import subprocess
    import sys

    CHILD = "import json, os; print(json.dumps(dict(os.environ)))"


    class EnvAgent:
        def run(self, data):
            # What the agent's code sees, and what a tool it starts (a shell, a sandbox) sees.
            child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
            return {"own": dict(os.environ), "child": json.loads(child.stdout)}
"""


def test_a_subprocess_agent_and_the_tools_it_starts_get_no_job_credentials(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "env_agent_mod.py").write_text(textwrap.dedent(AGENT))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in CREDENTIAL_VARS:
        monkeypatch.setenv(name, f"/jobs/run-1/.{name.lower()}")
    monkeypatch.setenv("RELAX_TEST_KEEP", "kept")
    assert set(CREDENTIAL_VARS) >= {"RELAX_HPC_SECRET_FILE", "RAY_AUTH_TOKEN_PATH"}
    seen = run_agent_in_worker("env_agent_mod:EnvAgent", {}, "http://127.0.0.1:1/v1", "key.sk-relax-x")
    for where in ("own", "child"):
        assert not set(CREDENTIAL_VARS) & set(seen[where]), where
        assert seen[where]["RELAX_TEST_KEEP"] == "kept"
    assert seen["own"]["OPENAI_API_KEY"] == seen["child"]["OPENAI_API_KEY"] == "key.sk-relax-x"

