"""Role-side ends of the weight channel, as mixins a role class inherits (Ray exposes their methods).

* `WeightSenderEndpoint` for the trainer's rank 0; the class must provide
  `export_weights() -> list[(name, tensor)]` returning a snapshot (clones), because the
  broadcast runs on a background thread while the next training step changes the model.
* `WeightReceiverEndpoint` for rollout engines (later ActorFwd / Reference); the class must
  provide `weight_version() -> int` and `update_weights(named_tensors, version)`.

A receiver applies bucket after bucket under its *old* version and switches to the new version
only after the last bucket, so a failed broadcast never leaves an engine claiming a version it
does not fully hold. While `receive_weights` runs, the role's actor serves no other call: a
generate request queued behind it starts only after the swap, i.e. engines pause at a batch
boundary, swap, and resume.
"""

from __future__ import annotations

from typing import Iterable

import torch

from relax_hpc.weights.channel import (
    DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT_S, PendingBroadcast, WeightChannelReceiver, WeightChannelSender,
)


class WeightSenderEndpoint:
    """Mixin: trainer rank 0 hosts the channel and sends snapshots of its weights."""

    _weight_sender: WeightChannelSender | None = None
    _weight_pending: PendingBroadcast | None = None

    def export_weights(self) -> list[tuple[str, torch.Tensor]]:
        raise NotImplementedError("a WeightSenderEndpoint must define export_weights()")

    def open_weight_channel(
        self, host: str, port: int, num_receivers: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "cpu",
    ) -> int:
        """Host the channel's store at host:port (0 = any free port); returns the port receivers join."""
        self.close_weight_channel()
        self._weight_sender = WeightChannelSender(host, port, num_receivers, bucket_bytes, timeout_s, device)
        return self._weight_sender.port

    def start_send_weights(self, version: int) -> None:
        """Snapshot the weights now and broadcast them in the background (returns at once)."""
        if self._weight_sender is None:
            raise RuntimeError("start_send_weights before open_weight_channel: open the channel first")
        if self._weight_pending is not None:
            self.finish_send_weights()  # one broadcast at a time; surface the previous one's error
        self._weight_pending = self._weight_sender.broadcast_async(self.export_weights(), version)

    def finish_send_weights(self) -> int:
        """Wait for the background broadcast; returns its version or raises its error."""
        pending, self._weight_pending = self._weight_pending, None
        if pending is None:
            raise RuntimeError("finish_send_weights without start_send_weights")
        return pending.wait()

    def send_weights(self, version: int) -> int:
        self.start_send_weights(version)
        return self.finish_send_weights()

    def close_weight_channel(self) -> None:
        sender, self._weight_sender, self._weight_pending = self._weight_sender, None, None
        if sender is not None:
            sender.close()


class WeightReceiverEndpoint:
    """Mixin: a rollout engine (or any weight consumer) joins the channel and receives broadcasts."""

    _weight_receiver: WeightChannelReceiver | None = None

    def weight_version(self) -> int:
        raise NotImplementedError("a WeightReceiverEndpoint must define weight_version()")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        raise NotImplementedError("a WeightReceiverEndpoint must define update_weights()")

    def join_weight_channel(
        self, host: str, port: int, rank: int, num_receivers: int, timeout_s: float = DEFAULT_TIMEOUT_S,
        device: str = "cpu", pipeline: bool = True,
    ) -> None:
        self.close_weight_channel()
        self._weight_receiver = WeightChannelReceiver(
            host, port, rank, num_receivers, timeout_s, device, pipeline=pipeline
        )

    def receive_weights(self) -> int:
        """Receive one broadcast, applying each bucket as it arrives; returns the new version."""
        if self._weight_receiver is None:
            raise RuntimeError("receive_weights before join_weight_channel: join the channel first")
        old = self.weight_version()
        version = self._weight_receiver.receive(lambda bucket: self.update_weights(bucket, old))
        self.update_weights([], version)
        return version

    def close_weight_channel(self) -> None:
        receiver, self._weight_receiver = self._weight_receiver, None
        if receiver is not None:
            receiver.close()
