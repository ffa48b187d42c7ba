"""Sharded loading under `strategy = "fsdp2"` over 2 gloo ranks (CPU): no rank but rank 0 ever
holds a whole model, and every parameter gets exactly what `from_pretrained` gives.

One spawned pair of ranks does every case:

* a fsdp2 `TorchBackend` of the tiny Qwen3 with a reference (kl_coef > 0) and an OPD teacher,
  built under `AllocatedBytes`, which counts the CPU storage the construction holds (what ops
  allocate and what modules register; on CPU the device and host are one memory, so this is
  every tensor the rank makes, its host copies included);
* the same backend with `ddp` (the existing, unsharded path), also measured;
* one training step on both (rank 1 has fewer micro-batches, so it runs empty passes of the
  policy, reference and teacher) and one streamed step in which rank 1 gets no rows;
* `load_sharded` of the tiny MoE (experts fused into 3-D tensors on load), Qwen3-VL and
  Qwen3-Omni (weights renamed, ``thinker.`` dropped) in bfloat16, recording where the
  parameters were when `shard_model` received the model.

The spawned ranks take several seconds: marked slow.
"""

from __future__ import annotations

import os
import socket
import threading
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from relax_hpc.backends.batch import pack_rows
from relax_hpc.backends.parallel import full_weights, shard_model
from relax_hpc.backends.sharded_load import load_sharded
from relax_hpc.backends.torch_backend import TorchBackend
from relax_hpc.data.rows import sample_to_row
from relax_hpc.data.sample import Sample
from relax_hpc.models.hf import load_policy_model
from relax_hpc.models.tiny import vocab_size, write_tiny_model
from relax_hpc.models.tiny_mm import write_tiny_multimodal
from relax_hpc.models.tiny_moe import write_tiny_moe_model
from relax_hpc.spec.schema import AlgorithmSpec, TrainSpec

pytestmark = pytest.mark.slow

WORLD = 2
SHARDS = ((0, 8), (8, 12))  # 2 micro-batches of 4 on rank 0, 1 on rank 1
FAMILIES = ("moe", "qwen3_vl", "qwen3_omni")
TOLERANCE = 1e-6


