"""Routing replay (R3) in the Megatron trainer: its MoE routers use the experts the engine chose.

With ``[algorithm] routing_replay = true`` every sample carries the engine's routing
(`relax_hpc.engines.routed_experts`, row field ``routed_experts``: ``[tokens - 1, layers, top_k]``).
The trainer builds its GPTModel with ``moe_enable_routing_replay = True`` (megatron-core gives each
``TopKRouter`` a ``RouterReplay``) and runs each micro-batch's forward and backward inside
`replayed_routing`: every router takes the recorded top-k indices instead of its own top-k, and
computes the gate weights from its own scores at those indices (softmax over the chosen logits for
Qwen3-MoE), so gradients still flow through the router.

Layout: a micro-batch right-padded to ``[B, S]`` (`relax_hpc.backends.batch.pack_rows`) gets
``pack_routes`` -> ``[B, S, layers, k]``; positions with no recorded route (each sample's last
token, whose logits are never trained on, and padding) are sent to experts ``0..k-1``, which
changes no trained position under a causal mask. Megatron's hidden states are sequence-major
``[S, B, h]``, so layer l's replay tensor is ``packed[:, :, l].transpose(0, 1)`` flattened to
``[S * B, k]``; with sequence parallelism each tensor-parallel rank routes its own ``S / tp``
slice of the sequence. Expert parallelism needs nothing more: routing happens before dispatch.

Limits: one micro-batch in flight per model (no pipeline-parallel interleaving), no context
parallelism, no packed (THD) sequences unless the caller packs routes the same way.

megatron is only touched through the model's own modules, so this imports without it.
Tests: tests/backends/test_routing_replay.py (pure parts), tests/backends/test_megatron_routing_replay.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from relax_hpc.data.rows import ROUTED_EXPERTS_FIELD

__all__ = ["model_router_replays", "pack_routes", "pack_row_routes", "replay_indices", "replayed_routing"]


def pack_routes(routes: Sequence[torch.Tensor], lengths: Sequence[int], width: int) -> torch.Tensor:
    """``[B, width, layers, k]`` int64 of each sample's routes at its token positions.

    `routes[i]` is ``[lengths[i] - 1, layers, k]`` (the engine's routing of every token it fed);
    the uncovered positions (the last token, padding) get experts ``0..k-1``.
    """
    if not routes:
        raise ValueError("cannot pack the routes of an empty micro-batch")
    layers, k = routes[0].shape[1:]
    out = torch.arange(k, dtype=torch.long).expand(len(routes), width, layers, k).clone()
    for i, (r, n) in enumerate(zip(routes, lengths, strict=True)):
        if r.dim() != 3 or tuple(r.shape[1:]) != (layers, k):
            raise ValueError(f"sample {i} of the micro-batch has routes of shape {tuple(r.shape)}, expected "
                             f"[tokens - 1, {layers}, {k}] like sample 0; were they recorded with one model?")
        if r.shape[0] != n - 1 or n > width:
            raise ValueError(
                f"sample {i} of the micro-batch has {n} tokens but routes for {r.shape[0]}; the engine must "
                f"record one route per token it fed (tokens - 1 = {n - 1}) and the batch is {width} wide. "
                "Check that the engine ran with routing replay on and the rows are not truncated"
            )
        out[i, : n - 1] = r.to(torch.long)
    return out


def pack_row_routes(rows: Sequence[Mapping[str, Any]], width: int) -> torch.Tensor:
    """`pack_routes` of transfer-queue rows (their ``tokens`` and ``routed_experts`` fields)."""
    missing = [i for i, row in enumerate(rows) if ROUTED_EXPERTS_FIELD not in row]
    if missing:
        raise ValueError(f"rows {missing} of the micro-batch have no {ROUTED_EXPERTS_FIELD!r} field; with "
                         "[algorithm] routing_replay = true the rollout engine must record routing "
                         "(NativeEngine(record_routing=True), or SGLang with --enable-return-routed-experts)")
    return pack_routes([row[ROUTED_EXPERTS_FIELD] for row in rows], [int(row["tokens"].shape[0]) for row in rows],
                       width)


def replay_indices(packed: torch.Tensor, tp_rank: int = 0, tp_size: int = 1,
                   sequence_parallel: bool = False) -> list[torch.Tensor]:
    """Per MoE layer, the ``[tokens, k]`` indices its router sees, in Megatron's token order.

    Megatron flattens ``[S, B]`` sequence-major; with sequence parallelism a tensor-parallel rank
    holds rows ``rank * S / tp`` to ``(rank + 1) * S / tp`` of it.
    """
    _, seq, layers, k = packed.shape
    seq_major = packed.transpose(0, 1)  # [S, B, layers, k]
    if sequence_parallel and tp_size > 1:
        if seq % tp_size:
            raise ValueError(f"sequence length {seq} is not divisible by tensor_model_parallel_size {tp_size}; "
                             "with sequence parallelism pad the micro-batch to a multiple of it")
        chunk = seq // tp_size
        seq_major = seq_major[tp_rank * chunk: (tp_rank + 1) * chunk]
    return [seq_major[:, :, layer].reshape(-1, k).contiguous() for layer in range(layers)]


def model_router_replays(model: torch.nn.Module) -> list[Any]:
    """The ``RouterReplay`` of each MoE router of `model`, in layer order (empty: replay is off)."""
    return [m.router_replay for m in model.modules() if getattr(m, "router_replay", None) is not None]


@contextlib.contextmanager
def replayed_routing(model: torch.nn.Module, packed: torch.Tensor, tp_rank: int = 0, tp_size: int = 1,
                     sequence_parallel: bool = False) -> Iterator[None]:
    """Inside, every MoE router of `model` routes the micro-batch's tokens as `packed` says.

    Run the micro-batch's forward and its backward inside (an activation recompute re-routes
    during backward, and finds the same indices). The model's routers only are set, not
    megatron's process-wide list, so other models in the process (a reference) route freely.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = model_router_replays(model)
    if not replays:
        raise ValueError("the model has no router replay; build it with moe_enable_routing_replay = True "
                         "(set on the provider / TransformerConfig when [algorithm] routing_replay = true)")
    per_layer = replay_indices(packed, tp_rank, tp_size, sequence_parallel)
    if len(per_layer) != len(replays):
        raise ValueError(f"the routes cover {len(per_layer)} MoE layers but the model has {len(replays)} routers "
                         "(pipeline parallelism: pass this stage's layers only)")
    try:
        for replay, indices in zip(replays, per_layer):
            replay.set_target_indices(indices)
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        yield
    finally:
        for replay in replays:
            replay.clear_indices()
            replay.clear_router_replay_action()
