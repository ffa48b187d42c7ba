"""Log-probabilities of target tokens and per-token entropy from logits, memory-friendly.

``token_logprobs_and_entropy(logits [B, T, V], targets [B, T])`` returns the
float32 log-prob of each target token and the entropy of each position's
distribution. Vocabularies are large (150k+), so a naive
``log_softmax(logits.float())`` followed by ``exp`` and a product keeps three
or four float32 ``[B, T, V]`` tensors alive for backward. Here a custom
autograd function walks the rows in chunks, keeps only the caller's logits
(which autograd holds anyway), the targets and the entropy, and recomputes the
softmax chunk by chunk in backward. Peak extra memory is a few
``[chunk, V]`` float32 buffers instead of several ``[B, T, V]`` ones. Rows that
fit in one chunk (small vocabularies) go in one pass over the caller's tensor:
there the step's time is the number of ops, not their size.

Gradients (per row, ``p = softmax(x)``, ``x = logits / temperature``)::

    d logp_target / dx_j = 1[j == target] - p_j
    d entropy      / dx_j = -p_j * (log p_j + entropy)
"""

from __future__ import annotations

from typing import Any, Final

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

# Elements per chunk of float32 work (2**25 floats = 128 MiB per buffer); for a
# 150k vocabulary that is ~220 rows per chunk.
_CHUNK_ELEMENTS: Final[int] = 1 << 25
# Up to this many elements (16 MiB of float32 per buffer; 27 rows of a 150k vocabulary) plain
# autograd ops serve: it keeps three such buffers for backward, and on small vocabularies (the
# tiny model's 48 tokens) a custom function's own overhead is most of the time.
_PLAIN_ELEMENTS: Final[int] = 1 << 22
# Below every log p of a p > 0 (float64's exp underflows below about -745), yet small enough in
# magnitude that the entropy's gradient through it stays finite, so times p == 0 it is 0, not NaN
# (with the dtype's lowest value an entropy weight above 1 overflowed).
_LOG_P_FLOOR: Final[float] = -1e4


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bfloat16/float32 inputs; float64 stays float64 (for gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _plogp(p: Tensor, logp: Tensor) -> Tensor:
    """``p * log p`` that is 0 where p == 0 (a -inf logit would otherwise give 0 * -inf = NaN)."""
    return torch.where(p > 0, p * logp, torch.zeros_like(p))


def _log_softmax(logits: Tensor, temperature: float) -> Tensor:
    """``log softmax(logits / temperature)`` over the vocabulary, in the compute dtype."""
    return torch.log_softmax(_scaled(logits.to(_compute_dtype(logits.dtype)), temperature), dim=-1)


def _rows_forward(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """(log-prob of each target, entropy) of rows ``[..., V]`` at once."""
    log_p = _log_softmax(logits, temperature)
    logp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    # -sum p log p, with log p clamped to _LOG_P_FLOOR: where p == 0 (a -inf logit of a masked
    # token) the product is 0, not 0 * -inf = NaN; where p > 0 the clamp changes nothing.
    # (torch.special.entr does the same with a branch per element: 3x the time.)
    entropy = (log_p.exp() * log_p.clamp(min=_LOG_P_FLOOR)).sum(dim=-1).neg()
    return logp, entropy


def _rows_grad(logits: Tensor, targets: Tensor, entropy: Tensor, grad_logp: Tensor | None,
               grad_entropy: Tensor | None, temperature: float) -> Tensor:
    """The gradient of rows ``[..., V]`` of logits, their softmax recomputed."""
    log_p = _log_softmax(logits, temperature)
    p = torch.exp(log_p)
    grad_x: Tensor | None = None
    if grad_logp is not None:  # -p * g_lp, plus g_lp at the target
        g_lp = grad_logp.to(p.dtype).unsqueeze(-1)
        grad_x = p * g_lp.neg()
        grad_x.scatter_add_(-1, targets.unsqueeze(-1), g_lp)
    if grad_entropy is not None:  # -p * g_ent * (log p + H); _plogp keeps p == 0 columns at 0
        g_ent = grad_entropy.to(p.dtype).unsqueeze(-1)
        term = -g_ent * (_plogp(p, log_p) + p * entropy.unsqueeze(-1))
        grad_x = term if grad_x is None else grad_x + term
    assert grad_x is not None
    return _scaled(grad_x, temperature).to(logits.dtype)


class _TokenLogprobEntropy(torch.autograd.Function):
    """Logits ``[..., V]`` -> (log-prob of target ``[...]``, entropy ``[...]``).

    Up to ``chunk_rows`` rows go at once, as the caller's tensor (a slice such as
    ``logits[:, :-1]`` is not copied); more are walked in chunks of rows.
    """

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, targets: Tensor, temperature: float, chunk_rows: int
    ) -> tuple[Tensor, Tensor]:
        n_rows = targets.numel()
        if n_rows <= chunk_rows:
            logp, entropy = _rows_forward(logits, targets, temperature)
        else:
            rows, flat_targets = logits.reshape(n_rows, logits.shape[-1]), targets.reshape(n_rows)
            logp = torch.empty(n_rows, dtype=_compute_dtype(logits.dtype), device=logits.device)
            entropy = torch.empty_like(logp)
            for start in range(0, n_rows, chunk_rows):
                stop = min(start + chunk_rows, n_rows)
                logp[start:stop], entropy[start:stop] = _rows_forward(
                    rows[start:stop], flat_targets[start:stop], temperature)
            logp, entropy = logp.view(targets.shape), entropy.view(targets.shape)
        ctx.save_for_backward(logits, targets, entropy)
        ctx.temperature = temperature
        ctx.chunk_rows = chunk_rows
        # An output the loss does not use (the entropy, without a bonus) gets None, not zeros:
        # backward then skips its term.
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, None, None, None]:
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None
        logits, targets, entropy = ctx.saved_tensors
        temperature: float = ctx.temperature
        chunk_rows: int = ctx.chunk_rows
        n_rows = targets.numel()
        if n_rows <= chunk_rows:
            return _rows_grad(logits, targets, entropy, grad_logp, grad_entropy, temperature), None, None, None
        vocab = logits.shape[-1]
        rows, flat_targets, flat_entropy = logits.reshape(n_rows, vocab), targets.reshape(n_rows), entropy.reshape(n_rows)
        flat_grad_logp = None if grad_logp is None else grad_logp.reshape(n_rows)
        flat_grad_entropy = None if grad_entropy is None else grad_entropy.reshape(n_rows)
        grad_logits = torch.empty((n_rows, vocab), dtype=logits.dtype, device=logits.device)
        for start in range(0, n_rows, chunk_rows):
            chunk = slice(start, min(start + chunk_rows, n_rows))
            grad_logits[chunk] = _rows_grad(
                rows[chunk], flat_targets[chunk], flat_entropy[chunk],
                None if flat_grad_logp is None else flat_grad_logp[chunk],
                None if flat_grad_entropy is None else flat_grad_entropy[chunk], temperature)
        return grad_logits.view(logits.shape), None, None, None


