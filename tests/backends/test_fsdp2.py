"""`strategy = "fsdp2"` on the tiny model over 2 gloo ranks (CPU).

One spawned pair of ranks trains the same unequal shards (8 and 4 samples, micro-batches of 4, so
rank 1 runs empty passes) for 3 steps with `ddp` and with `fsdp2`, saves both as DCP checkpoints
and loads the ddp checkpoint into a fresh fsdp2 trainer. The tests then check that:

* the two strategies give the same losses and parameters (1e-5), and fsdp2 really shards;
* the fsdp2 checkpoint (written by 2 ranks, sharded) loads into 1 process exactly: every
  parameter and every AdamW moment equals the gathered one, and the HF export holds them too;
* a ddp checkpoint loads into fsdp2 over 2 ranks exactly;
* a streamed step in which rank 1 receives no rows at all trains the same with both strategies.

The spawned ranks take several seconds: marked slow.
"""

from __future__ import annotations

import copy
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relax_hpc.backends.batch import pack_rows
from relax_hpc.backends.parallel import STRATEGIES, Strategy
from relax_hpc.backends.torch_backend import TorchBackend
from relax_hpc.ckpt import CheckpointManager, ResumeState
from relax_hpc.data.rows import sample_to_row
from relax_hpc.data.sample import Sample
from relax_hpc.models.tiny import vocab_size
from relax_hpc.spec.schema import AlgorithmSpec, TrainSpec

pytestmark = pytest.mark.slow

SHARDS = ((0, 8), (8, 12))  # unequal: 2 micro-batches of 4 on rank 0, 1 on rank 1
STEPS = 3
TOLERANCE = 1e-5
CLIP = 0.5  # below every step's gradient norm: clipping the sharded gradients is exercised


def _backend(model_dir: Path, strategy: Strategy) -> TorchBackend:
    optim = TrainSpec(steps=1, lr=1e-2, grad_clip=CLIP, micro_batch_size=4)
    loss = AlgorithmSpec(name="grpo", kl_coef=0.05, kl_estimator="k3")
    return TorchBackend(model_dir, optim, loss, strategy=strategy)


