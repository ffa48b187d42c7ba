"""Flat weight buffers: snapshots laid out as the channel's buckets, receiving in place, binding a
module's parameters to the buffer without a copy."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from weights_harness import make_weights

from relax_hpc.auth import JobSecret
from relax_hpc.weights.channel import WeightChannelReceiver, WeightChannelSender
from relax_hpc.weights.group import LocalBroadcastHub

from relax_hpc.weights.flat import FlatWeights, bind_module, copy_into_module
from relax_hpc.weights.layout import ALIGN, plan_buckets
from test_weights_local import LocalChannel


def _contiguous(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.contiguous()) for n, t in named]


def test_snapshot_holds_exact_copies_laid_out_as_the_buckets() -> None:
    named = make_weights(1)
    flat = FlatWeights.snapshot(named, bucket_bytes=4096, direct_bytes=1024)
    assert flat.buckets == plan_buckets(named, 4096, 1024)
    got = dict(flat.named())
    for name, t in named:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    # every bucket starts aligned and the views share the one buffer
    assert all(start % ALIGN == 0 for start in flat.starts)
    embed = got["embed.weight"]
    assert embed.untyped_storage().data_ptr() == flat.buffer.untyped_storage().data_ptr()


def test_snapshot_refills_a_fitting_buffer_and_replaces_one_that_does_not_fit() -> None:
    first = FlatWeights.snapshot(make_weights(1), 4096, 1024)
    again = FlatWeights.snapshot(make_weights(2), 4096, 1024, reuse=first)
    assert again is first and torch.equal(dict(again.named())["layer.0.b"], dict(make_weights(2))["layer.0.b"])
    other = FlatWeights.snapshot(make_weights(2), 256, 1 << 20, reuse=first)
    assert other is not first and not first.fits(other.buckets)


def test_copy_from_names_the_parameters_that_do_not_match() -> None:
    flat = FlatWeights.snapshot(make_weights(1), 4096, 1024)
    with pytest.raises(ValueError, match=r"missing \['scale.scalar'\].*take a new snapshot"):
        flat.copy_from([(n, t) for n, t in make_weights(1) if n != "scale.scalar"])


def test_channel_sends_a_snapshot_that_receivers_take_in_place() -> None:
    ch = LocalChannel(2, bucket_bytes=512, direct_bytes=2048)
    results: dict[int, object] = {}
    buffers: dict[int, FlatWeights | None] = {1: None, 2: None}

    def run(rank: int) -> None:
        try:
            flat, version = ch.receivers[rank - 1].receive_into(buffers[rank])
            results[rank] = (flat, version, flat is buffers[rank])
            buffers[rank] = flat
        except Exception as exc:  # noqa: BLE001 - asserted below
            results[rank] = exc

    snapshot = None
    for version, seed in [(1, 1), (2, 2)]:
        threads = [threading.Thread(target=run, args=(r,)) for r in (1, 2)]
        for t in threads:
            t.start()
        snapshot = ch.sender.snapshot(make_weights(seed), reuse=snapshot)
        assert ch.sender.broadcast(snapshot, version) == version
        for t in threads:
            t.join(timeout=30)
        for rank in (1, 2):
            flat, got_version, reused = results[rank]  # type: ignore[misc]
            assert got_version == version and reused == (version == 2)
            got = dict(flat.named())
            for name, t in make_weights(seed):
                assert torch.equal(got[name], t), (rank, name)


def test_a_received_buffer_of_another_layout_is_left_alone() -> None:
    ch = LocalChannel(1, bucket_bytes=512)
    old = FlatWeights.snapshot(make_weights(9), 4096, 1024)
    before = old.buffer.clone()
    out: list = []
    t = threading.Thread(target=lambda: out.append(ch.receivers[0].receive_into(old)))
    t.start()
    ch.sender.broadcast(make_weights(3), 5)
    t.join(timeout=30)
    flat, version = out[0]
    assert version == 5 and flat is not old and torch.equal(old.buffer, before)


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.proj = torch.nn.Linear(4, 10)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as in models with tied word embeddings
        self.norm = torch.nn.LayerNorm(4)
        self.register_buffer("scale", torch.tensor(2.0))


def test_bind_module_points_every_tensor_at_the_buffer_without_a_copy() -> None:
    torch.manual_seed(0)
    src, dst = _Tiny(), _Tiny()
    flat = FlatWeights.snapshot(list(src.state_dict().items()), 1 << 20, 1 << 20)
    params_before = {n: p for n, p in dst.named_parameters()}
    assert bind_module(dst, flat)
    views = dict(flat.named())
    for name, tensor in dst.state_dict().items():
        if name != "embed.weight":  # tied: both names share the view bound last (head.weight's)
            assert tensor.data_ptr() == views[name].data_ptr(), name
    assert {n: p for n, p in dst.named_parameters()} == params_before  # same Parameter objects
    assert dst.head.weight is dst.embed.weight  # still tied
    x = torch.tensor([1, 2, 3])
    h = dst.norm(dst.embed(x))
    assert torch.equal(dst.proj(h) + dst.head(h), src.proj(src.norm(src.embed(x))) + src.head(src.norm(src.embed(x))))
    flat.buffer.zero_()  # the module now reads the buffer itself
    assert torch.count_nonzero(dst.embed.weight) == 0 and float(dst.scale) == 0.0


def test_bind_module_refuses_a_buffer_that_does_not_cover_the_module() -> None:
    src, dst = _Tiny(), _Tiny()
    before = {n: t.clone() for n, t in dst.state_dict().items()}
    half = FlatWeights.snapshot([(n, t.half()) for n, t in src.state_dict().items()], 1 << 20, 1 << 20)
    missing = FlatWeights.snapshot([(n, t) for n, t in src.state_dict().items() if n != "scale"], 1 << 20, 1 << 20)
    assert not bind_module(dst, half) and not bind_module(dst, missing)
    for name, tensor in dst.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_copy_into_module_casts_in_place_and_names_an_unknown_weight() -> None:
    src, dst = _Tiny(), _Tiny()
    ptrs = {n: t.data_ptr() for n, t in dst.state_dict().items()}
    copy_into_module(dst, [(n, t.half()) for n, t in src.state_dict().items()], "rollout")
    for name, tensor in dst.state_dict().items():
        assert tensor.data_ptr() == ptrs[name] and tensor.dtype == torch.float32, name
        assert torch.equal(tensor, src.state_dict()[name].half().float()), name
    with pytest.raises(KeyError, match="'lm_head.bias', which the actor_fwd model does not have"):
        copy_into_module(dst, [("lm_head.bias", torch.zeros(3))], "actor_fwd")


# --------------------------------------------------------------------------- staged through the wire's device
def _many_buckets(seed: int) -> list[tuple[str, torch.Tensor]]:
    """The harness's mix of dtypes and shapes (but its one large tensor, which would be a bucket
    of its own) plus twelve 4 kB layers: a model of many buckets."""
    g = torch.Generator().manual_seed(seed)
    return [*[(n, t) for n, t in make_weights(seed) if n != "embed.weight"], *[(f"extra.{i}", torch.randn(32, 32, generator=g)) for i in range(12)]]


def _staged_channel(pipelines: tuple[bool, ...]) -> tuple[WeightChannelSender, list[WeightChannelReceiver]]:
    """A sender whose snapshot stays in host memory and receivers that keep theirs there too, each
    bucket passing through staging buffers (forced: on a CPU-only machine host and wire are one
    device; on a GPU node the same path runs whenever `home` is not the wire's device)."""
    n, hub, store, secret = len(pipelines), LocalBroadcastHub(1 + len(pipelines), 5.0), dist.HashStore(), JobSecret.generate()
    sender = WeightChannelSender("", 0, n, bucket_bytes=4096, timeout_s=5.0, secret=secret, store=store,
                                 direct_bytes=1 << 20, group_factory=lambda _b: hub.group(0), home="cpu", stage=True)
    receivers = [WeightChannelReceiver("", 0, r, n, timeout_s=5.0, secret=secret, store=store, pipeline=p,
                                       group_factory=lambda _b, r=r: hub.group(r), home="cpu", stage=True)
                 for r, p in enumerate(pipelines, start=1)]
    return sender, receivers


def test_a_staged_broadcast_is_exact_and_holds_two_buckets_on_the_wire_device_not_the_model() -> None:
    sender, receivers = _staged_channel((True, False))
    buffers: dict[int, FlatWeights | None] = {0: None, 1: None}
    snapshot = None
    for version, seed in [(1, 4), (2, 5)]:
        results: dict[int, object] = {}

        def run(i: int) -> None:
            results[i] = receivers[i].receive_into(buffers[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        snapshot = sender.snapshot(_many_buckets(seed), reuse=snapshot)
        assert sender.broadcast(snapshot, version) == version
        for t in threads:
            t.join(timeout=30)
        for i in (0, 1):
            flat, got = results[i]  # type: ignore[misc]
            assert got == version and flat.device == torch.device("cpu")
            assert (flat is buffers[i]) == (version == 2)  # the second version refills the first's buffer
            buffers[i] = flat
            received = dict(flat.named())
            for name, t in _many_buckets(seed):
                assert torch.equal(received[name], t), (i, name)
    largest = max(b.nbytes for b in snapshot.buckets)
    assert len(snapshot.buckets) > 4 and snapshot.nbytes > 4 * largest  # the model is many buckets
    assert sender.staging_bytes == 2 * largest  # two buckets in staging, whatever the model's size
    assert receivers[0].staging_bytes == 2 * largest and receivers[1].staging_bytes == largest  # pipeline=False: one


def test_a_staged_sender_and_a_receiver_on_the_wire_device_speak_the_same_stream() -> None:
    hub, store, secret = LocalBroadcastHub(2, 5.0), dist.HashStore(), JobSecret.generate()
    sender = WeightChannelSender("", 0, 1, bucket_bytes=4096, timeout_s=5.0, secret=secret, store=store,
                                 direct_bytes=16384, group_factory=lambda _b: hub.group(0), stage=True)
    receiver = WeightChannelReceiver("", 0, 1, 1, timeout_s=5.0, secret=secret, store=store,
                                     group_factory=lambda _b: hub.group(1))
    assert sender.staged and not receiver.staged  # by default only a home off the wire's device is staged
    out: list = []
    t = threading.Thread(target=lambda: out.append(receiver.receive_into(None)))
    t.start()
    sender.broadcast(sender.snapshot(make_weights(6)), 3)
    t.join(timeout=30)
    flat, version = out[0]
    assert version == 3 and all(torch.equal(dict(flat.named())[n], w) for n, w in make_weights(6))
    assert receiver.staging_bytes == 0  # received straight into its buffer


def test_a_snapshot_is_kept_in_host_memory_whatever_the_wire_device() -> None:
    hub, store, secret = LocalBroadcastHub(2, 5.0), dist.HashStore(), JobSecret.generate()
    sender = WeightChannelSender("", 0, 1, secret=secret, store=store, group_factory=lambda _b: hub.group(0))
    assert sender.home == torch.device("cpu") and sender.snapshot(make_weights(1)).device == torch.device("cpu")
    other = FlatWeights.snapshot(make_weights(1), 4096, 1024, device="meta")
    with pytest.raises(ValueError, match="keeps snapshots on cpu; take it with this channel's snapshot"):
        sender.broadcast(other, 1)
