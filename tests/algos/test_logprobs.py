"""Checks of token_logprobs_and_entropy: hand-worked values and gradients against plain autograd."""

from __future__ import annotations

import math

import pytest
import torch

from relax_hpc.algos.logprobs import token_logprobs_and_entropy


def reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return logp, entropy


def test_two_token_vocabulary_by_hand() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    logp, entropy = token_logprobs_and_entropy(logits, torch.tensor([[1, 0]]))
    # p = (1, 3)/4 = (0.25, 0.75): logp(1) = ln 0.75 = -0.287682, logp(0) = ln 0.25 = -1.386294
    # entropy = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.346574 + 0.215762 = 0.562335
    torch.testing.assert_close(logp, torch.tensor([[-0.287682, -1.386294]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, torch.tensor([[0.562335, 0.562335]]), atol=1e-6, rtol=0)


def test_temperature_divides_logits() -> None:
    logits = torch.tensor([[[0.0, 2.0 * math.log(3.0)]]])
    logp, entropy = token_logprobs_and_entropy(logits, torch.tensor([[1]]), temperature=2.0)
    # logits / 2 = (0, ln 3): same distribution as above
    torch.testing.assert_close(logp, torch.tensor([[-0.287682]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, torch.tensor([[0.562335]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "shifted slice"])
@pytest.mark.parametrize("chunk_rows", [1, 3, 100, None], ids=["rows", "chunks", "one chunk", "plain ops"])
def test_values_and_gradients_match_plain_autograd(chunk_rows: int | None, sliced: bool) -> None:
    # A shifted slice (`logits[:, :-1]`, as the trainer passes) is not contiguous: one chunk takes
    # it as it is, several walk its rows. Without chunk_rows, so few elements go through plain ops.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6 if sliced else 5, 11, generator=gen) * 3.0
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    w_lp, w_ent = torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)

    def rows(x: torch.Tensor) -> torch.Tensor:
        return x[:, :-1] if sliced else x

    mine = logits.clone().requires_grad_(True)
    logp, entropy = token_logprobs_and_entropy(rows(mine), targets, temperature=0.7, chunk_rows=chunk_rows)
    ((logp * w_lp).sum() + (entropy * w_ent).sum()).backward()

    theirs = logits.clone().requires_grad_(True)
    ref_logp, ref_entropy = reference(rows(theirs), targets, 0.7)
    ((ref_logp * w_lp).sum() + (ref_entropy * w_ent).sum()).backward()

    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(entropy, ref_entropy)
    assert mine.grad is not None and theirs.grad is not None
    torch.testing.assert_close(mine.grad, theirs.grad)


@pytest.mark.parametrize("chunk_rows", [2, 100, None], ids=["two chunks", "one chunk", "plain ops"])
def test_gradcheck_in_float64(chunk_rows: int | None) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[0, 3, 1]])
    assert torch.autograd.gradcheck(lambda x: token_logprobs_and_entropy(x, targets, 1.3, chunk_rows), (logits,))


def test_bfloat16_logits_are_computed_in_float32() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(1, 4, 7, generator=gen) * 2).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 7, (1, 4), generator=gen)
    logp, entropy = token_logprobs_and_entropy(logits, targets)
    assert logp.dtype == torch.float32 and entropy.dtype == torch.float32
    ref_logp, ref_entropy = reference(logits.detach(), targets, 1.0)  # same bf16 values upcast
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(entropy, ref_entropy)
    logp.sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("chunk_rows", [1, None], ids=["chunks", "plain ops"])
def test_minus_inf_logits_give_no_nan(chunk_rows: int | None) -> None:
    logits = torch.tensor([[[0.0, 0.0, -math.inf]]], requires_grad=True)
    logp, entropy = token_logprobs_and_entropy(logits, torch.tensor([[0]]), chunk_rows=chunk_rows)
    # p = (0.5, 0.5, 0): logp = ln 0.5 = -0.693147, entropy = ln 2 = 0.693147
    torch.testing.assert_close(logp, torch.tensor([[-0.693147]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, torch.tensor([[0.693147]]), atol=1e-6, rtol=0)
    (logp + 1e6 * entropy).sum().backward()  # a large weight on the entropy: still no NaN
    # d logp/dx = onehot - p = (0.5, -0.5, 0); d H/dx_j = -p_j (ln p_j + H) = (0, 0, 0)
    assert logits.grad is not None
    torch.testing.assert_close(logits.grad, torch.tensor([[[0.5, -0.5, 0.0]]]))


def test_invalid_targets_and_temperature_are_explained() -> None:
    logits = torch.zeros(1, 2, 5)
    with pytest.raises(ValueError, match=r"target ids must lie in \[0, 5\).*-100 with the pad id"):
        token_logprobs_and_entropy(logits, torch.tensor([[1, -100]]))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs_and_entropy(logits, torch.tensor([[1, 1]]), temperature=0.0)
    with pytest.raises(ValueError, match=r"logits must be \[B, T, V\] and targets \[B, T\]"):
        token_logprobs_and_entropy(logits, torch.tensor([1, 1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bfloat16_matches_reference_with_less_peak_memory() -> None:
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(3)
    logits = (torch.randn(4, 512, 32000, generator=gen, device=device) * 2).to(torch.bfloat16)
    targets = torch.randint(0, 32000, (4, 512), generator=gen, device=device)

    def peak_extra(fn: object) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        x = logits.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        logp, entropy = fn(x, targets)  # type: ignore[operator]
        (logp.sum() + entropy.sum()).backward()
        torch.cuda.synchronize()
        assert x.grad is not None
        return torch.cuda.max_memory_allocated() - base, logp.detach(), entropy.detach(), x.grad

    mine_peak, logp, entropy, grad = peak_extra(lambda x, t: token_logprobs_and_entropy(x, t))
    ref_peak, ref_logp, ref_entropy, ref_grad = peak_extra(lambda x, t: reference(x, t, 1.0))
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=1e-2, rtol=1e-2)
    assert mine_peak < ref_peak, (mine_peak, ref_peak)
