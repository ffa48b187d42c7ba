"""Rollout engines in processes of their own: `EngineHost` (the Ray actor) and its router client.

With `[rollout] num_engines = N > 1` the driver starts N `EngineHost` actors (one GPU each where
the engines run on GPUs) and hands their handles to the rollout role, whose `EngineRouter`
reaches them through `RayEngineClient`. The rollout role stays the one receiver of the
trainer's weight broadcast and passes each version on to the engines through Ray's object
store (one shared copy per update), so an engine that dies or joins never breaks the trainer's
channel.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np
import torch

from relax_hpc.engines.base import Generation, RolloutEngine, SamplingParams
from relax_hpc.engines.fleet import engine_for_actor
from relax_hpc.engines.router import Future, WeightsUnavailable
from relax_hpc.media.items import PromptMedia
from relax_hpc.roles.heartbeat import Heartbeats


class SharedWeights(NamedTuple):
    """One weight version as it goes through Ray's object store: each tensor's bytes as a flat
    uint8 array, with its name, dtype and shape.

    Ray pickles numpy arrays out of band, once per array and only the array's own bytes. A torch
    tensor, by contrast, pickles through `torch.save` of its whole storage. The weights rollout
    receives are views of one flat buffer, so that storage was the whole model, saved once per
    tensor: 24 x the bytes of the tiny model, about 26 ms a version instead of 2 ms.
    """

    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    data: list[np.ndarray]


def pack_weights(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SharedWeights:
    """Named tensors (any dtype, views of a larger buffer included) as `SharedWeights`."""
    packed = SharedWeights([], [], [], [])
    for name, tensor in named_tensors:
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        packed.names.append(name)
        packed.dtypes.append(str(tensor.dtype).removeprefix("torch."))
        packed.shapes.append(tuple(tensor.shape))
        packed.data.append(flat.view(torch.uint8).numpy())
    return packed


def unpack_weights(shared: SharedWeights) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of `pack_weights`, on the arrays' memory (no copy; engines copy them in)."""
    out = []
    with warnings.catch_warnings():
        # Arrays from Ray's object store are read-only; the tensors are only read from.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, dtype, shape, data in zip(shared.names, shared.dtypes, shared.shapes, shared.data):
            out.append((name, torch.from_numpy(data).view(getattr(torch, dtype)).reshape(shape)))
    return out


class EngineHost(Heartbeats):
    """One rollout engine in this process; a Ray actor (see the module docstring)."""

    def __init__(self, engine: str, model_path: str, dtype: str, device: str, num_threads: int = 0,
                 record_routing: bool = False) -> None:
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.engine: RolloutEngine = engine_for_actor(engine, model_path, dtype, device, record_routing)

    def pid(self) -> int:
        return os.getpid()

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None,
                 media: Sequence[PromptMedia | None] | None = None) -> list[Generation]:
        if media is None:
            return self.engine.generate(prompts, params, seed)
        return self.engine.generate(prompts, params, seed, media=media)

    def load_weights(self, shared: SharedWeights, version: int) -> int:
        self.engine.update_weights(unpack_weights(shared), version)
        return version

    def weight_version(self) -> int:
        return self.engine.weight_version

    def memory_record(self, index: int = 0) -> dict[str, Any]:
        """The bytes this engine holds, from its model's tensors (relax_hpc/roles/memory.py)."""
        from relax_hpc.roles.memory import engine_record

        model = getattr(self.engine, "model", None)
        return engine_record(model if isinstance(model, torch.nn.Module) else None, index,
                             str(getattr(self.engine, "device", "cpu"))).as_dict()

    def current_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The weights it serves (a joining engine loads them), by the names `load_weights` takes."""
        model = getattr(self.engine, "model", None)
        if model is None:
            raise WeightsUnavailable(f"a {type(self.engine).__name__} cannot hand over its weights")
        return [(name, t.detach().cpu()) for name, t in model.state_dict().items()]

    def call(self, method: str) -> Any:
        if method not in ("pause", "resume", "release_memory", "resume_memory"):
            raise ValueError(f"EngineHost.call: {method!r} is not an engine control method")
        return getattr(self.engine, method)()


class RayEngineClient:
    """`EngineClient` for an `EngineHost` actor."""

    def __init__(self, id: str, handle: Any) -> None:
        self.id, self.handle = id, handle

    def submit(self, prompts: list[list[int]], params: SamplingParams, seed: int | None,
               media: Sequence[PromptMedia | None] | None = None) -> Future:
        return self.handle.generate.remote(prompts, params, seed, media).future()

    def share(self, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> Any:
        import ray

        return ray.put(pack_weights(named_tensors))

    def load_weights(self, shared: Any, version: int) -> Future:
        return self.handle.load_weights.remote(shared, version).future()

    def call(self, method: str) -> Future:
        return self.handle.call.remote(method).future()

    def current_weights(self) -> list[tuple[str, torch.Tensor]]:
        import ray

        return ray.get(self.handle.current_weights.remote())

    def died(self, error: BaseException) -> bool:
        from ray.exceptions import RayActorError

        return isinstance(error, RayActorError)

    def close(self) -> None:
        pass  # the driver kills the actors
