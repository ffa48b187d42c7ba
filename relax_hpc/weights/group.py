"""The collective behind the weight channel: a broadcast group, and the store used to rendezvous.

`BroadcastGroup` is the small interface the channel needs (`broadcast(tensor, src)` returning a
handle with `wait()`). Two implementations:

* `TorchBroadcastGroup`: a torch.distributed backend (`ProcessGroupGloo` for CPU tensors,
  `ProcessGroupNCCL` for CUDA tensors) built directly from a `PrefixStore` over the channel's
  TCPStore. It never touches the default process group, so it coexists with the trainer's
  data-parallel group (which *is* the default group in the trainer ranks) and with engines that
  run their own torch.distributed worlds.
* `LocalBroadcastGroup`: threads of one process sharing a `LocalBroadcastHub` (unit tests).

The store is any `torch.distributed.Store`: a `TCPStore` hosted by the sender (trainer rank 0)
in production, a `HashStore` in process for tests. `host_store` hosts a TCPStore that listens
only on the address its peers connect to (the trainer's rendezvous store uses it too); the
channel and the trainer reach it through a `SealedStore` (`weights.sealed_store`): keys under the
job secret's prefix, values sealed with it (docs/weights.md, "Who can reach the store"). Over a
`SealedStore`, `TorchBroadcastGroup` first agrees on a fresh epoch with its peers (`agree_epoch`)
and forms the group in it, so rank addresses recorded in an earlier rendezvous of the job (an
earlier attempt, a channel rebuilt after a restart) do not open in this one.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import threading
from typing import Any, Protocol

import torch
import torch.distributed as dist

from relax_hpc.weights.sealed_store import SealedStore, agree_epoch


class PendingOp(Protocol):
    def wait(self) -> object: ...


class BroadcastGroup(Protocol):
    rank: int
    size: int
    backend: str

    def broadcast(self, tensor: torch.Tensor, src: int) -> PendingOp:
        """Start broadcasting `tensor` from rank `src` into every rank's `tensor` (same shape/dtype)."""
        ...

    def close(self) -> None: ...


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU tensors."""
    if device.type == "cuda":
        return "nccl"
    if device.type == "cpu":
        return "gloo"
    raise ValueError(f"weight channel device '{device}': allowed are 'cpu' (gloo) and 'cuda[:N]' (NCCL)")


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the interface that routes to `host`.

    Gloo binds its pairs to the address it is given; picking the interface that reaches the
    trainer head avoids the classic multi-NIC mistake (binding to a management or docker
    interface that the peer cannot reach). No packet is sent: UDP connect only picks a route.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def _listen_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple[Any, ...]]:
    """The socket family and address to listen on for `host` (a name resolves to its first address).

    A wildcard (``0.0.0.0``, ``::``, empty) is refused: a store listens on the one address its
    peers are given, never on every interface of the node.
    """
    wildcard = ValueError(
        f"store host {host!r}: give the address peers connect to (the node's route address, e.g. "
        "ray.util.get_node_ip_address()), not a wildcard that listens on every interface"
    )
    if not host:
        raise wildcard
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ConnectionError(f"cannot resolve store host {host!r} to an address ({exc})") from exc
    if ipaddress.ip_address(str(sockaddr[0]).split("%")[0]).is_unspecified:
        raise wildcard
    return family, sockaddr


def host_store(host: str, port: int, world_size: int, timeout: datetime.timedelta,
               wait_for_workers: bool = False) -> dist.TCPStore:
    """Host a TCPStore listening only on `host`'s address; `port=0` picks a free port (`.port`).

    The listening socket is made here and handed to the store (`master_listen_fd`, which the
    libuv backend accepts): left to itself, TCPStore listens on every interface.
    """
    family, sockaddr = _listen_address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does: rebind after a restart
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
        bound_port = int(sock.getsockname()[1])
    except OSError as exc:
        sock.close()
        raise OSError(
            exc.errno, f"cannot listen on {sockaddr[0]}:{port} ({exc.strerror}); the address must be one "
            "of this node's and the port free (0 picks one)"
        ) from exc
    # The store owns the descriptor from here on: it closes it when it is destroyed, and also when
    # its own construction fails, so the Python socket must not close it a second time.
    fd = sock.detach()
    return dist.TCPStore(
        sockaddr[0], bound_port, world_size, True, timeout=timeout, wait_for_workers=wait_for_workers,
        master_listen_fd=fd, use_libuv=True,
    )


def open_store(host: str, port: int, world_size: int, is_sender: bool, timeout_s: float) -> dist.TCPStore:
    """The channel's TCPStore: hosted by the sender on `host`'s address only (`port=0` picks a free
    port), joined by receivers. The channel puts every key under the job secret's prefix."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if is_sender:
            return host_store(host, port, world_size, timeout)
        return dist.TCPStore(
            host, port, world_size, False, timeout=timeout, wait_for_workers=False, use_libuv=True
        )
    except (RuntimeError, OSError) as exc:
        role = "host" if is_sender else "reach"
        raise ConnectionError(
            f"weight channel: could not {role} the TCP store at {host}:{port} within {timeout_s:.0f} s ({exc}); "
            "check that the trainer head's address and weight-channel port are reachable from this node"
        ) from exc


