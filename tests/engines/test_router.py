"""EngineRouter: work spread by load, groups and sessions kept together, dead engines' work
moved exactly once, weights to every live engine."""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from relax_hpc.engines.base import SamplingParams
from relax_hpc.engines.memory import ScriptedEngine
from relax_hpc.engines.router import EngineRouter, LocalEngineClient, NoEngineLeft
from relax_hpc.models.hf import load_tokenizer

PARAMS = SamplingParams(max_new_tokens=4)


class EngineGone(RuntimeError):
    """What a client reports when its engine's process is gone."""


class MortalClient(LocalEngineClient):
    """A local client whose engine 'dies' on its `die_on`-th generate call (or weight load)."""

    def __init__(self, id: str, engine: Any, die_on: int | None = None, die_on_load: bool = False) -> None:
        super().__init__(id, engine)
        self.die_on, self.die_on_load = die_on, die_on_load
        self.generate_calls = 0

    def submit(self, prompts: list[list[int]], params: SamplingParams, seed: int | None) -> Any:
        self.generate_calls += 1
        if self.die_on is not None and self.generate_calls >= self.die_on:
            return _failed(EngineGone(f"{self.id} was killed"))
        return super().submit(prompts, params, seed)

    def load_weights(self, shared: Any, version: int) -> Any:
        if self.die_on_load:
            return _failed(EngineGone(f"{self.id} was killed"))
        return super().load_weights(shared, version)

    def died(self, error: BaseException) -> bool:
        return isinstance(error, EngineGone)


def _failed(error: BaseException) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(error)
    return future


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def _engines(tokenizer: Any, n: int) -> list[ScriptedEngine]:
    return [ScriptedEngine(tokenizer, [str(k)]) for k in range(n)]


def _router(tokenizer: Any, engines: list[Any], clients: list[Any] | None = None) -> EngineRouter:
    clients = clients or [LocalEngineClient(f"engine-{k}", e) for k, e in enumerate(engines)]
    # Two pieces per engine, so that an engine that finishes early has a piece left to take.
    return EngineRouter(clients, tokenizer, tokenizer.eos_token_id, chunks_per_engine=2)


def _brief(router: EngineRouter) -> list[dict[str, Any]]:
    return [{"id": e["id"], "samples": e["samples"], "alive": e["alive"]} for e in router.report()]


def _prompts(groups: int, group_size: int) -> list[list[int]]:
    return [[100 + g] for g in range(groups) for _ in range(group_size)]


def test_one_engine_gets_the_whole_call_with_the_seed_as_given(tokenizer: Any) -> None:
    (engine,) = _engines(tokenizer, 1)
    router = _router(tokenizer, [engine])
    gens = router.generate(_prompts(3, 2), PARAMS, seed=41, group_size=2)
    assert [g.prompt_ids for g in gens] == _prompts(3, 2)
    assert [(len(p), seed) for p, _, seed in engine.calls] == [(6, 41)]
    assert _brief(router) == [{"id": "engine-0", "samples": 6, "alive": True}]


def test_two_engines_share_the_call_and_keep_each_group_on_one_engine(tokenizer: Any) -> None:
    engines = _engines(tokenizer, 2)
    router = _router(tokenizer, engines)
    prompts = _prompts(8, 4)
    gens = router.generate(prompts, PARAMS, seed=3, group_size=4)

    assert [g.prompt_ids for g in gens] == prompts  # answers in the order asked
    by_prompt: dict[int, set[str]] = {}
    for g in gens:
        by_prompt.setdefault(g.prompt_ids[0], set()).add(g.text)
    # engine k answers "k": every group was answered by exactly one engine
    assert all(len(texts) == 1 for texts in by_prompt.values()), by_prompt
    for engine in engines:
        assert engine.calls, "both engines served"
        assert all(len(p) % 4 == 0 for p, _, _ in engine.calls)
    seeds = sorted(seed for e in engines for _, _, seed in e.calls)
    assert seeds == [3000, 3001, 3002, 3003]  # 2 chunks per engine, each its own seed
    assert sum(r["samples"] for r in router.report()) == 32


