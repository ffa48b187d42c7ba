"""Checks of vocab_parallel_logprobs_and_entropy against the full-vocabulary token_logprobs_and_entropy.

The tests without a process group run in this process. The others share one spawn of two gloo
ranks on 127.0.0.1 (module fixture): each rank computes every case from its slice of the same
logits and saves outputs and gradients; the tests compare them here with hand-worked numbers and
with the full-vocabulary computation. The spawn takes a few seconds: those tests are marked slow.
"""

from __future__ import annotations

import math
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from relax_hpc.algos import (
    LossInputs,
    policy_loss,
    token_logprobs_and_entropy,
)
from relax_hpc.algos import vocab_parallel_logprobs_and_entropy as vp_logprobs
from relax_hpc.spec.schema import AlgorithmSpec

WORLD_SIZE = 2
RANDOM_SPLIT = (0, 6, 11)  # V = 11 in unequal slices [0, 6) and [6, 11): vocab_start need not be r * V / tp
HAND_SPLIT = (0, 2, 4)  # V = 4 in halves
TEMPERATURE = 0.7
EXTREME_TEMPERATURES = (0.5, 2.0)  # powers of 2: logits / T is exact, see _extreme_case
LOSS_CONFIGS = {
    "grpo": AlgorithmSpec(name="grpo", entropy_coef=0.01),
    "gspo": AlgorithmSpec(name="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4, entropy_coef=0.01),
}
# Two rows of the same logits x = (0, ln 3, ln 2, ln 2), targets 1 (rank 0's) and 2 (rank 1's).
HAND_LOGITS = torch.tensor([[[0.0, math.log(3.0), math.log(2.0), math.log(2.0)]] * 2])
HAND_TARGETS = torch.tensor([[1, 2]])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _random_case() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Full logits [2, 5, 11], targets, and the weights of logp and entropy in the test loss."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen) * 3.0
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    return logits, targets, torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)


def _extreme_case() -> tuple[Tensor, Tensor, Tensor]:
    """Logits ``shift + b`` with ``shift`` = +1e4 (row 0) or -1e4 (row 1), targets, and ``b``.

    exp(1e4) overflows without the max shift. In float32 ``shift + b`` rounds ``b`` to a multiple of
    2**-10, after which ``logits - shift`` is exact (Sterbenz), as is division by a power of 2: so the
    full-vocabulary result on ``logits - shift``, an identical distribution, is the exact reference.
    Also one -inf logit and one near one-hot position (entropy ~0), targets avoiding the -inf.
    """
    gen = torch.Generator().manual_seed(3)
    shift = torch.tensor([1e4, -1e4]).view(2, 1, 1)
    logits = shift + torch.randn(2, 5, 11, generator=gen) * 3.0
    logits[0, 0, 7] = -math.inf
    logits[1, 2, 4] = -1e4 + 1e3
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    targets[0, 0] = 3
    return logits, targets, logits - shift


def _loss_inputs(name: str, logp: Tensor, entropy: Tensor) -> LossInputs:
    """Old log-probs near the current ones, such that some tokens (grpo) or one sequence (gspo) clip."""
    logits, targets, _, _ = _random_case()
    current = token_logprobs_and_entropy(logits, targets, TEMPERATURE)[0]
    gen = torch.Generator().manual_seed(4)
    if name == "grpo":
        old_logp = current + 0.3 * torch.randn(current.shape, generator=gen)
    else:  # sequence 0 (A > 0): ratio ~ exp(1e-3) > 1 + 4e-4, clipped; sequence 1: ratio ~ 1 +- 1e-5, not
        old_logp = current + 1e-5 * torch.randn(current.shape, generator=gen)
        old_logp[0] -= 1e-3
    mask = torch.ones_like(current)
    mask[1, 3:] = 0.0
    return LossInputs(logp=logp, old_logp=old_logp, advantages=torch.tensor([1.0, -0.5]), mask=mask, entropy=entropy)


def _logp_entropy_and_grad(
    logits: Tensor, targets: Tensor, w_lp: Tensor, w_ent: Tensor, temperature: float, **vp: Any
) -> tuple[Tensor, Tensor, Tensor]:
    """(logp, entropy, d/dlogits of sum(logp * w_lp + entropy * w_ent)); vocab-parallel when vp is given."""
    x = logits.clone().contiguous().requires_grad_(True)
    if vp:
        logp, entropy = vp_logprobs(x, targets, temperature, **vp)
    else:
        logp, entropy = token_logprobs_and_entropy(x, targets, temperature)
    (logp * w_lp + entropy * w_ent).sum().backward()
    assert x.grad is not None
    return logp.detach(), entropy.detach(), x.grad


