"""PPO's value model: the policy's architecture with a scalar head, its AdamW step and its checkpoints.

`ValueModel` runs the decoder of a Hugging Face causal LM (the backbone; its LM head is never
evaluated) and maps each position's last hidden state to one number, ``V_t``. The head starts at
zero, so a fresh critic predicts 0 everywhere and learns from there; built from `[critic]
model_path` (or the policy's `[model] path`). `ValueTrainer` holds it with its own AdamW
(float32 master weights, like the policy's), computes the values of packed rows and trains them
on the clipped value loss (relax_hpc/algos/gae.py) with the whole step's token count as
denominator, so micro-batching does not change the gradient.

Checkpoints are the trainer's own, next to the actor's: ``<root>/step_N/critic.pt`` (model and
optimizer state), written as ``tmp_step_N`` and renamed, so a crash never leaves a half-written
step that looks complete; the newest `keep_last` are kept.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from relax_hpc.algos.aggregation import loss_denominator
from relax_hpc.algos.gae import value_loss
from relax_hpc.backends.batch import TrainBatch
from relax_hpc.models.hf import load_policy_model

CHECKPOINT_FILE = "critic.pt"


class ValueModel(torch.nn.Module):
    """A causal LM's backbone and a scalar head: ``values(input_ids, attention_mask) -> [B, L]``."""

    def __init__(self, model_path: str) -> None:
        super().__init__()
        lm = load_policy_model(model_path, dtype="float32", device="cpu")
        self.backbone = lm.base_model  # the decoder, without the LM head
        hidden = int(lm.config.get_text_config().hidden_size)
        self.value_head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.value_head(hidden).squeeze(-1)


@dataclass(frozen=True)
class ValueOptimConfig:
    lr: float
    grad_clip: float  # 0 disables clipping
    micro_batch_size: int
    clip_eps: float | None  # [algorithm] value_clip_eps
    loss_agg: str  # [algorithm] loss_agg


class ValueTrainer:
    """The critic's model and optimizer on one device."""

    def __init__(self, model_path: str, cfg: ValueOptimConfig, device: str = "cpu", seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.cfg = cfg
        self.device = torch.device(device)
        self.model = ValueModel(model_path).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, L-1]`` float32, in the shifted columns of `batch` (column t: the state before
        token t+1), so they line up with its `loss_mask`."""
        self.model.eval()
        out = []
        with torch.no_grad():
            for start in range(0, len(batch), self.cfg.micro_batch_size):
                micro = batch.slice(start, start + self.cfg.micro_batch_size).to(self.device)
                out.append(self.model(micro.input_ids, micro.attention_mask)[:, :-1].float().cpu())
        return torch.cat(out)

    def train(self, batch: TrainBatch, old_values: torch.Tensor, returns: torch.Tensor) -> dict[str, float]:
        """One optimizer step on the clipped value loss over the whole `batch`."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        denominator = max(loss_denominator(batch.loss_mask, self.cfg.loss_agg), 1.0)
        loss_sum, clipped, error_sum, tokens = 0.0, 0.0, 0.0, 0.0
        for start in range(0, len(batch), self.cfg.micro_batch_size):
            stop = start + self.cfg.micro_batch_size
            micro = batch.slice(start, stop).to(self.device)
            mask = micro.loss_mask
            pred = self.model(micro.input_ids, micro.attention_mask)[:, :-1]
            terms = value_loss(pred, old_values[start:stop].to(self.device), returns[start:stop].to(self.device),
                               mask, self.cfg.clip_eps, self.cfg.loss_agg, denominator)
            terms.loss.backward()
            count = float(mask.sum().item())
            loss_sum += float(terms.loss.item())
            clipped += terms.clip_frac * count
            error_sum += terms.value_error * count
            tokens += count
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.cfg.grad_clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip).item())
        else:
            norm = float(torch.norm(torch.stack([p.grad.detach().norm() for p in params])).item())
        self.optimizer.step()
        tokens = max(tokens, 1.0)
        return {"loss": loss_sum, "clip_frac": clipped / tokens, "value_error": error_sum / tokens, "grad_norm": norm}

    # -- checkpoints ---------------------------------------------------------------------------

    def save(self, root: Path, step: int, keep_last: int) -> Path:
        """``root/step_<step>/critic.pt`` via ``tmp_step_<step>``; the newest `keep_last` kept."""
        root.mkdir(parents=True, exist_ok=True)
        final, tmp = root / f"step_{step}", root / f"tmp_step_{step}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        torch.save({"step": step, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()},
                   tmp / CHECKPOINT_FILE)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in saved_steps(root)[:-keep_last]:
            shutil.rmtree(root / f"step_{old}", ignore_errors=True)
        return final

    def load(self, root: Path, step: int) -> None:
        """Restore the critic saved at `step`: the actor resumes from that step, so must the critic."""
        path = root / f"step_{step}" / CHECKPOINT_FILE
        if not path.is_file():
            have = ", ".join(str(s) for s in saved_steps(root)) or "none"
            raise FileNotFoundError(
                f"the run resumes from step {step} but the critic has no checkpoint of that step at {path} "
                f"(critic steps saved: {have}); resume from a job directory whose checkpoints the critic "
                "wrote too, or set [checkpoint] resume = false to start afresh")
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def saved_steps(root: Path) -> Sequence[int]:
    """The steps with a complete critic checkpoint under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit() and (p / CHECKPOINT_FILE).is_file()]
    return sorted(found)
