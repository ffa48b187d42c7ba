"""The bucketed, versioned weight channel: trainer rank 0 broadcasts parameters to every receiver.

One sender (rank 0, the trainer's first rank; it hosts the channel's TCPStore on the address
the receivers are given) and `num_receivers` receivers (ranks 1..n: rollout engines, ActorFwd,
Reference). The channel reaches the store through `seal_store(..., secret, "weights")`: every key
below, the gloo/NCCL rendezvous included, lives under the job secret's prefix, and every value is
sealed with a key derived from the secret, so a client without it can neither read nor forge one
(docs/weights.md, "Who can reach the store"). One broadcast:

1. the sender writes the JSON header (version, sequence number, backend, bucket layout) to the
   store under ``header/<seq>``; every receiver announces ``ready/<seq>/<rank>`` and reads it;
2. the sender waits (deadline) until every receiver is ready, naming the ones that are not;
3. buckets go out one collective each, pipelined: the sender packs bucket k+1 while bucket k is
   on the wire, a receiver posts bucket k+1 before it applies bucket k. A `FlatWeights`
   snapshot (`snapshot`) is sent without packing, and `receive_into` receives into one
   without unpacking: the roles move weights that way, copying nothing but the snapshot;
4. a final "done" collective carries (version, seq, bucket count) so a receiver that fell out of
   step fails loudly instead of applying someone else's bytes;
5. each receiver sets ``ack/<seq>/<rank>`` after its last apply; the sender waits (deadline) for
   all acks and names the receivers that did not answer.

`broadcast_async` runs the broadcast on a background thread so it overlaps the next training
step; the tensors handed over must not change until its handle's `wait()` returns (a snapshot
is a copy, so that holds). See docs/weights.md for the measured figures.

Whole-model buffers live in each side's `home`, which is not necessarily the wire's device: the
sender's snapshot is in host memory by default (a trainer GPU has no room for another copy of
the model), and so are the buffers of a receiver whose engines are servers with weights of their
own. Those buckets go through two bucket-sized staging buffers on the wire's device
(`_broadcast_staged`), so the GPU holds two buckets of the model, never all of it.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import time
from collections import deque
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from relax_hpc.auth import JobSecret
from relax_hpc.weights.flat import FlatWeights
from relax_hpc.weights.group import (
    BroadcastGroup, PendingOp, TorchBroadcastGroup, backend_for, local_address_towards, open_store,
)
from relax_hpc.weights.layout import (
    Bucket, Header, as_bytes, decode_header, dtype_name, encode_header, pack_bucket, plan_buckets, unpack_bucket,
)
from relax_hpc.weights.sealed_store import SealedStore, seal_store

MIB = 1 << 20
DEFAULT_BUCKET_BYTES = 512 * MIB
DEFAULT_DIRECT_BYTES = 16 * MIB
DEFAULT_TIMEOUT_S = 600.0

NamedTensors = Sequence[tuple[str, torch.Tensor]]
ApplyFn = Callable[[list[tuple[str, torch.Tensor]]], None]
GroupFactory = Callable[[str], BroadcastGroup]  # backend name -> this rank's group


class WeightChannelError(RuntimeError):
    """A broadcast failed; the channel is unusable until it is rebuilt."""


class WeightChannelTimeout(WeightChannelError, TimeoutError):
    def __init__(self, message: str, missing_ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing_ranks = list(missing_ranks)


def _missing(store: dist.Store, keys: dict[int, str]) -> list[int]:
    return sorted(rank for rank, key in keys.items() if not store.check([key]))


def _wait_keys(store: dist.Store, keys: dict[int, str], deadline: float) -> list[int]:
    """Wait until every key exists or the deadline passes; returns the ranks whose key is missing."""
    remaining = deadline - time.monotonic()
    if remaining > 0:
        try:
            store.wait(list(keys.values()), datetime.timedelta(seconds=remaining))
            return []
        except (RuntimeError, dist.DistStoreError):
            pass  # a timeout; find out which keys are missing below
    return _missing(store, keys)


def _broadcast_buckets(group: BroadcastGroup, flat: FlatWeights) -> None:
    """Every bucket of `flat`, one collective each, from rank 0 into the same slices everywhere
    (the same call on the sender and on a receiver); at most two on the wire at once."""
    in_flight: deque[PendingOp] = deque()
    for k, bucket in enumerate(flat.buckets):
        if bucket.nbytes == 0:
            continue
        while len(in_flight) > 1:
            in_flight.popleft().wait()
        in_flight.append(group.broadcast(flat.bucket(k), 0))
    while in_flight:
        in_flight.popleft().wait()


def _broadcast_staged(group: BroadcastGroup, flat: FlatWeights, staging: Sequence[torch.Tensor],
                      sending: bool) -> None:
    """`_broadcast_buckets` for a `flat` kept away from the wire's device: each bucket passes
    through one of the `staging` buffers on that device. The sender copies bucket k into a free
    staging buffer and broadcasts it; a receiver receives into one and copies it out into `flat`.
    As many buckets are on the wire at once as there are staging buffers."""
    in_flight: deque[tuple[PendingOp, int, torch.Tensor]] = deque()

    def land(op: PendingOp, k: int, buf: torch.Tensor) -> None:
        op.wait()
        if not sending:
            flat.bucket(k).copy_(buf)  # into host memory: returns once the bytes are there

    slot = 0
    for k, bucket in enumerate(flat.buckets):
        if bucket.nbytes == 0:
            continue
        while len(in_flight) >= len(staging):  # the buffer about to be used is free again
            land(*in_flight.popleft())
        buf = staging[slot][: bucket.nbytes]
        if sending:
            buf.copy_(flat.bucket(k), non_blocking=True)  # the broadcast is queued after it
        in_flight.append((group.broadcast(buf, 0), k, buf))
        slot = (slot + 1) % len(staging)
    while in_flight:
        land(*in_flight.popleft())


def _needs_staging(home: torch.device, wire: torch.device, stage: bool | None) -> bool:
    return home != wire if stage is None else stage


class PendingBroadcast:
    """Handle of a broadcast running on the sender's background thread."""

    def __init__(self, future: concurrent.futures.Future[int], version: int) -> None:
        self._future, self.version = future, version

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> int:
        """Block until every receiver acknowledged; returns the version, or raises the broadcast's error."""
        return self._future.result(timeout)


