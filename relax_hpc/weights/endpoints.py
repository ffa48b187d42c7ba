"""Role-side ends of the weight channel, as mixins a role class inherits (Ray exposes their methods).

* `WeightSenderEndpoint` for the trainer's rank 0; the class must provide
  `export_weights() -> list[(name, tensor)]` returning a snapshot (clones), because the
  broadcast runs on a background thread while the next training step changes the model. A
  class that also provides `live_weights()` (the tensors themselves) is snapshotted by the
  channel instead, into one flat buffer laid out as the buckets: the same one copy as a clone,
  and then the broadcast copies nothing (docs/weights.md, "Flat buffers").
* `WeightReceiverEndpoint` for rollout engines and ActorFwd; the class must provide
  `weight_version() -> int` and `update_weights(named_tensors, version)`, and may override
  `stage_weights` / `commit_weights` / `weights_failed` to keep a broadcast apart until it is
  complete (the roles do, through a `WeightInbox`).

Both ends key the channel's store with `job_secret()`, read in the role's own process from the
file ``RELAX_HPC_SECRET_FILE`` names: the secret never travels in a Ray call.

A receiver stages bucket after bucket and switches to the new version only after the last
bucket (`commit_weights`), so a failed broadcast never leaves an engine claiming, or running,
a version it does not fully hold. The receiving runs on one of the actor's threads while its
producer keeps generating: the producer swaps a committed update in at its next batch boundary,
and waits there (`WeightInbox.wait_for`) when the staleness bound needs a version that is still
on the wire.
"""

from __future__ import annotations

import abc
import threading
import time
from typing import Callable, Iterable

import torch

from relax_hpc.auth import job_secret
from relax_hpc.weights.channel import (
    DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT_S, PendingBroadcast, WeightChannelReceiver, WeightChannelSender,
)
from relax_hpc.weights.flat import FlatWeights
from relax_hpc.weights.group import local_address_towards

_ROUTE_PROBE_PORT = 9  # any port: local_address_towards only looks up the route, it sends nothing


class WeightSenderEndpoint(abc.ABC):
    """Mixin: trainer rank 0 hosts the channel and sends snapshots of its weights."""

    _weight_sender: WeightChannelSender | None = None
    _weight_pending: PendingBroadcast | None = None
    _weight_snapshot: FlatWeights | None = None

    @abc.abstractmethod
    def export_weights(self) -> list[tuple[str, torch.Tensor]]:
        """A snapshot (clones) of the weights to send."""

    def live_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        """The weights themselves (no copy), for the channel to snapshot; None: use `export_weights`."""
        return None

    def open_weight_channel(
        self, peer: str, port: int, num_receivers: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "cpu",
    ) -> tuple[str, int]:
        """Host the channel's store on this node at `port` (0 = any free port); returns the
        (host, port) receivers join.

        The store listens on this node's address on the interface that routes to `peer` (the
        driver's node): the trainer's rank 0, which hosts it, may run on another node than the
        driver, and a store listens only on an address of its own node.
        """
        self.close_weight_channel()
        host = local_address_towards(peer, _ROUTE_PROBE_PORT)
        self._weight_sender = WeightChannelSender(
            host, port, num_receivers, bucket_bytes, timeout_s, device, secret=job_secret()
        )
        return host, self._weight_sender.port

    def start_send_weights(self, version: int) -> None:
        """Snapshot the weights now and broadcast them in the background (returns at once)."""
        if self._weight_sender is None:
            raise RuntimeError("start_send_weights before open_weight_channel: open the channel first")
        if self._weight_pending is not None:
            self.finish_send_weights()  # one broadcast at a time; surface the previous one's error
        live = self.live_weights()
        if live is None:
            payload: list[tuple[str, torch.Tensor]] | FlatWeights = self.export_weights()
        else:  # the previous snapshot is off the wire: refill it
            payload = self._weight_snapshot = self._weight_sender.snapshot(live, reuse=self._weight_snapshot)
        self._weight_pending = self._weight_sender.broadcast_async(payload, version)

    def finish_send_weights(self) -> int:
        """Wait for the background broadcast; returns its version or raises its error."""
        pending, self._weight_pending = self._weight_pending, None
        if pending is None:
            raise RuntimeError("finish_send_weights without start_send_weights")
        return pending.wait()

    def send_weights(self, version: int) -> int:
        self.start_send_weights(version)
        return self.finish_send_weights()

    def weight_channel_bytes(self) -> tuple[list[torch.Tensor], int]:
        """What this sender holds for the channel: its snapshot (whole model, in `home`) and the
        bytes of its staging buffers on the wire's device."""
        snapshot = [self._weight_snapshot.buffer] if self._weight_snapshot is not None else []
        return snapshot, self._weight_sender.staging_bytes if self._weight_sender is not None else 0

    def close_weight_channel(self) -> None:
        sender, self._weight_sender, self._weight_pending = self._weight_sender, None, None
        self._weight_snapshot = None
        if sender is not None:
            sender.close()


