"""The transfer queue contract: the data bus between Rollout, ActorFwd, Reference, Advantages and Actor.

A *partition* (one per rollout step, named ``train_<step>``) holds *rows*; a row is a dict of
*fields* (tensor, numpy array or small scalar/str). Producers ``put`` rows and later roles
``write`` extra fields onto them. A consumer *task* (``"actor_fwd"``, ``"actor"``, ...) ``get``s
rows that carry all the fields it needs; every task sees every row exactly once, provided it
``ack``s what it received (unacked rows come back after a consumer restart). The queue is
bounded by ``capacity`` rows and exposes the staleness rule that paces rollout.

This module holds only the interface, the value types and the pure rules; the implementations
are :mod:`relax_hpc.transfer.memory` (threads, tests) and the ZMQ server/client adapters.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, Union, runtime_checkable

import numpy as np
import torch

Scalar = Union[bool, int, float, str, None]
Value = Union[torch.Tensor, np.ndarray, Scalar]
Row = Mapping[str, Value]

TRAIN_PREFIX = "train_"
_TRAIN_NAME = re.compile(r"^train_(\d+)$")
MAX_NAME_LEN = 200
MAX_STR_LEN = 64 * 1024


class TransferQueueError(RuntimeError):
    """A request the queue refused (bad arguments, cleared partition, fenced consumer, ...)."""


class TransferTimeoutError(TransferQueueError, TimeoutError):
    """A blocking call (get, put against capacity, staleness wait) ran out of time."""


class TransferAbortedError(TransferQueueError):
    """A role that feeds an in-process queue failed: calls waiting on it stop at once with that
    role's error instead of waiting out their timeout (`InMemoryTransferQueue.abort`)."""


class TransferUnreachableError(TransferQueueError, ConnectionError):
    """The queue server did not answer at all (not running, wrong address, network)."""


@dataclass(frozen=True)
class Batch:
    """What one ``get`` returns.

    ``end`` is True when the partition is complete and this task has now received every row:
    it is set on the last (possibly short or empty) batch and on every later ``get``.
    """

    partition: str
    indices: list[int]
    rows: list[dict[str, Value]]
    end: bool = False

    def __len__(self) -> int:
        return len(self.indices)

    def column(self, name: str) -> list[Value]:
        """The values of one field, in row order."""
        return [row[name] for row in self.rows]


@dataclass(frozen=True)
class PartitionInfo:
    """A snapshot of one uncleared partition."""

    name: str
    rows: int
    expected_rows: int | None
    complete: bool
    fields: list[str] = field(default_factory=list)


@runtime_checkable
class TransferQueue(Protocol):
    """The data bus. Every blocking call takes ``timeout`` seconds and raises
    :class:`TransferTimeoutError` when it runs out; nothing is consumed by a call that timed out.

    A handle has one consumer identity (``consumer_id``, default ``""``) and one session: when a
    new session of the same consumer id gets or acks for a task, rows that the previous session
    of that consumer received but never acked are handed out again (restart recovery), and the
    old session is fenced off. Concurrent consumers of one task need distinct consumer ids.
    """

    def put(self, partition: str, rows: Sequence[Row], timeout: float = 60.0) -> list[int]:
        """Append rows; returns their row indices. Blocks while the queue is at capacity."""
        ...

    def write(self, partition: str, indices: Sequence[int], rows: Sequence[Row]) -> None:
        """Add (or overwrite) fields on existing rows: ``rows[k]`` goes onto row ``indices[k]``."""
        ...

    def get(
        self,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        timeout: float = 60.0,
        ack: Sequence[int] = (),
    ) -> Batch:
        """Up to ``batch_size`` rows having all ``fields`` that ``task`` has not received yet.

        Waits until ``batch_size`` such rows exist, or the partition is complete and no other
        row can become ready (then a short final batch with ``end=True``). A cleared
        partition answers an empty batch with ``end=True``.

        ``ack``: rows of this partition that ``task`` is done with, acked first (as by
        :meth:`ack`) in the same request, so a consumer loop costs one round trip a batch. The
        ack stands even when the get then times out.
        """
        ...

    def stream(
        self,
        partition: str,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        timeout: float = 60.0,
        ack: bool = True,
    ) -> Iterator[Batch]:
        """Every batch of ``partition`` for ``task`` (as :meth:`get` returns them), up to and
        including the one with ``end=True``; an implementation may fetch the next batch while the
        caller works on the current one. ``timeout`` applies to each batch.

        With ``ack``, a batch counts as done once the caller asks for the next one (or the stream
        ends, or a get fails) and is acked then, riding on a get where it can. A caller that leaves
        the stream early leaves the current batch (and one fetched ahead) unacked: those rows go to
        the next session of this consumer id, as after a crash. Without ``ack`` the caller acks.
        """
        ...

    def prefetch(self, partition: str, task: str, fields: Sequence[str], batch_size: int,
                 timeout: float = 60.0) -> None:
        """Ask now for the first batch of a later :meth:`stream` with the same arguments.

        A hint: the request waits on the server (for rows that may not exist yet) while the
        caller works, and that stream's first batch is its answer. An implementation may do
        nothing. If the prefetched request times out, the stream asks again.
        """
        ...

    def ack(self, partition: str, task: str, indices: Sequence[int]) -> int:
        """Commit received rows so they are never delivered to ``task`` again; returns how many."""
        ...

    def complete(self, partition: str, total_rows: int) -> None:
        """Declare that ``partition`` will hold exactly ``total_rows`` rows."""
        ...

    def clear(self, partition: str) -> int:
        """Drop a partition (the actor, after training on it); returns the rows freed."""
        ...

    def partitions(self) -> list[PartitionInfo]:
        """Uncleared partitions, oldest first."""
        ...

    def oldest_uncleared(self) -> int | None:
        """The smallest step id among uncleared ``train_<id>`` partitions, or None."""
        ...

    def may_start(self, step: int, max_staleness: int) -> bool:
        """Whether rollout may start producing ``step`` now (see :func:`staleness_allows`)."""
        ...

    def wait_until_may_start(self, step: int, max_staleness: int, timeout: float = 600.0) -> None:
        """Block until :meth:`may_start` is True; raises :class:`TransferTimeoutError`."""
        ...

    def close(self) -> None:
        """Release the handle (sockets); unacked rows stay owed to the next session."""
        ...


