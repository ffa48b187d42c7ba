"""Weight channel logic in one process: the pure layout, and sender/receivers as threads over the
in-memory broadcast group and torch's in-process HashStore."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from weights_harness import make_weights

from relax_hpc.auth import JobSecret
from relax_hpc.weights.channel import WeightChannelReceiver, WeightChannelSender, WeightChannelTimeout
from relax_hpc.weights.group import LocalBroadcastHub
from relax_hpc.weights.layout import (
    ALIGN, Header, decode_header, encode_header, pack_bucket, plan_buckets, unpack_bucket,
)


# --------------------------------------------------------------------------- layout
def test_plan_splits_by_bucket_size_and_sends_large_tensors_direct() -> None:
    named = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("big", torch.zeros(100)), ("c", torch.zeros(3))]
    buckets = plan_buckets(named, bucket_bytes=128, direct_bytes=300)
    # a: 40 B @0; b: 40 B @64 (aligned) -> 104 <= 128, same bucket; big: 400 B > 128 -> direct;
    # c: 12 B -> new packed bucket.
    assert [(b.direct, [p.name for p in b.params], b.nbytes) for b in buckets] == [
        (False, ["a", "b"], 104), (True, ["big"], 400), (False, ["c"], 12),
    ]
    assert [p.offset for p in buckets[0].params] == [0, ALIGN]


def test_plan_rejects_duplicate_names_and_tiny_buckets() -> None:
    with pytest.raises(ValueError, match=r"\['w'\] more than once"):
        plan_buckets([("w", torch.zeros(1)), ("w", torch.zeros(1))], 1024, 1024)
    with pytest.raises(ValueError, match="bucket_bytes=8"):
        plan_buckets([("w", torch.zeros(1))], 8, 1024)


def test_header_round_trips_as_json_and_pack_unpack_is_exact() -> None:
    named = make_weights(5)
    header = Header(7, 3, "gloo", plan_buckets(named, bucket_bytes=1 << 20, direct_bytes=1 << 30))
    raw = encode_header(header)
    assert raw.startswith(b"{") and decode_header(raw) == header
    (bucket,) = header.buckets
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
    out = dict(unpack_bucket(bucket, pack_bucket(bucket, dict(named), buf)))
    for name, t in named:
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name


def test_header_from_another_format_is_refused() -> None:
    with pytest.raises(ValueError, match="header format 99"):
        decode_header(b'{"format": 99}')


# --------------------------------------------------------------------------- channel (threads)
class LocalChannel:
    """A sender and `n` receivers in this process; receivers run `receive` on threads."""

    def __init__(self, n: int, timeout_s: float = 5.0, **sender_kw: Any) -> None:
        self.hub, self.store = LocalBroadcastHub(1 + n, timeout_s), dist.HashStore()
        self.secret = JobSecret.generate()
        self.sender = WeightChannelSender(
            "", 0, n, timeout_s=timeout_s, secret=self.secret, store=self.store,
            group_factory=lambda _b: self.hub.group(0), **sender_kw,
        )
        self.receivers = [self.join(r, n, timeout_s) for r in range(1, n + 1)]

    def join(self, rank: int, n: int, timeout_s: float) -> WeightChannelReceiver:
        return WeightChannelReceiver(
            "", 0, rank, n, timeout_s=timeout_s, secret=self.secret, store=self.store,
            group_factory=lambda _b: self.hub.group(rank),
        )

    def receive_on_threads(self, ranks: list[int], targets: dict[str, torch.Tensor] | None = None) -> dict[int, Any]:
        results: dict[int, Any] = {}

        def run(rank: int) -> None:
            got: dict[str, torch.Tensor] = {}
            calls: list[int] = []

            def apply(bucket: list[tuple[str, torch.Tensor]]) -> None:
                calls.append(len(bucket))
                got.update({n: t.clone() for n, t in bucket})

            try:
                version = self.receivers[rank - 1].receive(apply, targets)
                results[rank] = (version, got, calls)
            except Exception as exc:  # noqa: BLE001 - asserted by the tests
                results[rank] = exc

        self.threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
        for t in self.threads:
            t.start()
        return results

    def join_threads(self) -> None:
        for t in self.threads:
            t.join(timeout=30)


def test_two_versions_reach_every_receiver_exactly() -> None:
    ch = LocalChannel(2, bucket_bytes=512)
    for version, seed in [(1, 1), (2, 2)]:
        results = ch.receive_on_threads([1, 2])
        assert ch.sender.broadcast(make_weights(seed), version) == version
        ch.join_threads()
        for rank in (1, 2):
            got_version, got, calls = results[rank]
            assert got_version == version and ch.receivers[rank - 1].version == version
            assert len(calls) > 3  # 512-byte buckets split the parameters
            for name, t in make_weights(seed):
                assert got[name].dtype == t.dtype and torch.equal(got[name], t), (rank, name)


def test_direct_parameters_land_in_their_targets_without_a_buffer() -> None:
    ch = LocalChannel(1, direct_bytes=1024)
    named = make_weights(3)
    targets = {name: torch.zeros_like(t).contiguous() for name, t in named}
    results = ch.receive_on_threads([1], targets)
    ch.sender.broadcast(named, 4)
    ch.join_threads()
    version, got, _ = results[1]
    assert version == 4
    assert torch.equal(targets["embed.weight"], dict(named)["embed.weight"])  # direct: written in place
    assert torch.equal(targets["layer.0.b"], torch.zeros(33))  # packed: only handed to apply
    assert torch.equal(got["layer.0.b"], dict(named)["layer.0.b"])


def test_async_broadcast_returns_before_receivers_finish() -> None:
    ch = LocalChannel(1)
    pending = ch.sender.broadcast_async(make_weights(1), 9)
    time.sleep(0.2)
    assert not pending.done()  # the receiver has not started: the sender waits for it
    results = ch.receive_on_threads([1])
    assert pending.wait(timeout=10) == 9
    ch.join_threads()
    assert results[1][0] == 9


def test_receiver_that_does_not_receive_is_named_and_channel_stays_broken() -> None:
    ch = LocalChannel(2, timeout_s=0.5)
    ch.receive_on_threads([1])  # rank 2 never calls receive
    with pytest.raises(WeightChannelTimeout, match=r"rank\(s\) \[2\] did not start receiving") as info:
        ch.sender.broadcast(make_weights(1), 1)
    assert info.value.missing_ranks == [2]
    ch.join_threads()
    with pytest.raises(RuntimeError, match="broken by an earlier failure"):
        ch.sender.broadcast(make_weights(1), 2)


def test_receiver_without_a_sender_times_out_naming_the_sender() -> None:
    ch = LocalChannel(1, timeout_s=0.3)
    with pytest.raises(WeightChannelTimeout, match="sender \\(trainer rank 0\\) published no broadcast #0"):
        ch.receivers[0].receive(lambda bucket: None)


def test_invalid_arguments_are_refused_with_the_allowed_values() -> None:
    store, secret = dist.HashStore(), JobSecret.generate()
    with pytest.raises(ValueError, match="allowed are 1..2"):
        WeightChannelReceiver(
            "", 0, 0, 2, secret=secret, store=store, group_factory=lambda _b: LocalBroadcastHub(3).group(0)
        )
    with pytest.raises(ValueError, match="at least one receiver"):
        WeightChannelSender("", 0, 0, secret=secret, store=store)
    with pytest.raises(ValueError, match="'cpu' \\(gloo\\) and 'cuda"):
        WeightChannelSender("", 0, 1, secret=secret, store=store, device="meta")
