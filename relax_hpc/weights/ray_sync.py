"""`DistributedWeightSync`: the `WeightSync` that drives the weight channel between Ray actors.

The sender actor inherits `WeightSenderEndpoint` (trainer rank 0), every receiver actor inherits
`WeightReceiverEndpoint` (rollout engines). `sync(version)` tells every receiver to receive,
tells the sender to send, and waits for all of them with a deadline; errors name the receivers
(by label and channel rank) that failed or did not answer. `start(version)` returns a
`PendingSync` so the driver can run the next training step while the bytes move:

    pending = weights.start(version)   # sender snapshots its weights, broadcast starts
    stats = train_the_next_step()      # overlaps the broadcast
    pending.wait()                     # every receiver now holds `version` (or this raises)

In the training loop the trainer starts each broadcast itself, at the end of its step
(`ActorWorker.train_from_queue(..., publish_version=v)`), so that the next step queued behind it
starts at once; the driver then only posts the receivers' side with `expect(v)` and waits for
them. The sender waits (with the channel's deadline) until every receiver is ready.

Receivers stage the buckets and switch to the new version after the last one; rollout and
ActorFwd wait at their batch boundary for the version the staleness bound requires
(docs/weights.md, "Overlap").

The channel is opened lazily on the first sync and rebuilt (new store port) on the next sync
after a failure, e.g. once a restarted engine is back. The sender hosts its store on its own
node, on the interface that routes to `host` (the driver's node), and answers with the address
it listens on, which the receivers are given: trainer rank 0 need not share the driver's node.
"""

from __future__ import annotations

from typing import Any, Sequence

from relax_hpc.weights.channel import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT_S, WeightChannelError

# Ray's own bookkeeping on top of the channel's deadline, so the channel's error (which names
# the late rank) is the one that surfaces, not a bare Ray timeout.
_RAY_GRACE_S = 30.0


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    # Ray's task errors start with a traceback banner; the original message is the last line.
    return text[-1] if text else type(exc).__name__


class PendingSync:
    """An in-flight `DistributedWeightSync` broadcast; `wait()` returns when every receiver runs it."""

    def __init__(self, owner: DistributedWeightSync, version: int, start_ref: Any | None,
                 receive_refs: list[Any]) -> None:
        self.owner, self.version = owner, version
        self._start_ref, self._receive_refs = start_ref, receive_refs
        self._done = False
        self._error: WeightChannelError | None = None

    def wait(self) -> None:
        """Block until the broadcast is done; raises its error (again on every later call)."""
        if not self._done:
            self._done = True
            try:
                self._collect()
            except WeightChannelError as exc:
                self._error = exc
        if self._error is not None:
            raise self._error

    def _collect(self) -> None:
        import ray

        owner = self.owner
        # A broadcast the trainer started itself (start_ref None) is finished by the trainer's
        # next one, or at shutdown; its receivers answering means every byte arrived.
        sender_refs = [] if self._start_ref is None else [self._start_ref, owner.sender.finish_send_weights.remote()]
        refs = [*sender_refs, *self._receive_refs]
        _, not_ready = ray.wait(refs, num_returns=len(refs), timeout=owner.timeout_s + _RAY_GRACE_S)
        problems: list[str] = []
        sender_error = ""
        for ref in sender_refs:  # the first error is the cause; keep it
            if sender_error:
                break
            if ref in not_ready:
                sender_error = "the sender (trainer rank 0) did not finish"
            else:
                try:
                    ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - reported with context below
                    sender_error = _first_line(exc)
        for i, ref in enumerate(self._receive_refs):
            who = f"{owner.labels[i]} (channel rank {i + 1})"
            if ref in not_ready:
                problems.append(f"{who} did not answer within {owner.timeout_s + _RAY_GRACE_S:.0f} s")
                continue
            try:
                got = ray.get(ref)
            except Exception as exc:  # noqa: BLE001
                problems.append(f"{who} failed: {_first_line(exc)}")
                continue
            if got != self.version:
                problems.append(f"{who} reports version {got}")
        if sender_error or problems:
            owner._connected = False  # rebuild the channel on the next sync
            ranks = "; ".join(f"rank {i + 1} = {label}" for i, label in enumerate(owner.labels))
            raise WeightChannelError(
                f"weight sync to version {self.version} failed: "
                + "; ".join(([f"sender: {sender_error}"] if sender_error else []) + problems)
                + f" [{ranks}]. Check those roles' logs under the job directory"
            )


class DistributedWeightSync:
    """`WeightSync` over the bucketed torch.distributed channel between Ray actors.

    `host` is the driver's node address: the sender hosts the channel on the interface of its own
    node that routes there (module docstring); `port` is the store's port there (0: any free one).
    """

    def __init__(
        self, sender: Any, receivers: Sequence[Any], host: str, port: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "cpu",
        receiver_devices: Sequence[str] | None = None, labels: Sequence[str] | None = None,
    ) -> None:
        if not receivers:
            raise ValueError("DistributedWeightSync needs at least one receiver actor")
        self.sender, self.receivers = sender, list(receivers)
        self.host, self.port, self.bucket_bytes = host, port, bucket_bytes
        self.address = ""  # host:port of the open channel, as the sender answered
        self.timeout_s, self.device = timeout_s, device
        self.receiver_devices = list(receiver_devices or [device] * len(self.receivers))
        self.labels = list(labels or [f"receiver {i}" for i in range(len(self.receivers))])
        if len(self.receiver_devices) != len(self.receivers) or len(self.labels) != len(self.receivers):
            raise ValueError("receiver_devices and labels need one entry per receiver actor")
        self._connected = False

    def connect(self) -> None:
        """Open the channel on the sender and join every receiver (idempotent)."""
        import ray

        if self._connected:
            return
        n, deadline = len(self.receivers), self.timeout_s + _RAY_GRACE_S
        host, port = ray.get(
            self.sender.open_weight_channel.remote(
                self.host, self.port, n, self.bucket_bytes, self.timeout_s, self.device
            ),
            timeout=deadline,
        )
        self.address = f"{host}:{port}"
        joins = [
            r.join_weight_channel.remote(host, port, i + 1, n, self.timeout_s, dev)
            for i, (r, dev) in enumerate(zip(self.receivers, self.receiver_devices))
        ]
        _, late = ray.wait(joins, num_returns=len(joins), timeout=deadline)
        if late:
            names = [self.labels[joins.index(ref)] for ref in late]
            raise WeightChannelError(
                f"weight channel at {self.address} (trainer rank 0's node): {names} did not join within "
                f"{deadline:.0f} s; check that they can reach that node's address and port"
            )
        ray.get(joins)
        self._connected = True

    def start(self, version: int) -> PendingSync:
        """Begin broadcasting `version`; the trainer may keep training until `wait()`."""
        self.connect()
        receive_refs = [r.receive_weights.remote() for r in self.receivers]
        start_ref = self.sender.start_send_weights.remote(version)
        return PendingSync(self, version, start_ref, receive_refs)

    def expect(self, version: int) -> PendingSync:
        """The receivers' side of a broadcast the trainer starts itself (see the module doc):
        every receiver takes part in the next broadcast, which must be `version`."""
        self.connect()
        return PendingSync(self, version, None, [r.receive_weights.remote() for r in self.receivers])

    def sync(self, version: int) -> None:
        self.start(version).wait()

    def close(self) -> None:
        import ray

        refs = [a.close_weight_channel.remote() for a in [self.sender, *self.receivers]]
        ray.wait(refs, num_returns=len(refs), timeout=_RAY_GRACE_S)
        self._connected = False
