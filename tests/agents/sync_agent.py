"""A subprocess-mode agent for the tests (standard library + openai only, so a spawned worker
starts fast)."""

from __future__ import annotations

import os


class SyncEnvAgent:
    """Subprocess agent: a sync OpenAI client configured only from the environment."""

    def run(self, data: dict) -> float:
        from openai import OpenAI

        from relax_hpc.auth import job_secret

        # The session's key carries the proxy's token (the spawned worker inherits the job secret).
        assert os.environ["OPENAI_API_KEY"].startswith(job_secret().token("agent-proxy") + ".sk-relax-")
        client = OpenAI()
        msgs = list(data["messages"])
        first = client.chat.completions.create(model="policy", messages=msgs)
        msgs += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "more"}]
        client.chat.completions.create(model="policy", messages=msgs)
        return 2.0
