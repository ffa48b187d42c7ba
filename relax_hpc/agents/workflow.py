"""Run user agent workflows against the proxy and collect their sessions.

An agent is a class whose instances have

    async def run(self, data: dict, **extra_kwargs) -> float | dict[str, float]

(a plain `def run` is accepted in subproc mode). One instance is made per session. `data` is
the dataset row: {"prompt", "label", "metadata", "messages", "media_parts"} where "messages" is
the prompt as a one-message chat and "media_parts" the row's images and audio as OpenAI content
parts (`image_url` / `input_audio` with inline data, [] for a row without media), ready to put
in a user message's content. The return value is the reward of the session's last completion, or a dict
{completion_id: reward} (completion ids are the `id` of the SDK's responses).

Modes:
- "inline": the coroutine runs in the rollout worker's event loop with keyword arguments
  `base_url`, `api_key` and `http_client` (a shared `httpx.AsyncClient`), e.g.
  `AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)`.
- "subproc": it runs in a process pool (`agent_subproc_max_workers` processes); `OPENAI_BASE_URL`
  and `OPENAI_API_KEY` are set in its environment, so `OpenAI()` works unchanged.

`api_key` is the session's key, `<proxy token>.<session part>`: the proxy requires its token on
every request (proxy.py), so an agent authenticates by using the key it was given as is.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from relax_hpc.agents.dotted import load_dotted
from relax_hpc.agents.export import CompletionRecord
from relax_hpc.agents.proxy import AgentProxy
from relax_hpc.agents.subproc import run_agent_in_worker

AgentMode = Literal["inline", "subproc"]


@dataclass
class SessionResult:
    records: list[CompletionRecord]
    result: float | Mapping[str, float]


class AgentRunner:
    """Runs sessions of one agent class; create and use it inside the proxy's event loop."""

    def __init__(self, agent_path: str, mode: AgentMode, proxy: AgentProxy, max_workers: int = 4) -> None:
        if mode not in ("inline", "subproc"):
            raise ValueError(f'[rollout] agent_mode = "{mode}": must be "inline" or "subproc"')
        self.agent_path, self.mode, self.proxy = agent_path, mode, proxy
        self.agent_class = load_dotted("[rollout] agent", agent_path)
        if not callable(getattr(self.agent_class, "run", None)):
            raise ValueError(f'[rollout] agent = "{agent_path}": the class has no run(self, data, **kwargs) method')
        self._http: Any = None
        self._pool: ProcessPoolExecutor | None = None
        if mode == "subproc":
            # spawn, not fork: the rollout process holds threads (torch, the event loop).
            self._pool = ProcessPoolExecutor(max_workers, mp_context=multiprocessing.get_context("spawn"))

    async def run_session(self, data: Mapping[str, Any]) -> SessionResult:
        """Open a session, run the agent once, close the session; its key stops working after."""
        session = self.proxy.sessions.open()
        try:
            if self.mode == "inline":
                result = await self._run_inline(data, session.api_key)
            else:
                assert self._pool is not None
                loop = asyncio.get_running_loop()
                result = await loop.run_in_executor(
                    self._pool, run_agent_in_worker, self.agent_path, dict(data),
                    self.proxy.base_url, session.api_key,
                )
        finally:
            records = self.proxy.sessions.close(session)
        return SessionResult(list(records), result)

    async def _run_inline(self, data: Mapping[str, Any], api_key: str) -> Any:
        from relax_hpc.ops.http import async_http_client

        if self._http is None:
            self._http = async_http_client(600.0)  # the job's own proxy: no redirects, no HTTP(S)_PROXY
        agent = self.agent_class()
        out = agent.run(dict(data), base_url=self.proxy.base_url, api_key=api_key, http_client=self._http)
        if not inspect.isawaitable(out):
            raise TypeError(f'[rollout] agent = "{self.agent_path}": in inline mode run() must be '
                            "async (async def run); use agent_mode = \"subproc\" for a sync agent")
        return await out

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
