"""The Megatron backend's pure helpers, in the project venv (no megatron): rank layout, which rank
reads rows, fixed-shape micro-batches, the clipping rule, and the missing-library message."""

from __future__ import annotations

import pytest
import torch

from relax_hpc.backends.base import require_backend
from relax_hpc.backends.batch import TrainBatch, pack_samples
from relax_hpc.backends.megatron_data import (
    MegatronLayout,
    check_layout,
    concat_batches,
    empty_batch,
    pad_batch,
    split_micro_batches,
)
from relax_hpc.backends.megatron_optim import clip_coefficient
from relax_hpc.data.sample import Sample


def _samples() -> list[Sample]:
    return [Sample([4, 13, 5], [6, 2], [-0.5, -0.25], 0, group_id=0, prompt_index=0, advantage=1.0),
            Sample([3], [3, 3, 2], [-0.1, -0.2, -0.3], 0, group_id=0, prompt_index=1, advantage=-1.0),
            Sample([7, 8], [9], [-0.7], 0, group_id=1, prompt_index=2, advantage=0.5)]


def test_layout_matches_megatrons_rank_order() -> None:
    # tp-cp-ep-dp-pp: rank = tp + TP * (cp + CP * (dp + DP * pp)); 8 ranks, TP=2, PP=2 -> DP=2.
    layout = MegatronLayout(8, tensor=2, pipeline=2)
    assert layout.data == 2 and layout.model_parallel == 4
    coords = [(c.tensor, c.data, c.pipeline) for c in map(layout.coordinates, range(8))]
    assert coords == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    # The first rank of each replica (tp 0, pp 0) reads; each rank gets its replica's rows.
    assert [layout.reads_rows(r) for r in range(8)] == [True, False, True, False, False, False, False, False]
    assert [layout.row_source(r) for r in range(8)] == [0, 0, 2, 2, 0, 0, 2, 2]
    with pytest.raises(ValueError, match="rank 8 is outside 0..7"):
        layout.coordinates(8)


def test_pure_data_parallel_reads_on_every_rank() -> None:
    layout = MegatronLayout(3)
    assert layout.data == 3 and all(layout.reads_rows(r) for r in range(3))
    assert [layout.row_source(r) for r in range(3)] == [0, 1, 2]


def test_check_layout_lists_every_problem_with_its_key() -> None:
    with pytest.raises(ValueError) as caught:
        check_layout(MegatronLayout(3, tensor=2, context=2), sequence_parallel=False,
                     distributed_optimizer=True, device="cpu")
    text = str(caught.value)
    assert "[train] num_processes = 3 is not a multiple of" in text and "= 4" in text
    assert "context_parallel = 2: not supported" in text
    assert "distributed_optimizer = true needs CUDA" in text
    with pytest.raises(ValueError, match="sequence_parallel = true needs tensor_parallel > 1"):
        check_layout(MegatronLayout(2), sequence_parallel=True, distributed_optimizer=False, device="cpu")
    with pytest.raises(ValueError, match="expert_parallel = 3 must divide the data-parallel size 2"):
        check_layout(MegatronLayout(4, tensor=2, expert=3), sequence_parallel=False,
                     distributed_optimizer=False, device="cpu")
    check_layout(MegatronLayout(4, tensor=2), sequence_parallel=True, distributed_optimizer=True, device="cuda")


def test_pad_batch_adds_only_untrained_pad_cells() -> None:
    batch = pack_samples(_samples(), pad_id=0)  # 3 rows, length 5
    grown = pad_batch(batch, rows=4, length=7, pad_id=0)
    assert grown.input_ids.shape == (4, 7) and grown.targets.shape == (4, 6)
    assert torch.equal(grown.input_ids[:3, :5], batch.input_ids)
    assert torch.equal(grown.loss_mask[:3, :4], batch.loss_mask)
    assert grown.loss_mask[3].sum() == 0 and grown.loss_mask[:, 4:].sum() == 0
    assert grown.advantages.tolist() == [1.0, -1.0, 0.5, 0.0]
    assert grown.input_ids[3].tolist() == [0] * 7 and grown.old_log_probs is None
    with pytest.raises(ValueError, match="cannot shrink"):
        pad_batch(batch, rows=2, length=5, pad_id=0)


def test_gae_per_token_advantages_are_padded_and_joined_like_the_log_probs() -> None:
    # GAE writes one advantage per response token ([B, L-1]); the outcome estimators one per row.
    batch = pack_samples(_samples(), pad_id=0)  # 3 rows, length 5: 4 token columns
    batch.advantages = torch.arange(12, dtype=torch.float32).reshape(3, 4) * batch.loss_mask
    grown = pad_batch(batch, rows=4, length=7, pad_id=0)
    assert grown.advantages.shape == (4, 6)
    assert torch.equal(grown.advantages[:3, :4], batch.advantages)
    assert grown.advantages[3].sum() == 0 and grown.advantages[:, 4:].sum() == 0
    joined = concat_batches([batch.slice(0, 1), batch.slice(1, 3)], pad_id=0)
    assert torch.equal(joined.advantages, batch.advantages)


