"""Simulated rollout engines: many of them behind the real `EngineRouter`, without a model.

`SimulatedEngineClient` is an `EngineClient` (engines/router.py) that answers a chunk of prompts
after the time a latency model gives for it, with responses whose lengths follow a long-tailed
distribution. It computes nothing while it "generates": one `Timeline` thread completes the
futures of every client at their due times, so hundreds of engines fit in one process on a
small host and the router and the transfer queue are what does the work. `benchmarks/sim_fleet.py`
drives a fleet of them (docs/benchmarks.md, "Fleet simulation").

The latency model is that of `NativeEngine`, which batches statically: a chunk of B prompts is
left-padded to its longest prompt (width W), prefilled once, then decoded one step at a time for
the whole batch until its longest response ends:

    seconds = call_s + prefill_s_per_token * B * W + steps * (decode_step_s + decode_s_per_token * B)

with `steps` the longest response of the chunk. `EngineTimings()` holds the constants measured on
the tiny model (`python benchmarks/sim_fleet.py --measure`); pass others for another engine.

    timeline = Timeline()
    clients = [SimulatedEngineClient(f"engine-{i}", timeline, seed=i) for i in range(256)]
    router = EngineRouter(clients, tokenizer=None, eos_id=SIM_EOS)
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from relax_hpc.engines.base import EngineGone, Generation, SamplingParams
from relax_hpc.engines.router import Future
from relax_hpc.media.items import PromptMedia

SIM_EOS = 2  # the token a simulated response that stops ends with
SIM_TOKEN = 7  # every other simulated token


@dataclass(frozen=True)
class EngineTimings:
    """What one engine's batch costs, in seconds (see the module docstring for the formula).

    Defaults: the tiny model (hidden 64, 2 layers) on `NativeEngine` with `LeanDecoder`, one torch
    thread, float32, on the 2-core CPU development host, measured on 2026-11-24 by
    `python benchmarks/sim_fleet.py --measure` (EOS off, so every row decodes to the end; median
    of 5 timed calls per shape; decode from the difference of 72 and 8 new tokens at batches 1, 8,
    32, 64; prefill from one new token, less that step, at batches 1, 8, 32 and widths 16, 64,
    128; straight lines fitted to relative error). Each value is the median of three runs, which
    spread by about 10% (call 0.85-0.98 ms, prefill 5.5-5.9 us, step 0.49-0.52 ms, per row
    13.8-15.1 us). A decode step of 32 rows costs 0.97 ms, of 64 rows 1.45 ms.
    """

    call_s: float = 0.00089  # per generate call: padding, set-up, the first forward's fixed cost
    prefill_s_per_token: float = 5.8e-6  # per padded prompt token (B x W)
    decode_step_s: float = 0.00050  # per decode step, whatever the batch
    decode_s_per_token: float = 14.8e-6  # per decode step and row of the batch
    load_s: float = 0.00015  # one weight update (`update_weights`, copied in place)

    def chunk_seconds(self, prompt_lens: Sequence[int], response_lens: Sequence[int]) -> float:
        """How long one generate call of these prompts, answered with these lengths, takes."""
        if not prompt_lens:
            return 0.0
        batch, width, steps = len(prompt_lens), max(prompt_lens), max(response_lens)
        return (self.call_s + self.prefill_s_per_token * batch * width
                + steps * (self.decode_step_s + self.decode_s_per_token * batch))


@dataclass(frozen=True)
class ResponseLengths:
    """Long-tailed response lengths: a fraction `truncated` runs to max_new_tokens; the others are
    lognormal with median `median` and shape `sigma`, at least 1 token, cut at max_new_tokens."""

    median: float = 128.0
    sigma: float = 1.0
    truncated: float = 0.02

    def draw(self, rng: random.Random, n: int, max_new_tokens: int) -> list[int]:
        mu = math.log(max(self.median, 1.0))
        out = []
        for _ in range(n):
            if rng.random() < self.truncated:
                out.append(max_new_tokens)
            else:
                out.append(min(max_new_tokens, max(1, round(rng.lognormvariate(mu, self.sigma)))))
        return out


class Timeline:
    """Runs callbacks at their due times, on one thread that sleeps in between.

    `thread=False` starts none: a test then moves its own `clock` and calls `run_due()`.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, thread: bool = True) -> None:
        self.clock = clock
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        if thread:
            self._thread = threading.Thread(target=self._run, name="sim-timeline", daemon=True)
            self._thread.start()

    def at(self, due: float, fn: Callable[[], None]) -> None:
        entry = (due, next(self._order), fn)
        with self._cond:
            heapq.heappush(self._heap, entry)
            if self._heap[0] is entry:  # earlier than what the thread sleeps towards
                self._cond.notify()

    def run_due(self) -> int:
        """Run every callback whose time has come; returns how many ran."""
        ran = 0
        while True:
            with self._cond:
                if not self._heap or self._heap[0][0] > self.clock():
                    return ran
                _, _, fn = heapq.heappop(self._heap)
            fn()
            ran += 1

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > self.clock()):
                    self._cond.wait(None if not self._heap else self._heap[0][0] - self.clock())
                if self._closed:
                    return
            self.run_due()


