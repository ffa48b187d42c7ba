"""Pack samples, or transfer-queue rows, into right-padded training tensors.

Positions are shifted for next-token prediction: column t of the per-token tensors holds the
prediction of token t+1 of the sequence, so the response tokens of a sample with a prompt of
length P sit at columns P-1 .. P+R-2.

`pack_samples` packs `Sample`s (rollout, the forward roles, `TorchBackend.train`). `pack_rows`
packs the trainer's queue rows straight from their tensors into the same `TrainBatch`, without
the round trip through Python lists that a `Sample` needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable

import numpy as np
import torch

from relax_hpc.data.sample import Sample
from relax_hpc.media.items import PromptMedia


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1] next tokens
    loss_mask: torch.Tensor  # [B, L-1] 1 on trained response tokens
    rollout_log_probs: torch.Tensor  # [B, L-1]
    advantages: torch.Tensor  # [B], or [B, L-1] per token (GAE)
    old_log_probs: torch.Tensor | None = None  # [B, L-1] from ActorFwd, when that role runs
    ref_log_probs: torch.Tensor | None = None  # [B, L-1] from Reference, when that role runs
    # [B, L, layers, top_k]: the engine's routed experts of every row (routing replay), else None
    routed_experts: torch.Tensor | None = None
    # Per row, its prompt's canonical media (a multimodal model), else None: the trainer builds
    # the media tensors and M-RoPE positions of each micro-batch from them (relax_hpc.media)
    media: tuple[PromptMedia | None, ...] | None = None

    def __len__(self) -> int:
        return self.input_ids.size(0)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor],
             media: tuple[PromptMedia | None, ...] | None) -> "TrainBatch":
        return TrainBatch(*(None if t is None else fn(t) for t in (
            self.input_ids, self.attention_mask, self.targets, self.loss_mask,
            self.rollout_log_probs, self.advantages, self.old_log_probs, self.ref_log_probs,
            self.routed_experts,
        )), media=media)

    def slice(self, start: int, stop: int) -> "TrainBatch":
        return self._map(lambda t: t[start:stop], None if self.media is None else self.media[start:stop])

    def to(self, device: torch.device) -> "TrainBatch":
        return self._map(lambda t: t.to(device), self.media)

    def trimmed(self) -> "TrainBatch":
        """The batch without the padding columns that no row reaches (its rows right-padded to
        a longer batch's length, as a micro-batch sliced from a whole step's batch is): the
        same losses and gradients, for fewer positions. At least two columns stay (one target)."""
        length = self.input_ids.size(1)
        used = max(2, int(self.attention_mask.sum(dim=1).max())) if len(self) else length
        if used >= length:
            return self

        def cut(t: torch.Tensor) -> torch.Tensor:
            if t.dim() < 2:
                return t  # per-sequence (advantages)
            return t[:, :used] if t.size(1) == length else t[:, : used - 1]

        return self._map(cut, self.media)


def pack_samples(samples: list[Sample], pad_id: int) -> TrainBatch:
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    spans = _Spans(samples)
    batch, length = len(samples), spans.length
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    input_ids[spans.seq_rows, spans.seq_cols] = _flat(
        (t for s in samples for t in chain(s.prompt_ids, s.response_ids)), spans.seq_count, np.int64)
    attention = torch.zeros((batch, length), dtype=torch.long)
    attention[spans.seq_rows, spans.seq_cols] = 1
    loss_mask = spans.per_token([s.mask() for s in samples])
    rollout_lp = spans.per_token([s.rollout_log_probs for s in samples])
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    old_lp = _per_token(samples, spans, lambda s: s.old_log_probs)
    ref_lp = _per_token(samples, spans, lambda s: s.ref_log_probs)
    routes = None
    if all(s.routed_experts is not None for s in samples):
        from relax_hpc.backends.megatron_replay import pack_routes

        routes = pack_routes([s.routed_experts for s in samples],  # type: ignore[misc]
                             [len(s.prompt_ids) + len(s.response_ids) for s in samples], length)
    media = tuple(s.media for s in samples) if any(s.media is not None for s in samples) else None
    return TrainBatch(input_ids, attention, input_ids[:, 1:].clone(), loss_mask, rollout_lp, advantages,
                      old_lp, ref_lp, routes, media)


class _Spans:
    """Where each sample's tokens go in a packed batch, as index tensors: whole sequences in the
    [B, L] tensors, responses in the [B, L-1] per-token ones (column t predicts token t + 1). One
    scatter per tensor instead of a copy per sample: a step's packing was a millisecond of
    Python for 32 samples."""

    def __init__(self, samples: list[Sample]) -> None:
        prompts = np.fromiter((len(s.prompt_ids) for s in samples), np.int64, len(samples))
        responses = np.fromiter((len(s.response_ids) for s in samples), np.int64, len(samples))
        totals = prompts + responses
        self.length = int(totals.max())
        self.rows = len(samples)
        self.seq_count, self.response_count = int(totals.sum()), int(responses.sum())
        self.response_lengths = responses.tolist()
        self.seq_rows, self.seq_cols = _ranges(totals, np.zeros_like(totals))
        self.response_rows, self.response_cols = _ranges(responses, prompts - 1)

    def per_token(self, values: list[list[float]]) -> torch.Tensor:
        """A [B, L-1] float tensor holding each sample's per-response-token `values`, 0 elsewhere."""
        for i, (row, n) in enumerate(zip(values, self.response_lengths)):
            if len(row) != n:
                raise ValueError(f"sample {i} has {len(row)} per-token values for its {n} response tokens")
        out = torch.zeros((self.rows, self.length - 1), dtype=torch.float32)
        out[self.response_rows, self.response_cols] = _flat(chain.from_iterable(values), self.response_count,
                                                            np.float32)
        return out


