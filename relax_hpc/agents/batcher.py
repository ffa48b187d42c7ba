"""Batch the generation requests of concurrent episodes or agent sessions into engine calls.

Every episode (or agent session) runs as its own coroutine and awaits `generate` for one prompt.
A rollout engine is fastest when it sees many prompts at once, so requests are held until every
live caller is waiting (then all active episodes generate together, one engine call per turn) or
until `max_wait_s` passes (a caller busy with a slow tool must not stall the others). The engine
runs in a worker thread, so the event loop keeps serving HTTP and environments meanwhile. A
prompt's media (a multimodal model) travel with it; a call whose prompts carry none is made
without them, so engines that read text only are called exactly as before.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Hashable

from relax_hpc.engines.base import Generation, Generator, SamplingParams
from relax_hpc.engines.router import EngineRouter
from relax_hpc.media.items import PromptMedia


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: asyncio.Future[Generation]
    session: Hashable | None = None
    media: PromptMedia | None = None


class EngineBatcher:
    """An async front of an engine (a `Generator`); create it, and use it, inside one event loop.

    `live` is the number of callers that may still submit (set it with `begin(n)` and lower it
    with `finish_one()` as callers end); when all of them are waiting the batch goes at once.
    Each engine call gets the seed `seed_base + k` for its k-th call, so a run is reproducible
    when the callers are (sync environments, a fixed `live`).
    """

    def __init__(self, engine: Generator, max_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.max_wait_s = max_wait_s
        self.seed_base = 0
        self.calls = 0  # engine calls made so far (tests check the batching with it)
        self.batch_sizes: list[int] = []
        self._live = 0
        self._call_in_round = 0
        self._pending: list[_Request] = []
        self._changed: asyncio.Event | None = None
        self._runner: asyncio.Task[None] | None = None

    def begin(self, live: int, seed_base: int) -> None:
        """Start a round of `live` callers whose engine calls are seeded from `seed_base`."""
        self._live, self.seed_base = live, seed_base
        self._call_in_round = 0

    def finish_one(self) -> None:
        """A caller ended: the others need not wait for it any more."""
        self._live = max(0, self._live - 1)
        self._poke()

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       session: Hashable | None = None, media: PromptMedia | None = None) -> Generation:
        """Generate one response; resolves when the batch it joined has been decoded. Calls with
        the same `session` key go to the same engine when the engine is a router over several.
        `media`: the prompt's images / audios, its placeholders already expanded in `prompt_ids`."""
        loop = asyncio.get_running_loop()
        if self._runner is None or self._runner.done():
            self._changed = asyncio.Event()
            self._runner = loop.create_task(self._run())
        request = _Request(list(prompt_ids), params, loop.create_future(), session, media)
        self._pending.append(request)
        self._poke()
        return await request.future

    def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()

    def _poke(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _run(self) -> None:
        assert self._changed is not None
        loop = asyncio.get_running_loop()
        while True:
            while not self._pending:
                self._changed.clear()
                await self._changed.wait()
            deadline = loop.time() + self.max_wait_s
            while len(self._pending) < self._live and loop.time() < deadline:
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), deadline - loop.time())
                except TimeoutError:
                    break
            batch, self._pending = self._pending, []
            await self._decode(batch)

    async def _decode(self, batch: list[_Request]) -> None:
        # One engine call per distinct SamplingParams (usually exactly one), in arrival order.
        by_params: dict[SamplingParams, list[_Request]] = {}
        for request in batch:
            by_params.setdefault(request.params, []).append(request)
        for params, requests in by_params.items():
            seed = self.seed_base + self._call_in_round
            self._call_in_round += 1
            self.calls += 1
            self.batch_sizes.append(len(requests))
            try:
                prompts = [r.prompt_ids for r in requests]
                kwargs: dict[str, Any] = {}
                if any(r.media for r in requests):
                    kwargs["media"] = [r.media for r in requests]
                if isinstance(self.engine, EngineRouter) and any(r.session is not None for r in requests):
                    kwargs["sessions"] = [r.session if r.session is not None else id(r) for r in requests]
                gens = await asyncio.to_thread(self.engine.generate, prompts, params, seed, **kwargs)
            except Exception as e:  # every waiter sees the engine's error
                for r in requests:
                    if not r.future.done():
                        r.future.set_exception(e)
                continue
            for r, gen in zip(requests, gens):
                if not r.future.done():
                    r.future.set_result(gen)
