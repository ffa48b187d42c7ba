"""The Critic role on the tiny model: GAE advantages written onto queued rows, one value-loss step
that moves the critic toward the returns, its checkpoint, and the trainer's packing of the result."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from relax_hpc.algos.gae import gae_step
from relax_hpc.backends.batch import pack_rows
from relax_hpc.roles.critic import CriticConfig, CriticWorker
from relax_hpc.spec.schema import AlgorithmSpec, CheckpointSpec, CriticSpec, JobInfoSpec
from relax_hpc.transfer.memory import InMemoryTransferQueue
from relax_hpc.transfer.queue import partition_name

# Three responses after 3-token prompts: lengths 4, 2 and 3; the second's last token is masked
# (an observation), so its terminal reward sits on its first token.
TOKENS = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 12, 13], [5, 6, 7, 14, 15, 16]]
MASKS = [[1, 1, 1, 1], [1, 0], [1, 1, 1]]
REWARDS = [1.0, 0.0, 1.0]


def _rows() -> list[dict]:
    return [{"tokens": torch.tensor(t), "prompt_length": 3, "loss_mask": torch.tensor(m, dtype=torch.int8),
             "rollout_log_probs": torch.zeros(len(m)), "rewards": r}
            for t, m, r in zip(TOKENS, MASKS, REWARDS)]


def _put_step(queue: InMemoryTransferQueue, step: int) -> None:
    queue.put(partition_name(step), _rows())
    queue.complete(partition_name(step), len(TOKENS))


def _config(model: Path, tmp: Path, strategy: str | None = None) -> CriticConfig:
    return CriticConfig(model_dir=str(model), checkpoint_dir=str(tmp / "critic"),
                        checkpoint=CheckpointSpec(), job=JobInfoSpec(name="critic"),
                        table=CriticSpec(lr=1e-2, micro_batch_size=2, strategy=strategy),  # type: ignore[arg-type]
                        algo=AlgorithmSpec(gamma=0.9, lam=0.8), timeout_s=30)


def _critic(model: Path, tmp: Path) -> CriticWorker:
    return CriticWorker(_config(model, tmp))


def test_writes_whitened_token_advantages_and_learns_the_returns(tiny_model_dir: Path, tmp_path: Path) -> None:
    queue = InMemoryTransferQueue()
    _put_step(queue, 0)
    critic = _critic(tiny_model_dir, tmp_path)
    head = [p.detach().clone() for p in critic.trainer.model.value_head.parameters()]
    stats = critic.train_step(queue, 0)
    batch = queue.open_session("trainer").get(partition_name(0), "actor", ["advantages", "loss_mask"], 10, timeout=5)
    advantages = [row["advantages"] for row in batch.rows]
    assert [a.shape[0] for a in advantages] == [4, 2, 3]  # one per response token
    # A fresh critic predicts 0 everywhere, so GAE sees V = 0: these are the advantages of gae_step.
    mask = torch.zeros(3, 4)
    for i, m in enumerate(MASKS):
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    want, returns = gae_step(torch.tensor(REWARDS), torch.zeros(3, 4), mask, 0.9, 0.8)
    for i, m in enumerate(MASKS):
        assert advantages[i].tolist() == pytest.approx(want[i, : len(m)].tolist(), abs=1e-5)
    trained = torch.cat([a[torch.tensor(m, dtype=torch.bool)] for a, m in zip(advantages, MASKS)])
    assert abs(float(trained.mean())) < 1e-5  # whitened over the trained tokens
    assert stats["rows"] == 3.0 and stats["reward_sum"] == 2.0
    assert stats["critic/values_mean"] == 0.0 and stats["critic/loss"] > 0
    assert stats["critic/returns_mean"] == pytest.approx(float(returns[mask.bool()].mean()), abs=1e-6)
    # The value loss step moved the zero head; the next value error on the same rows is smaller.
    assert all(not torch.equal(a, b.detach()) for a, b in zip(head, critic.trainer.model.value_head.parameters()))
    _put_step(queue, 1)
    assert critic.train_step(queue, 1)["critic/value_error"] < stats["critic/value_error"]


def test_checkpoint_round_trip_and_a_missing_step_says_what_to_do(tiny_model_dir: Path, tmp_path: Path) -> None:
    queue = InMemoryTransferQueue()
    _put_step(queue, 0)
    critic = _critic(tiny_model_dir, tmp_path)
    critic.train_step(queue, 0)
    critic.save_checkpoint(1)
    batch = pack_rows([{**r, "advantages": 0.0} for r in _rows()], 0)
    trained = critic.trainer.values(batch)
    fresh = _critic(tiny_model_dir, tmp_path)
    assert not torch.equal(fresh.trainer.values(batch), trained)
    fresh.load_checkpoint(1)
    assert torch.equal(fresh.trainer.values(batch), trained)
    assert fresh.trainer.optimizer.state_dict()["state"]  # AdamW's moments came back too
    assert not (tmp_path / "critic" / "tmp_step_1").exists()
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of that step .*critic steps saved: 1\)"):
        fresh.load_checkpoint(2)


def test_pack_rows_takes_one_advantage_per_response_token() -> None:
    rows = [{**r, "advantages": torch.arange(len(m), dtype=torch.float32) + 1} for r, m in zip(_rows(), MASKS)]
    batch = pack_rows(rows, 0)
    # response tokens sit at columns P-1 = 2 .. of the shifted [B, L-1] layout
    assert batch.advantages.shape == batch.loss_mask.shape == (3, 6)
    assert batch.advantages[0].tolist() == [0, 0, 1, 2, 3, 4]
    assert batch.advantages[1].tolist() == [0, 0, 1, 2, 0, 0]
    assert pack_rows([{**r, "advantages": 0.5} for r in _rows()], 0).advantages.tolist() == [0.5, 0.5, 0.5]
