"""The critic over 2 ranks (real processes, a real gloo group, the queue over ZMQ) against 1 rank.

One spawned pair of critic ranks takes two steps with `ddp`, then two with `fsdp2` (a second
worker in the same processes, the group already joined), on 5 rows with micro-batches of 2:
rank 0 values rows 0, 2, 4 in two micro-batches, rank 1 rows 1, 3 in one (under fsdp2 it runs an
empty pass). The test checks that:

* the advantages the ranks write, whitened with the moments summed over both, are the ones a
  single critic writes for the whole step (1e-6), in the second step too (after a trained step);
* the value-loss gradient of each step (gathered whole under fsdp2) and the step's statistics
  are the single critic's;
* the fsdp2 critic's checkpoint (DCP, written by both ranks, the metadata by rank 0) loads into a
  fresh 2-rank critic, which then values the rows exactly as the saved one did, with its AdamW
  moments back, and into 1 process (DCP reshards).

The spawned ranks take several seconds: marked slow.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp

from relax_hpc.auth import job_secret
from relax_hpc.backends.batch import pack_rows
from relax_hpc.roles import critic as critic_module
from relax_hpc.roles.rendezvous import rendezvous_address
from relax_hpc.roles.critic import CriticConfig, CriticWorker
from relax_hpc.spec.schema import AlgorithmSpec, CheckpointSpec, CriticSpec, JobInfoSpec
from relax_hpc.transfer.memory import InMemoryTransferQueue
from relax_hpc.transfer.queue import partition_name
from relax_hpc.transfer.zmq_client import TransferQueueClient
from relax_hpc.transfer.zmq_server import TransferQueueServer

pytestmark = pytest.mark.slow

STRATEGIES = ("ddp", "fsdp2")
STEPS = 2  # per strategy: partitions 0, 1 for ddp, 2, 3 for fsdp2
PROMPT = [5, 6, 7]
RESPONSES = [[8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18], [19], [20, 21, 22]]
MASKS = [[1, 1, 1, 1], [1, 0], [1, 1, 0, 1, 1], [1], [1, 1, 1]]
REWARDS = ([1.0, 0.0, 1.0, 0.0, 0.5], [0.0, 1.0, 1.0, 0.25, 0.0])  # by step of a strategy
TOLERANCE = 1e-6


def _rows(step: int) -> list[dict[str, Any]]:
    return [{"tokens": torch.tensor(PROMPT + r), "prompt_length": len(PROMPT),
             "loss_mask": torch.tensor(m, dtype=torch.int8), "rollout_log_probs": torch.zeros(len(m)),
             "rewards": REWARDS[step % STEPS][i]}
            for i, (r, m) in enumerate(zip(RESPONSES, MASKS))]


def _config(model_dir: str, out: Path, strategy: str) -> CriticConfig:
    return CriticConfig(model_dir=model_dir, checkpoint_dir=str(out / f"critic_{strategy}"),
                        checkpoint=CheckpointSpec(), job=JobInfoSpec(name="critic"),
                        table=CriticSpec(lr=1e-2, micro_batch_size=2, strategy=strategy),  # type: ignore[arg-type]
                        algo=AlgorithmSpec(gamma=0.9, lam=0.8), timeout_s=60)


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole (gathered from the shards under fsdp2: collective)."""
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return out


def _moments(worker: CriticWorker) -> list[torch.Tensor]:
    """This rank's AdamW moments (its shards under fsdp2)."""
    moments = [s["exp_avg"] for _, s in sorted(worker.trainer.optimizer.state_dict()["state"].items())]
    return [(t.to_local() if hasattr(t, "to_local") else t).clone() for t in moments]