class WeightReceiverEndpoint(abc.ABC):
    """Mixin: a rollout engine (or any weight consumer) joins the channel and receives broadcasts."""

    _weight_receiver: WeightChannelReceiver | None = None

    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version the role runs now."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Take a complete update of `version`."""

    def weight_home(self) -> str | None:
        """Where this role keeps received weights (`WeightChannelReceiver`'s `home`): None for the
        wire's device, where an engine that computes with the buffer in place needs them."""
        return None

    def join_weight_channel(
        self, host: str, port: int, rank: int, num_receivers: int, timeout_s: float = DEFAULT_TIMEOUT_S,
        device: str = "cpu", pipeline: bool = True,
    ) -> None:
        self.close_weight_channel()
        self._weight_receiver = WeightChannelReceiver(
            host, port, rank, num_receivers, timeout_s, device, secret=job_secret(),
            pipeline=pipeline, home=self.weight_home(),
        )

    def stage_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """One bucket of a broadcast in flight; by default applied under the old version."""
        self.update_weights(bucket, self.weight_version())

    def commit_weights(self, version: int) -> None:
        """The last bucket arrived: the update is complete and is `version` from now on."""
        self.update_weights([], version)

    def weights_failed(self, message: str) -> None:
        """A broadcast failed mid-way (its error is raised to the caller of `receive_weights` too)."""

    def weight_inbox(self) -> WeightInbox | None:
        """The role's inbox, to receive straight into its spare flat buffer; None: stage buckets."""
        return None

    def receive_weights(self) -> int:
        """Receive one broadcast (into the inbox, or staging each bucket as it arrives), then
        `commit_weights`; returns the new version."""
        if self._weight_receiver is None:
            raise RuntimeError("receive_weights before join_weight_channel: join the channel first")
        inbox = self.weight_inbox()
        try:
            if inbox is not None:
                version = inbox.receive(self._weight_receiver)
            else:
                version = self._weight_receiver.receive(self.stage_weights)
        except Exception as exc:
            self.weights_failed(f"{type(exc).__name__}: {exc}")
            raise
        self.commit_weights(version)
        return version

    def weight_receiver_staging_bytes(self) -> int:
        return self._weight_receiver.staging_bytes if self._weight_receiver is not None else 0

    def close_weight_channel(self) -> None:
        receiver, self._weight_receiver = self._weight_receiver, None
        if receiver is not None:
            receiver.close()


Weights = dict[str, torch.Tensor]
BindFn = Callable[[FlatWeights, int], bool]
CopyFn = Callable[[list[tuple[str, torch.Tensor]], int], None]


