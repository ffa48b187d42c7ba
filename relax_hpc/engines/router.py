"""`EngineRouter`: N rollout engines behind one `RolloutEngine`, spreading work by load.

The rollout role drives one engine; with `[rollout] num_engines = N` that engine is a router
over N engine clients (in this process, or Ray actors elsewhere). A `generate` call is cut
into chunks of whole prompt groups; each live engine takes one chunk at a time, so an engine
that finishes early takes the next one (work goes by load, not by a fixed share). A request
that belongs to a multi-turn session (``sessions=[key, ...]``) goes to the engine that served
that session before, so its prefix stays warm there.

A dead engine (its client says so of the error) is taken out of service, and the chunk it held
goes back to the front of the queue for the others: every prompt gets exactly one answer,
whatever dies, as long as one engine lives. New weights go to every live engine (one shared
copy of the tensors, `EngineClient.share`); an engine that dies meanwhile is dropped there too.

    router = EngineRouter([LocalEngineClient("engine-0", a), LocalEngineClient("engine-1", b)],
                          tokenizer, eos_id)
    router.generate(prompts, params, seed=7, group_size=8)
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Protocol, Sequence

import torch

from relax_hpc.engines.base import EngineGone, Generation, RolloutEngine, SamplingParams
from relax_hpc.media.items import PromptMedia

log = logging.getLogger(__name__)

Future = concurrent.futures.Future
MAX_SESSIONS = 65_536  # sessions remembered for affinity; a forgotten one is placed anew


class EngineClient(Protocol):
    """One engine as the router sees it: calls return futures, so engines work side by side."""

    id: str

    def submit(self, prompts: list[list[int]], params: SamplingParams, seed: int | None,
               media: Sequence[PromptMedia | None] | None = None) -> Future: ...

    def share(self, named_tensors: list[tuple[str, torch.Tensor]]) -> Any:
        """The form of a weight update every client of this kind can load (made once per update)."""

    def load_weights(self, shared: Any, version: int) -> Future: ...

    def call(self, method: str) -> Future:
        """Run the engine's `pause`, `resume`, `release_memory` or `resume_memory`."""

    def died(self, error: BaseException) -> bool:
        """True when `error` means the engine's process is gone (its work must go elsewhere)."""

    def close(self) -> None: ...


class LocalEngineClient:
    """An engine in this process, run on a thread of its own."""

    def __init__(self, id: str, engine: RolloutEngine) -> None:
        self.id, self.engine = id, engine
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=id)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def submit(self, prompts: list[list[int]], params: SamplingParams, seed: int | None,
               media: Sequence[PromptMedia | None] | None = None) -> Future:
        if media is None:  # engines without media support take the text-only call
            return self._thread.submit(self.engine.generate, prompts, params, seed)
        return self._thread.submit(self.engine.generate, prompts, params, seed, media=media)

    def share(self, named_tensors: list[tuple[str, torch.Tensor]]) -> Any:
        return named_tensors

    def load_weights(self, shared: Any, version: int) -> Future:
        return self._thread.submit(self.engine.update_weights, shared, version)

    def call(self, method: str) -> Future:
        return self._thread.submit(getattr(self.engine, method))

    def died(self, error: BaseException) -> bool:
        # Else a local engine's error is the caller's error.
        return isinstance(error, EngineGone)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        close = getattr(self.engine, "close", None)  # an engine that owns a process stops it
        if close is not None:
            close()


class NoEngineLeft(RuntimeError):
    """Every engine behind the router is dead."""


@dataclass
class EngineState:
    client: EngineClient
    alive: bool = True
    samples: int = 0  # responses this engine produced that were kept
    version: int = 0
    busy: bool = False
    sessions: int = 0  # sessions pinned here


@dataclass
class _Chunk:
    index: int  # position in the call's chunk list: its results' place, its seed
    rows: list[int]  # indices into the call's prompts
    pinned: int | None = None  # the engine a session chunk must run on (moved if it dies)