def _flat(values: Iterable[float], count: int, dtype: type) -> torch.Tensor:
    """The first `count` of `values` as a 1-D tensor."""
    return torch.from_numpy(np.fromiter(values, dtype, count))


def _ranges(counts: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column indices of `counts[i]` cells from column `starts[i]` in each row i."""
    rows = np.repeat(np.arange(len(counts)), counts)
    cols = np.arange(int(counts.sum())) + np.repeat(starts - (np.cumsum(counts) - counts), counts)
    return torch.from_numpy(rows), torch.from_numpy(cols)


def _per_token(samples: list[Sample], spans: _Spans,
               get: Callable[[Sample], list[float] | None]) -> torch.Tensor | None:
    """A [B, L-1] tensor of a per-response-token field, or None unless every sample has it."""
    values = [get(s) for s in samples]
    if any(v is None for v in values):
        return None
    return spans.per_token(values)  # type: ignore[arg-type]


# Row fields (relax_hpc.data.rows) of the per-response-token values the forward roles write.
OLD_LOG_PROBS_FIELD = "log_probs"  # ActorFwd
REF_LOG_PROBS_FIELD = "ref_log_probs"  # Reference


def pack_rows(rows: Sequence[Mapping[str, Any]], pad_id: int) -> TrainBatch:
    """The `TrainBatch` that `pack_samples` builds from the rows' samples, from the row tensors.

    Each row carries `tokens` (prompt then response), `prompt_length`, `rollout_log_probs` and
    `loss_mask` (one value per response token), `advantages`, and optionally `log_probs` /
    `ref_log_probs` (used only when every row has them, as in `pack_samples`). Every field is
    concatenated once over the batch and scattered under a boolean mask of its cells. The row
    tensors are only read: the queue may deliver them as views into one shared buffer.
    """
    if not rows:
        raise ValueError("cannot pack an empty list of rows")
    tokens = [row["tokens"] for row in rows]
    lengths = torch.tensor([t.shape[0] for t in tokens], dtype=torch.long)
    prompt = torch.tensor([int(row["prompt_length"]) for row in rows], dtype=torch.long)
    _check_prompt_lengths(prompt, lengths)
    response = lengths - prompt
    columns = torch.arange(int(lengths.max()))
    attention = columns < lengths[:, None]
    input_ids = torch.full(attention.shape, pad_id, dtype=torch.long)
    # True cells read row-major are each row's tokens in order, i.e. the concatenation order.
    input_ids.masked_scatter_(attention, torch.cat(tokens).to(torch.long))
    first = (prompt - 1)[:, None]
    in_response = (columns[:-1] >= first) & (columns[:-1] < first + response[:, None])
    counts = response.tolist()

    def per_token(name: str) -> torch.Tensor:
        return _scatter_response([row[name] for row in rows], in_response, counts, name)

    def optional(name: str) -> torch.Tensor | None:
        return per_token(name) if all(name in row for row in rows) else None

    # One advantage per row, or one per response token (the critic's GAE: a tensor per row).
    if all(isinstance(row["advantages"], torch.Tensor) and row["advantages"].dim() == 1 for row in rows):
        advantages = per_token("advantages")
    else:
        advantages = torch.tensor([float(row["advantages"]) for row in rows], dtype=torch.float32)
    return TrainBatch(
        input_ids, attention.long(), input_ids[:, 1:].clone(), per_token("loss_mask"),
        per_token("rollout_log_probs"), advantages,
        optional(OLD_LOG_PROBS_FIELD), optional(REF_LOG_PROBS_FIELD), _routes_of(rows, input_ids.shape[1]),
        _media_of(rows),
    )


def _media_of(rows: Sequence[Mapping[str, Any]]) -> tuple[PromptMedia | None, ...] | None:
    """Each row's media (relax_hpc.data.rows.MEDIA_FIELDS), or None when no row carries any."""
    from relax_hpc.data.rows import media_from_fields

    media = tuple(media_from_fields(dict(row)) for row in rows)
    return media if any(m is not None for m in media) else None


def _routes_of(rows: Sequence[Mapping[str, Any]], width: int) -> torch.Tensor | None:
    """The rows' routed experts packed ``[B, width, layers, top_k]`` when every row has them."""
    from relax_hpc.backends.megatron_replay import pack_row_routes
    from relax_hpc.data.rows import ROUTED_EXPERTS_FIELD

    return pack_row_routes(rows, width) if all(ROUTED_EXPERTS_FIELD in row for row in rows) else None


def _check_prompt_lengths(prompt: torch.Tensor, lengths: torch.Tensor) -> None:
    bad = ((prompt < 1) | (prompt > lengths)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(
            f"row {i} of the micro-batch has prompt_length {int(prompt[i])} but {int(lengths[i])} "
            "tokens; prompt_length must be between 1 and the number of tokens (prompt + response): "
            "check the producer's rows (relax_hpc.data.rows.sample_to_row)"
        )


def _scatter_response(values: list[torch.Tensor], in_response: torch.Tensor, counts: list[int],
                      name: str) -> torch.Tensor:
    """A float32 [B, L-1] tensor with each row's values at its response columns, zeros elsewhere."""
    got = [v.shape[0] for v in values]
    if got != counts:
        # masked_scatter_ would silently misalign (or drop) values whose lengths do not match.
        i = next(k for k, (g, c) in enumerate(zip(got, counts)) if g != c)
        raise ValueError(
            f"row {i} of the micro-batch has {got[i]} values in field {name!r} but {counts[i]} "
            "response tokens (tokens minus prompt_length); the field needs one value per response "
            "token: check the role that wrote it"
        )
    out = torch.zeros(in_response.shape, dtype=torch.float32)
    return out.masked_scatter_(in_response, torch.cat(values).to(torch.float32))
