"""Log-probs of target tokens and per-token entropy from vocab-parallel logits, without gathering them.

With tensor parallelism (Megatron) each of the ``tp`` ranks of a group holds
the logits of one contiguous slice of the vocabulary, ``[B, T, V_local]``, the
rank that starts at id ``vocab_start`` owning ids ``[vocab_start, vocab_start +
V_local)``. ``vocab_parallel_logprobs_and_entropy`` returns the same
``(logp [B, T], entropy [B, T])`` as
:func:`relax_hpc.algos.logprobs.token_logprobs_and_entropy` on the full
vocabulary, identical on every rank of the group, with two collectives on
``[B*T]``-sized vectors instead of an all-gather of ``[B, T, V]``:

1. ``all_reduce(MAX)`` of each row's largest logit ``m`` (a constant shift for
   stability, so it needs no gradient);
2. one ``all_reduce(SUM)`` of four stacked ``[B*T]`` vectors, each a sum over
   the rank's slice: ``S = sum_j e_j`` with ``e_j = exp(x_j - m)``,
   ``sum_j e_j (x_j - m)``, the target's logit (only the owning rank adds a
   non-zero value) and a 1 from the rank that owns the target.

With ``x = logits / temperature``::

    log Z      = m + log S
    logp       = x_target - log Z
    entropy    = log Z - sum_j p_j x_j = log S - sum_j e_j (x_j - m) / S

The fourth sum checks that every target is owned by exactly one rank, so an
ignore-index such as -100, a target past the vocabulary or a wrong
``vocab_start`` is an error on every rank at once rather than a silent wrong
log-prob (``token_logprobs_and_entropy`` rejects the same targets).

Backward needs no collective: with ``log p_j = x_j - log Z`` and the entropy
``H`` saved from forward, each rank's gradient is a function of its own slice
(derivation in :class:`_VocabParallelLogprobEntropy`). Each rank's loss must be
the same function of the (replicated) outputs, as in Megatron's
``_VocabParallelCrossEntropy``; then each rank's ``local_logits.grad`` is its
slice of the full-vocabulary gradient, with no further reduction. Rows are
processed in chunks like ``logprobs.py``, so no float32 copy of the
``[B, T, V_local]`` logits is kept alive for backward.

Tests: ``.venv/bin/pytest tests/algos/test_vocab_parallel.py -q`` (two gloo
ranks on CPU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from relax_hpc.algos.logprobs import _CHUNK_ELEMENTS, _plogp

__all__ = ["vocab_parallel_logprobs_and_entropy"]

_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def _all_reduce(tensor: Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None) -> None:
    """In-place all-reduce over ``group``; a no-op without one (the whole vocabulary is local)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """Rows ``[N, V_local]`` of one vocabulary slice -> (log-prob of target ``[N]``, entropy ``[N]``).

    Gradients, per row, ``x = logits / temperature``, ``p = softmax(x)`` over the
    full vocabulary, ``log p_k = x_k - log Z`` with ``d log Z / dx_j = p_j``, so
    ``dp_k / dx_j = p_k (1[k == j] - p_j)``.

    Log-prob of the target ``t``: ``d (x_t - log Z) / dx_j = 1[j == t] - p_j``.

    Entropy ``H = -sum_k p_k log p_k``::

        dH/dx_j = -sum_k (dp_k/dx_j) (log p_k + 1)
                = -sum_k p_k (1[k == j] - p_j) (log p_k + 1)
                = -p_j (log p_j + 1) + p_j sum_k p_k (log p_k + 1)
                = -p_j (log p_j + 1) + p_j (1 - H)
                = -p_j (log p_j + H)

    Both need only the rank's own ``x_j``, the global ``log Z`` and ``H`` (saved
    from forward), and ``1[j == t]`` only on the rank that owns ``t``: backward
    is local. The chain rule through ``x = logits / temperature`` divides by the
    temperature.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        targets: Tensor,
        temperature: float,
        group: dist.ProcessGroup | None,
        vocab_start: int,
        chunk_rows: int,
    ) -> tuple[Tensor, Tensor]:
        n_rows, local_vocab = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)
        owned = (targets >= vocab_start) & (targets < vocab_start + local_vocab)
        local_targets = torch.where(owned, targets - vocab_start, torch.zeros_like(targets))

        # Dividing by a positive number preserves order, so the max of x is the max logit / temperature.
        row_max = logits.detach().amax(dim=-1).to(dtype) / temperature
        _all_reduce(row_max, dist.ReduceOp.MAX, group)

        sums = torch.zeros(4, n_rows, dtype=dtype, device=logits.device)
        for start in range(0, n_rows, chunk_rows):
            stop = min(start + chunk_rows, n_rows)
            shifted = logits[start:stop].to(dtype) / temperature - row_max[start:stop].unsqueeze(-1)
            exp_shifted = torch.exp(shifted)
            sums[0, start:stop] = exp_shifted.sum(dim=-1)
            # where e == 0 (a -inf logit) the product is 0, not 0 * -inf = NaN
            sums[1, start:stop] = _plogp(exp_shifted, shifted).sum(dim=-1)
        target_x = logits.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).to(dtype) / temperature
        sums[2] = torch.where(owned, target_x, torch.zeros_like(target_x))
        sums[3] = owned.to(dtype)
        _all_reduce(sums, dist.ReduceOp.SUM, group)

        owners = sums[3]
        if not bool((owners == 1).all()):
            unowned, shared = int((owners == 0).sum().item()), int((owners > 1).sum().item())
            raise ValueError(
                f"vocab_parallel_logprobs_and_entropy: every target id must lie in exactly one rank's "
                f"vocabulary slice [vocab_start, vocab_start + V_local); {unowned} of {n_rows} targets lie in "
                f"none and {shared} in several. Check vocab_start on each rank (this rank: {vocab_start}, "
                f"V_local {local_vocab}) and replace ignore-index values such as -100 with the pad id"
            )
        log_sum = torch.log(sums[0])
        logp = (sums[2] - row_max) - log_sum
        # log S - E_p[x - m] >= 0 exactly; rounding can leave -1e-7 on a near one-hot row
        entropy = (log_sum - sums[1] / sums[0]).clamp_min(0.0)
        # m and log S apart: m + log S at |m| ~ 1e4 would round log p to float32's 1e-3 spacing there
        ctx.save_for_backward(logits, local_targets, owned, row_max, log_sum, entropy)
        ctx.temperature = temperature
        ctx.chunk_rows = chunk_rows
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_logp: Tensor, grad_entropy: Tensor
    ) -> tuple[Tensor, None, None, None, None, None]:
        logits, local_targets, owned, row_max, log_sum, entropy = ctx.saved_tensors
        temperature: float = ctx.temperature
        chunk_rows: int = ctx.chunk_rows
        dtype = torch.promote_types(logits.dtype, torch.float32)
        grad_logits = torch.empty_like(logits)
        # the one-hot term only where this rank owns the target
        g_target = torch.where(owned, grad_logp.to(dtype), torch.zeros((), dtype=dtype, device=logits.device))
        for start in range(0, logits.shape[0], chunk_rows):
            stop = min(start + chunk_rows, logits.shape[0])
            shifted = logits[start:stop].to(dtype) / temperature - row_max[start:stop].unsqueeze(-1)
            log_p = shifted - log_sum[start:stop].unsqueeze(-1)
            p = torch.exp(log_p)
            g_lp = grad_logp[start:stop].to(dtype).unsqueeze(-1)
            g_ent = grad_entropy[start:stop].to(dtype).unsqueeze(-1)
            ent = entropy[start:stop].unsqueeze(-1)
            # -p * (g_lp + g_ent * (log p + H)); _plogp keeps p == 0 columns at 0
            grad_x = -(p * g_lp) - g_ent * (_plogp(p, log_p) + p * ent)
            grad_x.scatter_add_(-1, local_targets[start:stop].unsqueeze(-1), g_target[start:stop].unsqueeze(-1))
            grad_logits[start:stop] = (grad_x / temperature).to(logits.dtype)
        return grad_logits, None, None, None, None, None


def vocab_parallel_logprobs_and_entropy(
    local_logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    chunk_rows: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Return ``(logp [B, T], entropy [B, T])`` in float32 from this rank's slice ``local_logits [B, T, V_local]``.

    ``local_logits[..., j]`` is the logit of token id ``vocab_start + j``; the
    ranks of ``group`` (the tensor-parallel group) must together cover the
    vocabulary with disjoint slices (Megatron: ``vocab_start = rank * V / tp``).
    ``targets [B, T]`` are global token ids, the same on every rank, each a
    valid id (use the pad id in padding, as for ``token_logprobs_and_entropy``).
    Every rank of ``group`` must call this with the same ``B``, ``T``,
    ``temperature`` and targets; all get the same outputs. ``group=None`` means
    no tensor parallelism: ``local_logits`` is the whole vocabulary and
    ``vocab_start`` must be 0 (it does *not* mean the default world group;
    pass ``dist.group.WORLD`` for that). Both outputs are differentiable
    w.r.t. ``local_logits``; backward runs no collective.
    """
    name = "vocab_parallel_logprobs_and_entropy"
    if local_logits.dim() != 3 or targets.shape != local_logits.shape[:2]:
        raise ValueError(
            f"{name}: local_logits must be [B, T, V_local] and targets [B, T]; got "
            f"local_logits {tuple(local_logits.shape)} and targets {tuple(targets.shape)}"
        )
    if not local_logits.is_floating_point():
        raise ValueError(f"{name}: local_logits must be floating point, got {local_logits.dtype}")
    if targets.dtype not in _INTEGER_DTYPES:
        raise ValueError(f"{name}: targets must be integer token ids, got {targets.dtype}")
    if not temperature > 0.0:
        raise ValueError(f"{name}: temperature must be > 0 (the sampling temperature), got {temperature}")
    batch, seq, local_vocab = local_logits.shape
    if local_vocab == 0:
        raise ValueError(f"{name}: this rank's vocabulary slice is empty (local_logits {tuple(local_logits.shape)})")
    if vocab_start < 0 or (group is None and vocab_start != 0):
        raise ValueError(
            f"{name}: vocab_start = {vocab_start}; it must be >= 0, and 0 with group=None "
            f"(pass the tensor-parallel group when local_logits hold a slice of the vocabulary)"
        )
    rows = chunk_rows if chunk_rows is not None else max(1, _CHUNK_ELEMENTS // local_vocab)
    if rows < 1:
        raise ValueError(f"{name}: chunk_rows must be >= 1, got {chunk_rows}")
    flat_logits = local_logits.reshape(batch * seq, local_vocab)
    flat_targets = targets.reshape(batch * seq).to(torch.int64)
    # torch ships Function.apply untyped
    logp, entropy = _VocabParallelLogprobEntropy.apply(  # type: ignore[no-untyped-call]
        flat_logits, flat_targets, float(temperature), group, int(vocab_start), rows
    )
    return logp.reshape(batch, seq), entropy.reshape(batch, seq)