def _rank_worker(rank: int, port: int, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )
    group = dist.group.WORLD
    results: dict[str, Any] = {}
    try:
        lo, hi = HAND_SPLIT[rank], HAND_SPLIT[rank + 1]
        ones = torch.ones(HAND_TARGETS.shape)
        for key, w_lp, w_ent in (("hand_logp", ones, 0 * ones), ("hand_entropy", 0 * ones, ones)):
            results[key] = _logp_entropy_and_grad(
                HAND_LOGITS[..., lo:hi], HAND_TARGETS, w_lp, w_ent, 1.0, group=group, vocab_start=lo
            )

        lo, hi = RANDOM_SPLIT[rank], RANDOM_SPLIT[rank + 1]
        logits, targets, w_lp, w_ent = _random_case()
        for chunk_rows in (None, 3):
            results[f"random_{chunk_rows}"] = _logp_entropy_and_grad(
                logits[..., lo:hi], targets, w_lp, w_ent, TEMPERATURE,
                group=group, vocab_start=lo, chunk_rows=chunk_rows,
            )

        for name, cfg in LOSS_CONFIGS.items():
            x = logits[..., lo:hi].clone().contiguous().requires_grad_(True)
            logp, entropy = vp_logprobs(x, targets, TEMPERATURE, group, lo)
            loss, stats = policy_loss(cfg, _loss_inputs(name, logp, entropy))
            loss.backward()
            results[f"loss_{name}"] = (loss.detach(), stats, x.grad)

        extreme_logits, extreme_targets, _ = _extreme_case()
        for temperature in EXTREME_TEMPERATURES:
            results[f"extreme_{temperature}"] = _logp_entropy_and_grad(
                extreme_logits[..., lo:hi], extreme_targets, w_lp, w_ent, temperature, group=group, vocab_start=lo
            )

        try:  # an ignore-index: the owner check must fail on both ranks (none hangs in a collective)
            vp_logprobs(logits[..., lo:hi].contiguous(), torch.full_like(targets, -100), 1.0, group, lo)
        except ValueError as e:
            results["bad_target_error"] = str(e)
        torch.save(results, Path(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's results from one spawn of two gloo ranks."""
    out = tmp_path_factory.mktemp("vocab_parallel")
    mp.spawn(_rank_worker, args=(_free_port(), str(out)), nprocs=WORLD_SIZE, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


def _joined(ranks: list[dict[str, Any]], key: str) -> tuple[Tensor, Tensor, Tensor]:
    """The ranks' (logp, entropy, grad slice) for ``key``: outputs equal on every rank, grads concatenated."""
    per_rank = [r[key] for r in ranks]
    logp, entropy, _ = per_rank[0]
    for other in per_rank[1:]:
        assert torch.equal(other[0], logp) and torch.equal(other[1], entropy)
    return logp, entropy, torch.cat([r[2] for r in per_rank], dim=-1)


def _assert_close(actual: Tensor, expected: Tensor, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


# --- two gloo ranks -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_hand_worked_four_token_vocabulary_in_two_halves(ranks: list[dict[str, Any]]) -> None:
    # x = (0, ln 3 | ln 2, ln 2): rank 0 holds ids 0-1, rank 1 ids 2-3. Global max m = ln 3;
    # e = exp(x - m) = (1/3, 1 | 2/3, 2/3): rank sums 4/3 and 4/3, S = 8/3, log Z = ln 3 + ln(8/3) = ln 8.
    # p = (1/8, 3/8, 1/4, 1/4). Target 1 (rank 0 sends x = ln 3, rank 1 sends 0): logp = ln 3 - ln 8
    # = ln(3/8) = -0.980829. Target 2 (rank 1's): ln 2 - ln 8 = ln(1/4) = -1.386294.
    # H = -(1/8 ln 1/8 + 3/8 ln 3/8 + 2 * 1/4 ln 1/4) = 0.259930 + 0.367811 + 0.693147 = 1.320888.
    logp, entropy, grad_logp = _joined(ranks, "hand_logp")
    _assert_close(logp, torch.tensor([[-0.980829, -1.386294]]))
    _assert_close(entropy, torch.tensor([[1.320888, 1.320888]]))
    # d logp / dx = onehot - p: row 1 (target 1) (-1/8, 5/8 | -1/4, -1/4); row 2 (target 2) (-1/8, -3/8 | 3/4, -1/4)
    _assert_close(grad_logp, torch.tensor([[[-0.125, 0.625, -0.25, -0.25], [-0.125, -0.375, 0.75, -0.25]]]))
    # d H / dx_j = -p_j (ln p_j + H): log p + H = (-0.758553, 0.340059, -0.065406, -0.065406), so
    # -(1/8)(-0.758553) = 0.094819, -(3/8)(0.340059) = -0.127522, -(1/4)(-0.065406) = 0.016351 (sums to 0)
    _, _, grad_entropy = _joined(ranks, "hand_entropy")
    _assert_close(grad_entropy, torch.tensor([[0.094819, -0.127522, 0.016351, 0.016351]] * 2).unsqueeze(0))


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_random_logits_match_full_vocabulary(ranks: list[dict[str, Any]], chunk_rows: int | None) -> None:
    logits, targets, w_lp, w_ent = _random_case()
    ref_logp, ref_entropy, ref_grad = _logp_entropy_and_grad(logits, targets, w_lp, w_ent, TEMPERATURE)
    logp, entropy, grad = _joined(ranks, f"random_{chunk_rows}")
    _assert_close(logp, ref_logp)
    _assert_close(entropy, ref_entropy)
    _assert_close(grad, ref_grad)  # each rank's slice of the full gradient, no reduction needed


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(LOSS_CONFIGS))
def test_policy_loss_on_vocab_parallel_logprobs(ranks: list[dict[str, Any]], name: str) -> None:
    logits, targets, _, _ = _random_case()
    x = logits.clone().requires_grad_(True)
    logp, entropy = token_logprobs_and_entropy(x, targets, TEMPERATURE)
    ref_loss, ref_stats = policy_loss(LOSS_CONFIGS[name], _loss_inputs(name, logp, entropy))
    ref_loss.backward()
    assert x.grad is not None
    assert 0.0 < ref_stats["clip_frac"] < 1.0, ref_stats  # some tokens clipped and some not: both paths tested
    for rank, result in enumerate(ranks):
        loss, stats, grad = result[f"loss_{name}"]
        lo, hi = RANDOM_SPLIT[rank], RANDOM_SPLIT[rank + 1]
        _assert_close(loss, ref_loss.detach())
        assert stats["clip_frac"] == ref_stats["clip_frac"]
        _assert_close(grad, x.grad[..., lo:hi])


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("temperature", EXTREME_TEMPERATURES)
def test_extreme_logits_stay_finite(ranks: list[dict[str, Any]], temperature: float) -> None:
    _, targets, unshifted = _extreme_case()
    _, _, w_lp, w_ent = _random_case()
    logp, entropy, grad = _joined(ranks, f"extreme_{temperature}")
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all() and torch.isfinite(grad).all()
    assert (entropy >= 0).all() and entropy[1, 2] < 1e-6  # the near one-hot position
    ref_logp, ref_entropy, ref_grad = _logp_entropy_and_grad(unshifted, targets, w_lp, w_ent, temperature)
    _assert_close(logp, ref_logp)
    _assert_close(entropy, ref_entropy)
    _assert_close(grad, ref_grad)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ignore_index_is_an_error_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        message = result["bad_target_error"]
        assert isinstance(message, str) and "10 of 10 targets lie in none" in message and "pad id" in message


# --- no process group ---------------------------------------------------------------------


@pytest.mark.parametrize("chunk_rows", [1, None])
def test_without_group_equals_full_vocabulary(chunk_rows: int | None) -> None:
    logits, targets, w_lp, w_ent = _random_case()
    ref = _logp_entropy_and_grad(logits, targets, w_lp, w_ent, TEMPERATURE)
    mine = _logp_entropy_and_grad(logits, targets, w_lp, w_ent, TEMPERATURE, group=None, chunk_rows=chunk_rows)
    for actual, expected in zip(mine, ref):
        _assert_close(actual, expected)


def test_gradcheck_in_float64() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[0, 3, 1]])
    assert torch.autograd.gradcheck(lambda x: vp_logprobs(x, targets, 1.3, None, 0, 2), (logits,))


def test_bfloat16_logits_give_float32_outputs_and_bfloat16_grads() -> None:
    logits, targets, _, _ = _random_case()
    x = logits.to(torch.bfloat16).requires_grad_(True)
    logp, entropy = vp_logprobs(x, targets)
    ref_logp, ref_entropy = token_logprobs_and_entropy(x.detach(), targets)
    assert logp.dtype == entropy.dtype == torch.float32
    _assert_close(logp, ref_logp)
    _assert_close(entropy, ref_entropy)
    logp.sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16


def test_bad_arguments_say_what_to_do() -> None:
    logits, targets, _, _ = _random_case()
    with pytest.raises(ValueError, match="replace ignore-index values such as -100 with the pad id"):
        vp_logprobs(logits, torch.full_like(targets, -100))
    with pytest.raises(ValueError, match="0 with group=None"):
        vp_logprobs(logits, targets, vocab_start=6)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        vp_logprobs(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match=r"\[B, T, V_local\]"):
        vp_logprobs(logits[0], targets[0])