class WeightInbox:
    """Where a receiving role keeps weight updates until its engine can swap them in.

    Two ways in. A channel receive goes straight into a flat buffer (`receive`): the spare one,
    which the engine does not run on, so nothing is copied after the wire. Loose buckets (the
    in-process sync, `update_weights`) are staged as copies. Either way `commit` after the last
    bucket turns what arrived into a complete update, and `install` hands the newest one to the
    engine at its batch boundary: a flat update is bound (the engine's parameters become views
    into it, and the buffer it ran on becomes the spare) or, when the engine cannot bind it,
    copied. Complete updates not yet installed merge, the newer version winning (each carries
    every tensor); a receive that finds one waiting reuses its buffer. Thread safe: the
    channel's thread receives and commits while the role's producer waits and installs.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._staged: Weights = {}
        self._staged_flat: FlatWeights | None = None
        self._ready: Weights | FlatWeights | None = None
        self._ready_version = -1
        self._spare: FlatWeights | None = None  # a flat buffer nobody reads: the next receive's target
        self._bound: FlatWeights | None = None  # the flat buffer the engine runs on, or copied last
        self._failure: str | None = None
        self.awaited: int | None = None  # the version a producer is waiting for (diagnostics, tests)

    def stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        copies = [(name, tensor.detach().clone()) for name, tensor in named_tensors]
        with self._changed:
            self._staged.update(copies)

    def receive(self, receiver: WeightChannelReceiver) -> int:
        """Take part in the channel's next broadcast, received into the spare flat buffer."""
        with self._changed:
            spare, self._spare = self._spare, None
            if spare is None and isinstance(self._ready, FlatWeights):
                # The waiting update is about to be superseded: its buffer takes the new one.
                spare, self._ready = self._ready, None
        flat, version = receiver.receive_into(spare)
        with self._changed:
            self._staged_flat = flat
        return version

    def commit(self, version: int) -> None:
        with self._changed:
            if self._staged_flat is not None:
                replaced = self._ready
                self._ready, self._staged_flat = self._staged_flat, None
                if isinstance(replaced, FlatWeights):
                    self._spare = replaced
            else:
                ready = dict(self._ready.named()) if isinstance(self._ready, FlatWeights) else self._ready
                self._ready = {**(ready or {}), **self._staged}
            self._ready_version, self._staged, self._failure = version, {}, None
            self._changed.notify_all()

    def fail(self, message: str) -> None:
        """Drop the staged part of a failed broadcast and wake a producer waiting for it."""
        with self._changed:
            self._staged, self._staged_flat, self._failure = {}, None, message
            self._changed.notify_all()

    def install(self, bind: BindFn, copy: CopyFn) -> int | None:
        """Hand the newest complete update to the engine; returns its version, None when there is none.

        A flat update is given to `bind(flat, version)`; when that returns False (the engine
        cannot use the buffer in place) or for staged copies, `copy(named_tensors, version)`.
        The tensors given either way stay unchanged until the next install: the engine may keep
        them instead of a copy. Call it only where the engine may change weights (its batch
        boundary).
        """
        with self._changed:
            ready, self._ready = self._ready, None
            version = self._ready_version
        if ready is None:
            return None
        if not isinstance(ready, FlatWeights):
            copy(list(ready.items()), version)
            return version
        # Bound or copied, the buffer is kept until the next install: an engine that copied it
        # may still read it (an SGLang server restarted in between is given this version again
        # from these tensors, so no engine keeps a host copy of its own).
        if not bind(ready, version):
            copy(ready.named(), version)
        released, self._bound = self._bound, ready
        if released is not None:
            with self._changed:
                self._spare = released
        return version

    def buffers(self) -> list[torch.Tensor]:
        """The flat buffers this inbox holds now (installed, waiting, spare, being received)."""
        with self._changed:
            held = [self._bound, self._spare, self._staged_flat,
                    self._ready if isinstance(self._ready, FlatWeights) else None]
        return [flat.buffer for flat in held if flat is not None]

    def release_buffers(self) -> int:
        """Drop the flat buffers kept for the engine (the one it ran on, and the spare) while
        the engine has released its memory; returns the bytes of the spare (the engine counts
        its own). A complete update not yet installed is kept; the next receive allocates anew."""
        with self._changed:
            spare, self._spare, self._bound = self._spare, None, None
        return 0 if spare is None else spare.buffer.numel() * spare.buffer.element_size()

    def wait_for(self, version: int, current: int, stop: threading.Event, timeout_s: float, who: str) -> bool:
        """Block until the engine (at `current`) or a complete update holds at least `version`.

        False when `stop` is set first. Raises when the broadcast failed or after `timeout_s`,
        saying which version `who` waited for.
        """
        deadline = time.monotonic() + timeout_s
        with self._changed:
            self.awaited = version
            try:
                while max(current, self._ready_version if self._ready is not None else -1) < version:
                    if stop.is_set():
                        return False
                    if self._failure is not None:
                        raise RuntimeError(
                            f"{who} needs weight version {version} (engine has {current}), but the "
                            f"weight broadcast failed: {self._failure}"
                        )
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(
                            f"{who} waited {timeout_s:g} s for weight version {version} (engine has "
                            f"{current}, last complete update {self._ready_version}); the trainer's "
                            "broadcast never completed: check the driver and trainer logs"
                        )
                    # Wake up now and then to see the stop flag, which does not notify.
                    self._changed.wait(min(left, 0.5))
                return True
            finally:
                self.awaited = None