def test_split_micro_batches_uniform_for_pipelines_and_rounded_for_sequence_parallel() -> None:
    batch = pack_samples(_samples(), pad_id=0)  # 3 rows, length 5
    free = split_micro_batches(batch, 2, pad_id=0, uniform=False)
    assert [tuple(m.input_ids.shape) for m in free] == [(2, 5), (1, 5)]
    uniform = split_micro_batches(batch, 2, pad_id=0, uniform=True, length_multiple=4)
    assert [tuple(m.input_ids.shape) for m in uniform] == [(2, 8), (2, 8)]
    # The trained tokens are the batch's, wherever they went: 2 + 3 + 1.
    assert sum(float(m.loss_mask.sum()) for m in uniform) == float(batch.loss_mask.sum()) == 6.0


def test_concat_batches_keeps_rows_in_order_and_drops_partial_fields() -> None:
    a = pack_samples(_samples()[:2], pad_id=0)
    b = pack_samples(_samples()[2:], pad_id=0)
    b.old_log_probs = torch.zeros_like(b.loss_mask)
    joined = concat_batches([a, b], pad_id=0)
    whole = pack_samples(_samples(), pad_id=0)
    for field in ("input_ids", "attention_mask", "targets", "loss_mask", "rollout_log_probs", "advantages"):
        assert torch.equal(getattr(joined, field), getattr(whole, field)), field
    assert joined.old_log_probs is None  # only one of the two had them


def test_empty_batch_trains_nothing() -> None:
    batch: TrainBatch = empty_batch(pad_id=7)
    assert batch.input_ids.tolist() == [[7, 7]] and batch.loss_mask.sum() == 0


def test_clip_coefficient_follows_torch_clip_grad_norm() -> None:
    # torch: grads *= min(max_norm / (norm + 1e-6), 1); 0 disables clipping here.
    assert clip_coefficient(4.0, 1.0) == pytest.approx(1.0 / (4.0 + 1e-6))
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(4.0, 0.0) == 1.0
    assert clip_coefficient(float("nan"), 1.0) == 1.0


def test_require_backend_names_the_install_when_megatron_is_missing() -> None:
    # The project venv has no megatron (tools/setup-megatron-cpu builds its own environment).
    with pytest.raises(ValueError, match=r"needs megatron.core and megatron.bridge.*relax-hpc\[megatron\]"):
        require_backend("megatron")
    require_backend("torch")


def _routed(samples: list[Sample]) -> list[Sample]:
    """The samples with routes [tokens - 1, 2 layers, top-2]: position t routes to (t, t+1) and (t+2, t+3)."""
    for s in samples:
        fed = len(s.prompt_ids) + len(s.response_ids) - 1
        s.routed_experts = (torch.arange(fed)[:, None, None] + torch.arange(4).view(1, 2, 2)).to(torch.uint8)
    return samples


def test_routed_experts_travel_with_the_rows_into_every_micro_batch() -> None:
    from relax_hpc.backends.batch import pack_rows
    from relax_hpc.data.rows import sample_to_row

    samples = _routed(_samples())
    by_rows = pack_rows([sample_to_row(s) for s in samples], pad_id=0)
    by_samples = pack_samples(samples, pad_id=0)
    assert by_rows.routed_experts is not None and by_samples.routed_experts is not None
    assert by_rows.routed_experts.shape == (3, 5, 2, 2)  # longest sample: 5 tokens
    assert torch.equal(by_rows.routed_experts, by_samples.routed_experts)
    # Sample 1 has 4 tokens: positions 0..2 carry its routes, 3 and 4 the padding (experts 0, 1).
    assert by_rows.routed_experts[1, :3].tolist() == samples[1].routed_experts.tolist()
    assert by_rows.routed_experts[1, 3:].tolist() == [[[0, 1], [0, 1]]] * 2
    parts = split_micro_batches(by_rows, 2, pad_id=0, uniform=True, length_multiple=4)
    assert [tuple(p.routed_experts.shape) for p in parts] == [(2, 8, 2, 2), (2, 8, 2, 2)]
    assert torch.equal(parts[1].routed_experts[0, :5], by_rows.routed_experts[2])
    assert parts[1].routed_experts[1].tolist() == [[[0, 1], [0, 1]]] * 8  # an added row
    assert torch.equal(concat_batches(parts, pad_id=0).routed_experts[:3, :5], by_rows.routed_experts)
    assert pack_samples(_samples(), pad_id=0).routed_experts is None  # without replay nothing is packed