class EngineRouter:
    """A `RolloutEngine` over N engine clients; see the module docstring."""

    def __init__(self, clients: Sequence[EngineClient], tokenizer: Any, eos_id: int,
                 chunks_per_engine: int = 2, local_engine: RolloutEngine | None = None) -> None:
        if not clients:
            raise ValueError("EngineRouter needs at least one engine client")
        # A fresh engine actor starts at version 0; an engine handed over may hold a later one.
        self.engines = [EngineState(c, version=getattr(c, "weight_version", 0)) for c in clients]
        self.tokenizer, self.eos_id = tokenizer, int(eos_id)
        self.chunks_per_engine = chunks_per_engine
        # With one in-process engine the router lends it out: zero-copy weight binding, its model.
        self._local = local_engine if len(clients) == 1 else None
        # Session key -> engine, newest last; the oldest are forgotten past MAX_SESSIONS.
        self._sessions: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
        self._lock = threading.Lock()

    # -- what the rollout role reads -----------------------------------------------------------

    @property
    def weight_version(self) -> int:
        live = [e.version for e in self.engines if e.alive]
        return min(live) if live else 0

    @property
    def model(self) -> Any:
        return getattr(self._local, "model", None)

    def serving(self) -> int:
        """How many engines are alive."""
        return sum(e.alive for e in self.engines)

    def report(self) -> list[dict[str, Any]]:
        """Per engine: its id, the samples it produced, whether it still serves."""
        return [{"id": e.client.id, "samples": e.samples, "alive": e.alive} for e in self.engines]

    # -- generation ------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None,
                 group_size: int = 1, sessions: Sequence[Hashable] | None = None,
                 media: Sequence[PromptMedia | None] | None = None) -> list[Generation]:
        """Answers to `prompts`, in order. `group_size` consecutive prompts form a group, which
        stays on one engine; `sessions` (one key per prompt) pins each session to one engine.
        One live engine gets the whole call, with `seed` as given (the single-engine run).
        `media`: each prompt's images / videos / audios (a multimodal model), travelling with it."""
        if not prompts:
            return []
        if media is not None and len(media) != len(prompts):
            raise ValueError(f"generate got {len(prompts)} prompts but {len(media)} media entries")
        chunks = self._plan(len(prompts), group_size, sessions)
        results: list[list[Generation] | None] = [None] * len(chunks)
        todo = collections.deque(chunks)
        running: dict[Future, tuple[_Chunk, int]] = {}
        try:
            while todo or running:
                self._dispatch(todo, running, prompts, params, seed, len(chunks), media)
                if not running:
                    raise self._no_engine_left(len(prompts))
                done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    chunk, k = running.pop(future)
                    engine = self.engines[k]
                    engine.busy = False
                    error = future.exception()
                    if error is None:
                        results[chunk.index] = future.result()
                        engine.samples += len(chunk.rows)
                        continue
                    if not engine.client.died(error):
                        raise error
                    self._bury(k, error, len(chunk.rows))
                    todo.appendleft(chunk)  # first in line: its prompts waited longest
        finally:
            for future, (_, k) in running.items():  # an error above: let nothing dangle as busy
                future.cancel()
                self.engines[k].busy = False
        answers: list[Generation | None] = [None] * len(prompts)
        for chunk, gens in zip(chunks, results):
            assert gens is not None and len(gens) == len(chunk.rows)
            for row, gen in zip(chunk.rows, gens):
                answers[row] = gen
        return [a for a in answers if a is not None]

    def _plan(self, n: int, group_size: int, sessions: Sequence[Hashable] | None) -> list[_Chunk]:
        if sessions is not None:
            if len(sessions) != n:
                raise ValueError(f"generate got {n} prompts but {len(sessions)} session keys")
            by_engine: dict[int, list[int]] = {}
            for row, key in enumerate(sessions):
                by_engine.setdefault(self._engine_for(key), []).append(row)
            return [_Chunk(i, rows, pinned=k) for i, (k, rows) in enumerate(sorted(by_engine.items()))]
        size = max(1, group_size)
        groups = [list(range(start, min(start + size, n))) for start in range(0, n, size)]
        live = self.serving()
        count = 1 if live <= 1 else min(len(groups), live * self.chunks_per_engine)
        chunks, start = [], 0
        for i in range(count):  # contiguous, sizes differing by at most one group
            stop = start + len(groups) // count + (1 if i < len(groups) % count else 0)
            chunks.append(_Chunk(i, [row for g in groups[start:stop] for row in g]))
            start = stop
        return chunks

    def _engine_for(self, key: Hashable) -> int:
        with self._lock:
            k = self._sessions.get(key)
            if k is None or not self.engines[k].alive:
                if k is not None:
                    self.engines[k].sessions -= 1
                k = self._least_loaded()
                self.engines[k].sessions += 1
            self._sessions[key] = k
            self._sessions.move_to_end(key)
            while len(self._sessions) > MAX_SESSIONS:
                _, old = self._sessions.popitem(last=False)
                self.engines[old].sessions -= 1
            return k

    def _least_loaded(self) -> int:
        live = [k for k, e in enumerate(self.engines) if e.alive]
        if not live:
            raise self._no_engine_left(0)
        return min(live, key=lambda k: (self.engines[k].sessions, self.engines[k].samples, k))

    def _dispatch(self, todo: collections.deque, running: dict, prompts: list[list[int]],
                  params: SamplingParams, seed: int | None, chunk_count: int,
                  media: Sequence[PromptMedia | None] | None = None) -> None:
        """Hand queued chunks to idle live engines (a session chunk only to its engine)."""
        for _ in range(len(todo)):
            chunk = todo.popleft()
            if chunk.pinned is not None and not self.engines[chunk.pinned].alive:
                dead, chunk.pinned = chunk.pinned, self._least_loaded()  # its sessions move along
                with self._lock:
                    for key in [key for key, k in self._sessions.items() if k == dead]:
                        self._sessions[key] = chunk.pinned
                        self.engines[dead].sessions -= 1
                        self.engines[chunk.pinned].sessions += 1
            idle = [k for k, e in enumerate(self.engines) if e.alive and not e.busy]
            k = chunk.pinned if chunk.pinned is not None else (idle[0] if idle else None)
            if k is None or self.engines[k].busy:
                todo.append(chunk)
                continue
            engine = self.engines[k]
            engine.busy = True
            chunk_seed = seed if seed is None or chunk_count == 1 else seed * 1_000 + chunk.index
            chunk_prompts = [prompts[r] for r in chunk.rows]
            if media is None:  # a text-only call: clients without media support take it too
                future = engine.client.submit(chunk_prompts, params, chunk_seed)
            else:
                future = engine.client.submit(chunk_prompts, params, chunk_seed, [media[r] for r in chunk.rows])
            running[future] = (chunk, k)

    def _bury(self, k: int, error: BaseException, prompts: int) -> None:
        engine = self.engines[k]
        if engine.alive:
            engine.alive = False
            log.warning("rollout engine %s died (%s); %d prompts of its work go to the %d engines left",
                        engine.client.id, str(error).strip().splitlines()[-1] if str(error).strip() else
                        type(error).__name__, prompts, self.serving())

    def _no_engine_left(self, prompts: int) -> NoEngineLeft:
        ids = ", ".join(e.client.id for e in self.engines)
        return NoEngineLeft(
            f"all {len(self.engines)} rollout engines ({ids}) died"
            + (f" with {prompts} prompts unanswered" if prompts else "")
            + "; nothing of this step was trained. Check the engines' logs, then resubmit: the run "
            "resumes from its last checkpoint"
        )

    # -- weights and memory ----------------------------------------------------------------------

    def bind_weights(self, flat: Any, version: int) -> bool:
        """Zero-copy binding works only for a single engine in this process."""
        bind = getattr(self._local, "bind_weights", None)
        if bind is None or not bind(flat, version):
            return False
        self.engines[0].version = version
        return True

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load `version` into every live engine (they share one copy of the tensors)."""
        live = [(k, e) for k, e in enumerate(self.engines) if e.alive]
        if not live:
            raise self._no_engine_left(0)
        shared = live[0][1].client.share(list(named_tensors))
        for k, future in [(k, e.client.load_weights(shared, version)) for k, e in live]:
            if self._settled(k, future):
                self.engines[k].version = version
        if not self.serving():
            raise self._no_engine_left(0)

    def _settled(self, k: int, future: Future) -> bool:
        """Wait for a call on engine k: True when it succeeded, False when the engine died."""
        error = future.exception()
        if error is None:
            return True
        if not self.engines[k].client.died(error):
            raise error
        self._bury(k, error, 0)
        return False

    def _on_all(self, method: str) -> list[Any]:
        calls = [(k, e.client.call(method)) for k, e in enumerate(self.engines) if e.alive]
        return [f.result() for k, f in calls if self._settled(k, f)]

    def pause(self) -> None:
        self._on_all("pause")

    def resume(self) -> None:
        self._on_all("resume")

    def release_memory(self) -> int:
        return sum(int(freed or 0) for freed in self._on_all("release_memory"))

    def resume_memory(self) -> None:
        self._on_all("resume_memory")

    def close(self) -> None:
        for e in self.engines:
            e.client.close()
