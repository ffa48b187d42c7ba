"""Collective save/load with a real 2-rank gloo process group on 127.0.0.1."""

from __future__ import annotations

import errno
import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ckpt_helpers import assert_same_training_state, fresh, resume_state, rng_draws, train
from relax_hpc.ckpt import CheckpointDiskFullError, CheckpointManager, UnsafeCheckpointError
from relax_hpc.ckpt import manager as manager_module

WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, root: str, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )
    try:
        mgr = CheckpointManager(Path(root), keep_last=2)
        trained = {}
        for step in (1, 2, 3):
            trained[step] = train(step, seed=step)  # replicated: same values on both ranks
            torch.manual_seed(1000 * step + rank)  # per-rank RNG streams must come back per rank
            mgr.save(step, trained[step].model, trained[step].optimizer, resume_state(step))
        draws_after_save = rng_draws()
        assert mgr.list_complete() == [2, 3], mgr.list_complete()

        rng_draws()
        dst = fresh()
        assert mgr.load_latest(dst.model, dst.optimizer) == resume_state(3)
        assert_same_training_state(trained[3], dst)
        assert rng_draws() == draws_after_save

        # Damage visible only to rank 1: both ranks must still agree on falling back.
        if rank == 1:
            (Path(root) / "step_3" / "rng_rank1.pt").unlink()
        dist.barrier()
        dst = fresh()
        assert mgr.load_latest(dst.model, dst.optimizer) == resume_state(2)
        assert_same_training_state(trained[2], dst)

        # A file others could change, seen by both ranks: both refuse, naming it.
        if rank == 1:
            (Path(root) / "step_2" / "rng_rank1.pt").chmod(0o666)
        dist.barrier()
        try:
            mgr.load_latest(fresh().model, fresh().optimizer)
            raise AssertionError("an unsafe checkpoint was loaded")
        except UnsafeCheckpointError as e:
            assert "step_2/rng_rank1.pt (mode 0666" in str(e), e
        dist.barrier()
        if rank == 1:
            (Path(root) / "step_2" / "rng_rank1.pt").chmod(0o600)

        # A full disk on rank 1 alone: both ranks report it, rank 0 removes tmp_step_4.
        if rank == 1:
            def full(*_args: object) -> None:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            manager_module._write_rng = full  # a spawned process of its own: no undo needed
        try:
            mgr.save(4, trained[3].model, trained[3].optimizer, resume_state(4))
            raise AssertionError("a save on a full disk succeeded")
        except CheckpointDiskFullError as e:
            assert "No space left on device" in str(e), e
        dist.barrier()
        assert not (Path(root) / "tmp_step_4").exists()
        assert mgr.list_complete() == [2, 3], mgr.list_complete()

        Path(out, f"rank{rank}.json").write_text(json.dumps({"ok": True, "draws": draws_after_save}))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_two_rank_gloo_save_and_load(tmp_path: Path) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    mp.spawn(_worker, args=(_free_port(), str(root), str(out)), nprocs=WORLD_SIZE, join=True)

    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    assert all(r["ok"] for r in results)
    assert results[0]["draws"] != results[1]["draws"]  # the ranks really had different RNG states
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2", "step_3"]
    step3 = root / "step_3"
    assert (step3 / "rng_rank0.pt").exists() and not (step3 / "rng_rank1.pt").exists()
    assert json.loads((step3 / "resume.json").read_text())["world_size"] == WORLD_SIZE