class AllocatedBytes(TorchDispatchMode):
    """The CPU storage bytes a rank holds while this mode is active: `live` now, `peak` at most
    at once. A storage counts from the op that first returns it (not a view of, or an in-place
    write to, an input), or from when a module registers it as a parameter or buffer (what
    `from_pretrained` loads comes from safetensors, outside the dispatcher), until it is freed.
    A DTensor counts its local shard."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._lock = threading.Lock()  # storages can be freed on a gloo thread
        self._tracked: set[int] = set()
        self._hooks: list[Any] = []

    def __enter__(self) -> AllocatedBytes:
        from torch.nn.modules.module import (
            register_module_buffer_registration_hook,
            register_module_parameter_registration_hook,
        )

        def registered(module: torch.nn.Module, name: str, tensor: torch.Tensor | None) -> None:
            for storage in _cpu_storages(tensor):
                self._track(storage)

        self._hooks = [register_module_parameter_registration_hook(registered),
                       register_module_buffer_registration_hook(registered)]
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {id(s) for s in _cpu_storages((args, kwargs))}
        for storage in _cpu_storages(out):
            if id(storage) not in inputs:
                self._track(storage)
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, size = id(storage), storage.nbytes()
        with self._lock:
            if key in self._tracked:
                return
            self._tracked.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key, size)

    def _freed(self, key: int, size: int) -> None:
        with self._lock:
            self._tracked.discard(key)
            self.live -= size


def _cpu_storages(tree: Any) -> list[torch.UntypedStorage]:
    out = []
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            local = getattr(leaf, "_local_tensor", leaf)  # a DTensor's shard
            if local.device.type == "cpu":
                out.append(local.untyped_storage())
    return out


def _param_bytes(model: torch.nn.Module) -> int:
    """This rank's bytes of `model`'s parameters (its shards, when sharded)."""
    return sum(getattr(p, "_local_tensor", p).nbytes for p in model.parameters())


def _samples(step: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(200 + step)
    samples = []
    for i in range(SHARDS[-1][1]):
        prompt = torch.randint(3, vocab_size(), (1 + i % 4,), generator=gen).tolist()
        response = torch.randint(3, vocab_size(), (1 + (5 * i) % 7,), generator=gen).tolist()
        samples.append(Sample(prompt, response, [0.0] * len(response), 0, group_id=i // 4,
                              prompt_index=i // 4, advantage=float(torch.randn(1, generator=gen))))
    return samples


def _text_backend(dirs: dict[str, str], strategy: str) -> tuple[TorchBackend, AllocatedBytes]:
    optim = TrainSpec(steps=1, lr=1e-2, micro_batch_size=4)
    loss = AlgorithmSpec(name="grpo", kl_coef=0.05, kl_estimator="k3")
    with AllocatedBytes() as allocated:
        backend = TorchBackend(dirs["text"], optim, loss, teacher_path=dirs["teacher"],
                               strategy=strategy)  # type: ignore[arg-type]
    return backend, allocated


def _steps(backend: TorchBackend, rank: int) -> dict[str, dict[str, float]]:
    """A step on unequal shards, then a streamed step in which rank 1 gets no rows."""
    start, stop = SHARDS[rank]
    batch = backend.train(_samples(0)[start:stop])
    rows = [sample_to_row(s) for s in _samples(1)] if rank == 0 else []
    stream = backend.train_stream(pack_rows(rows[i : i + 4], backend.pad_id) for i in range(0, len(rows), 4))
    return {"batch": batch, "stream": stream}


def _rank_worker(rank: int, port: int, dirs: dict[str, str], out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=120))
    try:
        results: dict[str, Any] = {}
        backend, allocated = _text_backend(dirs, "fsdp2")
        results["fsdp2"] = {
            "peak": allocated.peak, "live": allocated.live,
            "policy_bytes": _param_bytes(backend.model), "reference_bytes": _param_bytes(backend.reference),
            "teacher_bytes": _param_bytes(backend.teacher),
            "policy": dict(full_weights(backend.model)), "reference": dict(full_weights(backend.reference)),
            "teacher": dict(full_weights(backend.teacher)),
            "buffers": {n: b.clone() for n, b in backend.model.named_buffers()},
            "steps": _steps(backend, rank),
        }
        del backend
        backend, allocated = _text_backend(dirs, "ddp")
        results["ddp"] = {"peak": allocated.peak, "steps": _steps(backend, rank)}
        del backend
        for family in FAMILIES:
            devices: set[str] = set()

            def recording_shard(model: torch.nn.Module) -> None:
                devices.update(p.device.type for p in model.parameters())
                shard_model(model, torch.device("cpu"), torch.bfloat16)

            model = load_sharded(dirs[family], "bfloat16", torch.device("cpu"), recording_shard)
            results[family] = {"devices_at_shard": devices, "weights": dict(full_weights(model)),
                               "buffers": {n: b.clone() for n, b in model.named_buffers()},
                               "conversions": repr(model._weight_conversions)}
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sharded-models")
    dirs = {"text": tiny_model_dir, "teacher": write_tiny_model(root / "teacher", seed=1),
            "moe": write_tiny_moe_model(root / "moe", seed=0)}
    for arch in ("qwen3_vl", "qwen3_omni"):
        dirs[arch] = write_tiny_multimodal(root / arch, arch, seed=0)
    return dirs


@pytest.fixture(scope="module")
def ranks(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("sharded-load")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    dirs = {name: str(path) for name, path in model_dirs.items()}
    mp.spawn(_rank_worker, args=(port, dirs, str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def _model_bytes(path: Path) -> int:
    return sum(p.nbytes for p in load_policy_model(path).parameters())


@pytest.mark.timeout(300)
def test_policy_reference_and_teacher_hold_exactly_the_checkpoint(
    ranks: list[dict[str, Any]], model_dirs: dict[str, Path]
) -> None:
    fsdp2 = ranks[0]["fsdp2"]
    policy, teacher = load_policy_model(model_dirs["text"]), load_policy_model(model_dirs["teacher"])
    _assert_exact(fsdp2["policy"], policy.state_dict())
    _assert_exact(fsdp2["reference"], fsdp2["policy"])  # the reference starts as the policy
    _assert_exact(fsdp2["teacher"], teacher.state_dict())
    # Non-persistent buffers (rotary inv_freq) are left as garbage by to_empty: copied from rank 0.
    for rank in ranks:
        _assert_exact(rank["fsdp2"]["buffers"], dict(policy.named_buffers()))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", FAMILIES)
def test_converted_checkpoints_load_sharded_exactly(
    ranks: list[dict[str, Any]], model_dirs: dict[str, Path], family: str
) -> None:
    loaded = load_policy_model(model_dirs[family], dtype="bfloat16")
    _assert_exact(ranks[0][family]["weights"], loaded.state_dict())
    assert ranks[0][family]["conversions"] == repr(loaded._weight_conversions)
    assert (ranks[0][family]["conversions"] != "[]") == (family != "qwen3_vl")  # Qwen3-VL needs none
    for rank in ranks:
        assert rank[family]["devices_at_shard"] == {"meta"}  # nothing materialised before sharding
        _assert_exact(rank[family]["buffers"], dict(loaded.named_buffers()))


@pytest.mark.timeout(300)
def test_no_rank_materialises_a_whole_model(ranks: list[dict[str, Any]], model_dirs: dict[str, Path]) -> None:
    policy, teacher = _model_bytes(model_dirs["text"]), _model_bytes(model_dirs["teacher"])
    whole = 2 * policy + teacher  # policy, reference, teacher
    largest = max(p.nbytes for p in load_policy_model(model_dirs["text"]).parameters())
    for rank in ranks:
        got = rank["fsdp2"]
        # Each rank holds half of each model, the tied embedding counted once.
        assert got["policy_bytes"] == got["reference_bytes"] == pytest.approx(policy / WORLD, rel=0.02)
        assert got["teacher_bytes"] == pytest.approx(teacher / WORLD, rel=0.02)
    # Rank 1 never held more than its shards and the whole tensor in flight (two for a moment:
    # gloo's worker thread frees the last one as the next is allocated); unsharded (ddp), it holds
    # all three models whole.
    assert ranks[1]["fsdp2"]["peak"] <= whole / WORLD + 2 * largest + 0.05 * policy
    assert ranks[1]["ddp"]["peak"] >= whole
    # Rank 0 read each model whole into host memory, one at a time, and freed each copy (and the
    # full state dict broadcast from it) once its shards were filled.
    assert policy <= ranks[0]["fsdp2"]["peak"] <= whole / WORLD + policy + largest + 0.05 * policy
    assert ranks[0]["fsdp2"]["live"] <= whole / WORLD + 0.05 * policy


@pytest.mark.timeout(300)
def test_training_after_sharded_loading_matches_the_unsharded_path(ranks: list[dict[str, Any]]) -> None:
    fsdp2, ddp = ranks[0]["fsdp2"]["steps"], ranks[0]["ddp"]["steps"]
    for step in ("batch", "stream"):
        assert fsdp2[step].keys() == ddp[step].keys() and "loss/total" in ddp[step]
        for key, value in ddp[step].items():
            assert fsdp2[step][key] == pytest.approx(value, abs=TOLERANCE), (step, key)
    assert ddp["stream"]["loss/kl"] != 0.0  # the first step moved the policy off the reference
