"""Transfer layer: the queue that carries samples between roles (see docs/transfer-queue.md).

``TransferQueue`` is the interface; ``InMemoryTransferQueue`` serves tests and single-process
runs; ``TransferQueueServer`` / ``TransferQueueClient`` are the ZMQ adapter, imported lazily so
that code using only the interface does not load zmq.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relax_hpc.transfer.memory import InMemoryTransferQueue
from relax_hpc.transfer.queue import (
    Batch,
    PartitionInfo,
    TransferQueue,
    TransferQueueError,
    TransferTimeoutError,
    TransferUnreachableError,
    partition_name,
    partition_step,
    queue_capacity,
    staleness_allows,
)

if TYPE_CHECKING:
    from relax_hpc.transfer.zmq_client import TransferQueueClient
    from relax_hpc.transfer.zmq_server import TransferQueueServer

__all__ = [
    "Batch",
    "InMemoryTransferQueue",
    "PartitionInfo",
    "TransferQueue",
    "TransferQueueClient",
    "TransferQueueError",
    "TransferQueueServer",
    "TransferTimeoutError",
    "TransferUnreachableError",
    "partition_name",
    "partition_step",
    "queue_capacity",
    "staleness_allows",
]


def __getattr__(name: str) -> Any:
    if name == "TransferQueueClient":
        from relax_hpc.transfer.zmq_client import TransferQueueClient

        return TransferQueueClient
    if name == "TransferQueueServer":
        from relax_hpc.transfer.zmq_server import TransferQueueServer

        return TransferQueueServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
