"""The weight channel across real processes over gloo (and NCCL where CUDA is present).

One sender process and two receiver processes run three broadcasts (versions 1..3) with
different bucket settings; each test checks one property of that run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from weights_harness import make_weights, run_channel, tensor_bytes

MIB = 1 << 20
PLAN = [
    {"version": 1, "seed": 11, "bucket_bytes": 512 * MIB, "direct_bytes": 4 * MIB},  # one packed bucket
    {"version": 2, "seed": 22, "bucket_bytes": 256, "direct_bytes": 4 * MIB},  # tiny buckets: many
    {"version": 3, "seed": 33, "bucket_bytes": 4096, "direct_bytes": 1024},  # direct + packed mix
]


@pytest.fixture(scope="module")
def gloo_run() -> tuple[list[tuple[str, Any]], dict[int, list[tuple[str, Any]]]]:
    return run_channel({1: len(PLAN), 2: len(PLAN)}, n=2, plan=PLAN, timeout_s=20.0)


def _results(run: Any, rank: int) -> list[dict[str, Any]]:
    kinds = [kind for kind, _ in run[1][rank]]
    assert kinds == ["version"] * len(PLAN), f"rank {rank} reported {run[1][rank]}"
    return [payload for _, payload in run[1][rank]]


def test_sender_reports_every_version(gloo_run: Any) -> None:
    assert gloo_run[0] == [("sent", 1), ("sent", 2), ("sent", 3)]


@pytest.mark.parametrize("rank", [1, 2])
def test_every_receiver_gets_exact_tensors_of_each_version(gloo_run: Any, rank: int) -> None:
    for step, got in zip(PLAN, _results(gloo_run, rank)):
        assert got["version"] == step["version"]
        expected = {name: tensor_bytes(t) for name, t in make_weights(step["seed"])}
        assert set(got["weights"]) == set(expected)
        for name, (dtype, shape, raw) in expected.items():
            assert got["weights"][name] == (dtype, shape, raw), f"{name} differs in version {step['version']}"


def test_versions_differ_in_content(gloo_run: Any) -> None:
    first, second = _results(gloo_run, 1)[:2]
    assert first["weights"]["layer.0.w"] != second["weights"]["layer.0.w"]


def test_bucket_size_sets_the_number_of_applied_buckets(gloo_run: Any) -> None:
    one, tiny, mixed = _results(gloo_run, 1)
    # version 1: everything (the zero-byte "empty" included) fits one 512 MiB bucket
    assert one["calls"] == 1
    # version 2, 256-byte buckets, parameters in order (bytes; packed offsets align to 64):
    #   embed 76800 > 256 -> direct #1; layer.0.w 11220 -> direct #2; layer.0.b 132 -> packed #3;
    #   w_bf16 8192 -> direct #4; b_bf16 14 @0, int64 80 @64 -> packed #5 (144 used);
    #   int32 120 would end at 192+120 > 256 -> packed #6: int32 @0, bool 9 @128, scalar 4 @192,
    #   empty 0 @256; transposed 384 > 256 -> direct #7.  7 buckets, 7 apply calls.
    assert tiny["calls"] == 7
    # version 3, 4096-byte buckets, direct from 1024 bytes: embed #1, layer.0.w #2, layer.0.b
    # packed #3, w_bf16 direct #4, everything after it fits one packed bucket #5.
    assert mixed["calls"] == 5


FLAT_PLAN = [
    {"version": 1, "seed": 11, "bucket_bytes": 4096, "direct_bytes": 1024},
    {"version": 2, "seed": 22, "bucket_bytes": 4096, "direct_bytes": 1024},  # same layout: buffers reused
    {"version": 3, "seed": 33, "bucket_bytes": 256, "direct_bytes": 4 * MIB},  # new layout: new buffer
]


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_flat_snapshots_reach_flat_and_bucket_receivers_exactly(staged: bool) -> None:
    # The wire is the same whichever side holds flat buffers: rank 1 receives into a flat
    # buffer, rank 2 applies bucket by bucket; the sender broadcasts snapshots. Staged: the
    # snapshot and rank 1's buffer pass every bucket through staging buffers on the wire's
    # device (on a GPU node, the path of a host-memory snapshot and of SGLang's rollout role).
    sent, per_rank = run_channel(
        {1: len(FLAT_PLAN), 2: len(FLAT_PLAN)}, n=2, plan=FLAT_PLAN, timeout_s=20.0, flat_sender=True,
        flat_receivers=(1,), staged=staged,
    )
    assert sent == [("sent", 1), ("sent", 2), ("sent", 3)]
    for rank in (1, 2):
        assert [kind for kind, _ in per_rank[rank]] == ["version"] * 3, per_rank[rank]
        for step, (_, got) in zip(FLAT_PLAN, per_rank[rank]):
            expected = {name: tensor_bytes(t) for name, t in make_weights(step["seed"])}
            assert got["version"] == step["version"] and got["weights"] == expected, (rank, step)
    assert [got["reused"] for _, got in per_rank[1]] == [False, True, False]
    for _, got in per_rank[1]:  # staged: two buffers of the largest bucket (the embedding, every time)
        assert got["staging_bytes"] == (2 * got["largest_bucket"] if staged else 0), got["staging_bytes"]


def test_receiver_that_never_receives_or_never_joins_is_named() -> None:
    # rank 1 receives, rank 2 joins but never calls receive(), rank 3 never starts
    sent, per_rank = run_channel({1: 1, 2: 0}, n=3, plan=PLAN[:1], timeout_s=3.0)
    assert len(sent) == 1 and sent[0][0] == "error", sent
    message = sent[0][1]
    assert "WeightChannelTimeout" in message
    assert "rank(s) [2, 3] did not start receiving" in message
    assert "rank(s) [3] never joined" in message
    assert per_rank[2] == [("joined", None)]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="NCCL weight channel needs CUDA and 2 GPUs (one per rank); this machine has none",
)
@pytest.mark.parametrize("flat, host_receiver", [(False, False), (True, False), (True, True)],
                         ids=["buckets", "flat", "flat-host-receiver"])
def test_nccl_channel_exact_on_cuda(flat: bool, host_receiver: bool) -> None:
    # A flat sender's snapshot is in pinned host memory, staged bucket by bucket through cuda:0;
    # the host receiver keeps its buffer in host memory too (the rollout role of SGLang engines).
    plan = PLAN[:2]
    sent, per_rank = run_channel(
        {1: len(plan)}, n=1, plan=plan, timeout_s=60.0, device="cuda:0", receiver_device="cuda:1",
        flat_sender=flat, flat_receivers=(1,) if flat else (), staged=True if host_receiver else None,
    )
    assert sent == [("sent", 1), ("sent", 2)]
    for step, (kind, got) in zip(plan, per_rank[1]):
        assert kind == "version" and got["version"] == step["version"]
        expected = {name: tensor_bytes(t) for name, t in make_weights(step["seed"])}
        assert got["weights"] == expected
