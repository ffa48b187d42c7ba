"""The gradient of an optimizer step is the whole batch's, however the batch is split.

For every `[algorithm] loss_agg` mode, the gradient TorchBackend accumulates over micro-batches
of 8 (on one rank, and over 2 gloo ranks with unequal shards, both with `strategy = "ddp"` and
with `"fsdp2"`, where each rank holds a shard of every gradient) must equal the gradient of the
loss computed on the whole batch in one micro-batch, to 1e-6. The batch has 40 samples with
response lengths from 1 to 20, partial and fully masked loss masks, clipped ratios, TIS, a KL
loss and an entropy bonus, so that every aggregated term is exercised. The 2-rank case runs in
spawned processes on CPU and takes several seconds: it is marked slow.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relax_hpc.algos import LOSS_AGG_MODES
from relax_hpc.backends.batch import pack_rows
from relax_hpc.backends.parallel import STRATEGIES, Strategy
from relax_hpc.backends.torch_backend import TorchBackend
from relax_hpc.data.rows import sample_to_row
from relax_hpc.data.sample import Sample
from relax_hpc.models.tiny import vocab_size
from relax_hpc.spec.schema import AlgorithmSpec, TrainSpec

N_SAMPLES = 40
MICRO = 8
RANK_SHARDS = ((0, 24), (24, 40))  # unequal on purpose: 3 and 2 micro-batches of 8
TOLERANCE = 1e-6  # max abs difference between gradients
Grads = dict[str, torch.Tensor]


def _loss(mode: str) -> AlgorithmSpec:
    return AlgorithmSpec(name="grpo", loss_agg=mode, kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01,
                      dual_clip_c=3.0, tis_cap=1.5)


def _backend(model_dir: Path, mode: str, micro: int, mini_batches: int = 1,
             strategy: Strategy = "ddp") -> TorchBackend:
    # lr = 0: parameters never move, so every optimizer step's gradient is taken at the same
    # point and a later mini-batch's gradient can be compared with a single-batch one.
    optim = TrainSpec(steps=1, lr=0.0, grad_clip=0.0, micro_batch_size=micro, mini_batches=mini_batches)
    return TorchBackend(model_dir, optim, _loss(mode), keep_reference=False, strategy=strategy)


def _samples(model_dir: Path) -> list[Sample]:
    """40 samples, prompts of 1-6 and responses of 1-20 tokens, with varied loss masks.

    The log-probs of the old, rollout and reference policies are the current policy's plus
    noise, so ratios clip (both sides, and dual-clip), TIS weights cap and the KL is non-zero.
    """
    gen = torch.Generator().manual_seed(1234)
    samples = []
    for i in range(N_SAMPLES):
        prompt = torch.randint(3, vocab_size(), (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen)
        response_len = 1 + (7 * i) % 20
        response = torch.randint(3, vocab_size(), (response_len,), generator=gen)
        if i % 9 == 4:
            mask = [0] * response_len  # e.g. a truncated response that is not trained
        elif i % 3 == 1:
            mask = (torch.rand(response_len, generator=gen) < 0.6).int().tolist()  # tool output spans
        else:
            mask = [1] * response_len
        advantage = float(torch.randn(1, generator=gen) * 2)
        samples.append(Sample(prompt.tolist(), response.tolist(), [0.0] * response_len, 0, group_id=i // 4,
                              prompt_index=i // 4, advantage=advantage, loss_mask=mask))
    current = _backend(model_dir, "token_mean", MICRO).compute_log_probs(samples)
    for s, logp in zip(samples, current):
        lp = torch.tensor(logp)

        def noisy(scale: float) -> list[float]:
            return (lp + scale * torch.randn(lp.shape, generator=gen)).tolist()

        s.old_log_probs, s.rollout_log_probs, s.ref_log_probs = noisy(0.4), noisy(0.5), noisy(0.3)
    return samples


def _rows(samples: list[Sample]) -> list[dict]:
    rows = []
    for s in samples:
        row = sample_to_row(s)
        row["log_probs"] = torch.tensor(s.old_log_probs, dtype=torch.float32)
        row["ref_log_probs"] = torch.tensor(s.ref_log_probs, dtype=torch.float32)
        rows.append(row)
    return rows


def _grads(backend: TorchBackend) -> Grads:
    """Every gradient whole; a sharded (DTensor) one is gathered from all ranks."""
    def whole(grad: torch.Tensor) -> torch.Tensor:
        return grad.full_tensor() if hasattr(grad, "full_tensor") else grad

    return {n: whole(p.grad.detach()).clone()
            for n, p in backend.model.named_parameters() if p.grad is not None}


def _run_train(model_dir: Path, mode: str, samples: list[Sample], micro: int,
               mini_batches: int = 1, strategy: Strategy = "ddp") -> tuple[Grads, dict[str, float]]:
    backend = _backend(model_dir, mode, micro, mini_batches, strategy)
    stats = backend.train(samples)
    return _grads(backend), stats


def _run_stream(model_dir: Path, mode: str, samples: list[Sample],
                splits: list[int], strategy: Strategy = "ddp") -> tuple[Grads, dict[str, float]]:
    """`train_stream` on the samples' rows cut at `splits` (each part packed to its own length)."""
    backend = _backend(model_dir, mode, MICRO, strategy=strategy)
    rows = _rows(samples)
    bounds = [0, *splits, len(rows)]
    parts = [rows[a:b] for a, b in zip(bounds, bounds[1:])]
    stats = backend.train_stream(pack_rows(part, backend.pad_id) for part in parts)
    return _grads(backend), stats