class WeightChannelSender:
    """Rank 0 of the weight channel; hosts the TCPStore at `host:port` (`port=0` picks a free one),
    listening on `host`'s address only; `secret` is the job's (`relax_hpc.auth.job_secret()`).

    `home` is where `snapshot` keeps the whole model: host memory ("cpu") unless told otherwise,
    whatever the wire's `device`. `stage` forces (True) or forbids (False) passing the snapshot's
    buckets through staging buffers on the wire's device; by default they are staged exactly when
    the snapshot is not on that device.
    """

    def __init__(
        self, host: str, port: int, num_receivers: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "cpu", *, secret: JobSecret,
        direct_bytes: int = DEFAULT_DIRECT_BYTES, store: dist.Store | None = None,
        group_factory: GroupFactory | None = None, home: str = "cpu", stage: bool | None = None,
    ) -> None:
        if num_receivers < 1:
            raise ValueError(f"num_receivers={num_receivers}: the weight channel needs at least one receiver")
        self.num_receivers, self.bucket_bytes, self.direct_bytes = num_receivers, bucket_bytes, direct_bytes
        self.timeout_s, self.device, self.home = timeout_s, torch.device(device), torch.device(home)
        self.staged = _needs_staging(self.home, self.device, stage)
        self.backend = backend_for(self.device)
        raw = store if store is not None else open_store(host, port, 1 + num_receivers, True, timeout_s)
        self.host = host
        self.port = int(getattr(raw, "port", port))
        self.store: SealedStore = seal_store(raw, secret, "weights")
        self._group_factory = group_factory or (
            lambda backend: TorchBroadcastGroup(
                self.store, 0, 1 + num_receivers, backend, timeout_s, bind_host=host, device=self.device
            )
        )
        self._group: BroadcastGroup | None = None
        self._staging: list[torch.Tensor] = []
        self._seq = 0
        self._broken = ""
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-channel")

    def broadcast(self, weights: NamedTensors | FlatWeights, version: int) -> int:
        """Send `weights` as `version` to every receiver; returns once all acknowledged."""
        return self.broadcast_async(weights, version).wait()

    def broadcast_async(self, weights: NamedTensors | FlatWeights, version: int) -> PendingBroadcast:
        """Start the broadcast on the background thread (one at a time, in call order).

        A `FlatWeights` (see `snapshot`) goes out bucket by bucket without a copy; loose
        (name, tensor) pairs are packed into staging buffers on the way.
        """
        payload = weights if isinstance(weights, FlatWeights) else list(weights)
        return PendingBroadcast(self._pool.submit(self._broadcast, payload, version), version)

    def snapshot(self, named_tensors: NamedTensors, reuse: FlatWeights | None = None) -> FlatWeights:
        """Copy `named_tensors` into a flat buffer laid out in this channel's buckets, in `home`.

        The one copy a sender that keeps training must make anyway; broadcasting the result then
        copies nothing but each bucket into staging when `home` is not the wire's device. Pass
        the previous snapshot as `reuse` once its broadcast is done.
        """
        flat = FlatWeights.snapshot(named_tensors, self.bucket_bytes, self.direct_bytes, self.home, reuse,
                                    pin=self.device.type == "cuda")
        if self.device.type == "cuda" or self.home.type == "cuda":
            torch.cuda.synchronize()  # the copy is done before it is sent
        return flat

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._group is not None:
            self._group.close()
            self._group = None

    # ------------------------------------------------------------------ internals
    def _keys(self, kind: str, seq: int) -> dict[int, str]:
        return {r: f"{kind}/{seq}/{r}" for r in range(1, self.num_receivers + 1)}

    def _broadcast(self, named: list[tuple[str, torch.Tensor]] | FlatWeights, version: int) -> int:
        if self._broken:
            raise WeightChannelError(
                f"weight channel is broken by an earlier failure ({self._broken}); rebuild it "
                f"(a new sender and receivers on a new port) before sending version {version}"
            )
        try:
            return self._run(named, version)
        except WeightChannelError as exc:
            self._broken = str(exc)
            raise
        except Exception as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            raise

    def _run(self, weights: list[tuple[str, torch.Tensor]] | FlatWeights, version: int) -> int:
        seq, deadline = self._seq, time.monotonic() + self.timeout_s
        if isinstance(weights, FlatWeights):
            if weights.device != self.home:
                raise ValueError(
                    f"weight snapshot lives on {weights.device}, the channel keeps snapshots on {self.home}; "
                    "take it with this channel's snapshot()"
                )
            buckets = weights.buckets
        else:
            buckets = plan_buckets(weights, self.bucket_bytes, self.direct_bytes)
        header = Header(version, seq, self.backend, buckets)
        self._forget(seq - 1)
        self.store.set(f"header/{seq}", encode_header(header))
        late = _wait_keys(self.store, self._keys("ready", seq), deadline)
        if late:
            never = [r for r in late if not self.store.check([f"joined/{r}"])]
            detail = f"; rank(s) {never} never joined the channel" if never else ""
            raise WeightChannelTimeout(
                f"weight broadcast of version {version}: receiver rank(s) {late} did not start receiving "
                f"within {self.timeout_s:.0f} s{detail}. Every receiver must call receive() for every "
                "broadcast; check those engines' logs", late,
            )
        if self._group is None:
            self._group = self._group_factory(self.backend)
        try:
            if isinstance(weights, FlatWeights):
                self._stream_flat(self._group, header, weights)
            else:
                self._stream(self._group, header, dict(weights))
        except RuntimeError as exc:
            missing = _missing(self.store, self._keys("ack", seq))
            raise WeightChannelError(
                f"weight broadcast of version {version} failed on the wire ({exc}); receiver rank(s) "
                f"{missing} had not acknowledged. Check those engines' logs; the channel must be rebuilt"
            ) from exc
        late = _wait_keys(self.store, self._keys("ack", seq), deadline)
        if late:
            raise WeightChannelTimeout(
                f"weight broadcast of version {version}: receiver rank(s) {late} did not acknowledge within "
                f"{self.timeout_s:.0f} s (they received the buckets but did not finish applying them)", late,
            )
        self._seq = seq + 1
        return version

    def _stream(self, group: BroadcastGroup, header: Header, tensors: dict[str, torch.Tensor]) -> None:
        staging = self._staging_buffers(header.max_packed_bytes)
        in_flight: deque[tuple[PendingOp, torch.Tensor]] = deque()
        slot = 0
        for bucket in header.buckets:
            if bucket.nbytes == 0:
                continue
            # At most one other bucket stays on the wire: the staging slot about to be packed
            # was used two buckets ago and is free once the older op is done.
            while len(in_flight) > 1:
                in_flight.popleft()[0].wait()
            if bucket.direct:
                t = tensors[bucket.params[0].name].detach()
                payload = as_bytes(t.to(self.device, non_blocking=False).contiguous())
            else:
                payload = pack_bucket(bucket, tensors, staging[slot])
                slot ^= 1
            in_flight.append((group.broadcast(payload, 0), payload))
        while in_flight:
            in_flight.popleft()[0].wait()
        self._send_done(group, header)

    def _stream_flat(self, group: BroadcastGroup, header: Header, flat: FlatWeights) -> None:
        if self.staged:
            largest = max((b.nbytes for b in flat.buckets), default=0)
            _broadcast_staged(group, flat, self._staging_buffers(largest), sending=True)
        else:
            _broadcast_buckets(group, flat)
        self._send_done(group, header)

    @property
    def staging_bytes(self) -> int:
        """The bytes of the bucket-sized staging buffers this sender holds on the wire's device."""
        return sum(t.numel() for t in self._staging)

    def _send_done(self, group: BroadcastGroup, header: Header) -> None:
        done = torch.tensor([header.version, header.seq, len(header.buckets)], dtype=torch.int64, device=self.device)
        group.broadcast(done, 0).wait()

    def _staging_buffers(self, nbytes: int) -> list[torch.Tensor]:
        if nbytes and (not self._staging or self._staging[0].numel() < nbytes):
            self._staging = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return self._staging

    def _forget(self, seq: int) -> None:
        """Drop the store keys of a finished broadcast (every receiver acknowledged it)."""
        if seq < 0:
            return
        for key in [f"header/{seq}", *self._keys("ready", seq).values(), *self._keys("ack", seq).values()]:
            self.store.delete_key(key)