class SimulatedEngineClient:
    """An `EngineClient` whose engine is the latency model; see the module docstring.

    Like a real engine it does one thing at a time: work submitted while it is busy starts when
    the previous call ends. The lengths of a chunk's responses are drawn from a generator seeded
    by the chunk's seed, so a run with a seed is repeatable. `busy_s`, `calls` and `samples`
    count what it did; `submit_cpu_s` is the CPU time its callers spent in `submit`.
    """

    def __init__(self, id: str, timeline: Timeline, timings: EngineTimings = EngineTimings(),
                 lengths: ResponseLengths = ResponseLengths(), seed: int = 0, version: int = 0) -> None:
        self.id, self.timeline, self.timings, self.lengths = id, timeline, timings, lengths
        self._rng = random.Random(seed)
        self._version = version
        self._free_at = 0.0  # when the engine finishes what it was given
        self._lock = threading.Lock()
        self.busy_s = 0.0
        self.calls = 0
        self.samples = 0
        self.submit_cpu_s = 0.0  # the caller's CPU spent in `submit`: the simulation's, not the router's

    @property
    def weight_version(self) -> int:
        return self._version

    def _schedule(self, seconds: float, finish: Callable[[], Any]) -> Future:
        future: Future = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            start = max(self.timeline.clock(), self._free_at)
            self._free_at = start + seconds
            self.busy_s += seconds

        def complete() -> None:
            try:
                future.set_result(finish())
            except Exception as error:  # reported through the future, as an engine's error
                future.set_exception(error)

        self.timeline.at(start + seconds, complete)
        return future

    def submit(self, prompts: list[list[int]], params: SamplingParams, seed: int | None,
               media: Sequence[PromptMedia | None] | None = None) -> Future:
        cpu0 = time.thread_time()
        rng = self._rng if seed is None else random.Random(seed)
        lens = self.lengths.draw(rng, len(prompts), params.max_new_tokens)
        seconds = self.timings.chunk_seconds([len(p) for p in prompts], lens)
        self.calls += 1
        self.samples += len(prompts)
        version = self._version  # a chunk runs on the weights it started with

        def answer() -> list[Generation]:
            return [_generation(p, n, params.max_new_tokens, version) for p, n in zip(prompts, lens)]

        future = self._schedule(seconds, answer)
        self.submit_cpu_s += time.thread_time() - cpu0
        return future

    def share(self, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> Any:
        return named_tensors

    def load_weights(self, shared: Any, version: int) -> Future:
        def install() -> int:
            self._version = version
            return version

        return self._schedule(self.timings.load_s, install)

    def call(self, method: str) -> Future:
        return self._schedule(0.0, lambda: 0 if method == "release_memory" else None)

    def died(self, error: BaseException) -> bool:
        return isinstance(error, EngineGone)

    def close(self) -> None:
        pass


def _generation(prompt: list[int], length: int, max_new_tokens: int, version: int) -> Generation:
    stops = length < max_new_tokens
    tokens = [SIM_TOKEN] * (length - 1) + [SIM_EOS if stops else SIM_TOKEN]
    return Generation(prompt, tokens, [-1.0] * length, "stop" if stops else "length", version)