def test_an_engine_that_finishes_early_takes_more_work(tokenizer: Any) -> None:
    slow, fast = _engines(tokenizer, 2)
    release = threading.Event()
    slow_generate = slow.generate

    def held(prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> Any:
        assert release.wait(30), "the fast engine never took the rest of the work"
        return slow_generate(prompts, params, seed)

    fast_generate = fast.generate

    def counted(prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> Any:
        out = fast_generate(prompts, params, seed)
        if len(fast.calls) == 3:  # everything but the slow engine's chunk is done
            release.set()
        return out

    slow.generate, fast.generate = held, counted  # type: ignore[method-assign]
    router = _router(tokenizer, [slow, fast])
    gens = router.generate(_prompts(4, 2), PARAMS, seed=0, group_size=2)
    assert len(gens) == 8
    assert (len(slow.calls), len(fast.calls)) == (1, 3)
    assert [r["samples"] for r in router.report()] == [2, 6]


def test_a_dead_engines_prompts_go_to_the_others_exactly_once(tokenizer: Any) -> None:
    alive, doomed = _engines(tokenizer, 2)
    clients = [LocalEngineClient("engine-0", alive), MortalClient("engine-1", doomed, die_on=1)]
    router = _router(tokenizer, [alive, doomed], clients)
    prompts = _prompts(6, 2)
    gens = router.generate(prompts, PARAMS, seed=5, group_size=2)

    assert [g.prompt_ids for g in gens] == prompts
    assert doomed.calls == []  # it died before answering anything
    answered = [p for p, _, _ in alive.calls for p in p]
    assert sorted(map(tuple, answered)) == sorted(map(tuple, prompts))  # each prompt once
    assert len(alive.produced) == len(prompts)
    assert _brief(router) == [{"id": "engine-0", "samples": 12, "alive": True},
                              {"id": "engine-1", "samples": 0, "alive": False}]
    assert router.serving() == 1
    # The next call plans for the one engine left: one chunk, the seed as given.
    router.generate(prompts[:2], PARAMS, seed=9, group_size=2)
    assert alive.calls[-1][2] == 9


def test_when_every_engine_is_dead_the_error_says_so_and_what_to_do(tokenizer: Any) -> None:
    engines = _engines(tokenizer, 2)
    clients = [MortalClient(f"engine-{k}", e, die_on=1) for k, e in enumerate(engines)]
    router = _router(tokenizer, engines, clients)
    with pytest.raises(NoEngineLeft, match=r"all 2 rollout engines \(engine-0, engine-1\) died.*resubmit"):
        router.generate(_prompts(2, 2), PARAMS, group_size=2)


def test_an_engine_error_that_is_not_a_death_reaches_the_caller(tokenizer: Any) -> None:
    failing = ScriptedEngine(tokenizer, ["1"], fail_first=1)
    router = _router(tokenizer, [failing, *_engines(tokenizer, 1)])
    with pytest.raises(RuntimeError, match="out of memory"):
        router.generate(_prompts(4, 1), PARAMS)


def test_a_session_stays_on_its_engine_and_moves_when_the_engine_dies(tokenizer: Any) -> None:
    engines = _engines(tokenizer, 2)
    mortal = MortalClient("engine-1", engines[1])
    router = _router(tokenizer, engines, [LocalEngineClient("engine-0", engines[0]), mortal])
    first = router.generate([[1], [2], [3], [4]], PARAMS, sessions=["a", "b", "c", "d"])
    engine_of = {s: g.text for s, g in zip("abcd", first)}
    assert sorted(engine_of.values()) == ["0", "0", "1", "1"]  # spread by sessions pinned
    again = router.generate([[5], [6], [7], [8]], PARAMS, sessions=["d", "c", "b", "a"])
    assert [g.text for g in again] == [engine_of[s] for s in "dcba"]

    mortal.die_on = 1  # engine-1 dies: its sessions move to engine-0 and are answered once
    moved = router.generate([[9], [10], [11], [12]], PARAMS, sessions=["a", "b", "c", "d"])
    assert [g.text for g in moved] == ["0", "0", "0", "0"]
    assert [g.prompt_ids for g in moved] == [[9], [10], [11], [12]]


def test_new_weights_reach_every_live_engine_and_a_dead_one_is_dropped(tokenizer: Any) -> None:
    engines = _engines(tokenizer, 3)
    clients = [LocalEngineClient("engine-0", engines[0]), MortalClient("engine-1", engines[1], die_on_load=True),
               LocalEngineClient("engine-2", engines[2])]
    router = _router(tokenizer, engines, clients)
    router.update_weights([("w", torch.zeros(2))], version=4)
    assert [e.updates for e in engines] == [[4], [], [4]]
    assert router.weight_version == 4 and router.serving() == 2
    assert [r["alive"] for r in router.report()] == [True, False, True]


def test_the_router_reports_the_version_the_engines_it_was_given_hold(tokenizer: Any) -> None:
    engines = [ScriptedEngine(tokenizer, ["1"], version=3), ScriptedEngine(tokenizer, ["2"], version=5)]
    router = _router(tokenizer, engines)
    assert router.weight_version == 3  # the oldest live engine's
    router.update_weights([], version=6)
    assert router.weight_version == 6 and [e.weight_version for e in engines] == [6, 6]


class MediaRecordingEngine(ScriptedEngine):
    """A scripted engine that also records the media each call was given."""

    def __init__(self, tokenizer: Any, script: list[str]) -> None:
        super().__init__(tokenizer, script)
        self.media_calls: list[tuple[list[list[int]], list[Any]]] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None,
                 media: Any = None) -> Any:
        self.media_calls.append((prompts, list(media)))
        return super().generate(prompts, params, seed)


def test_media_travel_with_their_prompts_to_whichever_engine_serves_them(tokenizer: Any) -> None:
    import numpy as np

    from relax_hpc.media.items import MediaItem, PromptMedia

    engines = [MediaRecordingEngine(tokenizer, [str(k)]) for k in range(2)]
    router = _router(tokenizer, engines)
    prompts = _prompts(6, 2)
    # One distinct image per group (its first pixel is the group's prompt token).
    media = [PromptMedia((MediaItem("image", np.full((2, 2, 3), p[0] - 100, np.uint8)),)) for p in prompts]
    router.generate(prompts, PARAMS, seed=5, group_size=2, media=media)

    seen = [(p, m) for e in engines for ps, ms in e.media_calls for p, m in zip(ps, ms)]
    assert len(seen) == len(prompts) and all(e.media_calls for e in engines)
    for prompt, item_media in seen:
        assert int(item_media.items[0].data[0, 0, 0]) == prompt[0] - 100  # each prompt with its own media
    with pytest.raises(ValueError, match="6 prompts but 5 media entries"):
        router.generate(prompts[:6], PARAMS, media=media[:5])
