"""The rollout engine interface: what every generation backend (native torch, SGLang) provides.

An engine turns prompt token ids into sampled responses with the per-token log-probs and the
weight version that produced them, and accepts new weights between batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Protocol

import torch

from relax_hpc.spec.schema import RolloutSpec


@dataclass(frozen=True)
class SamplingParams:
    """How one engine call samples. `top_k = 0` and `top_p = 1.0` disable those filters.

    The values are this call's: the rollout fills them from [rollout] (roles/rollout.py:
    sampling_of), and a chat request, an episode's remaining budget, a judge or an HTTP generate
    request sets its own."""

    max_new_tokens: int = RolloutSpec.max_new_tokens
    temperature: float = RolloutSpec.temperature
    top_p: float = RolloutSpec.top_p
    top_k: int = RolloutSpec.top_k
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        # Every comparison with NaN is False, so this form rejects NaN as well as inf and <= 0.
        if not (0 < self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")


class EngineGone(RuntimeError):
    """An engine's process is gone for good (e.g. an SGLang server past its restarts): the
    router hands its work to the engines left."""


FinishReason = Literal["stop", "length"]


@dataclass
class Generation:
    """One sampled response.

    `logprobs[i]` is the log-probability of `token_ids[i]` under the policy's distribution at the
    sampling temperature, before top-k/top-p filtering: the quantity the trainer recomputes.
    `routed_experts`: for a mixture-of-experts model with routing replay on, the experts each MoE
    layer chose for every token fed to the model, ``[len(prompt_ids) + len(token_ids) - 1,
    layers, top_k]`` (relax_hpc/engines/routed_experts.py); None otherwise.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int
    text: str = ""
    extra: dict = field(default_factory=dict)
    routed_experts: torch.Tensor | None = None


class Generator(Protocol):
    """The narrow interface a caller that only samples needs (a GenRM judge, an agent proxy)."""

    @property
    def weight_version(self) -> int: ...

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None
    ) -> list[Generation]: ...


class RolloutEngine(Generator, Protocol):
    """A rollout engine: what the rollout role drives. Implementations: `NativeEngine` (torch),
    `ScriptedEngine` (in memory, for tests), `ManagedSGLangEngine` (an SGLang server,
relax_hpc/engines/sglang/fleet.py).

    Weights change only between `generate` calls: `update_weights` copies named tensors in and
    sets the version every later generation reports. `pause` waits for the `generate` calls in
    flight and holds new ones until `resume` (the rollout side of a weight update or of a
    colocated training step). `release_memory` frees what the engine holds on its device
    (weights and cache) and returns how many bytes; `resume_memory` takes them back, after
    which `update_weights` may refill the weights. An engine may also offer
    ``bind_weights(flat, version) -> bool``: run on the tensors of a received
    `relax_hpc.weights.flat.FlatWeights` in place of its own, without a copy (False when it
    cannot; the rollout role then copies through `update_weights`).
    """

    @property
    def tokenizer(self) -> Any: ...

    @property
    def eos_id(self) -> int: ...

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def release_memory(self) -> int: ...

    def resume_memory(self) -> None: ...
