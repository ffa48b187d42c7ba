"""The Megatron critic at TP=2 against the torch critic; run by the Megatron env's python.

    .venv-megatron/bin/python tests/backends/megatron_critic_check.py --model DIR --out DIR

Two spawned ranks joined by a gloo group run one `CriticWorker` with `[critic] backend =
"megatron"` and `[critic.megatron] tensor_parallel = 2` (one replica: both ranks take every row,
rank 0 writes the advantages). Its value head is set to the same non-zero weights as a torch
critic's (one process, here, after the ranks exit), and both take two steps on the same rows
(a queue each, in memory). Then the Megatron critic saves its checkpoint (dist_checkpointing,
both ranks), a fresh 2-rank critic loads it and values the rows again. The last stdout line is
JSON: the largest differences between the two critics (values before training, advantages and
statistics of each step, the head's gradient, values after training), and the round trip's.
tests/backends/test_megatron_critic.py judges them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any
from unittest import mock

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # this checkout's relax_hpc, not the one the environment was built from

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

PROMPT = [5, 6, 7]
RESPONSES = [[8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18], [19], [20, 21, 22]]
MASKS = [[1, 1, 1, 1], [1, 0], [1, 1, 0, 1, 1], [1], [1, 1, 1]]
REWARDS = ([1.0, 0.0, 1.0, 0.0, 0.5], [0.0, 1.0, 1.0, 0.25, 0.0])  # by step
STATS = ("rows", "reward_sum", "critic/loss", "critic/grad_norm", "critic/value_error", "critic/clip_frac",
         "critic/values_mean", "critic/returns_mean", "critic/explained_variance")
SAVED_STEP = len(REWARDS)


def rows(step: int) -> list[dict[str, Any]]:
    return [{"tokens": torch.tensor(PROMPT + r), "prompt_length": len(PROMPT),
             "loss_mask": torch.tensor(m, dtype=torch.int8), "rollout_log_probs": torch.zeros(len(m)),
             "rewards": REWARDS[step][i]} for i, (r, m) in enumerate(zip(RESPONSES, MASKS))]


def batch() -> Any:
    from relax_hpc.backends.batch import pack_rows

    return pack_rows([{**row, "advantages": 0.0} for row in rows(0)], 0)


def head_weights(hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A non-zero head (a fresh one is zero, and the first step's gradient would miss the decoder)."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, hidden, generator=g) * 0.05, torch.tensor([0.1])


def worker(args: argparse.Namespace, backend: str, rank: int = 0, world: int = 1) -> Any:
    from relax_hpc.roles import critic as critic_module
    from relax_hpc.spec.schema import AlgorithmSpec, CriticSpec, MegatronSpec

    cfg = critic_module.CriticConfig(
        model_path=args.model, checkpoint_dir=str(Path(args.out) / f"critic_{backend}"),
        table=CriticSpec(lr=1e-2, micro_batch_size=2, backend=backend,  # type: ignore[arg-type]
                         megatron=MegatronSpec(tensor_parallel=world)),
        algo=AlgorithmSpec(gamma=0.9, lam=0.8), timeout_s=60)
    with mock.patch.object(critic_module, "join_rank_group", return_value="cpu"):  # the group is joined
        return critic_module.CriticWorker(cfg, rank, world)


def set_head(head: torch.nn.Linear) -> None:
    weight, bias = head_weights(head.in_features)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)


def take_steps(critic: Any, head: torch.nn.Linear, grad: str) -> dict[str, Any]:
    """The critic's values of the rows, then two steps: each one's statistics, written advantages
    and the head's gradient (``grad``: the attribute that holds it), then the values again."""
    from relax_hpc.transfer.memory import InMemoryTransferQueue
    from relax_hpc.transfer.queue import partition_name

    out: dict[str, Any] = {"values": critic.trainer.values(batch()), "steps": []}
    queue = InMemoryTransferQueue()  # the worker keeps the queue it was first given
    for step in range(len(REWARDS)):
        queue.put(partition_name(step), rows(step))
        queue.complete(partition_name(step), len(RESPONSES))
        stats = critic.train_step(queue, step)
        advantages = None
        if critic.trainer.writes_rows:
            got = queue.open_session("reader").get(partition_name(step), "reader", ["advantages"], 100, timeout=5)
            advantages = dict(zip(got.indices, (row["advantages"] for row in got.rows)))
        out["steps"].append({"stats": stats, "advantages": advantages,
                             "head_grad": getattr(head.weight, grad).detach().clone()})
    out["trained"] = critic.trainer.values(batch())
    return out


