"""roles/engine_host.py: a weight version packed for Ray's object store comes back exactly, and
pickles to the tensors' own bytes once, not once per tensor of a shared buffer."""

from __future__ import annotations

import pickle

import torch

from relax_hpc.roles.engine_host import pack_weights, unpack_weights


def _views_of_one_buffer() -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    flat = torch.arange(24 * 100, dtype=torch.float32)
    return flat, [(f"layer.{k}.weight", flat[k * 100:(k + 1) * 100].view(10, 10)) for k in range(24)]


def _out_of_band_bytes(obj: object) -> tuple[int, int]:
    """(bytes in the pickle stream, bytes in out-of-band buffers), as Ray pickles an object."""
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return len(stream), sum(b.raw().nbytes for b in buffers)


def test_every_tensor_comes_back_with_its_name_dtype_shape_and_values() -> None:
    _, views = _views_of_one_buffer()
    named = views + [
        ("half", torch.randn(3, 5).to(torch.bfloat16)),
        ("mask", torch.tensor([True, False, True])),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("empty", torch.zeros(0, 4)),
        ("strided", torch.arange(12.0).view(3, 4).t()),  # not contiguous
    ]
    back = unpack_weights(pickle.loads(pickle.dumps(pack_weights(named), protocol=5)))
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, want), (_, got) in zip(named, back):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_views_of_one_buffer_pickle_to_their_own_bytes_once() -> None:
    flat, views = _views_of_one_buffer()
    stream, buffers = _out_of_band_bytes(pack_weights(views))
    assert buffers == flat.numel() * 4  # each view's 400 bytes, once
    assert stream < 4096  # names, dtypes and shapes only
    # The tensors themselves would save the whole shared buffer once per view.
    torch_stream, torch_buffers = _out_of_band_bytes([(n, t) for n, t in views])
    assert torch_stream + torch_buffers >= 24 * flat.numel() * 4
