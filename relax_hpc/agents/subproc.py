"""What a subprocess-mode agent runs in its pool worker (standard library only, so that the
worker starts quickly: it never imports torch).

Before the agent's module is imported, the job's credentials leave the worker's environment
(`relax_hpc.auth.worker_env`): an agent's tools may run code the model wrote, and what they
start inherits the worker's environment.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
from typing import Any

from relax_hpc.auth.worker_env import drop_credentials_from_environ


def run_agent_in_worker(agent_path: str, data: Any, base_url: str, api_key: str) -> Any:
    """Instantiate the agent class and run it once with the session's endpoint in the environment.

    The variables are set for the duration of the call: a pool worker runs one task at a time.
    """
    drop_credentials_from_environ()
    module_name, _, attr = agent_path.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    saved = {k: os.environ.get(k) for k in ("OPENAI_BASE_URL", "OPENAI_API_KEY")}
    os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"] = base_url, api_key
    try:
        result = cls().run(data)
        if inspect.isawaitable(result):
            result = asyncio.run(_await(result))
        return result
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def _await(awaitable: Any) -> Any:
    return await awaitable
