"""Routing replay (R3, trainer side), the pure parts: packing each sample's routes into the
right-padded micro-batch and laying them out in Megatron's sequence-major token order.
The Megatron run itself: tests/backends/test_megatron_routing_replay.py."""

from __future__ import annotations

import pytest
import torch

from relax_hpc.backends.megatron_replay import model_router_replays, pack_routes, pack_row_routes, replay_indices
from relax_hpc.data.rows import ROUTED_EXPERTS_FIELD


def _routes(values: list[int]) -> torch.Tensor:
    """One layer, top-1: [tokens - 1, 1, 1]."""
    return torch.tensor(values, dtype=torch.uint8).reshape(-1, 1, 1)


def test_pack_routes_pads_uncovered_positions_with_experts_0_to_k() -> None:
    # Sample 0 has 4 tokens (routes for 3), sample 1 has 2 (routes for 1); the batch is 4 wide.
    # Uncovered: sample 0's last column; sample 1's columns 1..3 -> expert 0 (k = 1).
    packed = pack_routes([_routes([5, 6, 7]), _routes([3])], lengths=[4, 2], width=4)
    assert packed.dtype == torch.long and packed.shape == (2, 4, 1, 1)
    assert packed[:, :, 0, 0].tolist() == [[5, 6, 7, 0], [3, 0, 0, 0]]
    # top-2: padding gets the distinct experts [0, 1].
    two = pack_routes([torch.tensor([[[4, 2]]], dtype=torch.uint8)], lengths=[2], width=3)
    assert two[0, :, 0].tolist() == [[4, 2], [0, 1], [0, 1]]


def test_pack_routes_rejects_misaligned_routes() -> None:
    with pytest.raises(ValueError, match="has 4 tokens but routes for 2"):
        pack_routes([_routes([5, 6])], lengths=[4], width=4)
    with pytest.raises(ValueError, match="expected"):
        pack_routes([_routes([5]), torch.zeros(1, 2, 1, dtype=torch.uint8)], lengths=[2, 2], width=2)
    with pytest.raises(ValueError, match="empty micro-batch"):
        pack_routes([], [], 1)


def test_pack_row_routes_reads_row_fields_and_names_a_missing_one() -> None:
    rows = [{"tokens": torch.tensor([1, 2, 3]), ROUTED_EXPERTS_FIELD: _routes([4, 5])},
            {"tokens": torch.tensor([1, 2]), ROUTED_EXPERTS_FIELD: _routes([6])}]
    assert pack_row_routes(rows, width=3)[:, :, 0, 0].tolist() == [[4, 5, 0], [6, 0, 0]]
    with pytest.raises(ValueError, match=r"rows \[1\].*routing_replay"):
        pack_row_routes([rows[0], {"tokens": torch.tensor([1, 2])}], width=3)


def test_replay_indices_are_sequence_major_per_layer() -> None:
    # B=2, S=2, 2 layers, top-1; value = 100 * layer + 10 * sample + position.
    packed = torch.tensor([[[[0], [100]], [[1], [101]]],
                           [[[10], [110]], [[11], [111]]]])  # [B, S, layers, k]
    layer0, layer1 = replay_indices(packed)
    # Megatron's [S, B] order: (s0, b0), (s0, b1), (s1, b0), (s1, b1).
    assert layer0.flatten().tolist() == [0, 10, 1, 11]
    assert layer1.flatten().tolist() == [100, 110, 101, 111]


def test_replay_indices_give_each_sequence_parallel_rank_its_slice() -> None:
    packed = torch.arange(4).reshape(1, 4, 1, 1)  # one sample, positions 0..3, 1 layer, top-1
    assert replay_indices(packed, tp_rank=0, tp_size=2, sequence_parallel=True)[0].flatten().tolist() == [0, 1]
    assert replay_indices(packed, tp_rank=1, tp_size=2, sequence_parallel=True)[0].flatten().tolist() == [2, 3]
    # Without sequence parallelism every TP rank routes the whole sequence.
    assert replay_indices(packed, tp_rank=1, tp_size=2)[0].flatten().tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="not divisible"):
        replay_indices(torch.zeros(1, 3, 1, 1, dtype=torch.long), tp_rank=0, tp_size=2, sequence_parallel=True)


def test_model_router_replays_finds_only_enabled_routers_in_order() -> None:
    class Router(torch.nn.Module):
        def __init__(self, replay: object | None) -> None:
            super().__init__()
            self.router_replay = replay

    first, second = object(), object()
    model = torch.nn.Sequential(Router(first), Router(None), Router(second))
    assert model_router_replays(model) == [first, second]