def run_rank(rank: int, args: argparse.Namespace, port: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)  # as join_rank_group does
    import megatron_cpu_stubs

    megatron_cpu_stubs.install()
    critic = worker(args, "megatron", rank, 2)
    set_head(critic.trainer.head)
    result = take_steps(critic, critic.trainer.head, "main_grad")
    result["writes_rows"] = critic.trainer.writes_rows
    result["data"] = (critic.trainer.data_rank, critic.trainer.data_size)
    result["saved"] = critic.save_checkpoint(SAVED_STEP)
    fresh = worker(args, "megatron", rank, 2)
    before_load = fresh.trainer.values(batch())
    fresh.load_checkpoint(SAVED_STEP)
    state, saved = fresh.trainer.optimizer.optimizer.state, critic.trainer.optimizer.optimizer.state
    result["resumed"] = {
        "values_diff": (fresh.trainer.values(batch()) - result["trained"]).abs().max().item(),
        "fresh_diff": (before_load - result["trained"]).abs().max().item(),
        "moments_equal": all(torch.equal(state[a][k], saved[b][k])
                             for a, b in zip(fresh.trainer.optimizer.masters, critic.trainer.optimizer.masters)
                             for k in ("exp_avg", "exp_avg_sq")),
        "moments_nonzero": any(bool(saved[m]["exp_avg"].abs().max() > 0) for m in critic.trainer.optimizer.masters),
    }
    if rank == 0:
        torch.save(result, args.result_file)
        results.put(True)
    dist.barrier()
    dist.destroy_process_group()


def compare(megatron: dict[str, Any], torch_side: dict[str, Any]) -> dict[str, Any]:
    """The largest differences, on the rows' real positions (past a row's end the torch critic's
    attention mask and Megatron's causal one see different padding: nothing reads those values)."""
    from relax_hpc.backends.megatron_optim import clip_coefficient

    real = batch().attention_mask[:, 1:].bool()
    out: dict[str, Any] = {
        "values_diff": (megatron["values"] - torch_side["values"])[real].abs().max().item(),
        "values_max": torch_side["values"][real].abs().max().item(),
        "trained_diff": (megatron["trained"] - torch_side["trained"])[real].abs().max().item(),
        "trained_moved": (torch_side["trained"] - torch_side["values"])[real].abs().max().item(),
        "steps": [],
    }
    for ours, theirs in zip(megatron["steps"], torch_side["steps"], strict=True):
        # The torch critic clips its gradients in place; Megatron's main_grad is the unclipped sum.
        coefficient = clip_coefficient(ours["stats"]["critic/grad_norm"], 1.0)
        out["steps"].append({
            "stats": {k: [ours["stats"][k], theirs["stats"][k]] for k in STATS},
            "advantages_diff": max((ours["advantages"][i] - a).abs().max().item()
                                   for i, a in theirs["advantages"].items()),
            "advantage_rows": sorted(ours["advantages"]),
            "head_grad_diff": (ours["head_grad"] * coefficient - theirs["head_grad"]).abs().max().item(),
            "head_grad_max": theirs["head_grad"].abs().max().item(),
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.result_file = os.path.join(args.out, "megatron_critic.pt")
    from megatron_ranks import run_ranks

    run_ranks("megatron_critic_check", 2, run_rank, lambda rank, port, results: (rank, args, port, results))
    megatron = torch.load(args.result_file, weights_only=False)
    critic = worker(args, "torch")  # one process, no group: the reference
    set_head(critic.trainer.model.value_head)
    result = compare(megatron, take_steps(critic, critic.trainer.model.value_head, "grad"))
    saved = Path(megatron["saved"])
    result.update(resumed=megatron["resumed"], writes_rows=megatron["writes_rows"], data=megatron["data"],
                  meta=json.loads((saved.parent / f"step_{SAVED_STEP}" / "critic.json").read_text()),
                  listing=sorted(p.name for p in saved.parent.iterdir()),
                  files=sorted(p.name for p in (saved / "critic").iterdir()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
