"""`EngineRouter`: N rollout engines behind one `RolloutEngine`, spreading work by load.

The rollout role drives one engine; with `[rollout] num_engines = N` that engine is a router
over N engine clients (in this process, or Ray actors elsewhere). A `generate` call is cut
into chunks of whole prompt groups, `chunks_per_engine` per live engine; each live engine takes
one chunk at a time, so with more than one chunk per engine an engine that finishes early takes
the next one (work goes by load, not by a fixed share). A request
that belongs to a multi-turn session (``sessions=[key, ...]``) goes to the engine that served
that session before, so its prefix stays warm there.

A dead engine (its client says so of the error) is taken out of service, and the chunk it held
goes back to the front of the queue for the others: every prompt gets exactly one answer,
whatever dies, as long as one engine lives. New weights go to every live engine (one shared
copy of the tensors per kind of client, `EngineClient.share`); an engine that dies meanwhile is
dropped there too.

Engines come and go at run time (the elastic API, federated grow jobs; engines/elastic/scaler.py):
`add_engine` registers one ("joining"), `join` gives it the current weights and puts it in
service ("active"), `drain` stops sending it work, waits for what it holds, and retires it
("draining" -> "gone"); an engine that dies is "failed". Entries are never removed, so indices
stay stable and `report()` shows what left. A chunk held by an engine that is retired without
finishing goes back to the queue once, and its late answer is ignored: no prompt is answered
twice, none is dropped.

    router = EngineRouter([LocalEngineClient("engine-0", a), LocalEngineClient("engine-1", b)],
                          tokenizer, eos_id)
    router.generate(prompts, params, seed=7, group_size=8)
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Protocol, Sequence

import torch

from relax_hpc.engines.base import EngineGone, Generation, RolloutEngine, SamplingParams
from relax_hpc.media.items import PromptMedia

log = logging.getLogger(__name__)

Future = concurrent.futures.Future
MAX_SESSIONS = 65_536  # sessions remembered for affinity; a forgotten one is placed anew
RETIRED_POLL_S = 0.5  # how often a generate call looks for chunks held by engines retired meanwhile
MAX_WAIT_S = min(365 * 86_400.0, threading.TIMEOUT_MAX / 2)  # the longest a drain waits for an engine


class EngineClient(Protocol):
    """One engine as the router sees it: calls return futures, so engines work side by side."""

    id: str

    def submit(self, prompts: list[list[int]], params: SamplingParams, seed: int | None,
               media: Sequence[PromptMedia | None] | None = None) -> Future: ...

    def share(self, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> Any:
        """The form of a weight update every client of this kind can load (made once per update
        and kind: the router groups its engines by client class)."""

    def load_weights(self, shared: Any, version: int) -> Future: ...

    def call(self, method: str) -> Future:
        """Run the engine's `pause`, `resume`, `release_memory` or `resume_memory`."""

    def died(self, error: BaseException) -> bool:
        """True when `error` means the engine's process is gone (its work must go elsewhere)."""

    def close(self) -> None: ...


