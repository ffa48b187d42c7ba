"""Simulated engines: the latency model, the long-tailed lengths, futures completed on a virtual
clock, and the real router over a fleet of them."""

from __future__ import annotations

import random
import threading
from concurrent.futures import Future
from typing import Any, Callable

import pytest

from relax_hpc.engines.base import Generation, SamplingParams
from relax_hpc.engines.router import EngineRouter, EngineState
from relax_hpc.engines.sim_engine import (
    SIM_EOS,
    EngineTimings,
    ResponseLengths,
    SimulatedEngineClient,
    Timeline,
)


class VirtualClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


TIMINGS = EngineTimings(call_s=0.5, prefill_s_per_token=0.01, decode_step_s=0.2, decode_s_per_token=0.05, load_s=3.0)


def test_a_chunk_costs_its_padded_prefill_and_its_longest_response() -> None:
    # 2 prompts of 10 and 20 tokens padded to 20: 0.01 * 2 * 20 = 0.4 s of prefill; the batch
    # decodes until the longer response (5 tokens) ends: 5 * (0.2 + 0.05 * 2) = 1.5 s; plus 0.5 s.
    assert TIMINGS.chunk_seconds([10, 20], [5, 3]) == pytest.approx(0.5 + 0.4 + 1.5)
    assert TIMINGS.chunk_seconds([], []) == 0.0


def test_lengths_have_a_tail_that_runs_to_max_new_tokens() -> None:
    rng = random.Random(0)
    assert ResponseLengths(median=5, sigma=0.0, truncated=0.0).draw(rng, 4, 100) == [5, 5, 5, 5]
    assert ResponseLengths(truncated=1.0).draw(rng, 3, 17) == [17, 17, 17]
    lens = ResponseLengths(median=20, sigma=1.0, truncated=0.05).draw(rng, 2000, 200)
    assert all(1 <= n <= 200 for n in lens)
    assert sorted(lens)[1000] < 40  # most are short ...
    assert lens.count(200) > 100  # ... and some hit the cap: the 5% plus the lognormal's tail


def test_the_engine_answers_when_its_latency_has_passed_on_a_virtual_clock() -> None:
    clock = VirtualClock()
    timeline = Timeline(clock, thread=False)
    lengths = ResponseLengths(median=4, sigma=0.0, truncated=0.0)
    client = SimulatedEngineClient("e0", timeline, TIMINGS, lengths)
    params = SamplingParams(max_new_tokens=6)
    first = client.submit([[1] * 10, [1] * 20], params, seed=3)
    second = client.submit([[1] * 20], params, seed=4)  # queued behind the first: one call at a time
    latency = TIMINGS.chunk_seconds([10, 20], [4, 4])  # 0.5 + 0.4 + 4 * 0.3 = 2.1 s
    clock.now += latency - 0.01
    assert timeline.run_due() == 0 and not first.done()
    clock.now += 0.01
    assert timeline.run_due() == 1 and first.done() and not second.done()
    gens = first.result()
    assert [len(g.token_ids) for g in gens] == [4, 4]
    assert all(g.finish_reason == "stop" and g.token_ids[-1] == SIM_EOS and len(g.logprobs) == 4 for g in gens)
    clock.now += TIMINGS.chunk_seconds([20], [4])
    assert timeline.run_due() == 1 and second.done()
    assert client.calls == 2 and client.samples == 3
    assert client.busy_s == pytest.approx(latency + TIMINGS.chunk_seconds([20], [4]))


def test_a_chunk_runs_on_the_weights_it_started_with_and_loads_take_their_time() -> None:
    clock = VirtualClock()
    timeline = Timeline(clock, thread=False)
    client = SimulatedEngineClient("e0", timeline, TIMINGS, ResponseLengths(truncated=1.0))
    chunk = client.submit([[1]], SamplingParams(max_new_tokens=2), seed=None)
    load = client.load_weights([], 7)
    clock.now += TIMINGS.chunk_seconds([1], [2])
    timeline.run_due()
    assert chunk.result()[0].weight_version == 0 and chunk.result()[0].finish_reason == "length"
    assert not load.done() and client.weight_version == 0
    clock.now += TIMINGS.load_s
    timeline.run_due()
    assert load.result() == 7 and client.weight_version == 7