def _max_abs_diff(got: Grads, want: Grads) -> float:
    assert got.keys() == want.keys()
    assert len(want) > 0
    return max(float((got[n] - want[n]).abs().max()) for n in want)


def _assert_same_stats(got: dict[str, float], want: dict[str, float]) -> None:
    for key, value in want.items():
        if key != "grad_norm":
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.fixture(scope="module")
def samples(tiny_model_dir: Path) -> list[Sample]:
    return _samples(tiny_model_dir)


@pytest.fixture(scope="module")
def whole_batch(tiny_model_dir: Path, samples: list[Sample]) -> dict[str, tuple[Grads, dict[str, float]]]:
    """Per mode: the gradient and stats of the whole batch in one micro-batch on one rank."""
    return {mode: _run_train(tiny_model_dir, mode, samples, micro=N_SAMPLES) for mode in LOSS_AGG_MODES}


def test_the_batch_exercises_every_term(whole_batch: dict[str, tuple[Grads, dict[str, float]]]) -> None:
    for mode, (grads, stats) in whole_batch.items():
        assert 0.0 < stats["clip_frac"] < 1.0, mode
        assert 0.0 < stats["tis/capped_frac"] < 1.0, mode
        assert stats["loss/kl"] > 0.0, mode
        assert max(float(g.abs().max()) for g in grads.values()) > 1e-3, mode


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_on_one_rank_give_the_whole_batch_gradient(
    tiny_model_dir: Path, samples: list[Sample], whole_batch: dict, mode: str
) -> None:
    want_grads, want_stats = whole_batch[mode]
    grads, stats = _run_train(tiny_model_dir, mode, samples, micro=MICRO)
    assert _max_abs_diff(grads, want_grads) <= TOLERANCE
    _assert_same_stats(stats, want_stats)
    # The streaming path, with micro-batches of uneven sizes as the queue may deliver them.
    grads, stats = _run_stream(tiny_model_dir, mode, samples, splits=[3, 11, 19, 27, 35])
    assert _max_abs_diff(grads, want_grads) <= TOLERANCE
    _assert_same_stats(stats, want_stats)


def test_an_explicit_step_denominator_differs_from_per_micro_batch_means(
    tiny_model_dir: Path, samples: list[Sample], whole_batch: dict
) -> None:
    # Guards the test above against passing vacuously: averaging the micro-batches' own token
    # means (each weighted by its share of rows, the old behaviour) gives another gradient.
    want_grads, _ = whole_batch["token_mean"]
    per_micro: Grads = {}
    for start in range(0, N_SAMPLES, MICRO):
        grads, _ = _run_train(tiny_model_dir, "token_mean", samples[start : start + MICRO], micro=MICRO)
        for n, g in grads.items():
            per_micro[n] = per_micro.get(n, 0) + g * MICRO / N_SAMPLES
    assert _max_abs_diff(per_micro, want_grads) > 100 * TOLERANCE


