"""`ScriptedEngine`: the in-memory `RolloutEngine`, for tests of everything that drives an engine.

It answers each prompt with the next text of a script (cycled), tokenized, then EOS, cut at
`max_new_tokens`; its log-probs are distinct decreasing numbers so alignment errors show. It
records every call, can fail its first calls (`fail_first`), and keeps the pause / release
contract of the interface strictly: a `generate` while released raises, one while paused waits.

    engine = ScriptedEngine(tokenizer, ["7", "8"])
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=4))
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

import torch

from relax_hpc.engines.base import Generation, SamplingParams


class ScriptedEngine:
    """A `RolloutEngine` that replies from a script; see the module docstring."""

    def __init__(self, tokenizer: Any, script: list[str], version: int = 0, fail_first: int = 0,
                 eos_id: int | None = None) -> None:
        if not script:
            raise ValueError("ScriptedEngine needs at least one reply in its script")
        self.tokenizer, self.script, self._version = tokenizer, script, version
        self.eos_id = int(tokenizer.eos_token_id if eos_id is None else eos_id)
        self.fail_first = fail_first
        self.calls: list[tuple[list[list[int]], SamplingParams, int | None]] = []
        self.produced: list[Generation] = []
        self.updates: list[int] = []  # versions given to update_weights, in order
        self.released = False
        self._next = 0
        self._lp = 0.0
        self._gate = threading.Condition()
        self._paused = False

    @property
    def weight_version(self) -> int:
        return self._version

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        for _ in named_tensors:  # consume them, as a real engine copies them in
            pass
        self._version = version
        self.updates.append(version)

    def pause(self) -> None:
        with self._gate:
            self._paused = True

    def resume(self) -> None:
        with self._gate:
            self._paused = False
            self._gate.notify_all()

    def release_memory(self) -> int:
        self.released = True
        return 0

    def resume_memory(self) -> None:
        self.released = False

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> list[Generation]:
        with self._gate:
            self._gate.wait_for(lambda: not self._paused)
        if self.released:
            raise RuntimeError("the engine released its memory; call resume_memory() before generate()")
        self.calls.append(([list(p) for p in prompts], params, seed))
        if len(self.calls) <= self.fail_first:
            raise RuntimeError("out of memory (simulated)")
        return [self._reply(list(p), params) for p in prompts]

    def _reply(self, prompt: list[int], params: SamplingParams) -> Generation:
        text = self.script[self._next % len(self.script)]
        self._next += 1
        ids = (self.tokenizer.encode(text, add_special_tokens=False) + [self.eos_id])[: params.max_new_tokens]
        finish = "stop" if ids[-1] == self.eos_id else "length"
        logprobs = []
        for _ in ids:
            self._lp -= 0.01
            logprobs.append(round(self._lp, 4))
        shown = ids[:-1] if finish == "stop" else ids
        generation = Generation(prompt, ids, logprobs, finish, self._version, self.tokenizer.decode(shown))
        self.produced.append(generation)
        return generation
