"""Flat weight buffers: snapshots laid out as the channel's buckets, receiving in place, binding a
module's parameters to the buffer without a copy."""

from __future__ import annotations

import threading

import pytest
import torch
from weights_harness import make_weights

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