def _scaled(x: Tensor, temperature: float) -> Tensor:
    """``x / temperature``; ``x`` itself at 1 (one op fewer per chunk: on small vocabularies the
    step's time is the number of ops, not their size)."""
    return x if temperature == 1.0 else x / temperature


def token_logprobs_and_entropy(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_rows: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Return ``(logp [B, T], entropy [B, T])`` in float32 for ``logits [B, T, V]`` and ``targets [B, T]``.

    ``logits[b, t]`` must be the prediction for ``targets[b, t]`` (shift before
    calling). ``temperature`` divides the logits first; use the sampling
    temperature so the log-probs match the rollout engine's. Every target must
    be a valid token id in ``[0, V)``, padding included (use the pad id, and
    mask it out later). ``chunk_rows`` overrides how many rows are processed at
    once (default: about 2**25 / V; up to 2**22 elements in all go through plain
    autograd ops instead). Both outputs are differentiable.
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"token_logprobs_and_entropy: logits must be [B, T, V] and targets [B, T]; got "
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)}"
        )
    if not logits.is_floating_point():
        raise ValueError(f"token_logprobs_and_entropy: logits must be floating point, got {logits.dtype}")
    if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"token_logprobs_and_entropy: targets must be integer token ids, got {targets.dtype}")
    if not temperature > 0.0:
        raise ValueError(
            f"token_logprobs_and_entropy: temperature must be > 0 (the sampling temperature), "
            f"got {temperature}"
        )
    vocab = logits.shape[-1]
    if targets.numel() > 0:
        low, high = (int(v) for v in torch.stack(torch.aminmax(targets)).tolist())  # one sync
        if low < 0 or high >= vocab:
            raise ValueError(
                f"token_logprobs_and_entropy: target ids must lie in [0, {vocab}) (the vocabulary), "
                f"got min {low} and max {high}; replace ignore-index values such as -100 with the pad id"
            )
    rows = chunk_rows if chunk_rows is not None else max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    if rows < 1:
        raise ValueError(f"token_logprobs_and_entropy: chunk_rows must be >= 1, got {chunk_rows}")
    if chunk_rows is None and targets.numel() * vocab <= _PLAIN_ELEMENTS:
        return _rows_forward(logits, targets.to(torch.int64), temperature)
    # torch ships Function.apply untyped
    logp, entropy = _TokenLogprobEntropy.apply(  # type: ignore[no-untyped-call]
        logits, targets.to(torch.int64), float(temperature), rows
    )
    return logp, entropy