def _samples(step: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(100 + step)
    samples = []
    for i in range(SHARDS[-1][1]):
        prompt = torch.randint(3, vocab_size(), (1 + i % 4,), generator=gen).tolist()
        response = torch.randint(3, vocab_size(), (1 + (5 * i) % 7,), generator=gen).tolist()
        advantage = float(torch.randn(1, generator=gen))
        samples.append(Sample(prompt, response, [0.0] * len(response), 0, group_id=i // 4,
                              prompt_index=i // 4, advantage=advantage))
    return samples


def _full_optimizer_state(backend: TorchBackend) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(backend.model, backend.optimizer, options=options)


def _train(backend: TorchBackend, rank: int) -> dict[str, list[float]]:
    """The loss and gradient norm (before clipping) of each step."""
    start, stop = SHARDS[rank]
    stats = [backend.train(_samples(step)[start:stop]) for step in range(STEPS)]
    return {key: [s[key] for s in stats] for key in ("loss/total", "grad_norm")}


def _stream_without_rank1(backend: TorchBackend, rank: int) -> dict[str, float]:
    """One streamed step: rank 0 gets every row (micro-batches of 4), rank 1 none."""
    rows = [sample_to_row(s) for s in _samples(STEPS)] if rank == 0 else []
    parts = [rows[i : i + 4] for i in range(0, len(rows), 4)]
    return backend.train_stream(pack_rows(part, backend.pad_id) for part in parts)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_worker(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=len(SHARDS), timeout=timedelta(seconds=120))
    try:
        results: dict = {}
        for strategy in STRATEGIES:
            torch.manual_seed(0)
            backend = _backend(Path(model_dir), strategy)
            curves = _train(backend, rank)
            # Copies: unsharded, both are the live tensors, which the streamed step below changes.
            weights = {n: t.clone() for n, t in backend.named_weights()}  # collective under fsdp2
            optim = copy.deepcopy(_full_optimizer_state(backend))
            sharded = [type(p).__name__ for p in backend.model.parameters()]
            backend.save_checkpoint(CheckpointManager(Path(out) / strategy),
                                    ResumeState(step=STEPS, weight_version=STEPS, data_cursor={},
                                                samples_trained=12 * STEPS))
            stream = _stream_without_rank1(backend, rank)
            results[strategy] = {"curves": curves, "weights": weights, "optim": optim, "params": sharded,
                                 "stream": stream, "after_stream": dict(backend.named_weights())}
        # ddp -> fsdp2: the replicated checkpoint loads into sharded parameters.
        fresh = _backend(Path(model_dir), "fsdp2")
        state = fresh.load_checkpoint(CheckpointManager(Path(out) / "ddp"))
        results["ddp_into_fsdp2"] = {"step": state.step if state else None,
                                     "weights": dict(fresh.named_weights())}
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("fsdp2")
    mp.spawn(_rank_worker, args=(_free_port(), str(tiny_model_dir), str(out)), nprocs=len(SHARDS), join=True)
    return out, torch.load(out / "rank0.pt", weights_only=False)


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys() and len(want) > 0
    return max(float((got[n].float() - want[n].float()).abs().max()) for n in want)


@pytest.mark.timeout(300)
def test_fsdp2_trains_like_ddp(runs: tuple[Path, dict], tiny_model_dir: Path) -> None:
    _, results = runs
    ddp, fsdp2 = results["ddp"], results["fsdp2"]
    assert set(ddp["params"]) == {"Parameter"} and set(fsdp2["params"]) == {"DTensor"}
    for key in ("loss/total", "grad_norm"):
        assert fsdp2["curves"][key] == pytest.approx(ddp["curves"][key], abs=TOLERANCE), key
    assert min(ddp["curves"]["grad_norm"]) > CLIP
    assert _max_diff(fsdp2["weights"], ddp["weights"]) <= TOLERANCE
    # The gathered weights are the whole model with HF names, and training moved every one.
    initial = TorchBackend(tiny_model_dir, TrainSpec(steps=1), AlgorithmSpec())
    start = dict(initial.named_weights())
    assert fsdp2["weights"].keys() == start.keys()
    assert all(not torch.equal(fsdp2["weights"][n], start[n]) for n in start)


@pytest.mark.timeout(300)
def test_fsdp2_checkpoint_from_two_ranks_resumes_in_one_process_exactly(
    runs: tuple[Path, dict], tiny_model_dir: Path, tmp_path: Path
) -> None:
    out, results = runs
    saved = results["fsdp2"]
    backend = _backend(tiny_model_dir, "fsdp2")  # one process: nothing to shard
    state = backend.load_checkpoint(CheckpointManager(out / "fsdp2"))
    assert state is not None and state.step == STEPS
    restored = dict(backend.named_weights())
    assert restored.keys() == saved["weights"].keys()
    assert all(torch.equal(restored[n], saved["weights"][n]) for n in restored)
    moments = _full_optimizer_state(backend)["state"]
    assert moments.keys() == saved["optim"]["state"].keys()
    for name, slots in saved["optim"]["state"].items():
        for slot, value in slots.items():
            assert torch.equal(moments[name][slot], value), (name, slot)

    from relax_hpc.ckpt.export import export_hf
    from relax_hpc.models.hf import load_causal_lm

    exported = load_causal_lm(export_hf(out / "fsdp2" / f"step_{STEPS}", tiny_model_dir, tmp_path / "hf"))
    assert all(torch.equal(t, saved["weights"][n]) for n, t in exported.state_dict().items())


@pytest.mark.timeout(300)
def test_ddp_checkpoint_resumes_into_fsdp2_exactly(runs: tuple[Path, dict]) -> None:
    _, results = runs
    loaded, saved = results["ddp_into_fsdp2"], results["ddp"]["weights"]
    assert loaded["step"] == STEPS
    assert loaded["weights"].keys() == saved.keys()
    assert all(torch.equal(loaded["weights"][n], saved[n]) for n in saved)


@pytest.mark.timeout(300)
def test_a_rank_without_rows_takes_part_in_the_step(runs: tuple[Path, dict]) -> None:
    _, results = runs
    ddp, fsdp2 = results["ddp"]["stream"], results["fsdp2"]["stream"]
    assert ddp.keys() == fsdp2.keys() and "loss/total" in ddp
    assert all(fsdp2[k] == pytest.approx(ddp[k], abs=TOLERANCE) for k in ddp)
    assert _max_diff(results["fsdp2"]["after_stream"], results["ddp"]["after_stream"]) <= TOLERANCE
