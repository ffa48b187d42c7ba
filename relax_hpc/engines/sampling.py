"""Pure functions that turn next-token logits into samples and log-probs."""

from __future__ import annotations

import torch


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf. `logits` is [B, V]."""
    if top_k > 0 and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # A token is dropped when the mass of the tokens ranked above it already reaches top_p;
        # the most likely token is therefore always kept.
        mass_above = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_above >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [B, V]; return (token ids [B], log-probs [B]).

    The log-prob is taken under softmax(logits / temperature) without the top-k/top-p filter, so it
    equals what the training backend recomputes from the same weights.
    """
    scaled = logits.float() / temperature
    logp_all = torch.log_softmax(scaled, dim=-1)
    filtered = filter_top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(filtered, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
