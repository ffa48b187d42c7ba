"""PPO's value model: the policy's architecture with a scalar head, its AdamW step and its checkpoints.

`ValueModel` runs the decoder of a Hugging Face causal LM (the backbone; its LM head is never
evaluated) and maps each position's last hidden state to one number, ``V_t``. The head starts at
zero, so a fresh critic predicts 0 everywhere and learns from there; built from `[critic]
model_path` (or the policy's `[model] path`). `ValueTrainer` holds it with its own AdamW
(float32 master weights, like the policy's), computes the values of packed rows and trains them
on the clipped value loss (relax_hpc/algos/gae.py) with the whole step's token count as
denominator, so micro-batching does not change the gradient.

Several critic ranks (a default process group of their own: roles/critic.py) hold the model as
the trainer's ranks hold the policy (`strategy`, backends/parallel.py): `ddp` a whole copy each,
the gradients summed with all-reduce; `fsdp2` sharded by `parallel.shard_model` (each decoder
layer of the backbone, then the root with the head), the gradients summed by FSDP2's
reduce-scatter. The loss is divided by the token count over every rank's rows, so the summed
gradient is the whole step's, as in one process. Sharded, every forward is a collective: ranks
with fewer micro-batches run empty passes until all are done. Every rank loads the whole model on
its device before `fsdp2` shards it (the policy's meta-device loading is not used here).

Checkpoints are the trainer's own, next to the actor's: ``<root>/step_N/critic/`` a torch DCP
checkpoint of model and optimizer (sharded as trained; DCP reshards on load), written by every
rank, and ``<root>/step_N/critic.json`` (the step, strategy and rank count) written by rank 0
once the tensors are down. The step is written as ``tmp_step_N`` and renamed, so a crash never
leaves a half-written step that looks complete; the newest `keep_last` are kept (`save_step`, which
the Megatron critic, backends/megatron_value.py, writes its checkpoints through too).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from relax_hpc.algos.aggregation import loss_denominator
from relax_hpc.algos.gae import value_loss
from relax_hpc.backends.batch import TrainBatch
from relax_hpc.backends.parallel import Strategy, in_lockstep, shard_model
from relax_hpc.models.hf import load_policy_model

CHECKPOINT_DIR = "critic"  # the DCP checkpoint in step_N/
CHECKPOINT_META = "critic.json"  # written last, by rank 0: the step is complete
T = TypeVar("T")


class ValueModel(torch.nn.Module):
    """A causal LM's backbone and a scalar head: ``values(input_ids, attention_mask) -> [B, L]``."""

    base_model_prefix = "backbone"  # where `parallel.fsdp_units` finds the decoder layers

    def __init__(self, model_path: str) -> None:
        super().__init__()
        lm = load_policy_model(model_path, dtype="float32", device="cpu")
        self.backbone = lm.base_model  # the decoder, without the LM head
        hidden = int(lm.config.get_text_config().hidden_size)
        self.value_head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1)


class ValueOptimSettings(Protocol):
    """What a value trainer reads of [critic] and [algorithm] (roles/critic.py: CriticConfig is one)."""

    @property
    def lr(self) -> float: ...  # [critic]

    @property
    def grad_clip(self) -> float: ...  # [critic]; 0 disables clipping

    @property
    def micro_batch_size(self) -> int: ...  # [critic]

    @property
    def value_clip_eps(self) -> float | None: ...  # [algorithm]

    @property
    def loss_agg(self) -> str: ...  # [algorithm]

    @property
    def strategy(self) -> Strategy: ...  # [critic] strategy, resolved


