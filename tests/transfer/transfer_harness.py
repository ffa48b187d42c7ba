"""A handle factory that hides which transfer-queue implementation a test runs against."""

from __future__ import annotations

from relax_hpc.auth import JobSecret
from relax_hpc.transfer import InMemoryTransferQueue, TransferQueue


class QueueHarness:
    """Builds one queue and hands out handles on it (each handle = one consumer session)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._handles: list[TransferQueue] = []
        self._memory: InMemoryTransferQueue | None = None
        self._server: object | None = None
        self.address = ""
        self.secret = JobSecret.generate()  # the queue's job secret: every handle is built with it

    def start(self, capacity: int | None = None) -> TransferQueue:
        """Create the queue; returns a first handle."""
        if self.kind == "memory":
            self._memory = InMemoryTransferQueue(capacity=capacity)
            self._handles.append(self._memory)
            return self._memory
        from relax_hpc.transfer.zmq_server import TransferQueueServer

        # "zmq": TCP only (as a client on another host sees it); "zmq-shm": same-host shared
        # memory for every payload, however small, so the whole contract runs through it;
        # "zmq-encrypt" / "zmq-authenticate": TCP with every message of a session sealed.
        payload = self.kind.removeprefix("zmq-") if self.kind in ("zmq-encrypt", "zmq-authenticate") else "curve"
        server = TransferQueueServer(
            "tcp://127.0.0.1:0", capacity=capacity, shm=self.kind == "zmq-shm", secret=self.secret,
            payload=payload,  # type: ignore[arg-type]
        )
        self.address = server.start()
        self._server = server
        return self.handle()

    def handle(self, consumer_id: str = "") -> TransferQueue:
        """Another handle on the same queue, as a separate process would have."""
        if self.kind == "memory":
            assert self._memory is not None, "call start() first"
            handle: TransferQueue = self._memory.open_session(consumer_id)
        else:
            from relax_hpc.transfer.zmq_client import TransferQueueClient

            handle = TransferQueueClient(
                self.address, secret=self.secret, consumer_id=consumer_id, connect_timeout=5.0,
                request_timeout=5.0, shm_min_bytes=0,
            )
            if self.kind == "zmq-shm":
                assert handle.shm_dir is not None, "the zmq-shm harness expects the shared-memory path"
            expected = self.kind.removeprefix("zmq-") if self.kind in ("zmq-encrypt", "zmq-authenticate") else "curve"
            assert handle.payload == expected, (self.kind, handle.payload)
        self._handles.append(handle)
        return handle

    def close(self) -> None:
        for handle in self._handles:
            handle.close()
        if self._server is not None:
            self._server.stop()  # type: ignore[attr-defined]