def partition_name(step: int) -> str:
    """The partition that holds rollout step ``step``."""
    if step < 0:
        raise ValueError(f"step must be >= 0 for a partition name, got {step}")
    return f"{TRAIN_PREFIX}{step}"


def partition_step(name: str) -> int | None:
    """The step id of a ``train_<id>`` partition name; None for any other name."""
    match = _TRAIN_NAME.match(name)
    return int(match.group(1)) if match else None


def staleness_allows(step: int, oldest_uncleared: int | None, max_staleness: int) -> bool:
    """Rollout may produce ``step`` iff ``step - oldest_uncleared <= max_staleness``.

    With ``step = N + 1`` after producing step N this is exactly Relax's rule
    ``N + 1 - min(uncleared ids) <= max_staleness``; nothing uncleared always allows.
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    if oldest_uncleared is None:
        return True
    return step - oldest_uncleared <= max_staleness


def queue_capacity(rollout_batch_size: int, max_staleness: int, n_samples_per_prompt: int) -> int:
    """Rows the queue must hold: ``rollout_batch_size * (max_staleness + 1) * n_samples_per_prompt``."""
    for key, val in (
        ("rollout_batch_size", rollout_batch_size),
        ("n_samples_per_prompt", n_samples_per_prompt),
    ):
        if val < 1:
            raise ValueError(f"{key} must be >= 1, got {val}")
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return rollout_batch_size * (max_staleness + 1) * n_samples_per_prompt


def check_name(kind: str, name: object) -> str:
    """Validate a partition/task/field name; returns it."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
        raise TransferQueueError(
            f"{kind} name must be a non-empty str of at most {MAX_NAME_LEN} characters, "
            f"got {name!r}"
        )
    return name


def check_value(name: str, value: object) -> None:
    """Reject values the wire cannot carry, with the field name in the message."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.is_sparse or value.is_quantized:
            raise TransferQueueError(
                f"field {name!r}: only dense CPU tensors can be queued (got device "
                f"{value.device}, layout {value.layout}); call .cpu() first"
            )
        return
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise TransferQueueError(
                f"field {name!r}: numpy object arrays cannot be queued; use a numeric dtype"
            )
        return
    if value is None or isinstance(value, (bool, int, float)):
        if isinstance(value, int) and not -(2**63) <= value < 2**64:
            raise TransferQueueError(f"field {name!r}: int {value} does not fit in 64 bits")
        return
    if isinstance(value, str):
        if len(value) > MAX_STR_LEN:
            raise TransferQueueError(
                f"field {name!r}: str of {len(value)} chars is longer than {MAX_STR_LEN}; "
                "encode large text as a uint8 tensor"
            )
        return
    raise TransferQueueError(
        f"field {name!r}: cannot queue a {type(value).__name__}; allowed are torch.Tensor, "
        "numpy.ndarray, bool, int, float, str and None"
    )


def check_rows(rows: Sequence[Row]) -> None:
    """Validate every field name and value of ``rows``."""
    if isinstance(rows, Mapping):
        raise TransferQueueError("rows must be a sequence of dicts, got a single dict; wrap it in [...]")
    for row in rows:
        if not isinstance(row, Mapping):
            raise TransferQueueError(f"each row must be a dict of field -> value, got {type(row).__name__}")
        for name, value in row.items():
            check_name("field", name)
            check_value(name, value)
