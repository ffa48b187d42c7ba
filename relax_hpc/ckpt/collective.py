"""How checkpoint ranks agree with each other: a tiny interface over torch.distributed.

Saving and loading are collective when a process group is initialised: every rank
writes its shard, but only rank 0 renames directories, writes ``latest`` and prunes,
and every rank must reach the same verdict on whether a checkpoint is usable.
``SingleProcessCollective`` is the in-memory implementation used without a process
group (and in unit tests); ``TorchDistCollective`` wraps an initialised group.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import torch.distributed as dist

__all__ = [
    "Collective",
    "SingleProcessCollective",
    "TorchDistCollective",
    "default_collective",
]

T = TypeVar("T")


class Collective(Protocol):
    """The few collective operations the checkpoint manager needs."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """Group handed to DCP; None means the default group (or no group at all)."""
        ...

    @property
    def is_distributed(self) -> bool:
        """False when DCP must run with ``no_dist=True`` (single process, no group)."""
        ...

    def barrier(self) -> None: ...

    def broadcast_from_rank0(self, obj: T) -> T:
        """Return rank 0's ``obj`` on every rank (picklable objects only)."""
        ...

    def all_gather(self, obj: T) -> list[T]:
        """Return every rank's ``obj``, indexed by rank."""
        ...


class SingleProcessCollective:
    """One rank, no communication."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return None

    @property
    def is_distributed(self) -> bool:
        return False

    def barrier(self) -> None:
        return None

    def broadcast_from_rank0(self, obj: T) -> T:
        return obj

    def all_gather(self, obj: T) -> list[T]:
        return [obj]


class TorchDistCollective:
    """Collectives over an initialised torch.distributed process group (gloo or nccl)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "TorchDistCollective needs torch.distributed.init_process_group() to have been "
                "called first; use SingleProcessCollective for a single process"
            )
        self._group = group

    @property
    def rank(self) -> int:
        return dist.get_rank(self._group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self._group)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self._group

    @property
    def is_distributed(self) -> bool:
        return True

    def barrier(self) -> None:
        dist.barrier(group=self._group)

    def broadcast_from_rank0(self, obj: T) -> T:
        box: list[Any] = [obj]
        src = dist.get_global_rank(self._group, 0) if self._group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self._group)
        return box[0]  # type: ignore[no-any-return]

    def all_gather(self, obj: T) -> list[T]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out


def default_collective() -> Collective:
    """The group-backed collective when torch.distributed is initialised, else single-process."""
    if dist.is_available() and dist.is_initialized():
        return TorchDistCollective()
    return SingleProcessCollective()