def test_lengths_follow_the_chunk_seed_whichever_engine_runs_it() -> None:
    clock = VirtualClock()
    timeline = Timeline(clock, thread=False)
    lengths = ResponseLengths(median=10, sigma=1.0, truncated=0.1)
    a = SimulatedEngineClient("a", timeline, TIMINGS, lengths, seed=1)
    b = SimulatedEngineClient("b", timeline, TIMINGS, lengths, seed=2)
    params = SamplingParams(max_new_tokens=50)
    fa, fb = a.submit([[1]] * 8, params, seed=11), b.submit([[1]] * 8, params, seed=11)
    clock.now += TIMINGS.chunk_seconds([1] * 8, [50] * 8)  # the longest these can take
    assert timeline.run_due() == 2
    assert [len(g.token_ids) for g in fa.result()] == [len(g.token_ids) for g in fb.result()]


def test_the_real_router_spreads_a_step_over_simulated_engines() -> None:
    timeline = Timeline()  # real time; the timings are zero, so chunks complete at once
    try:
        clients = [SimulatedEngineClient(f"engine-{i}", timeline, seed=i) for i in range(8)]
        router = EngineRouter(clients, tokenizer=None, eos_id=SIM_EOS)
        prompts = [[k] * 3 for k in range(64)]
        gens = router.generate(prompts, SamplingParams(max_new_tokens=8), seed=5, group_size=4)
        assert [g.prompt_ids for g in gens] == prompts  # every prompt answered once, in order
        assert sum(c.calls for c in clients) == 8  # one chunk per engine (the default)
        assert sum(c.samples for c in clients) == 64
        router.update_weights([], 3)
        assert router.weight_version == 3 and all(c.weight_version == 3 for c in clients)
    finally:
        timeline.close()


class HeldClient:
    """An engine client whose chunks complete only when the test releases them."""

    def __init__(self, id: str, held: list[tuple[Future, list[Generation]]], cond: threading.Condition) -> None:
        self.id, self.held, self.cond = id, held, cond

    def submit(self, prompts: list[list[int]], params: SamplingParams, seed: int | None, media: Any = None) -> Future:
        future: Future = Future()
        with self.cond:
            self.held.append((future, [Generation(p, [SIM_EOS], [-1.0], "stop", 0) for p in prompts]))
            self.cond.notify_all()
        return future

    def died(self, error: BaseException) -> bool:
        return False

    def close(self) -> None:
        pass


def test_handing_out_a_chunk_looks_at_each_engine_once_not_once_per_queued_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """256 chunks over 64 engines, completed one at a time: each hand-out lists the idle engines
    once (about 64 looks), where it used to list them again for every queued chunk (~1.2M looks)."""
    looks = [0]

    def alive(self: EngineState) -> bool:
        looks[0] += 1
        return self.state == "active"

    monkeypatch.setattr(EngineState, "alive", property(alive))
    held: list[tuple[Future, list[Generation]]] = []
    cond = threading.Condition()
    engines = 64
    clients: list[Any] = [HeldClient(f"e{i}", held, cond) for i in range(engines)]
    router = EngineRouter(clients, None, SIM_EOS, chunks_per_engine=4)
    prompts = [[k] for k in range(256)]
    out: list[list[Generation]] = []
    caller = threading.Thread(target=lambda: out.append(router.generate(prompts, SamplingParams(), seed=1)))
    caller.start()
    def handed_out(n: int) -> Callable[[], bool]:
        return lambda: len(held) == n

    released = 0
    while released < 256:  # complete the oldest chunk, then wait until the router hands out the next
        with cond:
            assert cond.wait_for(handed_out(min(256, engines + released)), timeout=60)
            future, gens = held[released]
        future.set_result(gens)
        released += 1
    caller.join(timeout=60)
    assert [g.prompt_ids for g in out[0]] == prompts
    assert looks[0] <= 2 * 256 * (engines + 8)