class WeightsUnavailable(RuntimeError):
    """An engine that cannot hand over the weights it serves (an SGLang server, a remote engine
    whose version directory is gone); a joining engine asks another one."""


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

    def share(self, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> Any:
        return named_tensors

    def load_weights(self, shared: Any, version: int) -> Future:
        return self._thread.submit(self.engine.update_weights, shared, version)

    def call(self, method: str) -> Future:
        return self._thread.submit(getattr(self.engine, method))

    def current_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The weights this engine serves, by the names `update_weights` takes (for a joining engine)."""
        model = getattr(self.engine, "model", None)
        if model is None:
            raise WeightsUnavailable(f"engine {self.id} ({type(self.engine).__name__}) cannot hand over its weights")
        return list(model.state_dict().items())

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


class JoinFailed(RuntimeError):
    """An engine could not be given the current weights; it is marked failed and never served."""


@dataclass
class EngineState:
    client: EngineClient
    state: str = "active"  # elastic_api.ENGINE_STATES: joining, active, draining, gone, failed
    samples: int = 0  # responses this engine produced that were kept
    version: int = 0
    busy: bool = False
    sessions: int = 0  # sessions pinned here
    slurm_job: str | None = None  # the Slurm job that runs it when it is not this job's own engine
    protected: bool = True  # an engine of the job's start-up set: scaled in only when forced
    closed: bool = False  # its client was closed (retired engines are closed at once)

    @property
    def alive(self) -> bool:
        """In service: it takes work and weight updates."""
        return self.state == "active"

    @property
    def address(self) -> str:
        return str(getattr(self.client, "address", "") or "in-job")


@dataclass
class _Chunk:
    index: int  # position in the call's chunk list: its results' place, its seed
    rows: list[int]  # indices into the call's prompts
    pinned: int | None = None  # the engine a session chunk must run on (moved if it dies)


class EngineRouter:
    """A `RolloutEngine` over N engine clients; see the module docstring."""

    def __init__(self, clients: Sequence[EngineClient], tokenizer: Any, eos_id: int,
                 chunks_per_engine: int = 1, local_engine: RolloutEngine | None = None) -> None:
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
        # Signalled when an engine finishes a chunk or changes state (drain waits on it).
        self._changed = threading.Condition(self._lock)
        # Held while weights are installed: a join loads the version every other engine runs.
        self._weights_lock = threading.Lock()
        self._installed_version = self.weight_version

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
        """Per engine: its id, address, state, weight version, the samples it produced, the job
        it belongs to (None: this job), whether it is protected from scale-in, whether it serves."""
        with self._lock:
            return [{"id": e.client.id, "address": e.address, "state": e.state, "weight_version": e.version,
                     "samples": e.samples, "job": e.slurm_job, "protected": e.protected, "alive": e.alive}
                    for e in self.engines]

    def serving_by_job(self) -> dict[str, int]:
        """Active engines per job ("main" for this job's own)."""
        counts: dict[str, int] = {}
        with self._lock:
            for e in self.engines:
                if e.alive:
                    counts[e.slurm_job or "main"] = counts.get(e.slurm_job or "main", 0) + 1
        return counts

    # -- engines joining and leaving -------------------------------------------------------------

    def add_engine(self, client: EngineClient, job: str | None = None, protected: bool = False) -> int:
        """Register an engine ("joining"); `join` puts it in service. Returns its index."""
        with self._lock:
            if any(e.client.id == client.id for e in self.engines):
                raise ValueError(f"an engine with id {client.id!r} is already registered")
            self.engines.append(EngineState(client, state="joining", slurm_job=job, protected=protected,
                                            version=getattr(client, "weight_version", 0)))
            return len(self.engines) - 1

    def join(self, k: int, timeout_s: float = 600.0) -> None:
        """Give joining engine k the weights the others run, then put it in service.

        An engine is not sent the weights only when both it and the job run version 0, the model
        directory's weights, which are the same in every attempt of the job. A number above 0
        names weights only within one attempt: after a requeue the run resumes from a checkpoint
        and trains the steps after it again, so an engine that outlived the previous attempt (a
        grow job's) may report the number the job runs now while it holds other weights; it is
        sent the current ones. JoinFailed (the engine marked failed) when the weights cannot be
        had or loaded; nothing it never served can be lost."""
        engine = self.engines[k]
        if engine.state != "joining":
            raise ValueError(f"engine {engine.client.id} is {engine.state}, not joining")
        with self._weights_lock:
            version = self._installed_version
            try:
                if not (engine.version == version == 0):
                    named = self._current_weights()
                    shared = engine.client.share(named, version)
                    engine.client.load_weights(shared, version).result(timeout=timeout_s)
                    engine.version = version
            except BaseException as e:
                self._retire(k, "failed")
                raise JoinFailed(f"engine {engine.client.id} ({engine.address}) could not load weight version "
                                 f"{version}: {type(e).__name__}: {e}") from e
            with self._changed:
                engine.state = "active"
                self._changed.notify_all()
        log.info("rollout engine %s (%s) joined at weight version %d; %d engines serve",
                 engine.client.id, engine.address, version, self.serving())

    def _current_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The installed version's weights, from an engine that can hand them over."""
        problems = []
        for e in self.engines:
            get = getattr(e.client, "current_weights", None)
            if not e.alive or get is None:
                continue
            try:
                return get()
            except WeightsUnavailable as error:
                problems.append(str(error))
        raise JoinFailed("no serving engine can hand over its weights (" + ("; ".join(problems) or
                         "none in this job") + "); engines join with the job's current weights only when a "
                         "native engine of the job serves")

    def drain(self, k: int, timeout_s: float) -> bool:
        """Send engine k no more work, wait up to `timeout_s` for the chunk it holds, then retire
        it ("gone"). True when it finished its work; False when the wait ran out and its chunk
        went back to the queue for the others (its late answer is ignored). The engine is
        retired however the wait ends (an error too): none stays "draining"."""
        engine = self.engines[k]
        # A wait near threading.TIMEOUT_MAX or past it (inf, 1e300) raises OverflowError instead of
        # waiting; NaN waits not at all.
        wait_s = min(max(timeout_s, 0.0), MAX_WAIT_S) if timeout_s == timeout_s else 0.0
        try:
            with self._changed:
                if engine.state in ("gone", "failed"):
                    return True
                engine.state = "draining"
                self._changed.notify_all()
                return self._changed.wait_for(lambda: not engine.busy, timeout=wait_s)
        finally:
            self.retire(k)

    def retire(self, k: int) -> None:
        """Take engine k out of service at once ("gone"; a failed one stays "failed"); a chunk it
        holds goes back to the queue for the others."""
        if self.engines[k].state != "failed":
            self._retire(k, "gone")
        else:
            self._close(self.engines[k])

    def _retire(self, k: int, state: str) -> None:
        engine = self.engines[k]
        with self._changed:
            engine.state = state
            self._changed.notify_all()
        self._close(engine)

    def _close(self, engine: EngineState) -> None:
        with self._lock:
            if engine.closed:
                return
            engine.closed = True
        try:
            engine.client.close()
        except Exception:  # a client that cannot close cleanly is gone all the same
            log.warning("closing rollout engine %s failed", engine.client.id, exc_info=True)

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
        # Each chunk's future posts itself here when it completes: waking up costs the same with
        # 256 chunks running as with 2 (`concurrent.futures.wait` visits every running future).
        finished: queue.SimpleQueue[Future] = queue.SimpleQueue()
        try:
            while todo or running:
                self._dispatch(todo, running, prompts, params, seed, len(chunks), media, finished.put)
                if not running:
                    raise self._no_engine_left(len(prompts))
                for future in self._completed(running, finished):
                    chunk, k = running.pop(future)
                    engine = self.engines[k]
                    self._set_idle(engine)
                    error = future.exception()
                    if error is None:
                        results[chunk.index] = future.result()
                        engine.samples += len(chunk.rows)
                        continue
                    if not engine.client.died(error):
                        raise error
                    self._bury(k, error, len(chunk.rows))
                    todo.appendleft(chunk)  # first in line: its prompts waited longest
                self._take_back_retired(running, todo)
        finally:
            for future, (_, k) in running.items():  # an error above: let nothing dangle as busy
                future.cancel()
                self._set_idle(self.engines[k])
        answers: list[Generation | None] = [None] * len(prompts)
        for chunk, gens in zip(chunks, results):
            assert gens is not None and len(gens) == len(chunk.rows)
            for row, gen in zip(chunk.rows, gens):
                answers[row] = gen
        return [a for a in answers if a is not None]

    @staticmethod
    def _completed(running: dict[Future, tuple[_Chunk, int]], finished: queue.SimpleQueue) -> list[Future]:
        """The running futures that completed: waits up to RETIRED_POLL_S for one, then takes all
        that are there. A future no longer running (taken back from a retired engine) is skipped."""
        try:
            done = [finished.get(timeout=RETIRED_POLL_S)]
        except queue.Empty:
            return []
        while True:
            try:
                done.append(finished.get_nowait())
            except queue.Empty:
                return [future for future in done if future in running]

    def _set_idle(self, engine: EngineState) -> None:
        with self._changed:
            engine.busy = False
            self._changed.notify_all()

    def _take_back_retired(self, running: dict[Future, tuple[_Chunk, int]], todo: collections.deque) -> None:
        """Chunks held by an engine retired meanwhile (a drain that ran out of time, a forced
        scale-in) go back to the front of the queue; their futures are forgotten, so a late
        answer is never used and every prompt is answered once."""
        for future, (chunk, k) in list(running.items()):
            engine = self.engines[k]
            if engine.state in ("gone", "failed"):
                del running[future]
                future.cancel()
                self._set_idle(engine)
                log.warning("rollout engine %s left holding %d prompts; they go to the %d engines serving",
                            engine.client.id, len(chunk.rows), self.serving())
                todo.appendleft(chunk)

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
                  media: Sequence[PromptMedia | None] | None, on_done: Callable[[Future], Any]) -> None:
        """Hand queued chunks to idle live engines (a session chunk only to its engine), lowest
        index first. The idle engines are listed once per call: listed again for every queued
        chunk, on every completion, they took half of the router's time at 256 engines
        (docs/benchmarks.md, "Fleet simulation")."""
        idle = collections.deque(k for k, e in enumerate(self.engines) if e.alive and not e.busy)
        waiting: list[_Chunk] = []  # chunks that found no engine (a session's is busy): they keep their place
        while todo and idle:  # every queued chunk, a session's too, needs an idle engine
            chunk = todo.popleft()
            if chunk.pinned is not None and not self.engines[chunk.pinned].alive:
                dead, chunk.pinned = chunk.pinned, self._least_loaded()  # its sessions move along
                with self._lock:
                    for key in [key for key, k in self._sessions.items() if k == dead]:
                        self._sessions[key] = chunk.pinned
                        self.engines[dead].sessions -= 1
                        self.engines[chunk.pinned].sessions += 1
            while idle and not self._free(idle[0]):
                idle.popleft()  # taken meanwhile by another call, or retired
            k = chunk.pinned if chunk.pinned is not None else (idle[0] if idle else None)
            if k is None or k not in idle or not self._free(k):
                waiting.append(chunk)
                continue
            idle.remove(k)
            engine = self.engines[k]
            with self._lock:
                engine.busy = True
            chunk_seed = seed if seed is None or chunk_count == 1 else seed * 1_000 + chunk.index
            chunk_prompts = [prompts[r] for r in chunk.rows]
            if media is None:  # a text-only call: clients without media support take it too
                future = engine.client.submit(chunk_prompts, params, chunk_seed)
            else:
                future = engine.client.submit(chunk_prompts, params, chunk_seed, [media[r] for r in chunk.rows])
            running[future] = (chunk, k)
            future.add_done_callback(on_done)
        todo.extendleft(reversed(waiting))

    def _free(self, k: int) -> bool:
        return self.engines[k].alive and not self.engines[k].busy

    def _bury(self, k: int, error: BaseException, prompts: int) -> None:
        engine = self.engines[k]
        if engine.state in ("active", "draining", "joining"):
            with self._changed:
                engine.state = "failed"
                self._changed.notify_all()
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
        """Zero-copy binding works only for a single engine in this process (none joined, or
        every engine that joined has left again)."""
        bind = getattr(self._local, "bind_weights", None)
        if bind is None or any(e.state not in ("gone", "failed") for e in self.engines[1:]):
            return False
        with self._weights_lock:
            if not bind(flat, version):
                return False
            self.engines[0].version = self._installed_version = version
        return True

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load `version` into every live engine: one shared form of the tensors per kind of
        client (Ray's object store, a directory on the shared filesystem, ...)."""
        with self._weights_lock:
            live = [(k, e) for k, e in enumerate(self.engines) if e.alive]
            if not live:
                raise self._no_engine_left(0)
            named = list(named_tensors)
            shared: dict[type, Any] = {}
            calls = []
            for k, e in live:
                kind = type(e.client)
                if kind not in shared:
                    shared[kind] = e.client.share(named, version)
                calls.append((k, e.client.load_weights(shared[kind], version)))
            for k, future in calls:
                if self._settled(k, future):
                    self.engines[k].version = version
            self._installed_version = version
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
            self._close(e)