class TorchBroadcastGroup:
    """A gloo or NCCL group over ranks 0..size-1, built from a store without the default group."""

    def __init__(
        self, store: dist.Store, rank: int, size: int, backend: str, timeout_s: float,
        bind_host: str = "", device: torch.device | None = None, name: str = "channel",
    ) -> None:
        self.rank, self.size, self.backend = rank, size, backend
        if isinstance(store, SealedStore) and not store.agreed:  # its own epoch: no recorded address opens
            store = agree_epoch(store, rank, size, group=f"pg/{name}/{backend}")
        # Kept for as long as the group: a store written in Python (`SealedStore`) reaches C++ only
        # as long as its Python object lives (weights/sealed_store.py).
        self.store = store
        timeout = datetime.timedelta(seconds=timeout_s)
        # `name` keeps several groups on one store apart (their rendezvous keys would collide).
        prefixed = dist.PrefixStore(f"pg/{name}/{backend}/", store)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
            self.pg: dist.Backend = dist.ProcessGroupGloo(prefixed, rank, size, opts)
        elif backend == "nccl":
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None or not torch.cuda.is_available():
                raise RuntimeError(
                    "weight channel backend 'nccl' needs a CUDA build of torch and a visible GPU; "
                    "use device='cpu' (gloo) on machines without one"
                )
            if device is not None and device.index is not None:
                torch.cuda.set_device(device)
            opts = nccl.Options()
            opts._timeout = timeout
            self.pg = nccl(prefixed, rank, size, opts)
        else:
            raise ValueError(f"weight channel backend '{backend}': allowed are 'gloo' and 'nccl'")

    def broadcast(self, tensor: torch.Tensor, src: int) -> PendingOp:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        return self.pg.broadcast([tensor], opts)

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except RuntimeError:
                pass  # already torn down by a failed peer; nothing left to release


class _Done:
    def wait(self) -> bool:
        return True


class LocalBroadcastHub:
    """Shared state for `LocalBroadcastGroup`s in one process: the n-th broadcast's payload."""

    def __init__(self, size: int, timeout_s: float = 10.0) -> None:
        self.size, self.timeout_s = size, timeout_s
        self._cond = threading.Condition()
        self._slots: dict[int, tuple[torch.Tensor, int]] = {}  # op index -> (payload, readers left)

    def group(self, rank: int) -> LocalBroadcastGroup:
        return LocalBroadcastGroup(self, rank)

    def _put(self, op: int, payload: torch.Tensor) -> None:
        with self._cond:
            self._slots[op] = (payload, self.size - 1)
            self._cond.notify_all()

    def _take(self, op: int, rank: int) -> torch.Tensor:
        with self._cond:
            if not self._cond.wait_for(lambda: op in self._slots, timeout=self.timeout_s):
                raise RuntimeError(f"local broadcast #{op}: rank {rank} timed out after {self.timeout_s} s")
            payload, left = self._slots[op]
            if left <= 1:
                del self._slots[op]
            else:
                self._slots[op] = (payload, left - 1)
            return payload


class LocalBroadcastGroup:
    """In-process `BroadcastGroup`: ranks are threads; the source's bytes are copied to each receiver."""

    backend = "local"

    def __init__(self, hub: LocalBroadcastHub, rank: int) -> None:
        self.hub, self.rank, self.size = hub, rank, hub.size
        self._ops = 0

    def broadcast(self, tensor: torch.Tensor, src: int) -> PendingOp:
        op, self._ops = self._ops, self._ops + 1
        if self.rank == src:
            self.hub._put(op, tensor.clone())
        else:
            tensor.copy_(self.hub._take(op, self.rank))
        return _Done()

    def close(self) -> None:
        pass
