"""Trainer ranks: each picks its own device, and with fsdp2 rank 0 holds the gathered weights.

`rank_device` is a pure function of the spec's device, the rank's position on its node, the
environment and Ray's GPU ids; `local_rank_on_node` counts lower ranks on the same host through
the group's store. The two-rank ActorWorker test spawns gloo processes (slow).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relax_hpc.backends.parallel import rank_device
from relax_hpc.roles.actor import ActorConfig, ActorWorker, local_rank_on_node
from relax_hpc.spec.schema import AlgorithmSpec, CheckpointSpec, JobInfoSpec, ModelSpec, RolloutSpec, TrainSpec


def test_cpu_and_explicit_devices_are_kept() -> None:
    assert rank_device("cpu", 3, env={"LOCAL_RANK": "1"}) == "cpu"
    assert rank_device("cuda:2", 0, env={"LOCAL_RANK": "1"}) == "cuda:2"


def test_local_rank_env_wins_over_the_position_on_the_node() -> None:
    assert rank_device("cuda", 0, env={"LOCAL_RANK": "3"}) == "cuda:3"


def test_ray_gpu_ids_are_located_among_the_visible_devices() -> None:
    # Ray's assignment wins: CUDA_VISIBLE_DEVICES then hides every other GPU, whatever LOCAL_RANK says.
    assert rank_device("cuda", 0, env={"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "5"}, ray_gpu_ids=[5]) == "cuda:0"
    # Ray restricts CUDA_VISIBLE_DEVICES to the GPUs it assigned: GPU 5 is this process's cuda:0.
    assert rank_device("cuda", 1, env={"CUDA_VISIBLE_DEVICES": "5"}, ray_gpu_ids=[5]) == "cuda:0"
    assert rank_device("cuda", 0, env={"CUDA_VISIBLE_DEVICES": "4,6"}, ray_gpu_ids=["6"]) == "cuda:1"
    # Ray told not to set CUDA_VISIBLE_DEVICES: the id is the index.
    assert rank_device("cuda", 0, env={}, ray_gpu_ids=[2]) == "cuda:2"


def test_without_hints_the_position_on_the_node_picks_the_gpu() -> None:
    # Two trainer ranks on one node, neither told which GPU: not both cuda:0.
    assert [rank_device("cuda", local, env={}) for local in (0, 1)] == ["cuda:0", "cuda:1"]
    assert rank_device("cuda", None, env={}) == "cuda:0"


def test_local_rank_counts_lower_ranks_on_the_same_host() -> None:
    store = dist.HashStore()
    here = socket.gethostname()
    store.set("relax_hpc/trainer_host/0", "another-node")
    store.set("relax_hpc/trainer_host/1", here)
    store.set("relax_hpc/trainer_host/2", here)
    assert local_rank_on_node(store, 3) == 2  # ranks 1 and 2 share this host, rank 0 does not
    assert local_rank_on_node(store, 0) == 0


# -- two fsdp2 trainer ranks -----------------------------------------------------------------------


def _free_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _rank(rank: int, master: str, model_dir: str, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cfg = ActorConfig(model=ModelSpec(path=model_dir), train=TrainSpec(steps=1, lr=1e-3, strategy="fsdp2"),
                      algorithm=AlgorithmSpec(), rollout=RolloutSpec(), checkpoint=CheckpointSpec(keep_last=1),
                      job=JobInfoSpec(name="fsdp2", seed=0), checkpoint_dir=str(Path(out) / "checkpoints"),
                      num_threads=1)
    worker = ActorWorker(cfg, rank, 2, master)
    try:
        result: dict = {"device": worker.device, "sharded": worker.backend.sharded}
        try:
            result["weights"] = worker.live_weights()
        except RuntimeError as e:
            result["error"] = str(e)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        worker.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_fsdp2_ranks_gather_the_weights_on_rank_0(tiny_model_dir: Path, tmp_path: Path) -> None:
    mp.spawn(_rank, args=(_free_address(), str(tiny_model_dir), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert rank0["device"] == rank1["device"] == "cpu"
    assert rank0["sharded"] and rank1["sharded"]
    from relax_hpc.models.hf import load_causal_lm

    want = load_causal_lm(tiny_model_dir).state_dict()
    got = dict(rank0["weights"])
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert "only rank 0 keeps them" in rank1["error"]
