"""A subprocess-mode agent for the tests (standard library + openai only, so a spawned worker
starts fast)."""

from __future__ import annotations

import os


class SyncEnvAgent:
    """Subprocess agent: a sync OpenAI client configured only from the environment."""

    def run(self, data: dict) -> float:
        import re

        from openai import OpenAI

        # The session's key carries the proxy's token (64 hex digits; the proxy refuses the calls
        # below with 401 unless it is the right one); the worker itself gets no job credentials.
        assert re.fullmatch(r"[0-9a-f]{64}\.sk-relax-[A-Za-z0-9_-]+", os.environ["OPENAI_API_KEY"])
        assert "RELAX_HPC_SECRET_FILE" not in os.environ and "RAY_AUTH_TOKEN_PATH" not in os.environ
        client = OpenAI()
        msgs = list(data["messages"])
        first = client.chat.completions.create(model="policy", messages=msgs)
        msgs += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "more"}]
        client.chat.completions.create(model="policy", messages=msgs)
        return 2.0