def _rank(rank: int, master: str, model_dir: str, out: str, address: str) -> None:
    torch.set_num_threads(1)
    root, results = Path(out), {}
    worker: CriticWorker | None = None
    batch = pack_rows([{**row, "advantages": 0.0} for row in _rows(0)], 0)
    for k, strategy in enumerate(STRATEGIES):
        cfg = _config(model_dir, root, strategy)
        if worker is None:
            worker = CriticWorker(cfg, rank, 2, master)
        else:  # the same processes, the group already joined: the next critic uses it
            worker.shutdown()
            with mock.patch.object(critic_module, "join_rank_group", return_value="cpu"):
                worker = CriticWorker(cfg, rank, 2, master)
        steps = []
        for step in range(k * STEPS, (k + 1) * STEPS):
            stats = worker.train_step(address, step)
            steps.append({"stats": stats, "grads": _full_grads(worker.trainer.model)})
        results[strategy] = {"steps": steps, "sharded": worker.trainer.sharded}
        if strategy == "fsdp2":
            worker.save_checkpoint(STEPS)
            trained = worker.trainer.values(batch)
            with mock.patch.object(critic_module, "join_rank_group", return_value="cpu"):
                fresh = CriticWorker(cfg, rank, 2, master)
            fresh.load_checkpoint(STEPS)
            results["resumed"] = {"same_values": torch.equal(fresh.trainer.values(batch), trained),
                                  "was_fresh": bool(fresh.trainer.values(batch).abs().sum() > 0),
                                  "same_moments": all(torch.equal(a, b) for a, b in
                                                      zip(_moments(fresh), _moments(worker), strict=True)),
                                  "values": trained}
    assert worker is not None
    worker.shutdown()
    torch.save(results, root / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("critic_ranks")
    server = TransferQueueServer("tcp://127.0.0.1:0", secret=job_secret(), capacity=1000)
    address = server.start()
    queue = TransferQueueClient(address, secret=job_secret(), consumer_id="test")
    try:
        for step in range(len(STRATEGIES) * STEPS):
            queue.put(partition_name(step), _rows(step))
            queue.complete(partition_name(step), len(RESPONSES))
        mp.spawn(_rank, args=(rendezvous_address(), str(tiny_model_dir), str(out), address), nprocs=2, join=True)
        written = {}
        for step in range(len(STRATEGIES) * STEPS):
            got = queue.get(partition_name(step), "reader", ["advantages"], 100, timeout=10)
            written[step] = dict(zip(got.indices, (row["advantages"] for row in got.rows)))
    finally:
        queue.close()
        server.stop()
    return {"out": out, "written": written, **{f"rank{r}": torch.load(out / f"rank{r}.pt", weights_only=False)
                                               for r in range(2)}}


@pytest.fixture(scope="module")
def single(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One critic over the whole steps (the reference): its advantages, gradients and statistics."""
    queue = InMemoryTransferQueue()
    worker = CriticWorker(_config(str(tiny_model_dir), tmp_path_factory.mktemp("critic_single"), "ddp"))
    steps = []
    for step in range(STEPS):
        queue.put(partition_name(step), _rows(step))
        queue.complete(partition_name(step), len(RESPONSES))
        stats = worker.train_step(queue, step)
        got = queue.open_session("reader").get(partition_name(step), "reader", ["advantages"], 100, timeout=5)
        steps.append({"stats": stats, "grads": _full_grads(worker.trainer.model),
                      "advantages": dict(zip(got.indices, (row["advantages"] for row in got.rows)))})
    return {"steps": steps, "worker": worker}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_write_the_advantages_and_take_the_gradient_step_of_one(
        ranks: dict[str, Any], single: dict[str, Any], strategy: str) -> None:
    k = STRATEGIES.index(strategy)
    assert ranks["rank0"][strategy]["sharded"] == (strategy == "fsdp2")
    for step, want in enumerate(single["steps"]):
        written = ranks["written"][k * STEPS + step]
        assert sorted(written) == list(range(len(RESPONSES)))  # every row, each written by its rank
        for index, adv in want["advantages"].items():
            assert adv.shape == written[index].shape == (len(MASKS[index]),)
            assert torch.allclose(written[index], adv, atol=TOLERANCE), (step, index)
        for rank in (0, 1):
            got = ranks[f"rank{rank}"][strategy]["steps"][step]
            assert got["grads"].keys() == want["grads"].keys()
            for name, grad in want["grads"].items():
                assert torch.allclose(got["grads"][name], grad, atol=TOLERANCE, rtol=1e-5), (step, name)
            for key in ("rows", "reward_sum", "critic/loss", "critic/grad_norm", "critic/value_error",
                        "critic/values_mean", "critic/returns_mean", "critic/explained_variance"):
                assert got["stats"][key] == pytest.approx(want["stats"][key], abs=TOLERANCE, nan_ok=True), key
    # Non-trivial: the second step's gradient reaches the backbone (the head left zero after the first).
    assert any(float(g.abs().sum()) > 0 for n, g in single["steps"][1]["grads"].items() if n.startswith("backbone"))


def test_a_two_rank_fsdp2_critic_resumes_from_its_checkpoint(ranks: dict[str, Any], single: dict[str, Any]) -> None:
    for rank in (0, 1):
        resumed = ranks[f"rank{rank}"]["resumed"]
        assert resumed["same_values"] and resumed["was_fresh"] and resumed["same_moments"]
    step_dir = ranks["out"] / "critic_fsdp2" / f"step_{STEPS}"
    assert json.loads((step_dir / "critic.json").read_text()) == {"step": STEPS, "strategy": "fsdp2",
                                                                  "num_processes": 2}
    assert not (ranks["out"] / "critic_fsdp2" / f"tmp_step_{STEPS}").exists()
    # DCP reshards: the 2-rank checkpoint loads into one process too.
    one: CriticWorker = single["worker"]
    fresh = CriticWorker(_config(one.cfg.model_dir, ranks["out"], "fsdp2"))
    fresh.load_checkpoint(STEPS)
    batch = pack_rows([{**row, "advantages": 0.0} for row in _rows(0)], 0)
    assert torch.allclose(fresh.trainer.values(batch), ranks["rank0"]["resumed"]["values"], atol=TOLERANCE)
