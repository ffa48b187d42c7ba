"""One pass of Megatron's forward-backward schedule over a list of micro-batches.

``run_schedule`` drives ``megatron.core.pipeline_parallel.get_forward_backward_func()``: no
pipelining at PP=1, 1F1B at PP>1, where every stage runs the same micro-batches and only the last
stage computes a loss. The loss is computed on the vocab-parallel logits: each tensor-parallel rank
holds ``[B, L, V / tp]`` and ``vocab_parallel_logprobs_and_entropy`` gives every rank the same
per-token log-probs and entropies with two small all-reduces; the full vocabulary is never
gathered.

A micro-batch's loss (``LossFn``) is already its share of the step's loss (divided by the step's
global count), so the schedule must not rescale it: the loss function returns Megatron's
three-tuple ``(loss, num_tokens, extra)`` and the model config has ``calculate_per_token_loss``
(``megatron_model``), under which the schedule leaves the loss as it is.

Routing replay (R3) hook: a ``MicroBatch`` with ``routed_experts`` ``[B, L, layers, top_k]``
(``megatron_replay.pack_routes``) runs its forward inside ``megatron_replay.replayed_routing``, so
the model's MoE routers take the engine's experts (the model needs
``moe_enable_routing_replay``: ``make_provider(routing_replay=True)``). Only the forward is
replayed there; with activation recomputation the backward re-routes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from relax_hpc.algos import vocab_parallel_logprobs_and_entropy
from relax_hpc.backends import megatron_cpu
from relax_hpc.backends.batch import TrainBatch


@dataclass
class MicroBatch:
    """One micro-batch of the schedule: its rows, and what the loss needs beside them."""

    batch: TrainBatch
    teacher_log_probs: torch.Tensor | None = None  # [B, L-1], on-policy distillation
    trained: bool = True  # False: a pass without rows, for the collectives only
    routed_experts: torch.Tensor | None = None  # [B, L, layers, top_k]: R3, replayed when given


# (micro-batch, log-probs [B, L-1], entropy [B, L-1]) -> (scalar loss to back-propagate, extra)
LossFn = Callable[[MicroBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


def forward_logits(model: Any, batch: TrainBatch, routed_experts: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's output: vocab-parallel logits ``[B, L, V / tp]`` on the last pipeline stage,
    the hidden states to send on the others. Right padding needs only the causal mask."""
    ids = batch.input_ids
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    mask = megatron_cpu.causal_mask(ids.shape[1]).to(ids.device)
    if routed_experts is None:
        return model(input_ids=ids, position_ids=positions, attention_mask=mask)
    from megatron.core import parallel_state

    from relax_hpc.backends.megatron_replay import replayed_routing

    config = model.config
    with replayed_routing(model, routed_experts, parallel_state.get_tensor_model_parallel_rank(),
                          parallel_state.get_tensor_model_parallel_world_size(),
                          bool(config.sequence_parallel)):
        return model(input_ids=ids, position_ids=positions, attention_mask=mask)


def _last_stage_loss(loss_fn: LossFn, micro: MicroBatch, temperature: float,
                     local_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    rank = parallel_state.get_tensor_model_parallel_rank()
    logits = local_logits[:, :-1]
    logp, entropy = vocab_parallel_logprobs_and_entropy(
        logits, micro.batch.targets, temperature, group=group, vocab_start=rank * logits.shape[-1])
    loss, extra = loss_fn(micro, logp, entropy)
    return loss, torch.ones((), dtype=torch.int), extra


def run_schedule(model: Any, micro_batches: list[MicroBatch], loss_fn: LossFn, *, temperature: float,
                 forward_only: bool) -> list[dict[str, Any]]:
    """Run the schedule over ``micro_batches`` (on this rank's device); returns each micro-batch's
    ``extra`` on the last pipeline stage, nothing on the others. Without ``forward_only`` the
    gradients are back-propagated and reduced over data-parallel ranks (``finalize_model_grads``).

    Under pipeline parallelism every micro-batch must have the same shape (the stages exchange
    activations of one fixed shape): see ``megatron_data.split_micro_batches(uniform=True)``."""
    if not micro_batches:
        raise ValueError("run_schedule needs at least one micro-batch")
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data: Iterator[MicroBatch], stage: Any) -> tuple[torch.Tensor, Any]:
        micro = next(data)
        output = forward_logits(stage, micro.batch, micro.routed_experts)
        return output, partial(_last_stage_loss, loss_fn, micro, temperature)

    rows, length = micro_batches[0].batch.input_ids.shape
    context = torch.no_grad() if forward_only else contextlib.nullcontext()
    with context:
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=model,
            num_microbatches=len(micro_batches), seq_length=length, micro_batch_size=rows,
            forward_only=forward_only,
        )