# -- two gloo ranks --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_worker(rank: int, port: int, model_dir: str, samples: list[Sample], out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=len(RANK_SHARDS), timeout=timedelta(seconds=120))
    try:
        start, stop = RANK_SHARDS[rank]
        shard = samples[start:stop]
        results: dict[str, dict] = {}
        for strategy in STRATEGIES:
            for mode in LOSS_AGG_MODES:
                results.setdefault(strategy, {})[mode] = {
                    "train": _run_train(Path(model_dir), mode, shard, micro=MICRO, strategy=strategy),
                    "stream": _run_stream(Path(model_dir), mode, shard, list(range(MICRO, len(shard), MICRO)),
                                          strategy=strategy),
                    # Two optimizer steps: the second one's gradient is left in .grad.
                    "mini_batches": _run_train(Path(model_dir), mode, shard, micro=MICRO // 2, mini_batches=2,
                                               strategy=strategy),
                }
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_results(tiny_model_dir: Path, samples: list[Sample], tmp_path_factory: pytest.TempPathFactory) -> list:
    out = tmp_path_factory.mktemp("grad-accumulation")
    mp.spawn(_rank_worker, args=(_free_port(), str(tiny_model_dir), samples, str(out)),
             nprocs=len(RANK_SHARDS), join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(len(RANK_SHARDS))]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("path", ["train", "stream"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_over_two_gloo_ranks_give_the_whole_batch_gradient(
    two_rank_results: list, whole_batch: dict, mode: str, path: str, strategy: str
) -> None:
    # Rank 0 has 3 micro-batches and rank 1 two: with fsdp2 rank 1 also runs an empty pass.
    want_grads, want_stats = whole_batch[mode]
    for rank, results in enumerate(two_rank_results):
        grads, stats = results[strategy][mode][path]
        assert _max_abs_diff(grads, want_grads) <= TOLERANCE, rank
        _assert_same_stats(stats, want_stats)  # every rank reports the step's global stats


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_each_mini_batch_over_two_ranks_is_divided_by_its_own_step_count(
    tiny_model_dir: Path, samples: list[Sample], two_rank_results: list, mode: str, strategy: str
) -> None:
    # mini_batches = 2 splits each rank's shard in halves: rank 0 rows 0-11 | 12-23, rank 1 rows
    # 24-31 | 32-39. The second optimizer step is the whole-batch step on rows 12-23 and 32-39.
    second = samples[12:24] + samples[32:40]
    want_grads, _ = _run_train(tiny_model_dir, mode, second, micro=len(second))
    for rank, results in enumerate(two_rank_results):
        grads, _ = results[strategy][mode]["mini_batches"]
        assert _max_abs_diff(grads, want_grads) <= TOLERANCE, rank


# mini_batches = 4 over ranks holding 7 and 2 rows, and mini_batches = 2 over ranks holding 6
# and 0 rows: every rank takes 4 (2) optimizer steps over shares that differ by at most a row,
# so their collectives pair up. The old log-probs are left out, so the trainer computes them
# itself in a full pass first (the pass a rank without rows joins with empty passes when sharded).
UNEVEN = {"uneven": (((0, 7), (7, 9)), 4), "empty": (((0, 6), (6, 6)), 2)}


def _uneven_worker(rank: int, port: int, model_dir: str, samples: list[Sample], out: str) -> None:
    import dataclasses

    from relax_hpc.backends.batch import pack_samples

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        results: dict[str, dict] = {}
        for strategy in STRATEGIES:
            for case, (shards, mini) in UNEVEN.items():
                start, stop = shards[rank]
                shard = [dataclasses.replace(s, old_log_probs=None) for s in samples[start:stop]]
                backend = _backend(Path(model_dir), "token_mean", 2, mini, strategy)
                stats = backend.train_batch(pack_samples(shard, backend.pad_id) if shard else None)
                results.setdefault(strategy, {})[case] = (_grads(backend), stats)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mini_batches_over_ranks_with_unequal_or_no_rows_pair_up_and_give_each_steps_gradient(
    tiny_model_dir: Path, samples: list[Sample], tmp_path: Path
) -> None:
    import dataclasses

    mp.spawn(_uneven_worker, args=(_free_port(), str(tiny_model_dir), samples, str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    plain = [dataclasses.replace(s, old_log_probs=None) for s in samples]
    # The last optimizer step's rows: rank 0's last share and rank 1's.
    last_step = {"uneven": plain[5:7] + plain[8:9], "empty": plain[3:6]}
    for case, rows in last_step.items():
        want, _ = _run_train(tiny_model_dir, "token_mean", rows, micro=len(rows))
        for strategy in STRATEGIES:
            for rank in range(2):
                grads, stats = results[rank][strategy][case]
                assert _max_abs_diff(grads, want) <= TOLERANCE, (case, strategy, rank)
                assert stats["grad_norm"] > 0, (case, strategy, rank)
