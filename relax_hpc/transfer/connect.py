"""Open a queue handle for one role from whatever the driver handed it: a ZMQ address or an
in-memory queue (tests and in-process runs)."""

from __future__ import annotations

from relax_hpc.transfer.memory import InMemoryTransferQueue
from relax_hpc.transfer.queue import TransferQueue



def connect_queue(target: InMemoryTransferQueue | str, consumer_id: str) -> TransferQueue:
    """A new session on the queue; open one per thread (ZMQ sockets are not thread safe). A ZMQ
    address is reached with this job's secret (``RELAX_HPC_SECRET_FILE``)."""
    if isinstance(target, InMemoryTransferQueue):
        return target.open_session(consumer_id)
    from relax_hpc.auth import job_secret
    from relax_hpc.transfer.zmq_client import TransferQueueClient

    return TransferQueueClient(target, secret=job_secret(), consumer_id=consumer_id)


def report_failure(target: InMemoryTransferQueue | str, reason: str) -> None:
    """A role feeding `target` failed with `reason`. An in-process queue stops its waiters with it
    (`InMemoryTransferQueue.abort`); on a ZMQ queue the driver finds the failed role by polling."""
    if isinstance(target, InMemoryTransferQueue):
        target.abort(reason)