class WeightChannelReceiver:
    """Rank `rank` (1..num_receivers) of the weight channel; joins the sender's store at `host:port`
    with the job's `secret` (the sender's, or it finds none of the channel's keys).

    With `pipeline=True` (default) it holds two bucket buffers so the next bucket arrives while
    the current one is applied; `pipeline=False` holds one (memory: one bucket, slower).

    `home` is where `receive_into` keeps the whole model: the wire's `device` by default (an
    engine that computes with the buffer in place needs it there), "cpu" for a role whose
    engines hold their own copy (each bucket then lands in a staging buffer on the wire's device
    and is copied out; `stage` forces or forbids that, as for the sender).
    """

    def __init__(
        self, host: str, port: int, rank: int, num_receivers: int, timeout_s: float = DEFAULT_TIMEOUT_S,
        device: str = "cpu", *, secret: JobSecret, pipeline: bool = True, store: dist.Store | None = None,
        group_factory: GroupFactory | None = None, home: str | None = None, stage: bool | None = None,
    ) -> None:
        if not 1 <= rank <= num_receivers:
            raise ValueError(f"receiver rank={rank}: allowed are 1..{num_receivers} (rank 0 is the sender)")
        self.rank, self.num_receivers, self.timeout_s = rank, num_receivers, timeout_s
        self.device, self.pipeline = torch.device(device), pipeline
        self.home = torch.device(home) if home is not None else self.device
        self.staged = _needs_staging(self.home, self.device, stage)
        self.backend = backend_for(self.device)
        raw = store if store is not None else open_store(host, port, 1 + num_receivers, False, timeout_s)
        self.store: SealedStore = seal_store(raw, secret, "weights")
        bind = local_address_towards(host, port) if store is None else ""
        self._group_factory = group_factory or (
            lambda backend: TorchBroadcastGroup(
                self.store, rank, 1 + num_receivers, backend, timeout_s, bind_host=bind, device=self.device
            )
        )
        self._group: BroadcastGroup | None = None
        self._buffers: list[torch.Tensor] = []
        self._seq = 0
        self.version = -1  # no broadcast received yet
        self.store.set(f"joined/{rank}", b"1")

    def receive(self, apply: ApplyFn, targets: Mapping[str, torch.Tensor] | None = None) -> int:
        """Take part in the next broadcast; `apply` gets each bucket's (name, tensor) pairs as it
        arrives (views into a reused buffer: copy them if you keep them). Returns the version.

        `targets` (optional, e.g. the engine's ``state_dict()``) lets a parameter that travels in
        a direct bucket land straight in its final tensor when that tensor is contiguous, on the
        channel's device and of the same dtype and shape: `apply` then gets the target itself
        (``target.copy_(target)`` is free), saving a full copy of the large parameters.
        """
        header, group = self._begin()
        self._stream(group, header, apply, targets or {})
        return self._finish(header)

    def receive_into(self, into: FlatWeights | None = None) -> tuple[FlatWeights, int]:
        """Take part in the next broadcast, receiving every bucket straight into a flat buffer.

        `into` is filled when its layout fits the broadcast's (the same model as last time);
        otherwise a new `FlatWeights` is allocated and `into` is left alone. Returns the buffer
        holding the complete update and its version. Nothing is copied after the wire but each
        bucket out of staging when `home` is not the wire's device; after a failure the buffer's
        contents are partial and must not be used.
        """
        header, group = self._begin()
        flat = into if into is not None and into.fits(header.buckets, self.home) else FlatWeights(
            header.buckets, self.home, pin=self.device.type == "cuda"
        )
        if self.staged:
            largest = max((b.nbytes for b in header.buckets), default=0)
            _broadcast_staged(group, flat, self._bucket_buffers(largest), sending=False)
        else:
            _broadcast_buckets(group, flat)
        self._check_done(group, header)
        return flat, self._finish(header)

    def _begin(self) -> tuple[Header, BroadcastGroup]:
        """Announce readiness for the next broadcast and read its header."""
        seq = self._seq
        self.store.set(f"ready/{seq}/{self.rank}", b"1")
        key = f"header/{seq}"
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.timeout_s))
        except (RuntimeError, dist.DistStoreError) as exc:
            raise WeightChannelTimeout(
                f"weight receiver rank {self.rank}: the sender (trainer rank 0) published no broadcast "
                f"#{seq} within {self.timeout_s:.0f} s; check the trainer's log", [0],
            ) from exc
        header = decode_header(self.store.get(key))
        if header.backend != self.backend:
            raise WeightChannelError(
                f"weight receiver rank {self.rank} runs on {self.device} ({self.backend}) but the sender "
                f"broadcasts over {header.backend}; give both sides the same kind of device"
            )
        if self._group is None:
            self._group = self._group_factory(self.backend)
        return header, self._group

    def _finish(self, header: Header) -> int:
        self.store.set(f"ack/{header.seq}/{self.rank}", str(header.version).encode())
        self._seq, self.version = header.seq + 1, header.version
        return header.version

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def _stream(
        self, group: BroadcastGroup, header: Header, apply: ApplyFn, targets: Mapping[str, torch.Tensor]
    ) -> None:
        buckets = [b for b in header.buckets if b.nbytes]
        direct = [self._direct_target(b, targets) for b in buckets]
        buffers = self._bucket_buffers(max((b.nbytes for b, t in zip(buckets, direct) if t is None), default=0))
        slots: list[int] = []  # buffered buckets alternate between the buffers; -1: straight into a target
        buffered = 0
        for t in direct:
            slots.append(-1 if t is not None else buffered % len(buffers))
            buffered += t is None

        def post(k: int) -> tuple[PendingOp, torch.Tensor]:
            target = direct[k]
            buf = as_bytes(target) if target is not None else buffers[slots[k]][: buckets[k].nbytes]
            return group.broadcast(buf, 0), buf

        pending = post(0) if buckets else None
        for k, bucket in enumerate(buckets):
            assert pending is not None
            op, buf = pending
            # Post the next bucket before applying this one, so it arrives while we copy.
            nxt = post(k + 1) if self.pipeline and k + 1 < len(buckets) else None
            op.wait()
            target = direct[k]
            apply([(bucket.params[0].name, target)] if target is not None else unpack_bucket(bucket, buf))
            pending = nxt if self.pipeline else (post(k + 1) if k + 1 < len(buckets) else None)
        empty = [b for b in header.buckets if not b.nbytes]
        for bucket in empty:  # zero-byte parameters never travel; hand them over as empty tensors
            apply(unpack_bucket(bucket, torch.empty(0, dtype=torch.uint8, device=self.device)))
        self._check_done(group, header)

    def _check_done(self, group: BroadcastGroup, header: Header) -> None:
        done = torch.empty(3, dtype=torch.int64, device=self.device)
        group.broadcast(done, 0).wait()
        got = [int(x) for x in done.tolist()]
        if got != [header.version, header.seq, len(header.buckets)]:
            raise WeightChannelError(
                f"weight receiver rank {self.rank}: stream out of step (expected version/seq/buckets "
                f"{[header.version, header.seq, len(header.buckets)]}, got {got}); rebuild the channel"
            )

    def _direct_target(self, bucket: Bucket, targets: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        if not bucket.direct:
            return None
        p = bucket.params[0]
        t = targets.get(p.name)
        ok = (
            t is not None and t.is_contiguous() and t.device.type == self.device.type
            and (self.device.index is None or t.device.index == self.device.index)
            and dtype_name(t.dtype) == p.dtype and tuple(t.shape) == p.shape
        )
        return t.detach() if ok and t is not None else None

    @property
    def staging_bytes(self) -> int:
        """The bytes of the bucket buffers this receiver holds on the wire's device."""
        return sum(t.numel() for t in self._buffers)

    def _bucket_buffers(self, nbytes: int) -> list[torch.Tensor]:
        count = 2 if self.pipeline else 1
        if nbytes and (len(self._buffers) != count or self._buffers[0].numel() < nbytes):
            self._buffers = []  # free the old ones before allocating the larger ones
            self._buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(count)]
        return self._buffers