class ValueLossSums:
    """One step's clipped value loss, micro-batch by micro-batch: each backward, and the sums the
    step's statistics come from (over every rank's micro-batches: `stats`)."""

    def __init__(self, cfg: ValueOptimSettings, denominator: float) -> None:
        self.cfg, self.denominator = cfg, denominator
        self.sums = [0.0, 0.0, 0.0, 0.0]  # loss, clipped tokens, squared error, tokens

    def backward(self, pred: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                 mask: torch.Tensor) -> None:
        terms = value_loss(pred, old_values.to(pred.device), returns.to(pred.device), mask, self.cfg.value_clip_eps,
                           self.cfg.loss_agg, self.denominator)
        terms.loss.backward()
        count = float(mask.sum().item())
        for k, value in enumerate((float(terms.loss.item()), terms.clip_frac * count, terms.value_error * count,
                                   count)):
            self.sums[k] += value

    def stats(self, sum_over_ranks: Callable[[list[float]], list[float]], grad_norm: float) -> dict[str, float]:
        loss, clipped, error, tokens = sum_over_ranks(self.sums)
        tokens = max(tokens, 1.0)
        return {"loss": loss, "clip_frac": clipped / tokens, "value_error": error / tokens, "grad_norm": grad_norm}


class ValueTrainer:
    """The critic's model and optimizer on one rank (of the default process group, if any)."""

    def __init__(self, model_path: str, cfg: ValueOptimSettings, device: str = "cpu", seed: int = 0,
                 pad_id: int = 0) -> None:
        torch.manual_seed(seed)
        self.cfg = cfg
        self.device = torch.device(device)
        self.pad_id = pad_id
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # Each rank values and trains its own share of a step's rows and writes their advantages.
        self.data_rank, self.data_size, self.writes_rows = self.rank, self.world_size, True
        # As the policy's: one CPU process has nothing to shard; one CUDA rank in a group still wraps.
        self.sharded = cfg.strategy == "fsdp2" and (
            self.world_size > 1 or (self.device.type == "cuda" and dist.is_initialized()))
        model = ValueModel(model_path).to(self.device)
        self.model = shard_model(model, self.device) if self.sharded else model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)

    def values(self, batch: TrainBatch | None) -> torch.Tensor | None:
        """``[B, L-1]`` float32, in the shifted columns of `batch` (column t: the state before
        token t+1), so they line up with its `loss_mask`; None for a rank without rows (which
        still runs the empty passes a sharded model's collectives need)."""
        self.model.eval()
        out = []
        with torch.no_grad():
            for start in self._in_lockstep(range(0, 0 if batch is None else len(batch), self.cfg.micro_batch_size)):
                if start is None or batch is None:
                    self._empty_pass(backward=False)
                    continue
                micro = batch.slice(start, start + self.cfg.micro_batch_size).to(self.device)
                out.append(self.model(micro.input_ids, micro.attention_mask)[:, :-1].float().cpu())
        return torch.cat(out) if out else None

    def train(self, batch: TrainBatch | None, old_values: torch.Tensor | None,
              returns: torch.Tensor | None) -> dict[str, float]:
        """One optimizer step on the clipped value loss over every rank's `batch` (None: this rank
        has no rows this step and still takes part); the statistics are the whole step's."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        local = 0.0 if batch is None else loss_denominator(batch.loss_mask, self.cfg.loss_agg)
        (denominator,) = self._sum_over_ranks([local])
        sums = ValueLossSums(self.cfg, max(denominator, 1.0))  # no trained token: the loss is 0 whatever we divide by
        step = self.cfg.micro_batch_size
        for start in self._in_lockstep(range(0, 0 if batch is None else len(batch), step)):
            if start is None or batch is None or old_values is None or returns is None:
                self._empty_pass(backward=True)
                continue
            micro = batch.slice(start, start + step).to(self.device)
            pred = self.model(micro.input_ids, micro.attention_mask)[:, :-1]
            sums.backward(pred, old_values[start:start + step], returns[start:start + step], micro.loss_mask)
        self._all_reduce_grads()
        return sums.stats(self._sum_over_ranks, self._clip_and_step())

    # -- ranks ---------------------------------------------------------------------------------

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """`values` (float64, on CPU) summed over the critic's ranks."""
        if self.world_size == 1:
            return values
        wide = values.to(self.device, torch.float64)  # NCCL needs a GPU tensor
        dist.all_reduce(wide, op=dist.ReduceOp.SUM)
        return wide.cpu()

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        return self.sum_over_ranks(torch.tensor(values, dtype=torch.float64)).tolist()

    def _in_lockstep(self, items: Iterable[T]) -> Iterator[T | None]:
        """This rank's items, then None (an empty pass) until every rank is through its own:
        sharded, every forward and backward is a collective. Without sharding, only the items."""
        if not self.sharded:
            yield from items
            return
        yield from in_lockstep(items, self._sum_over_ranks)

    def _empty_pass(self, backward: bool) -> None:
        """A forward (and backward) of one pad token with a zero loss: a pass's collectives,
        adding nothing to any gradient."""
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
        with torch.set_grad_enabled(backward):
            out = self.model(ids, torch.ones_like(ids))
            if backward:
                (out.sum() * 0.0).backward()

    def _all_reduce_grads(self) -> None:
        """`ddp`: sum the gradients over ranks (the loss was divided by the global count);
        sharded, FSDP2 has summed them at each backward."""
        if self.world_size == 1 or self.sharded:
            return
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)

    def _clip_and_step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.cfg.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):  # over sharded (DTensor) gradients
            norm = norm.full_tensor()
        self.optimizer.step()
        return float(norm)

    def parameter_bytes(self) -> int:
        """The bytes of parameters this rank holds (its shards, sharded)."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        return sum(t.numel() * t.element_size() for t in local)

    # -- checkpoints ---------------------------------------------------------------------------

    def save(self, root: Path, step: int, keep_last: int) -> Path:
        """``root/step_<step>/`` via ``tmp_step_<step>``; the newest `keep_last` kept. Collective:
        every rank writes its part of the DCP checkpoint; rank 0 the metadata, the rename, the pruning."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from relax_hpc.ckpt.manager import single_process_quiet

        def write(directory: Path) -> None:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            with single_process_quiet():  # its end is collective: every rank's files are written by then
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory,
                         no_dist=self.world_size == 1)

        return save_step(root, step, keep_last, write, {"strategy": self.cfg.strategy})

    def load(self, root: Path, step: int) -> None:
        """Restore the critic saved at `step`: the actor resumes from that step, so must the critic.
        Collective; DCP reshards, so any rank count and strategy loads it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from relax_hpc.ckpt.manager import single_process_quiet

        directory = saved_step(root, step)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        holder = {"model": model_sd, "optim": optim_sd}
        with single_process_quiet():
            dcp.load(holder, checkpoint_id=directory, no_dist=self.world_size == 1)
        set_state_dict(self.model, self.optimizer, model_state_dict=holder["model"], optim_state_dict=holder["optim"])


def save_step(root: Path, step: int, keep_last: int, write: Callable[[Path], None], meta: dict[str, Any]) -> Path:
    """``root/step_<step>/`` via ``tmp_step_<step>``: every rank's `write` of the tensors into its
    ``critic/``, then rank 0's ``critic.json`` (the step, `meta`, the rank count), the rename and the
    pruning to the newest `keep_last`. Collective over the default group, if any."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    final, tmp = root / f"step_{step}", root / f"tmp_step_{step}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    if world > 1:
        dist.barrier()
    write(tmp / CHECKPOINT_DIR)
    if rank == 0:
        (tmp / CHECKPOINT_META).write_text(json.dumps({"step": step, **meta, "num_processes": world}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in saved_steps(root)[:-keep_last]:
            shutil.rmtree(root / f"step_{old}", ignore_errors=True)
    if world > 1:
        dist.barrier()
    return final


def saved_step(root: Path, step: int) -> Path:
    """The tensors' directory of the critic saved at `step`; FileNotFoundError saying what is there."""
    path = root / f"step_{step}"
    if not (path / CHECKPOINT_META).is_file():
        have = ", ".join(str(s) for s in saved_steps(root)) or "none"
        raise FileNotFoundError(
            f"the run resumes from step {step} but the critic has no checkpoint of that step at {path} "
            f"(critic steps saved: {have}); resume from a job directory whose checkpoints the critic "
            "wrote too, or set [checkpoint] resume = false to start afresh")
    return path / CHECKPOINT_DIR


def saved_steps(root: Path) -> Sequence[int]:
    """The steps with a complete critic checkpoint under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit() and (p / CHECKPOINT_META).is_file()]
    return sorted(found)
